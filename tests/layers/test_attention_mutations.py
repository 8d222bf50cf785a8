"""Mutation check: known attention and norm bugs, injected into copies of shardops/layers/_attention.py
(and the modules it runs: _attention_core.py, _rope.py, …) and shardops/layers/_norms.py, are
caught by the suite's own checks.

Each mutant replaces one exact line of the real source (the test fails if that line is not
there exactly once, so mutants cannot drift from the code), is loaded as a module and swapped in
where the checks look the layer up (``_attention_checks.attention`` / ``.norms``). The checks
are the ones the suite runs: ``check_attention`` (forward and every gradient against float64),
``check_attention_dtype_flow``, the collective budget, ``check_sequence_parallel_norm``.
"""

import inspect
import types

import _attention_checks
import jax
import pytest
from _attention_checks import (
    check_attention,
    check_attention_dtype_flow,
    check_sequence_parallel_norm,
    requested_and_compiled,
)
from test_attention import BUDGETS

import shardops
from shardops.layers import (
    _attention,
    _attention_core,
    _attention_reference,
    _kv_heads,
    _masks,
    _norms,
    _rope,
)

# The attention family: the kernel's module and the modules it calls by attribute
# (``_rope.rotate``, ``_attention_core.core_for``), where a mutant of theirs is swapped in.
FAMILY = {"attention": _attention, "attention_core": _attention_core,
          "attention_reference": _attention_reference, "kv_heads": _kv_heads, "masks": _masks,
          "rope": _rope}  # fmt: skip
SOURCES = {**{k: inspect.getsource(m) for k, m in FAMILY.items()},
           "norms": inspect.getsource(_norms)}  # fmt: skip
F32, BF16 = shardops.FLOAT32, shardops.BFLOAT16

# Used by the norm mutant "an extra psum on the parameter gradients": identity forward, the
# cotangent summed over model again (as if Megatron's hand-written all-reduce ran on top of
# check_vma's); outside shard_map (the unsharded run) it does nothing.
EXTRA_PSUM = """
import jax


@jax.custom_vjp
def _psum_grad(s):
    return s


def _psum_grad_fwd(s):
    return s, None


def _psum_grad_bwd(_, g):
    try:
        return (lax.psum(g, "model"),)
    except NameError:
        return (g,)


_psum_grad.defvjp(_psum_grad_fwd, _psum_grad_bwd)
"""

K_LINE = V_LINE = (  # the projections of the training kernel and the decoder's
    '    yq, yk, yv = precision.matmuls(x, (params["wq"], params["wk"], params["wv"]))'
)
OTHER_HEADS = (
    'lax.all_gather(params["{w}"], MODEL_AXIS, axis=1, tiled=True)[:, : params["{w}"].shape[1]]'
)
MASK = "visible = (k_positions[None, :] <= q_positions[:, None])[None, None]"
PSUM = "        y = reduce_from_region(y_partial, axis_name)  # y[B, S, D] in accum"
KV_INDEX = (
    "    if kv.index is not None:  # replicated K/V: each query head's own KV head, by index\n"
)
REPEAT = (
    "    return jnp.repeat(t, heads // n, axis=1)  # contiguous groups: query head j reads j // g"
)
SHARED_INDEX = (
    "    index = (i * local + jnp.arange(local)) // group - first  # [H/p]: local KV head per query"
)
ROTATE_HALF = (
    "    t1, t2 = t[..., :half], t[..., half:]\n"
    "    return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)"
)
POSITIONS = "        positions = jnp.arange(seq)[None]  # [1, S]"
SEGMENTS = "        visible = same if visible is None else same & visible"
SHARED_COPY = (
    "                w = copy_to_region(params[name], axis_name, accum)  # w[D, KV·hd] in accum"
)
# Used by "replicated_kv_gradient_not_reduced": enters the region (varying over model) but its
# backward keeps device 0's cotangent instead of summing them.
UNREDUCED = """


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unreduced(w, axis):
    return lax.pcast(w, axis, to="varying")


def _unreduced_fwd(w, axis):
    return _unreduced(w, axis), None


def _unreduced_bwd(axis, _, g):
    return (lax.all_gather(g, axis, to="invarying")[0],)


_unreduced.defvjp(_unreduced_fwd, _unreduced_bwd)
"""
# The output projection's partial sums y[B, S, D]{U_model} (``_attend``, before the kernel's psum).
Y_PARTIAL = '    return precision.matmul(o, params["wo"])  # y[B, S, D] in accum'

