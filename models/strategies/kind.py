"""A kind of parallelism: one way of using mesh axes, as one object the core asks.

A ``Strategy`` (``models.strategies.layout``) is a tuple of kinds, each over its mesh axes.
``build``, the step and ``ctx.unit`` do not branch on which kinds there are; they ask each:

    what it splits             ``splits_batch`` (the batch's dim 0 over its axes),
                               ``splits_sequence`` (every activation's S: ``local_tokens``),
                               ``splits_parameters`` (``materialise``: its part of ``ctx.unit``),
                               ``sequence_axes`` (S between layers, inside its kernels: sp)
    its gradients              ``sums_gradients``: a parameter replicated over its axes meets
                               different tokens on each device, so ``ctx.unit`` enters it
                               varying over them and autodiff sums its gradient (an AllReduce);
                               ``update``: the kind that owns the step's update (zero1)
    the parameters' layout     ``logical_rules()``: rows of the one table that maps the plan
                               roles' logical dims (``mlp``, ``heads``, ``vocab``, …) to mesh
                               axes, by which ``build`` splits every leaf; then
                               ``layout(specs, stored, context)`` → ``(specs, stored)``, the
                               kinds with ``splits_layers`` first (tp pads), the others on what
                               is left (fsdp)
    the optimizer's layout     ``optimizer_layout(specs, stored, context)`` (zero1)
    the stored order           ``stored_order(specs, context)``: dim 0 of a leaf stored
                               permuted (pp's circular chunks, one block per stage)
    the kernel a role runs     ``dense``, ``embed``, ``attention`` (after every kind's
                               ``attention_options``), ``gated_mlp``, ``tied_head``,
                               ``cross_entropy``, ``argmax``: the layer context asks the kinds,
                               innermost first, and runs the local kernel where none answers;
                               ``moe_options``: each kind's options of the experts' kernel;
                               ``splits_output``: a layer's output split along its features
    the stacked layers         ``scan``: where it runs ``ctx.scan`` (pp: the stages in turn)
    the step                   ``value_and_grad``: where it runs the forward and backward
                               itself (pp: by its schedule)
    for a caller outside       ``gather_logits``: the whole of what it split of the logits
    its checks                 ``check_model``, ``check_mesh``, ``check_batch``: each names the
                               strategy, the kind, both sizes and the fix; ``check_locate``
    its row in tables          ``name``, ``description()``

A new kind is a subclass in a file of its own (the built-in ones: ``data.py``, ``fsdp.py``,
``zero1.py``, ``tensor.py``, ``context.py``, ``expert.py``, ``pipe.py``); a strategy takes kinds defined outside the library
through ``Strategy(extra=(MyKind("axis"),))`` (``docs/adding-a-kind.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
from jax.sharding import PartitionSpec as P

from shardops import entry_axes
from shardops_models.strategies.plan import is_shape, logical_rules, model_specs, replicated


def axes_of(value, kind: str) -> tuple[str, ...]:
    """``value`` (a mesh axis name, a sequence of them, or None) as a tuple of names; a
    TypeError naming ``kind`` otherwise."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(a, str) and a for a in value):
        raise TypeError(
            f"Strategy: {kind} takes a mesh axis name or a tuple of them; got {value!r}"
        )
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class LayoutContext:
    """What a kind's ``layout`` may read: the mesh, the plan's leaf ``roles``, the model's own
    (logical) ``shapes``, what it ``declared`` (``models.networks.contract.Declared``), the
    strategy's ``rules`` (logical dim name → mesh axis, ``Strategy.logical_rules``) and
    ``build``'s ``microbatches``."""

    mesh: Any
    roles: Any
    shapes: Any
    declared: Any
    rules: dict = dataclasses.field(default_factory=dict)
    microbatches: int = 1


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of parallelism over mesh ``axes`` (see the module docstring); the base class
    does nothing, and each hook's default leaves everything as it was.

    Arguments:
        axes: the mesh axes it uses (a name or a tuple of names).
    """

    axes: tuple[str, ...]

    name: ClassVar[str] = "kind"
    """The kind's key in ``Strategy.rules`` and tables (``dp``, ``fsdp``, …)."""
    doc: ClassVar[str] = ""
    """One line for the strategy's table: what it splits, what it communicates."""
    splits_batch: ClassVar[bool] = False
    """Whether it splits the batch's dim 0 over its axes."""
    splits_sequence: ClassVar[bool] = False
    """Whether it splits every activation's tokens over its axes (``local_tokens``: cp)."""
    sums_gradients: ClassVar[bool] = False
    """Whether a parameter replicated over its axes has its gradient summed over them."""
    splits_layers: ClassVar[bool] = False
    """Whether it splits the layers' weights by plan role (tp): laid out first, and its axis is
    ``ctx.axis_name("model")``."""
    regathers: ClassVar[bool] = False
    """Whether ``ctx.unit`` gathers a weight again for its second use in a forward (fsdp: a
    tied table), behind an optimization barrier the train step's compiler must keep."""
    splits_parameters: ClassVar[bool] = False
    """Whether it splits parameters over its axes (fsdp): ``ctx.unit`` then leaves their
    leaves to its ``materialise``."""
    sequence_axes: ClassVar[tuple[str, ...]] = ()
    """The axes over which it splits every activation along S between layers, inside the
    layers' own kernels (sp); the kind that splits the tokens (cp) checks that they divide
    each of its chunks."""

    def __post_init__(self):
        object.__setattr__(self, "axes", axes_of(self.axes, self.name))
        if not self.axes:
            raise ValueError(f"{type(self).__name__}: give it at least one mesh axis")

    def description(self) -> str:
        return self.doc

    # --- layout

    def logical_rules(self) -> dict[str, str]:
        """Logical dim name → mesh axis, the rows this kind adds to the strategy's rules."""
        return {}

    def layout(self, specs, stored, context: LayoutContext):
        """``(specs, stored)``: the parameters' PartitionSpecs and stored shapes after this
        kind's split (``stored`` grows where a split pads a dim)."""
        return specs, stored

    def optimizer_layout(self, specs, stored, context: LayoutContext):
        """The PartitionSpecs of the optimizer state's parameter-shaped leaves."""
        return specs

    def stored_order(self, specs, context: LayoutContext) -> dict[str, tuple[int, ...]]:
        """The leaves stored in another order along dim 0 than the model's (pp's circular
        chunks), ``{keystr(path): order}``: stored row r holds the model's row ``order[r]``."""
        return {}

    # --- the layer context

    def materialise(self, ctx, leaves, used, ready) -> None:
        """This kind's part of ``ctx.unit``: make ready (``ready[i]``, in place) the leaves of
        the unit (``Param``) it splits; ``used``: per leaf, how many earlier units of this
        forward used it. The leaves no kind splits are ready already."""

    def local_tokens(self, tokens):
        """This device's tokens of ``tokens[b, S, ...]`` (the whole sequence) where the kind
        splits the sequence (``ctx.local_tokens``); ``tokens`` otherwise."""
        return tokens

    # --- the layers: the kernel each plan role runs. The layer context asks the kinds from the
    # innermost (tensor) to the outermost (data); the first answer that is not None runs, and
    # where none answers, the local kernel (``shardops.dense``, …). The layer has checked the
    # plan role (one the layer takes) and made its parameters ready (``ctx.unit``) already.

    def dense(self, ctx, p, x, whole_sequence: bool = False):
        """``x[..., D] · w + b`` of the dense layer ``p`` (``Param`` leaves ``w``, optional
        ``b``) where this kind runs it, else None. ``whole_sequence`` (passed only when true):
        under a kind splitting the activations along S, ``x`` is the whole sequence already
        (``ctx.gather_sequence``)."""
        return None

    def gather_sequence(self, ctx, x):
        """``x`` split along S between layers by this kind (sp), gathered whole
        (``ctx.gather_sequence``), else None."""
        return None

    def embed(self, ctx, p, ids):
        """``table[ids]`` (``ids``: this device's tokens) where this kind runs the lookup, else
        None."""
        return None

    def attention_options(self, ctx, options: dict) -> dict:
        """``ctx.attention``'s keyword options as this kind's kernels take them (the context
        kind: this device's positions and segment ids, and its ``context``). Every kind is
        asked, outermost first, before any kind's ``attention``."""
        return options

    def attention(self, ctx, p, x, options: dict):
        """Self-attention of ``x`` with the parameters ``p`` where this kind runs it, else
        None; ``options``: what ``attention_options`` made of ``ctx.attention``'s keywords."""
        return None

    def moe_options(self, ctx, p, options: dict) -> dict:
        """``ctx.moe``'s options for ``shardops.layers.moe_kernel`` with this kind's part
        (ep: ``expert_axis``; tp: ``model_axis``, each where the layer's experts are split over
        it); a kind that cannot run a mixture of experts refuses here. Every kind is asked,
        outermost first."""
        return options

    def gated_mlp(self, ctx, p, x, activation):
        """``down(activation(gate(x)) ⊙ up(x))`` where this kind runs it, else None."""
        return None

    def tied_head(self, ctx, p, w, x, whole_sequence: bool = False):
        """``x · w`` with ``w = table.T`` (``p``: the embedding's parameters) where this kind
        runs the tied head, else None; ``whole_sequence`` as ``dense``'s."""
        return None

    def splits_output(self, p) -> bool:
        """Whether the output of ``ctx.dense(p, ·)`` (or ``ctx.tied_head(p, ·)``) is split
        along its features over this kind's axes (``ctx.is_split``)."""
        return False

    def cross_entropy(self, ctx, logits, labels, vocab_size):
        """The per-position loss of ``logits`` this kind split along the vocabulary (the
        ``split`` of ``ctx.cross_entropy``), else None."""
        return None

    def argmax(self, ctx, logits, vocab_size):
        """The arg-max of ``logits`` this kind split along the vocabulary, else None."""
        return None

    def scan(self, ctx, fn, params, x, outputs: bool):
        """``ctx.scan(fn, params, x, outputs=outputs)`` where this kind runs the stacked
        layers (pp: through its stages), else None; ``ctx.scan_layers`` runs this device's."""
        return None

    def check_locate(self, strategy) -> None:
        """Refuse the divergence locator (``shardops.inspect.compare``), which compares every
        layer's output with the reference's, where this kind lays activations out in an order
        the reference's cannot be compared with."""

    # --- the step

    def update(self, opt_param_specs, precision):
        """Where this kind owns the step's update (ZeRO-1: the gradients are reduced by the
        update, not by autodiff), the object that runs it, else None. It has ``varying(params)``
        (the parameters as the loss takes them), ``whole(partial, params)`` (the gradients
        ``loss_and_grads`` returns) and ``update(optimizer, params, opt_state, partial)`` →
        ``(params, opt_state)`` (``models.strategies.zero1.Zero1``)."""
        return None

    def value_and_grad(self, body, params, x, y):
        """Where this kind runs the step's forward and backward itself (pp: by its schedule),
        ``(loss, grads)``: this device's share of the loss and the gradients of ``params``
        (``body``: the step, ``models.training._step._Body``; ``x, y``: this device's batch);
        else None (autodiff of ``body.local_loss``)."""
        return None

    def gather_logits(self, logits, *, model, params, ctx):
        """This device's ``logits`` → the whole of what this kind splits of them, for a caller
        outside the mesh (``setup.logits``); ``params``: the model's wrapped parameters, ``ctx``
        the layer context that made the logits."""
        return logits

    # --- checks, each before anything traces

    def check_model(self, strategy, declared, model_name: str) -> None:
        """Refuse a model this kind cannot split (``declared``: what the model declares)."""

    def check_mesh(self, strategy, mesh, context: LayoutContext) -> None:
        """Refuse a mesh (its axes present already) on which this kind cannot split the model."""

    def check_batch(self, strategy, mesh, x) -> None:
        """Refuse a batch ``x`` this kind cannot split (the batch axes' split is checked
        already)."""


def split_dim(spec, axes) -> int | None:
    """The dim of a leaf split over any of ``axes`` (by its PartitionSpec), or None."""
    return next((d for d, e in enumerate(spec) if set(axes) & set(entry_axes(e))), None)


def is_spec(s) -> bool:
    return isinstance(s, P)


def role_layout(context: LayoutContext):
    """Every leaf's split by its plan role's logical dims, through the strategy's one rules table
    (each kind's rows: tp's ``mlp``, ``heads``, … → its axis; a kind of your own's); replicated
    where no rule maps a dim. The axis the ``heads`` rule names is the one whose devices must
    hold whole heads (``plan.model_specs``)."""
    if not any(axis is not None for axis in context.rules.values()):
        return jax.tree.map(replicated, context.shapes, is_leaf=is_shape)
    heads = context.rules.get("heads")
    size = context.mesh.shape[heads] if isinstance(heads, str) else 1
    rules = {**logical_rules(heads if isinstance(heads, str) else None), **context.rules}
    return model_specs(context.roles, context.shapes, heads, size, context.declared.num_heads,
                       rules=rules)  # fmt: skip
