"""shardops on one accelerator against plain-JAX programs of the same Llama: step time,
tokens/s, MFU, memory, the largest batch and sequence that fit, and a 10-step loss check.

    python benchmarks/accelerator.py                  # the 254M and 470M Llamas (a TPU or GPU)
    python benchmarks/accelerator.py --model 254m     # one of them
    python benchmarks/accelerator.py --quick          # a tiny Llama on CPU (CI, well under a minute)

The models (``MODELS``) are the issue's: a 254M Llama (D = 1024, 16 layers, 8 query and 4 KV
heads of 128, SwiGLU 2816, vocabulary 32000) and a 470M one (D = 2048, 8 layers, 16 / 4 heads
of 128, SwiGLU 5632), the blocks under one ``lax.scan``, trained with Adam; every program
stores float32 parameters and multiplies in bfloat16 with float32 accumulation
(``shardops.MIXED_BFLOAT16``), the loss the mean next-token cross-entropy. The programs, all
compiled for one device and fed the same parameters (``Llama.init``) and batches:

- ``plain einsum``: the model written here in plain JAX (``plain_logits``: RMSNorm, rotate-half
  RoPE, grouped-query attention by einsum, SwiGLU), ``optax.adam``, one ``jax.jit``;
- ``plain flash`` and ``plain splash`` (TPU only): the same, attention by JAX's Pallas TPU
  kernels ``flash_attention`` and splash attention (``make_splash_mqa_single_device`` over each
  KV head's group of query heads, blocks of 512);
- ``shardops ref``: ``models.build("ref", model=Llama(...), precision=MIXED_BFLOAT16)``;
- ``shardops fsdp_tp``: the same model through ``fsdp_tp``'s per-device path on a 1×1 mesh
  (data = 1, model = 1): shard_map and every collective of the strategy, each over one device.

``build``'s ``attention=`` (``--attention``) and ``remat=`` (``--remat``) options are passed
where the installed ``models.build`` accepts them (``build_options``): before the attention
option exists the shardops rows run the library's only attention, and before ``remat`` is a
policy (``models.Remat``) it is a bool that only fsdp strategies accept (``shardops ref`` then
has no remat row). A row whose program the installed build cannot make says why.

For each shape ``batch × seq`` (``SHAPES``; the last with remat: every program recomputes its
blocks in the backward pass) every program is compiled, its temp bytes read from
``compiled.memory_analysis()``, and it is run unless it does not fit: XLA's
``RESOURCE_EXHAUSTED`` at compile or run time, or a peak (arguments + outputs − donated + temp)
above the device's memory (``memory_stats()["bytes_limit"]``, or ``--memory-limit``). The
programs that fit are timed in rotation (one step each per round, every other round reversed,
``block_until_ready`` each step) after ``--warmup`` rounds; the step time is the median of
``--steps``. MFU = the model's FLOPs per step (``Llama.train_flops_per_token``, PaLM's count:
remat's recomputation is not counted) / step time / peak: the bf16 matmul peak measured in the
same run (``measured_peak``: a large bf16 matmul, timed) and the specification's
(``SPEC_PEAK_FLOPS`` by ``device_kind``; n/a for a device not in it).

The largest fitting shapes (where the device reports its memory, unless ``--no-search``):
per program, with and without remat, the largest power-of-two batch at ``SEARCH_SEQ`` and the
longest power-of-two sequence at batch 1, from the compiled programs' memory analysis (compiled,
not run).

Loss check: 10 steps from the same init on the same batches; every program's losses against
``plain einsum``'s, within ``LOSS_RTOL`` relative (a bfloat16 bound, see there). ``--quick``
fails (exit 1) when they disagree; a full run records and prints it.

Time and memory on one chip: each program's train state is 12 bytes a parameter (3 GB for
the 254M model, 5.9 GB for the 470M, which has 491.8M parameters); when the programs' states do
not fit the device together they wait on the host between steps (``bench_shape``), moved outside the timed calls, which
makes a round slower but not a step. Every program is compiled once per shape (the search adds
a few compiles a program); ``--model 254m``, ``--steps``, ``--attention`` and ``--no-search``
shorten a run on a chip lent for minutes.

It writes ``benchmarks/results/accelerator.json`` and ``accelerator.md`` (both models:
``accelerator_254m.*`` and ``accelerator_470m.*``; ``--quick``: a temporary folder unless
``--out``). Without a TPU or GPU JAX runs on CPU, where the figures are
no accelerator's (the JSON names the platform and device kind).
"""

