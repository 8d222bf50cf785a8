"""The gated MLP of today's decoders (Llama's SwiGLU): per-device kernel, layer, specs.

    gate = x[B, S, D] · wg[D, F_model] + bg                                  (column-parallel)
    up   = x[B, S, D] · wu[D, F_model] + bu                                  (column-parallel)
    h    = silu(gate) ⊙ up                       → h[B, S, F_model]          (local)
    y    = h · wd[F_model, D] → y[B, S, D]{U_model} → psum → + bd            (row-parallel)

``x`` enters the model-parallel region once for both column layers (one ``copy_to_region``, or
under sequence parallelism one ``gather_to_region`` along S), so the backward reduces ``dx``
once, not twice: a hand-written gated MLP of two ``column_parallel_dense`` calls pays two dx
AllReduces (``docs/strategies.md``). The down projection is ``row_parallel_dense_kernel``.

Precision: the two column products accumulate in ``accum_dtype``; the activation and the
product ``silu(gate) ⊙ up`` are evaluated on those float32 values and rounded once to the
compute dtype, where the down projection reads ``h``.

An uneven hidden size (Llama's 11008 on 3 devices, d_ff = 172 on 8) is stored padded to a
multiple of p (``shard_params`` pads; ``hidden`` is the logical F): the down projection masks
the padded columns of ``h``, so they reach neither the output nor a gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import MODEL_AXIS, SEQUENCE_DIM
from shardops._mesh import check_divisible, spec_entry
from shardops._precision import FLOAT32, Precision
from shardops.comm._mappings import REPLICATED_INPUT, copy_to_region, gather_to_region
from shardops.comm._reasons import Reason, because
from shardops.layers._common import (
    bound_axis_size,
    check_axes,
    check_precision,
    check_replicated_over,
    check_sharded_over,
    run_layer,
    scoped,
)
from shardops.layers._dense_kernels import row_parallel_dense_kernel
from shardops.layers._params import init_dense

PROJECTIONS = ("gate", "up", "down")
HIDDEN_NAME = "mlp_hidden"
"""The ``checkpoint_name`` of the hidden ``h``: a remat policy saving it by name
(``shardops_models.strategies.remat.MLP_HIDDEN``) keeps it for the backward pass."""

_GATHER = Reason("gated_mlp_sequence_gather", forward={
    "all_gather": "the input is split over {axis} along the sequence (sequence parallelism) "
                  "and the gate and up projections need all of it: gathered once for both",
}, backward={
    "psum_scatter": "it is the transpose of the sequence-parallel gather: dx partial sums of "
                    "the gate and up projections are reduced and split back over {axis}",
})  # fmt: skip


class GatedMlpSpecs(NamedTuple):
    """PartitionSpecs of the gated MLP: input ``x``, the gate and up weights ``w_in`` and
    biases ``b_in``, the down weight ``w_out`` and bias ``b_out``, and the output ``y``."""

    x: P
    w_in: P
    b_in: P
    w_out: P
    b_out: P
    y: P

    @property
    def params(self) -> dict:
        """The specs of ``init_gated_mlp``'s tree, for ``shard_params``."""
        column = {"w": self.w_in, "b": self.b_in}
        return {"gate": column, "up": dict(column), "down": {"w": self.w_out, "b": self.b_out}}


def tensor_parallel_gated_mlp_specs(
    *, axis_name: str = MODEL_AXIS, batch_axis: str | None = None, sequence_parallel: bool = False
) -> GatedMlpSpecs:
    """Layout of ``tensor_parallel_gated_mlp``: ``x[B_batch, S, D] → y[B_batch, S, D]``, gate
    and up ``w[D, F_model]``, ``b[F_model]``, down ``w[F_model, D]``, ``b[D]`` replicated;
    ``sequence_parallel`` splits ``x`` and ``y`` along S too."""
    x = P(spec_entry(batch_axis), axis_name if sequence_parallel else None, None)
    return GatedMlpSpecs(x=x, w_in=P(None, axis_name), b_in=P(axis_name),
                         w_out=P(axis_name, None), b_out=P(None), y=x)  # fmt: skip


