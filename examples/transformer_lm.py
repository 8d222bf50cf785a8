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

``--model flax-llama`` trains the same Llama written in Flax NNX (``examples/flax_llama.py``,
annotated with logical axis names, not written for shardops) through ``FlaxModel``, which runs
each of its layers with shardops' kernels (``docs/flax.md``): dp, fsdp, zero1, tp and their
compositions; it samples by recomputing the prefix (its attention has no KV cache here) and
reports no FLOP utilisation (its attention's FLOPs are its own code's).

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

This script is the run, phase after phase; the modules beside it hold its parts, one each:
the command line (``_lm_arguments.py``), the experts' reference, follower and log line
(``_lm_experts.py``), the decoding of the sample (``_lm_decoding.py``), the progress bar
(``_lm_progress.py``) and the report, metrics and plot (``_lm_report.py``).
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
import itertools
import math
import sys
import time

import jax
import numpy as np
import optax

# The script's parts, beside it in examples/ (Python puts a script's folder on sys.path).
from _lm_arguments import PRECISIONS, parse_command_line
from _lm_decoding import decode, generate
from _lm_experts import RoutingFollower, context_shards, expert_line, grouped_reference
from _lm_progress import Progress
from _lm_report import MAX_RELATIVE_DIFF, log, plot, report_throughput, write_metrics

import shardops
import shardops.distributed
import shardops.preemption
import shardops.watchdog
import shardops_models as models
from shardops_models.data import text
from shardops_models.training import checkpoint, loop
from shardops_models.training.meshes import mesh_for, mesh_text


def parse_args(argv=None):
    """``(parser, args)``: the command line, parsed and checked (``_lm_arguments``); its
    ``--help`` starts with the first paragraph of the module's docstring."""
    return parse_command_line(argv, description=__doc__.split("\n\n")[0])


def make_model(args):
    """``models.Gpt``, ``models.Llama`` or the Flax NNX Llama (``flax_model``) of the
    arguments' sizes, over the 256 byte values."""
    if args.model == "flax-llama":
        return flax_model(args)
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