import argparse
import inspect
import json
import math
import pathlib
import platform as host_platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import shardops
import shardops_models as models

RESULTS = pathlib.Path(__file__).parent / "results"

MODELS = {
    "254m": dict(vocab_size=32000, d_model=1024, num_layers=16, num_heads=8, num_kv_heads=4,
                 d_ff=2816),
    "470m": dict(vocab_size=32000, d_model=2048, num_layers=8, num_heads=16, num_kv_heads=4,
                 d_ff=5632),
}  # fmt: skip
QUICK_MODEL = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=176)
CONTEXT = 32768  # the longest sequence the models accept (RoPE has no table: a check only)

# (batch, seq, remat): the shapes; the last recomputes the blocks in the backward pass
# (``--remat``'s policy, "full" by default).
SHAPES = ((4, 1024, False), (8, 1024, False), (2, 2048, False), (1, 8192, False),
          (16, 1024, True))  # fmt: skip
QUICK_SHAPES = ((1, 64, False), (1, 64, True))
SEARCH_SEQ, SEARCH_MAX_BATCH = 1024, 256

SPEC_PEAK_FLOPS = {
    # Dense bfloat16 matmul FLOP/s per chip (per GPU) by jax.Device.device_kind, from the
    # vendors' specification sheets. A device not listed gets n/a, not a guess.
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM, dense (no sparsity)
    "NVIDIA H200": 989e12,
}

LEARNING_RATE = 3e-4
LOSS_STEPS = 10
# bfloat16 keeps 8 significant bits: one rounding of a value v moves it by up to 2⁻⁸·|v|.
# The two programs round their activations at different points (plain JAX where its ops
# round, shardops once per layer output), so their logits differ by a few such roundings,
# and 10 Adam steps (each moving a weight by up to the learning rate whatever the gradient's
# size) carry that difference forward. The mean loss over B·S tokens averages the per-token
# differences, so one bfloat16 rounding of the loss itself, 2⁻⁸ relative, bounds it (the quick
# run's programs differ by about 5e-5). At a small init the loss stays near ln V whatever the
# model computes, so this checks the programs train alike; tests/test_benchmark.py checks the
# plain program's logits against ``Llama.reference_logits``.
LOSS_RTOL = 2.0**-8
SPLASH_BLOCK = 512


def model_of(sizes: dict):
    return models.Llama(**sizes, context=CONTEXT)


# --- the plain-JAX programs


def _dot(x, w, spec="...d,df->...f"):
    """``einsum(spec, x, w)`` of bfloat16 operands accumulated in float32."""
    return jnp.einsum(spec, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)  # fmt: skip


def _rms(x, scale, eps):
    """RMSNorm in float32, rounded once to bfloat16."""
    x = x.astype(jnp.float32)
    y = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale
    return y.astype(jnp.bfloat16)


