"""Activation-checkpoint policies (``models.Remat``, ``models.strategies.remat``): every policy
trains the GPT and the Llama as the reference does under ``ref``, ``fsdp_tp``, ``2d`` and a
context-parallel layout; each holds less memory than ``"none"`` in the compiled step
(``Setup.temp_bytes``, XLA:CPU's ``memory_analysis``), ``"full"`` ≤ ``"matmuls"`` ≤ ``"none"``;
under fsdp every policy but ``"none"`` gathers the weights again in the backward pass; bad
policies and names no layer makes are refused."""

import functools

import jax
import optax
import pytest
from _cover import cover
from _gpt_checks import BATCH, GPT, SEQ, check_lm_trajectory
from _messages import refused
from _model_checks import check_trajectory, mesh_for
from _mutants import mutant
from test_llama import GQA
from test_strategies import SIZES

import shardops_models as models
from shardops_models.strategies import remat as remat_module
from shardops_models.strategies.remat import NAMES, Remat, names_made

SAVED = ("attention_output", "mlp_hidden")
POLICIES = ["full", "matmuls", SAVED, "offload"]
LAYOUTS = [(GPT, "ref", None), (GQA, "fsdp_tp", "4x2"), (GPT, "2d", "4x2"),
           (GQA, "2d+ring", "2x2x2c"), (GPT, "sp", "2x4")]  # fmt: skip
# Each layout and each policy once (every pair under SHARDOPS_FULL=1): the policy is one
# jax.checkpoint around ctx.unit, the same code under every strategy; what differs is what
# the unit recomputes (fsdp's gathers, tp's AllReduces, the context ring).
CASES = cover(LAYOUTS, POLICIES, t=1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][1]}-{Remat.of(c[1])}")
def test_every_policy_trains_as_the_reference(case):
    (model, strategy, mesh), remat = case
    check_lm_trajectory(model, strategy, mesh, "sgd", remat=remat)


@pytest.mark.parametrize(("strategy", "mesh_shape", "remat"), [
    ("zero1", {"data": 8}, "full"),
    ("hsdp_tp", {"replica": 2, "data": 2, "model": 2}, "matmuls"),
    ("zero1_tp", {"data": 4, "model": 2}, "offload"),
], ids=str)  # fmt: skip
def test_the_mlp_trains_as_the_reference_under_the_other_layouts(strategy, mesh_shape, remat):
    """ZeRO-1 (parameters entering the unit already varying) and HSDP under a policy."""
    check_trajectory(strategy, mesh_shape, "sgd", sizes=SIZES, batch=32, remat=remat)


def test_the_cases_cover_every_layout_and_policy():
    assert {c[0][1] for c in CASES} == {"ref", "fsdp_tp", "2d", "2d+ring", "sp"}
    assert {Remat.of(c[1]) for c in CASES} == {Remat.of(p) for p in POLICIES}


# Memory: a Llama of 3 blocks where the activations dominate (S = 64, d_ff = 4·D), unsharded.
DEEP = models.Llama(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                    d_ff=128, context=64)  # fmt: skip
DEEP_BATCH = 8


@functools.cache
def temp(remat) -> int:
    setup = models.build("ref", optimizer=optax.sgd(0.1), model=DEEP, remat=remat)
    return setup.temp_bytes(DEEP_BATCH)


def check_memory(matmuls=None) -> None:
    """Each policy holds less than ``"none"``; ``"full"`` ≤ ``"matmuls"`` ≤ ``"none"``; and
    ``"matmuls"`` holds less than a checkpoint that keeps everything saveable (the norms', the
    activations' and attention's values too), which XLA:CPU may hold at or below ``"none"``."""
    matmuls = "matmuls" if matmuls is None else matmuls
    none, full, kept = temp("none"), temp("full"), temp(matmuls)
    named, everything = temp(SAVED), temp(jax.checkpoint_policies.everything_saveable)
    assert max(full, kept, named) < none, (none, full, kept, named)
    assert full <= kept <= none, (full, kept, none)
    assert kept < everything, f"matmuls holds {kept} B, a policy keeping everything {everything}"


def test_each_policy_holds_less_than_none():
    check_memory()


def test_offload_on_cpu_holds_what_matmuls_holds():
    """XLA:CPU's "pinned_host" is the same memory as its device's: the documented fallback."""
    assert temp("offload") == temp("matmuls")


MATMULS_LINE = "            return policies.dots_with_no_batch_dims_saveable\n"


def test_a_policy_saving_everything_is_caught():
    kept_all = mutant(remat_module, "saves_everything", MATMULS_LINE,
                      "            return policies.everything_saveable\n")  # fmt: skip
    policy = kept_all.Remat("matmuls").jax_policy()
    with pytest.raises(AssertionError):
        check_memory(policy)


def test_an_unmutated_copy_passes():
    same = mutant(remat_module, "unmutated", MATMULS_LINE, MATMULS_LINE)
    check_memory(same.Remat("matmuls").jax_policy())


@pytest.mark.parametrize("remat", ["none", "full", "matmuls", SAVED, "offload"], ids=str)
def test_fsdp_regathers_under_every_policy_but_none(remat):
    """A gather's output is no dot and no named activation: no policy keeps it."""
    setup = models.build("fsdp", mesh_for({"data": 8}), optimizer=optax.sgd(0.1), model=GPT,
                         remat=remat)  # fmt: skip
    backward = setup.budget(BATCH, SEQ).totals(pass_="backward")
    regathered = backward.get(("all-gather", ("data",)), 0)
    assert (regathered > 0) == (remat != "none"), (remat, regathered)


def test_the_layers_make_every_name():
    """Both models name each activation of ``NAMES`` (the gated MLP's hidden in shardops)."""
    for model in (GPT, GQA):
        setup = models.build("ref", optimizer=optax.sgd(0.1), model=model, remat=NAMES)
        assert names_made(setup.step_jaxpr(2, SEQ)) == set(NAMES), model.name


def test_remat_values_read_as_policies():
    assert Remat.of(False) == Remat.of(None) == Remat("none") and not Remat.of(False)
    assert Remat.of(True) == Remat("full") and Remat.of(True)
    assert Remat.of(["mlp_hidden"]) == Remat("save", ("mlp_hidden",))
    assert Remat.of(jax.checkpoint_policies.everything_saveable).kind == "custom"
    setup = models.build("dp", mesh_for({"data": 8}), optimizer=optax.sgd(0.1), remat=True)
    assert setup.remat == Remat("full")  # under every strategy now, not fsdp only


def test_bad_policies_are_refused():
    sgd = optax.sgd(0.1)
    with refused(ValueError, argument="remat='matmul'", got="is not a policy",
                 expected="one of ('none', 'full', 'matmuls', 'offload')",
                 fix="Pick one of"):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat="matmul")
    with refused(TypeError, argument="remat=3", got="got int",
                 expected="expected one of ('none', 'full', 'matmuls', 'offload')",
                 fix='Pass e.g. remat="matmuls"'):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat=3)
    with refused(ValueError, argument="remat names ['attn_out']", got="no layer of gpt",
                 expected=f"it makes {sorted(NAMES)}", fix="Pick from those"):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat=("attention_output", "attn_out"))
    with refused(ValueError, argument="remat names ['attention_output']", got="no layer of mlp",
                 expected="it makes none", fix="checkpoint_name(x, name)"):  # fmt: skip
        models.build("ref", optimizer=sgd, remat=Remat("offload", ("attention_output",)))
    with refused(ValueError, argument="remat: a policy that saves names", got="got none",
                 expected="at least one name", fix='remat="full"'):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat=())
