"""What examples/transformer_lm.py reports: its lines, on process 0 only (``log``), the
throughput and model FLOPs utilisation of the steps it trained (``report_throughput``), the
``--metrics-json`` record (``write_metrics``) and the ``--plot`` of the losses (``plot``)."""

import json
import math

import jax
import numpy as np

import shardops.distributed
from shardops_models.search import matmul_flops

MAX_RELATIVE_DIFF = 1e-3  # --compare-reference: |loss − ref_loss| / ref_loss at the last step


def log(*args, **kwargs) -> None:
    """``print`` on process 0 only: the figures are global, one copy is enough."""
    if shardops.distributed.is_main():
        print(*args, **kwargs)


def report_throughput(run, first_step_seconds: float, train_seconds: float) -> dict:
    """Logs the steps this run trained (a resumed run: only those), their tokens/s and the
    model FLOPs utilisation; returns those figures, for the metrics' timing."""
    args, model, mesh, done = run.args, run.model, run.mesh, run.done
    trained = args.steps - done  # this run's steps: a resumed run reports only what it trained
    tokens_trained = trained * args.batch_size * args.context
    tokens_per_second = tokens_trained / train_seconds
    which = f" ({done + 1}–{args.steps} of {args.steps}, resumed at step {done})" if done else ""
    log(f"Trained {trained} steps{which} in {train_seconds:.1f} s (first step, with compilation, "
          f"{first_step_seconds:.1f} s; {tokens_per_second:,.0f} tokens/s)")  # fmt: skip
    # Model FLOPs utilisation: the model's training FLOPs per second (PaLM's count) over the
    # machine's matmul peak in the compute dtype, measured now on the devices this run used
    # (on an accelerator with matrices large enough to keep it busy).
    timing = {"tokens_per_second": tokens_per_second, "resumed_at": done, "steps_trained": trained,
              "tokens_trained": tokens_trained}  # fmt: skip
    if not hasattr(model, "train_flops_per_token"):  # a Flax module: its FLOPs are its own code's
        return {**timing, "model_flops_per_second": None, "peak_flops_per_second": None,
                "mfu": None}  # fmt: skip
    model_flops = model.train_flops_per_token(args.context) * tokens_per_second
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    here = [d for d in devices if d.process_index == jax.process_index()]
    dtype = run.setup.precision.compute_dtype.name
    size = 512 if devices[0].platform == "cpu" else 4096
    peak = len(devices) * matmul_flops(here, dtype, size=size)  # every device busy at once
    mfu = model_flops / peak
    log(f"Model FLOPs utilisation {mfu:.1%}: {model_flops / 1e9:.2f} GFLOP/s of the model's "
        f"training ({model.train_flops_per_token(args.context) / 1e6:.2f} MFLOP per token) over "
        f"a measured peak of {peak / 1e9:.1f} GFLOP/s ({dtype} matmuls on all {len(devices)} "
        f"devices at once)")  # fmt: skip
    return {**timing, "model_flops_per_second": model_flops, "peak_flops_per_second": peak,
            "mfu": mfu}  # fmt: skip


def write_metrics(run, path: str, losses, ref_losses, relative_diff, timing: dict, sample) -> None:
    """The ``--metrics-json`` record: the run's text, layout and model, its arguments, the
    losses per step (the reference's), the validation history, the final figures, the
    routing flips the reference followed, ``timing`` and the ``sample``."""
    args, mesh, follower = run.args, run.mesh, run.follower
    record = {
        "corpus": run.corpus.name, "corpus_message": run.corpus.message, "strategy": args.strategy,
        "mesh": None if mesh is None else dict(mesh.shape), "model": run.model.name,
        "parameters": run.n_params,
        "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
        "steps": list(range(1, args.steps + 1)), "losses": losses,
        "reference_losses": ref_losses or None, "valid": run.history["valid"],
        "final_loss": losses[-1], "final_reference_loss": ref_losses[-1] if ref_losses else None,
        "final_relative_diff": relative_diff, "final_valid_loss": run.history["valid"][-1]["loss"],
        "routing_flips": None if follower is None else {str(k): v for k, v in
                                                        follower.flips.items()},
        "timing": timing,
        "sample": sample,
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


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
