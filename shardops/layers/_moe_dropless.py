"""The mixture of experts' dropless path (``capacity_factor=None``): no slots and nothing
dropped. This device's T·k choices are sorted by expert (a stable argsort), each expert
applies its SwiGLU to exactly its rows by grouped matmuls (``lax.ragged_dot``, or the Pallas
TPU kernels of megablox with ``grouped_matmul="megablox"``; group sizes = tokens per expert),
the outputs return to token order and are combined with the renormalised weights:

    xs[T·k, D] = x[token of each sorted choice];  group_sizes[E] = choices per expert
    ys = down(silu(xs · gate) ⊙ (xs · up)) by grouped matmuls  → ys[T·k, D]{U_model}
    y[G, S, D] = Σ_k weights[G, S, k] · ys[unsorted] → psum over model

It equals the capacity path at ``capacity_factor ≥ E / k`` (``C = S``) without its padding.
The experts are not split: with an expert axis of size > 1 the tokens per device and expert
are ragged, which needs ``lax.ragged_all_to_all``, not implemented on XLA:CPU where this
library is tested; that combination is refused (``docs/moe.md``).

``_grouped_matmul`` is the grouped matmul with its backward (``dx`` by the transposed
weights, ``dw`` by a ragged contraction), on either implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from shardops._precision import Precision, _reduce_to
from shardops.layers._mlp import _gated


def _grouped_dot(how: str, x_c, w_c, group_sizes, accum, precision):
    """``y[M, N]``: rows ``x_c[M, K]`` of group i (``group_sizes[i]`` rows, in order) times
    ``w_c[i, K, N]``, accumulated in ``accum``."""
    if how == "megablox":
        return _megablox().gmm(x_c, w_c, group_sizes, accum, _tiling(x_c.shape[0], *w_c.shape[1:]),
                                interpret=_interpret())  # fmt: skip
    return lax.ragged_dot(x_c, w_c, group_sizes, precision=precision, preferred_element_type=accum)


def _grouped_dot_rhs_t(how: str, g_c, w_c, group_sizes, accum, precision):
    """``dx[M, K]``: rows ``g_c[M, N]`` of group i times ``w_c[i, K, N]ᵀ``."""
    if how == "megablox":
        return _megablox().gmm(g_c, w_c, group_sizes, accum, _tiling(g_c.shape[0], *w_c.shape[2:0:-1]),
                                transpose_rhs=True, interpret=_interpret())  # fmt: skip
    return lax.ragged_dot(g_c, jnp.swapaxes(w_c, 1, 2), group_sizes, precision=precision,
                          preferred_element_type=accum)  # fmt: skip


def _grouped_outer(how: str, x_c, g_c, group_sizes, accum, precision):
    """``dw[E, K, N]``: ``dw[i] = x_c[rows of i]ᵀ · g_c[rows of i]`` (the contraction ragged)."""
    e = group_sizes.shape[0]
    if how == "megablox":
        m, k_dim, n = x_c.shape[0], x_c.shape[1], g_c.shape[1]
        return _megablox().tgmm(x_c.swapaxes(0, 1), g_c, group_sizes, accum, _tiling(m, k_dim, n),
                                 num_actual_groups=e, interpret=_interpret())  # fmt: skip
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])  # fmt: skip
    return lax.ragged_dot_general(x_c, g_c, group_sizes, dims, precision=precision,
                                  preferred_element_type=accum)  # fmt: skip


def _megablox():
    """JAX's Pallas TPU grouped matmuls (imported when asked for)."""
    import importlib  # the package's name ``gmm`` is a function: the module by its path

    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tiling(m: int, k_dim: int, n: int) -> tuple[int, int, int]:
    """megablox's tiles: rows by 512, features by the largest of 1024, 512, 256, 128 that
    divides them (MaxText's sizes), or a whole dimension that none divides (small tests)."""

    def tile(dim, sizes):
        return next((t for t in sizes if dim % t == 0), dim)

    features = (1024, 512, 256, 128)
    return tile(m, (512, 256, 128)), tile(k_dim, features), tile(n, features)


