"""Mutation check for the strategies: bugs injected into copies of models/training's modules (the shared
step), models/networks/mlp.py (the MLP's metrics) or models/strategies/parallel.py (the data axis) are caught by the
same checks the suite runs (against an independent reference, or, for what values cannot show,
the compiled program: donation, the requested bytes)."""

import inspect
import sys
import types

import jax
import pytest
from _model_checks import (
    check_bf16_budget,
    check_donation,
    check_dtype_flow,
    check_evaluation,
    check_trajectory,
)
from _mutants import training
from test_strategies import check_remat_regathers

import shardops
from shardops.layers import _attention
from shardops.layers import _dense_kernels as _kernels
from shardops_models.networks import _mlp, mlp
from shardops_models.strategies import fsdp, parallel, tensor
from shardops_models.training import _train

GRADS = "        loss, grads = self._value_and_grad(params, x, y)\n"
LOCAL_LOSS = (
    "        targets = self._global_batch(y.shape[0] * microbatches) * math.prod(y.shape[1:])\n"
)

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
        LOCAL_LOSS.replace("self._global_batch(y.shape[0] * microbatches)", "y.shape[0]"),
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
    """``build`` of copies of models/training's modules, ``old`` (in one of them) replaced."""
    return training("mutant", old, new).build


def mutant_mlp_build(old: str, new: str):
    """``build`` with the MLP from a mutated copy of models/networks/mlp.py."""
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


