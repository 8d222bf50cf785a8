"""Ring attention over the ``context`` axis (``_context_attention``'s ``ring`` method): each
device keeps its queries while the K/V blocks go round the ring with ppermute, each step's
scores combined by an online softmax, with a custom VJP that passes K/V round again with their
dK/dV partial sums and returns those to their owners (the module docstring of
``_context_attention`` gives the schedule, the causal halves and the layout's positions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from shardops._mesh import varying_axes
from shardops.comm._collectives import ring_pass
from shardops.comm._reasons import Reason
from shardops.layers import _flash

_RING = Reason("context_ring", forward={
    "ppermute": "ring attention over {axis}: each device passes its K/V block to the next",
}, backward={
    "ppermute": "ring attention's backward over {axis}: K/V blocks go round again, with their "
                "dK/dV partial sums, which the last step returns to their owners",
})  # fmt: skip


def _local_positions(i, n: int, s: int):
    """``[s]`` int32: the global positions of device ``i``'s ``s`` tokens (chunks ``i``, ``2n−1−i``)."""
    c = s // 2
    chunk = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + chunk, (2 * n - 1 - i) * c + chunk])


def _pass_on(tree, axis: str, way: int = 1):
    """Each device's blocks to the next device of the ring (``i → i+way mod n``)."""
    return jax.tree.map(lambda t: ring_pass(t, axis, shift=way, reason=_RING), tree)


def _filled(like, shape, value, dtype):
    """A constant of ``shape`` varying over the mesh axes ``like`` varies over (a loop carry)."""
    out = jnp.full(shape, value, dtype)
    axes = tuple(sorted(varying_axes(like)))
    return lax.pcast(out, axes, to="varying") if axes else out


_ALL, _FIRST, _SECOND = "all", "first", "second"


def _half(t, which: str, dim: int):
    """``t`` along ``dim`` (the local tokens): all, or its first or second chunk."""
    if which == _ALL:
        return t
    c = t.shape[dim] // 2
    return lax.slice_in_dim(t, 0 if which == _FIRST else c, c if which == _FIRST else 2 * c,
                            axis=dim)  # fmt: skip


def _put_half(t, part, which: str, dim: int, add: bool = False):
    """``t`` with its ``which`` chunk along ``dim`` replaced by (or, with ``add``, plus) ``part``."""
    if which == _ALL:
        return t + part if add else part
    c = t.shape[dim] // 2
    start = 0 if which == _FIRST else c
    if add:
        part = part + lax.slice_in_dim(t, start, start + c, axis=dim)
    return lax.dynamic_update_slice_in_dim(t, part, start, axis=dim)


def _blocks(step_fn, carry, t: int, causal: bool, earlier):
    """Run ``step_fn(carry, rows, cols)`` on the part of step ``t``'s block that any query
    sees: all of it at t = 0 or without ``causal``; else, on the held block's owner being
    ``earlier`` than this device, every query against its first chunk, otherwise the second
    chunk of the queries against all of it (``_context_attention``'s module docstring)."""
    if t == 0 or not causal:
        return step_fn(carry, _ALL, _ALL)
    return lax.cond(earlier, lambda c: step_fn(c, _ALL, _FIRST),
                    lambda c: step_fn(c, _SECOND, _ALL), carry)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring_attention(axis, causal, precision, block_k, q, k, v, seg_all, index):
    """``o[B, H, s, hd]`` (accum) of ``q[B, H, s, hd]`` over the ring's K/V blocks ``k, v[B,
    n, s, hd]``; ``seg_all[B, S]``: every device's segment ids, device-major (or None);
    ``index[H]`` (or None): the held KV head of each query head, the blocks travelling with
    their own KV heads only. Each step is the blocked core over the held block in blocks of
    ``block_k``, merged into the running result by its log-sum-exp."""
    return _ring_fwd(axis, causal, precision, block_k, q, k, v, seg_all, index)[0]


def _expand(t, index):
    """``t[B, n, s, hd]`` → each query head's KV head ``[B, H, s, hd]`` (or ``t``)."""
    return t if index is None else jnp.take(t, index, axis=1)


def _fold(part, index, count: int):
    """The transpose of ``_expand``: ``part[B, H, s, hd]`` summed into its ``count`` KV heads."""
    if index is None:
        return part
    shape = (part.shape[0], count, *part.shape[2:])
    return jnp.zeros(shape, part.dtype).at[:, index].add(part)


def _block_of(seg_all, owner, s: int):
    """Device ``owner``'s ``s`` segment ids of the device-major ``seg_all[B, S]`` (or None)."""
    if seg_all is None:
        return None
    return lax.dynamic_slice_in_dim(seg_all, owner * s, s, axis=1)


