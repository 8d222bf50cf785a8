"""A tour of shardings with today's JAX: the seed's first half, step by step.

    python examples/sharding_tour.py                   # the tour, in the terminal only
    python examples/sharding_tour.py --png tiles.png   # and the weight-tile picture in tiles.png

1. split a vector across devices, 2. a dot product of two sharded vectors with its psum,
3. vmap over a sharded batch, 4. the incompatible-devices mistake, caught and explained,
5. a model's layout in the terminal and, with ``--png PATH``, as a picture (nothing is written
without it). On a machine without an accelerator the script simulates 8 CPU devices itself
(XLA_FLAGS, set before JAX starts).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models


def section(title):
    print(f"\n== {title}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--png", metavar="PATH", help="also save the weight tiles as a PNG at PATH")
    args = p.parse_args(argv)
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    mesh = shardops.make_mesh({"data": 4, "model": 2}, devices=devices)

    section("1. Split a vector across devices")
    line = shardops.make_mesh({"i": 8}, devices=devices)
    v = jax.device_put(jnp.arange(16.0), NamedSharding(line, P("i")))
    print(
        f"v = arange(16) with PartitionSpec P('i') on 8 devices: each holds {v.sharding.shard_shape(v.shape)} elements"
    )
    for shard in v.addressable_shards[:3]:
        print(f"  device {shard.device.id}: {shard.data.tolist()}")
    print("  …")
    jax.debug.visualize_array_sharding(v, use_color=False)

    section("2. A dot product of two sharded vectors")

    def local_dot(a, b):  # a, b: this device's 2 elements
        return lax.psum(jnp.dot(a, b), "i")  # partial sums, then AllReduce over 'i'

    dot = jax.jit(jax.shard_map(local_dot, mesh=line, in_specs=(P("i"), P("i")), out_specs=P()))
    w = jax.device_put(jnp.ones(16), NamedSharding(line, P("i")))
    print(f"v · ones = {float(dot(v, w))} (expected {float(jnp.arange(16.0).sum())})")
    for sentence in shardops.inspect.explain(line, dot, v, w):
        print("  " + sentence)

    section("3. vmap over a sharded batch")
    batch = jax.device_put(jnp.ones((8, 784)), NamedSharding(mesh, P("data")))
    params = models.init_mlp(jax.random.key(0))
    logits = jax.jit(jax.vmap(lambda x: models.mlp_forward(params, x[None])[0]))(batch)
    print(f"vmap of one example's forward over x[8, 784] split over 'data': logits {logits.shape}, "
          f"laid out as {logits.sharding.spec}: the batch stayed split, no communication")  # fmt: skip

    section("4. The incompatible-devices mistake")
    first, second = devices[:4], devices[4:8]
    half = shardops.make_mesh({"model": 4}, devices=first)
    w_on_first = shardops.shard_params(shardops.init_dense(jax.random.key(1), 784, 512), half,
                                       shardops.column_parallel_dense_specs().params)  # fmt: skip
    x_on_second = jax.device_put(jnp.ones((8, 784)), NamedSharding(
        shardops.make_mesh({"model": 4}, devices=second), P()))  # fmt: skip
    try:
        shardops.column_parallel_dense(x_on_second, **w_on_first, mesh=half)
    except shardops.DeviceMismatchError as e:
        print(f"caught: {e}")

    section("5. A model's layout, in the terminal (and as a picture with --png PATH)")
    show_model_layout(mesh, args.png)


def show_model_layout(mesh, png: str | None) -> None:
    """Section 5: fsdp_tp's parameters laid out in the terminal, and the weight tiles of 2d and
    fsdp_tp (saved as a picture at ``png``, when given)."""
    setup = models.build("fsdp_tp", mesh, optimizer=optax.sgd(1.0))
    state = setup.init(jax.random.key(0))
    shardops.inspect.show_layout(
        state.params, title="fsdp_tp parameters on data=4 × model=2", grids=False
    )
    weights = {
        f"2d {k}": v
        for k, v in models.build("2d", mesh, optimizer=optax.sgd(1.0)).weight_layouts().items()
    }
    weights.update({f"fsdp_tp {k}": v for k, v in setup.weight_layouts().items()})
    for name, (shape, spec) in weights.items():
        tiles = shardops.inspect.tiles_of(shape, NamedSharding(mesh, spec))  # {block: device ids}
        print(f"  {name}: {len(tiles)} tiles, each on {len(next(iter(tiles.values())))} device(s)")
    if png:
        shardops.inspect.layout_png(
            png, weights, mesh, title="2d vs fsdp_tp weight tiles on data=4 × model=2"
        )
        print(f"saved {png}")
    else:
        print("  (no picture written; `--png PATH` saves these tiles as a PNG)")


if __name__ == "__main__":
    main()
