"""KV-cache decoding of ``models.Llama`` and ``models.Gpt`` under tensor parallelism.

    decoder = generation.Decoder(model, shardops.make_mesh({"data": 2, "model": 4}),
                                 batch=8, max_len=256)
    params = decoder.place(params)                       # full params → the decoding layout
    tokens = decoder.generate(params, prompt, steps=64)  # greedy; temperature=, key= to sample

The prompt ``prompt[B, S_p]`` is *prefilled* in one pass that writes every layer's keys and
values into the cache; then each new token is one step that attends to the cache and appends
its own K/V, at position ``S_p + t`` (rotary positions continue from the prompt). All rows of
a batch share the prompt length. ``generate`` runs prefill and every step in one compiled
program (a ``lax.scan`` over the steps: one dispatch, nothing in flight to bound).
``logits`` runs one prefill or step a call against a ``KVCache`` (teacher-forced decoding).

**The forward is the model's own.** Each prefill and step runs ``model.apply`` (the forward
every training strategy runs, ``models/networks``) through a ``CachedParallel``
(``_cached_context.py``): the ``2d`` layer context whose ``attention`` reads and writes this
layer's slice of the cache at ``start`` (``shardops.layers.cached_attention_kernel``) and whose
``scan`` carries the cache through the loop over stacked layers. One context a trace: the
cache goes in, ``ctx.written()`` hands the written one out. The GPT reads its learned
positions from ``start`` (``Gpt.apply(..., start=)``); the Llama's rotary positions are the
attention's. A draw's forward runs the output layer on the last position alone.

**Layout** (the ``2d`` strategy's by default: Megatron's tensor parallelism over ``model``,
the batch over ``data``; ``strategy=`` picks another, ``decoding_strategy``): each device
holds ``H/p`` query heads and the weights of ``2d``; the cache ``k, v[L, B/d, n, S_max, hd]``
per device holds the KV heads its query heads read: split by KV head (``n = KV/p``) where
``model`` divides the KV heads, else the KV heads replicated like their weights (``n =
kv_cache_heads(H, KV, p)``; devices whose query heads read the same KV head each cache it).
A vocabulary or d_ff the model axis does not divide is padded and masked as in training.
Other mesh axes (``context``, ``replica``) are accepted and replicate the decoding: the
devices along them hold the same rows, weights and cache, and compute the same tokens (no
faster; build the mesh from ``data`` and ``model`` alone to use them for rows).

**A mixture of experts** (``Llama(experts=Experts(...))``, Mixtral-style) decodes without
drops: every token, of the prompt and of each step, goes to its ``k`` experts, whatever
capacity factor the model trained with (``CachedParallel.moe``). A one-token step could never
drop; a prefill of a long prompt at the training capacity would, and its tokens would route
otherwise than the same tokens fed one a step. So the tokens are those of the full forward
of the dropless model (``capacity_factor=None``, or the capacity path at ``E / k``: Hugging
Face's Mixtral, which has no capacity, routes so), whichever way they are fed. Under
``2d`` (and ``tp``) each expert's hidden units are split over ``model`` (its combine one
AllReduce of ``[b, s, D]``, in place of the MLP's), every expert on every row shard, routed
dropless (sorted by expert, grouped matmuls).

**Expert parallelism** (``"2d+ep"``, ``"tp+ep"``; the default on a mesh with an ``expert``
axis when the model has experts): the experts stay split over ``expert`` as training lays
them out (``E/N`` a device, each's hidden units over ``model``), so a model whose experts fit
only when split decodes, and the batch's rows are split over ``data × expert``. Each forward,
the prefill and every one-token step, routes its rows' tokens on their own device and sends
each expert's slots to the expert's device and back by two AllToAlls over ``expert``
(``shardops.layers.moe_kernel``, as in training), at the capacity ``E / k`` (``C = s`` slots
per expert and row: a token chooses an expert at most once, so nothing is dropped, and the
tokens are the dropless model's). The slots cost ``E / k`` times the tokens' work in a
prefill (``[E, b·s, D]`` a device; a dropless exchange needs ``lax.ragged_all_to_all``, not
implemented on XLA:CPU); a step's are ``[E, b, D]``. A dropless model (``capacity_factor=
None``, as ``HfMixtral.model()`` reads one) is built at ``E / k`` for the layout, so
``HfMixtral.load(decoder.setup)`` and a ``Setup.gather`` of an ep-trained state both place
into it.

**Sampling.** Greedy is the vocab-parallel argmax (an AllReduce(max) and an AllReduce(min) of
``B/d`` numbers; the logits are never gathered). With ``temperature`` > 0 a token is drawn by
the Gumbel-max trick, ``argmax(logits/T + g)``: entry ``(r, v)`` of ``g`` is
``jax.random.gumbel(fold_in(fold_in(step_key, r), v))`` for the global row ``r`` and token id
``v``, where token ``t`` of the continuation (0: the prompt's next) has ``step_key =
fold_in(key, t)``, each device drawing only its
``[B/d, V/p]`` block, so the draw equals the unsharded one's for the same key, whatever the
mesh.

**Per step** (one token, batch ``b = B/d`` per device), over ``model``: the embedding's
AllReduce of ``x[b, 1, D]``, two AllReduces of ``[b, 1, D]`` per layer (attention's output
and the MLP's, or the experts' combine), and the argmax's two of ``[b, 1]``; all float32;
under ep, two AllToAlls of ``[E, b, D]`` per layer over ``expert``. Nothing over ``data``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers import kv_cache_heads, vocab_parallel_argmax_kernel
from shardops_models.generation._cached_context import CachedParallel
from shardops_models.networks.gpt import Gpt
from shardops_models.networks.llama import Llama
from shardops_models.strategies.layout import DATA_AXIS, EXPERT_AXIS, Strategy, strategy_named
from shardops_models.strategies.parallel import is_param, wrap
from shardops_models.strategies.plan import leaf_roles
from shardops_models.training import _layer_order
from shardops_models.training._train import STATE_DONATED, build, check_not_donated

STRATEGY = "2d"  # the default decoding layout: tp over model, the batch over data
DECODING_KINDS = ("dp", "tp", "ep")
"""The kinds a decoding layout is made of (``decoding_strategy``): the batch's rows split (dp,
and ep's), tp's heads and hidden units, ep's experts."""
_PLACE = ("Place the model's params for decoding: decoder.place(setup_it_came_from.gather("
          "state).params)")  # fmt: skip


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v"),
                   meta_fields=("length",))  # fmt: skip
