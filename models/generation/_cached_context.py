"""The layer context of a KV-cache decoder: the model's own ``apply`` run against a cache.

    ctx = CachedParallel(strategy, precision, cache=(k, v), start=start, output=paths)
    logits, _ = model.apply(ctx, tree, ids)      # ids[b, s] at positions start … start+s−1
    k, v = ctx.written()                          # the cache with their keys and values

``models.generation.Decoder`` has no forward of its own: it runs ``Gpt.apply`` and
``Llama.apply``, the forward every training strategy runs, through this ``Parallel`` whose
``attention`` reads and writes a KV cache. Every other layer (``unit``, ``embed``, ``dense``,
``gated_mlp``, the norms, ``tied_head``) is ``Parallel``'s own (``moe`` too, routed dropless),
so a change to the model or to its layers reaches the decoder too.

**Design: one context per trace, the cache in and the written cache out.** A context is made
for one call of ``model.apply`` inside one trace (the decoder makes one per prefill and per
step) and holds that trace's cache, ``k, v[L, b, n, S_max, hd]`` per device (``n =
kv_cache_heads(H, KV, p)``), and ``start``, the position of the tokens' first (an int32 scalar,
traced in ``generate``'s loop). Its private cursor records, as the forward runs, the cache
written so far and the next layer to read: the model's ``l``-th call of ``ctx.attention``
reads layer ``l``'s slice ``k, v[l]`` and writes the new tokens' keys and values back into it
(``shardops.layers.cached_attention_kernel``; the cache's functional update, ``.at[l].set``).
``written()`` hands the cache out after ``apply`` returns. Nothing outlives the trace: the
decoder never reuses a context, and a second forward through one is refused (its cursor would
hold the first trace's values).

**Stacked layers** (``ctx.scan``, the Llama's blocks ``[L, …]``): the ``lax.scan`` over the
layers carries the whole cache and the layer index beside the residual stream, each layer
reading and writing its slice inside the loop (one compiled block whatever the depth, the
cache updated in place), as unrolled blocks (the GPT's ``ctx.unit`` per block) do one after
another. Each layer must attend exactly once.

**A mixture of experts routes dropless** (``moe``; the Mixtral-style ``Llama(experts=...)``,
whose stacked blocks return their statistics beside the residual stream through ``scan(...,
outputs=True)``): every token goes to its ``k`` experts, whatever capacity factor the model
trained with. The capacity is per sequence, ``C = min(S, ceil(cf · S · k / E))``: a one-token
step never drops, but a prefill of a long prompt at a small ``cf`` would, and the same tokens
would then route one way when prefilled and another when fed one at a time. The dropless
layer (``capacity_factor=None``: the choices sorted by expert, grouped matmuls, linear in the
prompt's length) makes the prefill, every step and teacher-forced ``Decoder.logits`` agree
with each other and with the full forward of the model with a dropless ``Experts``
(``capacity_factor=None``, or ``≥ E / k``), as Hugging Face's Mixtral routes at inference (it
has no capacity).

**Last only.** With ``last_only`` the output layer (``output``: the paths of
``model.output_layer(params)``'s parameters) sees the last position alone, ``x[b, 1, D]``:
what a draw reads, so a prefill's head costs one position, not ``s``.

Communication: ``Parallel``'s, per layer: the cached attention's AllReduce of ``y[b, s, D]``
over the tp axis replaces the training kernel's (the same), and the cache never moves; the
experts' statistics are each device's own (no AllReduce over the batch).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from shardops.layers import cached_attention_kernel
from shardops_models.strategies.expert import ExpertKind
from shardops_models.strategies.parallel import Parallel, is_param, one_layer
from shardops_models.strategies.plan import StackedRole


def _returned(y) -> str:
    """What a layer returned, for an error: an array's type, or a tuple's length."""
    if isinstance(y, tuple):
        return f"a tuple of {len(y)}"
    return str(jax.typeof(y)) if isinstance(y, jax.Array) else type(y).__name__


class _Cursor:
    """The cache as this trace's forward has written it so far, ``k, v[L, b, n, S_max, hd]``,
    and ``layer``, the next layer to read (a Python int; inside ``scan``'s loop, traced);
    ``calls``: the ``attention`` calls so far (a Python int, for the checks)."""

    def __init__(self, k, v):
        self.k, self.v, self.layer, self.calls = k, v, 0, 0

    def read(self):
        return self.k[self.layer], self.v[self.layer]  # each [b, n, S_max, hd]

    def write(self, k, v):
        self.k = self.k.at[self.layer].set(k)  # [L, b, n, S_max, hd]
        self.v = self.v.at[self.layer].set(v)
        self.layer, self.calls = self.layer + 1, self.calls + 1


@dataclasses.dataclass(frozen=True)
class CachedParallel(Parallel):
    """``Parallel`` whose ``attention`` attends to and extends a KV cache (module docstring).

    Arguments (besides ``Parallel``'s; the decoding layout: tp over the ``model`` axis):
        cache: ``(k, v)``, each ``[L, b, n, S_max, hd]`` in the compute dtype: this device's
            rows and KV heads of every layer (``shardops.layers.cached_attention_kernel``).
        start: int32 scalar (may be traced), the position of ``ids[:, 0]``; rotary positions
            continue from it and the new keys and values are written from it.
        output: the paths (``Param.path``) of the output layer's parameters.
        last_only: the output layer on the last position alone.
    """

    cache: tuple | None = None
    start: jax.Array | int = 0
    output: frozenset[str] = frozenset()
    last_only: bool = False
    _cursor: _Cursor = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not (isinstance(self.cache, tuple) and len(self.cache) == 2):
            raise TypeError(
                f"CachedParallel: cache must be the pair (k, v) of this trace's cache, each "
                f"[L, b, n, S_max, hd]; got {type(self.cache).__name__}. Pass cache=(k, v), "
                f"this device's blocks of Decoder.init_cache()'s k and v"
            )
        object.__setattr__(self, "_cursor", _Cursor(*self.cache))

    @property
    def num_layers(self) -> int:
        """``L``: the layers the cache holds."""
        return self.cache[0].shape[0]

    def written(self):
        """``(k, v)``, each ``[L, b, n, S_max, hd]``: the cache with the forward's keys and
        values written, once every layer has attended (else a ValueError)."""
        cursor = self._cursor
        if cursor.calls != self.num_layers:
            raise ValueError(
                f"CachedParallel.written: the forward called ctx.attention {cursor.calls} "
                f"times; the cache holds {self.num_layers} layers, one call each. Decode a "
                f"model whose every layer attends once (models.Gpt, models.Llama)"
            )
        return cursor.k, cursor.v

    def attention(self, p, x, *, num_heads: int, num_kv_heads: int | None = None,
                  causal: bool = True, rope_theta: float | None = None, positions=None,
                  segment_ids=None):  # fmt: skip
        """Causal head-parallel attention of ``x[b, s, D]`` at positions ``start …
        start+s−1`` against the next layer's cache, whose slots ``start …`` it writes
        (``cached_attention_kernel``: one AllReduce of ``y[b, s, D]`` over the tp axis).
        The positions are the cache's: ``positions`` and ``segment_ids`` (packed documents)
        are refused, and so is a non-causal attention."""
        if not causal or positions is not None or segment_ids is not None:
            raise ValueError(
                f"CachedParallel.attention: a KV cache holds one causal sequence a row at "
                f"positions start, start+1, …; got causal={causal}, positions="
                f"{'given' if positions is not None else None}, segment_ids="
                f"{'given' if segment_ids is not None else None}. Decode one document a row "
                f"with the model's default positions"
            )
        cursor = self._cursor
        if isinstance(cursor.layer, int) and cursor.layer >= self.num_layers:
            raise ValueError(
                f"CachedParallel.attention: call {cursor.calls + 1} of this forward; the cache "
                f"holds {self.num_layers} layers, one call each. Make one context per forward, "
                f"and decode a model whose every layer attends once"
            )
        params = {k: self.array(q) for k, q in p.items()}  # this device's heads' weights
        y, (k, v) = cached_attention_kernel(
            x,
            params,
            cursor.read(),
            self.start,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            rope_theta=rope_theta,
            axis_name=self.axis_name(),
            precision=self.precision,
            implementation=self.attention_implementation,
        )  # y[b, s, D]; k, v[b, n, S_max, hd] with positions start … start+s−1 written
        cursor.write(k, v)
        return y

    def scan(self, fn, params, x, *, outputs: bool = False):
        """``Parallel.scan``'s loop over stacked layers, carrying the cache and the layer
        index beside ``x[b, s, D]``: layer ``l`` reads and writes ``k, v[l]``. With
        ``outputs`` (a mixture of experts' statistics), ``fn(layer, x)`` returns ``(x, out)``
        and ``scan`` returns ``(x, outs)``, each leaf of ``outs`` stacked over the layers
        ``[L, …]``, as ``Parallel.scan`` does."""
        leaves = [q for q in jax.tree.leaves(params, is_leaf=is_param) if is_param(q)]
        if not leaves or any(not isinstance(q.role, StackedRole) for q in leaves):
            return super().scan(fn, params, x, outputs=outputs)  # not stacked: Parallel's error
        cursor, first, calls_before = self._cursor, self._cursor.layer, self._cursor.calls
        layers = leaves[0].value.shape[0]
        if not isinstance(first, int) or first + layers > self.num_layers:
            raise ValueError(
                f"CachedParallel.scan: {layers} stacked layers after the {first} this forward "
                f"has attended in; the cache holds {self.num_layers} layers. Make the cache "
                f"for the model's layers (Decoder.init_cache), one context per forward"
            )
        per_layer = one_layer(params)  # as Parallel.scan: each leaf the layer's view

        def body(carry, layer_and_index):
            x, cursor.k, cursor.v = carry  # x[b, s, D]; the whole cache [L, b, n, S_max, hd]
            layer, i = layer_and_index
            cursor.layer, calls = first + i, cursor.calls
            y = self.unit(fn, layer, x)
            if outputs and not (isinstance(y, tuple) and len(y) == 2):
                raise ValueError(
                    f"CachedParallel.scan(outputs=True): each layer must return (x, out), the "
                    f"residual stream and its outputs; got {_returned(y)}. Return the "
                    f"pair, or scan without outputs"
                )
            x, out = y if outputs else (y, None)  # x[b, s, D]; out: this layer's outputs
            if cursor.calls != calls + 1:
                raise ValueError(
                    f"CachedParallel.scan: a stacked layer called ctx.attention "
                    f"{cursor.calls - calls} times; the cache holds one slice a layer, read "
                    f"and written by one call. Decode a model whose every layer attends once"
                )
            return (x, cursor.k, cursor.v), out

        index = jnp.arange(layers, dtype=jnp.int32)  # [L]: the layer each step reads
        (x, cursor.k, cursor.v), outs = lax.scan(body, (x, cursor.k, cursor.v),
                                                 (per_layer, index))  # outs: each leaf [L, …]  # fmt: skip
        cursor.layer, cursor.calls = first + layers, calls_before + layers
        return (x, outs) if outputs else x

    def moe(self, p, x, *, k: int, capacity_factor: float | None, score: str = "softmax",
            load_balance: str = "global", activation=jax.nn.silu):  # fmt: skip
        """``Parallel.moe`` routed so that nothing is dropped, whatever ``capacity_factor``
        the model trained with (the inference rule; module docstring): every token of ``x[b,
        s, D]`` goes to its ``k`` experts, so a prefill of ``s`` tokens and each one-token step
        route every token as the full forward of a dropless model does. Experts whole on each
        device are run dropless (``capacity_factor=None``: sorted by expert, grouped matmuls).
        Experts split over an expert axis (the decoder's ``+ep`` layouts) take the capacity
        path at ``capacity_factor = E / k`` (``C = s`` slots per expert and row: a token
        chooses an expert at most once, so none is dropped), each row's slots sent to their
        experts' devices and back by ``Parallel.moe``'s AllToAlls over that axis, as in
        training. The statistics are this device's (``load_balance="group"``: no AllReduce
        over the batch; the decoder discards them). Communication: ``Parallel.moe``'s (the
        combine's AllReduce of ``y[b, s, D]`` over the tp axis; under ep the two AllToAlls of
        the slots ``[E, b·s, D]`` over the expert axis)."""
        experts = p["router"].shape[-1]
        split = any(isinstance(kind, ExpertKind) and kind.splits(p) for kind in self.strategy.kinds)
        return super().moe(p, x, k=k, capacity_factor=experts / k if split else None,
                           score=score, load_balance="group", activation=activation)  # fmt: skip

    def dense(self, p, x):
        """``Parallel.dense``; the output layer on the last position alone under
        ``last_only``."""
        return super().dense(p, self._output_input(p, x))

    def tied_head(self, p, x):
        """``Parallel.tied_head``; on the last position alone under ``last_only``."""
        return super().tied_head(p, self._output_input(p, x))

    def _output_input(self, p, x):
        """``x[b, s, D]``, or ``x[b, 1, D]`` (its last position) where ``p`` is the output
        layer and ``last_only``."""
        paths = {q.path for q in jax.tree.leaves(p, is_leaf=is_param) if is_param(q)}
        return x[:, -1:] if self.last_only and paths and paths <= self.output else x