def _rope(t, theta):
    """Hugging Face's rotate-half RoPE on ``t[B, S, n, hd]`` (float32)."""
    s, hd = t.shape[1], t.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2) / hd))  # (hd/2,) float64 at trace time
    angles = np.arange(s)[:, None] * inv_freq[None]  # (S, hd/2)
    cos = jnp.asarray(np.concatenate([np.cos(angles)] * 2, -1), jnp.float32)[:, None]  # (S, 1, hd)
    sin = jnp.asarray(np.concatenate([np.sin(angles)] * 2, -1), jnp.float32)[:, None]
    rotated = jnp.concatenate([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
    return t * cos + rotated * sin


def einsum_attention(q, k, v):
    """Causal GQA ``q[B, S, H, hd]``, ``k, v[B, S, n, hd]`` (bf16) → ``o[B, S, H, hd]`` (bf16):
    scores and softmax in float32, the query heads grouped over their KV head."""
    b, s, h, hd = q.shape
    n = k.shape[2]
    q = q.reshape(b, s, n, h // n, hd)  # (B, S, n, G, hd)
    scores = jnp.einsum("bqngd,bknd->bngqk", q, k,
                        preferred_element_type=jnp.float32) / math.sqrt(hd)  # fmt: skip
    mask = np.tril(np.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # (B, n, G, S, S)
    o = jnp.einsum("bngqk,bknd->bqngd", weights.astype(jnp.bfloat16), v,
                   preferred_element_type=jnp.float32)  # fmt: skip
    return o.reshape(b, s, h, hd).astype(jnp.bfloat16)


def flash_attention(q, k, v):
    """JAX's Pallas TPU ``flash_attention`` (K and V repeated to every query head)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    s, h, hd = q.shape[1:]
    group = h // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # (B, S, H, hd)
    blk = min(SPLASH_BLOCK, s)
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                          block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk,
                          block_q_dkv=blk, block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)  # fmt: skip
    heads_first = [a.transpose(0, 2, 1, 3) for a in (q, k, v)]  # (B, H, S, hd)
    o = fa.flash_attention(*heads_first, causal=True, sm_scale=1 / math.sqrt(hd),
                           block_sizes=sizes)  # fmt: skip
    return o.transpose(0, 2, 1, 3)  # (B, S, H, hd)


def splash_attention(q, k, v, *, interpret: bool = False):
    """JAX's Pallas TPU splash attention: the MQA kernel on each KV head and its group of
    query heads (vmapped over batch and KV heads), causal, blocks of ``SPLASH_BLOCK``."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, s, h, hd = q.shape
    n = k.shape[2]
    group = h // n
    blk = min(SPLASH_BLOCK, s)
    sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                          block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                          block_kv_dq=blk)  # fmt: skip
    mask = sa.MultiHeadMask([sa.CausalMask((s, s))] * group)
    kernel = sa.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    q = (q / math.sqrt(hd)).astype(q.dtype)  # the kernel does not scale
    q = q.reshape(b, s, n, group, hd).transpose(0, 2, 3, 1, 4)  # (B, n, G, S, hd)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, n, S, hd)
    o = jax.vmap(jax.vmap(kernel))(q, k, v)  # (B, n, G, S, hd)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, h, hd)


ATTENTIONS = {"einsum": einsum_attention, "flash": flash_attention, "splash": splash_attention}


def plain_logits(model, params, ids, attend=einsum_attention, remat: str | None = None):
    """The Llama of ``models.networks.llama`` in plain JAX under mixed bfloat16: float32
    ``logits[B, S, V]`` of ``ids[B, S]``; ``remat`` (a key of ``PLAIN_REMAT``) checkpoints
    each block."""
    b, s = ids.shape
    h, n, hd, eps = model.num_heads, model.num_kv_heads, model.head_dim, model.norm_eps
    x = params["embed"]["table"][ids].astype(jnp.bfloat16)  # (B, S, D)

    def block(x, p):
        y = _rms(x, p["attn_norm"]["scale"], eps)
        a = p["attn"]
        q = _rope(_dot(y, a["wq"]).reshape(b, s, h, hd), model.rope_theta)  # (B, S, H, hd) f32
        k = _rope(_dot(y, a["wk"]).reshape(b, s, n, hd), model.rope_theta)  # (B, S, n, hd)
        v = _dot(y, a["wv"]).reshape(b, s, n, hd)
        o = attend(*(t.astype(jnp.bfloat16) for t in (q, k, v)))  # (B, S, H, hd)
        x = x + _dot(o.reshape(b, s, h * hd), a["wo"]).astype(jnp.bfloat16)
        y = _rms(x, p["mlp_norm"]["scale"], eps)
        m = p["mlp"]
        gated = jax.nn.silu(_dot(y, m["gate"]["w"])) * _dot(y, m["up"]["w"])  # (B, S, F) f32
        return x + _dot(gated.astype(jnp.bfloat16), m["down"]["w"]).astype(jnp.bfloat16), None

    if remat is not None:
        block = jax.checkpoint(block, policy=PLAIN_REMAT[remat])
    x, _ = lax.scan(block, x, params["blocks"])
    x = _rms(x, params["norm"]["scale"], eps)
    w = params["embed"]["table"].T if model.tie_embeddings else params["head"]["w"]
    return _dot(x, w)  # (B, S, V) float32


# build's remat policies and the jax.checkpoint policy each means for the plain programs
PLAIN_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def plain_step(model, optimizer, attend, remat):
    """``(state, ids, labels) → (state, loss)``: mean token cross-entropy, Adam."""

    def loss_fn(params, ids, labels):
        logits = plain_logits(model, params, ids, attend, remat)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    def step(state, ids, labels):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


# --- the programs


class Unsupported(Exception):
    """The installed build cannot make this program (the reason is the message)."""


class Runner(NamedTuple):
    """One program at one shape: its jitted step (donating the state), the abstract
    arguments to compile it for, and how to place concrete ones."""

    step: Callable
    abstract_args: tuple
    state_of: Callable  # params → state
    place: Callable  # (ids, labels) → placed batch


def build_options(remat: str | None, attention: str | None, strategy: str) -> dict:
    """``models.build`` keyword arguments for ``remat`` (a policy name, None: none) and
    ``attention``, as the installed build accepts them: ``remat`` a policy where
    ``models.Remat`` exists, else the older bool (``"full"`` only, fsdp strategies only);
    ``attention`` only where build has the option."""
    options = {}
    if attention is not None:
        if "attention" not in inspect.signature(models.build).parameters:
            raise Unsupported(f"this build has no attention= option (asked {attention!r})")
        options["attention"] = attention
    if remat is not None:
        if hasattr(models, "Remat"):
            options["remat"] = remat
        elif remat != "full":
            raise Unsupported(f"this build's remat is a bool: no policy {remat!r}")
        elif not models.strategy_named(strategy).fsdp:
            raise Unsupported("this build's remat=True applies to fsdp strategies only")
        else:
            options["remat"] = True
    return options


def attention_choices() -> tuple[str, ...] | None:
    """The ``attention=`` values the installed build takes, or None without the option."""
    if "attention" not in inspect.signature(models.build).parameters:
        return None
    return getattr(shardops.layers, "IMPLEMENTATIONS", ("auto", "einsum", "blocked", "splash"))


class Program(NamedTuple):
    label: str
    runner: Callable  # (model, batch, seq, remat) → Runner


def plain_program(attention: str) -> Program:
    def runner(model, batch, seq, remat):
        attend = ATTENTIONS[attention]
        optimizer = optax.adam(LEARNING_RATE)
        step = jax.jit(plain_step(model, optimizer, attend, remat), donate_argnums=0)
        params = jax.eval_shape(model.init, jax.random.key(0))
        state = (params, jax.eval_shape(optimizer.init, params))
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

        def state_of(p):
            p = jax.device_put(jax.device_get(p))  # buffers of its own: the step donates them
            return (p, optimizer.init(p))

        return Runner(step, (state, ids, ids), state_of, lambda x, y: jax.device_put((x, y)))

    return Program(f"plain {attention}", runner)


def shardops_program(strategy: str, attention: str | None) -> Program:
    def runner(model, batch, seq, remat):
        options = build_options(remat, attention, strategy)
        optimizer = optax.adam(LEARNING_RATE)
        kwargs = dict(model=model, optimizer=optimizer, precision=shardops.MIXED_BFLOAT16)
        if strategy == "ref":
            setup = models.build("ref", **kwargs, **options)
            params = jax.eval_shape(model.init, jax.random.key(0))
            ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
            state = models.TrainState(params, jax.eval_shape(optimizer.init, params))
            args = (state, ids, ids)
        else:
            mesh = shardops.make_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
            setup = models.build(strategy, mesh, **kwargs, **options)
            args = setup.abstract_step_args(batch, seq)
        return Runner(setup.train_step, args, setup.shard, lambda x, y: setup.place_batch(x, y))

    suffix = "" if attention is None else f" {attention}"
    return Program(f"shardops {strategy}{suffix}", runner)


def programs_for(platform: str, attentions) -> list[Program]:
    """The programs (module docstring): the Pallas TPU kernels' on a TPU only."""
    plain = ["einsum"] + (["flash", "splash"] if platform == "tpu" else [])
    out = [plain_program(a) for a in plain]
    for attention in attentions:
        out += [shardops_program("ref", attention), shardops_program("fsdp_tp", attention)]
    return out


# --- measuring


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def memory_of(compiled) -> dict | None:
    """Per-device bytes of a compiled program: arguments, outputs, donated (aliased), temp and
    the peak = arguments + outputs − aliased + temp."""
    a = compiled.memory_analysis()
    if a is None:
        return None
    out = {"argument": int(a.argument_size_in_bytes), "output": int(a.output_size_in_bytes),
           "alias": int(a.alias_size_in_bytes), "temp": int(a.temp_size_in_bytes)}  # fmt: skip
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


_COMPILED = {}  # (program, model, batch, seq, remat, limit) → compile_program's answer


def compile_program(program, model, batch, seq, remat, limit):
    """``(runner, compiled, memory, status)`` of ``program`` at ``batch × seq`` under the
    remat policy ``remat`` (None: none): status "fits", "OOM" (XLA's RESOURCE_EXHAUSTED
    at compile time), "OOM (predicted)" (the peak above ``limit``) or "n/a: <why>". Each
    program is compiled once per shape in a run (the timed rows, the search and the loss check
    share it)."""
    key = (program.label, model, batch, seq, remat, limit)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(program, model, batch, seq, remat, limit)
    return _COMPILED[key]


def _compile(program, model, batch, seq, remat, limit):
    try:
        runner = program.runner(model, batch, seq, remat)
    except Unsupported as e:
        return None, None, None, f"n/a: {e}"
    try:
        compiled = runner.step.lower(*runner.abstract_args).compile()
    except Exception as e:  # XlaRuntimeError's type moves between JAX versions
        if is_out_of_memory(e):
            return runner, None, None, "OOM"
        raise
    memory = memory_of(compiled)
    if limit is not None and memory is not None and memory["peak"] > limit:
        return runner, compiled, memory, "OOM (predicted)"
    return runner, compiled, memory, "fits"


def measured_peak(size: int, repeats: int = 20) -> float:
    """bf16 matmul FLOP/s of the first device: ``a[size, size] @ b`` (float32 accumulation),
    the median of ``repeats`` timed runs after one warm-up, 8 products per call so that the
    dispatch is amortised."""
    key_a, key_b = jax.random.split(jax.random.key(1))
    a = jax.random.normal(key_a, (size, size), jnp.bfloat16)
    b = jax.random.normal(key_b, (size, size), jnp.bfloat16) / size

    @jax.jit
    def chain(a, b):
        for _ in range(8):  # each product feeds the next: none can be skipped
            a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return a

    jax.block_until_ready(chain(a, b))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(chain(a, b))
        times.append(time.perf_counter() - begin)
    return 8 * 2 * size**3 / float(np.median(times))


def device_memory_limit():
    """The first device's memory in bytes (``memory_stats()["bytes_limit"]``), or None."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # some backends raise rather than return None
        return None
    return None if not stats else stats.get("bytes_limit")


def random_batch(model, batch, seq, rng):
    tokens = rng.integers(0, model.vocab_size, (batch, seq + 1), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]  # ids, labels: the next tokens


def bench_shape(
    programs, model, batch, seq, remat, *, steps, warmup, limit, peaks, rng, offload="auto"
):
    """One row per program at ``batch × seq``: every program that fits timed in one rotation.

    Each program's train state (parameters and Adam's two moments: 12 bytes a parameter, 3 GB
    for the 254M model) stays on the device between its steps unless the states of all the
    programs and the largest program's own buffers would not fit ``limit`` together
    (``offload="auto"``; ``"always"``, ``"never"``): then a program's state waits on the host
    while the others run and is put back before its step, outside the timed call."""
    params = jax.device_get(model.init(jax.random.key(0)))  # host: each program places its own
    x, y = random_batch(model, batch, seq, rng)
    flops = model.train_flops_per_token(seq) * batch * seq
    rows, runs = [], {}
    for program in programs:
        runner, compiled, memory, status = compile_program(program, model, batch, seq, remat,
                                                           limit)  # fmt: skip
        row = {"program": program.label, "batch": batch, "seq": seq, "remat": remat,
               "status": status, "memory": memory, "flops_per_step": flops}  # fmt: skip
        rows.append(row)
        if status == "fits":
            runs[program.label] = [compiled, runner, runner.place(x, y), row]
    memories = [run[3]["memory"] for run in runs.values() if run[3]["memory"]]
    together = sum(m["argument"] for m in memories) + max(
        (m["peak"] - m["argument"] for m in memories), default=0
    )
    host = offload == "always" or (offload == "auto" and limit is not None and together > limit)
    shardings = {}
    for label, run in runs.items():  # the states, made one at a time
        run[1] = run[1].state_of(params)
        run[3]["state_on_host"] = host
        if host:  # the state waits on the host, its device buffers freed
            shardings[label] = jax.tree.map(lambda a: a.sharding, run[1])
            run[1] = jax.device_get(run[1])
    times = {label: [] for label in runs}
    for i in range(warmup + steps):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for label in order:
            run = runs[label]
            if run is None:
                continue
            state = run[1]
            if host:
                state = jax.block_until_ready(jax.device_put(state, shardings[label]))
            begin = time.perf_counter()
            try:
                state, _ = jax.block_until_ready(run[0](state, *run[2]))
            except Exception as e:  # the device's out-of-memory error, at run time
                if not is_out_of_memory(e):
                    raise
                run[3]["status"] = "OOM"
                runs[label] = None
                continue
            elapsed = time.perf_counter() - begin
            run[1] = jax.device_get(state) if host else state
            del state
            if i >= warmup:
                times[label].append(elapsed)
    for label, run in runs.items():
        if run is None:
            continue
        row = run[3]
        ms = float(np.median(times[label]) * 1e3)
        row.update(step_ms=ms, tokens_per_s=batch * seq / ms * 1e3, steps=len(times[label]))
        for name, peak in peaks.items():
            row[f"mfu_{name}"] = None if peak is None else flops / (ms / 1e3) / peak
    del runs
    return rows


def largest_fitting(programs, model, limit, *, seq, max_batch, max_seq, policy="full", starts=None):
    """Per program, without remat and under the remat ``policy``: the largest power-of-two
    batch at ``seq`` and the longest power-of-two sequence at batch 1 whose compiled step fits
    ``limit`` (compiled, not run). ``starts``: remat → (batch, sequence) to search from (a
    shape already compiled for the timed rows costs nothing; default (1, ``seq``))."""
    out = []
    for program in programs:
        for remat in (None, policy):
            start_batch, start_seq = (starts or {}).get(remat, (1, seq))
            found = {"program": program.label, "remat": remat, "seq": seq}
            for what, start, stop, shape in (
                ("batch", start_batch, max_batch, lambda n: (n, seq)),
                ("seq_at_batch_1", max(start_seq, seq), max_seq, lambda n: (1, n)),
            ):  # fmt: skip

                def status(n, shape=shape, remat=remat, program=program):
                    return compile_program(program, model, *shape(n), remat, limit)[3]

                found[what], found[f"{what}_stopped"] = _largest(status, start, stop,
                                                                 floor=1 if what == "batch"
                                                                 else seq)  # fmt: skip
                if found[f"{what}_stopped"].startswith("n/a"):
                    break
            out.append(found)
            print(f"largest fitting: {program.label}{f' remat {remat}' if remat else ''}: batch "
                  f"{found['batch']} at S={seq}, S {found.get('seq_at_batch_1')} at batch 1",
                  flush=True)  # fmt: skip
    return out


def _largest(status, start: int, stop: int, floor: int = 1):
    """``(n, why)``: the largest power of two ``n`` in [floor, stop] whose ``status(n)`` is
    "fits", searched from ``start``: doubling while it fits, else halving until it does;
    ``why`` the status that ended the search ("searched to the end" at ``stop``). A status
    "n/a: …" (a program the build cannot make) ends it at once, with no ``n``."""
    first = status(start)
    if first.startswith("n/a"):
        return None, first
    if first != "fits":
        n = start // 2
        while n >= floor:
            if status(n) == "fits":
                return n, first
            n //= 2
        return None, first
    best, n = start, start * 2
    while n <= stop:
        why = status(n)
        if why != "fits":
            return best, why
        best, n = n, n * 2
    return best, "searched to the end"


def loss_check(programs, model, batch, seq, rng, limit=None) -> dict:
    """``LOSS_STEPS`` steps of every program from the same init on the same batches; each
    program's losses against the first's (``plain einsum``)."""
    params = jax.device_get(model.init(jax.random.key(0)))
    batches = [random_batch(model, batch, seq, rng) for _ in range(LOSS_STEPS)]
    losses = {}
    for program in programs:
        runner, compiled, _, status = compile_program(program, model, batch, seq, None, limit)
        if status != "fits":
            continue
        state, out = runner.state_of(params), []
        for x, y in batches:
            state, loss = compiled(state, *runner.place(x, y))
            out.append(float(loss))  # one step in flight
        losses[program.label] = out
        del state  # one program's state on the device at a time
    anchor = next(iter(losses))
    ref = np.asarray(losses[anchor])
    rtol = {label: float(np.max(np.abs(np.asarray(v) - ref) / np.abs(ref)))
            for label, v in losses.items() if label != anchor}  # fmt: skip
    return {"batch": batch, "seq": seq, "steps": LOSS_STEPS, "anchor": anchor, "losses": losses,
            "max_relative_diff": rtol, "bound": LOSS_RTOL,
            "agree": all(r <= LOSS_RTOL for r in rtol.values())}  # fmt: skip


# --- the report

COLUMNS = ("program", "batch × seq", "step ms (median)", "tokens/s", "MFU (measured peak)",
           "MFU (spec peak)", "temp MiB", "fits")  # fmt: skip


def markdown(results: dict) -> str:
    peaks = results["peaks"]
    spec = peaks["spec"]
    lines = [f"{results['model']} on {results['device_kind']} ({results['platform']}), JAX "
             f"{results['jax']}: bf16 matmul peak measured {peaks['measured'] / 1e12:.3g} TFLOP/s"
             f", specification {'n/a' if spec is None else f'{spec / 1e12:.3g} TFLOP/s'}; "
             f"device memory {_gib(results['memory_limit'])}.", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 3) + "---|"]  # fmt: skip
    for r in results["rows"]:
        shape = f"{r['batch']} × {r['seq']}" + (f" remat {r['remat']}" if r["remat"] else "")
        timed = "step_ms" in r

        def pct(key, r=r, timed=timed):
            return "n/a" if not timed or r.get(key) is None else f"{r[key]:.1%}"

        cells = [r["program"], shape, f"{r['step_ms']:.1f}" if timed else "—",
                 f"{r['tokens_per_s']:,.0f}" if timed else "—", pct("mfu_measured"),
                 pct("mfu_spec"), "—" if not r["memory"] else f"{r['memory']['temp'] / 2**20:.1f}",
                 r["status"]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    flops = {r["seq"]: r["flops_per_step"] / (r["batch"] * r["seq"]) for r in results["rows"]}
    lines += ["", "FLOPs per token (PaLM's count, `Llama.train_flops_per_token`): "
              + ", ".join(f"S = {s}: {f / 1e9:.3f} GFLOP" for s, f in sorted(flops.items()))
              + "; the same count for every program (remat's recomputation not counted)."]  # fmt: skip
    if results.get("largest"):
        lines += ["", f"Largest fitting (compiled, not run; peak ≤ {_gib(results['memory_limit'])}"
                  "): power-of-two batch at S = "
                  f"{results['largest'][0]['seq']}, and sequence at batch 1:", "",
                  "| program | remat | batch | seq at batch 1 |", "|---|---|---:|---:|"]  # fmt: skip
        for r in results["largest"]:
            lines.append(f"| {r['program']} | {r['remat'] or 'none'} | "
                         f"{_found(r, 'batch')} | {_found(r, 'seq_at_batch_1')} |")  # fmt: skip
    check = results["loss_check"]
    lines += ["", f"Loss check: {check['steps']} Adam steps at {check['batch']} × {check['seq']} "
              f"from the same init on the same batches, against `{check['anchor']}` (bound "
              f"{check['bound']:.2g} relative): " + ("agree" if check["agree"] else "DISAGREE"), "",
              "| program | first loss | last loss | max relative difference |",
              "|---|---:|---:|---:|"]  # fmt: skip
    for label, losses in check["losses"].items():
        diff = check["max_relative_diff"].get(label)
        lines.append(f"| {label} | {losses[0]:.5f} | {losses[-1]:.5f} | "
                     f"{'—' if diff is None else f'{diff:.2e}'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _gib(n) -> str:
    return "not reported" if n is None else f"{n / 2**30:.1f} GiB"


def _found(r, key) -> str:
    if r.get(key) is None:
        return r.get(f"{key}_stopped", "—")
    return f"{r[key]:,}" + (" (the search's end)" if r[f"{key}_stopped"] == "searched to the end"
                            else "")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny Llama and shapes: checks it runs")
    p.add_argument("--model", choices=sorted(MODELS), nargs="+", default=sorted(MODELS))
    p.add_argument("--steps", type=int, default=None, help="timed steps per program (20; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (3; quick 1)")
    p.add_argument("--attention", nargs="+", default=None,
                   help="build's attention= values for the shardops rows (default auto; "
                        "ignored by a build without the option)")  # fmt: skip
    p.add_argument("--remat", default="full", choices=sorted(PLAIN_REMAT), metavar="POLICY",
                   help="the remat rows' policy: full (recompute each block) or matmuls (keep "
                        "the dense layers' outputs); build's remat= of the same name")  # fmt: skip
    p.add_argument("--memory-limit", type=float, default=None, metavar="BYTES",
                   help="device memory in bytes (default: the device's bytes_limit)")  # fmt: skip
    p.add_argument("--no-search", action="store_true", help="skip the largest-fitting search")
    p.add_argument("--offload-states", choices=("auto", "always", "never"), default=None,
                   help="keep the programs' train states on the host between their steps: "
                        "auto (when they do not fit the device together; the default), "
                        "always (quick's, so CI runs the round trip), never")  # fmt: skip
    p.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    args = p.parse_args(argv)
    quick = args.quick
    steps = args.steps or (3 if quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    out = pathlib.Path(args.out or (tempfile.mkdtemp() if quick else RESULTS))
    device = jax.devices()[0]
    platform = device.platform
    limit = args.memory_limit or device_memory_limit()
    if quick and limit is None:
        limit = 64 * 2**20  # CPU reports none: a small budget exercises the search
    choices = attention_choices()
    attentions = [None] if choices is None else (args.attention or ["auto"])
    for a in attentions:
        if choices is not None and a not in choices:
            p.error(f"--attention {a!r}: the installed build accepts {', '.join(choices)}")
    programs = programs_for(platform, attentions)
    if choices is None:
        print("models.build has no attention= option here: the shardops rows run its only "
              "attention", flush=True)  # fmt: skip
    began = time.perf_counter()
    peaks = {
        "measured": measured_peak(256 if quick else 8192),
        "spec": SPEC_PEAK_FLOPS.get(device.device_kind),
    }
    print(f"{device.device_kind}: bf16 matmul peak {peaks['measured'] / 1e12:.3g} TFLOP/s measured",
          flush=True)  # fmt: skip
    rng = np.random.default_rng(0)
    named = {"quick": QUICK_MODEL} if quick else {k: MODELS[k] for k in args.model}
    exit_code = 0
    for name, sizes in named.items():
        model = model_of(sizes)
        rows = []
        for batch, seq, with_remat in QUICK_SHAPES if quick else SHAPES:
            remat = args.remat if with_remat else None
            rows += bench_shape(programs, model, batch, seq, remat, steps=steps, warmup=warmup,
                                limit=limit, peaks=peaks, rng=rng,
                                offload=args.offload_states or ("always" if quick else "auto"))  # fmt: skip
            for r in rows[-len(programs) :]:
                timing = f"{r['step_ms']:.1f} ms" if "step_ms" in r else r["status"]
                print(f"{r['program']:>24} {batch} × {seq}{f' remat {remat}' if remat else ''}: "
                      f"{timing}",
                      flush=True)  # fmt: skip
        largest = None
        if not args.no_search and limit is not None:
            # quick: the timed shape's programs only (compiled already), so it costs nothing
            # from shapes the timed rows compiled (quick: only those, so it costs nothing)
            starts = {None: (1, 64), args.remat: (1, 64)} if quick else {
                None: (8, 8192), args.remat: (16, 8192)}  # fmt: skip
            largest = largest_fitting(programs, model, limit, seq=64 if quick else SEARCH_SEQ,
                                      max_batch=1 if quick else SEARCH_MAX_BATCH,
                                      max_seq=64 if quick else CONTEXT, policy=args.remat,
                                      starts=starts)  # fmt: skip
        check = loss_check(programs, model, *(QUICK_SHAPES if quick else SHAPES)[0][:2], rng, limit)
        for label, losses in check["losses"].items():
            print(f"loss {label:>24}: " + " ".join(f"{v:.5f}" for v in losses), flush=True)
        results = {
            "model": model.name, "model_key": name, "platform": platform,
            "device_kind": device.device_kind, "jax": jax.__version__,
            "host": host_platform.platform(), "memory_limit": limit, "peaks": peaks,
            "attention_option": choices is not None, "rows": rows, "largest": largest,
            "loss_check": check, "seconds": time.perf_counter() - began,
        }  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        stem = "accelerator" if len(named) == 1 else f"accelerator_{name}"
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        table = markdown(results)
        (out / f"{stem}.md").write_text(table)
        print(table, flush=True)
        if not check["agree"]:
            print(f"the losses disagree beyond {LOSS_RTOL:.2g} relative: "
                  f"{check['max_relative_diff']}", file=sys.stderr, flush=True)  # fmt: skip
            if quick:
                exit_code = 1
    print(f"wrote {out} in {time.perf_counter() - began:.0f} s")
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
