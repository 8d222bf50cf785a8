"""Train a small byte-level GPT or Llama on real text with any strategy, on a 4×2 mesh by default.

The model (``models.Gpt``): 4 blocks of width 128 with 4 heads, an MLP of 512, learned
positions up to a context of 128 bytes, an untied head over the 256 byte values: 0.87M
parameters. 300 steps of Adam (peak LR 1e-3 after 20 warm-up steps, cosine decay to 1e-4) on
batches of 8 windows of 128 bytes: about a minute on 2 CPU cores with 8 simulated devices.
The loss falls from 5.61 to a validation loss of 2.56 nats per byte, and with
``--compare-reference`` the final losses of fsdp_tp and of the unsharded model agree to 3.4e-7.

``--model llama`` trains ``models.Llama`` instead: the same width, depth and heads, 2 key/value
heads shared by the 4 query heads, rotary positions, a SwiGLU MLP of 352, RMSNorm, the blocks
under one ``lax.scan`` (``--tie-embeddings``: the head is the embedding's table), with the
gradients clipped to a global norm of 1 (``shardops.clip_by_global_norm``, right under every
strategy). Both models report tokens/s and the model FLOPs utilisation: the training FLOPs
(PaLM's count) per second over the machine's measured matmul peak (float32, or bfloat16 under
a bfloat16 ``--precision``).

``--precision`` picks the policy (``float32``, the default; ``mixed_bfloat16``: float32
parameters and optimizer, bfloat16 matmuls accumulated in float32; ``bfloat16``), ``--remat``
the activation checkpointing of each block and ``--attention`` how each device computes
attention (``auto``, ``einsum``, ``blocked``, ``splash``): ``models.build``'s options of those
names, for the sharded run, the reference and the decoder alike.

    python examples/transformer_lm.py                                  # fsdp_tp on data=4 × model=2
    python examples/transformer_lm.py --model llama --strategy hsdp_tp --mesh replica=2,data=2,model=2
    python examples/transformer_lm.py --strategy sp --mesh 2x4 --steps 500
    python examples/transformer_lm.py --compare-reference --steps 300 --mesh 4x2 \\
        --plot examples/transformer_lm.png --metrics-json /tmp/lm.json

``--context-parallel ring`` (or ``allgather``, ``ulysses``) splits the sequence of every
activation over the mesh's ``context`` axis too, attention by that method
(``shardops.layers.context_parallel_attention_kernel``), composed with the strategy:

    python examples/transformer_lm.py --strategy 2d --mesh data=2,context=2,model=2 \\
        --context-parallel ring --context 1024 --compare-reference

``--moe`` (with ``--model llama``) puts a mixture of ``--experts`` SwiGLU experts in each
block, each byte routed to ``--top-k`` of them at ``--capacity-factor`` (Mixtral-style;
``none``: dropless), and logs the auxiliary losses and each expert's share and drops;
``--expert-parallel`` splits the experts over the mesh's ``expert`` axis (not dropless). With
``--context-parallel`` each device's S/N tokens of a sequence are one capacity group (N: the
``context`` axis' size), and the logged drops and ``--compare-reference``'s plain-jnp reference
route those groups (``context_shards=N``). The sample decodes dropless: every byte, of the prompt
and of each step, goes to its k experts, whatever the training capacity
(``docs/hugging-face-and-decoding.md``):

    python examples/transformer_lm.py --model llama --moe --experts 4 --expert-parallel \
        --strategy 2d --mesh data=2,expert=2,model=2 --compare-decoding --temperature 0

``--schedule gpipe`` (or ``1f1b``, or ``circular`` with ``--virtual`` stages per stage)
pipelines the layers over the mesh's ``pipe`` axis (the GPT built with its blocks stacked,
``models.Gpt(stacked=True)``), each device's batch split into ``--microbatches``
(``docs/pipeline.md``):

    python examples/transformer_lm.py --model llama --strategy 2d --schedule 1f1b \
        --mesh pipe=2,data=2,model=2 --microbatches 4 --compare-reference
    python examples/transformer_lm.py --model llama --strategy 2d --schedule circular \
        --virtual 2 --layers 4 --mesh pipe=2,data=2,model=2 --microbatches 4

Text (``shardops_models.data.text``): tiny_shakespeare through tfds when it is prepared, else the
Python standard library's source, which every machine has (one line says which).
``--compare-reference`` trains the unsharded model (strategy ``ref``) in lockstep, from the
same init on the same batches, and fails (exit status 1) if the final losses differ by more
than 1e-3 relative. With ``--moe`` the reference routes every token by the sharded run's
expert choices (``RoutingFollower``, ``shardops.layers.moe_routing_hook``): the two runs' router
scores differ by float rounding (tp and fsdp sum in another order than one matmul), and a
near-tie broken apart sends a token to another expert in each run, which training amplifies
(fsdp_tp's first: step 12, a tie in the reference's float32 scores; 3.2e-3 apart by step 30
unfollowed). The run reports the tokens whose choices the reference would have made otherwise
and fails if one is not a tie broken apart: the reference's own experts may beat the followed
ones by no more than the two runs' scores of those experts differ (the sharded run's are the
best by its own scores, so no tolerance is needed):

    python examples/transformer_lm.py --model llama --moe --compare-reference

Devices: on a machine without an accelerator the script simulates 8 CPU devices itself, by
setting XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts. With one
(``ACCELERATOR``: ``JAX_PLATFORMS`` naming another platform first, or, when it is unset,
a TPU's or GPU's device file) it runs on the real devices and sets nothing; on one
chip give it ``--mesh 1x1``:

    python examples/transformer_lm.py --model llama --mesh 1x1 --precision mixed_bfloat16 \
        --attention splash --remat full --batch-size 16 --context 1024

Processes and checkpoints, as in examples/mlp_2d.py: under ``python -m shardops.launch`` each
process reads only its rows of every batch and process 0 prints; ``--checkpoint-dir`` saves
the train state (with the losses so far) every ``--checkpoint-every`` steps and at the end,
and ``--resume`` continues from the latest one on any strategy and mesh. SIGTERM saves at the
next step and exits with code 143 (``shardops.preemption``); a stuck process stops the run
after ``--watchdog-timeout`` seconds, named (``shardops.watchdog``).

    python -m shardops.launch -n 2 -- examples/transformer_lm.py --checkpoint-dir runs/lm
"""

import glob
import os

