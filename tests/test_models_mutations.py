"""Mutation check for the strategies: bugs injected into a copy of models/_train.py (the shared
step), models/mlp.py (the MLP's metrics) or models/parallel.py (the data axis) are caught by the
same checks the suite runs (against an independent reference)."""

import inspect
import sys
import types

import jax
import pytest
from _model_checks import check_dtype_flow, check_evaluation, check_trajectory
from shardops_models import _mlp, _train, mlp, parallel

import shardops

SOURCE = inspect.getsource(_train)
GRADS = "        loss, grads = jax.value_and_grad(self.local_loss)(params, x, y)\n"
LOCAL_LOSS = "        targets = self._global_batch(y.shape[0]) * math.prod(y.shape[1:])\n"

MUTANTS = {
    "zeroed_layer_gradient": (
        GRADS,
        GRADS + "        grads[0] = jax.tree.map(jnp.zeros_like, grads[0])\n",
    ),
    "doubled_layer_gradient": (
        GRADS,
        GRADS + "        grads[-1] = jax.tree.map(lambda g: 2 * g, grads[-1])\n",
    ),
    # The gradient trap: autodiff already reduced the gradients over data.
    "extra_psum_over_data": (GRADS, GRADS + "        grads = lax.psum(grads, 'data')\n"),
    "loss_averaged_locally": (
        LOCAL_LOSS,
        LOCAL_LOSS.replace("self._global_batch(y.shape[0])", "y.shape[0]"),
    ),
}
CASES = [
    ("dp", {"data": 4}),
    ("2d", {"data": 2, "model": 4}),
    ("fsdp", {"data": 4}),
    ("fsdp_tp", {"data": 4, "model": 2}),
]
SIZES = (48, 64, 24, 10)


def mutant_module(module, old: str, new: str):
    source = inspect.getsource(module)
    assert source.count(old) == 1, f"not found exactly once in {module.__name__}: {old!r}"
    mutant = types.ModuleType(module.__name__ + "_mutant")
    sys.modules[mutant.__name__] = mutant  # dataclasses look their module up
    exec(
        compile(source.replace(old, new), f"<mutant of {module.__name__}>", "exec"), mutant.__dict__
    )
    return mutant


def mutant_build(old: str, new: str):
    return mutant_module(_train, old, new).build


def mutant_mlp_build(old: str, new: str):
    """``build`` with the MLP from a mutated copy of models/mlp.py."""
    mutant = mutant_module(mlp, old, new)

    def build(*args, sizes, **kwargs):
        return _train.build(*args, model=mutant.Mlp(sizes), **kwargs)

    return build


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_unmutated_copy_passes(case):
    build = mutant_build(GRADS, GRADS)
    check_trajectory(*case, "sgd", sizes=SIZES, batch=32, build=build)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name, case):
    build = mutant_build(*MUTANTS[name])
    with pytest.raises(AssertionError):
        check_trajectory(*case, "sgd", sizes=SIZES, batch=32, build=build)
    jax.clear_caches()


EVAL_REDUCE = "            sums = lax.psum(sums, self.batch_axes)\n"
EVAL_MUTANTS = {
    # The global sums of loss and hits divided by this device's row count: off by the shards.
    "eval_count_not_reduced": (
        EVAL_REDUCE,
        "            sums = (*lax.psum(sums[:2], self.batch_axes), sums[2])\n",
    ),
    # Per-shard sums combined with the wrong collective.
    "eval_reduced_with_pmax": (EVAL_REDUCE, EVAL_REDUCE.replace("lax.psum", "lax.pmax")),
    "eval_reduced_with_pmean": (EVAL_REDUCE, EVAL_REDUCE.replace("lax.psum", "lax.pmean")),
    # Padding rows counted as examples, or their (arbitrary) predictions as hits.
    "eval_counts_padding_rows": (
        "        return loss_sum, jnp.sum(hits, dtype=jnp.int32), jnp.sum(labelled, dtype=jnp.int32)\n",
        "        return loss_sum, jnp.sum(hits, dtype=jnp.int32), jnp.asarray(y.shape[0], jnp.int32)\n",
    ),
    "eval_hits_include_padding": (
        "        hits = (jnp.argmax(logits, -1) == jnp.argmax(y, -1)) & labelled  # (b,)\n",
        "        hits = jnp.argmax(logits, -1) == jnp.argmax(y, -1)  # (b,)\n",
    ),
    # The loss mean taken over rows and classes of the local batch (the seed's formula, per shard).
    "eval_loss_not_divided_by_classes": (
        "        loss_sum = cross_entropy_sum(logits, y) / y.shape[-1]  # padding rows add 0\n",
        "        loss_sum = cross_entropy_sum(logits, y)  # padding rows add 0\n",
    ),
}
EVAL_CASES = [
    ("dp", {"data": 4}),
    ("2d", {"data": 2, "model": 4}),
    ("fsdp_tp", {"data": 4, "model": 2}),
    ("tp", {"model": 8}),
]
# tp replicates the batch: it has no batch reduction to get wrong.
EVAL_PAIRS = [
    (name, case)
    for name in EVAL_MUTANTS
    for case in EVAL_CASES
    if not (case[0] == "tp" and ("count_not" in name or "reduced_with" in name))
]