def init_gated_mlp(
    key: jax.Array, d_model: int, d_ff: int, *, use_bias: bool = False, dtype=jnp.float32
) -> dict[str, dict[str, jax.Array]]:
    """Full parameters ``{"gate", "up": {"w": w[d_model, d_ff]}, "down": {"w": w[d_ff,
    d_model]}}`` (and ``"b"`` of each with ``use_bias``; Llama has none), each as
    ``shardops.init_dense``. Shard with ``shard_params(params, mesh,
    tensor_parallel_gated_mlp_specs().params)``."""
    k_gate, k_up, k_down = jax.random.split(key, 3)
    return {
        "gate": init_dense(k_gate, d_model, d_ff, use_bias=use_bias, dtype=dtype),
        "up": init_dense(k_up, d_model, d_ff, use_bias=use_bias, dtype=dtype),
        "down": init_dense(k_down, d_ff, d_model, use_bias=use_bias, dtype=dtype),
    }


def _hidden(x, params, activation, precision: Precision):
    """``activation(x·wg + bg) ⊙ (x·wu + bu)`` in float32, rounded once to compute dtype.

    The elementwise step is recomputed in the backward pass from ``gate`` and ``up``
    (``jax.checkpoint``): the backward keeps those two float32 ``[..., F]`` arrays instead of
    the activation's float32 intermediates (SiLU's sigmoid and products: three more), the same
    values bit for bit."""
    accum = precision.accum_dtype
    # [..., F(/p)] each, in accum; x rounded once for both (one copy kept for the backward)
    gate, up = precision.matmuls(x, (params["gate"]["w"], params["up"]["w"]))
    if "b" in params["gate"]:
        gate = gate + params["gate"]["b"].astype(accum)
    if "b" in params["up"]:
        up = up + params["up"]["b"].astype(accum)
    return jax.checkpoint(_gated, static_argnums=(2, 3))(gate, up, activation, precision)


def _gated(gate, up, activation, precision: Precision):
    return (activation(gate) * up).astype(precision.compute_dtype)  # h[..., F(/p)]


@scoped("gated_mlp")
def tensor_parallel_gated_mlp_kernel(
    x,
    params,
    *,
    axis_name: str = MODEL_AXIS,
    sequence_parallel: bool = False,
    hidden: int | None = None,
    activation: Callable = jax.nn.silu,
    precision: Precision = FLOAT32,
):
    """The gated MLP on local blocks: ``x[B, S, D] → y[B, S, D]``, F/p hidden units per device.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        x: ``x[..., D]`` replicated over ``axis_name``; with ``sequence_parallel`` the sequence
            shard ``x[B, S/p, D]``.
        params: ``{"gate", "up": {"w": w[D, F/p], "b"?: b[F/p]}, "down": {"w": w[F/p, D],
            "b"?: b[D]}}``, local shards (``down``'s bias replicated).
        hidden: the logical F when the stored F is padded to a multiple of p.
        activation: the gate's nonlinearity (``jax.nn.silu``: SwiGLU; ``jax.nn.gelu``: GeGLU).

    Returns:
        ``y[..., D]`` in compute dtype, replicated over ``axis_name`` (``y[B, S/p, D]`` with
        ``sequence_parallel``).

    Communication over ``axis_name`` (V = bytes of ``y`` or ``x`` in ``accum_dtype``):
        forward: AllReduce of ``y{U_model}`` (V); with ``sequence_parallel`` AllGather of ``x``
        and ReduceScatter of ``y``.
        backward: one AllReduce of ``dx`` for gate and up together (V); with
        ``sequence_parallel`` AllGather of ``dy``, ReduceScatter of ``dx`` and, with a down
        bias, an AllReduce of ``dbd[D]``. Weight gradients are local.
    """
    op = "tensor_parallel_gated_mlp_kernel"
    p = bound_axis_size(axis_name, op)
    _check_params(op, params)
    for name in PROJECTIONS:
        check_sharded_over(params[name]["w"], axis_name, f"params[{name!r}]['w']", op)
    _check_local(op, x, params, hidden, p)
    accum = precision.accum_dtype
    if sequence_parallel:
        # x_block[B, S/p, D] → x[B, S, D] once for gate and up; backward: one ReduceScatter.
        with because(_GATHER, axis_name):
            x = gather_to_region(x, axis_name, SEQUENCE_DIM, accum)  # x[B, S, D] in accum
    else:
        check_replicated_over(x, axis_name, "x", op)
        # Megatron's "f" once for gate and up: identity forward, one AllReduce of dx backward.
        with because(REPLICATED_INPUT, axis_name):
            x = copy_to_region(x, axis_name, accum)  # x[..., D] in accum
    h = _hidden(x, params, activation, precision)  # h[..., F/p] in compute dtype
    h = checkpoint_name(h, HIDDEN_NAME)  # a remat policy may keep it by name
    return row_parallel_dense_kernel(  # y[..., D] (sp: y[B, S/p, D]) in compute dtype
        h, params["down"]["w"], params["down"].get("b"), axis_name=axis_name,
        in_features=hidden, reduce="psum_scatter" if sequence_parallel else "psum",
        scatter_dimension=SEQUENCE_DIM, precision=precision,
    )  # fmt: skip


