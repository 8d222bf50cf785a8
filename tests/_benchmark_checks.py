"""Hand-worked figures of benchmarks/accelerator.py, each a literal worked out in its comment
(never the code's own formula): the measured matmul peak's FLOP count, the specification
table, the Llama's FLOPs per token (with experts, and the benchmark's two models), the train
state's bytes, the peak-memory formula, the offload decision and MFU.

Shared by tests/test_benchmark_arithmetic.py and its mutation module
(tests/test_benchmark_arithmetic_mutations.py): each check takes the module it checks (the
benchmark, or ``models.networks.llama``), so a mutated copy runs the same check; every
failure is an AssertionError. Arithmetic only: the one compiled program is a four-line toy
(``check_memory_of``) and the peak's 4 × 4 chain.
"""

import importlib.util
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parent.parent


def load_accelerator() -> types.ModuleType:
    """benchmarks/accelerator.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_accelerator_arithmetic", ROOT / "benchmarks" / "accelerator.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _RecordingJax:
    """``jax`` as a module under test sees it, recording the functions it jits."""

    def __init__(self):
        self.jitted = []

    def __getattr__(self, name):
        return getattr(jax, name)

    def jit(self, fun, **kwargs):
        self.jitted.append(fun)
        return jax.jit(fun, **kwargs)


def check_measured_peak(acc) -> None:
    """``measured_peak(4, repeats=3)`` on a clock whose three timed calls take 1, 0.25 and
    0.5 s. A call chains 8 products a[4, 4] @ b[4, 4], each 2·M·N·K = 2·4·4·4 = 128 FLOPs (a
    multiply and an add per term): 8 · 128 = 1024 FLOPs a call, over the median 0.5 s:
    2048 FLOP/s. The program it times holds those 1024 FLOPs: 8 dot_generals of 4 × 4 × 4."""
    ticks = iter([0.0, 1.0, 10.0, 10.25, 20.0, 20.5])  # (begin, end) of each timed call
    recording = _RecordingJax()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(acc, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
        mp.setattr(acc, "jax", recording)
        rate = acc.measured_peak(4, repeats=3)
    assert rate == 2048.0, rate
    (chain,) = recording.jitted
    a = jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)
    dots = [e for e in jax.make_jaxpr(chain)(a, a).eqns if e.primitive.name == "dot_general"]
    shapes = [(e.invars[0].aval.shape, e.invars[1].aval.shape) for e in dots]
    flops = sum(2 * m * k * n for (m, k), (_, n) in shapes)  # 2·M·N·K each
    assert (len(shapes), flops) == (8, 1024), shapes


# Dense bfloat16 matmul FLOP/s per chip (per GPU) by jax.Device.device_kind, the vendors'
# published figures without 2:4 sparsity. The kinds are JAX's (its Pallas TPU tests match
# "TPU v5 lite" to v5e, "TPU v5" to v5p, "TPU v6 lite" to v6e; the GPUs report NVIDIA's names).
PUBLISHED_BF16_PEAKS = {
    "TPU v4": 275e12,  # cloud.google.com/tpu/docs/v4: peak compute per chip (bf16) 275 TFLOPs
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16 (its Int8 figure, 394 TOPs, is not bf16;
    # 16 GB HBM at 819 GB/s, not in this table)
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,  # v5p, cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16
    "TPU v6 lite": 918e12,  # v6e (Trillium), cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), both memories
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    # NVIDIA H100 SXM and H200 SXM datasheets: BF16 Tensor Core 1,979 TFLOPS with sparsity,
    # so 989.4 dense (the same GH100 at the same clocks; the H200 adds memory only)
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
}


def check_spec_table(acc) -> None:
    """The specification table holds the published dense bf16 peaks, entry for entry."""
    assert acc.SPEC_PEAK_FLOPS == PUBLISHED_BF16_PEAKS, acc.SPEC_PEAK_FLOPS


def check_moe_flops_per_token(llama) -> None:
    """PaLM's count (``Llama.train_flops_per_token``: 6 × the matmul weights a token meets +
    12 · L · H · hd · S) for a tiny mixture of experts, worked by hand.

    L = 2, D = 8, H = 4 (hd 2), KV = 2, F = 16, V = 10, E = 4 experts, k = 2, S = 6. Per block:
    the projections Q 8·4·2 = 64, K and V 8·2·2 = 32 each, O 4·2·8 = 64: 192; the router
    8·4 = 32; k = 2 experts, each a gated MLP of 3 matmuls 3·8·16 = 384: 768 (the slots a
    capacity factor pads are not model FLOPs). A block 192 + 32 + 768 = 992, two 1984, the head
    8·10 = 80: 2064 weights, each a multiply-add (2 FLOPs) forward and two backward (the
    input's and the weight's gradients): 6 · 2064 = 12384. Attention's QKᵀ and PV, S·hd
    multiply-adds each per head and token: 2 · 2 · 6·2 forward, ×3 with the backward, over
    4 heads and 2 layers: 12·2·4·2·6 = 1152. In all 13536."""
    moe = llama.Llama(vocab_size=10, d_model=8, num_layers=2, num_heads=4, num_kv_heads=2,
                      d_ff=16, experts=llama.Experts(num_experts=4, k=2))  # fmt: skip
    assert moe.train_flops_per_token(6) == 12384 + 1152, moe.train_flops_per_token(6)


def check_benchmark_models_flops_per_token(acc) -> None:
    """The accelerator table's FLOPs per token at S = 1024 (``MODELS``; hd = 128):

    254m: a block's projections 1024·(8 + 2·4)·128 + 8·128·1024 = 2,097,152 + 1,048,576 =
    3,145,728 and MLP 3·1024·2816 = 8,650,752: 11,796,480; ×16 = 188,743,680; the head
    1024·32000 = 32,768,000: 221,511,680 weights, ×6 = 1,329,070,080; attention
    12·16·8·128·1024 = 201,326,592; in all 1,530,396,672.

    470m: 2048·(16 + 2·4)·128 + 16·128·2048 = 6,291,456 + 4,194,304 = 10,485,760 and
    3·2048·5632 = 34,603,008: 45,088,768; ×8 = 360,710,144; the head 2048·32000 = 65,536,000:
    426,246,144, ×6 = 2,557,476,864; attention 12·8·16·128·1024 = 201,326,592; in all
    2,758,803,456."""
    for name, flops in (("254m", 1_530_396_672), ("470m", 2_758_803_456)):
        got = acc.model_of(acc.MODELS[name]).train_flops_per_token(1024)
        assert got == flops, (name, got)


def check_train_state_bytes(acc) -> None:
    """The plain program's train state (what it compiles for): float32 parameters and Adam's
    two float32 moments, 12 bytes a parameter, and Adam's int32 step count, 4 bytes.

    QUICK_MODEL (V 256, D 64, L 2, H 4 of 16, KV 2, F 176): the embedding and the head
    256·64 = 16,384 each; a block 64·64 + 2·64·32 + 64·64 = 12,288 projections, 3·64·176 =
    33,792 MLP, 2·64 = 128 norm scales: 46,208, ×2 = 92,416; the final norm 64: 125,248
    parameters, 12 · 125,248 + 4 = 1,502,980 bytes. 254m: 2·32000·1024 = 65,536,000, a block
    3,145,728 + 8,650,752 + 2048 = 11,798,528, ×16 = 188,776,448, + 1024: 254,313,472 →
    3,051,761,668 bytes. 470m: 2·32000·2048 = 131,072,000, a block 10,485,760 + 34,603,008 +
    4096 = 45,092,864, ×8 = 360,742,912, + 2048: 491,816,960 → 5,901,803,524 bytes. The batch
    at 2 × 64: ids and labels int32, 2·64·4 = 512 bytes each."""
    cases = ((acc.QUICK_MODEL, 125_248, 1_502_980),
             (acc.MODELS["254m"], 254_313_472, 3_051_761_668),
             (acc.MODELS["470m"], 491_816_960, 5_901_803_524))  # fmt: skip
    for sizes, parameters, state_bytes in cases:
        runner = acc.plain_program("einsum").runner(acc.model_of(sizes), 2, 64, None)
        state, ids, labels = runner.abstract_args
        assert sum(a.size for a in jax.tree.leaves(state[0])) == parameters, sizes
        assert sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state)) == state_bytes
        assert [a.size * a.dtype.itemsize for a in (ids, labels)] == [512, 512]


def check_memory_of(acc) -> None:
    """``memory_of``'s peak: arguments + outputs − donated (outputs written into donated
    arguments' buffers) + temp.

    As XLA would report the quick plain step at 2 × 64 (``check_train_state_bytes``):
    arguments the state 1,502,980 + ids and labels 1,024 = 1,504,004; outputs the state and
    the float32 loss, 1,502,984; donated the state, 1,502,980; temp 100,000: the peak
    1,504,004 + 1,502,984 − 1,502,980 + 100,000 = 1,604,008. And XLA's own figures for a
    toy step s[256] f32 (donated), x[4, 8] f32 → s + Σx: arguments 1024 + 128 = 1152,
    output 1024, donated 1024, so the peak is 1152 + temp."""
    analysis = types.SimpleNamespace(
        argument_size_in_bytes=1_504_004, output_size_in_bytes=1_502_984,
        alias_size_in_bytes=1_502_980, temp_size_in_bytes=100_000,
    )  # fmt: skip
    got = acc.memory_of(types.SimpleNamespace(memory_analysis=lambda: analysis))
    assert got == {"argument": 1_504_004, "output": 1_502_984, "alias": 1_502_980,
                   "temp": 100_000, "peak": 1_604_008}, got  # fmt: skip
    step = jax.jit(lambda s, x: s + jnp.sum(x), donate_argnums=0)
    compiled = step.lower(jax.ShapeDtypeStruct((256,), jnp.float32),
                          jax.ShapeDtypeStruct((4, 8), jnp.float32)).compile()  # fmt: skip
    got = acc.memory_of(compiled)
    assert (got["argument"], got["output"], got["alias"]) == (1152, 1024, 1024), got
    assert got["peak"] == 1152 + got["temp"], got


def bench_two_programs(acc, limit: int) -> list[dict]:
    """``bench_shape``'s rows at 2 × 4 for two fake programs under the device memory
    ``limit``: "a" steps in 0.25 s, holds 100 bytes of arguments and peaks at 250; "b" steps
    in 0.5 s, 120 and 200. A model of 1e6 FLOPs a token; peaks 6.4e7 (measured), 1.28e8
    (spec) FLOP/s."""
    clock = [0.0]
    memory = {"a": {"argument": 100, "peak": 250}, "b": {"argument": 120, "peak": 200}}
    seconds = {"a": 0.25, "b": 0.5}

    def compile_program(program, model, batch, seq, remat, limit):
        def step(state, ids, labels):
            clock[0] += seconds[program.label]
            return state, jnp.float32(0)

        runner = acc.Runner(None, (), lambda params: jnp.zeros(2), lambda x, y: (x, y))
        return runner, step, memory[program.label], "fits"

    model = types.SimpleNamespace(init=lambda key: {}, vocab_size=16,
                                  train_flops_per_token=lambda seq: 1e6)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(acc, "compile_program", compile_program)
        mp.setattr(acc, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        return acc.bench_shape([acc.Program("a", None), acc.Program("b", None)], model, 2, 4,
                               None, steps=3, warmup=1, limit=limit,
                               peaks={"measured": 6.4e7, "spec": 1.28e8},
                               rng=np.random.default_rng(0))  # fmt: skip


def check_mfu_and_offload(acc) -> None:
    """MFU, tokens/s and the offload decision of ``bench_shape`` (``bench_two_programs``).

    Both states on the device together with the larger program's own buffers: 100 + 120 +
    max(250 − 100, 200 − 120) = 370 bytes, so a limit of 370 keeps them there and 369 sends
    them to the host. A step is 2 · 4 = 8 tokens, 8e6 FLOPs; "a": 8 / 0.25 s = 32 tokens/s,
    8e6 / 0.25 s = 3.2e7 FLOP/s, MFU 3.2e7 / 6.4e7 = 0.5 and / 1.28e8 = 0.25; "b": 16
    tokens/s, 1.6e7 FLOP/s, MFU 0.25 and 0.125."""
    for limit, on_host in ((370, False), (369, True)):
        rows = bench_two_programs(acc, limit)
        assert [r["state_on_host"] for r in rows] == [on_host, on_host], (limit, rows)
        assert [r["flops_per_step"] for r in rows] == [8e6, 8e6], rows
        got = [r[k] for r in rows for k in ("step_ms", "tokens_per_s", "mfu_measured", "mfu_spec")]
        assert got == pytest.approx([250, 32, 0.5, 0.25, 500, 16, 0.25, 0.125], rel=1e-12), got
