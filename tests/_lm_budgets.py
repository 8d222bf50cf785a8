"""Literal expectations for the collectives of one GPT / Llama train step, written by hand from
the models' shapes: per (kind, mesh axes, dtype), how many collectives the traced step asks
for and the bytes V they move (V as ``shardops.inspect.collectives`` counts it: the full tensor
reduced or assembled; the ring formulas are ``_layout_checks.RING_BYTES``'s).

``check_budget`` (tests/_gpt_checks.py) compares the step's own traced budget with its
compiled program, which holds by construction for any program: a collective added to the
step, or one reduced in bfloat16, passes it. Here nothing is derived from the library: the
traced budget must equal these numbers (count, bytes and dtype), and so must the compiled
program (bytes and dtype; XLA:CPU combines all-reduces, so its op count is not the step's).
The mutation modules (test_gpt_mutations.py, test_llama_mutations.py) show both.

Each case is one the suites already compile (tests/networks/test_gpt.py, test_llama.py,
tests/strategies/test_context_parallel.py): one per strategy, one per context-parallel method,
and a Llama; test_lm_budgets.py checks that each is still run.

The GPT (``_gpt_checks.GPT``): V = 64, D = 32, H = 8 heads of 4, F = 64, L = 1, S = 16;
global batch B = 16. Its parameters, float32 bytes:
    embed  table[64, 32] 8,192    pos table[16, 32] 2,048
    block  ln1 scale+bias 256; attention wq, wk, wv, wo [32, 32] 4 × 4,096, bq, bv, bo
           [32] 3 × 128 (no key bias) = 16,768; ln2 256; up w[32, 64] 8,192 + b[64] 256;
           down w[64, 32] 8,192 + b[32] 128
    head   ln_f 256, w[32, 64] 8,192
    total  52,736 bytes in 20 leaves.
Megatron's plan splits over model (p): the table by vocabulary, wq/wk/wv/bq/bv by heads (column),
wo by rows, up column (w and b), down row, head column; replicated: pos 2,048, ln1, ln2, ln_f
3 × 256, bo 128, down.b 128 = 3,072 bytes. A device's model shard of the parameters is then
49,664 / p + 3,072 bytes: p = 2 → 27,904; p = 4 → 15,488.

Per block under tp (Megatron), with x[b, S', D] float32 = b · S' · 128 bytes (b the local
batch, S' the local sequence): forward AllReduces of the embedding (vocab-parallel lookup),
the attention output (row wo) and the MLP output (row down); backward AllReduces of dx of the
three column layers (attention's qkv, up, head); the vocab-parallel loss AllReduces three
float32 [b, S'] values (max, Σ exp, target logit). Under sp the three forward AllReduces are
ReduceScatters along S and the three column inputs AllGathers along S (their transposes in
the backward: 6 AllGathers and 6 ReduceScatters of the whole x[b, S', D]), and four more kinds
of AllReduce over model: the 6 norm scale/bias gradients (128 bytes each, replicated
parameters applied to sequence shards), the two row biases bo and down.b (128 each), and the
position embedding's dx[b, S', D] (it is looked up whole, then sliced to the device's block).
"""

from __future__ import annotations

from collections import Counter

import shardops

AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
A2A, PERMUTE = "all-to-all", "collective-permute"
F32 = "f32"
DATA, MODEL, REPLICA, CONTEXT = ("data",), ("model",), ("replica",), ("context",)
REPLICA_DATA, DATA_CONTEXT = ("replica", "data"), ("data", "context")

GPT_NAME = "gpt L=1 D=32 H=8 F=64 V=64 S≤16"
GQA_NAME = "llama L=2 D=32 H=8/2 F=172 V=97 S≤16"
CLIP = 0.25  # test_llama.CLIP: every Llama case clips
LOSS = {(AR, DATA, F32): (1, 4)}  # the global loss: one float32 summed over the batch axes


def _tp(x_bytes: int, loss_bytes: int) -> dict:
    """tp on model: 3 forward + 3 backward AllReduces of x, 3 of the loss's [b, S'] values."""
    return {(AR, MODEL, F32): (9, 6 * x_bytes + 3 * loss_bytes)}