@dataclasses.dataclass(frozen=True)
class KVCache:
    """A decoder's KV cache and how many positions of it are written (``Decoder.init_cache``
    makes an empty one, ``Decoder.logits`` returns the next).

    ``k, v[L, B, p·n, S_max, hd]`` (``Decoder.init_cache``'s layout): every layer's keys and
    values at positions ``0 … length−1``; the slots from ``length`` on hold zeros or stale
    entries that nothing reads. ``length`` is a Python int, the position the next token goes
    to: ``Decoder.logits`` compares its ``start`` with it before anything runs."""

    k: jax.Array
    v: jax.Array
    length: int


class Decoder:
    """Prefill and one-token steps of ``model`` on ``mesh`` (axes ``data``, ``model`` and, for
    a model with experts, ``expert``), for batches of ``batch`` rows and sequences of at most
    ``max_len`` tokens (the cache's length; at most the model's context). ``precision``: the
    compute policy, the cache in its compute dtype. ``attention``: ``"einsum"`` scores a
    step's queries against the whole cache at once; any other implementation (``"auto"``, the
    default) reads the cache in blocks (``shardops.layers.cached_attention_kernel``).
    ``strategy``: the decoding layout, ``"tp"``, ``"2d"``, ``"tp+ep"`` or ``"2d+ep"``; None
    (the default) picks it from the mesh (``decoding_strategy``). ``setup`` is its
    ``Setup`` (what ``HfLlama.load`` places into; a training checkpoint decodes through
    ``Checkpoints.restore`` into its own setup, ``setup.gather``, then ``place``)."""

    def __init__(self, model: Llama | Gpt, mesh, *, batch: int, max_len: int,
                 precision: shardops.Precision = shardops.FLOAT32,
                 attention: str = "auto", strategy: Strategy | str | None = None):  # fmt: skip
        if not isinstance(model, Llama | Gpt):
            raise TypeError(f"Decoder decodes a models.Llama or models.Gpt; got "
                            f"{type(model).__name__}")  # fmt: skip
        if getattr(model, "bos_id", None) is not None:
            raise ValueError(
                f"Decoder: the model packs documents (bos_id={model.bos_id}); decoding keeps one "
                f"document a row and does not restart positions at bos_id. Decode "
                f"dataclasses.replace(model, bos_id=None), one document a prompt."
            )
        if not 1 <= max_len <= model.context:
            raise ValueError(f"max_len={max_len} must be in [1, {model.context}] (the model's "
                             f"context: the GPT's learned positions end there, the Llama was "
                             f"trained up to it; build the model with a longer one)")  # fmt: skip
        self.model, self.mesh, self.max_len, self.precision = model, mesh, max_len, precision
        picked = strategy is None
        strategy = decoding_strategy(strategy, model, mesh)
        try:
            self.setup = build(strategy, mesh, model=_splittable(model, strategy),
                               optimizer=optax.identity(), precision=precision,
                               attention=attention)  # fmt: skip
            self.setup.check_batch_size(batch)
        except ValueError as e:
            if not (picked and strategy.ep is not None):
                raise
            raise ValueError(
                f"{e} (The Decoder picked strategy {strategy.name!r} because the mesh has an "
                f"{strategy.ep!r} axis and the model has experts: its experts split over it, "
                f"the rows over {strategy.batch_axes}. Pass strategy="
                f"{strategy.name.removesuffix('+ep')!r} to decode with every expert on each "
                f"device, the {strategy.ep!r} axis replicating the decoding)"
            ) from None
        self.attention = attention
        self.batch = batch
        strategy = self.setup.strategy
        self.tp, self.data = strategy.tp, strategy.batch_axes
        p = mesh.shape[self.tp]
        self.cache_heads = kv_cache_heads(model.num_heads, self.kv_heads, p)
        self.param_specs = self.setup.param_specs
        padding = self.setup.padding  # the forward's parameters, as the training step wraps them
        self._roles = leaf_roles(self.setup.plan, padding.logical)
        self._logical = padding.logical if padding.padded else None
        row = shardops.spec_entry(*self.data)
        # The cache: [L, B, p·n, S_max, hd] globally, device (i, j) holding rows i, heads j.
        self.cache_spec = P(None, row, self.tp, None, None)
        self.batch_spec = P(row)
        self._row = row
        self._programs: dict[tuple[int, float], object] = {}

    @property
    def kv_heads(self) -> int:
        """The model's KV heads (the GPT's attention has one per query head)."""
        return getattr(self.model, "num_kv_heads", self.model.num_heads)

    # --- placement

    def place(self, params):
        """Full (host) params of the model, as ``model.init`` or ``Setup.gather`` give them, laid
        out for decoding (padded where the model axis does not divide a dim)."""
        return self.setup.shard(params).params

    def init_cache(self) -> KVCache:
        """An empty cache for ``logits``: a ``KVCache`` of length 0 whose ``k`` and ``v`` are
        each ``[L, B, p·n, S_max, hd]`` zeros in the compute dtype (``L`` layers, ``p`` the
        size of ``model``, ``n = kv_cache_heads(H, KV, p)``, ``hd`` the head dim), device
        (i, j) holding the batch rows of its row index i (over the batch axes: ``data``, and
        ``expert`` under ep) and its n KV heads."""
        return KVCache(self._zeros(), self._zeros(), 0)

    @property
    def cache_shape(self) -> tuple[int, ...]:
        """The global shape ``(L, B, p·n, S_max, hd)`` of each of a cache's ``k`` and ``v``."""
        m = self.model
        return (m.num_layers, self.batch, self.mesh.shape[self.tp] * self.cache_heads,
                self.max_len, m.head_dim)  # fmt: skip

    @functools.cached_property
    def _zeros(self):
        """The jitted zeros of one cache array (compiled once per decoder, not per call)."""
        shape = self.cache_shape
        return jax.jit(lambda: jnp.zeros(shape, self.precision.compute_dtype),
                       out_shardings=NamedSharding(self.mesh, self.cache_spec))  # fmt: skip

    # --- the programs

    @functools.cached_property
    def _forward(self):
        """``(params, cache, ids[B, s], start) → (logits[B, s, V_pad], cache)``: s new tokens
        at positions ``start …``, the logits split over the vocabulary."""
        specs = (self.param_specs, (self.cache_spec,) * 2, self.batch_spec, P())
        out = (P(self._row, None, self.tp), (self.cache_spec,) * 2)
        return jax.shard_map(self._local_forward, mesh=self.mesh, in_specs=specs, out_specs=out)

    def _local_forward(self, params, cache, ids, start, *, last_only: bool = False):
        """The model's own ``apply`` on ``ids[b, s]`` at positions ``start …``, through a
        ``CachedParallel`` made for this trace: ``(logits[b, s or 1, V_pad/p], cache)``;
        ``last_only``: the head on the last position alone (what a draw reads)."""
        tree = wrap(params, self._roles, self.param_specs, self._logical)
        output = jax.tree.leaves(self.model.output_layer(tree), is_leaf=is_param)
        ctx = CachedParallel(self.setup.strategy, self.precision,
                             attention_implementation=self.attention, cache=tuple(cache),
                             start=start, output=frozenset(q.path for q in output),
                             last_only=last_only)  # fmt: skip
        # The GPT reads its learned positions itself (from start); the Llama's rotary ones
        # are the attention's, which the context starts at start.
        positions = {"start": start} if isinstance(self.model, Gpt) else {}
        logits, _ = self.setup.model.apply(ctx, tree, ids, **positions)  # [b, s or 1, V_pad/p]
        return logits, ctx.written()

    def _local_next(self, logits, key, temperature):
        """The next token ``[b]`` of each row from its last logits ``[b, V_pad/p]``: argmax, or
        with ``temperature`` > 0 the Gumbel-max draw (``_gumbel``)."""
        vocab = self.model.vocab_size
        logits = logits.astype(jnp.float32)
        if temperature > 0:
            b, v_local = logits.shape
            first_row = lax.axis_index(self.data) * b if self.data else 0
            rows = first_row + jnp.arange(b)  # [b]: global batch rows
            cols = lax.axis_index(self.tp) * v_local + jnp.arange(v_local)  # [V_pad/p]: token ids
            noise = _gumbel(key, rows, cols)  # g[b, V_pad/p]: this device's block only
            logits = logits / temperature + noise
        return vocab_parallel_argmax_kernel(logits, vocab_size=vocab, axis_name=self.tp)

    def logits(self, params, cache: KVCache, ids, start: int):
        """Teacher-forced decoding, one call at a time: the logits of ``ids`` fed at positions
        ``start … start+s−1`` against ``cache``, and the cache with their keys and values
        written (``generate`` runs a prefill and its steps in one program instead).

            cache = decoder.init_cache()                               # length 0
            logits, cache = decoder.logits(params, cache, prompt, 0)   # prefill: [B, S_p, V]
            step, cache = decoder.logits(params, cache, token, S_p)    # token[B, 1] → [B, 1, V]

        Arguments:
            params: the decoding layout's params (``place``, or a checkpoint loaded into
                ``setup``).
            cache: the ``KVCache`` of ``init_cache`` or of the previous call. It is donated:
                keep the one returned.
            ids: ``ids[B, s]`` integer tokens, host or placed, ``s ≥ 1``.
            start: a Python int, the position of ``ids[:, 0]``: ``cache.length`` continues
                the cache (0 prefills an empty one); less rewinds it (below).

        Returns:
            ``(logits[B, s, V], cache)``: float32 logits over the model's vocabulary (the
            padding cut off), laid out like the batch, and a ``KVCache`` of length
            ``start + s``.

        ``start`` past ``cache.length`` is refused: the slots between were never written and
        the attention would read their zeros as keys and values, finite logits of no
        sequence. Below it, rewinding is well defined, so it is allowed: the slots from
        ``start`` on are overwritten by ``ids`` or masked as later positions, so the logits
        are those of the cache's first ``start`` tokens followed by ``ids`` (tested), e.g.
        another continuation of the same prefix. ``start`` must be concrete (a traced one is
        a TypeError): it is compared with the cache's length before the step runs.
        """
        concrete = isinstance(start, int | np.integer | jax.Array) and not isinstance(
            start, bool | jax.core.Tracer)  # fmt: skip
        if not concrete:
            raise TypeError(
                f"Decoder.logits: start must be a concrete int (the position of ids[:, 0], "
                f"compared with the cache's length before the step runs); got "
                f"{type(start).__name__}. Call logits outside jit with start=cache.length, "
                f"or use generate for a whole decoding in one program"
            )
        start = int(start)
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"Decoder.logits: cache must be the KVCache of decoder.init_cache() or of the "
                f"previous logits call (it records the positions written); got "
                f"{type(cache).__name__}"
            )
        for name, c in (("k", cache.k), ("v", cache.v)):
            if tuple(c.shape) != self.cache_shape:
                raise ValueError(
                    f"Decoder.logits: cache.{name} has shape {tuple(c.shape)}; this decoder's "
                    f"is {self.cache_shape} [L, B, p·n, S_max, hd]: start from this decoder's "
                    f"init_cache()"
                )
        check_not_donated(
            "Decoder.logits", "logits donates the cache it is given: pass the cache the latest "
            "call returned (a smaller start rewinds it); to keep an old one, copy it before the "
            "call: KVCache(jnp.copy(cache.k), jnp.copy(cache.v), cache.length)",
            **{"cache.k": cache.k, "cache.v": cache.v},
        )  # fmt: skip
        check_not_donated("Decoder.logits", STATE_DONATED, params=params)
        ids = ids if isinstance(ids, jax.Array) else np.asarray(ids)
        self._check(ids, start, what="ids")
        if start > cache.length:
            unwritten = (f"position {cache.length} was" if start == cache.length + 1 else
                         f"positions {cache.length} … {start - 1} were")  # fmt: skip
            raise ValueError(
                f"Decoder.logits: start={start} is past the cache's next position "
                f"{cache.length} (cache.length): {unwritten} never written, and the attention "
                f"would read the empty slots. Feed the tokens of those positions first, or "
                f"pass start={cache.length} (or less, to rewind)"
            )
        self.setup.padding.check_stored(params, "Decoder.logits", "decoder.place(params)")
        _layer_order.check(params, self.setup.layer_order, "Decoder.logits: params", _PLACE)
        ids = jax.device_put(ids, NamedSharding(self.mesh, self.batch_spec))
        logits, (k, v) = self._logits(params, (cache.k, cache.v), ids, jnp.int32(start))
        return logits, KVCache(k, v, start + ids.shape[1])

    @functools.cached_property
    def _logits(self):
        vocab = self.model.vocab_size

        def run(params, cache, ids, start):
            logits, cache = self._forward(params, cache, ids, start)
            return logits[..., :vocab].astype(jnp.float32), cache

        return jax.jit(run, donate_argnums=1)

    def generate(self, params, prompt, steps: int, *, temperature: float = 0.0, key=None):
        """``tokens[B, steps]``: the continuation of ``prompt[B, S_p]`` (placed or host ints),
        greedy (``temperature`` = 0) or sampled at ``temperature`` with ``key`` (one key for the
        whole batch; step ``t`` uses ``fold_in(key, t)``). ``S_p + steps ≤ max_len``."""
        prompt = prompt if isinstance(prompt, jax.Array) else np.asarray(prompt)  # host or placed
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            raise ValueError(f"steps must be a positive int (tokens to generate); got {steps!r}")
        self._check(prompt, 0, steps, what="prompt")  # S_p + steps ≤ max_len
        self.setup.padding.check_stored(params, "Decoder.generate", "decoder.place(params)")
        _layer_order.check(params, self.setup.layer_order, "Decoder.generate: params", _PLACE)
        check_not_donated("Decoder.generate", STATE_DONATED, params=params, prompt=prompt)
        if temperature < 0:
            raise ValueError(f"temperature must be ≥ 0 (0: greedy); got {temperature}")
        if temperature > 0 and key is None:
            raise ValueError("sampling (temperature > 0) needs key=jax.random.key(...)")
        key = jax.random.key(0) if key is None else key
        prompt = jax.device_put(prompt, NamedSharding(self.mesh, self.batch_spec))
        return self.generate_program(steps, float(temperature))(params, prompt, key)

    def generate_program(self, steps: int, temperature: float = 0.0):
        """The jitted ``(params, prompt[B, S_p], key) → tokens[B, steps]`` program behind
        ``generate`` (placed arguments; for ``shardops.inspect``): the prefill and ``steps − 1``
        one-token steps in a ``lax.scan``, the cache created and kept inside it. Made once per
        ``(steps, temperature)`` and kept: a later ``generate`` of the same length and
        temperature runs it without tracing again."""
        cached = self._programs.get((steps, temperature))
        if cached is not None:
            return cached
        m = self.model
        local_batch = self.batch // self.setup.batch_multiple

        def local(params, prompt, key):
            shape = (m.num_layers, local_batch, self.cache_heads, self.max_len, m.head_dim)
            cache = (jnp.zeros(shape, self.precision.compute_dtype),) * 2
            cache = jax.tree.map(lambda c: lax.pcast(c, (*self.data, self.tp),
                                                     to="varying"), cache)  # fmt: skip
            logits, cache = self._local_forward(params, cache, prompt, jnp.int32(0),
                                                last_only=True)  # fmt: skip
            first = self._local_next(logits[:, -1], jax.random.fold_in(key, 0), temperature)

            def step(carry, t):
                cache, token = carry
                logits, cache = self._local_forward(params, cache, token[:, None],
                                                    prompt.shape[1] + t - 1)  # fmt: skip
                token = self._local_next(logits[:, -1], jax.random.fold_in(key, t), temperature)
                return (cache, token), token

            _, rest = lax.scan(step, (cache, first), jnp.arange(1, steps, dtype=jnp.int32))
            return jnp.concatenate([first[:, None], rest.T], axis=1)  # [b, steps]

        specs = (self.param_specs, self.batch_spec, P())
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=self.batch_spec)
        return self._programs.setdefault((steps, temperature), jax.jit(fn))

    def budget(self, prompt_len: int, steps: int, *, temperature: float = 0.0):
        """The ``shardops.inspect.Ledger`` of ``generate_program(steps, temperature)`` on a
        prompt of ``prompt_len`` tokens, from its trace (compiling nothing): the collectives the
        module docstring lists, per kind, mesh axes and bytes."""
        params = self.setup.padding.abstract(self.precision.param_dtype)
        params = jax.tree.map(
            lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                 sharding=NamedSharding(self.mesh, spec)),
            params, self.param_specs)  # fmt: skip
        prompt = jax.ShapeDtypeStruct((self.batch, prompt_len), jnp.int32,
                                      sharding=NamedSharding(self.mesh, self.batch_spec))  # fmt: skip
        return shardops.inspect.traced_ledger(self.mesh, self.generate_program(steps, temperature),
                                              params, prompt, jax.random.key(0))  # fmt: skip

    def _check(self, ids, start: int, steps_after: int = 0, *, what: str):
        """``ids[B, s]`` fits this decoder at positions ``start …``, and so do ``steps_after``
        tokens after them (``generate``'s contract: ``S_p + steps ≤ max_len``)."""
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"{what} must be integer tokens [batch, tokens]; got {ids.dtype}"
                f"{tuple(ids.shape)}. One sequence is one row: {what}[None] for a decoder of "
                f"batch=1, or np.repeat({what}[None], {self.batch}, axis=0) for this one's "
                f"{self.batch} rows"
            )
        if ids.shape[0] != self.batch:
            raise ValueError(f"{what} dim 0 (batch) = {ids.shape[0]}; this decoder was built "
                             f"for batch={self.batch}")  # fmt: skip
        if ids.shape[1] == 0:
            raise ValueError(
                f"{what} has no tokens: {what}{tuple(ids.shape)}; give each row at least one "
                f"(to generate from nothing, start every row with the model's first token, "
                f"e.g. a BOS id)"
            )
        if start < 0:
            raise ValueError(f"Decoder.logits: start={start} is negative: it is the position of "
                             f"{what}[:, 0], 0 for a prefill or cache.length to continue")  # fmt: skip
        last = start + ids.shape[1] - 1 + steps_after
        if not last < self.max_len:
            raise ValueError(f"positions {start} … {last} do not fit the cache of max_len="
                             f"{self.max_len}; build the Decoder with a longer max_len")  # fmt: skip
        self.model.check_batch(ids)  # token range, when concrete