def gated_mlp(x, params, *, activation: Callable = jax.nn.silu, precision: Precision = FLOAT32):
    """Unsharded gated MLP: ``down(activation(gate(x)) ⊙ up(x))``, ``x[..., D] → y[..., D]``.

    The same computation and precision as ``tensor_parallel_gated_mlp_kernel`` on one device:
    the reference it is checked against, and the MLP of a strategy that does not split it.
    """
    op = "gated_mlp"
    check_precision(op, precision)
    _check_params(op, params)
    _check_global(op, x, params)
    h = _hidden(x.astype(precision.accum_dtype), params, activation, precision)  # h[..., F]
    h = checkpoint_name(h, HIDDEN_NAME)  # a remat policy may keep it by name
    return precision.finish(precision.matmul(h, params["down"]["w"]), params["down"].get("b"))


def tensor_parallel_gated_mlp(
    x,
    params,
    *,
    mesh: Mesh,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
    hidden: int | None = None,
    activation: Callable = jax.nn.silu,
    precision: Precision = FLOAT32,
):
    """The gated MLP on global arrays, gate and up column-parallel and down row-parallel over
    ``axis_name``.

    Arguments:
        x: ``x[B, S, D]`` in compute dtype, split over ``batch_axis`` (if given) along B; with
            ``sequence_parallel`` also over ``axis_name`` along S.
        params: full-shape parameters as ``init_gated_mlp`` makes them, laid out as
            ``tensor_parallel_gated_mlp_specs(...).params`` (or left to ``shard_map``). F must
            divide by the axis size: pad it (``shard_params`` does) and pass ``hidden``.
        hidden: the logical F of padded weights.

    Returns ``y[B, S, D]`` laid out as the specs' ``y``. Communication: see the kernel.
    """
    op = "tensor_parallel_gated_mlp"
    check_axes(mesh, axis_name, batch_axis)
    check_precision(op, precision)
    _check_params(op, params)
    _check_global(op, x, params)
    precision.check_activation("x", x.dtype)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        precision.check_param(f"params{jax.tree_util.keystr(path)}", leaf.dtype)
    check_divisible(argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh,
                    axes=(batch_axis,))  # fmt: skip
    stored = params["gate"]["w"].shape[1]
    check_divisible(argument="params['gate']['w']", dim=1, dim_name="hidden", size=stored,
                    mesh=mesh, axes=(axis_name,),
                    hint="; pad it with shard_params and pass hidden=F")  # fmt: skip
    if sequence_parallel:
        check_divisible(argument="x", dim=SEQUENCE_DIM, dim_name="sequence", size=x.shape[1],
                        mesh=mesh, axes=(axis_name,))  # fmt: skip
    if hidden is not None and not 0 < hidden <= stored:
        raise ValueError(f"{op}: hidden={hidden} must be in [1, {stored}] (the stored F)")
    specs = tensor_parallel_gated_mlp_specs(
        axis_name=axis_name, batch_axis=batch_axis, sequence_parallel=sequence_parallel
    )
    param_specs = {k: {n: specs.params[k][n] for n in params[k]} for k in params}
    kernel = functools.partial(
        tensor_parallel_gated_mlp_kernel, axis_name=axis_name, hidden=hidden,
        sequence_parallel=sequence_parallel, activation=activation, precision=precision,
    )  # fmt: skip
    return run_layer(op, kernel, mesh, {"x": x, "params": params},
                     {"x": specs.x, "params": param_specs}, specs.y)  # fmt: skip