# An accelerator JAX will find, told before JAX is imported (it reads XLA_FLAGS once, when its
# backend starts): JAX_PLATFORMS' first entry when it is set, else the device files of a TPU VM
# (/dev/accel*, /dev/vfio/<n>), an NVIDIA GPU (/dev/nvidia<n>) or an AMD one (/dev/kfd).
if os.environ.get("JAX_PLATFORMS", "").strip():
    ACCELERATOR = os.environ["JAX_PLATFORMS"].split(",")[0].strip().lower() != "cpu"
else:
    ACCELERATOR = any(glob.glob(f) for f in ("/dev/accel*", "/dev/vfio/[0-9]*",
                                             "/dev/nvidia[0-9]*", "/dev/kfd"))  # fmt: skip
if not ACCELERATOR and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardops
import shardops.distributed
import shardops.preemption
import shardops.watchdog
import shardops_models as models
from shardops_models.data import text
from shardops_models.generation import Decoder
from shardops_models.search import matmul_flops
from shardops_models.training import checkpoint, loop
from shardops_models.training.meshes import mesh_for, mesh_text

MAX_RELATIVE_DIFF = 1e-3  # --compare-reference: |loss − ref_loss| / ref_loss at the last step
PRECISIONS = {"float32": shardops.FLOAT32, "mixed_bfloat16": shardops.MIXED_BFLOAT16,
              "bfloat16": shardops.BFLOAT16}  # fmt: skip


