"""Shared checks of context-parallel attention: forward and every gradient against the float64
reference of ``_attention_checks`` (its derived bound; ring attention's softmax as
``_attention_checks.RING_DOCS`` derives), and the ledger of one fixed case.

The layer is looked up through ``context`` at trace time, so the mutation tests can swap in a
mutant module and be judged by exactly these checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _attention_checks import (
    assert_within_bounds,
    attention_reference,
    random_inputs,
    random_segments,
    softmax_blocks,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers import _attention, _context_attention

context = _context_attention  # looked up at trace time (mutation tests)

CONTEXT, DATA, MODEL = shardops.CONTEXT_AXIS, shardops.DATA_AXIS, shardops.MODEL_AXIS


def mesh_of(axes: tuple[tuple[str, int], ...]):
    """A mesh (Auto axes: the layer permutes its global input) of ``((name, size), ...)``."""
    return shardops.make_mesh(dict(axes), axis_types="auto")


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "method", "num_heads", "num_kv_heads", "causal", "rope_theta",
                     "model_axis", "batch_axis", "sequence_parallel", "precision", "permute",
                     "implementation"),
)  # fmt: skip
def forward_and_grads(x, params, ct, positions=None, segment_ids=None, *, mesh, method, num_heads,
                      num_kv_heads, causal, rope_theta, model_axis, batch_axis,
                      sequence_parallel, precision, permute=True,
                      implementation="auto"):  # fmt: skip
    """``y`` and ``d sum(ct·y) / d(x, params)`` through ``context_parallel_attention``."""
    fn = context.context_parallel_attention

    def loss(x, params):
        y = fn(x, params, mesh=mesh, num_heads=num_heads, num_kv_heads=num_kv_heads,
               causal=causal, rope_theta=rope_theta, positions=positions,
               segment_ids=segment_ids, method=method, model_axis=model_axis,
               batch_axis=batch_axis, sequence_parallel=sequence_parallel, permute=permute,
               precision=precision, implementation=implementation)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, grads


def roles(axes):
    """The model and batch axes of a mesh given as ``((name, size), ...)``."""
    names = dict(axes)
    return (MODEL if MODEL in names else None), (DATA if DATA in names else None)


def folded_blocks(method: str, implementation: str, seq: int, n: int) -> int:
    """The reference's ``ring``: the key blocks one query's online softmax folds in (each ring
    step one or more blocks of its ``S/N`` keys; 0: the einsum's single softmax)."""
    if method == "ring":
        return n * max(1, softmax_blocks(implementation, seq // n))
    return softmax_blocks(implementation, seq)


def check_context_attention(
    axes: tuple[tuple[str, int], ...],
    method: str,
    precision=shardops.FLOAT32,
    *,
    batch: int = 4,
    seq: int = 16,
    d_model: int = 32,
    num_heads: int = 8,
    head_dim: int = 4,
    num_kv_heads: int | None = None,
    causal: bool = True,
    rope_theta: float | None = None,
    documents: int = 1,
    use_bias: bool = True,
    temperature: float = 1.0,
    sequence_parallel: bool = False,
    seed: int = 0,
    implementation: str = "auto",
) -> float:
    """Assert forward and every gradient are within the bound; return the worst ratio."""
    mesh = mesh_of(axes)
    model_axis, batch_axis = roles(axes)
    n = dict(axes)[CONTEXT]
    p = dict(axes).get(MODEL, 1)
    kv = num_heads if num_kv_heads is None else num_kv_heads
    replicate_kv = model_axis is not None and not _attention.splits_kv_heads(kv, p)
    rng = np.random.default_rng(seed)
    x, params, ct = random_inputs(rng, batch, seq, d_model, num_heads, head_dim, precision,
                                  use_bias, temperature, num_kv_heads)  # fmt: skip
    segment_ids = random_segments(rng, batch, seq, documents) if documents > 1 else None
    ref = attention_reference(x, params, ct, num_heads=num_heads, causal=causal,
                              precision=precision, num_kv_heads=num_kv_heads,
                              rope_theta=rope_theta, segment_ids=segment_ids,
                              kv_devices=p if replicate_kv else 1,
                              ring=folded_blocks(method, implementation, seq, n))  # fmt: skip
    y, (dx, dparams) = forward_and_grads(
        jax.device_put(x, NamedSharding(mesh, P(batch_axis))), params,
        jax.device_put(ct, NamedSharding(mesh, P(batch_axis))), None, segment_ids,
        mesh=mesh, method=method, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
        rope_theta=rope_theta, model_axis=model_axis, batch_axis=batch_axis,
        sequence_parallel=sequence_parallel, precision=precision, implementation=implementation,
    )  # fmt: skip
    assert y.dtype == precision.compute_dtype and dx.dtype == precision.compute_dtype
    assert all(g.dtype == precision.param_dtype for g in dparams.values())
    got = {"y": y, "x": dx, **dparams}
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    where = (
        f"{method} ({implementation}) on mesh {dict(axes)} B={batch} S={seq} D={d_model} H={num_heads} KV={kv} "
        f"hd={head_dim} causal={causal} sp={sequence_parallel} bias={use_bias} "
        f"T={temperature} rope={rope_theta} docs={documents} seed={seed}"
    )
    return assert_within_bounds(got, ref, where, precision, key=f"context {precision.name}")


def context_ledger(axes, method, *, batch=4, seq=16, d_model=32, num_heads=8, head_dim=4,
                   num_kv_heads=None, causal=True, documents=1, precision=shardops.FLOAT32):  # fmt: skip
    """The ``Ledger`` of forward + gradients with the input already in the layout
    (``permute=False``), so every collective is the kernel's."""
    mesh = mesh_of(axes)
    model_axis, batch_axis = roles(axes)
    kv = num_heads if num_kv_heads is None else num_kv_heads
    p = dict(axes).get(MODEL, 1)
    replicate_kv = model_axis is not None and not _attention.splits_kv_heads(kv, p)
    rng = np.random.default_rng(0)
    x, params, ct = random_inputs(rng, batch, seq, d_model, num_heads, head_dim, precision,
                                  num_kv_heads=num_kv_heads)  # fmt: skip
    segment_ids = random_segments(rng, batch, seq, documents) if documents > 1 else None
    specs = context.context_parallel_attention_specs(model_axis=model_axis, batch_axis=batch_axis,
                                                     replicate_kv=replicate_kv)  # fmt: skip
    x, ct = (jax.device_put(t, NamedSharding(mesh, specs.x)) for t in (x, ct))
    params = shardops.shard_params(params, mesh, specs.params)
    if segment_ids is not None:
        segment_ids = jax.device_put(segment_ids, NamedSharding(mesh, specs.tokens))
    fn = functools.partial(forward_and_grads, mesh=mesh, method=method, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, causal=causal, rope_theta=None,
                           model_axis=model_axis, batch_axis=batch_axis, sequence_parallel=False,
                           precision=precision, permute=False)  # fmt: skip
    return shardops.inspect.ledger(mesh, fn, x, params, ct, None, segment_ids)