# name → (old line, new line, appended code, (precision, causal, sequence_parallel), caught by)
ATTENTION_MUTANTS = {
    # Heads split for Q but not for K: every device attends with device 0's key heads (as when
    # K is computed for all heads and the head index is not offset by the device's position).
    "k_heads_of_device_0": (
        K_LINE,
        K_LINE.replace('params["wk"]', OTHER_HEADS.format(w="wk"), 1),
        "", (F32, True, False), "numbers",
    ),
    "v_heads_of_device_0": (
        V_LINE,
        V_LINE.replace('params["wv"]', OTHER_HEADS.format(w="wv"), 1),
        "", (F32, True, True), "numbers",
    ),
    # Columns grouped into heads the wrong way (strided instead of contiguous blocks).
    "heads_grouped_by_stride": (
        "    return y.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)  # [B, n, S, hd]",
        "    return y.reshape(batch, seq, -1, heads).transpose(0, 3, 1, 2)  # [B, n, S, hd]",
        "", (F32, False, False), "numbers",
    ),
    "softmax_over_queries": (
        "probs = jax.nn.softmax(scores, axis=-1)",
        "probs = jax.nn.softmax(scores, axis=-2)",
        "", (F32, True, False), "numbers",
    ),
    # Off by one either way: a query sees the next token, or not even itself (NaN row).
    "causal_mask_sees_the_next_token": (
        MASK, MASK.replace("q_positions[:, None]", "q_positions[:, None] + 1"), "", (F32, True, True), "numbers",
    ),
    "causal_mask_hides_the_diagonal": (
        MASK, MASK.replace("<=", "<"), "", (F32, True, False), "numbers",
    ),
    # The output projection's partial sums leave unreduced (check_vma refuses the out_specs) or
    # are reduced twice (×p).
    "output_psum_missing": (
        PSUM, "        y = y_partial  # y[B, S, D] in accum", "", (F32, True, False), "numbers",
    ),
    "output_psum_doubled": (
        PSUM, PSUM.replace("reduce_from_region(y_partial, axis_name)",
                           "reduce_from_region(reduce_from_region(y_partial, axis_name), axis_name)"),
        "", (F32, True, False), "numbers",
    ),
    # bo added to every device's partial sum: counted p times.
    "bias_before_the_reduction": (
        Y_PARTIAL,
        Y_PARTIAL.replace('precision.matmul(o, params["wo"])',
                          'precision.matmul(o, params["wo"]) + params["bo"]'),
        "", (F32, False, False), "numbers",
    ),
    # Precision: the partial sums rounded to bf16 before the psum. The tight bf16 bound alone
    # must see it (the dtype flow would too).
    "bf16_partial_sum_before_psum": (
        Y_PARTIAL,
        Y_PARTIAL.replace('precision.matmul(o, params["wo"])',
                          'precision.matmul(o, params["wo"]).astype(precision.compute_dtype)'),
        "", (BF16, True, False), "numbers",
    ),
    # Megatron's "f" applied to the bf16 activation: autodiff all-reduces dx in bf16 (and the
    # sequence-parallel gather's transpose reduce-scatters it in bf16). The projections' dx
    # are summed in f32 before the one bf16 rounding (``Precision.matmuls``), which leaves the
    # bf16 AllReduce's error within the bound at these sizes: the dtype flow reads the psum.
    "dx_all_reduced_in_bf16": (
        "        x = copy_to_region(x, axis_name, accum)  # x[B, S, D] in accum",
        "        x = lax.pcast(x, axis_name, to='varying')  # x[B, S, D]",
        "", (BF16, True, False), "dtype flow",
    ),
    "dx_reduce_scattered_in_bf16": (
        "        x = gather_to_region(x, axis_name, SEQUENCE_DIM, accum)  # x[B, S, D] in accum",
        "        x = lax.all_gather(x, axis_name, axis=SEQUENCE_DIM, tiled=True)  # x[B, S, D]",
        "", (BF16, True, True), "dtype flow",
    ),
    # The attention products differentiated by plain autodiff: bf16 × f32 transposes that
    # accumulate in bf16. Numerically invisible on a CPU; the dtype flow reads it.
    "attention_products_by_plain_autodiff": (
        "    return _einsum(spec, compute, accum, precision.matmul_precision, a, b)",
        "    return _einsum_of(spec, a, b, compute, accum, precision.matmul_precision)",
        "", (BF16, True, True), "dtype flow",
    ),
    # --- modern decoders (the options each is judged with: MODERN_OPTIONS)
    # Query head j reads KV head j % KV (tiled) instead of Hugging Face's j // (H/KV).
    "query_head_reads_kv_head_j_mod_kv": (
        REPEAT, REPEAT.replace("jnp.repeat(t, heads // n, axis=1)", "jnp.tile(t, (1, heads // n, 1, 1))"),
        "", (F32, True, False, "gqa_wide"), "numbers",
    ),
    "replicated_kv_head_j_mod_kv": (
        SHARED_INDEX, SHARED_INDEX.replace("// group - first", "% kv_heads"),
        "", (F32, True, False, "gqa_spanning"), "numbers",
    ),
    # The replicated K/V's per-query index skipped where a device reads as many KV heads as
    # it holds query heads (H = 6, KV = 2 on 3 devices: device 1 would pair 2, 3 with 0, 1).
    "replicated_kv_index_skipped": (
        KV_INDEX, "    if n == heads:\n        return t\n" + KV_INDEX,
        "", (F32, True, False, "gqa_misaligned"), "numbers",
    ),
    # Meta's interleaved pairs (2d, 2d+1) rotated instead of Hugging Face's (d, d + hd/2).
    "rope_on_interleaved_pairs": (
        ROTATE_HALF,
        "    t1, t2 = t[..., ::2], t[..., 1::2]\n"
        "    return jnp.stack([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1).reshape(t.shape)",
        "", (F32, True, False, "gqa"), "numbers",
    ),
    # Positions counted from 0 on each sequence shard (RoPE applied before the gather).
    "positions_restart_on_each_sequence_shard": (
        POSITIONS, POSITIONS.replace("jnp.arange(seq)[None]",
                                     "(jnp.arange(seq) % (seq // lax.axis_size('model')))[None]"),
        "", (F32, True, True, "gqa"), "numbers",
    ),
    # The segment mask dropped: a token attends across a document boundary.
    "attention_across_documents": (
        SEGMENTS, "        visible = visible", "", (F32, False, False, "packed"), "numbers",
    ),
    # A replicated KV head's gradient left unreduced over model: each device keeps device 0's.
    "replicated_kv_gradient_not_reduced": (
        SHARED_COPY, SHARED_COPY.replace("copy_to_region(params[name], axis_name, accum)",
                                         "_unreduced(params[name].astype(accum), axis_name)"),
        UNREDUCED, (F32, True, False, "gqa"), "numbers",
    ),
}  # fmt: skip