# --- checks -----------------------------------------------------------------------------------


def _check_params(op: str, params) -> None:
    if not isinstance(params, dict) or set(params) != set(PROJECTIONS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"{op}: params must be {{'gate', 'up', 'down'}}, each a dense layer's "
                         f"{{'w', 'b'?}} (shardops.init_gated_mlp); got {got}")  # fmt: skip
    for name in PROJECTIONS:
        sub = params[name]
        if not isinstance(sub, dict) or "w" not in sub or set(sub) - {"w", "b"}:
            got = sorted(sub) if isinstance(sub, dict) else type(sub).__name__
            raise ValueError(f"{op}: params[{name!r}] must hold 'w' and optionally 'b'; got "
                             f"{got}")  # fmt: skip


def _check_global(op: str, x, params) -> None:
    """``x[..., D]``, gate and up ``w[D, F]``, down ``w[F, D]``, biases to match."""
    wg, wu, wd = (params[n]["w"] for n in PROJECTIONS)
    d = x.shape[-1]
    if wg.shape != wu.shape or wg.ndim != 2 or wg.shape[0] != d:
        raise ValueError(
            f"{op}: gate and up weights must both be w[D, F] with D = x's features = {d}; got "
            f"gate {tuple(wg.shape)}, up {tuple(wu.shape)}"
        )
    if tuple(wd.shape) != (wg.shape[1], d):
        raise ValueError(
            f"{op}: the down weight must be w[F, D] = {(wg.shape[1], d)} to match the gate's "
            f"w{tuple(wg.shape)}; got {tuple(wd.shape)}"
        )
    for name, want in (("gate", wg.shape[1]), ("up", wg.shape[1]), ("down", d)):
        b = params[name].get("b")
        if b is not None and tuple(b.shape) != (want,):
            raise ValueError(f"{op}: params[{name!r}]['b'] must have shape ({want},); got "
                             f"{tuple(b.shape)}")  # fmt: skip


def _check_local(op: str, x, params, hidden, p: int) -> None:
    wg, wu, wd = (params[n]["w"] for n in PROJECTIONS)
    if wg.shape != wu.shape or wg.shape[0] != x.shape[-1] or wd.shape != (wg.shape[1], x.shape[-1]):
        raise ValueError(
            f"{op}: local shards must be gate, up w[D, F/p] and down w[F/p, D] with D = "
            f"{x.shape[-1]}; got gate {tuple(wg.shape)}, up {tuple(wu.shape)}, down "
            f"{tuple(wd.shape)}"
        )
    for name, want in (("gate", wg.shape[1]), ("up", wg.shape[1]), ("down", x.shape[-1])):
        b = params[name].get("b")
        if b is not None and tuple(b.shape) != (want,):
            how = "replicated" if name == "down" else "split like its w"
            raise ValueError(f"{op}: local params[{name!r}]['b'] must be b[{want}] ({how}); "
                             f"got {tuple(b.shape)}")  # fmt: skip
    stored = wg.shape[1] * p
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int)
                               or not 0 < hidden <= stored):  # fmt: skip
        raise ValueError(f"{op}: hidden={hidden!r} must be an int in [1, {stored}] (the stored "
                         f"F = {wg.shape[1]} × {p} devices)")  # fmt: skip


__all__ = [
    "GatedMlpSpecs",
    "gated_mlp",
    "init_gated_mlp",
    "tensor_parallel_gated_mlp",
    "tensor_parallel_gated_mlp_kernel",
    "tensor_parallel_gated_mlp_specs",
]
