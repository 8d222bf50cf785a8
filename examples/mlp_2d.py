"""Train the seed's MNIST MLP with 2D (data × model) sharding on a 4×2 mesh.

The seed's recipe: layer sizes 784-512-10, Gaussian init × 0.01, SGD with
lr = 1.0 · 0.95^(epoch/5), loss -mean(one_hot · log_softmax(logits)), batch 128, 20 epochs.

    python examples/mlp_2d.py                                   # the default run
    python examples/mlp_2d.py --strategy fsdp_tp --mesh 2x4     # any strategy and mesh
    python examples/mlp_2d.py --compare-reference --plot curves.png
    python examples/mlp_2d.py --data-dir /usr/share/datasets/fashion-mnist --epochs 2
    python examples/mlp_2d.py --checkpoint-dir runs/mlp --checkpoint-every 100 --resume
    python -m shardops.launch -n 2 -- examples/mlp_2d.py   # 2 processes × 4 devices

Data: tfds MNIST when it is prepared or can be downloaded; offline, the shipped Fashion-MNIST
sample (one line says so); ``--data-dir`` reads any folder of the four IDX files.

Devices: on a machine without an accelerator the script simulates 8 CPU devices itself, by
setting XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts (equivalently,
jax.config.update("jax_num_cpu_devices", 8)). The flag only adds host devices; an accelerator
with enough devices is used when present.

Processes: under ``python -m shardops.launch`` each process joins the run
(``shardops.distributed.initialize``), reads only its rows of every batch and of every
evaluation chunk, and process 0 prints the (global) figures and writes the files.

Checkpoints: ``--checkpoint-dir`` saves the train state every ``--checkpoint-every`` steps and
at the end of every epoch, with the data position, seed and metric history; ``--resume``
continues from the latest one, on any strategy and mesh, and a run resumed on the same
layout ends bit-identical to one never stopped.

Runs that survive: SIGTERM (a cluster's preemption notice, or the launcher stopped) saves a
checkpoint at the next step boundary, the same on every process (``shardops.preemption``), and
exits with code 143; ``--resume`` continues it. Under the launcher a stuck process (alive but
not reaching the next step) stops the whole run after ``--watchdog-timeout`` seconds, naming it
(``shardops.watchdog``).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np
import optax

import shardops
import shardops.distributed
import shardops.preemption
import shardops.watchdog
import shardops_models as models
from shardops_models.data import mnist
from shardops_models.training import checkpoint, loop
from shardops_models.training.meshes import mesh_for, mesh_text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="2d", choices=models.strategies_for(models.Mlp()))
    p.add_argument("--mesh", default="4x2",
                   help="axis sizes, e.g. 4x2 (data×model), 8x1, replica=2,data=2,model=2")  # fmt: skip
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=models.INIT_LR, help="initial learning rate")
    p.add_argument("--decay-rate", type=float, default=models.DECAY_RATE)
    p.add_argument("--decay-steps", type=float, default=models.DECAY_STEPS, help="in epochs")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="sgd: the seed's schedule; adam: optax.adam(--lr)")  # fmt: skip
    p.add_argument("--init-scale", type=float, default=models.INIT_SCALE)
    p.add_argument("--hidden", type=int, nargs="*", default=[512], help="hidden widths")
    p.add_argument("--dataset", default="mnist", choices=mnist.DATASETS)
    p.add_argument("--data-dir", help="folder with the four IDX files (MNIST or Fashion-MNIST)")
    p.add_argument("--train-size", type=int, help="use only the first N training images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--remat", nargs="?", const="full", default="none",
                   choices=models.strategies.remat.POLICIES,
                   help="activation checkpointing of each layer: full (the bare flag; under "
                        "fsdp also re-gathers the weights in the backward), matmuls, offload, "
                        "none (the default)")  # fmt: skip
    p.add_argument("--locate", action="store_true",
                   help="compare one gradient step with the unsharded model layer by layer "
                        "(shardops.inspect.compare) and exit")  # fmt: skip
    p.add_argument("--compare-reference", action="store_true",
                   help="train the unsharded model alongside on identical batches")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="save loss and accuracy curves as a PNG")
    p.add_argument(
        "--metrics-json", metavar="PATH", help="save per-epoch metrics and test predictions"
    )
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save the train state in DIR")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="also save every N steps (default: at the end of each epoch only)")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (if any)")  # fmt: skip
    p.add_argument("--watchdog-timeout", type=float, metavar="S",
                   default=shardops.watchdog.DEFAULT_TIMEOUT_S,
                   help="stop the run when a process lags a step the others passed by S "
                        "seconds (default %(default)g; 0: off)")  # fmt: skip
    p.add_argument("--stop-on-non-finite", action="store_true",
                   help="stop at the first step whose loss or gradient is NaN or inf, naming "
                        "the parameters and (in one process) the first non-finite layer")  # fmt: skip
    return p.parse_args(argv)


def make_mesh(spec: str, strategy: str):
    """The run's mesh (``shardops_models.training.meshes.mesh_for``); a bad spec ends the run
    with one line."""
    try:
        return mesh_for(strategy, spec)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def log(*args, **kwargs) -> None:
    """``print`` on process 0 only: the figures are global, one copy is enough."""
    if shardops.distributed.is_main():
        print(*args, **kwargs)


def main(argv=None):
    shardops.distributed.initialize()  # joins a multi-process run; a no-op otherwise
    args = parse_args(argv)
    try:
        return train(args)
    except loop.NonFiniteError as e:  # --stop-on-non-finite
        raise SystemExit(f"Stopped: {e}") from None


@dataclasses.dataclass
class Run:
    """One run's pieces, shared by its phases: the arguments, the data, the layer sizes and
    steps per epoch, the sharded run's Setup and the unsharded reference's
    (``--compare-reference``; else None) with their train states, and what the steps so far
    made: the history of epochs, the steps trained (``done``), the checkpoints and the
    non-finite guard."""

    args: argparse.Namespace
    dataset: mnist.Dataset
    sizes: tuple[int, ...]
    steps_per_epoch: int
    setup: models.Setup
    ref: models.Setup | None
    state: models.TrainState
    ref_state: models.TrainState | None
    rows: slice | None = None  # this process's rows of every batch
    history: list = dataclasses.field(default_factory=list)
    done: int = 0  # steps trained so far
    ckpt: checkpoint.Checkpoints | None = None
    position: dict = dataclasses.field(default_factory=dict)  # what a resume must continue
    guard: loop.NonFiniteGuard | None = None

    def place(self, x, y):
        """One host batch, placed for the sharded run and, if any, the reference."""
        placed = self.setup.place_local_batch(x, y, batch=self.args.batch_size)
        return placed, (self.ref.place_batch(x, y) if self.ref is not None else None)

    def save(self, step: int) -> None:
        """A checkpoint of ``step``: the train state, with the data position and history."""
        if self.guard is not None:
            self.guard.drain()  # every step saved is checked first: no checkpoint holds a NaN
        extra = {**self.position, "history": self.history}
        self.ckpt.save(step, self.setup, self.state, extra=extra)


def train(args):
    """The run, phase after phase: set up (and resume), the epochs (each trained, evaluated
    and reported), the comparison with the reference and the files. Returns ``(history,
    summary)``, or ``--locate``'s exit status."""
    run = set_up(args)
    resume(run)
    if args.locate:  # the first batch of the next epoch, at the current parameters
        return locate(run)
    # The first non-finite loss or gradient stops the run, naming the step and the layer (the
    # replay runs the unsharded model: one process only).
    run.guard = (loop.NonFiniteGuard(run.setup, locate=jax.process_count() == 1)
                 if args.stop_on_non_finite else None)  # fmt: skip
    run.rows = run.setup.process_rows(args.batch_size)  # this process's rows of every batch

    # SIGTERM: save at the next step boundary, the same on every process; a stuck process
    # stops the run (under the launcher).
    with (
        shardops.preemption.Preemption() as preemption,
        shardops.watchdog.Watchdog(args.watchdog_timeout or None) as watchdog,
        checkpoint.waited_on_error(run.ckpt),
    ):
        preempted = False
        for epoch in range(run.done // run.steps_per_epoch, args.epochs):
            first = run.done - epoch * run.steps_per_epoch  # > 0 when resuming mid-epoch
            seconds = train_epoch(run, epoch, first, preemption, watchdog)
            if seconds is None:  # a preemption notice, at a step boundary
                preempted = True
                break
            report_epoch(run, epoch, first, seconds)
    if preempted:
        stop_preempted(run.ckpt, run.save, run.done, run.steps_per_epoch)
    return finish(run)


def set_up(args) -> Run:
    """The run before its first step: the data, the mesh, the optimizer, the sharded run's
    setup and the reference's, both from the same init; logs the images and the model."""
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("--resume needs --checkpoint-dir")
    dataset = mnist.load(args.dataset, args.data_dir, log=log)
    if args.train_size:
        dataset = dataset.take_train(args.train_size)
    log(f"Images: {len(dataset.train_images):,} train / {len(dataset.test_images):,} test, "
        f"from {dataset.source}")  # fmt: skip
    mesh = make_mesh(args.mesh, args.strategy)
    if args.compare_reference and jax.process_count() > 1:
        raise SystemExit("--compare-reference trains the unsharded model in one process: "
                         "run it without the launcher")  # fmt: skip
    steps_per_epoch = len(dataset.train_images) // args.batch_size
    if steps_per_epoch < 1:
        raise SystemExit(
            f"--batch-size {args.batch_size} exceeds the {len(dataset.train_images)} training images"
        )
    if args.optimizer == "sgd":
        opt = models.seed_sgd(steps_per_epoch, init_lr=args.lr, decay_rate=args.decay_rate,
                              decay_steps=args.decay_steps)  # fmt: skip
    else:
        opt = optax.adam(args.lr)
    sizes = (784, *args.hidden, 10)
    setup = models.build(args.strategy, mesh, optimizer=opt, sizes=sizes, remat=args.remat)
    params = models.init_mlp(jax.random.key(args.seed), sizes, scale=args.init_scale)
    state = setup.shard(params)
    ref = ref_state = None
    if args.compare_reference:
        ref = models.build("ref", optimizer=opt, sizes=sizes)
        ref_state = ref.shard(params)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    log(f"Model: MLP {'-'.join(map(str, sizes))}, strategy {args.strategy} on {mesh_text(mesh)}"
        f"{processes}, {steps_per_epoch} steps of {args.batch_size} per epoch")  # fmt: skip
    return Run(args=args, dataset=dataset, sizes=sizes, steps_per_epoch=steps_per_epoch,
               setup=setup, ref=ref, state=state, ref_state=ref_state)  # fmt: skip


def resume(run: Run) -> None:
    """Opens ``--checkpoint-dir`` and, with ``--resume``, continues from its newest intact
    step: the state (the reference's too), the history and the steps done."""
    args, steps_per_epoch = run.args, run.steps_per_epoch
    if args.checkpoint_dir:
        run.ckpt = checkpoint.Checkpoints(args.checkpoint_dir, every=args.checkpoint_every)
    run.position = {"seed": args.seed, "batch_size": args.batch_size, "train_images":
                    len(run.dataset.train_images), "steps_per_epoch": steps_per_epoch}  # fmt: skip
    if not args.resume:
        return
    ckpt = run.ckpt
    if ckpt.latest_step() is None:
        log(f"Resume: no checkpoint in {ckpt.directory} yet; starting at step 0")
        return
    # The newest step that restores intact: a damaged one is named and passed over.
    run.state, extra, done = ckpt.restore_latest_intact(run.setup, log=log)
    saved = ckpt.record(done)  # who saved it: strategy and mesh
    check_position(extra, run.position, ckpt.directory)
    run.history, run.done = extra["history"], done
    if run.ref is not None:
        run.ref_state, _ = ckpt.restore(run.ref, done)
    log(f"Resume: step {done} (epoch {done // steps_per_epoch}, batch "
        f"{done % steps_per_epoch}) from {ckpt.directory}, saved by "
        f"{saved['strategy']} on {saved['mesh']}")  # fmt: skip


def locate(run: Run) -> int:
    """``--locate``: one gradient step on the first batch, compared with the unsharded model's
    layer by layer (``models.locate``); prints the report. 0 when every layer is within its
    bound, else 1."""
    args, dataset = run.args, run.dataset
    if jax.process_count() > 1:
        raise SystemExit("--locate runs the unsharded model in one process: no launcher")
    x, y = next(loop.epoch_batches(dataset.train_images, dataset.train_labels,
                                   args.batch_size, seed=args.seed, epoch=0))  # fmt: skip
    report = models.locate(run.setup, run.state.params, x, y)
    print(report)
    return 0 if report.within_bound else 1


def train_epoch(run: Run, epoch: int, first: int, preemption, watchdog) -> float | None:
    """Epoch ``epoch`` from its batch ``first`` (the sharded run's steps and the reference's,
    in lockstep), saving every ``--checkpoint-every`` steps; returns its seconds, or None
    when a preemption notice stopped it at a step boundary."""
    args, steps_per_epoch, ckpt = run.args, run.steps_per_epoch, run.ckpt
    batches = loop.epoch_batches(run.dataset.train_images, run.dataset.train_labels,
                                 args.batch_size, seed=args.seed, epoch=epoch, rows=run.rows,
                                 start=first)  # fmt: skip
    start = time.perf_counter()
    preempted = False
    with Progress(epoch, steps_per_epoch) as progress:
        inflight = loop.StepsInFlight()
        for step, placed in enumerate(loop.staged(run.place, batches), start=first):
            if preemption.reached(run.done):  # `done` steps trained: a step boundary
                preempted = True
                break
            watchdog.step(run.done)
            if run.guard is None:
                run.state, loss = run.setup.train_step(run.state, *placed[0])
                inflight.add(loss)
            else:  # step `done + 1` checked; NonFiniteError at the first bad one
                run.state, loss = run.guard.train_step(run.done + 1, run.state, *placed[0])
            if run.ref is not None:  # the same host batch, placed for the unsharded run
                run.ref_state, ref_loss = run.ref.train_step(run.ref_state, *placed[1])
                inflight.add(ref_loss)
            progress.update(step + 1, loss)
            run.done += 1
            if ckpt is not None and ckpt.should_save(run.done) and step + 1 < steps_per_epoch:
                run.save(run.done)
        inflight.drain()
        if run.guard is not None:
            run.guard.drain()
    if preempted:
        return None
    return time.perf_counter() - start


def report_epoch(run: Run, epoch: int, first: int, seconds: float) -> None:
    """Epoch ``epoch``'s row of the history (the steps this run trained of it, both splits'
    metrics, the reference's too), its lines, and its checkpoint."""
    steps_per_epoch = run.steps_per_epoch
    row = {"epoch": epoch, "seconds": seconds, "steps": steps_per_epoch - first,  # this run's
           **evaluate(run.setup, run.state.params, run.dataset)}  # fmt: skip
    if run.ref is not None:
        row.update({f"ref_{k}": v for k, v in evaluate(run.ref, run.ref_state.params,
                                                      run.dataset).items()})  # fmt: skip
    run.history.append(row)
    resumed = (f" ({steps_per_epoch - first} of {steps_per_epoch} steps, resumed at batch "
               f"{first})" if first else "")  # fmt: skip
    log(f"Epoch {epoch} in {seconds:.2f} sec{resumed}")
    log(f"Training set loss {row['train_loss']:.6f}")
    log(f"Training set accuracy {row['train_accuracy']:.4f}")
    log(f"Test set accuracy {row['test_accuracy']:.4f}", flush=True)
    if run.ckpt is not None:
        run.save(run.done)


def finish(run: Run):
    """After the last epoch: the sharded run against the reference (``compare``), the
    checkpoints closed, the test predictions, the plot and the metrics (process 0 writes the
    files). Returns ``(history, summary)``."""
    args, history = run.args, run.history
    summary = {}
    if run.ref is not None:
        summary = compare(run.setup, run.state, run.ref, run.ref_state, history,
                          run.dataset.test_images)  # fmt: skip
        log(f"Sharded vs reference: max |Δparam| = {summary['max_param_diff']:.2e}, "
            f"max |Δaccuracy| = {summary['max_accuracy_diff']:.4f}, test predictions differ "
            f"on {summary['prediction_disagreement']:.2%} of images")  # fmt: skip
    if run.ckpt is not None:
        log(f"Checkpoints: steps {run.ckpt.steps()} in {run.ckpt.directory}")
        run.ckpt.close()
    test_predictions = None
    if args.metrics_json:  # every process computes them (a collective), process 0 writes them
        test_predictions = np.argmax(
            loop.dataset_logits(run.setup, run.state.params, run.dataset.test_images), -1
        )
    if not shardops.distributed.is_main():
        return history, summary
    if args.plot:
        plot(
            history,
            args.plot,
            title=f"MLP {'-'.join(map(str, run.sizes))} · {args.strategy} · {run.dataset.name}",
        )
        log(f"Plot: {args.plot}")
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump({"args": vars(args), "history": history, "summary": summary,
                       "test_predictions": test_predictions.tolist()}, f)  # fmt: skip
    return history, summary


def stop_preempted(ckpt, save, done: int, steps_per_epoch: int) -> None:
    """The run got a preemption notice: save step ``done`` (if there is a --checkpoint-dir)
    and exit with ``shardops.preemption.EXIT_CODE``."""
    where = f"step {done} (epoch {done // steps_per_epoch}, batch {done % steps_per_epoch})"
    if ckpt is None:
        log(f"Preempted at {where}: nothing saved (no --checkpoint-dir)", flush=True)
    else:
        if done not in ckpt.steps():  # not saved already (at the end of an epoch)
            save(done)
        ckpt.close()  # waits for the save to be committed
        log(f"Preempted at {where}: saved it in {ckpt.directory}; continue with --resume",
            flush=True)  # fmt: skip
    raise SystemExit(shardops.preemption.EXIT_CODE)


def check_position(saved: dict, here: dict, directory: str) -> None:
    """Resuming continues the same data order: the seed, batch size and set must match."""
    for key, value in here.items():
        if saved.get(key) != value:
            raise SystemExit(
                f"--resume: the checkpoint in {directory} was trained with {key} = "
                f"{saved.get(key)}, this run has {value}; resume with the same --seed, "
                f"--batch-size and data, or start a new --checkpoint-dir"
            )


def evaluate(setup, params, dataset) -> dict:
    """Loss and accuracy of both splits, computed by the strategy's own sharded eval step."""
    train_loss, train_acc = loop.dataset_metrics(
        setup, params, dataset.train_images, dataset.train_labels)  # fmt: skip
    test_loss, test_acc = loop.dataset_metrics(
        setup, params, dataset.test_images, dataset.test_labels)  # fmt: skip
    return {"train_loss": train_loss, "train_accuracy": train_acc,
            "test_loss": test_loss, "test_accuracy": test_acc}  # fmt: skip


def compare(setup, state, ref, ref_state, history, test_images) -> dict:
    """Largest parameter and accuracy differences, and how often test predictions differ."""
    sharded = jax.tree.leaves(setup.gather(state.params))
    unsharded = jax.tree.leaves(ref.gather(ref_state.params))
    max_param = max(float(np.max(np.abs(a - b))) for a, b in zip(sharded, unsharded, strict=True))
    max_acc = max(abs(row[k] - row[f"ref_{k}"]) for row in history
                  for k in ("train_accuracy", "test_accuracy"))  # fmt: skip
    predictions = [np.argmax(loop.dataset_logits(s, st.params, test_images), -1)
                   for s, st in ((setup, state), (ref, ref_state))]  # fmt: skip
    return {"max_param_diff": max_param, "max_accuracy_diff": max_acc,
            "prediction_disagreement": float(np.mean(predictions[0] != predictions[1]))}  # fmt: skip


class Progress:
    """A rich progress bar on a terminal; plain lines at each quarter of the epoch otherwise."""

    def __init__(self, epoch: int, total: int):
        self.epoch, self.total = epoch, total
        self.tty = sys.stdout.isatty()
        self.quiet = not shardops.distributed.is_main()
        self.next_line = 1

    def __enter__(self):
        if self.tty and not self.quiet:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn(f"epoch {self.epoch}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), transient=True)  # fmt: skip
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, loss="…")
        return self

    def update(self, step: int, loss) -> None:
        if self.quiet:
            return
        if self.tty:
            if step % 10 == 0 or step == self.total:  # reading the loss syncs: not every step
                self.bar.update(self.task, completed=step, loss=f"{float(loss):.5f}")
        elif step >= self.next_line * self.total / 4:
            print(
                f"  epoch {self.epoch}: step {step}/{self.total}, loss {float(loss):.5f}",
                flush=True,
            )
            self.next_line += 1

    def __exit__(self, *exc):
        if self.tty and not self.quiet:
            self.bar.__exit__(*exc)


def plot(history, path, title):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [row["epoch"] for row in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in history], "o-", label="train loss (sharded)")
    ax_acc.plot(epochs, [r["train_accuracy"] for r in history], "o-", label="train (sharded)")
    ax_acc.plot(epochs, [r["test_accuracy"] for r in history], "s-", label="test (sharded)")
    if "ref_train_loss" in history[0]:
        ax_loss.plot(
            epochs, [r["ref_train_loss"] for r in history], "k--", label="train loss (reference)"
        )
        ax_acc.plot(
            epochs, [r["ref_train_accuracy"] for r in history], "k--", label="train (reference)"
        )
        ax_acc.plot(
            epochs, [r["ref_test_accuracy"] for r in history], "k:", label="test (reference)"
        )
    ax_loss.set(xlabel="epoch", ylabel="seed loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
