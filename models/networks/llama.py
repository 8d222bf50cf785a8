"""A Llama-style decoder built only from shardops layers, for every strategy.

    ids[B, S] → embed: table[V, D][ids]                                       (unit "embed")
      → L × block (stacked [L, …], one lax.scan):                             (one unit a layer)
            x + attention(rms_norm(x))   RoPE, KV heads shared by query heads, causal
            x + down(silu(gate(h)) ⊙ up(h)),  h = rms_norm(x)                 (SwiGLU)
      → rms_norm → head w[D, V], or the embedding's table[V, D]ᵀ (tied)       (unit "head")
      → cross-entropy against the next tokens labels[B, S]

No biases, as in Llama. The blocks' parameters stack the layers along dim 0 (``[L, D, …]``)
and run with ``ctx.scan``: one compiled block whatever the depth, the layout pipeline
parallelism will cut. The plan is Megatron's: the table split by vocabulary, attention by heads
(K and V by KV head, or replicated where the tp axis does not divide the KV heads), gate and up
column-, down row-parallel, the head column-parallel (a tied head is the vocab-parallel table
itself), norms replicated. A vocabulary or d_ff the tp axis does not divide is padded and
masked (``models.training``).

Packed sequences: with ``bos_id`` set, each ``bos_id`` token starts a new document; attention
stays within a document and the rotary positions restart at 0 at each.

``reference_logits`` is the same model in plain ``jax.numpy`` (no shardops layer), written
independently: Hugging Face's ``repeat_kv`` grouping and rotate-half RoPE; its experts run every
expert on every token and keep the choices that fit the capacity (all of them when dropless).
Its capacity groups are the sequences, or with ``context_shards=N`` each sequence's tokens as
context parallelism over N devices holds them (``_capacity_groups``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardops.layers import MOE_LOAD_BALANCE, MOE_SCORES
from shardops_models.networks._lm import PAD_LABEL, LanguageModel
from shardops_models.strategies.plan import (
    COLUMN,
    EXPERTS,
    HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    Role,
    stacked,
)

DROPLESS_EXPERTS = Role(
    "experts",
    {"router": ("embed", None),
     "gate": (None, "embed", "mlp"), "up": (None, "embed", "mlp"),
     "down": (None, "mlp", "embed")},
)  # fmt: skip
"""The plan role of a dropless mixture of experts (``Experts(capacity_factor=None)``):
``EXPERTS`` with no dim named ``experts``, so every expert stays whole on each device (each
one's hidden units split by the ``mlp`` rule, over the tp axis). Its name is ``EXPERTS``'s, so a
checkpoint moves between the capacity and dropless layers; a strategy with ep refuses it when
it builds (``models.strategies.expert``)."""


def default_d_ff(d_model: int) -> int:
    """Llama's hidden size: ⅔ of 4·D (the gated MLP's three matrices cost what a 4·D MLP's
    two do), rounded up to a multiple of 16."""
    return 16 * math.ceil(8 * d_model / 3 / 16)


@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture of SwiGLU experts in place of each block's MLP (Mixtral): ``num_experts``
    experts of the model's ``d_ff``, each token routed to ``k`` (``shardops.layers.moe_kernel``:
    ``score``, top-k renormalised, ``capacity_factor`` slots per expert per capacity group, or
    ``None``: dropless, every choice computed by its expert), the load-balancing loss
    (``load_balance``: ``"global"`` or ``"group"``) and the router z-loss added to the training
    loss with their weights, each summed over the layers.

    Dropless (``capacity_factor=None``) computes what ``capacity_factor = E / k`` (``C = S``)
    does without the slots' padding (tokens sorted by expert, grouped matmuls). Its experts are
    whole on every device (the plan role ``DROPLESS_EXPERTS``): a strategy with expert
    parallelism (ep) refuses it; there ``E / k`` drops nothing either.

    A capacity group is a sequence; under context parallelism over N devices, each device's
    chunks of a sequence (S/N tokens: chunks i and 2N−1−i of 2N), so a capacity model's
    routing depends on N (Megatron's, whose capacity counts each device's tokens; dropless
    routing does not). The reference takes N as ``context_shards``."""

    num_experts: int = 8
    k: int = 2
    capacity_factor: float | None = 1.25  # the common training choice (Switch, GShard: 1–2)
    score: str = "softmax"
    load_balance: str = "global"
    load_balance_weight: float = 0.01
    z_loss_weight: float = 0.001

    def __post_init__(self):
        for name in ("num_experts", "k"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Experts: {name} must be a positive int; got {n!r}")
        if self.k > self.num_experts:
            raise ValueError(f"Experts: k={self.k} > num_experts={self.num_experts}: a token "
                             f"picks k distinct experts; use k ≤ num_experts")  # fmt: skip
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, int | float)
                               or not (cf > 0 and math.isfinite(cf))):  # fmt: skip
            raise ValueError(f"Experts: capacity_factor must be a finite number > 0 (slots per "
                             f"expert = ceil(capacity_factor · S · k / E)) or None (dropless); "
                             f"got {cf!r}. E / k drops nothing, and so does None")  # fmt: skip
        for name, allowed in (("score", MOE_SCORES), ("load_balance", MOE_LOAD_BALANCE)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Experts: {name} must be one of {allowed}; got "
                                 f"{getattr(self, name)!r}. Pass one of them")  # fmt: skip

    def splittable(self) -> Experts:
        """These experts as expert parallelism can split them: dropless ones
        (``capacity_factor=None``, whole on every device) at the capacity ``E / k``, which
        drops nothing either (``C = S``) and routes every token alike; others as they are."""
        if self.capacity_factor is not None:
            return self
        return dataclasses.replace(self, capacity_factor=self.num_experts / self.k)


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's special ids a model carries for the tools that run it (transformers'
    ``bos_token_id``, ``eos_token_id``, ``pad_token_id``; ``generate`` stops at ``eos``, which
    may be several ids). The forward never reads them: ``Llama.bos_id`` is what packs documents.
    ``interop.HfLlama`` and ``HfMixtral`` read them from ``config.json``, and
    ``save_hf_llama``/``save_hf_mixtral`` write them back with ``generation_config.json``."""

    bos: int | None = None
    eos: int | tuple[int, ...] | None = None
    pad: int | None = None

    def __post_init__(self):
        if isinstance(self.eos, list | tuple):
            object.__setattr__(self, "eos", tuple(self.eos))  # a config's list, hashable
        for name in ("bos", "eos", "pad"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else (value,)
            if value is not None and (not ids or any(
                    isinstance(i, bool) or not isinstance(i, int | np.integer) for i in ids)):  # fmt: skip
                raise ValueError(f"SpecialTokens: {name} must be a token id (an int) or None"
                                 f"{', or a list of ids' if name == 'eos' else ''}; got "
                                 f"{value!r}")  # fmt: skip
            if value is not None:  # numpy ints as Python's (config.json is written from them)
                object.__setattr__(self, name, tuple(map(int, ids)) if isinstance(value, tuple)
                                   else int(value))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Llama(LanguageModel):
    """A Llama decoder: ``num_layers`` blocks of width ``d_model``, ``num_heads`` query heads
    of ``d_model / num_heads`` sharing ``num_kv_heads`` key/value heads (grouped-query
    attention; 1: multi-query), a SwiGLU MLP of ``d_ff`` (default ``default_d_ff``), rotary
    positions of base ``rope_theta``, RMSNorm with ``norm_eps``, and an output head of its own
    or tied to the embedding (``tie_embeddings``). ``special_tokens``: the tokenizer's ids
    (``SpecialTokens``), carried for the tools that run the model, never read by it."""

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    d_ff: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # Llama 2 and 3's rms_norm_eps
    tie_embeddings: bool = False
    context: int = 128  # the longest sequence a batch may hold (RoPE has no table to outgrow)
    bos_id: int | None = None  # packed documents: each begins at this token
    init_scale: float = 0.02  # Hugging Face's initializer_range
    experts: Experts | None = None  # a mixture of experts in place of each block's MLP
    # bos, eos, pad ids, for transformers' tools: not the model's function (not compared, not
    # hashed; a checkpoint does not record them)
    special_tokens: SpecialTokens | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "context"):  # fmt: skip
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Llama: {name} must be a positive int; got {n!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"Llama: d_model={self.d_model} must divide by num_heads="
                             f"{self.num_heads} (head_dim = d_model / num_heads)")  # fmt: skip
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Llama: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                f"(each KV head serves num_heads / num_kv_heads query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(f"Llama: head_dim = {self.head_dim} must be even (RoPE rotates "
                             f"pairs of dims)")  # fmt: skip
        if self.bos_id is not None and not 0 <= self.bos_id < self.vocab_size:
            raise ValueError(f"Llama: bos_id={self.bos_id} is not a token of the vocabulary "
                             f"[0, {self.vocab_size})")  # fmt: skip
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model))
        if self.special_tokens is not None and not isinstance(self.special_tokens, SpecialTokens):
            raise TypeError(f"Llama: special_tokens must be a models.SpecialTokens or None; got "
                            f"{type(self.special_tokens).__name__}: pass "
                            f"SpecialTokens(bos=..., eos=..., pad=...)")  # fmt: skip

    @property
    def name(self) -> str:
        return (f"llama L={self.num_layers} D={self.d_model} H={self.num_heads}/"
                f"{self.num_kv_heads} F={self.d_ff} V={self.vocab_size}"
                f"{' tied' if self.tie_embeddings else ''} S≤{self.context}"
                f"{f' E={self.experts.num_experts} k={self.experts.k}' if self.experts else ''}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def init(self, key, dtype=None):
        """Full parameters, each matrix normal × ``init_scale`` (Hugging Face's init), norms
        ones; the blocks stacked ``[L, …]``. Drawn in float32, then cast to ``dtype``."""
        d, f, v, n = self.d_model, self.d_ff, self.vocab_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        normal = jax.nn.initializers.normal(self.init_scale)
        shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
                  "gate": (d, f), "up": (d, f), "down": (f, d)}  # fmt: skip
        k_embed, k_head, *keys = jax.random.split(key, 2 + len(shapes))
        w = {name: normal(k, (n, *shape)) for k, (name, shape) in zip(keys, shapes.items(),
                                                                        strict=True)}  # fmt: skip
        params = {
            "embed": {"table": normal(k_embed, (v, d))},  # table[V, D]
            "blocks": {
                "attn_norm": {"scale": jnp.ones((n, d))},
                "attn": {k: w[k] for k in ("wq", "wk", "wv", "wo")},
                "mlp_norm": {"scale": jnp.ones((n, d))},
                "mlp": {k: {"w": w[k]} for k in ("gate", "up", "down")},
            },
            "norm": {"scale": jnp.ones((d,))},
        }
        if self.experts is not None:  # router[L, D, E]; gate, up[L, E, D, F]; down[L, E, F, D]
            e, keys = self.experts.num_experts, jax.random.split(jax.random.fold_in(key, 1), 4)
            del params["blocks"]["mlp"]
            params["blocks"]["moe"] = {
                name: normal(k, (n, *shape)) for k, (name, shape) in zip(keys, {
                    "router": (d, e), "gate": (e, d, f), "up": (e, d, f), "down": (e, f, d),
                }.items(), strict=True)
            }  # fmt: skip
        if not self.tie_embeddings:
            params["head"] = {"w": normal(k_head, (d, v))}  # w[D, V]
        return params if dtype is None else jax.tree.map(lambda a: a.astype(dtype), params)

    def train_flops_per_token(self, seq: int) -> float:
        """Model FLOPs of one training step per token at sequence length ``seq``, as PaLM
        counts them (appendix B): 6 × the matmul parameters (the head included; the embedding
        lookup is not a matmul) + 12 · L · H · hd · S for attention's two products, causal
        masking not subtracted."""
        d, f, hd, n = self.d_model, self.d_ff, self.head_dim, self.num_layers
        block = d * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * d
        mlp = 3 * d * f  # with experts: k of them a token, and the router
        if self.experts is not None:
            mlp = self.experts.k * mlp + d * self.experts.num_experts
        matmul = n * (block + mlp) + d * self.vocab_size
        return 6 * matmul + 12 * n * self.num_heads * hd * seq

    def plan(self):
        """Megatron's roles (see the module docstring); the blocks stacked."""
        block = {"attn_norm": REPLICATED, "attn": HEAD, "mlp_norm": REPLICATED,
                 "mlp": {"gate": COLUMN, "up": COLUMN, "down": ROW}}  # fmt: skip
        if self.experts is not None:  # dropless: every expert whole on each device
            del block["mlp"]
            block["moe"] = EXPERTS if self.experts.capacity_factor is not None else DROPLESS_EXPERTS
        plan = {"embed": VOCAB, "blocks": stacked(block), "norm": REPLICATED}
        if not self.tie_embeddings:
            plan["head"] = COLUMN
        return plan

    # --- the forward, once for every strategy

    @property
    def aux_weights(self) -> dict[str, float]:
        """The weight of each auxiliary loss ``apply`` returns (the experts' two; none for
        a dense model)."""
        if self.experts is None:
            return {}
        return {"load_balance": self.experts.load_balance_weight,
                "z_loss": self.experts.z_loss_weight}  # fmt: skip

    def apply(self, ctx, params, ids):
        """Logits ``[b, S, V]`` (``[b, S, V_model]`` under a split head) of ``ids[b, S]``, and
        the auxiliary losses (``models.Model``): with experts, the load-balancing loss and
        the router z-loss, each summed over the layers; else none."""
        segment_ids = self.segment_ids(ids)  # [b, S] or None
        x = ctx.unit(self._embed(ctx), {"embed": params["embed"]}, ids)  # x[b, S(_model), D]
        block, aux = self._block(ctx, segment_ids), {}
        if self.experts is None:
            x = ctx.scan(block, params["blocks"], x)
        else:
            x, stats = ctx.scan(block, params["blocks"], x, outputs=True)  # each [L]
            aux = {name: jnp.sum(stats[name]) for name in ("load_balance", "z_loss")}
        head = {"norm": params["norm"], "out": self.output_layer(params)}
        return ctx.unit(self._head(ctx), head, x), aux  # logits[b, S, V(_model)]

    def segment_ids(self, ids):
        """``segment_ids[b, S]``: the document of each token (one per ``bos_id``), or None."""
        if self.bos_id is None:
            return None
        return jnp.cumsum(ids == self.bos_id, axis=1, dtype=jnp.int32)

    def _embed(self, ctx):
        def embed(p, ids):
            return ctx.embed(p["embed"], ids)  # x[b, S, D] (sp: x[b, S_model, D])

        return embed

    def _block(self, ctx, segment_ids):
        def block(p, x):
            h = ctx.rms_norm(p["attn_norm"], x, eps=self.norm_eps)
            x = x + ctx.attention(p["attn"], h, num_heads=self.num_heads,
                                  num_kv_heads=self.num_kv_heads, causal=True,
                                  rope_theta=self.rope_theta, segment_ids=segment_ids)  # fmt: skip
            h = ctx.rms_norm(p["mlp_norm"], x, eps=self.norm_eps)
            if self.experts is None:
                return x + ctx.gated_mlp(p["mlp"], h)  # x[b, S, D] (sp: x[b, S_model, D])
            e = self.experts
            y, stats = ctx.moe(p["moe"], h, k=e.k, capacity_factor=e.capacity_factor,
                               score=e.score, load_balance=e.load_balance)  # fmt: skip
            return x + y, {"load_balance": stats.load_balance, "z_loss": stats.z_loss}

        return block

    def _head(self, ctx):
        def head(p, x):
            x = ctx.rms_norm(p["norm"], x, eps=self.norm_eps)
            if self.tie_embeddings:
                return ctx.tied_head(p["out"], x)  # x · tableᵀ: logits[b, S, V(_model)]
            return ctx.dense(p["out"], x)

        return head

    def output_layer(self, params):
        """The layer whose output is the logits: the head, or the embedding when tied."""
        return params["embed"] if self.tie_embeddings else params["head"]

    # --- the independent reference

    def reference_logits(self, params, ids, *, context_shards: int = 1):
        """The model in plain ``jax.numpy`` (no shardops), float32: ``logits[B, S, V]``;
        ``context_shards``: the experts' capacity groups are each sequence's tokens as context
        parallelism over that many devices holds them (``Experts``)."""
        return self._reference(params, ids, context_shards=context_shards)[0]

    def reference_loss(self, params, ids, labels, *, context_shards: int = 1):
        """The next-token cross-entropy of the reference, plus each auxiliary loss (summed
        over the layers) times its weight (``context_shards``: ``reference_logits``'s)."""
        logits, aux = self._reference(params, ids, context_shards=context_shards)
        real = labels != PAD_LABEL
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(real, labels, 0))
        loss = jnp.sum(jnp.where(real, losses, 0.0)) / labels.size
        return loss + sum(self.aux_weights[name] * value for name, value in aux.items())

    def expert_stats(self, params, ids, *, context_shards: int = 1) -> dict:
        """What the experts did with ``ids[B, S]`` at ``params`` (whole arrays), from the
        plain-jnp reference: the auxiliary losses (summed over the layers), and per layer and
        expert the share of the choices it got (``share[L, E]``, before dropping) and the
        fraction of those dropped at capacity (``dropped[L, E]``; 0 for an expert no token
        chose, and everywhere when dropless); ``context_shards``: ``reference_logits``'s."""
        if self.experts is None:
            raise ValueError("Llama.expert_stats: the model has no experts (experts=None)")
        _, aux, counts = self._reference(params, ids, counts=True, context_shards=context_shards)
        chosen, kept = (jnp.stack([c[i] for c in counts]) for i in (0, 1))  # each [L, E]
        share = chosen / jnp.sum(chosen, -1, keepdims=True)
        return {**aux, "share": share, "dropped": (chosen - kept) / jnp.maximum(chosen, 1)}

    def _reference(self, params, ids, counts: bool = False, context_shards: int = 1):
        """``(logits[B, S, V], aux)`` in plain ``jax.numpy``, float32; with ``counts``, also
        each layer's ``(chosen[E], kept[E])`` choices."""
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        b, s = ids.shape
        groups = _capacity_groups(s, context_shards)  # [S]: each position's capacity group
        hd, group = self.head_dim, self.num_heads // self.num_kv_heads
        causal = np.tril(np.ones((s, s), bool))[None, None]  # (1, 1, S, S)
        if self.bos_id is None:
            mask, positions = causal, jnp.broadcast_to(jnp.arange(s), (b, s))
        else:
            doc = jnp.cumsum(ids == self.bos_id, axis=1)  # (B, S): the document of each token
            same = doc[:, :, None] == doc[:, None, :]  # (B, S, S)
            mask = causal & same[:, None]
            positions = jnp.arange(s) - jnp.argmax(same, axis=2)  # from the document's first
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, hd, 2) / hd))  # (hd/2,)
        angles = positions[..., None] * inv_freq.astype(np.float32)  # (B, S, hd/2)
        cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None]  # (B, S, 1, hd)
        sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None]

        def rope(t):  # (B, S, heads, hd): Hugging Face's apply_rotary_pos_emb
            rotated = jnp.concatenate([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
            return t * cos + rotated * sin

        def rms(x, scale):
            return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + self.norm_eps) * scale

        x, aux, per_layer = params["embed"]["table"][ids], {}, []
        blocks = params["blocks"]
        for i in range(self.num_layers):
            p = jax.tree.map(lambda a, i=i: a[i], blocks)
            h = rms(x, p["attn_norm"]["scale"])
            q = rope((h @ p["attn"]["wq"]).reshape(b, s, self.num_heads, hd))
            k = rope((h @ p["attn"]["wk"]).reshape(b, s, self.num_kv_heads, hd))
            v = (h @ p["attn"]["wv"]).reshape(b, s, self.num_kv_heads, hd)
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # repeat_kv
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
            o = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, -1)
            x = x + o @ p["attn"]["wo"]
            h = rms(x, p["mlp_norm"]["scale"])
            if self.experts is not None:
                y, layer_aux, layer_counts = _reference_experts(self.experts, p["moe"], h, groups)
                x, aux = x + y, {n: aux.get(n, 0.0) + v for n, v in layer_aux.items()}
                per_layer.append(layer_counts)
                continue
            mlp = p["mlp"]
            x = x + (jax.nn.silu(h @ mlp["gate"]["w"]) * (h @ mlp["up"]["w"])) @ mlp["down"]["w"]
        x = rms(x, params["norm"]["scale"])
        logits = x @ (params["embed"]["table"].T if self.tie_embeddings else params["head"]["w"])
        return (logits, aux, per_layer) if counts else (logits, aux)


