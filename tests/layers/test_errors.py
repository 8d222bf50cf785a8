"""Bad input to the layers gets a clear error before anything is traced or run."""

import jax.numpy as jnp
import pytest
from _messages import refused
from _mutants import mutant

import shardops
from shardops.layers import _dense


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 2, "model": 4})


def test_out_features_not_divisible(mesh):
    with refused(ValueError, argument="column_parallel_dense: w dim 1 (out features)", got="= 30",
                 expected="is not divisible by mesh axis 'model' (size 4)",
                 fix=("Pad it to 32 with shardops.pad_params", "and pass out_features=30")):  # fmt: skip
        shardops.column_parallel_dense(jnp.ones((8, 16)), jnp.ones((16, 30)), mesh=mesh)


def test_in_features_not_divisible_for_row(mesh):
    with refused(ValueError, argument="row_parallel_dense: w dim 0 (in features)", got="= 30",
                 expected="is not divisible by mesh axis 'model' (size 4)",
                 fix=("Pad it to 32 with shardops.pad_params", "and pass in_features=30")):  # fmt: skip
        shardops.row_parallel_dense(jnp.ones((8, 30)), jnp.ones((30, 16)), mesh=mesh)


def test_batch_not_divisible_over_both_axes(mesh):
    # Sequence parallelism splits the batch over data × model = 8.
    with refused(ValueError, argument="x dim 0 (batch)", got="= 12",
                 expected="not divisible by mesh axis 'data' (size 2) × 'model' (size 4) = 8",
                 fix="choose a multiple of 8 or a mesh whose axes divide 12"):  # fmt: skip
        shardops.column_parallel_dense(
            jnp.ones((12, 16)), jnp.ones((16, 32)), mesh=mesh, batch_axis="data", gather_input=True
        )


def test_feature_scatter_needs_divisible_out_features(mesh):
    with refused(ValueError, argument="w dim 1 (out features)", got="= 10",
                 expected="not divisible by mesh axis 'model' (size 4)",
                 fix="choose a multiple of 4 or a mesh whose axis divides 10"):  # fmt: skip
        shardops.row_parallel_dense(
            jnp.ones((8, 16)),
            jnp.ones((16, 10)),
            mesh=mesh,
            reduce="psum_scatter",
            scatter_dimension=1,
        )


@pytest.mark.parametrize("argument", ["axis_name", "batch_axis"])
def test_unknown_axis(mesh, argument):
    with refused(ValueError, argument=f"{argument}=", got="'tensor' is not an axis of the mesh",
                 expected="axes ('data', 'model') with sizes {'data': 2, 'model': 4}",
                 fix=("Pass one of those names",
                      "shardops.make_mesh({..., 'tensor': size})")):  # fmt: skip
        shardops.column_parallel_dense(
            jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=mesh, **{argument: "tensor"}
        )


def test_batch_and_model_on_one_axis(mesh):
    with refused(ValueError, argument="batch_axis and axis_name", got="are both 'model'",
                 expected="the batch and the weights",
                 fix="must be split over different mesh axes"):  # fmt: skip
        shardops.column_parallel_dense(
            jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=mesh, batch_axis="model"
        )


@pytest.mark.parametrize("layer", ["column", "row"])
def test_mismatched_inner_dimensions(mesh, layer):
    fn = getattr(shardops, f"{layer}_parallel_dense")
    with pytest.raises(
        ValueError,
        match=r"inner dimensions differ: x\(8, 16\) has 16 features but w\(24, 32\) has 24 rows",
    ):
        fn(jnp.ones((8, 16)), jnp.ones((24, 32)), mesh=mesh)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "match"),
    [
        ((16,), (16, 32), r"x must have rank ≥ 2 \(x\[B, \.\.\., D\]\); got shape \(16,\)"),
        ((8, 16), (16, 32, 1), r"w must have rank 2 \(w\[D, F\]\)"),
    ],
)
def test_wrong_rank(mesh, x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        shardops.column_parallel_dense(jnp.ones(x_shape), jnp.ones(w_shape), mesh=mesh)


@pytest.mark.parametrize("layer", ["column", "row"])
@pytest.mark.parametrize("b_shape", [(16,), (1, 32), ()])
def test_bias_of_the_wrong_shape_is_not_broadcast(mesh, layer, b_shape):
    fn = getattr(shardops, f"{layer}_parallel_dense")
    with refused(ValueError, argument=f"{layer}_parallel_dense: b", got=f"got {b_shape}",
                 expected="must have shape (32,) to match w(16, 32)",
                 fix="No broadcasting is done"):  # fmt: skip
        fn(jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones(b_shape), mesh=mesh)


def test_bad_reduce_options(mesh):
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    with refused(ValueError, argument="reduce", got="got 'sum'",
                 expected="must be one of ('psum', 'psum_scatter')",
                 fix="'psum' gives a replicated output, 'psum_scatter' one split along "
                     "scatter_dimension"):  # fmt: skip
        shardops.row_parallel_dense(x, w, mesh=mesh, reduce="sum")
    with pytest.raises(
        ValueError,
        match=r"scatter_dimension must be one of the 2 dims it may split \(0 = batch, -1 = last\); got 2",
    ):
        shardops.row_parallel_dense(x, w, mesh=mesh, reduce="psum_scatter", scatter_dimension=2)


def test_not_a_mesh():
    with refused(TypeError, argument="mesh", got="got dict",
                 expected="must be a jax.sharding.Mesh", fix="(see shardops.make_mesh)"):  # fmt: skip
        shardops.column_parallel_dense(jnp.ones((8, 16)), jnp.ones((16, 32)), mesh={"model": 2})


def test_explicit_mesh_rejects_a_misplaced_input_with_the_fix():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = shardops.make_mesh({"data": 2, "model": 4}, axis_types="explicit")
    w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("model", None)))  # row layout
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P()))
    with pytest.raises(
        ValueError,
        match=r"w is laid out as P\('model', None\) but this layer needs P\(None, 'model'\).*jax.sharding.reshard",
    ):
        shardops.column_parallel_dense(x, w, mesh=mesh)


