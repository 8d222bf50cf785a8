"""The Flax layers ``FlaxModel`` swaps for shardops' kernels (``flax_nnx``'s table): the
object that takes a layer's place in the module during a forward (``Swapped``) and, under sp,
how a layer's input lies along the sequence (``SequenceSplit``)."""

from __future__ import annotations

import dataclasses

from flax import nnx

from shardops import MODEL_AXIS
from shardops_models.interop._flax_dense import Geometry, einsum, linear_general
from shardops_models.interop._foreign import Refusing
from shardops_models.strategies.plan import COLUMN, REPLICATED, ROW

LINEAR, GENERAL, EMBED, NORM, EXPERTS = "linear", "general", "embed", "norm", "experts"
SWAPPED = {nnx.Linear: LINEAR, nnx.LinearGeneral: GENERAL, nnx.Einsum: GENERAL, nnx.Embed: EMBED,
           nnx.RMSNorm: NORM, nnx.LayerNorm: NORM}  # fmt: skip
"""The Flax layers shardops runs with its kernels, by what each becomes."""


def geometry(layer, where: str) -> Geometry:
    if isinstance(layer, nnx.Einsum):
        geometry = einsum(layer, where)
        out = tuple(layer.kernel.shape[geometry.n_in :])
        if layer.bias is not None and tuple(layer.bias.shape) != out:
            raise ValueError(f"{where}: nnx.Einsum's bias {tuple(layer.bias.shape)} is not its "
                             f"output features {out}; shardops adds a bias over those only")  # fmt: skip
        return geometry
    return linear_general(layer, where)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Under sp, how a layer's input lies along S: the whole sequence (``seq`` tokens: inside a
    sublayer, after a norm or a column layer) or this device's block of it (``seq / parts``:
    between the layers, the residual stream)."""

    seq: int
    parts: int
    blocks: list = dataclasses.field(default_factory=list)
    """The sublayers' outputs so far (a row layer's: this device's block), and norms of them:
    a norm of one (Gemma's norm after a sublayer, before the residual add) keeps it a block."""

    @classmethod
    def of(cls, ctx, ids):
        """The split of a forward on ``ids[B, S]`` (whole), or None without sp (or with a tp
        axis of 1, which splits nothing)."""
        if not any(k.sequence_axes for k in ctx.strategy.kinds):
            return None
        parts = ctx.axis_size(MODEL_AXIS)
        if parts == 1:
            return None
        if ids.shape[1] // parts < 2:
            raise ValueError(
                f"FlaxModel under sequence parallelism over {MODEL_AXIS!r} (size {parts}): each "
                f"device's block of the {ids.shape[1]} tokens holds one, which the module's own "
                f"code would broadcast against the whole sequence without an error; use at "
                f"least 2 tokens a device"
            )
        return cls(ids.shape[1], parts)

    def is_block(self, y) -> bool:
        return any(y is b for b in self.blocks)

    def whole(self, x, where: str) -> bool | None:
        """Whether ``x[B, S?, ...]`` holds the whole sequence (else this device's block); None
        for an input without a sequence dim."""
        if x.ndim < 3:
            return None
        if x.shape[1] in (self.seq, self.seq // self.parts):
            return x.shape[1] == self.seq
        raise ValueError(
            f"{where}: x{tuple(x.shape)} under sequence parallelism: its dim 1 is neither the "
            f"whole sequence ({self.seq} tokens, inside a sublayer) nor this device's block of "
            f"it ({self.seq // self.parts}, between layers); the module's code between its "
            f"layers keeps the sequence dim where it is"
        )


class Swapped(Refusing):
    """A Flax layer's place in the module, run by the layer context ``ctx`` on the layer's
    ``Param``s (``p``: its dict, Flax's keys). A plain object: the module it sits in is only
    called, never split or transformed by Flax.

    Under sp (``split``) a norm's output is gathered along S once (``ctx.gather_sequence``),
    so the sublayer's own code sees the whole sequence (its reshapes and masks read
    ``x.shape``), and the column layers reading it do not gather it again; a row layer's
    output is reduced back to this device's block of the sequence, as are the embedding's."""

    def __init__(self, ctx, kind: str, p, layer, where: str, split: SequenceSplit | None,
                 unit: bool = True):  # fmt: skip
        self.ctx, self.kind, self.p, self.where, self.output = ctx, kind, p, where, None
        self.unit = unit  # each call a ctx.unit (else inside one: a stacked block's layer)
        self.split = split
        self.geometry = geometry(layer, where) if kind == GENERAL else None
        self.eps = getattr(layer, "epsilon", None)
        self.layer_norm = isinstance(layer, nnx.LayerNorm)

    def __call__(self, x, *args, **kwargs):
        given = [f"{k}={v!r}" for k, v in [*enumerate(args), *kwargs.items()] if v is not None]
        if given:  # out_sharding, an Einsum's own equation, a norm's mask …
            raise ValueError(f"{self.where}: called with {', '.join(given)}; under FlaxModel a "
                             f"layer takes its input alone (its layout is the strategy's)")  # fmt: skip
        ctx, p = self.ctx, as_shardops(self.kind, self.p)
        whole = None  # under sp: whether x holds the whole sequence (else this device's block)
        if self.split is not None and self.kind != EMBED:
            whole = self.split.whole(x, self.where)
        if self.kind in (LINEAR, GENERAL):
            gathered = self._dense_input(whole)
            if self.kind == LINEAR:
                y = self._run(lambda q, x: ctx.dense(q, x, whole_sequence=gathered), p, x)
            else:
                y = self._run(lambda q, x: self.geometry.run(ctx, q, x, gathered), p, x)
            if whole and self.p["kernel"].role == ROW:  # a sublayer's output: a block again
                self.split.blocks.append(y)
        elif self.kind == EMBED:
            y = self._run(lambda q, ids: ctx.embed(q, ids), p, x)
        else:
            norm = ctx.layer_norm if self.layer_norm else ctx.rms_norm
            y = self._run(lambda q, x: norm(q, x, eps=self.eps), p, x)
            # sp: a sublayer's input, gathered once for its column layers; a norm of a
            # sublayer's output (Gemma's, before the residual add) stays a block
            if whole is False and self.split.is_block(x):
                self.split.blocks.append(y)
            elif whole is False:
                y = ctx.gather_sequence(y)
        self.output = y
        return y

    def _run(self, fn, p, x):
        """``fn(p, x)`` as a unit of its own (``ctx.unit``), or inside the stacked block's."""
        return self.ctx.unit(fn, p, x) if self.unit else fn(p, x)

    def _dense_input(self, whole: bool | None) -> bool:
        """Under sp, whether a dense layer's input is the whole sequence (``ctx.dense``'s
        ``whole_sequence``), checked against its role: a row layer reads the whole sequence
        (a column layer's output), a replicated one this device's block."""
        if whole is None:
            return False
        role = self.p["kernel"].role
        if role == ROW and not whole:
            raise ValueError(
                f"{self.where}: row-parallel under sequence parallelism, but its input is this "
                f"device's block of the sequence; a row layer reads the output of column layers "
                f"(the whole sequence, split by features), whose input is a norm's output, "
                f"gathered: a pre-norm block, x + f(norm(x)) (a post-norm one, norm(x + f(x)), "
                f"trains under tp)"
            )
        if role == REPLICATED and whole:
            raise ValueError(
                f"{self.where}: replicated (no logical dim of its kernel maps to {MODEL_AXIS!r}) "
                f"but under sequence parallelism its input is the whole sequence (a norm's "
                f"gathered output or a column layer's); its output would not match the residual "
                f"stream's block. Split it (column: its out dim to {MODEL_AXIS!r}), or train "
                f"under tp"
            )
        return whole and role == COLUMN

    # A swapped layer's parameters and options are the strategy's: reading them from the module's
    # code (``self.embed.embedding``) is refused, naming the layer (``Refusing``).
    OWN = ("ctx", "kind", "p", "unit")
    REFUSAL = (
        "{where}.{name}: the module's code reads an attribute of a layer FlaxModel runs with "
        "shardops' kernel, whose parameters are laid out by the strategy; call the layer instead "
        "(a tied head: {where}.attend(x))"
    )

    def attend(self, query):
        """``nnx.Embed.attend``: the logits of a tied head, ``query · embeddingᵀ``."""
        ctx = self.ctx
        whole = self.split is not None and self.split.whole(query, self.where) is True
        self.output = self._run(lambda q, x: ctx.tied_head(q, x, whole_sequence=whole),
                               as_shardops(EMBED, self.p), query)  # fmt: skip
        return self.output


def as_shardops(kind: str, p: dict) -> dict:
    """A layer's parameters under the keys of its ``ctx`` layer (Flax's ``kernel`` is ``w``,
    ``bias`` ``b``, ``embedding`` ``table``; a norm's ``scale`` and ``bias`` are the same)."""
    renames = {LINEAR: {"kernel": "w", "bias": "b"}, EMBED: {"embedding": "table"}}.get(kind, {})
    return {renames.get(k, k): v for k, v in p.items()}


def at(module, path):
    for key in path:
        module = module[key] if isinstance(key, int) else getattr(module, key)
    return module


def set_at(module, path, value) -> None:
    parent, key = at(module, path[:-1]), path[-1]
    if isinstance(key, int):
        parent[key] = value
    else:
        setattr(parent, key, value)