MLP_EVAL_MUTANTS = {
    "eval_counts_padding_rows",
    "eval_hits_include_padding",
    "eval_loss_not_divided_by_classes",
}  # in models/mlp.py; the others in models/_train.py


def eval_build(name: str):
    old, new = EVAL_MUTANTS[name]
    return mutant_mlp_build(old, new) if name in MLP_EVAL_MUTANTS else mutant_build(old, new)


@pytest.mark.parametrize("case", EVAL_CASES, ids=lambda c: c[0])
def test_unmutated_copy_evaluates_alike(case):
    build = mutant_build(EVAL_REDUCE, EVAL_REDUCE)
    check_evaluation(*case, sizes=SIZES, batch=64, pad=8, build=build)
    old = EVAL_MUTANTS["eval_hits_include_padding"][0]
    check_evaluation(*case, sizes=SIZES, batch=64, pad=8, build=mutant_mlp_build(old, old))


@pytest.mark.parametrize(
    ("name", "case"), EVAL_PAIRS, ids=lambda v: v if isinstance(v, str) else v[0]
)
def test_evaluation_mutant_is_caught(name, case):
    build = eval_build(name)
    with pytest.raises((AssertionError, ValueError)) as caught:
        check_evaluation(*case, sizes=SIZES, batch=64, pad=8, build=build)
    if isinstance(caught.value, ValueError):  # only check_vma's trace-time verdict counts
        assert "out_specs" in str(caught.value), caught.value
    jax.clear_caches()


# Precision mutants of the strategies' shared helpers: the mutated function or class (from a copy
# of its module with one line replaced) is swapped into every module that imported it by name.
BF16, MIXED = shardops.BFLOAT16, shardops.MIXED_BFLOAT16
HELPER_MUTANTS = {
    # dp/2d: the replicated weight made varying in bf16, so autodiff all-reduces bf16 gradients.
    "data_gradient_all_reduced_in_bf16": (
        parallel, ("Parallel", "wrap"), ("shardops_models._train",),
        "                value = shardops.copy_to_region(value, DATA_AXIS, self.precision.accum_dtype)\n",
        "                value = jax.lax.pcast(value, DATA_AXIS, to='varying')\n",
        "flow", ("2d", {"data": 4, "model": 2}, BF16),
    ),
    # fsdp: a stage's bundle of split leaves gathered with its gradients reduced in bf16.
    "data_gradient_bundle_reduce_scattered_in_bf16": (
        parallel, ("Parallel", "wrap"), ("shardops_models._train",),
        "                    values, DATA_AXIS, dims, accum), strict=True):  # fmt: skip\n",
        "                    values, DATA_AXIS, dims, values[0].dtype), strict=True):\n",
        "flow", ("fsdp_tp", {"data": 2, "model": 4}, BF16),
    ),
    # fsdp: the plain all_gather, whose transpose reduce-scatters bf16 gradients.
    "data_gradient_reduce_scattered_in_bf16": (
        parallel, ("Parallel", "wrap"), ("shardops_models._train",),
        "        return shardops.gather_to_region(value, DATA_AXIS, dim, self.precision.accum_dtype)\n",
        "        return jax.lax.all_gather(value, DATA_AXIS, axis=dim, tiled=True)\n",
        "flow", ("fsdp_tp", {"data": 2, "model": 4}, BF16),
    ),
    # The loss computed from bf16 logits (log_softmax in bf16) under the mixed policy.
    "loss_from_bf16_logits": (
        _mlp, "cross_entropy_sum", ("shardops_models.mlp",),
        "    return -jnp.sum(labels * jax.nn.log_softmax(logits.astype(jnp.float32)))\n",
        "    return -jnp.sum(labels * jax.nn.log_softmax(logits))\n",
        "trajectory", ("dp", {"data": 4}, MIXED),
    ),
}  # fmt: skip


def swap_helper(monkeypatch, module, name, importers, old, new):
    mutant = mutant_module(module, old, new)
    for importer in importers:
        for n in (name,) if isinstance(name, str) else name:  # a class with its helpers
            monkeypatch.setattr(sys.modules[importer], n, getattr(mutant, n))
    jax.clear_caches()


def helper_check(check, case):
    strategy, mesh_shape, precision, *remat = case
    if check == "flow":
        check_dtype_flow(strategy, mesh_shape, precision, sizes=SIZES, remat=bool(remat))
    else:
        check_trajectory(strategy, mesh_shape, "sgd", sizes=SIZES, batch=32, precision=precision)


@pytest.mark.parametrize("name", HELPER_MUTANTS)
def test_unmutated_helper_copy_passes(monkeypatch, name):
    module, fn, importers, old, _, check, case = HELPER_MUTANTS[name]
    swap_helper(monkeypatch, module, fn, importers, old, old)
    helper_check(check, case)


@pytest.mark.parametrize("name", HELPER_MUTANTS)
def test_helper_mutant_is_caught(monkeypatch, name):
    module, fn, importers, old, new, check, case = HELPER_MUTANTS[name]
    swap_helper(monkeypatch, module, fn, importers, old, new)
    with pytest.raises(AssertionError):
        helper_check(check, case)
    jax.clear_caches()