CORE = '    if _local_implementation(implementation, q, k, segment_ids) == "splash":'
CORE_KV = (
    "    if kv.index is not None:  # replicated K/V read by index: each query head's own KV head"
)
CORE_TOKENS = (
    "                         q_segments=segment_ids, k_segments=segment_ids, causal=causal,"
)

# The dispatch to the blocked path (``_core``), judged with ``implementation="auto"``.
BLOCKED_MUTANTS = {
    "blocked_path_not_causal": (
        CORE_TOKENS, CORE_TOKENS.replace("causal=causal", "causal=False"),
        "", (F32, True, False), "numbers",
    ),
    "blocked_path_across_documents": (
        CORE_TOKENS, CORE_TOKENS.replace("q_segments=segment_ids, k_segments=segment_ids",
                                         "q_segments=None, k_segments=None"),
        "", (F32, False, False, "packed"), "numbers",
    ),
    # The replicated K/V's per-query index skipped: the core groups the held KV heads by
    # position instead (device 0 of H = 6, KV = 2 on 3 devices reads KV heads 0, 1).
    "blocked_path_kv_index_skipped": (
        CORE_KV, CORE_KV.replace("kv.index is not None", "False"),
        "", (F32, True, False, "gqa_misaligned"), "numbers",
    ),
}  # fmt: skip

# The options of the modern-decoder configurations (``check_attention`` keywords).
MODERN_OPTIONS = {
    "gqa": dict(num_kv_heads=2, rope_theta=10000.0),
    "gqa_wide": dict(d_model=64, num_heads=16, num_kv_heads=8),  # 2 KV heads a device on 4
    "gqa_misaligned": dict(
        d_model=24, num_heads=6, num_kv_heads=2, rope_theta=10000.0, meshes=[(3,), (2, 3)]
    ),
    "gqa_spanning": dict(d_model=48, num_heads=12, num_kv_heads=6, rope_theta=10000.0),
    "packed": dict(num_kv_heads=4, rope_theta=10000.0, documents=3),
}