def _interpret() -> bool:
    """megablox's Pallas kernels compile for a TPU; elsewhere they run interpreted (tests)."""
    return jax.default_backend() != "tpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _grouped_matmul(how, compute, accum, precision, x, w, group_sizes):
    """``y[M, N]`` = rows of ``x[M, K]`` grouped by ``group_sizes[E]`` times ``w[E, K, N]``:
    operands in ``compute``, accumulated and returned in ``accum``; the backward's products
    in ``compute`` too (as ``Precision.matmul``'s)."""
    return _grouped_dot(how, x.astype(compute), w.astype(compute), group_sizes, accum, precision)


def _grouped_matmul_fwd(how, compute, accum, precision, x, w, group_sizes):
    x_c, w_c = x.astype(compute), w.astype(compute)  # residuals in compute_dtype
    y = _grouped_dot(how, x_c, w_c, group_sizes, accum, precision)
    # empty slices carry x's and w's dtypes and varying mesh axes into the backward pass
    return y, (x_c, w_c, group_sizes, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _grouped_matmul_bwd(how, compute, accum, precision, residuals, g):
    x_c, w_c, group_sizes, x_kind, w_kind = residuals
    g_c = g.astype(compute)  # g[M, N]
    dx = _grouped_dot_rhs_t(how, g_c, w_c, group_sizes, accum, precision)  # dx[M, K] in accum
    dw = _grouped_outer(how, x_c, g_c, group_sizes, accum, precision)  # dw[E, K, N] in accum
    dx, dw = _reduce_to(dx, x_kind), _reduce_to(dw, w_kind)  # over axes only g varies over
    return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype), None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _grouped_experts(xs, group_sizes, params, activation, precision: Precision, how: str):
    """Every expert's SwiGLU on its rows of ``xs[M, D]`` (grouped by expert, ``group_sizes[E]``
    rows each): ``ys[M, D]`` in accum, partial sums over the model axis when F is split."""
    mm = functools.partial(_grouped_matmul, how, precision.compute_dtype, precision.accum_dtype,
                           precision.matmul_precision)  # fmt: skip
    gate = mm(xs, params["gate"], group_sizes)  # gate[M, F/p] in accum
    up = mm(xs, params["up"], group_sizes)  # up[M, F/p] in accum
    h = jax.checkpoint(_gated, static_argnums=(2, 3))(gate, up, activation, precision)  # h[M, F/p]
    return mm(h, params["down"], group_sizes)  # ys[M, D] in accum {U_model}


def _dropless(x_region, top_i, weights, params, activation, precision: Precision, how: str):
    """``y[G, S, D]`` (accum, ``{U_model}`` when F is split): each of the T·k choices of
    ``top_i[G, S, k]`` sorted by expert, the experts applied by grouped matmuls (every choice
    its expert, none dropped), the outputs put back in token order and combined with
    ``weights[G, S, k]``."""
    g, s, d = x_region.shape
    k, e = top_i.shape[-1], params["gate"].shape[0]
    expert = top_i.reshape(g * s * k)  # [T·k]: each choice's expert, token-major
    order = jnp.argsort(expert, stable=True)  # [T·k]: the choices sorted by expert
    group_sizes = jnp.bincount(expert, length=e).astype(jnp.int32)  # [E]: tokens per expert
    xs = x_region.reshape(g * s, d)[order // k]  # xs[T·k, D] in accum, grouped by expert
    ys = _grouped_experts(xs, group_sizes, params, activation, precision, how)  # ys[T·k, D]
    unsort = jnp.argsort(order)  # [T·k]: where each choice sits among the sorted
    ye = ys[unsort].reshape(g, s, k, d)  # ye[G, S, k, D]: choice j of token s back in place
    # in float32 on every backend, as the capacity path's combine
    return jnp.einsum("gsk,gskd->gsd", weights, ye, precision=lax.Precision.HIGHEST)