def flax_model(args):
    """examples/flax_llama.py's Llama (Flax NNX) of ``--model llama``'s sizes, as
    ``FlaxModel`` trains it (``docs/flax.md``): its own rules table, its heads declared, its
    positions passed (MaxText's ``decoder_positions``)."""
    import flax_llama

    from shardops_models.interop.flax_nnx import FlaxModel
    from shardops_models.networks.llama import default_d_ff

    kv_heads = args.kv_heads if args.kv_heads is not None else max(1, args.heads // 2)
    config = flax_llama.Config(vocab_size=text.VOCAB_SIZE, d_model=args.width,
                               num_heads=args.heads, num_kv_heads=kv_heads,
                               d_ff=default_d_ff(args.width), num_layers=args.layers)  # fmt: skip
    return FlaxModel(lambda rngs: flax_llama.Llama(config, rngs=rngs), rules=flax_llama.RULES,
                     name=f"flax llama L={args.layers} D={args.width} H={args.heads}/{kv_heads}",
                     num_heads=args.heads, num_kv_heads=kv_heads, context=args.context,
                     positions="positions")  # fmt: skip


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


@dataclasses.dataclass
class Run:
    """One run's pieces, shared by its phases: the arguments, the model, the mesh, the sharded
    run's Setup and the unsharded reference's (``--compare-reference``; else None) with the
    follower of the sharded run's expert choices, the text and this process's rows of every
    batch, the train states, and what the steps so far made: the losses (device scalars, read
    when logging and at the end), the validation history, the steps trained before this run
    (``done``: a resumed run's checkpoint), the checkpoints and the non-finite guard."""

    args: argparse.Namespace
    model: models.Gpt | models.Llama
    mesh: jax.sharding.Mesh | None
    setup: models.Setup
    ref: models.Setup | None
    follower: RoutingFollower | None
    corpus: text.Corpus
    n_params: int
    rows: slice
    valid_batches: list
    state: models.TrainState
    ref_state: models.TrainState | None
    losses: list = dataclasses.field(default_factory=list)
    ref_losses: list = dataclasses.field(default_factory=list)
    history: dict = dataclasses.field(default_factory=lambda: {"valid": []})
    done: int = 0
    ckpt: checkpoint.Checkpoints | None = None
    position: dict = dataclasses.field(default_factory=dict)  # what a resume must continue
    guard: loop.NonFiniteGuard | None = None

    def place(self, x, y):
        """One host batch, placed for the sharded run and, if any, the reference."""
        placed = self.setup.place_local_batch(x, y, batch=self.args.batch_size)
        return placed, (None if self.ref is None else self.ref.place_batch(x, y))

    def evaluate(self, step: int) -> str:
        """The validation loss and accuracy at ``step`` (the reference's too), added to the
        history; the line to print."""
        loss, accuracy = validation_loss(self.setup, self.state.params, self.valid_batches)
        row = {"step": step, "loss": loss, "accuracy": accuracy}
        line = f"  validation at step {step}: loss {loss:.4f}, accuracy {accuracy:.3f}"
        if self.ref is not None:
            row["ref_loss"], row["ref_accuracy"] = validation_loss(
                self.ref, self.ref_state.params, self.valid_batches
            )
            line += f" (reference {row['ref_loss']:.4f})"
        self.history["valid"].append(row)
        return line

    def save(self, step: int) -> None:
        """A checkpoint of ``step``: the train state, with the losses and history so far."""
        if self.guard is not None:
            self.guard.drain()  # every step saved is checked first: no checkpoint holds a NaN
        extra = {**self.position, "losses": [float(v) for v in self.losses],
                 "history": self.history}  # fmt: skip
        self.ckpt.save(step, self.setup, self.state, extra=extra)


def main(argv=None) -> int:
    shardops.distributed.initialize()  # joins a multi-process run; a no-op otherwise
    parser, args = parse_args(argv)
    try:
        return train(parser, args)
    except loop.NonFiniteError as e:  # --stop-on-non-finite
        raise SystemExit(f"Stopped: {e}") from None


def train(parser, args) -> int:
    """The run, phase after phase: set up (and resume), train, report, sample, write the files.
    Returns the exit status: 1 when a check fails (the final losses against the reference's,
    the reference's routing, ``--locate``'s bounds)."""
    started = time.perf_counter()
    run = set_up(parser, args)
    resume(parser, run)
    if args.locate:  # one gradient step, layer by layer, at the current parameters
        return locate(parser, run)
    # The first non-finite loss or gradient stops the run, naming the step and the layer (the
    # replay runs the unsharded model: one process only).
    run.guard = (loop.NonFiniteGuard(run.setup, locate=jax.process_count() == 1)
                 if args.stop_on_non_finite else None)  # fmt: skip
    seconds = train_steps(run)
    if seconds is None:  # the reference's routing was not a tie broken apart (printed)
        return 1
    first_step_seconds, train_seconds = seconds
    if run.ckpt is not None:
        log(f"Checkpoints: steps {run.ckpt.steps()} in {run.ckpt.directory}")
        run.ckpt.close()
    losses = [float(v) for v in run.losses]
    ref_losses = [float(v) for v in run.ref_losses]
    throughput = report_throughput(run, first_step_seconds, train_seconds)
    relative_diff = report_losses(run, losses, ref_losses)
    sample, timing_decode = sample_text(run)
    total_seconds = time.perf_counter() - started
    log(f"Total {total_seconds:.1f} s")
    if not shardops.distributed.is_main():
        return 0
    if args.plot:
        plot(losses, ref_losses, run.history["valid"], args.plot,
             title=f"{run.model.name} · {args.strategy} on {mesh_text(run.mesh)} · "
                   f"{run.corpus.name}")  # fmt: skip
        log(f"Plot: {args.plot}")
    if args.metrics_json:
        timing = {"train_seconds": train_seconds, "first_step_seconds": first_step_seconds,
                  "total_seconds": total_seconds, **throughput, **timing_decode}  # fmt: skip
        write_metrics(run, args.metrics_json, losses, ref_losses, relative_diff, timing, sample)
    if relative_diff is not None and relative_diff > MAX_RELATIVE_DIFF:
        print(f"FAILED: the final losses differ by {relative_diff:.2e} relative, more than "
              f"{MAX_RELATIVE_DIFF:.0e}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def build_setups(parser, args):
    """``(model, mesh, setup, ref, follower)``: the model, the mesh, the sharded run's Setup,
    the reference's (``--compare-reference``; else None) and the follower that routes the
    reference by the sharded run's expert choices (else None). A mesh the model cannot split,
    or a batch or context the strategy cannot, is a usage error."""
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
        if args.model == "flax-llama" and mesh is not None:  # a Flax module's layout checks
            setup.collective_budget(setup.batch_multiple, args.context)  # run in its trace
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
    return model, mesh, setup, ref, follower


def set_up(parser, args) -> Run:
    """The run before its first step: the setups (``build_setups``), the text, the full init
    sharded for both runs, and the validation batches; logs the text and the model."""
    model, mesh, setup, ref, follower = build_setups(parser, args)
    try:
        corpus = text.load_corpus(args.text_source)
    except text.TextUnavailableError as e:  # --text-source tfds without a prepared copy
        raise SystemExit(f"transformer_lm.py: {e}") from None
    log(corpus.message)
    n_params = sum(
        math.prod(s.shape) for s in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))
    )
    log(f"Model: {model.name}, {n_params / 1e6:.2f}M parameters; strategy {args.strategy} on "
          f"{mesh_text(mesh)}; {args.steps} steps of {args.batch_size}×{args.context} bytes")  # fmt: skip

    # the full init, shared by both runs, in the policy's parameter dtype
    params = model.init(jax.random.key(args.seed), dtype=setup.precision.param_dtype)
    state = setup.shard(params)
    ref_state = None if ref is None else ref.shard(params)
    del params

    rows = setup.process_rows(args.batch_size)  # this process's rows of every batch
    eval_batch = args.batch_size  # a multiple of batch_multiple, as checked above
    try:  # the validation text is the shorter: a window size it cannot fill fails here
        valid_batches = list(itertools.islice(
            text.batches(corpus.valid, eval_batch, args.context, seed=args.seed, epoch=0),
            args.eval_batches,
        ))  # fmt: skip
    except ValueError as e:
        parser.error(f"--batch-size {args.batch_size} × --context {args.context} bytes do not fit "
                     f"the validation text of {corpus.name} ({len(corpus.valid)} bytes): {e}")  # fmt: skip
    return Run(args=args, model=model, mesh=mesh, setup=setup, ref=ref, follower=follower,
               corpus=corpus, n_params=n_params, rows=rows, valid_batches=valid_batches,
               state=state, ref_state=ref_state)  # fmt: skip