def parse_mesh(spec: str) -> str:
    """``--mesh``: axis sizes, checked here so a bad spec is one argparse line."""
    try:
        shardops.parse_mesh(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt", choices=("gpt", "llama"),
                   help="models.Gpt (learned positions, GELU MLP) or models.Llama (RoPE, "
                        "grouped-query attention, SwiGLU, RMSNorm)")  # fmt: skip
    p.add_argument("--strategy", default="fsdp_tp", choices=sorted(models.STRATEGIES))
    p.add_argument("--mesh", default="4x2", type=parse_mesh,
                   help="axis sizes: 4x2 (data×model, the default), 8x1, 2x4, or named, e.g. "
                        "replica=2,data=2,model=2")  # fmt: skip
    p.add_argument("--context-parallel", choices=shardops.layers.CONTEXT_METHODS,
                   metavar="METHOD",
                   help="split the sequence over the mesh's 'context' axis as well, attention "
                        "by METHOD: allgather, ring or ulysses (the strategy becomes "
                        "STRATEGY+METHOD)")  # fmt: skip
    p.add_argument("--moe", action="store_true",
                   help="--model llama with a mixture of experts in each block (Mixtral-style; "
                        "logs the auxiliary losses and each expert's token share and drop rate)")  # fmt: skip
    p.add_argument("--experts", type=int, default=8, help="--moe: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="--moe: experts per token")
    p.add_argument("--capacity-factor", type=capacity_factor, default=1.25,
                   help="--moe: slots per expert = capacity_factor · tokens · k / experts, or "
                        "'none': dropless (every choice computed; not with --expert-parallel)")  # fmt: skip
    p.add_argument("--load-balance", choices=shardops.layers.MOE_LOAD_BALANCE, default="global",
                   help="--moe: the load-balancing loss over the whole batch (Megatron's "
                        "'global') or per sequence (GShard's 'group': needed with "
                        "--microbatches > 1)")  # fmt: skip
    p.add_argument("--expert-parallel", action="store_true",
                   help="--moe: split the experts over the mesh's 'expert' axis (the batch "
                        "too; the strategy becomes STRATEGY+ep)")  # fmt: skip
    p.add_argument("--schedule", choices=shardops.pipeline.SCHEDULES, default=None,
                   help="pipeline the layers over the mesh's 'pipe' axis by this schedule (the "
                        "strategy becomes STRATEGY+SCHEDULE; the GPT's blocks stacked; "
                        "docs/pipeline.md)")  # fmt: skip
    p.add_argument("--virtual", type=int, default=None,
                   help="--schedule circular: virtual stages per stage (default 2; the layers "
                        "split into pipe × VIRTUAL chunks)")  # fmt: skip
    p.add_argument("--microbatches", type=int, default=1,
                   help="split each device's batch into this many microbatches (the pipeline's "
                        "M; without --schedule, gradient accumulation; with --moe, "
                        "--load-balance group)")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="windows of --context bytes")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up")
    p.add_argument("--seed", type=int, default=0, help="init, batch order and sampling")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None,
                   help="llama: key/value heads (default: heads / 2)")  # fmt: skip
    p.add_argument("--tie-embeddings", action="store_true",
                   help="llama: the output head is the embedding's table")  # fmt: skip
    p.add_argument("--clip", type=float, default=None, metavar="NORM",
                   help="clip the gradients to this global norm (default: 1.0 for llama, none "
                        "for gpt)")  # fmt: skip
    p.add_argument("--context", type=int, default=128, help="bytes per window")
    p.add_argument("--remat", default="none", choices=models.strategies.remat.POLICIES,
                   help="activation checkpointing of each block (docs/strategies.md)")  # fmt: skip
    p.add_argument("--precision", default="float32", choices=sorted(PRECISIONS),
                   help="float32; mixed_bfloat16: float32 params, bfloat16 matmuls (float32 "
                        "accumulation); bfloat16: bfloat16 params too")  # fmt: skip
    p.add_argument("--attention", default="auto", choices=shardops.layers.IMPLEMENTATIONS,
                   help="each device's attention: auto (splash on TPU where the shapes fit, "
                        "else blocked), einsum (S×S scores), blocked, splash")  # fmt: skip
    p.add_argument("--log-every", type=int, default=50, metavar="N",
                   help="print the loss every N steps")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=100, metavar="N",
                   help="validation loss every N steps (and at the end); 0: only at the end")  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=8,
                   help="validation batches (of --batch-size windows) per evaluation")  # fmt: skip
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="bytes to generate at the end, with the KV cache (default and most: "
                        "what the context leaves after the prompt)")  # fmt: skip
    p.add_argument("--prompt-bytes", type=int, default=64, help="prompt length (validation text)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--compare-decoding", action="store_true",
                   help="also generate greedily by recomputing the whole prefix for "
                        "every byte, and compare its time and bytes with the KV cache's")  # fmt: skip
    p.add_argument("--text-source", default="auto", choices=text.SOURCES)
    p.add_argument("--locate", action="store_true",
                   help="compare one gradient step with the unsharded model layer by layer "
                        "(shardops.inspect.compare) and exit")  # fmt: skip
    p.add_argument("--compare-reference", action="store_true",
                   help="train the unsharded model in lockstep on the same batches")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="save the loss curves as a PNG")
    p.add_argument("--metrics-json", metavar="PATH", help="save losses, timing and the sample")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save the train state in DIR")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="also save every N steps (default: at the end only)")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (if any)")  # fmt: skip
    p.add_argument("--watchdog-timeout", type=float, metavar="S",
                   default=shardops.watchdog.DEFAULT_TIMEOUT_S,
                   help="stop the run when a process lags a step the others passed by S "
                        "seconds (default %(default)g; 0: off)")  # fmt: skip
    p.add_argument("--stop-on-non-finite", action="store_true",
                   help="stop at the first step whose loss or gradient is NaN or inf, naming "
                        "the parameters and (in one process) the first non-finite layer")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "log_every", "eval_batches", "prompt_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.sample_tokens is None:
        args.sample_tokens = max(args.context - args.prompt_bytes, 0)
    if args.sample_tokens and args.prompt_bytes >= args.context:
        p.error(f"--prompt-bytes {args.prompt_bytes} leaves no room in the --context of "
                f"{args.context} for --sample-tokens (the sample is decoded within the context)")  # fmt: skip
    for name in ("warmup", "eval_every", "sample_tokens", "watchdog_timeout"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be ≥ 0; got {getattr(args, name)}")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        p.error(f"--checkpoint-every must be at least 1 step; got {args.checkpoint_every} (leave "
                f"it out to save at the end only)")  # fmt: skip
    if args.temperature < 0:
        p.error(f"--temperature must be ≥ 0 (0: greedy); got {args.temperature}")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.resume and args.compare_reference:
        p.error("--compare-reference compares whole runs from the init: not with --resume")
    if args.model == "gpt" and (args.kv_heads is not None or args.tie_embeddings):
        p.error("--kv-heads and --tie-embeddings are options of --model llama")
    if args.moe and args.model != "llama":
        p.error("--moe replaces the Llama's MLPs: add --model llama")
    if args.moe:
        try:
            models.Experts(num_experts=args.experts, k=args.top_k,
                           capacity_factor=args.capacity_factor)  # fmt: skip
        except ValueError as e:
            p.error(f"--experts/--top-k/--capacity-factor: {e}")
        if args.microbatches > 1 and args.load_balance == "global":
            p.error(f"--moe with --microbatches {args.microbatches}: the global load balance "
                    f"multiplies two whole-batch means, which a step in microbatches never "
                    f"sees; add --load-balance group (per sequence: the microbatches average "
                    f"to the batch's exactly)")  # fmt: skip
    if args.expert_parallel:
        if not args.moe:
            p.error("--expert-parallel splits the experts of --moe")
        if args.capacity_factor is None:
            p.error(f"--capacity-factor none (dropless) keeps every expert whole on each "
                    f"device, which --expert-parallel splits; pass --capacity-factor "
                    f"{args.experts / args.top_k:g} (experts / top-k: drops nothing either) "
                    f"or drop --expert-parallel")  # fmt: skip
        args.strategy = f"{args.strategy}+ep"
    if args.microbatches < 1:
        p.error(f"--microbatches must be a positive int; got {args.microbatches}")
    if args.schedule:
        if args.locate:
            p.error("--schedule: --locate taps the layers of one device's forward; locate "
                    "without --schedule (the layers are the same)")  # fmt: skip
        circular = args.virtual not in (None, 2) and args.schedule == "circular"
        args.strategy = f"{args.strategy}+{args.schedule}" + (str(args.virtual) if circular else "")
    if args.virtual is not None and args.schedule != "circular":
        p.error(f"--virtual {args.virtual}: virtual stages are the circular schedule's; add "
                f"--schedule circular")  # fmt: skip
    if args.context_parallel:
        if args.locate:
            p.error("--locate compares activations in token order; run it without "
                    "--context-parallel (the other axes' layers are the same)")  # fmt: skip
        args.strategy = f"{args.strategy}+{args.context_parallel}"
    if args.clip is None and args.model == "llama":
        args.clip = 1.0
    if args.clip is not None and not args.clip > 0:
        p.error(f"--clip must be a positive norm; got {args.clip}")
    return p, args


def capacity_factor(text: str) -> float | None:
    """``--capacity-factor``: a number, or ``none`` (dropless: ``Experts(capacity_factor=None)``)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number (e.g. 1.25) nor 'none' (dropless)"
        ) from None


def make_model(args):
    """``models.Gpt`` or ``models.Llama`` of the arguments' sizes, over the 256 byte values."""
    if args.model == "gpt":
        return models.Gpt(vocab_size=text.VOCAB_SIZE, d_model=args.width, num_heads=args.heads,
                          num_layers=args.layers, context=args.context,
                          stacked=bool(args.schedule))  # fmt: skip
    kv_heads = args.kv_heads if args.kv_heads is not None else max(1, args.heads // 2)
    experts = (models.Experts(num_experts=args.experts, k=args.top_k,
                              capacity_factor=args.capacity_factor,
                              load_balance=args.load_balance) if args.moe else None)  # fmt: skip
    return models.Llama(vocab_size=text.VOCAB_SIZE, d_model=args.width, num_heads=args.heads,
                        num_kv_heads=kv_heads, num_layers=args.layers, context=args.context,
                        tie_embeddings=args.tie_embeddings, experts=experts)  # fmt: skip


def make_optimizer(args) -> optax.GradientTransformation:
    """Adam, warm-up then cosine decay to lr/10, after clipping to a global norm of
    ``--clip``: ``shardops.clip_by_global_norm`` reduces the norm over the axes each gradient
    is split over (optax's own would clip each device's shards by their own norm)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=min(args.warmup, args.steps - 1),
        decay_steps=args.steps, end_value=args.lr / 10,
    )  # fmt: skip
    if args.clip is None:
        return optax.adam(schedule)
    return optax.chain(shardops.clip_by_global_norm(args.clip), optax.adam(schedule))


def train_batches(tokens, batch_size: int, context: int, seed: int, rows: slice):
    """Endless ``(inputs, targets)`` host batches, each ``(B, S)`` int32: epoch after epoch of
    non-overlapping windows in a seeded order; only ``rows`` of each batch are read."""
    for epoch in itertools.count():
        yield from text.batches(tokens, batch_size, context, seed=seed, epoch=epoch, rows=rows)


def log(*args, **kwargs) -> None:
    """``print`` on process 0 only: the figures are global, one copy is enough."""
    if shardops.distributed.is_main():
        print(*args, **kwargs)


def context_shards(setup) -> int:
    """The devices of ``setup``'s context axis, N (1 without context parallelism): under cp
    each device's S/N tokens of a sequence are one capacity group of the experts
    (``models.Experts``), so a capacity model's routing depends on N."""
    cp = setup.strategy.cp
    return setup.mesh.shape[cp] if cp else 1


def grouped_reference(ref, shards: int):
    """``ref`` (the unsharded Setup) with its train step and evaluate taken from the model's
    plain-jnp reference (``Llama.reference_loss``, ``reference_logits``; float32 whatever the
    policy), whose experts route each sequence's tokens in the groups that context
    parallelism over ``shards`` devices makes (``context_shards``): the unsharded layers
    route each sequence as one group. ``--compare-reference`` under ``--moe
    --context-parallel``."""
    model, optimizer = ref.model, ref.optimizer
    value_and_grad = jax.value_and_grad(
        lambda params, x, y: model.reference_loss(params, x, y, context_shards=shards)
    )

    @jax.jit
    def train_step(state, x, y):  # (TrainState, loss): one step of ref's optimizer
        loss, grads = value_and_grad(state.params, x, y)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return models.TrainState(optax.apply_updates(state.params, updates), opt_state), loss

    @jax.jit
    def evaluate(params, x, y):  # Metrics: sums over the labelled positions of x[B, S]
        logits = model.reference_logits(params, x, context_shards=shards)  # (B, S, V)
        real = y != models.PAD_LABEL  # (B, S)
        target = jnp.where(real, y, 0)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, target)  # (B, S)
        hits = (jnp.argmax(logits, -1) == target) & real
        return models.Metrics(jnp.sum(jnp.where(real, losses, 0.0)),
                              jnp.sum(hits, dtype=jnp.int32), jnp.sum(real, dtype=jnp.int32))  # fmt: skip

    return dataclasses.replace(ref, train_step=train_step, evaluate=evaluate)


class RoutingFollower:
    """``--moe --compare-reference`` without routing flips: the reference routes each token by
    the sharded run's expert choices (``shardops.layers.moe_routing_hook``), so the two runs
    differ by float reordering only, and a near-tie the two break apart (router scores a few
    ulps apart, which tp's and fsdp's sums in another order than the unsharded matmul's make)
    cannot send one token to another expert in each run and amplify that rounding into a
    different model (``docs/moe.md``).

    ``record`` is the sharded step's hook: each device's ``probs[G, S, E]`` and ``top_i[G, S,
    k]`` of each layer, put together (``choices``) into ``[L][B, …]`` by the strategy's batch
    axes. ``follow`` is the reference's: it routes layer after layer by those choices
    (``jax.pure_callback``) and keeps its own top-k, to count the tokens whose choices it would
    have made otherwise (``flips``, per step). Each flip must be a tie broken apart by the two
    runs' scores: the sharded run's k experts ``S`` are the best by its scores ``p_s``, so the
    reference's own ``R`` can beat them by its scores ``p_r`` only by what the scores differ,
    ``Σ_R p_r − Σ_S p_r ≤ Σ_R |p_r − p_s| + Σ_S |p_r − p_s|`` (exact: it needs no tolerance).
    A flip beyond that bound is a choice the sharded scores do not make, a different routing,
    and fails the run."""

    def __init__(self, layers: int, setup):
        self.layers, self.mesh = layers, setup.mesh
        self.batch_axes = setup.strategy.batch_axes
        self.recorded, self.own = [], []  # device arrays, read after a step
        self.forced, self.scores = [], []  # the sharded step's [L][B, S, k] and [L][B, S, E]
        self.flips: dict[int, int] = {}  # step → tokens whose own choices differed
        self.worst = (0.0, None)  # (the largest flip's gap / its bound, where)

    def record(self, probs, top_i):
        mesh = jax.sharding.get_abstract_mesh()
        axes = [a for a in mesh.axis_names if a in getattr(mesh, "manual_axes", ())]
        coords = [jax.lax.axis_index(a) for a in axes]  # this device's place on the mesh
        jax.debug.callback(  # the arrays kept as they are: reading them here would deadlock
            lambda *c, p, t: self.recorded.append((dict(zip(axes, c, strict=True)), p, t)),
            *coords, p=jax.lax.stop_gradient(probs), t=top_i,
        )  # fmt: skip
        return top_i

    def choices(self) -> None:
        """The sharded step's scores and choices (after it ran), ``[L][B, S, E]`` and
        ``[L][B, S, k]``, for ``follow``."""
        jax.effects_barrier()
        per_device: dict = {}
        for coords, probs, top_i in self.recorded:  # in each device's order: layer after layer
            where = tuple(sorted((a, int(c)) for a, c in coords.items()))
            per_device.setdefault(where, []).append((np.asarray(probs), np.asarray(top_i)))
        self.recorded = []
        forced = scores = None
        for coords, layers in per_device.items():
            assert len(layers) % self.layers == 0, (coords, len(layers))  # (remat: recomputed)
            where, row = dict(coords), 0
            for a in self.batch_axes:  # the rows' block: the batch axes, the first the major
                row = row * self.mesh.shape[a] + int(where[a])
            g = layers[0][1].shape[0]  # this device's groups (sequences)
            if forced is None:  # forced[L, B, S, k], B: g rows on each block of the batch
                rows = g * math.prod(self.mesh.shape[a] for a in self.batch_axes)
                forced = np.full((self.layers, rows, *layers[0][1].shape[1:]), -1)
                scores = np.full((self.layers, rows, *layers[0][0].shape[1:]), np.nan)
            for i in range(self.layers):
                block = forced[i, row * g : (row + 1) * g]
                assert (block < 0).all() or (block == layers[i][1]).all()  # replicas agree
                block[...] = layers[i][1]
                scores[i, row * g : (row + 1) * g] = layers[i][0]
        assert forced is not None and (forced >= 0).all() and not np.isnan(scores).any()
        self.forced, self.scores, self.calls = list(forced.astype(np.int32)), list(scores), 0

    def follow(self, probs, top_i):
        jax.debug.callback(lambda p, t: self.own.append((p, t)), probs, top_i)
        return jax.pure_callback(self._next, jax.ShapeDtypeStruct(top_i.shape, top_i.dtype),
                                 jax.lax.stop_gradient(probs))  # fmt: skip

    def _next(self, probs):  # the next layer's choices (the layers run in order)
        self.calls += 1
        return self.forced[self.calls - 1]

    def count(self, step: int) -> str | None:
        """The flips of ``step`` (after the reference's step ran); a message for a flip that is
        not a tie broken apart by the two runs' scores (the class docstring), else None."""
        jax.effects_barrier()
        own, self.own = self.own, []
        assert len(own) == self.layers == self.calls, (len(own), self.calls)
        flips = 0
        for layer, ((probs, top_i), forced, sharded) in enumerate(
            zip(own, self.forced, self.scores, strict=True)
        ):
            probs, top_i = np.asarray(probs), np.asarray(top_i)  # [B, S, E], [B, S, k]
            differ = np.any(np.sort(top_i, -1) != np.sort(forced, -1), -1)  # [B, S]
            flips += int(np.sum(differ))
            for b, t in np.argwhere(differ):
                p_r, p_s = probs[b, t].astype(np.float64), sharded[b, t].astype(np.float64)
                mine, followed = top_i[b, t], forced[b, t]  # R, S
                gap = np.sum(p_r[mine]) - np.sum(p_r[followed])
                bound = np.sum(np.abs(p_r - p_s)[mine]) + np.sum(np.abs(p_r - p_s)[followed])
                ratio = gap / bound if bound > 0 else (np.inf if gap > 0 else 0.0)
                if ratio > self.worst[0]:
                    self.worst = (ratio, f"step {step}, layer {layer}, row {b}, position {t}: "
                                         f"experts {sorted(mine.tolist())} (own) vs "
                                         f"{sorted(followed.tolist())} (followed), score gap "
                                         f"{gap:.2e}, the runs' scores {bound:.2e} apart")  # fmt: skip
        if flips:
            self.flips[step] = flips
        if self.worst[0] > 1:
            return (f"the reference's own expert choice beats the sharded run's by more than "
                    f"the two runs' scores differ at {self.worst[1]}: a different routing, not "
                    f"a tie broken apart")  # fmt: skip
        return None


@functools.partial(jax.jit, static_argnums=(0, 3))
def expert_stats(model, params, ids, shards: int) -> dict:
    """``model.expert_stats(params, ids, context_shards=shards)``, compiled once per model."""
    return model.expert_stats(params, ids, context_shards=shards)


def expert_line(model, params, ids, shards: int) -> str:
    """The experts on the host batch ``ids[B, S]`` at ``params`` (whole arrays), routed in the
    run's capacity groups (``Llama.expert_stats`` with ``context_shards=shards``, the run's
    ``context_shards``): the auxiliary losses, and per expert (averaged over the layers) its
    share of the choices and the fraction of them dropped at capacity."""
    stats = expert_stats(model, params, np.asarray(jax.device_get(ids)), shards)
    share, dropped = (np.mean(np.asarray(stats[k]), 0) for k in ("share", "dropped"))
    return (f"    aux: load balance {float(stats['load_balance']):.3f}, z {float(stats['z_loss']):.2f}"
            f"; experts' share {' '.join(f'{v:.0%}' for v in share)}"
            f"; dropped {' '.join(f'{v:.0%}' for v in dropped)}")  # fmt: skip


def validation_loss(setup, params, valid_batches) -> tuple[float, float]:
    """Mean loss and accuracy over every target of ``valid_batches``, by ``setup.evaluate``."""
    inflight, sums = loop.StepsInFlight(), []
    for x, y in valid_batches:
        metrics = setup.evaluate(params, *setup.place_batch(x, y))
        inflight.add(metrics)
        sums.append(metrics)
    inflight.drain()
    sums = models.gather_tree(sums)  # replicated scalars: every process holds them
    count = sum(int(m.count) for m in sums)
    loss_sum = sum(float(m.loss_sum) for m in sums)  # float64 on the host
    return loss_sum / count, sum(int(m.correct) for m in sums) / count


def generate(setup, params, prompt: np.ndarray, n_tokens: int, *, temperature: float, key):
    """``n_tokens`` bytes after ``prompt`` ``(P,)``, one ``setup.logits`` call per byte: the
    whole prefix recomputed for every byte (what ``--compare-decoding`` times against the KV
    cache of ``decode``). A model with experts is recomputed dropless
    (``recompute_setup``), as the decoder routes.

    Every call sees the same window ``ids[batch_multiple, context]`` (the last ``context``
    bytes, padded on the right; only row 0 is used), so the forward compiles once. Causal
    attention keeps the padding from reaching the logits read at the last real position.
    """
    setup = recompute_setup(setup)
    context = setup.model.context
    rows = setup.batch_multiple
    tokens = list(prompt)
    for i in range(n_tokens):
        window = tokens[-context:]
        ids = np.zeros((rows, context), np.int32)  # (R, S), right-padded
        ids[0, : len(window)] = window
        logits = setup.logits(params, setup.place_batch(ids))  # (R, S, V), full vocabulary
        last = models.gather_tree(logits)[0, len(window) - 1]  # (V,) the next byte's logits
        if temperature == 0:
            token = int(np.argmax(np.asarray(last)))
        else:
            token = int(jax.random.categorical(jax.random.fold_in(key, i), last / temperature))
        tokens.append(token)
    return np.asarray(tokens[len(prompt) :], np.int32)


def recompute_setup(setup):
    """``setup``, or for a model with experts the same strategy, mesh and policy building the
    model routed dropless (``capacity_factor = E / k``: every token to its k experts), the
    rule of the KV-cache decoder: the same parameters, the same layout, and the window's
    right padding, routed apart from the real bytes, cannot take their experts' slots."""
    experts = getattr(setup.model, "experts", None)
    if experts is None:
        return setup
    dropless = dataclasses.replace(setup.model, experts=dataclasses.replace(
        experts, capacity_factor=experts.num_experts / experts.k))  # fmt: skip
    return models.build(setup.strategy, setup.mesh, model=dropless, optimizer=optax.identity(),
                        precision=setup.precision, attention=setup.attention)  # fmt: skip


def decode(setup, params, prompt: np.ndarray, n_tokens: int, *, temperature: float, key):
    """The model's continuation of ``prompt`` by KV-cache decoding (``generation.Decoder``):
    on every device of the run, the model axis of the training mesh (1 without one) splitting
    the heads and the rest the batch, whose rows all start from ``prompt`` (row 0 is shown).
    Returns ``(tokens, seconds, compile_seconds, rows)``: the timed call is the second one."""
    mesh = setup.mesh
    tp = setup.strategy.tp if mesh is not None else None
    model_size = mesh.shape[tp] if tp else 1
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    decode_mesh = shardops.make_mesh({"data": len(devices) // model_size, "model": model_size},
                                     devices=devices)  # fmt: skip
    rows = len(devices) // model_size
    decoder = Decoder(setup.model, decode_mesh, batch=rows, max_len=len(prompt) + n_tokens,
                      precision=setup.precision, attention=setup.attention)  # fmt: skip
    params = decoder.place(setup.gather(params))  # any training layout → the decoding one
    prompts = np.repeat(np.asarray(prompt, np.int32)[None], rows, axis=0)
    options = {"temperature": temperature, "key": key}
    start = time.perf_counter()
    tokens = decoder.generate(params, prompts, n_tokens, **options)
    jax.block_until_ready(tokens)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    tokens = models.gather_tree(decoder.generate(params, prompts, n_tokens, **options))
    return tokens[0], time.perf_counter() - start, compiled, rows


class Progress:
    """A rich progress bar on a terminal, with the loss lines printed above it; the lines alone
    otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.quiet = not shardops.distributed.is_main()  # process 0 alone shows progress
        self.tty = sys.stdout.isatty() and not self.quiet

    def __enter__(self):
        if self.tty:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                                TimeRemainingColumn(), transient=True)  # fmt: skip
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, loss="…")
        return self

    def update(self, step: int, loss: float | None = None) -> None:
        if self.tty:
            fields = {} if loss is None else {"loss": f"{loss:.4f}"}
            self.bar.update(self.task, completed=step, **fields)

    def print(self, line: str) -> None:
        if self.quiet:
            return
        if self.tty:
            self.bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def __exit__(self, *exc):
        if self.tty:
            self.bar.__exit__(*exc)


def main(argv=None) -> int:
    shardops.distributed.initialize()  # joins a multi-process run; a no-op otherwise
    parser, args = parse_args(argv)
    try:
        return train(parser, args)
    except loop.NonFiniteError as e:  # --stop-on-non-finite
        raise SystemExit(f"Stopped: {e}") from None


def train(parser, args) -> int:
    started = time.perf_counter()
    if jax.process_count() > 1 and (args.strategy == "ref" or args.compare_reference):
        parser.error("--strategy ref and --compare-reference run the unsharded model in one "
                     "process: run them without the launcher")  # fmt: skip
    try:
        model = make_model(args)
        mesh = mesh_for(args.strategy, args.mesh)
        optimizer = make_optimizer(args)
        options = dict(precision=PRECISIONS[args.precision], attention=args.attention)
        setup = models.build(args.strategy, mesh, model=model, optimizer=optimizer,
                             remat=args.remat, microbatches=args.microbatches, **options)  # fmt: skip
        ref = (
            models.build("ref", model=model, optimizer=optimizer, **options)
            if args.compare_reference
            else None
        )
        if ref is not None and args.moe and args.context_parallel:  # cp's capacity groups
            ref = grouped_reference(ref, context_shards(setup))
        # The reference routed by the sharded run's choices: each layer's kernel once a step
        # (not over a pipeline's stages, microbatches, or cp's plain-jnp reference).
        follower = None
        if (ref is not None and args.moe and mesh is not None and not args.context_parallel
                and not args.schedule and args.microbatches == 1):  # fmt: skip
            follower = RoutingFollower(args.layers, setup)
    except ValueError as e:  # a mesh the model cannot split over, or more devices than exist
        parser.error(str(e))
    if args.batch_size % (setup.batch_multiple * args.microbatches):
        parser.error(
            f"--batch-size {args.batch_size} must be a multiple of "
            f"{setup.batch_multiple * args.microbatches} (the devices {args.strategy} splits the "
            f"batch over on this mesh, {setup.batch_multiple}, × --microbatches "
            f"{args.microbatches})"
        )
    try:  # the batches' shape, as the steps will check it: --context under cp and sp
        setup.check_batch(np.zeros((args.batch_size, args.context), np.int32))
    except ValueError as e:
        parser.error(f"--context {args.context} does not fit strategy {args.strategy} on "
                     f"{mesh_text(mesh)}: {e}")  # fmt: skip
    try:
        corpus = text.load_corpus(args.text_source)
    except text.TextUnavailableError as e:  # --text-source tfds without a prepared copy
        raise SystemExit(f"transformer_lm.py: {e}") from None
    log(corpus.message)
    where = mesh_text(mesh)
    n_params = sum(
        math.prod(s.shape) for s in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))
    )
    log(f"Model: {model.name}, {n_params / 1e6:.2f}M parameters; strategy {args.strategy} on "
          f"{where}; {args.steps} steps of {args.batch_size}×{args.context} bytes")  # fmt: skip

    # the full init, shared by both runs, in the policy's parameter dtype
    params = model.init(jax.random.key(args.seed), dtype=setup.precision.param_dtype)
    state = setup.shard(params)
    ref_state = None if ref is None else ref.shard(params)
    del params

    rows = setup.process_rows(args.batch_size)  # this process's rows of every batch

    def place(x, y):  # one host batch, placed for the sharded run and, if any, the reference
        placed = setup.place_local_batch(x, y, batch=args.batch_size)
        return placed, (None if ref is None else ref.place_batch(x, y))

    eval_batch = args.batch_size  # a multiple of batch_multiple, as checked above
    try:  # the validation text is the shorter: a window size it cannot fill fails here
        valid_batches = list(itertools.islice(
            text.batches(corpus.valid, eval_batch, args.context, seed=args.seed, epoch=0),
            args.eval_batches,
        ))  # fmt: skip
    except ValueError as e:
        parser.error(f"--batch-size {args.batch_size} × --context {args.context} bytes do not fit "
                     f"the validation text of {corpus.name} ({len(corpus.valid)} bytes): {e}")  # fmt: skip
    history: dict = {"valid": []}

    def evaluate(step: int) -> str:
        loss, accuracy = validation_loss(setup, state.params, valid_batches)
        row = {"step": step, "loss": loss, "accuracy": accuracy}
        line = f"  validation at step {step}: loss {loss:.4f}, accuracy {accuracy:.3f}"
        if ref is not None:
            row["ref_loss"], row["ref_accuracy"] = validation_loss(
                ref, ref_state.params, valid_batches
            )
            line += f" (reference {row['ref_loss']:.4f})"
        history["valid"].append(row)
        return line

    losses, ref_losses = [], []  # device scalars, read when logging and at the end
    done, ckpt = 0, None  # steps trained so far
    if args.checkpoint_dir:
        ckpt = checkpoint.Checkpoints(args.checkpoint_dir, every=args.checkpoint_every)
    position = {"seed": args.seed, "batch_size": args.batch_size, "steps": args.steps,
                "corpus": corpus.name}  # fmt: skip
    if args.resume and ckpt.latest_step() is None:
        log(f"Resume: no checkpoint in {ckpt.directory} yet; starting at step 0")
    elif args.resume:
        # The newest step that restores intact: a damaged one is named and passed over.
        state, extra, done = ckpt.restore_latest_intact(setup, log=log)
        saved = ckpt.record(done)  # who saved it: strategy and mesh
        for key, value in position.items():
            if extra.get(key) != value:
                parser.error(f"--resume: the checkpoint in {ckpt.directory} was trained with "
                             f"{key} = {extra.get(key)}, this run has {value}")  # fmt: skip
        losses, history = extra["losses"], extra["history"]
        if done >= args.steps:
            parser.error(
                f"--resume: the checkpoint is at step {done}, already --steps {args.steps}"
            )
        log(f"Resume: step {done} from {ckpt.directory}, saved by "
            f"{saved['strategy']} on {saved['mesh']}")  # fmt: skip

    if args.locate:  # one gradient step, layer by layer, at the current parameters
        if args.strategy == "ref" or jax.process_count() > 1:
            parser.error("--locate compares a sharded strategy with the unsharded model in one "
                         "process")  # fmt: skip
        x, y = next(train_batches(corpus.train, args.batch_size, args.context, args.seed,
                                  slice(0, args.batch_size)))  # fmt: skip
        report = models.locate(setup, state.params, x, y)
        print(report)
        return 0 if report.within_bound else 1

    # The first non-finite loss or gradient stops the run, naming the step and the layer (the
    # replay runs the unsharded model: one process only).
    guard = (loop.NonFiniteGuard(setup, locate=jax.process_count() == 1)
             if args.stop_on_non_finite else None)  # fmt: skip

    def save(step: int) -> None:
        if guard is not None:
            guard.drain()  # every step saved is checked first: no checkpoint holds a NaN
        extra = {**position, "losses": [float(v) for v in losses], "history": history}
        ckpt.save(step, setup, state, extra=extra)

    batches = itertools.islice(
        train_batches(corpus.train, args.batch_size, args.context, args.seed, rows),
        done, args.steps,
    )  # fmt: skip
    train_start = time.perf_counter()
    first_step_seconds = None
    preempted = False
    inflight = loop.StepsInFlight()

    def drain() -> None:  # every step dispatched is done (and checked)
        inflight.drain()
        if guard is not None:
            guard.drain()

    # SIGTERM: save at the next step boundary, the same on every process; a stuck process
    # stops the run (under the launcher).
    with (
        shardops.preemption.Preemption() as preemption,
        shardops.watchdog.Watchdog(args.watchdog_timeout or None) as watchdog,
        checkpoint.waited_on_error(ckpt),
        Progress(args.steps) as progress,
    ):
        for step, (placed, ref_placed) in enumerate(loop.staged(place, batches), start=done + 1):
            if preemption.reached(step - 1):  # `step - 1` steps trained: a boundary
                preempted = True
                break
            watchdog.step(step - 1)
            # (a hook of None: none; the hooks are read when the steps are traced, at step 1)
            with shardops.layers.moe_routing_hook(follower and follower.record):
                if guard is None:
                    state, loss = setup.train_step(state, *placed)
                    inflight.add(loss)
                else:  # NonFiniteError at the first bad step
                    state, loss = guard.train_step(step, state, *placed)
            losses.append(loss)
            if follower is not None:
                follower.choices()  # the step's expert choices, for the reference to follow
            if ref is not None:  # the same host batch, from the same init
                with shardops.layers.moe_routing_hook(follower and follower.follow):
                    ref_state, ref_loss = ref.train_step(ref_state, *ref_placed)
                inflight.add(ref_loss)
                ref_losses.append(ref_loss)
            if follower is not None and (not_a_tie := follower.count(step)):
                print(f"FAILED: {not_a_tie}", file=sys.stderr)
                return 1
            if step == done + 1:  # compilation
                drain()
                first_step_seconds = time.perf_counter() - train_start
            if step % args.log_every == 0 or step == args.steps:
                line = f"step {step:>5}/{args.steps}: loss {float(loss):.4f}"
                if ref is not None:
                    line += f" (reference {float(ref_loss):.4f})"
                if follower is not None and follower.flips:
                    line += f"; routing flips followed: {sum(follower.flips.values())}"
                progress.print(line)
                if args.moe and jax.process_count() == 1:  # (the whole batch: one process)
                    progress.print(expert_line(model, setup.gather(state.params), placed[0],
                                               context_shards(setup)))  # fmt: skip
                progress.update(step, float(loss))
            else:
                progress.update(step)
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                drain()
                progress.print(evaluate(step))
            if ckpt is not None and (ckpt.should_save(step) or step == args.steps):
                save(step)
        drain()
    if preempted:
        done = step - 1
        if ckpt is None:
            log(f"Preempted at step {done}: nothing saved (no --checkpoint-dir)", flush=True)
        else:
            if done not in ckpt.steps():  # not saved already
                save(done)
            ckpt.close()  # waits for the save to be committed
            log(f"Preempted at step {done}: saved it in {ckpt.directory}; continue with "
                f"--resume", flush=True)  # fmt: skip
        raise SystemExit(shardops.preemption.EXIT_CODE)
    train_seconds = time.perf_counter() - train_start
    if ckpt is not None:
        log(f"Checkpoints: steps {ckpt.steps()} in {ckpt.directory}")
        ckpt.close()
    losses = [float(v) for v in losses]
    ref_losses = [float(v) for v in ref_losses]
    trained = args.steps - done  # this run's steps: a resumed run reports only what it trained
    tokens_trained = trained * args.batch_size * args.context
    tokens_per_second = tokens_trained / train_seconds
    which = f" ({done + 1}–{args.steps} of {args.steps}, resumed at step {done})" if done else ""
    log(f"Trained {trained} steps{which} in {train_seconds:.1f} s (first step, with compilation, "
          f"{first_step_seconds:.1f} s; {tokens_per_second:,.0f} tokens/s)")  # fmt: skip
    # Model FLOPs utilisation: the model's training FLOPs per second (PaLM's count) over the
    # machine's matmul peak in the compute dtype, measured now on the devices this run used
    # (on an accelerator with matrices large enough to keep it busy).
    model_flops = model.train_flops_per_token(args.context) * tokens_per_second
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    here = [d for d in devices if d.process_index == jax.process_index()]
    dtype = setup.precision.compute_dtype.name
    size = 512 if devices[0].platform == "cpu" else 4096
    peak = len(devices) * matmul_flops(here, dtype, size=size)  # every device busy at once
    mfu = model_flops / peak
    log(f"Model FLOPs utilisation {mfu:.1%}: {model_flops / 1e9:.2f} GFLOP/s of the model's "
        f"training ({model.train_flops_per_token(args.context) / 1e6:.2f} MFLOP per token) over "
        f"a measured peak of {peak / 1e9:.1f} GFLOP/s ({dtype} matmuls on all {len(devices)} "
        f"devices at once)")  # fmt: skip

    relative_diff = None
    if ref is not None:
        relative_diff = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
        log(f"Final loss: {losses[-1]:.6f} ({args.strategy}) vs {ref_losses[-1]:.6f} (ref), "
              f"relative difference {relative_diff:.2e} (limit {MAX_RELATIVE_DIFF:.0e})")  # fmt: skip
        if follower is not None:
            flips = follower.flips
            log(f"Routing: the reference followed {args.strategy}'s expert choices; its own "
                f"differed at {sum(flips.values())} token-layers, each a tie broken apart by "
                f"the two runs' scores (the largest gap {follower.worst[0]:.2f} of its bound)"
                + (f", at {len(flips)} steps from step {min(flips)} (the first: "
                   + ", ".join(f"{k}: {v}" for k, v in sorted(flips.items())[:5])
                   + (", …" if len(flips) > 5 else "") + ")" if flips else ""))  # fmt: skip
    else:
        log(f"Final loss: {losses[-1]:.6f}")
    valid = history["valid"][-1]
    log(f"Validation loss {valid['loss']:.4f} ({valid['loss'] / math.log(2):.3f} bits per byte), "
          f"accuracy {valid['accuracy']:.3f}, on {args.eval_batches}×{eval_batch} windows")  # fmt: skip

    sample, timing_decode = None, {}
    if args.sample_tokens:
        start = int(np.argmax(corpus.valid == ord("\n"))) + 1  # the validation text's second line
        prompt = corpus.valid[start : start + args.prompt_bytes]
        key = jax.random.key(args.seed)
        n = min(args.sample_tokens, model.context - len(prompt))
        if n < args.sample_tokens:
            log(f"Decoding {n} bytes, not {args.sample_tokens}: the prompt's {len(prompt)} "
                f"and the sample must fit the model's context of {model.context} positions "
                f"(--context)")  # fmt: skip
        generated, seconds, compiled, rows = decode(
            setup, state.params, prompt, n, temperature=args.temperature, key=key)  # fmt: skip
        log(f"KV-cache decoding: {rows} × {n} bytes in {seconds:.3f} s, "
            f"{rows * n / seconds:,.0f} tokens/s ({n / seconds:,.0f} per sequence; the "
            f"program compiled and ran first in {compiled:.1f} s)")  # fmt: skip
        timing_decode = {"decode_seconds": seconds, "decode_rows": rows,
                         "decode_tokens_per_second": rows * n / seconds}  # fmt: skip
        if args.compare_decoding:
            start = time.perf_counter()
            recomputed = generate(setup, state.params, prompt, n, temperature=0.0, key=key)
            slow = time.perf_counter() - start
            cached = decode(setup, state.params, prompt, n, temperature=0.0, key=key)
            same = int(np.sum(cached[0] == recomputed))
            log(f"Greedy, {n} bytes: full recompute {slow:.2f} s ({n / slow:,.0f} tokens/s) "
                f"vs KV cache {cached[1]:.3f} s ({n / cached[1]:,.0f} tokens/s per "
                f"sequence): {slow / cached[1]:.1f}× faster; {same} of {n} bytes the "
                f"same")  # fmt: skip
            timing_decode["recompute_seconds"] = slow
        sample = {"prompt": text.decode(prompt), "generated": text.decode(generated),
                  "temperature": args.temperature}  # fmt: skip
        how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
        log(f"Sample ({len(generated)} bytes, {how}) after a {len(prompt)}-byte prompt "
              f"from the validation text, between the markers:")  # fmt: skip
        log(f"{sample['prompt']}⟦{sample['generated']}⟧")

    total_seconds = time.perf_counter() - started
    log(f"Total {total_seconds:.1f} s")
    if not shardops.distributed.is_main():
        return 0
    if args.plot:
        plot(losses, ref_losses, history["valid"], args.plot,
             title=f"{model.name} · {args.strategy} on {where} · {corpus.name}")  # fmt: skip
        log(f"Plot: {args.plot}")
    if args.metrics_json:
        record = {
            "corpus": corpus.name, "corpus_message": corpus.message, "strategy": args.strategy,
            "mesh": None if mesh is None else dict(mesh.shape), "model": model.name,
            "parameters": n_params,
            "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
            "steps": list(range(1, args.steps + 1)), "losses": losses,
            "reference_losses": ref_losses or None, "valid": history["valid"],
            "final_loss": losses[-1], "final_reference_loss": ref_losses[-1] if ref_losses else None,
            "final_relative_diff": relative_diff, "final_valid_loss": valid["loss"],
            "routing_flips": None if follower is None else {str(k): v for k, v in
                                                            follower.flips.items()},
            "timing": {"train_seconds": train_seconds, "first_step_seconds": first_step_seconds,
                       "total_seconds": total_seconds, "tokens_per_second": tokens_per_second,
                       "resumed_at": done, "steps_trained": trained,
                       "tokens_trained": tokens_trained, "model_flops_per_second": model_flops,
                       "peak_flops_per_second": peak, "mfu": mfu, **timing_decode},
            "sample": sample,
        }  # fmt: skip
        with open(args.metrics_json, "w") as f:
            json.dump(record, f, indent=1)
    if relative_diff is not None and relative_diff > MAX_RELATIVE_DIFF:
        print(f"FAILED: the final losses differ by {relative_diff:.2e} relative, more than "
              f"{MAX_RELATIVE_DIFF:.0e}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def plot(losses, ref_losses, valid, path, title):
    """Training loss per step (and the reference's), validation loss points; with a reference,
    a second panel of the relative difference per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(losses) + 1)
    panels = 2 if ref_losses else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 3.6), squeeze=False)
    ax = axes[0, 0]
    ax.plot(steps, losses, lw=1.2, label="train (sharded)")
    if ref_losses:
        ax.plot(steps, ref_losses, "k--", lw=0.9, label="train (reference)")
    ax.plot([v["step"] for v in valid], [v["loss"] for v in valid], "o", color="tab:red",
            label="validation")  # fmt: skip
    ax.axhline(math.log(256), color="gray", lw=0.6, ls=":", label="uniform, ln 256")
    ax.set(xlabel="step", ylabel="cross-entropy (nats per byte)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if ref_losses:
        ax = axes[0, 1]
        diff = np.abs(np.asarray(losses) - ref_losses) / np.abs(ref_losses)  # (steps,)
        differ = diff > 0  # a log axis has no place for the steps where the losses are equal
        ax.semilogy(steps[differ], diff[differ], ".", ms=3,
                    label=f"equal at {np.sum(~differ)} of {len(diff)} steps")  # fmt: skip
        ax.axhline(MAX_RELATIVE_DIFF, color="tab:red", lw=0.8, ls="--", label="limit 1e-3")
        ax.set(xlabel="step", ylabel="|loss − ref| / ref", title="sharded vs reference")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