# x entering the region as a plain (invariant) cast and projected by three separate matmuls:
# still the right numbers, but each matmul then all-reduces its own dx: three backward
# AllReduces, not one.
THREE_DX_REDUCTIONS = (
    "        x = copy_to_region(x, axis_name, accum)  # x[B, S, D] in accum",
    "        x = x.astype(accum)  # x[B, S, D] in accum",
    """

def projections(x, params, heads, kv_heads, precision):
    q = _heads(precision.matmul(x, params["wq"]), params.get("bq"), heads, precision)
    k = _heads(precision.matmul(x, params["wk"]), params.get("bk"), kv_heads, precision)
    v = _heads(precision.matmul(x, params["wv"]), params.get("bv"), kv_heads, precision)
    return q, k, v
""",
)

NORM_MUTANTS = {
    # An extra psum on the parameter gradients (Megatron's manual all-reduce on top of
    # check_vma's): dscale × p.
    "extra_psum_on_scale_grad": (
        "        y = y * scale.astype(STATS_DTYPE)  # [..., D]",
        "        y = y * _psum_grad(scale.astype(STATS_DTYPE))  # [..., D]",
        EXTRA_PSUM, ("rms_norm", F32),
    ),
    # Layer-norm statistics in bf16 under the bf16 policy.
    "statistics_in_bf16": (
        "    x32 = x.astype(STATS_DTYPE)  # x[..., D] in f32\n",
        "    x32 = x  # x[..., D] in f32\n",
        "", ("layer_norm", BF16),
    ),
}  # fmt: skip


def load(kind: str, old: str, new: str, extra: str) -> types.ModuleType:
    """A copy of ``_{kind}.py`` with ``old`` replaced by ``new`` (and ``extra`` appended). For
    ``kind="attention"`` the line may be in any module of ``FAMILY``: copies of the whole
    family, that module's mutated, each calling the others' copies; returns ``_attention``'s."""
    if kind != "attention":
        return _load(kind, old, new, extra)
    owners = [name for name in FAMILY if SOURCES[name].count(old)]
    assert len(owners) == 1, f"mutated line not found in one attention module: {old!r}"
    copies = {
        name: _load(name, old, new, extra) if name == owners[0] else _load(name, "", "", "")
        for name in FAMILY
    }
    for copy in copies.values():
        for name, other in copies.items():
            if hasattr(copy, f"_{name}"):
                setattr(copy, f"_{name}", other)
    return copies["attention"]


def _load(kind: str, old: str, new: str, extra: str) -> types.ModuleType:
    source = SOURCES[kind]
    assert source.count(old) == 1 or not old, f"mutated line not once in _{kind}.py: {old!r}"
    module = types.ModuleType(f"shardops.layers._{kind}_mutant")
    exec("from jax import lax", module.__dict__)  # the mutants' own lines may call lax
    code = compile(
        source.replace(old, new) + extra if old else source + extra,
        f"<mutant of shardops/layers/_{kind}.py>",
        "exec",
    )
    exec(code, module.__dict__)
    return module


@pytest.fixture
def swap(monkeypatch):
    def swap(kind: str, module):
        monkeypatch.setattr(_attention_checks, kind, module)
        jax.clear_caches()  # drop programs traced with the real module

    yield swap
    jax.clear_caches()


def suite_check(config, caught_by="any", implementation="einsum"):
    """The suite's checks of ``config``, run with ``implementation`` (the mutants of the S×S
    path and of the kernel around it are judged on the einsum path, whose bf16 bound is the
    tightest; ``BLOCKED_MUTANTS`` on the default)."""
    precision, causal, sequence_parallel, *modern = config
    options = dict(MODERN_OPTIONS[modern[0]]) if modern else {}
    meshes = options.pop("meshes", [(4,), (2, 4)])
    if caught_by in ("numbers", "any"):
        for mesh_shape in meshes:
            check_attention(mesh_shape, precision, batch=4, seq=8, causal=causal,
                            sequence_parallel=sequence_parallel, implementation=implementation,
                            **options)  # fmt: skip
    if caught_by in ("dtype flow", "any"):
        check_attention_dtype_flow((2, 4), precision, causal=causal,
                                   sequence_parallel=sequence_parallel,
                                   implementation=implementation)  # fmt: skip