def _sp(x_bytes: int, loss_bytes: int) -> dict:
    """sp on model (see the module docstring): 6 AllGathers and 6 ReduceScatters of the whole
    x; AllReduces: 3 loss values, 6 norm leaves and 2 row biases of 128 bytes, the position
    embedding's dx (x's bytes): 12."""
    return {
        (AG, MODEL, F32): (6, 6 * x_bytes),
        (RS, MODEL, F32): (6, 6 * x_bytes),
        (AR, MODEL, F32): (12, 3 * loss_bytes + 8 * 128 + x_bytes),
    }


def _fsdp(axes, count: int, nbytes: int) -> dict:
    """FSDP over ``axes``: ``count`` AllGathers in the forward of ``nbytes`` in all (every
    parameter's model shard, once: no remat), the same ReduceScatters of the gradients."""
    return {(AG, axes, F32): (count, nbytes), (RS, axes, F32): (count, nbytes)}


# (model name, strategy, mesh, optimizer, clip, remat) → {(kind, axes, dtype): (count, V bytes)}
# fmt: off
EXPECTED = {
    # dp on data = 8: every leaf's gradient AllReduced (20 leaves, 52,736 bytes) + the loss.
    (GPT_NAME, "dp", "data8", "sgd", None, False): {(AR, DATA, F32): (21, 52_736 + 4)},
    # tp on model = 2 (replica and data hold replicas, B = 16 whole): x[16, 16, 32] = 32,768;
    # loss values [16, 16] = 1,024. 6 · 32,768 + 3 · 1,024 = 199,680.
    (GPT_NAME, "tp", "2x2x2", "sgd", None, False): _tp(32_768, 1_024),
    # sp on model = 8, B = 16: the whole x[16, 16, 32] = 32,768 per gather/scatter (6 · =
    # 196,608); AllReduce 3 · 1,024 + 8 · 128 + 32,768 = 36,864.
    (GPT_NAME, "sp", "model8", "sgd", None, False): _sp(32_768, 1_024),
    # 2d: data = 2 × model = 4, b = 8: model 6 · 16,384 + 3 · 512 = 99,840; data: each
    # device's model shard of every gradient, 15,488 (20 leaves), + the loss.
    (GPT_NAME, "2d", "2x4", "adam", None, False): {
        **_tp(16_384, 512), (AR, DATA, F32): (21, 15_488 + 4)},
    # dp_sp: data = 4 × model = 2, b = 4: x[4, 16, 32] = 8,192, loss [4, 16] = 256; data: the
    # model shards of 2 (27,904) + the loss.
    (GPT_NAME, "dp_sp", "4x2", "sgd", None, False): {
        **_sp(8_192, 256), (AR, DATA, F32): (21, 27_904 + 4)},
    # fsdp on data = 2 (replica and model hold replicas), b = 8. The leaves of a unit that
    # share dtype and varying axes travel in one AllGather; a dense w[...] alone (here every
    # one is gathered, none moves activations): embed + pos 10,240; the block's ln1, attention,
    # ln2, up.b, down.b 256 + 16,768 + 256 + 256 + 128 = 17,664; up.w, down.w, head.w 8,192
    # each; ln_f 256: 6 gathers of 52,736, the same 6 ReduceScatters back.
    (GPT_NAME, "fsdp", "2x2x2", "sgd", None, False): {**_fsdp(DATA, 6, 52_736), **LOSS},
    # hsdp: replica = 2 × data = 2 × (model = 2 of replicas), b = 4: fsdp's 6 gathers and
    # scatters over data, then each scattered shard (half of 52,736) AllReduced over replica;
    # the loss over replica × data.
    (GPT_NAME, "hsdp", "2x2x2", "sgd", None, False): {
        **_fsdp(DATA, 6, 52_736), (AR, REPLICA, F32): (6, 26_368),
        (AR, REPLICA_DATA, F32): (1, 4)},
    # fsdp_tp: data = 4 × model = 2, b = 4: model as tp with x[4, 16, 32] = 8,192; data
    # gathers the model shards (27,904) in 8 bundles: the table's [32, 32] 4,096 and pos 2,048
    # apart (varying over model or not); the block's model-split leaves (wq, wk, wv [32, 16],
    # bq, bv [16], wo [16, 32], up.b [32]) 8,448 and its replicated ones (ln1, bo, ln2,
    # down.b) 768; up.w, down.w, head.w [32, 32] 4,096 each; ln_f 256.
    (GPT_NAME, "fsdp_tp", "4x2", "adam", None, False): {
        **_tp(8_192, 256), **_fsdp(DATA, 8, 27_904), **LOSS},
    # fsdp_sp: data = 2 × model = 4, b = 8: sp with x[8, 16, 32] = 16,384, loss [8, 16] =
    # 512; under sp no dense weight moves activations, so the dense weights join the
    # bundles: table [16, 32], pos, head.w [32, 16] 2,048 each; the block's split leaves with
    # up.w and down.w (3 · 1,024 + 2 · 32 + 1,024 + 2,048 + 64 + 2,048) 8,320; its replicated
    # ones 768; ln_f 256: 6 bundles of 15,488.
    (GPT_NAME, "fsdp_sp", "2x4", "sgd", None, False): {
        **_sp(16_384, 512), **_fsdp(DATA, 6, 15_488), **LOSS},
    # hsdp_tp on replica = 1 × data = 2 × model = 4 (no replica collective: one device),
    # b = 8: tp with x[8, 16, 32] = 16,384; data gathers the model shards of 4 (15,488) in 8
    # bundles as fsdp_tp's; the loss over data.
    (GPT_NAME, "hsdp_tp", "1x2x4", "adam", None, False): {
        **_tp(16_384, 512), **_fsdp(DATA, 8, 15_488), **LOSS},
    # hsdp_sp: replica = 2 × data = 2 × model = 2, b = 4: sp with x[4, 16, 32] = 8,192; data
    # gathers the model shards of 2 (27,904) in 6 bundles as fsdp_sp's; each scattered shard
    # (13,952 in all) AllReduced over replica; the loss over replica × data.
    (GPT_NAME, "hsdp_sp", "2x2x2", "adam", None, False): {
        **_sp(8_192, 256), **_fsdp(DATA, 6, 27_904), (AR, REPLICA, F32): (6, 13_952),
        (AR, REPLICA_DATA, F32): (1, 4)},
    # zero1 on data = 2: in the optimizer every float32 partial gradient is ReduceScattered
    # (each of the 20 leaves has a dim that divides by 2) and every updated parameter shard
    # AllGathered back: 52,736 each way; the loss.
    (GPT_NAME, "zero1", "2x2x2", "sgd", None, False): {
        (RS, DATA, F32): (20, 52_736), (AG, DATA, F32): (20, 52_736), **LOSS},
    # zero1_tp: data = 2 × model = 2, b = 8: tp with x[8, 16, 32] = 16,384; zero1 over data
    # on each device's model shard (27,904), leaf by leaf.
    (GPT_NAME, "zero1_tp", "2x2x2", "sgd", None, False): {
        **_tp(16_384, 512), (RS, DATA, F32): (20, 27_904), (AG, DATA, F32): (20, 27_904),
        **LOSS},
    # Context parallelism. dp + ring on data = 2 × context = 4, b = 8, S/4 = 4 tokens: every
    # gradient and the loss AllReduced over data × context (as dp's); K and V blocks
    # [8, 8 heads, 4, 4] = 4,096 bytes: the forward ring passes both 3 times (6 permutes), the
    # backward passes them 3 times the other way and dK, dV 4 times home (14): 20 · 4,096.
    (GPT_NAME, "dp+ring", "2x4c", "sgd", None, False): {
        (AR, DATA_CONTEXT, F32): (21, 52_736 + 4), (PERMUTE, CONTEXT, F32): (20, 81_920)},
    # 2d + allgather on data = 2 × context = 2 × model = 2, b = 8, S/2 = 8 tokens: tp with
    # x[8, 8, 32] = 8,192 and loss values [8, 8] = 256; K and V gathered over context,
    # [8, 4 heads, 16, 4] = 8,192 each, and dK, dV ReduceScattered back; the model shards of
    # 2 (27,904) and the loss AllReduced over data × context.
    (GPT_NAME, "2d+allgather", "2x2x2c", "sgd", None, False): {
        **_tp(8_192, 256), (AG, CONTEXT, F32): (2, 16_384), (RS, CONTEXT, F32): (2, 16_384),
        (AR, DATA_CONTEXT, F32): (21, 27_904 + 4)},
    # sp + ulysses on context = 2 × model = 4, B = 16 whole, S/2 = 8 tokens: sp with
    # x[16, 8, 32] = 16,384 and loss values [16, 8] = 512; q, k, v AllToAll'd from sequence to
    # heads and the output back ([16, 8, 2 heads, 4] = 4,096 each: 4 forward, 4 backward);
    # the model shards of 4 (15,488) and the loss AllReduced over context.
    (GPT_NAME, "sp+ulysses", "c2x4", "sgd", None, False): {
        **_sp(16_384, 512), (A2A, CONTEXT, F32): (8, 32_768),
        (AR, CONTEXT, F32): (21, 15_488 + 4)},
    # The Llama (test_llama.GQA): V = 97 stored as 104, D = 32, H = 8, 2 KV heads, F = 172
    # stored as 176, L = 2 stacked blocks (a scan: its body counted twice), clipped SGD. tp on
    # model = 8, B = 16: x[16, 16, 32] = 32,768. Forward: the embedding and, per layer, the
    # attention output and the gated MLP's down (5); backward: dx of the head and, per layer,
    # of attention's and the MLP's column inputs (5): 10 · 32,768 = 327,680. The 2 KV heads
    # do not split over 8: wk, wv [32, 2 · 4] stay replicated and their gradients AllReduce
    # (4 · 1,024). The loss: 3 · [16, 16] = 3 · 1,024. Clipping: the squared norms of the
    # model shards summed over model, one float32.
    (GQA_NAME, "tp", "model8", "sgd", CLIP, False): {
        (AR, MODEL, F32): (10 + 4 + 3 + 1, 327_680 + 4_096 + 3_072 + 4)},
}
# fmt: on