EVAL_REDUCE = (
    "            sums = shardops.comm.all_reduce(sums, self.reduce_axes, reason=_METRICS)\n"
)
EVAL_MUTANTS = {
    # The global sums of loss and hits divided by this device's row count: off by the shards.
    "eval_count_not_reduced": (
        EVAL_REDUCE,
        "            sums = (*lax.psum(sums[:2], self.reduce_axes), sums[2])\n",
    ),
    # Per-shard sums combined with the wrong collective.
    "eval_reduced_with_pmax": (
        EVAL_REDUCE,
        "            sums = lax.pmax(sums, self.reduce_axes)\n",
    ),
    "eval_reduced_with_pmean": (
        EVAL_REDUCE,
        "            sums = lax.pmean(sums, self.reduce_axes)\n",
    ),
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
}  # in models/networks/mlp.py; the others in models/training's modules


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
        parallel, ("Parallel", "wrap"), ("shardops_models.training._step",),
        "            value = shardops.comm.copy_to_region(value, axes, self.precision.accum_dtype)\n",
        "            value = jax.lax.pcast(value, axes, to='varying')\n",
        "flow", ("2d", {"data": 4, "model": 2}, BF16),
    ),
    # fsdp: a unit's bundle of split leaves gathered with its gradients reduced in bf16.
    "data_gradient_bundle_reduce_scattered_in_bf16": (
        fsdp, ("FsdpKind",), ("shardops_models.strategies.layout",),
        "                                                               accum, self.replicas(ctx, varying))  # fmt: skip\n",
        "                                                               values[0].dtype, self.replicas(ctx, varying))\n",
        "flow", ("fsdp_tp", {"data": 2, "model": 4}, BF16),
    ),
    # fsdp: the plain all_gather, whose transpose reduce-scatters bf16 gradients.
    "data_gradient_reduce_scattered_in_bf16": (
        fsdp, ("FsdpKind",), ("shardops_models.strategies.layout",),
        "            return shardops.comm.gather_to_region(value, self.axes, dim,\n",
        "            return jax.lax.all_gather(value, self.axes, axis=dim, tiled=True)\n            return shardops.comm.gather_to_region(value, self.axes, dim,\n",
        "flow", ("fsdp_tp", {"data": 2, "model": 4}, BF16),
    ),
    # The loss computed from bf16 logits (log_softmax in bf16) under the mixed policy.
    "loss_from_bf16_logits": (
        _mlp, "cross_entropy_sum", ("shardops_models.networks.mlp",),
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


# Memory-only options of models/training's build: values cannot show them, the compiled program can.
TRAIN_STEP = (
    '        train_step=jit(step_of_state, "train_step", step_options, donate_argnums=0),\n'
)
LOSS_AND_GRADS = '        loss_and_grads=jit(loss_and_grads, "loss_and_grads"),\n'
REMAT_OPTIONS = "    step_options = keep if remat or regathers else None\n"
DONATION_MUTANTS = {
    # The train step keeps the old state: two states in memory at every step.
    "train_step_not_donated": (TRAIN_STEP, TRAIN_STEP.replace(", donate_argnums=0", "")),
    # loss_and_grads donates the params it is given (the grads could reuse them): the caller's
    # params are gone after it.
    "loss_and_grads_donates_params": (
        LOSS_AND_GRADS, LOSS_AND_GRADS.replace('grads")', 'grads", donate_argnums=0)'),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", DONATION_MUTANTS)
def test_donation_mutant_is_caught(name):
    build = mutant_build(*DONATION_MUTANTS[name])  # outside raises: a line not found is no catch
    with pytest.raises(AssertionError):
        check_donation(build)


def test_unmutated_copy_donates_alike():
    """The harness of the compiled-program checks around (donation, and remat's option below):
    unmutated copies of models/training's modules compile the same donations as the real one."""
    check_donation(mutant_build(TRAIN_STEP, TRAIN_STEP))


def test_remat_without_its_compiler_option_is_caught():
    """remat's compiler option (keep XLA:CPU's optimization barriers for the late CSE pass)
    changes no value and no requested byte: without it XLA merges the backward re-gather into
    the forward gather, and only the compiled program's all-gathers show it."""
    build = mutant_build(REMAT_OPTIONS, "    step_options = None\n")
    with pytest.raises(AssertionError):
        check_remat_regathers(build)


# bf16 reductions on the sequence-parallel paths: each changes the numbers by a rounding, the
# requested bytes by half. (module, swapped names, where the swap goes, old, new, strategies and
# policies whose budget check must catch it.) A replicated bias reaches the kernels in its own
# dtype only without a data axis (dp and fsdp hand it on in float32): sp under BFLOAT16.
SP_GATHER = "            x = gather_to_region(x, axis_name, gather_dimension, accum)  # x[..., D] in accum\n"
SP_ATTENTION = (
    "        x = gather_to_region(x, axis_name, SEQUENCE_DIM, accum)  # x[B, S, D] in accum\n"
)
SP_BO = "            bo = copy_to_region(bo, axis_name, accum)  # bo[D] in accum\n"
SP_BIAS = "        b = copy_to_region(b, axis_name, precision.accum_dtype)  # b[D] in accum\n"
SP_POSITIONS = "            x = shardops.comm.copy_to_region(x, self.axis, precision.accum_dtype)\n"
SP_MUTANTS = {
    # A column layer's gathered input: dx reduce-scattered along S in bf16.
    "column_sp_dx_reduce_scattered_in_bf16": (
        _kernels, "column_parallel_dense_kernel", "shardops.layers", SP_GATHER,
        SP_GATHER.replace("gather_dimension, accum)", "gather_dimension, x.dtype)"),
        [("dp_sp", MIXED), ("fsdp_sp", BF16)],
    ),
    # Attention's gathered input: dx reduce-scattered along S in bf16.
    "attention_sp_dx_reduce_scattered_in_bf16": (
        _attention, "head_parallel_attention_kernel", "shardops.layers", SP_ATTENTION,
        SP_ATTENTION.replace("SEQUENCE_DIM, accum)", "SEQUENCE_DIM, x.dtype)"),
        [("sp", MIXED)],
    ),
    # Attention's replicated output bias on a sequence shard: dbo all-reduced in its own dtype.
    "attention_sp_dbo_all_reduced_in_the_param_dtype": (
        _attention, "head_parallel_attention_kernel", "shardops.layers", SP_BO,
        "            bo = jax.lax.pcast(bo, axis_name, to='varying')\n", [("sp", BF16)],
    ),
    # A row layer's replicated bias on a sequence shard: db all-reduced in its own dtype.
    "row_sp_db_all_reduced_in_the_param_dtype": (
        _kernels, "row_parallel_dense_kernel", "shardops.layers", SP_BIAS,
        "        b = lax.pcast(b, axis_name, to='varying')\n", [("sp", BF16)],
    ),
    # The replicated position table's lookup kept as this device's part of S: its dx
    # all-reduced over model in the compute dtype.
    "positions_sp_dx_all_reduced_in_bf16": (
        tensor, "TensorKind", "shardops_models.strategies.layout", SP_POSITIONS,
        "            x = jax.lax.pcast(x, self.axis, to='varying')\n",
        [("sp", MIXED), ("fsdp_sp", BF16)],
    ),
}  # fmt: skip


def swap_sp_mutant(monkeypatch, name, new=None):
    module, names, into, old, replacement, _ = SP_MUTANTS[name]
    mutant = mutant_module(module, old, old if new is None else replacement)
    for n in (names,) if isinstance(names, str) else names:
        monkeypatch.setattr(sys.modules[into], n, getattr(mutant, n))
    jax.clear_caches()


@pytest.mark.parametrize("name", SP_MUTANTS)
def test_unmutated_sp_copy_asks_for_its_budget(monkeypatch, name):
    swap_sp_mutant(monkeypatch, name)
    for strategy, precision in SP_MUTANTS[name][-1]:
        check_bf16_budget(strategy, precision)


@pytest.mark.parametrize("name", SP_MUTANTS)
def test_sp_bf16_reduction_mutant_is_caught(monkeypatch, name):
    swap_sp_mutant(monkeypatch, name, new=True)
    for strategy, precision in SP_MUTANTS[name][-1]:
        with pytest.raises(AssertionError, match="the program asks for"):
            check_bf16_budget(strategy, precision)
    jax.clear_caches()


@pytest.mark.parametrize(("line", "replacement"), [
    ('    step_of_state = _state_checked(step, padding, "setup.train_step")\n',
     "    step_of_state = step\n"),
    ('    evaluate = _params_checked(evaluate, padding, "setup.evaluate")\n',
     "    evaluate = evaluate\n"),
], ids=["train_step", "evaluate"])  # fmt: skip
def test_steps_without_their_params_check_are_caught(monkeypatch, line, replacement):
    """Without the check, shard_map refuses the params itself (a ValueError dumping both
    pytrees), where the test asks for the step's own error and advice."""
    from test_strategies import test_wrong_params_or_state_to_the_steps_are_clear_errors as wrong

    import shardops_models as models

    monkeypatch.setattr(models, "build", training("checked_params", line, line).build)
    wrong()  # the unmutated copies pass: what fails below is the mutation
    monkeypatch.setattr(models, "build", training("unchecked_params", line, replacement).build)
    with pytest.raises((pytest.fail.Exception, AssertionError, ValueError, TypeError)):
        wrong()
