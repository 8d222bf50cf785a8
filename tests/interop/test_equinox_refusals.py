"""What ``EquinoxModel`` cannot run explicitly is refused by name, with the fix; and mutants of
the adapter, each caught by the Equinox checks (tests/_equinox_checks.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from _equinox_checks import (
    CONFIG,
    MLP_ROLES,
    ROLES,
    STRATEGIES,
    Gpt,
    Mlp,
    check_trains_like_equinox,
    equinox_gpt,
    equinox_model,
)
from _model_checks import mesh_for
from _mutants import copies

import shardops_models as models
from shardops_models.interop.equinox import EquinoxModel


class Conv(eqx.Module):
    conv: eqx.nn.Conv1d
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv, self.out = eqx.nn.Conv1d(3, 4, 3, key=k1), eqx.nn.Linear(4, 2, key=k2)

    def __call__(self, x):
        return self.out(self.conv(x).mean(-1))


class OwnMatmul(eqx.Module):
    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (2, 4))

    def __call__(self, x):
        return self.w @ x


class Bf16(eqx.Module):
    out: eqx.nn.Linear

    def __init__(self, key):
        self.out = eqx.nn.Linear(4, 2, dtype=jnp.bfloat16, key=key)

    def __call__(self, x):
        return self.out(x)


class ReadsTheTable(Mlp):
    def __call__(self, x):
        return self.down.weight @ jax.nn.relu(self.up(self.norm(x)))


class LogSoftmaxGpt(equinox_gpt.Gpt):
    def __call__(self, ids):  # under tp each device would normalise over its vocabulary shard
        return jax.nn.log_softmax(super().__call__(ids))


class Stacked(eqx.Module):
    layers: eqx.nn.Linear

    def __init__(self, key):
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(
            jax.random.split(key, 3)
        )

    def __call__(self, x):
        return jax.lax.scan(lambda h, w: (w @ h, None), x, self.layers.weight)[0]


class BatchedCall(eqx.Module):
    out: eqx.nn.Linear

    def __init__(self, key):
        self.out = eqx.nn.Linear(4, 2, key=key)

    def __call__(self, x):
        return self.out(x[None]).mean(0)  # a Linear on x[1, 4]: Equinox's own would fail


def test_construction_refuses_what_the_adapter_cannot_honour():
    """Each at ``EquinoxModel(...)``, before any strategy: code after the head (a
    log-softmax over the vocabulary, split under tp), layers stacked by ``eqx.filter_vmap``, a
    head named that is not a Linear."""
    with pytest.raises(ValueError, match=r"the module's output is not head's \(the layer making "
                                         r"the logits\); return the head's logits unchanged"):  # fmt: skip
        EquinoxModel(lambda key: LogSoftmaxGpt(CONFIG, key), roles=ROLES, num_heads=4)
    with pytest.raises(ValueError, match=r"layers: Linear with weight of shape \(3, 4, 4\): "
                                         r"layers stacked by eqx\.filter_vmap"):  # fmt: skip
        _classifier(Stacked)
    with pytest.raises(ValueError, match=r"head='norm' is not an eqx\.nn\.Linear of the module"):
        EquinoxModel(Gpt, roles=ROLES, num_heads=4, head="norm")
    named = EquinoxModel(Gpt, roles=ROLES, num_heads=4, head="head")
    assert named.vocab_size == CONFIG.vocab_size


def _classifier(make, roles=(), shape=(4,)):
    return EquinoxModel(make, roles=roles, task="classify", example_shape=shape)


@pytest.mark.parametrize(
    ("model", "strategy", "match"),
    [
        (lambda: _classifier(Conv, shape=(3, 8)), "dp",
         r"parameter conv\.weight belongs to Conv1d at conv, which shardops cannot run"),
        (lambda: _classifier(OwnMatmul), "dp", r"parameter w belongs to OwnMatmul at the module"),
        (lambda: _classifier(Bf16), "dp",
         r"out\.weight is bfloat16, but the precision policy keeps parameters in float32"),
        (lambda: _classifier(Mlp, {"up": "column", "mlp.down": "row"}, (24,)), "dp",
         r"the roles pattern 'mlp\.down' matches no layer not matched by an earlier pattern "
         r".*; the layers are norm, up, down"),
        (lambda: _classifier(Mlp, {"norm": "column"}, (24,)), "dp",
         r"roles give norm \(LayerNorm\) the role 'column'.* takes one of \['replicated'\]"),

        (lambda: equinox_model("gpt"), "dp_sp",
         r"EquinoxModel 'equinox gpt' under 'dp_sp': sp splits the activations along the "
         r"sequence, which the module's own vmaps hide"),
        (lambda: EquinoxModel(Gpt, roles={**ROLES, "blocks.*.attn.output_proj": "replicated"},
                              num_heads=4), "2d",
         r"blocks\.0\.attn: MultiheadAttention under tp over 'model' \(size 2\) with roles "
         r"\{'query': 'column', 'key': 'column', 'value': 'column', 'output': 'replicated'\}"),
        (lambda: _classifier(BatchedCall), "dp",
         r"out: called on x\(1, 4\); an Equinox layer takes one example \(one token\)"),
        (lambda: equinox_model("gpt"), "tp8",
         r"num_heads=4 is not divisible by the tp axis 'model' \(size 8\)"),
    ],
    ids=["conv", "own-matmul", "dtype", "roles-typo", "role-not-taken", "sp", "mha-roles",
         "batched-call", "heads"],
)  # fmt: skip
def test_what_shardops_cannot_run_explicitly_is_refused_by_name(model, strategy, match):
    meshes = {**STRATEGIES, "dp_sp": {"data": 4, "model": 2}, "tp8": {"data": 1, "model": 8}}
    with pytest.raises(ValueError, match=match):
        setup = models.build(strategy.removesuffix("8"), mesh_for(meshes[strategy]),
                             model=model(), optimizer=optax.sgd(0.1))  # fmt: skip
        setup.collective_budget(8, 16)  # traces the step: the layers meet the strategy here


def test_a_module_reading_a_swapped_layers_weight_is_refused_by_name():
    """A tied head written ``self.embed.weight @ x``: the weight is the strategy's."""
    setup = models.build("2d", mesh_for(STRATEGIES["2d"]),
                         model=_classifier(ReadsTheTable, MLP_ROLES, (24,)),
                         optimizer=optax.sgd(0.1))  # fmt: skip
    with pytest.raises(AttributeError, match=r"down\.weight: the module's code reads an "
                                             r"attribute of a layer EquinoxModel runs"):  # fmt: skip
        setup.collective_budget(8, 16)


