"""The seed's 8-way data parallelism: the MNIST MLP with the batch split over 8 devices.

    python examples/mlp_data_parallel.py                  # shardops' dp strategy (shard_map)
    python examples/mlp_data_parallel.py --with-pmap      # and jax.pmap alongside: same numbers

``--with-pmap`` trains a second copy through ``jax.pmap``, the seed's own tool
(``models/strategies/pmap.py``: parameters replicated by stacking, gradients reduced with an explicit
``lax.psum``), on identical batches,
and prints how far the two runs are apart after every epoch. On a machine without an
accelerator the script simulates 8 CPU devices itself (XLA_FLAGS, set before JAX starts).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import time

import jax
import numpy as np

import shardops
import shardops_models as models
from shardops_models.data import mnist
from shardops_models.strategies import pmap
from shardops_models.training import loop

N_DEVICES = 8


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--dataset", default="mnist", choices=mnist.DATASETS)
    p.add_argument("--data-dir")
    p.add_argument("--train-size", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-pmap", action="store_true")
    args = p.parse_args(argv)

    dataset = mnist.load(args.dataset, args.data_dir)
    if args.train_size:
        dataset = dataset.take_train(args.train_size)
    devices = jax.devices() if len(jax.devices()) >= N_DEVICES else jax.devices("cpu")
    mesh = shardops.make_mesh({"data": N_DEVICES}, devices=devices)
    steps_per_epoch = len(dataset.train_images) // args.batch_size
    optimizer = models.seed_sgd(steps_per_epoch)
    setup = models.build("dp", mesh, optimizer=optimizer)
    params = models.init_mlp(jax.random.key(args.seed))
    state = setup.shard(params)
    print(f"Images: {len(dataset.train_images):,} train, from {dataset.source}")
    print(
        f"dp: batch {args.batch_size} split over {N_DEVICES} devices, {steps_per_epoch} steps per epoch"
    )

    if args.with_pmap:
        pmap_step = pmap.pmap_train_step(optimizer, devices[:N_DEVICES])
        p_params = pmap.replicate(params, N_DEVICES)
        p_opt = pmap.replicate(optimizer.init(params), N_DEVICES)

    for epoch in range(args.epochs):
        start = time.perf_counter()
        inflight = loop.StepsInFlight()
        batches = loop.epoch_batches(dataset.train_images, dataset.train_labels,
                                         args.batch_size, seed=args.seed, epoch=epoch)  # fmt: skip
        for x, y in batches:
            state, loss = setup.train_step(state, *setup.place_batch(x, y))
            inflight.add(loss)
            if args.with_pmap:  # the same batch as (8, B/8, ...) for pmap
                p_params, p_opt, p_loss = pmap_step(
                    p_params, p_opt, pmap.split_batch(x, N_DEVICES), pmap.split_batch(y, N_DEVICES)
                )
                inflight.add(p_loss)
        inflight.drain()
        seconds = time.perf_counter() - start
        _, test_acc = loop.dataset_metrics(
            setup, state.params, dataset.test_images, dataset.test_labels
        )
        print(f"Epoch {epoch} in {seconds:.2f} sec: test accuracy {test_acc:.4f} (shard_map dp)")
        if args.with_pmap:
            print_pmap_comparison(setup, state, p_params, dataset)


def print_pmap_comparison(setup, state, p_params, dataset) -> None:
    """``--with-pmap``: the pmap run's test accuracy, and how far its parameters (device 0's
    replica) are from the shard_map run's."""
    pmap_params = jax.tree.map(lambda a: np.asarray(a[0]), p_params)
    pmap_acc = float(models.accuracy(pmap_params, dataset.test_images, dataset.test_labels))
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(setup.gather(state.params)),
            jax.tree.leaves(pmap_params),
            strict=True,
        )
    )
    print(f"         jax.pmap: test accuracy {pmap_acc:.4f}; max |Δparam| vs shard_map {diff:.2e}")


if __name__ == "__main__":
    main()