def resume(parser, run: Run) -> None:
    """Opens ``--checkpoint-dir`` and, with ``--resume``, continues from its newest intact
    step: the state, the losses and history so far, and the steps done. A checkpoint of
    another seed, batch size, length or text, or of every step already, is a usage error."""
    args = run.args
    if args.checkpoint_dir:
        run.ckpt = checkpoint.Checkpoints(args.checkpoint_dir, every=args.checkpoint_every)
    run.position = {"seed": args.seed, "batch_size": args.batch_size, "steps": args.steps,
                    "corpus": run.corpus.name}  # fmt: skip
    ckpt = run.ckpt
    if args.resume and ckpt.latest_step() is None:
        log(f"Resume: no checkpoint in {ckpt.directory} yet; starting at step 0")
    elif args.resume:
        # The newest step that restores intact: a damaged one is named and passed over.
        run.state, extra, run.done = ckpt.restore_latest_intact(run.setup, log=log)
        saved = ckpt.record(run.done)  # who saved it: strategy and mesh
        for key, value in run.position.items():
            if extra.get(key) != value:
                parser.error(f"--resume: the checkpoint in {ckpt.directory} was trained with "
                             f"{key} = {extra.get(key)}, this run has {value}")  # fmt: skip
        run.losses, run.history = extra["losses"], extra["history"]
        if run.done >= args.steps:
            parser.error(
                f"--resume: the checkpoint is at step {run.done}, already --steps {args.steps}"
            )
        log(f"Resume: step {run.done} from {ckpt.directory}, saved by "
            f"{saved['strategy']} on {saved['mesh']}")  # fmt: skip


def locate(parser, run: Run) -> int:
    """``--locate``: one gradient step on the first batch, compared with the unsharded model's
    layer by layer (``models.locate``); prints the report. 0 when every layer is within its
    bound, else 1."""
    args = run.args
    if args.strategy == "ref" or jax.process_count() > 1:
        parser.error("--locate compares a sharded strategy with the unsharded model in one "
                     "process")  # fmt: skip
    x, y = next(train_batches(run.corpus.train, args.batch_size, args.context, args.seed,
                              slice(0, args.batch_size)))  # fmt: skip
    report = models.locate(run.setup, run.state.params, x, y)
    print(report)
    return 0 if report.within_bound else 1