# The configurations the mutants are judged in; the unmutated copy must pass each one.
CONFIGS = sorted({(m[3], "einsum") for m in ATTENTION_MUTANTS.values()}
                 | {(m[3], "auto") for m in BLOCKED_MUTANTS.values()}, key=repr)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "implementation"),
    CONFIGS,
    ids=lambda c: (
        c if isinstance(c, str) else f"{c[0].name}-causal{c[1]}-sp{c[2]}-" + "".join(c[3:])
    ),
)
def test_unmutated_copy_passes(swap, config, implementation):
    """The harness itself causes no failure: a copy with a no-op replacement passes."""
    swap("attention", load("attention", MASK, MASK, ""))
    suite_check(config, implementation=implementation)


@pytest.mark.parametrize("name", [*ATTENTION_MUTANTS, *BLOCKED_MUTANTS])
def test_attention_mutant_is_caught(swap, name):
    blocked = name in BLOCKED_MUTANTS
    old, new, extra, config, caught_by = (BLOCKED_MUTANTS if blocked else ATTENTION_MUTANTS)[name]
    assert new != old or extra, f"mutant {name} changes nothing"
    swap("attention", load("attention", old, new, extra))
    with pytest.raises((AssertionError, ValueError)) as caught:
        suite_check(config, caught_by, "auto" if blocked else "einsum")
    if isinstance(caught.value, ValueError):  # only check_vma's trace-time verdict counts
        assert "out_specs" in str(caught.value) or "vma" in str(caught.value), caught.value


def test_three_dx_reductions_are_caught_by_the_collective_budget(swap):
    swap("attention", load("attention", *THREE_DX_REDUCTIONS))
    suite_check((F32, True, False), "numbers", "auto")  # numerically still right...
    requested, compiled = requested_and_compiled((2, 4), F32, sequence_parallel=False)
    expected = BUDGETS["replicated"][1]  # (AR, model): V forward + V backward
    assert requested != expected  # ...but it asks for three backward dx all-reduces,
    one = expected[("all-reduce", ("model",))] // 2
    assert requested[("all-reduce", ("model",))] == one + 3 * one
    assert compiled == requested  # and XLA does not combine them


@pytest.mark.parametrize("name", NORM_MUTANTS)
def test_unmutated_norms_copy_passes(swap, name):
    old, _, extra, (kind, precision) = NORM_MUTANTS[name]
    swap("norms", load("norms", old, old, extra))
    check_sequence_parallel_norm(kind, (2, 4), precision)


@pytest.mark.parametrize("name", NORM_MUTANTS)
def test_norm_mutant_is_caught(swap, name):
    old, new, extra, (kind, precision) = NORM_MUTANTS[name]
    swap("norms", load("norms", old, new, extra))
    with pytest.raises(AssertionError):
        check_sequence_parallel_norm(kind, (2, 4), precision)


# --- heads split mid-head under tp: the plan's and ctx.attention's checks (test_errors.py) ------

HEAD_CHECK_MUTANTS = {
    # The plan splits wq by columns whatever the heads (no num_heads, or one 4 does not divide).
    "plan_whole_heads_unchecked": (
        "plan",
        "            _check_whole_heads(path, shapes, axis, axis_size, num_heads)",
        "            pass",
    ),
    "plan_head_count_unchecked": ("plan", "    if num_heads % axis_size:", "    if False:"),
    # ctx.attention trusts the plan's KV count: the kernel's in_specs advice is the first word.
    "attention_kv_as_planned_unchecked": (
        "tensor",
        "    if split and isinstance(kv_heads, int) and kv_heads % n:",
        "    if False:",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", HEAD_CHECK_MUTANTS)
def test_head_check_mutant_is_caught(name, monkeypatch):
    import test_errors
    from _mutants import mutant

    import shardops_models as models
    from shardops_models.strategies import layout, plan, tensor

    where, line, replacement = HEAD_CHECK_MUTANTS[name]
    if where == "plan":
        module = mutant(plan, name, line, replacement)
        run = lambda: test_errors.check_the_plan_refuses_heads_split_mid_head(module)  # noqa: E731
    else:  # the strategies' tensor kind from the mutated copy of models/strategies/tensor.py
        monkeypatch.setattr(
            layout, "TensorKind", mutant(tensor, name, line, replacement).TensorKind
        )
        run = lambda: test_errors.check_attention_refuses_kv_heads_split_by_another_count(  # noqa: E731
            models.build
        )
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        run()
