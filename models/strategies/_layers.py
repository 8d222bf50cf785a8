"""The layers a model's forward calls on the layer context (``ctx.dense``, ``ctx.embed``,
``ctx.attention``, ``ctx.gated_mlp``, the norms, ``ctx.tied_head``, the loss): ``Layers``, a
base of ``models.strategies.parallel.Parallel``.

Each layer checks its parameter keys and plan roles, then asks the strategy's kinds for its
kernel (``Kind.dense``, …; the innermost kind first, tensor before context before the batch
kinds): the first answer runs, and where no kind answers the local kernel does
(``shardops.dense``, ``shardops.attention``, …). No layer reads which kinds the strategy has.
Each output is tapped for the divergence locator (``shardops.inspect.tap``, the identity
outside it) under the name of its parameters' path, with the layout the strategy gives it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import shardops
from shardops import SEQUENCE_DIM, spec_entry, varying_axes
from shardops_models.strategies._param import Param, is_param
from shardops_models.strategies.plan import COLUMN, HEAD, REPLICATED, ROW, VOCAB
from shardops_models.strategies.remat import ATTENTION_OUTPUT, MLP_INPUT, MLP_OUTPUT


class Layers:
    """The ``ctx`` layers (module docstring). A base of ``Parallel``, whose ``strategy``,
    ``precision``, ``attention_implementation``, parameter values (``_arrays``, ``_value``)
    and axes (``axis_name``) they use."""

    def _layer_kernel(self, hook: str, *args, **options):
        """The first answer of the kinds' layer hook ``hook`` (``Kind.dense``, …), asked from
        the innermost kind (tensor) out, or None where none runs the layer."""
        for kind in reversed(self.strategy.kinds):
            y = getattr(kind, hook)(self, *args, **options)
            if y is not None:
                return y
        return None

    def _dense(self, p, x, whole_sequence: bool = False):
        """``x[..., D] · w + b``: by the kind that runs ``p["w"]``'s role (tp's column and
        row kernels), else local. A weight a kind left split (``pending``: fsdp's route) is
        that kind's first."""
        role = p["w"].role
        if role not in (COLUMN, ROW, REPLICATED):
            raise ValueError(f"{p['w'].path}: a dense layer takes role column, row or "
                             f"replicated; the plan says {role!r}")  # fmt: skip
        if getattr(p["w"], "pending", None) is not None:  # a weight left split (fsdp's route)
            y = self._splitter.pending_dense(self, p, x)
            if y is not None:
                return y
        whole = {"whole_sequence": True} if whole_sequence else {}  # kinds without sp omit it
        y = self._layer_kernel("dense", p, x, **whole)
        if y is not None:
            return y
        w, b = self._arrays(p, "w", "dense"), self._optional(p, "b")
        return shardops.dense(x, w, b, precision=self.precision)

    def _embed(self, p, ids):
        """``table[ids]``: by the kind that runs the table's role (tp's vocab-parallel lookup),
        else local. ``ids`` hold the whole sequence; each device looks up its own tokens
        (``local_tokens``)."""
        table, role = self._arrays(p, "table", "embed"), p["table"].role
        if role not in (VOCAB, REPLICATED):
            raise ValueError(f"{p['table'].path}: an embedding takes role vocab or replicated; "
                             f"the plan says {role!r}")  # fmt: skip
        ids = self.local_tokens(ids)  # ids[b, S_context] under cp
        x = self._layer_kernel("embed", p, ids)
        if x is not None:
            return x
        return jnp.take(table, ids, axis=0).astype(self.precision.compute_dtype)  # x[B, S, D]

    def _attention(self, p, x, **options):
        """Self-attention: by the kind that runs it (tp's head-parallel kernel, cp's by its
        method), each kind having made the options its own (``Kind.attention_options``: cp's
        positions), else local."""
        params = {k: self._arrays(p, k, "attention") for k in p}
        roles = {q.role for q in p.values()}
        if roles - {HEAD, REPLICATED} or len(roles) > 1:
            raise ValueError(f"attention parameters take one role, head or replicated; the plan "
                             f"says {sorted(roles)}")  # fmt: skip
        for kind in self.strategy.kinds:
            options = kind.attention_options(self, options)
        options["implementation"] = self.attention_implementation
        y = self._layer_kernel("attention", p, x, options)
        if y is not None:
            return y
        return shardops.attention(x, params, precision=self.precision, **options)

    def _layer_norm(self, p, x, eps):
        return shardops.layer_norm(
            x, self._optional(p, "scale"), self._optional(p, "bias"), eps=eps
        )  # same layout as x; under sp dscale, dbias are AllReduced over model (check_vma)

    def _rms_norm(self, p, x, eps):
        return shardops.rms_norm(x, self._optional(p, "scale"), eps=eps)

    def dense(self, p, x, *, whole_sequence: bool = False):
        """``x[..., D] · w + b`` by the role of ``p["w"]``: column-parallel, row-parallel or
        local. Under sp, ``x[B, S_model, D]`` is gathered along S by a column layer and a row
        layer's output is reduce-scattered back along S; ``whole_sequence``: a column layer's
        ``x[B, S, D]`` is the whole sequence already (``gather_sequence``), not gathered
        again. Keys: ``w``, optionally ``b``."""
        _check_keys(p, "dense", LAYER_KEYS["dense"])
        k = x.shape[-1] * self._split_size(p["w"], 0)  # D: a row layer's x holds D/p of it
        return self._tap(
            self._dense(p, x, whole_sequence),
            p,
            k=k,
            features_split=self.is_split(p),
            features=_logical(p["w"], 1) if self.is_split(p) else None,
        )

    def embed(self, p, ids):
        """``table[ids]``: vocab-parallel under tp (the AllReduce, or under sp the
        ReduceScatter along S, of the rows each device holds), else a local lookup. Keys:
        ``table``."""
        _check_keys(p, "embed", LAYER_KEYS["embed"])
        return self._tap(self._embed(p, ids), p, k=1)

    def attention(self, p, x, *, num_heads: int, num_kv_heads: int | None = None,
                  causal: bool = True, rope_theta: float | None = None, positions=None,
                  segment_ids=None):  # fmt: skip
        """Self-attention of ``x[b, S, D]`` (sp: ``x[b, S_model, D]``): head-parallel under tp
        (sp: x gathered along S once), else local. ``num_kv_heads`` < ``num_heads`` is
        grouped-query attention; ``rope_theta`` rotary positions at ``positions[b, S]`` (each
        token's global position; default ``0 … S−1``, restarting at each document of
        ``segment_ids[b, S]``, which keep attention within a document). ``positions`` and
        ``segment_ids`` cover the whole sequence, also under sp and cp (under cp, ``x`` is
        this device's block ``x[b, S_context, D]`` and attention runs by the layout's
        ``cp_method``, ``shardops.layers.context_parallel_attention_kernel``). Keys: ``wq``,
        ``wk``, ``wv``, ``wo``, optionally ``bq``, ``bk``, ``bv``, ``bo`` (``shardops.init_attention``)."""
        _check_keys(p, "attention", LAYER_KEYS["attention"])
        y = self._attention(p, x, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
                            rope_theta=rope_theta, positions=positions,
                            segment_ids=segment_ids)  # fmt: skip
        y = checkpoint_name(y, ATTENTION_OUTPUT)  # what remat=("attention_output",) saves
        model = self.axis_name("model")  # x[b, S_model, D] varies over it under sp
        seq = x.shape[SEQUENCE_DIM] * (lax.axis_size(model) if model in varying_axes(x) else 1)
        return self._tap(y, p, k=max(x.shape[-1], seq))  # K: D (projections), S (p · v)

    def gated_mlp(self, p, x, *, activation: Callable = jax.nn.silu):
        """``down(activation(gate(x)) ⊙ up(x))`` of ``x[b, S, D]`` (SwiGLU by default): under
        tp gate and up column-parallel and down row-parallel, ``x`` entering the region once
        for both (``shardops.layers.tensor_parallel_gated_mlp_kernel``), else local. Keys:
        ``gate``, ``up``, ``down``, each a dense layer's ``w`` and optional ``b``
        (``shardops.init_gated_mlp``)."""
        _check_keys(p, "gated_mlp", LAYER_KEYS["gated_mlp"])
        for name in ("gate", "up", "down"):
            _check_keys(p[name], "gated_mlp", LAYER_KEYS["dense"])
        x = checkpoint_name(x, MLP_INPUT)  # names for remat (the hidden's: shardops'; ``remat``)
        y = self._layer_kernel("gated_mlp", p, x, activation)
        if y is None:
            params = {k: {n: self._value(q, "gated_mlp") for n, q in p[k].items()} for k in p}
            y = shardops.gated_mlp(x, params, activation=activation, precision=self.precision)
        y = checkpoint_name(y, MLP_OUTPUT)
        return self._tap(y, p, k=p["down"]["w"].shape[0] * self._split_size(p["down"]["w"], 0))

    def moe(self, p, x, *, k: int, capacity_factor: float | None, score: str = "softmax",
            load_balance: str = "global", activation: Callable = jax.nn.silu):  # fmt: skip
        """A mixture of SwiGLU experts on ``x[b, S, D]`` (``capacity_factor=None``: dropless,
        the experts unsplit): ``(y[b, S, D], stats)``, ``stats`` a ``shardops.layers.MoeStats``
        (the load-balancing and router z losses, each expert's tokens and drops). Each
        sequence is one capacity group; under context parallelism over N devices each
        device's share of a sequence (``x[b, S/N, D]``: chunks i and 2N−1−i of 2N) is one
        group. Each kind adds its part of the kernel's options (``Kind.moe_options``: ep's
        expert axis, tp's model axis, cp's context axis); under ``load_balance="global"`` the
        counts are summed over the batch axes (and the context axis). Keys: ``router``,
        ``gate``, ``up``, ``down`` (``shardops.layers.init_moe``; the plan role ``EXPERTS``)."""
        _check_keys(p, "moe", LAYER_KEYS["moe"])
        _check_load_balance(load_balance, self.microbatches)
        params = {key: self._value(q, "moe") for key, q in p.items()}
        options = {"k": k, "capacity_factor": capacity_factor, "score": score,
                   "load_balance": load_balance, "batch_axes": self.strategy.batch_axes}  # fmt: skip
        for kind in self.strategy.kinds:
            options = kind.moe_options(self, p, options)
        x = checkpoint_name(x, MLP_INPUT)
        y, stats = shardops.layers.moe_kernel(x, params, activation=activation,
                                              precision=self.precision, **options)  # fmt: skip
        y = checkpoint_name(y, MLP_OUTPUT)
        return self._tap(y, p, k=p["down"].shape[1] * self._split_size(p["down"], 1)), stats

    def layer_norm(self, p, x, *, eps: float = 1e-5):
        """``shardops.layer_norm`` of ``x[..., D]``. Keys, both optional: ``scale``, ``bias``."""
        _check_keys(p, "layer_norm", LAYER_KEYS["layer_norm"])
        return self._tap(self._layer_norm(p, x, eps), p, k=x.shape[-1])

    def rms_norm(self, p, x, *, eps: float = 1e-6):
        """``shardops.rms_norm`` of ``x[..., D]``. Keys, optional: ``scale``."""
        _check_keys(p, "rms_norm", LAYER_KEYS["rms_norm"])
        return self._tap(self._rms_norm(p, x, eps), p, k=x.shape[-1])

    def _tap(self, y, p, *, k: int, features_split: bool = False, features: int | None = None,
             suffix: str = ""):  # fmt: skip
        """``shardops.inspect.tap`` of a layer's output, named by its parameters' path, with the layout
        of the strategy: the batch over its batch axes, and over the tp axis the features (a
        column layer) or the sequence (between layers under sp) when ``y`` varies over it."""
        paths = [q.path for q in jax.tree.leaves(p, is_leaf=is_param) if is_param(q)]
        if not paths:  # a layer without parameters (a norm with no scale): no name to tap by
            return y
        name = _layer_path(paths) + suffix
        if shardops.inspect.tapping():
            for kind in self.strategy.kinds:
                kind.check_locate(self.strategy)
        spec, model = None, self.axis_name("model")
        if self.strategy.axes:
            varying = varying_axes(y)
            entries: list = [None] * y.ndim
            batch = [a for a in self.strategy.batch_axes if a in varying]
            if batch:
                entries[0] = spec_entry(*batch)
            if model in varying:
                entries[-1 if features_split else SEQUENCE_DIM] = model
            spec = P(*entries)
        shape = None if features is None else (*(None,) * (y.ndim - 1), features)
        return shardops.inspect.tap(y, name, spec=spec, k=k, shape=shape)  # padding cut off

    def is_split(self, p) -> bool:
        """Whether ``dense(p, ·)``'s (or ``tied_head(p, ·)``'s) output is split along its
        features: a column layer (a vocab table) under tp (``Kind.splits_output``)."""
        return any(kind.splits_output(p) for kind in self.strategy.kinds)

    def gather_sequence(self, x):
        """Under sp, ``x[b, S_model, ...]`` (a norm's output, between layers) gathered along S
        over the tp axis into the whole sequence, once for the several column layers that read
        it (``dense(..., whole_sequence=True)``: q, k and v; gate and up). Megatron's "g" once
        per sublayer; the backward ReduceScatters their summed ``dx``. Else ``x``. The gathered
        value is in ``x``'s dtype, so the column layers' ``dx`` are summed in it before the
        ReduceScatter (in ``accum_dtype``): under a bfloat16 policy, one rounding more than
        each layer gathering its own ``x``."""
        y = self._layer_kernel("gather_sequence", x)
        return x if y is None else y

    def tied_head(self, p, x, *, whole_sequence: bool = False):
        """Logits ``x[b, S, D] · table[V, D]ᵀ`` of the embedding's own table (tied input and
        output embeddings): under tp vocab-parallel, ``logits[b, S, V_model]`` never gathered,
        ``x`` entering the region as a column layer's input (sp: gathered along S), so
        ``dx`` is AllReduced (sp: ReduceScattered) over the tp axis; else a local product.
        The table's gradient is the sum of both uses (autodiff adds them; under FSDP each use
        gathers it and ReduceScatters its part). ``whole_sequence`` as ``dense``'s. Keys:
        ``table``."""
        _check_keys(p, "tied_head", LAYER_KEYS["embed"])
        table, role = self._arrays(p, "table", "tied_head"), p["table"].role
        if role not in (VOCAB, REPLICATED):
            raise ValueError(f"{p['table'].path}: a tied head takes role vocab or replicated; "
                             f"the plan says {role!r}")  # fmt: skip
        w = table.T  # w[D, V(_model)]: the table's rows as output columns
        whole = {"whole_sequence": True} if whole_sequence else {}
        y = self._layer_kernel("tied_head", p, w, x, **whole)
        if y is None:
            y = shardops.dense(x, w, precision=self.precision)
        return self._tap(
            y,
            p,
            k=x.shape[-1],
            features_split=self.is_split(p),
            features=_logical(p["table"], 0) if self.is_split(p) else None,
            suffix=" (tied head)",  # the embedding's own tap has the plain name
        )

    def cross_entropy(self, logits, labels, *, split: bool, vocab_size: int | None = None):
        """Per-position loss ``[...]`` in float32 of integer ``labels``; ``split``: the logits
        are ``logits[..., V_model]`` (a column head) and the loss is vocab-parallel.
        ``vocab_size``: the logical V when the logits hold padded columns (masked out)."""
        _check_logits_cover_labels(logits, labels,
                                   any(k.sequence_axes for k in self.strategy.kinds))  # fmt: skip
        if split:
            return self._split_loss("cross_entropy", logits, labels, vocab_size)
        logits = logits.astype(jnp.float32)  # [..., V] in f32
        return optax.softmax_cross_entropy_with_integer_labels(logits[..., :vocab_size], labels)

    def argmax(self, logits, *, split: bool, vocab_size: int | None = None):
        """The arg-max over the vocabulary (int32), padded columns (from ``vocab_size`` on)
        excluded."""
        if split:
            return self._split_loss("argmax", logits, vocab_size)
        return jnp.argmax(logits[..., :vocab_size], axis=-1).astype(jnp.int32)

    def _split_loss(self, hook: str, logits, *args):
        """``hook`` (``cross_entropy``, ``argmax``) of logits split along the vocabulary, by
        the kind that split them."""
        y = self._layer_kernel(hook, logits, *args)
        if y is None:
            raise ValueError(
                f"ctx.{hook}(split=True): no kind of strategy {self.strategy.name!r} splits the "
                f"vocabulary; pass split=ctx.is_split(head_params), which says whether it is"
            )
        return y


LAYER_KEYS = {
    "dense": (("w",), ("b",)),
    "embed": (("table",), ()),
    "attention": (("wq", "wk", "wv", "wo"), ("bq", "bk", "bv", "bo")),
    "layer_norm": ((), ("scale", "bias")),
    "rms_norm": ((), ("scale",)),
    "gated_mlp": (("gate", "up", "down"), ()),
    "moe": (("router", "gate", "up", "down"), ()),
}
"""Each ``ctx`` layer's parameter keys: (required, optional)."""


_HINTS = {
    "weight": "Hugging Face's norm 'weight' is 'scale' here; its Linear 'weight[out, in]' is "
              "'w[in, out]' (transposed)",
    "kernel": "Flax's 'kernel' is 'w' here, 'bias' is 'b'",
    "embedding": "Flax's 'embedding' is 'table' here",
}  # fmt: skip


def _check_keys(p, layer: str, keys) -> None:
    """Refuse a parameter dict that lacks a key ``layer`` needs or holds one it does not use,
    naming the layer, the parameters' path, the keys expected and the keys given."""
    required, optional = keys
    if not isinstance(p, dict):
        raise TypeError(f"ctx.{layer} takes a dict of parameters (keys {list(required + optional)}); "
                        f"got {type(p).__name__}")  # fmt: skip
    missing = [k for k in required if k not in p]
    unknown = sorted(set(p) - set(required) - set(optional), key=str)
    if not (missing or unknown):
        return
    leaf = next((q for q in jax.tree.leaves(p, is_leaf=is_param) if is_param(q)), None)
    where = f" at {leaf.path[: leaf.path.rfind('[')] or 'the top'}" if leaf is not None else ""
    what = [f"missing {missing}"] if missing else []
    what += [f"unknown {unknown}"] if unknown else []
    hints = [_HINTS[k] for k in unknown if k in _HINTS]
    expected = f"{list(required)}" + (f", optionally {list(optional)}" if optional else "")
    raise ValueError(
        f"ctx.{layer}{where}: expects parameter keys {expected}; got {sorted(p, key=str)} "
        f"({', '.join(what)})." + (f" {'; '.join(hints)}." if hints else "")
    )


def _logical(p: Param, dim: int) -> int | None:
    """The model's own size of ``p``'s dim ``dim`` (None where nothing is padded)."""
    return None if p.logical is None else p.logical[dim]


def _layer_path(paths) -> str:
    """The path of the layer whose parameters have ``paths`` (``"['blocks'][0]['up']"`` for
    ``…['up']['w']`` and ``…['up']['b']``): their common prefix, to a whole key."""
    if len(paths) == 1:
        return paths[0][: paths[0].rfind("[")]
    n = 0
    while all(len(q) > n and q[n] == paths[0][n] for q in paths):
        n += 1
    prefix = paths[0][:n]
    return prefix[: prefix.rfind("]") + 1]


def _check_logits_cover_labels(logits, labels, sequence_split: bool) -> None:
    """``sequence_split``: a kind splits the activations along S between layers (sp)."""
    if logits.shape[:-1] != labels.shape:
        hint = (
            " Under sequence parallelism the output layer gathers the sequence only as a "
            "column-parallel layer: give it the plan's role 'column'."
            if sequence_split
            else ""
        )
        raise ValueError(
            f"cross_entropy: logits{tuple(logits.shape)} do not cover labels"
            f"{tuple(labels.shape)} (the logits' leading dims must equal the labels' shape).{hint}"
        )


def _check_load_balance(load_balance: str, microbatches: int) -> None:
    """``load_balance="global"`` only on the whole batch: the load-balancing loss
    ``E · Σ_e f_e · P_e`` is a product of two batch means, and the mean of the microbatches'
    products is not the product of their means (nor can 1F1B know every microbatch's counts
    before the first backward), so the objective would depend on which rows share a microbatch
    and equal no unsplit run's."""
    if load_balance == "global" and microbatches > 1:
        raise ValueError(
            f"ctx.moe: load_balance='global' with microbatches={microbatches}: the global load "
            f"balance E · Σ_e f_e · P_e multiplies two means over the whole batch, and a step "
            f"split into microbatches (a pipeline's, or gradient accumulation) sees one part at a "
            f"time, so its objective would depend on which rows share a microbatch and match no "
            f"unsplit run. Use Experts(load_balance='group') (GShard's per-sequence form: the "
            f"microbatches' losses average to the whole batch's exactly), or microbatches=1"
        )