def train_steps(run: Run) -> tuple[float, float] | None:
    """Steps ``done + 1`` to ``--steps``: each logged, evaluated and saved as the flags ask.
    Returns ``(first step's seconds, with compilation; all the steps' seconds)``, or None when
    the reference's routing was not a tie broken apart (printed). A preemption notice saves
    and exits (``stop_preempted``)."""
    args = run.args
    batches = itertools.islice(
        train_batches(run.corpus.train, args.batch_size, args.context, args.seed, run.rows),
        run.done, args.steps,
    )  # fmt: skip
    train_start = time.perf_counter()
    first_step_seconds = None
    preempted = False
    inflight = loop.StepsInFlight()

    def drain() -> None:  # every step dispatched is done (and checked)
        inflight.drain()
        if run.guard is not None:
            run.guard.drain()

    # SIGTERM: save at the next step boundary, the same on every process; a stuck process
    # stops the run (under the launcher).
    with (
        shardops.preemption.Preemption() as preemption,
        shardops.watchdog.Watchdog(args.watchdog_timeout or None) as watchdog,
        checkpoint.waited_on_error(run.ckpt),
        Progress(args.steps) as progress,
    ):
        for step, (placed, ref_placed) in enumerate(loop.staged(run.place, batches),
                                                    start=run.done + 1):  # fmt: skip
            if preemption.reached(step - 1):  # `step - 1` steps trained: a boundary
                preempted = True
                break
            watchdog.step(step - 1)
            loss, ref_loss = train_step(run, step, placed, ref_placed, inflight)
            if run.follower is not None and (not_a_tie := run.follower.count(step)):
                print(f"FAILED: {not_a_tie}", file=sys.stderr)
                return None
            if step == run.done + 1:  # compilation
                drain()
                first_step_seconds = time.perf_counter() - train_start
            log_step(run, step, loss, ref_loss, placed[0], progress)
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                drain()
                progress.print(run.evaluate(step))
            if run.ckpt is not None and (run.ckpt.should_save(step) or step == args.steps):
                run.save(step)
        drain()
    if preempted:
        stop_preempted(run, step - 1)
    return first_step_seconds, time.perf_counter() - train_start


def train_step(run: Run, step: int, placed, ref_placed, inflight: loop.StepsInFlight):
    """One step of the sharded run and, from the same host batch, of the reference in
    lockstep, routed by the sharded run's expert choices when a follower is set; returns the
    two losses (device scalars; the reference's None without one)."""
    follower, ref_loss = run.follower, None
    # (a hook of None: none; the hooks are read when the steps are traced, at step 1)
    with shardops.layers.moe_routing_hook(follower and follower.record):
        if run.guard is None:
            run.state, loss = run.setup.train_step(run.state, *placed)
            inflight.add(loss)
        else:  # NonFiniteError at the first bad step
            run.state, loss = run.guard.train_step(step, run.state, *placed)
    run.losses.append(loss)
    if follower is not None:
        follower.choices()  # the step's expert choices, for the reference to follow
    if run.ref is not None:  # the same host batch, from the same init
        with shardops.layers.moe_routing_hook(follower and follower.follow):
            run.ref_state, ref_loss = run.ref.train_step(run.ref_state, *ref_placed)
        inflight.add(ref_loss)
        run.ref_losses.append(ref_loss)
    return loss, ref_loss


def log_step(run: Run, step: int, loss, ref_loss, ids, progress: Progress) -> None:
    """The progress at ``step``, and every ``--log-every`` steps (and at the last) its loss
    line: the reference's loss, the routing flips followed, and with ``--moe`` the experts on
    the step's batch ``ids``."""
    args, follower = run.args, run.follower
    if step % args.log_every == 0 or step == args.steps:
        line = f"step {step:>5}/{args.steps}: loss {float(loss):.4f}"
        if run.ref is not None:
            line += f" (reference {float(ref_loss):.4f})"
        if follower is not None and follower.flips:
            line += f"; routing flips followed: {sum(follower.flips.values())}"
        progress.print(line)
        if args.moe and jax.process_count() == 1:  # (the whole batch: one process)
            progress.print(expert_line(run.model, run.setup.gather(run.state.params), ids,
                                       context_shards(run.setup)))  # fmt: skip
        progress.update(step, float(loss))
    else:
        progress.update(step)


def stop_preempted(run: Run, done: int) -> None:
    """The run got a preemption notice after ``done`` steps: save that step (with a
    ``--checkpoint-dir``) and exit with ``shardops.preemption.EXIT_CODE``."""
    ckpt = run.ckpt
    if ckpt is None:
        log(f"Preempted at step {done}: nothing saved (no --checkpoint-dir)", flush=True)
    else:
        if done not in ckpt.steps():  # not saved already
            run.save(done)
        ckpt.close()  # waits for the save to be committed
        log(f"Preempted at step {done}: saved it in {ckpt.directory}; continue with "
            f"--resume", flush=True)  # fmt: skip
    raise SystemExit(shardops.preemption.EXIT_CODE)