def _step_tokens(seg_all, q_pos, k_pos, r, owner, s: int, rows: str, cols: str):
    """The positions and segment ids of a step's queries (``rows``) and keys (``cols``)."""
    q_seg, k_seg = _block_of(seg_all, r, s), _block_of(seg_all, owner, s)
    return {
        "q_positions": _half(q_pos, rows, 0),
        "k_positions": _half(k_pos, cols, 0),
        "q_segments": None if q_seg is None else _half(q_seg, rows, 1),
        "k_segments": None if k_seg is None else _half(k_seg, cols, 1),
    }


def _ring_fwd(axis, causal, precision, block_k, q, k, v, seg_all, index):
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    s = q.shape[2]
    compute = precision.compute_dtype
    q_pos = _local_positions(r, n, s)  # [s]: this device's global positions
    qc = q.astype(compute)  # q[B, H, s, hd]
    kc, vc = k.astype(compute), v.astype(compute)  # the blocks that travel: k[B, n, s, hd]
    held = (kc, vc)
    o = _filled(q, q.shape, 0.0, precision.accum_dtype)  # the attention over the blocks so far
    lse = _filled(q, q.shape[:-1], _flash.MASKED, jnp.float32)  # and its log-sum-exp [B, H, s]

    for t in range(n):  # ring steps: the block of device r − t
        owner = (r - t) % n  # whose block this device holds now
        k_pos = _local_positions(owner, n, s)

        def step(carry, rows, cols, held=held, k_pos=k_pos, owner=owner):
            o, lse = carry
            kb, vb = (_half(_expand(t, index), cols, 2) for t in held)
            o_t, lse_t = _flash.attention_with_lse(
                _half(qc, rows, 2), kb, vb, causal=causal, block_k=block_k, precision=precision,
                **_step_tokens(seg_all, q_pos, k_pos, r, owner, s, rows, cols),
            )  # fmt: skip
            o_new, lse_new = _flash.merge(_half(o, rows, 2), _half(lse, rows, 2), o_t, lse_t)
            return _put_half(o, o_new, rows, 2), _put_half(lse, lse_new, rows, 2)

        o, lse = _blocks(step, (o, lse), t, causal, owner < r)
        if t < n - 1:
            held = _pass_on(held, axis)
    # At N = 2 the backward needs the one block the forward received: kept (a second pass
    # would be the same swap of the same values, which XLA merges with this one anyway).
    peer = held if n == 2 else None
    return o, (qc, kc, vc, seg_all, index, o, lse, peer)


# The backward ring passes blocks i → i−1: the forward's i → i+1 on the same K/V would be the
# same ppermute of the same values, which XLA merges (CSE; XLA:CPU drops optimization
# barriers first), keeping every received block alive from the forward to the backward, O(S).
_BACK = -1


def _ring_bwd(axis, causal, precision, block_k, residuals, do):
    qc, kc, vc, seg_all, index, out, lse, peer = residuals
    count = kc.shape[1]  # the KV heads held (by index: fewer than the query heads)
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    s = qc.shape[2]
    q_pos = _local_positions(r, n, s)
    rounded = do.astype(precision.compute_dtype).astype(jnp.float32)  # dO as products read it
    delta = jnp.sum(rounded * out.astype(jnp.float32), -1)  # D[B, H, s] = rowsum(dO∘O)
    dq = _filled(qc, qc.shape, 0.0, precision.accum_dtype)
    dk = _filled(kc, kc.shape, 0.0, precision.accum_dtype)  # the held block's dK, travelling
    dv = _filled(vc, vc.shape, 0.0, precision.accum_dtype)
    held = (kc, vc)

    for t in range(n):  # ring steps: the block of device r + t
        owner = (r + t) % n  # the backward ring turns the other way (_BACK)
        k_pos = _local_positions(owner, n, s)

        def step(carry, rows, cols, held=held, k_pos=k_pos, owner=owner):
            dq, dk, dv = carry
            kb, vb = (_half(_expand(t, index), cols, 2) for t in held)
            dq_part, dk_part, dv_part = _flash.attention_backward(
                _half(qc, rows, 2), kb, vb, _half(do, rows, 2), _half(lse, rows, 2),
                _half(delta, rows, 2), causal=causal, block_k=block_k, precision=precision,
                **_step_tokens(seg_all, q_pos, k_pos, r, owner, s, rows, cols),
            )  # fmt: skip
            return (_put_half(dq, dq_part, rows, 2, add=True),
                    _put_half(dk, _fold(dk_part, index, count), cols, 2, add=True),
                    _put_half(dv, _fold(dv_part, index, count), cols, 2, add=True))  # fmt: skip

        dq, dk, dv = _blocks(step, (dq, dk, dv), t, causal, owner < r)
        if t < n - 1:
            if peer is None:
                held, (dk, dv) = _pass_on((held, (dk, dv)), axis, _BACK)
            else:  # N = 2: the peer's block, kept by the forward
                held, (dk, dv) = peer, _pass_on((dk, dv), axis, _BACK)
    if n > 1:  # the block held last is device r−1's: its dK/dV go home
        dk, dv = _pass_on((dk, dv), axis, _BACK)
    return dq, dk, dv, None, None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
