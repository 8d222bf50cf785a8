"""Mutation check: known context-parallel attention bugs, injected into copies of
shardops/layers/_context_attention.py and _ring_attention.py, are caught by the suite's own checks.

Each mutant replaces one exact line of the real source (``_mutants.mutant``: the test fails if the
line is not there exactly once), is swapped in where ``_context_checks`` looks the layer up, and
must fail ``check_context_attention`` (forward and every gradient against float64) or the ledger
formulas of ``test_context_attention``, on the one case named with it.
"""

import _context_checks
import jax
import pytest
from _context_checks import CONTEXT, check_context_attention, context_ledger
from _mutants import copies
from test_context_attention import HEADS, B, _expected, _weights

from shardops.layers import init_attention


def mutant(name: str, line: str, replacement: str):
    """A copy of ``_context_attention`` (and of ``_ring_attention``, which it runs) with ``line``
    replaced in the one of them that holds it."""
    modules = ("_ring_attention", "_context_attention")  # in import order
    return copies("shardops.layers", modules, name, line, replacement)["_context_attention"]


RING4 = ((CONTEXT, 4),)
THREE = (("data", 2), (CONTEXT, 2), ("model", 2))

# name → (line, replacement, (mesh, method, options) of the check that catches it)
MUTANTS = {
    # The forward ring stops one step short: each query misses one device's keys.
    "ring_step_short": (
        "    for t in range(n):  # ring steps: the block of device r − t",
        "    for t in range(n - 1):  # ring steps: the block of device r − t",
        (RING4, "ring", {"causal": False}),
    ),
    # The backward ring one step short: one block's dq, dk, dv contributions are lost.
    "backward_ring_step_short": (
        "    for t in range(n):  # ring steps: the block of device r + t",
        "    for t in range(n - 1):  # ring steps: the block of device r + t",
        (RING4, "ring", {"causal": False}),
    ),
    # The causal mask on local positions: every held block's keys masked as if they were the
    # device's own tokens.
    "ring_mask_on_local_positions": (
        "        k_pos = _local_positions(owner, n, s)\n\n        def step(carry, rows, cols, "
        "held=held, k_pos=k_pos, owner=owner):\n            o, lse = carry",
        "        k_pos = _local_positions(r, n, s)\n\n        def step(carry, rows, cols, "
        "held=held, k_pos=k_pos, owner=owner):\n            o, lse = carry",
        (RING4, "ring", {}),
    ),
    "allgather_mask_on_local_positions": (
        "    q_pos = _local_positions(lax.axis_index(axis), n, s)  # [s]",
        "    q_pos = jnp.arange(s, dtype=jnp.int32)  # [s]",
        (RING4, "allgather", {}),
    ),
    # The ring steps merged without their log-sum-exp weights (the rescale of the earlier ones).
    "rescale_skipped": (
        "            o_new, lse_new = _flash.merge(_half(o, rows, 2), _half(lse, rows, 2), o_t, lse_t)",
        "            o_new, lse_new = _half(o, rows, 2) + o_t, jnp.logaddexp(_half(lse, rows, 2), "
        "lse_t)",
        (RING4, "ring", {"causal": False}),
    ),
    # The balancing permutation not undone on the output.
    "permutation_not_inverted": (
        "    return y[:, inverse_order(x.shape[1], n)] if permute else y",
        "    return y",
        (RING4, "allgather", {"causal": False}),
    ),
    # dK/dV left with the device that held them last, not returned home.
    "dkv_not_returned_home": (
        "        dk, dv = _pass_on((dk, dv), axis, _BACK)",
        "        dk, dv = dk, dv",
        (RING4, "ring", {}),
    ),
    # dK/dV sent on the forward way round: to the device after, not the owner (N > 2).
    "dkv_to_the_wrong_device": (
        "        dk, dv = _pass_on((dk, dv), axis, _BACK)",
        "        dk, dv = _pass_on((dk, dv), axis, 1)",
        (RING4, "ring", {}),
    ),
    # Ulysses' all-to-all splitting the head dim instead of the heads (the sequence gathered,
    # every head kept with hd/N of its features): every shape still agrees.
    "ulysses_wrong_dims": (
        "    to_heads, to_seq = _AllToAll(axis, 1, 2, _ULYSSES), _AllToAll(axis, 2, 1, _ULYSSES)",
        "    to_heads, to_seq = _AllToAll(axis, 3, 2, _ULYSSES), _AllToAll(axis, 2, 3, _ULYSSES)",
        (RING4, "ulysses", {"num_kv_heads": 8}),
    ),
    # Segment ids that do not travel with the keys: a query attends across a document
    # boundary that falls between two shards.
    "ring_segments_stay_home": (
        "q_seg, k_seg = _block_of(seg_all, r, s), _block_of(seg_all, owner, s)",
        "q_seg, k_seg = _block_of(seg_all, r, s), _block_of(seg_all, r, s)",
        (RING4, "ring", {"documents": 3}),
    ),
    "allgather_segments_stay_home": (
        "        k_seg = all_gather(segment_ids, axis, axis=1, reason=_SEGMENTS)  # [B, S]",
        "        k_seg = jnp.tile(segment_ids, (1, n))  # [B, S]",
        (THREE, "allgather", {"documents": 3, "num_kv_heads": 4}),
    ),
}  # fmt: skip