def report_losses(run: Run, losses: list, ref_losses: list) -> float | None:
    """Logs the final loss (against the reference's, and how the reference routed), and the
    last validation loss; returns the final losses' relative difference (None without a
    reference)."""
    args, relative_diff = run.args, None
    if run.ref is not None:
        relative_diff = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
        log(f"Final loss: {losses[-1]:.6f} ({args.strategy}) vs {ref_losses[-1]:.6f} (ref), "
              f"relative difference {relative_diff:.2e} (limit {MAX_RELATIVE_DIFF:.0e})")  # fmt: skip
        if run.follower is not None:
            log(run.follower.summary(args.strategy))
    else:
        log(f"Final loss: {losses[-1]:.6f}")
    valid = run.history["valid"][-1]
    log(f"Validation loss {valid['loss']:.4f} ({valid['loss'] / math.log(2):.3f} bits per byte), "
          f"accuracy {valid['accuracy']:.3f}, on {args.eval_batches}×{args.batch_size} windows")  # fmt: skip
    return relative_diff


def sample_text(run: Run) -> tuple[dict | None, dict]:
    """``--sample-tokens`` bytes after a prompt from the validation text, decoded with the KV
    cache (``decode``) and logged, with ``--compare-decoding`` timed against recomputing the
    prefix; returns the sample (None without one) and the decoding's timing."""
    args, model, params, valid = run.args, run.model, run.state.params, run.corpus.valid
    if not args.sample_tokens:
        return None, {}
    start = int(np.argmax(valid == ord("\n"))) + 1  # the validation text's second line
    prompt = valid[start : start + args.prompt_bytes]
    key = jax.random.key(args.seed)
    n = min(args.sample_tokens, model.context - len(prompt))
    if n < args.sample_tokens:
        log(f"Decoding {n} bytes, not {args.sample_tokens}: the prompt's {len(prompt)} "
            f"and the sample must fit the model's context of {model.context} positions "
            f"(--context)")  # fmt: skip
    if isinstance(model, models.Gpt | models.Llama):
        generated, seconds, compiled, rows = decode(
            run.setup, params, prompt, n, temperature=args.temperature, key=key)  # fmt: skip
        log(f"KV-cache decoding: {rows} × {n} bytes in {seconds:.3f} s, "
            f"{rows * n / seconds:,.0f} tokens/s ({n / seconds:,.0f} per sequence; the "
            f"program compiled and ran first in {compiled:.1f} s)")  # fmt: skip
    else:  # a Flax module's attention is its own: no KV cache, the prefix recomputed
        start, rows = time.perf_counter(), 1
        generated = generate(run.setup, params, prompt, n, temperature=args.temperature, key=key)
        seconds = time.perf_counter() - start
        log(f"Decoding by recomputing the prefix ({model.name}'s attention is its own, with no "
            f"KV cache): {n} bytes in {seconds:.1f} s")  # fmt: skip
    timing_decode = {"decode_seconds": seconds, "decode_rows": rows,
                     "decode_tokens_per_second": rows * n / seconds}  # fmt: skip
    if args.compare_decoding:
        timing_decode["recompute_seconds"] = compare_decoding(run.setup, params, prompt, n, key)
    sample = {"prompt": text.decode(prompt), "generated": text.decode(generated),
              "temperature": args.temperature}  # fmt: skip
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    log(f"Sample ({len(generated)} bytes, {how}) after a {len(prompt)}-byte prompt "
          f"from the validation text, between the markers:")  # fmt: skip
    log(f"{sample['prompt']}⟦{sample['generated']}⟧")
    return sample, timing_decode


def compare_decoding(setup, params, prompt: np.ndarray, n: int, key) -> float:
    """``--compare-decoding``: ``n`` greedy bytes by recomputing the whole prefix for every
    byte (``generate``) against the KV cache's, timed and compared, logged; returns the
    recompute's seconds."""
    start = time.perf_counter()
    recomputed = generate(setup, params, prompt, n, temperature=0.0, key=key)
    slow = time.perf_counter() - start
    cached = decode(setup, params, prompt, n, temperature=0.0, key=key)
    same = int(np.sum(cached[0] == recomputed))
    log(f"Greedy, {n} bytes: full recompute {slow:.2f} s ({n / slow:,.0f} tokens/s) "
        f"vs KV cache {cached[1]:.3f} s ({n / cached[1]:,.0f} tokens/s per "
        f"sequence): {slow / cached[1]:.1f}× faster; {same} of {n} bytes the "
        f"same")  # fmt: skip
    return slow


if __name__ == "__main__":
    sys.exit(main())
