"""A GPT-style model of your own from shardops layers, checked against its unsharded twin.

    python examples/custom_model.py                       # data=4 × model=2
    python examples/custom_model.py --sequence-parallel   # activations split along S between layers

The model, every piece a shardops layer on global arrays inside an ordinary ``jax.jit``:

    ids[B, S] → vocab_parallel_embedding (table[V_model, D])            # psum over model
      → N × [ x + head_parallel_attention(layer_norm(x))                 # heads over model
              x + row_parallel_dense(gelu(column_parallel_dense(layer_norm(x)))) ]
      → layer_norm → column_parallel_dense (w[D, V_model]) → logits[B, S, V_model]
      → vocab_parallel_cross_entropy(logits, labels)                     # logits never gathered

The vocabulary (V = 51) does not divide by ``model``: the table and the output weight are
zero-padded to 52 rows/columns (``shard_params`` does it) and the layers take ``vocab_size`` /
``out_features``, so the padding never reaches a loss or a gradient. With
``--sequence-parallel`` the embedding reduce-scatters along S, the norms and residuals run on
``x[B, S_model, D]``, and each block gathers S once per layer and reduce-scatters it back
(Megatron's sequence parallelism).

The script builds the same model unsharded from the same weights (plain ``jnp``: a table
lookup, a numpy-style attention, ``optax`` cross-entropy) and prints the agreement of the loss,
the logits, every gradient and a short SGD run, then the collectives XLA compiled, per layer.
On a machine without an accelerator it simulates 8 CPU devices (XLA_FLAGS, set before JAX starts).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops

# A small GPT: vocabulary 51 (uneven on model=2), width 64, 4 heads of 16, MLP 256, 2 layers.
V, D, HEADS, HEAD_DIM, F, DEPTH = 51, 64, 4, 16, 256, 2
B, S, STEPS, LR = 8, 16, 5, 0.1
BATCH_AXIS = shardops.DATA_AXIS


def init(key):
    """Full (unsharded) parameters: the same numbers feed both versions."""
    k_embed, k_head, *k_blocks = jax.random.split(key, 2 + DEPTH)
    normal = jax.nn.initializers.normal(0.02)
    blocks = []
    for k in k_blocks:
        k_attn, k_up, k_down = jax.random.split(k, 3)
        blocks.append({
            "ln1": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
            "attn": shardops.init_attention(k_attn, D, HEADS, HEAD_DIM),
            "ln2": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
            "up": shardops.init_dense(k_up, D, F, b_init=normal),
            "down": shardops.init_dense(k_down, F, D, b_init=normal),
        })  # fmt: skip
    return {
        "embed": normal(k_embed, (V, D)),  # table[V, D]
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
        "head": shardops.init_dense(k_head, D, V, use_bias=False),  # w[D, V]
    }


def specs(sequence_parallel: bool):
    """PartitionSpecs of the parameter tree: the layers' own specs, norms replicated."""
    attn = shardops.head_parallel_attention_specs(
        batch_axis=BATCH_AXIS, sequence_parallel=sequence_parallel
    )
    norm = {"scale": P(), "bias": P()}
    block = {"ln1": norm, "attn": attn.params, "ln2": norm,
             "up": shardops.column_parallel_dense_specs().params,
             "down": shardops.row_parallel_dense_specs().params}  # fmt: skip
    return {
        "embed": shardops.vocab_parallel_embedding_specs().params["table"],
        "blocks": [block] * DEPTH,
        "ln_f": norm,
        "head": {"w": shardops.column_parallel_dense_specs().w},
    }


def forward_sharded(params, ids, mesh, sequence_parallel):
    """Logits ``[B, S, V_model]`` (padded to 52 columns) of the sharded model."""
    sp = sequence_parallel
    common = dict(mesh=mesh, batch_axis=BATCH_AXIS)
    x = shardops.vocab_parallel_embedding(
        ids, params["embed"], vocab_size=V, **common,
        **(dict(reduce="psum_scatter", scatter_dimension=1) if sp else {}),
    )  # x[B_data, S, D], or x[B_data, S_model, D]  # fmt: skip
    for p in params["blocks"]:
        h = shardops.layer_norm(x, **p["ln1"])  # same layout as x
        x = x + shardops.head_parallel_attention(
            h, p["attn"], num_heads=HEADS, causal=True, sequence_parallel=sp, **common
        )  # heads over model
        h = shardops.layer_norm(x, **p["ln2"])
        h = shardops.column_parallel_dense(
            h, **p["up"], **common, **(dict(gather_input=True, gather_dimension=1) if sp else {})
        )  # h[B_data, S, F_model]
        x = x + shardops.row_parallel_dense(
            jax.nn.gelu(h), **p["down"], **common,
            **(dict(reduce="psum_scatter", scatter_dimension=1) if sp else {}),
        )  # psum (or psum_scatter along S) → x  # fmt: skip
    h = shardops.layer_norm(x, **params["ln_f"])
    return shardops.column_parallel_dense(
        h, params["head"]["w"], out_features=V, **common,
        **(dict(gather_input=True, gather_dimension=1) if sp else {}),
    )  # logits[B_data, S, V_model], padded columns zero  # fmt: skip


def loss_sharded(params, ids, labels, mesh, sequence_parallel):
    logits = forward_sharded(params, ids, mesh, sequence_parallel)
    losses = shardops.vocab_parallel_cross_entropy(
        logits, labels, mesh=mesh, vocab_size=V, batch_axis=BATCH_AXIS
    )  # loss[B_data, S], f32
    return jnp.mean(losses)


