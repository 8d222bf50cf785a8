"""A model of your own from shardops layers: transformer feed-forward blocks with layer norm.

    python examples/custom_model.py

Each block is ``x + W2 · gelu(W1 · layer_norm(x))``, the feed-forward half of a transformer
layer, written with shardops' global-array layers inside an ordinary ``jax.jit``:

- ``W1`` is column-parallel (``w1[D, H_model]``): no communication forward;
- ``W2`` is row-parallel (``w2[H_model, D]``): one psum over ``model`` forward;
- the layer norm and the residual run on the replicated ``x[B_data, D]``.

The script builds the same model unsharded from the same weights, and prints the agreement of
outputs, gradients and a short SGD run, plus the collectives XLA compiled. On a machine without
an accelerator it simulates 8 CPU devices itself (XLA_FLAGS, set before JAX starts).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import shardops

B, D, H, DEPTH, STEPS, LR = 64, 64, 256, 2, 10, 0.05


def init(key):
    """Full (unsharded) weights: the same numbers feed both versions."""
    blocks = []
    for k in jax.random.split(key, DEPTH):
        k1, k2 = jax.random.split(k)
        blocks.append({
            "scale": jnp.ones(D), "shift": jnp.zeros(D),
            "up": shardops.init_dense(k1, D, H, b_init=jax.nn.initializers.normal(0.1)),
            "down": shardops.init_dense(k2, H, D, b_init=jax.nn.initializers.normal(0.1)),
        })  # fmt: skip
    return blocks


def layer_norm(x, scale, shift):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + shift  # (B, D)


def block_sharded(x, p, mesh):
    h = layer_norm(x, p["scale"], p["shift"])  # (B_data, D), replicated over model
    h = shardops.column_parallel_dense(
        h, **p["up"], mesh=mesh, batch_axis="data"
    )  # (B_data, H_model)
    h = jax.nn.gelu(h)
    h = shardops.row_parallel_dense(
        h, **p["down"], mesh=mesh, batch_axis="data"
    )  # psum → (B_data, D)
    return x + h


def block_reference(x, p):
    h = layer_norm(x, p["scale"], p["shift"])
    return x + shardops.dense(jax.nn.gelu(shardops.dense(h, **p["up"])), **p["down"])


def model(params, x, block):
    for p in params:
        x = block(x, p)
    return x


def loss(params, x, target, block):
    return jnp.mean((model(params, x, block) - target) ** 2)


def shard(params, mesh):
    col, row = shardops.column_parallel_specs(), shardops.row_parallel_specs()
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [
        {
            "scale": jax.device_put(p["scale"], replicated),
            "shift": jax.device_put(p["shift"], replicated),
            "up": shardops.shard_params(p["up"], mesh, col.params),
            "down": shardops.shard_params(p["down"], mesh, row.params),
        }
        for p in params
    ]


def max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(u - v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def main():
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    mesh = shardops.make_mesh({"data": 4, "model": 2}, devices=devices)
    kx, kt, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, D))
    target = jax.random.normal(kt, (B, D))
    params = init(kp)
    batch = NamedSharding(mesh, shardops.column_parallel_specs(batch_axis="data").x)
    xs, ts = jax.device_put(x, batch), jax.device_put(target, batch)
    sharded_params = shard(params, mesh)

    def sharded_block(x, p):
        return block_sharded(x, p, mesh)

    grad_sharded = jax.jit(jax.value_and_grad(lambda p, x, t: loss(p, x, t, sharded_block)))
    grad_reference = jax.jit(jax.value_and_grad(lambda p, x, t: loss(p, x, t, block_reference)))

    y_sharded = jax.jit(lambda p, x: model(p, x, sharded_block))(sharded_params, xs)
    y_reference = jax.jit(lambda p, x: model(p, x, block_reference))(params, x)
    (l_s, g_s), (l_r, g_r) = grad_sharded(sharded_params, xs, ts), grad_reference(params, x, target)
    print(f"{DEPTH} feed-forward blocks (D={D}, H={H}) on a data=4 × model=2 mesh, batch {B}")
    print(f"forward:   max |sharded − unsharded| = {max_diff(y_sharded, y_reference):.2e}")
    print(f"loss:      {float(l_s):.6f} vs {float(l_r):.6f}")
    print(f"gradients: max |sharded − unsharded| = {max_diff(g_s, g_r):.2e}")

    p_s, p_r = sharded_params, params
    for _ in range(STEPS):  # each step reads its loss back: at most one step in flight
        (l_s, g_s), (l_r, g_r) = grad_sharded(p_s, xs, ts), grad_reference(p_r, x, target)
        p_s = jax.tree.map(lambda p, g: p - LR * g, p_s, g_s)
        p_r = jax.tree.map(lambda p, g: p - LR * g, p_r, g_r)
        float(l_s)
    print(f"after {STEPS} SGD steps: loss {float(l_s):.6f} vs {float(l_r):.6f}, "
          f"max |Δparam| = {max_diff(p_s, p_r):.2e}")  # fmt: skip

    print("collectives in the compiled forward + backward:")
    for c in shardops.collectives(mesh, grad_sharded, sharded_params, xs, ts):
        if c.bytes:
            where = "backward" if "transpose" in c.op_name else "forward"
            if len(c.shapes) > 2:
                what = f"{len(c.shapes)} gradients"
            else:
                what = ", ".join(f"{d}{list(s)}" for d, s in c.shapes)
            print(f"  {where}: {c.kind} over {c.axes[0]!r} of {what} ({c.bytes:,} bytes)")


if __name__ == "__main__":
    main()
