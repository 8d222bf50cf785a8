"""Train the seed's MNIST MLP with 2D (data × model) sharding on a 4×2 mesh.

The seed's recipe: layer sizes 784-512-10, Gaussian init × 0.01, SGD with
lr = 1.0 · 0.95^(epoch/5), loss -mean(one_hot · log_softmax(logits)), batch 128, 20 epochs.

    python examples/mlp_2d.py                                   # the default run
    python examples/mlp_2d.py --strategy fsdp_tp --mesh 2x4     # any strategy and mesh
    python examples/mlp_2d.py --compare-reference --plot curves.png
    python examples/mlp_2d.py --data-dir /usr/share/datasets/fashion-mnist --epochs 2

Data: tfds MNIST when it is prepared or can be downloaded; offline, the shipped Fashion-MNIST
sample (one line says so); ``--data-dir`` reads any folder of the four IDX files.

Devices: on a machine without an accelerator the script simulates 8 CPU devices itself, by
setting XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts (equivalently,
jax.config.update("jax_num_cpu_devices", 8)). The flag only adds host devices; an accelerator
with enough devices is used when present.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import json
import sys
import time

import jax
import numpy as np
import optax
import shardops_models as models
from shardops_models import loop, mnist

import shardops


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="2d", choices=models.strategies_for(models.Mlp()))
    p.add_argument("--mesh", default="4x2", help="data×model sizes, e.g. 4x2, 8x1, 1x8")
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
    p.add_argument("--remat", action="store_true", help="fsdp/fsdp_tp: re-gather in backward")
    p.add_argument("--compare-reference", action="store_true",
                   help="train the unsharded model alongside on identical batches")  # fmt: skip
    p.add_argument("--plot", metavar="PATH", help="save loss and accuracy curves as a PNG")
    p.add_argument(
        "--metrics-json", metavar="PATH", help="save per-epoch metrics and test predictions"
    )
    return p.parse_args(argv)


def make_mesh(spec: str, strategy: str):
    if strategy == "ref":
        return None
    try:
        n_data, n_model = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh must look like 4x2 (data×model); got {spec!r}") from None
    needed = n_data * n_model
    devices = jax.devices()
    if len(devices) < needed and len(jax.devices("cpu")) >= needed:
        print(f"Devices: {len(devices)} {devices[0].platform} device(s) < {needed}; using "
              f"{needed} simulated CPU devices")  # fmt: skip
        devices = jax.devices("cpu")
    return shardops.make_mesh({"data": n_data, "model": n_model}, devices=devices)


def main(argv=None):
    args = parse_args(argv)
    dataset = mnist.load(args.dataset, args.data_dir)
    if args.train_size:
        dataset = dataset.take_train(args.train_size)
    print(f"Images: {len(dataset.train_images):,} train / {len(dataset.test_images):,} test, "
          f"from {dataset.source}")  # fmt: skip
    mesh = make_mesh(args.mesh, args.strategy)
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
    mesh_text = (
        "one device" if mesh is None else " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
    )
    print(f"Model: MLP {'-'.join(map(str, sizes))}, strategy {args.strategy} on {mesh_text}, "
          f"{steps_per_epoch} steps of {args.batch_size} per epoch")  # fmt: skip

    def place(x, y):
        return setup.place_batch(x, y), (ref.place_batch(x, y) if ref is not None else None)

    history = []
    for epoch in range(args.epochs):
        batches = loop.epoch_batches(dataset.train_images, dataset.train_labels,
                                         args.batch_size, seed=args.seed, epoch=epoch)  # fmt: skip
        start = time.perf_counter()
        with Progress(epoch, steps_per_epoch) as progress:
            inflight = loop.StepsInFlight()
            for step, placed in enumerate(loop.staged(place, batches)):
                state, loss = setup.train_step(state, *placed[0])
                inflight.add(loss)
                if ref is not None:  # the same host batch, placed for the unsharded run
                    ref_state, ref_loss = ref.train_step(ref_state, *placed[1])
                    inflight.add(ref_loss)
                progress.update(step + 1, loss)
            inflight.drain()
        seconds = time.perf_counter() - start
        row = {"epoch": epoch, "seconds": seconds, **evaluate(setup, state.params, dataset)}
        if ref is not None:
            row.update({f"ref_{k}": v for k, v in evaluate(ref, ref_state.params, dataset).items()})
        history.append(row)
        print(f"Epoch {epoch} in {seconds:.2f} sec")
        print(f"Training set loss {row['train_loss']:.6f}")
        print(f"Training set accuracy {row['train_accuracy']:.4f}")
        print(f"Test set accuracy {row['test_accuracy']:.4f}", flush=True)

    summary = {}
    if ref is not None:
        summary = compare(setup, state, ref, ref_state, history, dataset.test_images)
        print(f"Sharded vs reference: max |Δparam| = {summary['max_param_diff']:.2e}, "
              f"max |Δaccuracy| = {summary['max_accuracy_diff']:.4f}, test predictions differ "
              f"on {summary['prediction_disagreement']:.2%} of images")  # fmt: skip
    if args.plot:
        plot(
            history,
            args.plot,
            title=f"MLP {'-'.join(map(str, sizes))} · {args.strategy} · {dataset.name}",
        )
        print(f"Plot: {args.plot}")
    if args.metrics_json:
        test_predictions = np.argmax(
            loop.dataset_logits(setup, state.params, dataset.test_images), -1
        )
        with open(args.metrics_json, "w") as f:
            json.dump({"args": vars(args), "history": history, "summary": summary,
                       "test_predictions": test_predictions.tolist()}, f)  # fmt: skip
    return history, summary


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
        self.next_line = 1

    def __enter__(self):
        if self.tty:
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
        if self.tty:
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