# Mutants of the advice (the first clause unchanged): caught by the tests above, which read the
# message whole (tests/_messages.py); a match on the first clause alone passes them.
ADVICE_MUTANTS = {
    # the padding rounded down: "Pad it to 28" for 30 features on 4 devices
    "pad_rounds_down": (
        "        padded = -(-size // p) * p\n",
        "        padded = size // p * p\n",
        test_in_features_not_divisible_for_row,
    ),
    # the logical size to pass forgotten: "pass in_features=None"
    "logical_name_dropped": (
        '            f"shard_params(..., pad=True)) and pass {logical_name}={logical or size}."\n',
        '            f"shard_params(..., pad=True)) and pass {logical_name}={logical}."\n',
        test_in_features_not_divisible_for_row,
    ),
}


def check_advice_mutant(monkeypatch, mesh, name, replace):
    line, new, test = ADVICE_MUTANTS[name]
    bad = mutant(_dense, name, line, new if replace else line)
    monkeypatch.setattr(_dense, "_check_padded", bad._check_padded)
    test(mesh)


@pytest.mark.parametrize("name", ADVICE_MUTANTS)
def test_unmutated_advice_copy_passes(monkeypatch, mesh, name):
    check_advice_mutant(monkeypatch, mesh, name, replace=False)


@pytest.mark.parametrize("name", ADVICE_MUTANTS)
def test_advice_mutant_is_caught(monkeypatch, mesh, name):
    with pytest.raises(AssertionError, match="the message lacks"):
        check_advice_mutant(monkeypatch, mesh, name, replace=True)


# --- heads split mid-head under tp: refused by the plan (build) or ctx.attention, by name ------


class _AttentionLM:
    """ids → table → x + attention(x) → head: an attention block of ``heads`` query and ``kv``
    key/value heads of ``head_dim``, the plan's role ``head``; ``num_heads`` (the attribute
    the plan counts heads with) as given, or none."""

    sequence, context, name = True, 8, "attention lm"

    def __init__(self, heads, kv, head_dim, num_heads=None):
        self.heads, self.kv, self.head_dim = heads, kv, head_dim
        if num_heads is not None:
            self.num_heads, self.num_kv_heads = num_heads, kv

    def init(self, key, dtype=None):
        import jax

        k1, k2, k3 = jax.random.split(key, 3)
        d = self.heads * self.head_dim
        return {"embed": {"table": jax.random.normal(k1, (16, d))},
                "attn": shardops.init_attention(k2, d, self.heads, self.head_dim,
                                                num_kv_heads=self.kv),
                "head": {"w": jax.random.normal(k3, (d, 16))}}  # fmt: skip

    def plan(self):
        return {"embed": "replicated", "attn": "head", "head": "replicated"}

    def apply(self, ctx, params, ids):
        def attend(p, x):
            return ctx.attention(p, x, num_heads=self.heads, num_kv_heads=self.kv)

        x = ctx.unit(ctx.embed, params["embed"], ids)
        x = x + ctx.unit(attend, params["attn"], x)
        return ctx.unit(ctx.dense, params["head"], x), {}

    def loss_sum(self, ctx, params, logits, labels):
        return ctx.cross_entropy(logits, labels, split=False).sum()

    def check_batch(self, x, y=None):
        pass


from jax.sharding import PartitionSpec as P  # noqa: E402 (the head checks' section)


def plan_specs(plan_module, model, p: int = 4):
    """``model_specs`` of ``model``'s plan over a 'model' axis of ``p`` (no JAX: shapes only)."""
    import jax

    shapes = jax.tree.map(lambda a: tuple(a.shape), jax.eval_shape(model.init, jax.random.key(0)))
    roles = plan_module.leaf_roles(model.plan(), shapes)
    return plan_module.model_specs(roles, shapes, "model", p, getattr(model, "num_heads", None))