def by_dtype(collectives) -> dict:
    """``{(kind, axes, dtype): (count, bytes)}`` of ``collectives``, leaving out those that
    move nothing; a combined tuple counts once per dtype it holds."""
    count, nbytes = Counter(), Counter()
    for c in collectives:
        if not c.bytes:
            continue
        for key in {(c.kind, c.axes, d) for d in c.dtypes}:
            count[key] += 1
        for (dtype, _), b in zip(c.shapes, c.element_bytes, strict=True):
            nbytes[(c.kind, c.axes, dtype)] += b
    return {k: (count[k], nbytes[k]) for k in nbytes}


def check_hand_budget(case, setup, compiled, batch_shape) -> None:
    """The traced step asks for exactly ``EXPECTED[case]`` (count, bytes, dtype per kind and
    axes), and the compiled program moves those bytes in those dtypes."""
    expected = EXPECTED[case]
    traced = by_dtype(setup.budget(*batch_shape).requested)
    assert traced == expected, (
        f"{case}: the traced step asks for {_diff(traced, expected)} (count, bytes); "
        f"the hand-written budget says otherwise"
    )
    moved = {k: b for k, (_, b) in by_dtype(shardops.inspect.collectives(setup.mesh, compiled)).items()}  # fmt: skip
    want = {k: b for k, (_, b) in expected.items()}
    assert moved == want, f"{case}: the compiled step moves {_diff(moved, want)} (bytes)"


def _diff(got: dict, want: dict) -> str:
    keys = sorted(set(got) | set(want))
    return "; ".join(f"{k}: {got.get(k)} != expected {want.get(k)}" for k in keys
                     if got.get(k) != want.get(k)) or "the same"  # fmt: skip