def attention_reference(x, p):
    """Plain multi-head causal attention, no sharding."""

    def heads(w, b):
        return (x @ w + b).reshape(*x.shape[:2], HEADS, HEAD_DIM)  # (B, S, H, hd)

    q, k, v = heads(p["wq"], p["bq"]), heads(p["wk"], p["bk"]), heads(p["wv"], p["bv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM)  # (B, H, S, S)
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(*x.shape[:2], HEADS * HEAD_DIM)
    return out @ p["wo"] + p["bo"]  # (B, S, D)


def layer_norm_reference(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(
        ((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5
    ) * scale + bias


def forward_reference(params, ids):
    x = params["embed"][ids]  # (B, S, D)
    for p in params["blocks"]:
        x = x + attention_reference(layer_norm_reference(x, **p["ln1"]), p["attn"])
        h = jax.nn.gelu(shardops.dense(layer_norm_reference(x, **p["ln2"]), **p["up"]))
        x = x + shardops.dense(h, **p["down"])
    return layer_norm_reference(x, **params["ln_f"]) @ params["head"]["w"]  # (B, S, V)


def loss_reference(params, ids, labels):
    logits = forward_reference(params, ids)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(jnp.asarray(u) - jnp.asarray(v))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split activations along S between the layers")  # fmt: skip
    args = parser.parse_args(argv)
    sp = args.sequence_parallel
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    mesh = shardops.make_mesh({"data": 4, "model": 2}, devices=devices)

    k_ids, k_params = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(k_ids, (B, S + 1), 0, V)
    ids, labels = tokens[:, :-1], tokens[:, 1:]  # next-token prediction
    params = init(k_params)
    sharded = shardops.shard_params(params, mesh, specs(sp))  # pads V = 51 → 52
    batch = NamedSharding(mesh, P(BATCH_AXIS, None))
    ids_s, labels_s = jax.device_put(ids, batch), jax.device_put(labels, batch)

    grad_sharded = jax.jit(jax.value_and_grad(
        lambda p, i, t: loss_sharded(p, i, t, mesh, sp)))  # fmt: skip
    grad_reference = jax.jit(jax.value_and_grad(loss_reference))
    logits_s = jax.jit(lambda p, i: forward_sharded(p, i, mesh, sp))(sharded, ids_s)
    logits_r = jax.jit(forward_reference)(params, ids)
    (l_s, g_s), (l_r, g_r) = (
        grad_sharded(sharded, ids_s, labels_s),
        grad_reference(params, ids, labels),
    )
    g_s = jax.device_get(g_s)
    pad_grads = max(float(np.max(np.abs(g_s["embed"][V:]))),
                    float(np.max(np.abs(g_s["head"]["w"][:, V:]))))  # fmt: skip
    print(f"GPT: {DEPTH} blocks, D={D}, {HEADS} heads of {HEAD_DIM}, MLP {F}, vocabulary {V} "
          f"(padded to {sharded['embed'].shape[0]}), batch {B}×{S}, on data=4 × model=2"
          f"{', sequence parallel' if sp else ''}")  # fmt: skip
    print(f"forward:   max |sharded − unsharded| logits = "
          f"{max_diff(jax.device_get(logits_s)[..., :V], logits_r):.2e}")  # fmt: skip
    print(f"loss:      {float(l_s):.6f} vs {float(l_r):.6f}")
    print(f"gradients: max |sharded − unsharded| = {max_diff(shardops.unpad(g_s, g_r), g_r):.2e}; "
          f"on the vocabulary padding: {pad_grads:.1e}")  # fmt: skip

    p_s, p_r = sharded, params
    for _ in range(STEPS):  # each step reads its loss back: at most one step in flight
        (l_s, g_s), (l_r, g_r) = (
            grad_sharded(p_s, ids_s, labels_s),
            grad_reference(p_r, ids, labels),
        )
        p_s = jax.tree.map(lambda p, g: p - LR * g, p_s, g_s)
        p_r = jax.tree.map(lambda p, g: p - LR * g, p_r, g_r)
        float(l_s)
    final = jax.device_get(p_s)
    print(f"after {STEPS} SGD steps: loss {float(l_s):.6f} vs {float(l_r):.6f}, "
          f"max |Δparam| = {max_diff(shardops.unpad(final, p_r), p_r):.2e}")  # fmt: skip

    print_collectives(mesh, grad_sharded, sharded, ids_s, labels_s)


def print_collectives(mesh, grad_sharded, sharded, ids_s, labels_s) -> None:
    """The collectives in the compiled forward and backward of ``grad_sharded`` (the sharded
    loss and gradients), per layer: their count and bytes, by pass, kind and mesh axes."""
    print("collectives in the compiled forward + backward, per layer:")
    rows = collections.defaultdict(lambda: [0, 0])  # (pass, kind, axes, layer) → [count, bytes]
    for c in shardops.inspect.ledger(mesh, grad_sharded, sharded, ids_s, labels_s).collectives:
        if not c.bytes:
            continue
        axes = "×".join(c.axes)
        if axes == BATCH_AXIS:  # XLA combines these into one op over many tensors
            key = (
                "backward",
                c.kind,
                axes,
                f"{len(c.shapes)} gradients of params replicated over data",
            )
        else:
            layers = sorted(set(re.findall(r"shardops\.(\w+)", c.op_name)))
            # Unnamed: the norms' scale and bias, replicated over model next to x[B, S_model, D].
            layer = ", ".join(layers) or "gradients of the norms (check_vma's reduction)"
            key = ("backward" if "transpose" in c.op_name else "forward", c.kind, axes, layer)
        rows[key][0] += 1
        rows[key][1] += c.bytes
    for (where, kind, axes, layer), (count, nbytes) in sorted(
        rows.items(), key=lambda r: r[0][0] != "forward"
    ):
        print(f"  {where:<8} {kind:<14} over {axes!r:<7} {count} × {nbytes:>8,} bytes  ← {layer}")


if __name__ == "__main__":
    main()