NO_NUM_HEADS = (r"params\['attn'\]: the head role splits the attention over mesh axis 'model' "
                r"\(size 4\) by heads, and each device must hold whole heads, but the model has "
                r"no num_heads attribute to count them \(wq\[D, 16\] .*\): give the model a "
                r"num_heads attribute \(and num_kv_heads for grouped-query attention\), or role "
                r"'replicated'")  # fmt: skip
HEADS_NOT_DIVISIBLE = (r"params\['attn'\]: num_heads=2 is not divisible by mesh axis 'model' "
                       r"\(size 4\); the head role gives each device whole query heads, and "
                       r"wq\[D, 16\] split 4 ways would cut a head of 8\. Choose num_heads a "
                       r"multiple of 4 \(e\.g\. 4\), a smaller 'model' axis, or role 'replicated'")  # fmt: skip


def check_the_plan_refuses_heads_split_mid_head(plan_module):
    """2 heads of 8 on a model axis of 4: wq[D, 16] divides by 4, but each device would hold
    half a head. With a num_heads attribute that 4 does not divide, the plan names it; without
    one it cannot count grouped-query heads (wk narrower than wq) and says so. Multi-head
    attention without one is split with its columns and left to ctx.attention, which checks
    the heads its call names (test_build_refuses_heads_split_mid_head_before_tracing). A plan
    on an axis of 1, or heads that divide, stand."""
    with pytest.raises(ValueError, match=NO_NUM_HEADS):
        plan_specs(plan_module, _AttentionLM(4, 2, 4))
    assert plan_specs(plan_module, _AttentionLM(2, 2, 8))["attn"]["wq"] == P(None, "model")
    with pytest.raises(ValueError, match=HEADS_NOT_DIVISIBLE):
        plan_specs(plan_module, _AttentionLM(2, 2, 8, num_heads=2))
    plan_specs(plan_module, _AttentionLM(2, 2, 8), p=1)
    specs = plan_specs(plan_module, _AttentionLM(4, 2, 4, num_heads=4), p=4)
    assert specs["attn"]["wk"] == P(None, None)  # 2 KV heads on 4: replicated, whole


def test_the_plan_refuses_heads_split_mid_head():
    from shardops_models.strategies import plan

    check_the_plan_refuses_heads_split_mid_head(plan)


def test_build_refuses_heads_split_mid_head_before_tracing():
    """Through ``models.build``: the plan's error, before anything is traced; multi-head
    attention without a num_heads attribute builds, and ctx.attention refuses 2 heads on 4
    devices as the step traces (before any collective), while 4 heads on 4 train."""
    import jax
    import optax

    import shardops_models as models
    from shardops_models.training._tokens import model_batch

    mesh = shardops.make_mesh({"model": 4}, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=NO_NUM_HEADS):
        models.build("tp", mesh, model=_AttentionLM(4, 2, 4), optimizer=optax.sgd(0.1))
    for heads, fits in ((2, False), (4, True)):
        model = _AttentionLM(heads, heads, 16 // heads)
        setup = models.build("tp", mesh, model=model, optimizer=optax.sgd(0.1))
        state = jax.eval_shape(lambda m=model, s=setup: s.shard(m.init(jax.random.key(0))))
        if fits:
            setup.train_step.trace(state, *model_batch(model, 2, 8))
            continue
        with pytest.raises(ValueError, match=kv_as_planned(2, 2)):
            setup.train_step.trace(state, *model_batch(model, 2, 8))


def kv_as_planned(heads: int, kv: int) -> str:
    return (r"ctx.attention at \['attn'\]: the plan split wk, wv by KV head over mesh axis "
            r"'model' \(size 4\) \(by the model's num_heads attribute, or, without one, by "
            rf"columns as wide as wq's\), but this call has num_heads={heads}, num_kv_heads={kv}, "
            rf"and {kv} KV heads do not split over 4 devices \(each would hold part of a head\)\. "
            r"Give the model num_heads \(and num_kv_heads\) attributes equal to what its "
            r"forward passes to ctx.attention, so that the plan replicates them, or a head "
            r"count 4 divides\.")  # fmt: skip


KV_AS_PLANNED = kv_as_planned(4, 2)


def check_attention_refuses_kv_heads_split_by_another_count(build):
    """A model whose num_heads attribute (8) is not what its forward passes (4 heads of 8, 2
    KV heads): the plan counts 4 KV heads of 4 and splits wk[D, 16] over model 4, cutting each
    real KV head in two; ctx.attention names the mismatch as the step traces (the heads it is
    given are known only then), before the kernel."""
    import jax
    import optax

    from shardops_models.training._tokens import model_batch

    model = _AttentionLM(4, 2, 8, num_heads=8)
    mesh = shardops.make_mesh({"model": 4}, devices=jax.devices()[:4])
    setup = build("tp", mesh, model=model, optimizer=optax.sgd(0.1))
    state = jax.eval_shape(lambda: setup.shard(model.init(jax.random.key(0))))
    with pytest.raises(ValueError, match=KV_AS_PLANNED):
        setup.train_step.trace(state, *model_batch(model, 2, 8))


def test_attention_refuses_kv_heads_split_by_another_count():
    import shardops_models as models

    check_attention_refuses_kv_heads_split_by_another_count(models.build)