def _mutant(line: str, replacement: str):
    return copies("shardops_models.interop", ("_foreign", "equinox"), "equinox", line,
                  replacement)["equinox"]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "replacement", "name"),
    [
        # The attention keeps the model's head count under tp: each device's projections
        # (H/p heads) reshaped into H heads of hd/p, silently.
        ('        object.__setattr__(local, "num_heads", attention.num_heads // p)  # a static field',
         "        pass", "gpt"),
        # A Linear's bias dropped on the way to ctx.dense.
        ('''    if "bias" in p:
        flat["b"]''', '''    if False:
        flat["b"]''', "mlp"),
        # RMSNorm's bias left out (Equinox's RMSNorm has one, which ctx.rms_norm does not).
        ('            return y + ctx.array(q["bias"]) if "bias" in q else y',
         "            return y", "gpt"),
    ],
    ids=["heads-not-local", "bias-dropped", "rms-bias-dropped"],
)  # fmt: skip
def test_a_mutant_of_the_adapter_is_caught(line, replacement, name):
    module = _mutant(line, replacement)
    with pytest.raises(AssertionError):
        check_trains_like_equinox(equinox_model(name, module), name, "2d", "sgd")


def test_the_unmutated_adapter_copy_passes():
    module = _mutant("        self.eps = getattr(layer, \"eps\", None)",
                     "        self.eps = getattr(layer, \"eps\", None)")  # fmt: skip
    check_trains_like_equinox(equinox_model("gpt", module), "gpt", "2d", "sgd")
