"""The plain collectives, each with the reason it runs: ``lax``'s own call inside ``because``.

Per-device code inside ``jax.shard_map`` calls these instead of ``lax.psum`` and friends, so
every collective in shardops is found by name in ``shardops.comm`` and says why it runs::

    y = all_reduce(y_partial, "model", reason=PARTIAL_SUMS)

is ``with because(PARTIAL_SUMS, "model"): y = lax.psum(y_partial, "model")``: the same call (the
same program, bit for bit, and JAX's own autodiff), with the reason in its op name for
``shardops.inspect.explain``. Each takes what its ``lax`` twin takes (an array or a pytree of
them; ``axis_name`` a mesh axis or a tuple of them).

| name             | ``lax`` call                 | notation                              |
|------------------|------------------------------|---------------------------------------|
| ``all_reduce``   | ``psum``                     | ``A{U_X} → A``                        |
| ``all_max``      | ``pmax``                     | the elementwise max over ``X``        |
| ``all_min``      | ``pmin``                     | the elementwise min over ``X``        |
| ``all_gather``   | ``all_gather`` (tiled)       | ``A[I_X] → A[I]``                     |
| ``reduce_scatter`` | ``psum_scatter`` (tiled)   | ``A[I]{U_X} → A[I_X]``                |
| ``all_to_all``   | ``all_to_all`` (tiled)       | ``A[I_X, J] → A[I, J_X]``             |
| ``ring_pass``    | ``ppermute`` to ``i + shift`` | one ring step: device i's block to i + shift |
| ``send``         | ``ppermute`` along ``pairs``  | device i's block to j for each (i, j); zeros elsewhere |
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax import lax

from shardops.comm._reasons import Reason, because
from shardops.comm._ring import ring_pairs

AxisName = str | Sequence[str]


def all_reduce(x, axis_name: AxisName, *, reason: Reason):
    """AllReduce (``lax.psum``) of ``x{U_axis}`` over ``axis_name``: the sum, invariant over it.

    Backward (JAX's): none under ``check_vma`` (the cotangent reaches each device as it is).
    """
    with because(reason, axis_name):
        return lax.psum(x, axis_name)


def all_max(x, axis_name: AxisName, *, reason: Reason):
    """``lax.pmax`` of ``x`` over ``axis_name``: the elementwise max of every device's ``x``."""
    with because(reason, axis_name):
        return lax.pmax(x, axis_name)


def all_min(x, axis_name: AxisName, *, reason: Reason):
    """``lax.pmin`` of ``x`` over ``axis_name``: the elementwise min of every device's ``x``."""
    with because(reason, axis_name):
        return lax.pmin(x, axis_name)


def all_gather(
    x, axis_name: AxisName, *, axis: int = 0, tiled: bool = True, to: str = "varying",
    reason: Reason,
):  # fmt: skip
    """AllGather ``x[.., N_axis, ..] → x[.., N, ..]`` along ``axis`` (``lax.all_gather``;
    ``tiled=False`` stacks the blocks in a new dim ``axis`` instead; ``to="invarying"`` types
    the result invariant over ``axis_name``, as ``gather_from_region`` does).

    Backward (JAX's): ReduceScatter of ``dx`` (``to="varying"``), or each device's slice.
    """
    with because(reason, axis_name):
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to=to)


def reduce_scatter(
    x, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = True, reason: Reason
):
    """ReduceScatter ``x[.., N, ..]{U_axis} → x[.., N_axis, ..]`` along ``scatter_dimension``
    (``lax.psum_scatter``). Backward (JAX's): AllGather of ``dy``."""
    with because(reason, axis_name):
        return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)


def all_to_all(
    x, axis_name: AxisName, *, split_axis: int, concat_axis: int, tiled: bool = True,
    reason: Reason,
):  # fmt: skip
    """AllToAll ``x[.., S, .., C_axis, ..] → x[.., S_axis, .., C, ..]``: ``split_axis`` is cut
    into N blocks, block j sent to device j, and the received blocks are joined along
    ``concat_axis`` (``lax.all_to_all``). Backward (JAX's): the AllToAll back."""
    with because(reason, axis_name):
        return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def ring_pass(x, axis_name: AxisName, *, shift: int = 1, reason: Reason):
    """One ring step (``lax.ppermute``): device i's ``x`` goes to device ``(i + shift) mod N``
    over ``axis_name`` (a tuple of axes is one ring of their product size, in ``lax``'s
    linear order). Backward (JAX's): the step the other way."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    n = math.prod(lax.axis_size(a) for a in axes)
    with because(reason, axis_name):
        return lax.ppermute(x, axis_name, ring_pairs(n, shift))


def send(x, axis_name: str, pairs: Sequence[tuple[int, int]], *, reason: Reason):
    """``lax.ppermute`` along ``pairs``: for each ``(i, j)`` device i's ``x`` goes to device
    j over ``axis_name``; a device no pair sends to receives zeros (a pipeline stage's
    activation to the next stage). Backward (JAX's): each ``dx`` back from j to i."""
    with because(reason, axis_name):
        return lax.ppermute(x, axis_name, [tuple(p) for p in pairs])
