"""The command line of examples/transformer_lm.py: its flags, in groups (which model and how it
is split, the experts, the pipeline, training, the model's sizes, what is logged, evaluated and
sampled, the run's files and safeguards), and the checks that make a value out of range or a
combination the run cannot honour one usage line (argparse's, exit status 2) before anything
is built."""

import argparse

import shardops
import shardops.watchdog
import shardops_models as models
from shardops_models.data import text

PRECISIONS = {"float32": shardops.FLOAT32, "mixed_bfloat16": shardops.MIXED_BFLOAT16,
              "bfloat16": shardops.BFLOAT16}  # fmt: skip


def parse_command_line(argv=None, description: str | None = None):
    """``(parser, args)``: ``argv`` (the command line's when None) parsed, checked and completed
    (``check_args``); ``description`` heads ``--help``."""
    p = argparse.ArgumentParser(description=description)
    _strategy_arguments(p)
    _expert_arguments(p)
    _pipeline_arguments(p)
    _training_arguments(p)
    _model_arguments(p)
    _evaluation_arguments(p)
    _run_arguments(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return p, args


def parse_mesh(spec: str) -> str:
    """``--mesh``: axis sizes, checked here so a bad spec is one argparse line."""
    try:
        shardops.parse_mesh(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def capacity_factor(value: str) -> float | None:
    """``--capacity-factor``: a number, or ``none`` (dropless: ``Experts(capacity_factor=None)``)."""
    if value.strip().lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a number (e.g. 1.25) nor 'none' (dropless)"
        ) from None


def _strategy_arguments(p: argparse.ArgumentParser) -> None:
    """Which model, and how it is split: ``--model``, ``--strategy``, ``--mesh``,
    ``--context-parallel``."""
    p.add_argument("--model", default="gpt", choices=("gpt", "llama", "flax-llama"),
                   help="models.Gpt (learned positions, GELU MLP), models.Llama (RoPE, "
                        "grouped-query attention, SwiGLU, RMSNorm), or flax-llama: the same "
                        "Llama written in Flax NNX (examples/flax_llama.py), trained as written "
                        "by FlaxModel (needs the flax extra)")  # fmt: skip
    p.add_argument("--strategy", default="fsdp_tp", choices=sorted(models.STRATEGIES))
    p.add_argument("--mesh", default="4x2", type=parse_mesh,
                   help="axis sizes: 4x2 (data×model, the default), 8x1, 2x4, or named, e.g. "
                        "replica=2,data=2,model=2")  # fmt: skip
    p.add_argument("--context-parallel", choices=shardops.layers.CONTEXT_METHODS,
                   metavar="METHOD",
                   help="split the sequence over the mesh's 'context' axis as well, attention "
                        "by METHOD: allgather, ring or ulysses (the strategy becomes "
                        "STRATEGY+METHOD)")  # fmt: skip


def _expert_arguments(p: argparse.ArgumentParser) -> None:
    """The mixture of experts: ``--moe`` and its experts, routing, load balance and
    ``--expert-parallel``."""
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


def _pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """``--schedule`` and its ``--virtual`` stages; ``--microbatches``."""
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


def _training_arguments(p: argparse.ArgumentParser) -> None:
    """The run's length, batch, learning rate and seed."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="windows of --context bytes")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up")
    p.add_argument("--seed", type=int, default=0, help="init, batch order and sampling")


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's sizes, the gradients' clipping and how each step computes (remat,
    precision, attention)."""
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


def _evaluation_arguments(p: argparse.ArgumentParser) -> None:
    """What is logged, evaluated and sampled, and from which text."""
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


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """What the run does besides training (``--locate``, ``--compare-reference``),
    its files, checkpoints and safeguards."""
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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (``p.error``) a value out of range or flags the run cannot honour together, and
    completes ``args``: ``--sample-tokens``' and ``--clip``'s defaults, and the strategy named
    after what the run composes onto it (``strategy_name``)."""
    _check_ranges(p, args)
    _check_combinations(p, args)
    args.strategy = strategy_name(args)
    if args.clip is None and args.model in ("llama", "flax-llama"):
        args.clip = 1.0
    if args.clip is not None and not args.clip > 0:
        p.error(f"--clip must be a positive norm; got {args.clip}")


def _check_ranges(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each number in its range; the prompt leaves room in the context for the sample."""
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


def _check_combinations(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags that need or exclude others: ``--resume``, the Llama's options, ``--moe`` and
    ``--expert-parallel``, the pipeline's, ``--locate``."""
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.resume and args.compare_reference:
        p.error("--compare-reference compares whole runs from the init: not with --resume")
    if args.model == "gpt" and (args.kv_heads is not None or args.tie_embeddings):
        p.error("--kv-heads and --tie-embeddings are options of --model llama")
    if args.model == "flax-llama":
        _check_flax(p, args)
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
    if args.expert_parallel and not args.moe:
        p.error("--expert-parallel splits the experts of --moe")
    if args.expert_parallel and args.capacity_factor is None:
        p.error(f"--capacity-factor none (dropless) keeps every expert whole on each "
                f"device, which --expert-parallel splits; pass --capacity-factor "
                f"{args.experts / args.top_k:g} (experts / top-k: drops nothing either) "
                f"or drop --expert-parallel")  # fmt: skip
    if args.microbatches < 1:
        p.error(f"--microbatches must be a positive int; got {args.microbatches}")
    if args.schedule and args.locate:
        p.error("--schedule: --locate taps the layers of one device's forward; locate "
                "without --schedule (the layers are the same)")  # fmt: skip
    if args.virtual is not None and args.schedule != "circular":
        p.error(f"--virtual {args.virtual}: virtual stages are the circular schedule's; add "
                f"--schedule circular")  # fmt: skip
    if args.context_parallel and args.locate:
        p.error("--locate compares activations in token order; run it without "
                "--context-parallel (the other axes' layers are the same)")  # fmt: skip


FLAX_REFUSED = {"tie_embeddings": "--tie-embeddings", "moe": "--moe", "schedule": "--schedule",
                "context_parallel": "--context-parallel", "locate": "--locate",
                "compare_decoding": "--compare-decoding"}  # fmt: skip
"""The flags ``--model flax-llama`` does not take: its module has no tied head, experts,
stacked blocks or KV cache of shardops', and its own attention (einsums) cannot run under context
parallelism."""


def _check_flax(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--model flax-llama``: the flags a Flax module cannot honour (``docs/flax.md``)."""
    given = [flag for name, flag in FLAX_REFUSED.items() if getattr(args, name)]
    if given:
        p.error(f"--model flax-llama trains examples/flax_llama.py as written: without "
                f"{', '.join(given)} (use --model llama for them)")  # fmt: skip


def strategy_name(args: argparse.Namespace) -> str:
    """``--strategy`` with what the run composes onto it: ``+ep`` (``--expert-parallel``),
    ``+SCHEDULE`` (with its virtual stages when ``--virtual`` is not 2) and ``+METHOD``
    (``--context-parallel``), in that order."""
    name = args.strategy
    if args.expert_parallel:
        name = f"{name}+ep"
    if args.schedule:
        circular = args.virtual not in (None, 2) and args.schedule == "circular"
        name = f"{name}+{args.schedule}" + (str(args.virtual) if circular else "")
    if args.context_parallel:
        name = f"{name}+{args.context_parallel}"
    return name