def _gumbel(key, rows, cols):
    """``g[len(rows), len(cols)]``: standard Gumbel noise, entry ``(r, v)`` drawn from ``key``
    folded with the global row ``r`` and token id ``v``, so that it does not depend on which
    device draws it (the same draw on every mesh) and each device draws only its block."""

    def entry(r, v):
        return jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(key, r), v), (),
                                 jnp.float32)  # fmt: skip

    return jax.vmap(jax.vmap(entry, (None, 0)), (0, None))(rows, cols)


def decoding_strategy(strategy: Strategy | str | None, model, mesh) -> Strategy:
    """The layout a ``Decoder`` of ``model`` on ``mesh`` decodes in. ``None`` (the default):
    ``"2d"`` (tp over ``model``, the rows over ``data``; ``"tp"`` on a mesh without
    ``data``), with ``"+ep"`` where the model has experts and the mesh an ``expert`` axis
    (the experts split over it, the rows too). Given:
    a preset name or ``Strategy`` made of ``DECODING_KINDS`` alone, with a tp axis (``"tp"``,
    ``"2d"``, ``"tp+ep"``, ``"2d+ep"``); anything else is a ``ValueError`` naming why."""
    if strategy is None:
        experts = getattr(model, "experts", None) is not None
        strategy = STRATEGY if DATA_AXIS in mesh.axis_names else "tp"
        strategy += "+ep" if experts and EXPERT_AXIS in mesh.axis_names else ""
    s = strategy_named(strategy)
    other = [k.name for k in s.kinds if k.name not in (*DECODING_KINDS, "sp")]
    if other or s.sp or s.tp is None:
        why = (f"its {', '.join(other)} {'does' if len(other) == 1 else 'do'} not decode"
               if other else "sp splits the sequence, which a one-token step does not have"
               if s.sp else "it has no tp axis (the cache's heads and the vocabulary's split)")  # fmt: skip
        raise ValueError(
            f"Decoder: strategy {s.name!r} is not a decoding layout: {why}. Decode under a "
            f"layout of {DECODING_KINDS} with a tp axis: 'tp', '2d', 'tp+ep' or '2d+ep' (a "
            f"model axis of size 1 where you want no tensor parallelism); parameters trained "
            f"under another strategy decode from Setup.gather(state).params, through "
            f"decoder.place"
        )
    return s


def _splittable(model, strategy: Strategy):
    """``model`` as ``strategy`` can lay it out: under ep, its experts ``Experts.splittable``
    (dropless ones at ``E / k``, which drops nothing either). Decoding routes without drops
    whatever the capacity (``CachedParallel.moe``)."""
    experts = getattr(model, "experts", None)
    if strategy.ep is None or experts is None:
        return model
    return dataclasses.replace(model, experts=experts.splittable())