@pytest.fixture
def swap(monkeypatch):
    def use(name):
        line, replacement, _ = MUTANTS[name]
        module = mutant(name, line, replacement)
        monkeypatch.setattr(_context_checks, "context", module)
        jax.clear_caches()  # drop programs traced with the real module

    yield use
    jax.clear_caches()


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(swap, name):
    axes, method, options = MUTANTS[name][2]
    options = {"num_kv_heads": 2, "causal": True, **options}
    if method == "ulysses" and options["num_kv_heads"] % 4:
        options["num_kv_heads"] = HEADS
    swap(name)
    with pytest.raises(AssertionError, match="bound"):
        check_context_attention(axes, method, seq=32, **options)


def test_the_real_module_passes_every_mutants_check():
    for _, _, (axes, method, options) in MUTANTS.values():
        check_context_attention(axes, method, seq=32, **{"num_kv_heads": 2, "causal": True,
                                                         **options})  # fmt: skip


def test_ring_ledger_catches_a_ring_that_sends_replicated_heads(swap):
    """GQA sends only the KV heads: a ring that expands K/V to every query head before passing
    them moves H/KV times the bytes (torchtitan 1283) and fails the ledger formula."""
    MUTANTS["ring_sends_query_heads"] = (
        '        if index is not None and self.method == "ulysses":  # the heads split needs each',
        "        if True:  # the heads split needs each",
        None,
    )
    try:
        swap("ring_sends_query_heads")
        led = context_ledger(RING4, "ring", num_kv_heads=2)
    finally:
        del MUTANTS["ring_sends_query_heads"]
    want, _ = _expected("ring", 4, b=B, h=HEADS, kv=2, documents=1)
    want["backward"][("all-reduce", (CONTEXT,))] = _weights(HEADS, 2)
    got = led.by_pass()
    assert {p: got[p] for p in want} != want


# The size checks before tracing (test_context_attention's ``check_*``, run on the mutated
# module): name → (line, replacement, the check that must fail on it).
ERROR_MUTANTS = {
    # S = 0 divides by 2N: let through, the trace divides by the empty chunk.
    "empty_sequence_accepted": (
        "    if seq >= 1 and seq % multiple == 0:",
        "    if seq % multiple == 0:",
        "check_an_empty_sequence_is_refused",
    ),
    # The kernel's own check of its local block (a user's shard_map skips the layer's).
    "kernel_empty_block_accepted": (
        "        if seq < 2 or seq % 2:",
        "        if seq % 2:",
        "check_an_empty_sequence_is_refused",
    ),
    "balanced_order_of_nothing": (
        "    if seq < 1 or seq % (2 * n):",
        "    if seq % (2 * n):",
        "check_an_empty_sequence_is_refused",
    ),
    # A suggested length rounded up from below the multiple: 0 for S = 0.
    "suggests_zero": (
        "    return max(-(-seq // multiple), 1) * multiple",
        "    return -(-seq // multiple) * multiple",
        "check_suggested_lengths_are_positive_and_valid",
    ),
    # Sequence parallelism's split of each device's block forgotten in the multiple.
    "sequence_parallel_multiple_forgotten": (
        "    multiple = n * math.lcm(2, p if model_axis is not None else 1)",
        "    multiple = 2 * n",
        "check_suggested_lengths_are_positive_and_valid",
    ),
    # The kernel's suggestion under sequence parallelism forgets the model axis's split.
    "kernel_suggestion_without_sequence_parallelism": (
        "            multiple = n * math.lcm(2, sequence_split)",
        "            multiple = 2 * n",
        "check_an_odd_block_under_sequence_parallelism_suggests_a_length_that_fits",
    ),
    # The kernels' Ulysses head check lost: JAX's all-to-all is the first to object.
    "ulysses_heads_unchecked_in_the_kernel": (
        "            check_ulysses_heads(op, heads, kv_sent, self.axis_name, n)",
        "            pass",
        "check_ulysses_heads_in_a_users_shard_map",
    ),
    # The heads sent counted without the expansion of K/V read by index.
    "ulysses_counts_projected_kv_heads": (
        "    return heads, heads if count > 1 else count",
        "    return heads, count",
        "check_ulysses_heads_sent_by_hand",
    ),
}  # fmt: skip


def run_error_check(name, module) -> None:
    import test_context_attention

    check = ERROR_MUTANTS[name][2]
    params = init_attention(jax.random.key(0), 32, HEADS, 4, num_kv_heads=2)
    takes_params = check in ("check_an_empty_sequence_is_refused",
                             "check_ulysses_heads_in_a_users_shard_map")  # fmt: skip
    getattr(test_context_attention, check)(module, *((params,) if takes_params else ()))


@pytest.mark.parametrize("name", ERROR_MUTANTS)
def test_error_checks_pass_on_an_unmutated_copy(name):
    """Each mutant's check passes on a copy of the module made the same way, so a mutant is
    caught by what it changed, not by the copy."""
    line = ERROR_MUTANTS[name][0]
    run_error_check(name, mutant(f"unmutated_{name}", line, line))


@pytest.mark.parametrize("name", ERROR_MUTANTS)
def test_error_mutant_is_caught(name):
    line, replacement, check = ERROR_MUTANTS[name]
    module = mutant(name, line, replacement)
    try:
        run_error_check(name, module)
    except Exception:  # the check failed (pytest's own failures and the trace's errors alike)
        return
    except pytest.fail.Exception:
        return
    pytest.fail(f"mutant {name} passed {check}")