def _capacity_groups(s: int, n: int) -> np.ndarray:
    """``group[S]``: the capacity group of each position of a sequence of ``s`` tokens whose
    layers run under context parallelism over ``n`` devices: the sequence cut into 2n chunks of
    s/(2n), chunk c on device min(c, 2n−1−c) (the load-balanced layout: device i holds chunks i
    and 2n−1−i, causal attention's work even). ``n = 1``: the whole sequence, group 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"Llama reference: context_shards={n!r}; expected the devices of the "
                         f"context axis, a positive int. Pass 1 (no context parallelism) or "
                         f"the context axis' size")  # fmt: skip
    if n == 1:
        return np.zeros(s, np.int32)
    if s % (2 * n):
        raise ValueError(
            f"Llama reference: context_shards={n} cuts each sequence into 2 × {n} = {2 * n} "
            f"equal chunks, but S = {s} does not divide by {2 * n}; use sequences of a multiple "
            f"of {2 * n} tokens (as cp over {n} devices needs)"
        )
    chunk = np.arange(s) // (s // (2 * n))  # [S]: 0 … 2n−1
    return np.minimum(chunk, 2 * n - 1 - chunk).astype(np.int32)


def _reference_experts(experts: Experts, p, h, groups):
    """The mixture of experts in plain ``jax.numpy`` (float32) on ``h[B, S, D]``, the positions
    of each row in capacity groups ``groups[S]`` (``_capacity_groups``; one group: the row):
    ``(y[B, S, D], {"load_balance", "z_loss"}, (chosen[E], kept[E]))``. Every expert runs on
    every token (no dispatch); a token's output is the sum over its kept choices of weight ×
    expert: those that fit the capacity of their group, or every one (``capacity_factor=None``)."""
    b, s, _ = h.shape
    e, k = experts.num_experts, experts.k
    n = int(groups.max()) + 1  # capacity groups per sequence, each of s / n tokens
    member = jax.nn.one_hot(groups, n)  # [S, N]: 1 where position s lies in group j
    logits = h @ p["router"]  # [B, S, E]
    probs = jax.nn.softmax(logits, -1) if experts.score == "softmax" else jax.nn.sigmoid(logits)
    top, chosen = jax.lax.top_k(probs, k)  # [B, S, k]
    weights = top / jnp.sum(top, -1, keepdims=True)  # renormalised over the k
    choice = jax.nn.one_hot(chosen, e)  # [B, S, k, E]
    if experts.capacity_factor is None:  # dropless: every choice kept
        kept = choice
    else:
        capacity = math.ceil(experts.capacity_factor * (s // n) * k / e)
        grouped = choice[..., None] * member[:, None, None, :]  # [B, S, k, E, N]
        by_rank = jnp.swapaxes(grouped, 1, 2).reshape(b, k * s, e, n)  # 1st choices first
        line = jnp.swapaxes((jnp.cumsum(by_rank, 1) - 1).reshape(b, k, s, e, n), 1, 2)
        slot = jnp.sum(line * member[:, None, None, :], -1)  # [B, S, k, E]: place in its group
        kept = choice * (slot < capacity)
    hidden = jax.nn.silu(jnp.einsum("bsd,edf->bsef", h, p["gate"])) * jnp.einsum(
        "bsd,edf->bsef", h, p["up"])  # fmt: skip
    every = jnp.einsum("bsef,efd->bsed", hidden, p["down"])  # [B, S, E, D]: every expert
    y = jnp.einsum("bske,bsk,bsed->bsd", kept, weights, every)
    if experts.load_balance == "global":  # the whole batch's fractions
        f, mean_p = jnp.sum(choice, (0, 1, 2)) / (b * s * k), jnp.mean(probs, (0, 1))
        load_balance = e * jnp.sum(f * mean_p)
    else:  # each group's, averaged
        f = jnp.einsum("bske,sn->bne", choice, member) / (s // n * k)  # [B, N, E]
        mean_p = jnp.einsum("bse,sn->bne", probs, member) / (s // n)  # [B, N, E]
        load_balance = jnp.mean(e * jnp.sum(f * mean_p, -1))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    counts = (jnp.sum(choice, (0, 1, 2)), jnp.sum(kept, (0, 1, 2)))  # choices per expert
    return y, {"load_balance": load_balance, "z_loss": z_loss}, counts
