"""Mutation check: known flash-attention bugs, injected into copies of shardops/layers/_flash.py,
are caught by ``test_flash``'s own check (values and every gradient against float64); a key
block not clipped to the sequence (the same values, 8× the work) by the block shapes read from
the program (``check_key_blocks_clipped``).

Each mutant replaces one exact line of the real source (``tests/_mutants.py``: the line must
be there exactly once, so a mutant cannot drift from the code) and is run on the case that
exposes it; an unmutated copy passes the same cases.
"""

import pytest
from _mutants import mutant
from test_flash import CASES, check_against_reference, check_key_blocks_clipped

from shardops.layers import _flash

RESCALE = "    acc = alpha[..., None] * acc  # [B, n, g, S, hd]: the running-max rescale"
D_TERM = "        ds = p * (dp - delta[..., None]) * scale  # dS[B, n, g, Sq, block] float32"
CAUSAL = "visible & (key_positions[None, :] <= q_positions[:, None])"
DK = 'dk_block = _product("bngqk,bngqd->bnkd", ds, qg, precision)'
DV = 'dv_block = _product("bngqk,bngqd->bnkd", p, dog, precision)'
GROUPS = "reshape(batch, n, heads // n, seq, hd)  # [B,n,g,S,hd]"
PADDING = "real = (np.arange(blocks * block) < seq)"

SEGMENT_BLOCKS = (
    "segments = k_segments.reshape(batch, blocks, block).transpose(1, 0, 2)  # [nb, B, block]"
)
KEY_POSITIONS = "    return k, v, k_positions.reshape(blocks, block), jnp.asarray(real), segments"

# name → (line, replacement, the case that catches it)
MUTANTS = {
    # Every key block masked with the first block's segment ids: a document boundary in a
    # later block is lost (and a document reaching across blocks cut).
    "segment_mask_of_the_first_block": (
        SEGMENT_BLOCKS,
        "segments = jnp.broadcast_to(k_segments[None, :, :block], (blocks, batch, block))",
        "ragged_causal_segments",
    ),
    # The causal mask off by one block: each block's keys taken to sit a block earlier, so a
    # query sees the next block's keys.
    "causal_mask_off_by_one_block": (
        KEY_POSITIONS,
        KEY_POSITIONS.replace(
            "k_positions.reshape(blocks, block)", "k_positions.reshape(blocks, block) - block"
        ),
        "ragged_causal_segments",
    ),
    # The accumulator is not rescaled when the running maximum grows: blocks summed under an
    # older, smaller maximum are over-weighted.
    "running_max_rescale_omitted": (RESCALE, "    acc = acc", "plain"),
    # dS = P∘dP: the backward forgets D = rowsum(dO∘O), the softmax's normalisation term.
    "backward_d_term_dropped": (D_TERM, "        ds = p * dp * scale", "plain"),
    # The causal mask off by one: a query no longer sees itself (j < i).
    "causal_mask_hides_the_diagonal": (CAUSAL, CAUSAL.replace("<=", "<"), "causal"),
    # dk / dv take only the first query head of each KV head's group instead of their sum.
    "dk_not_summed_over_the_group": (
        DK,
        DK.replace("->bnkd", "->bngkd").replace("precision)", "precision)[:, :, 0]"),
        "gqa_causal_segments",
    ),
    "dv_not_summed_over_the_group": (
        DV,
        DV.replace("->bnkd", "->bngkd").replace("precision)", "precision)[:, :, 0]"),
        "gqa_causal_segments",
    ),
    # Query heads grouped by stride (head j reads KV head j % n) instead of j // (H/n).
    "query_heads_grouped_by_stride": (
        GROUPS,
        "reshape(batch, heads // n, n, seq, hd).swapaxes(1, 2)",
        "gqa_causal_segments",
    ),
    # The padded keys of a ragged last block are not masked (S=40 in blocks of 16).
    "padding_keys_visible": (
        PADDING,
        "real = (np.arange(blocks * block) < seq + 16)",
        "ragged_last_block",
    ),
}


# The key block clipped to the keys (S) in each entry point: the line, then the next one,
# which tells the three apart.
CLIP = "    block = min(int(block_k), k.shape[2])\n"
UNCLIPPED = "    block = int(block_k)\n"
ENTRIES = {
    "attend": "    with jax.named_scope(",  # blocked_attention and the layer's blocked path
    "attention_with_lse": "    return _forward(",  # a ring step's forward
    "attention_backward": "    return _backward(",  # a ring step's backward
}
# name → (line, replacement): each caught by check_key_blocks_clipped; the padded keys are
# masked, so the values stay right (the value check above passes on them).
BLOCK_MUTANTS = {
    f"{entry}_key_block_not_clipped": (CLIP + after, UNCLIPPED + after)
    for entry, after in ENTRIES.items()
}


@pytest.mark.parametrize("name", BLOCK_MUTANTS)
def test_an_unclipped_key_block_is_caught(name):
    line, replacement = BLOCK_MUTANTS[name]
    module = mutant(_flash, name, line, replacement)
    with pytest.raises(AssertionError, match="the key block is not clipped"):
        check_key_blocks_clipped(module)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    line, replacement, case = MUTANTS[name]
    module = mutant(_flash, name, line, replacement)
    with pytest.raises(AssertionError, match="off by"):
        check_against_reference(module.blocked_attention, CASES[case])


def test_an_unmutated_copy_passes():
    """The harness itself (loading a copy) does not make the checks fail."""
    module = mutant(_flash, "unmutated", RESCALE, RESCALE)
    check_key_blocks_clipped(module)
    for case in {case for _, _, case in MUTANTS.values()}:
        check_against_reference(module.blocked_attention, CASES[case])
