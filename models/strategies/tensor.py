"""Tensor parallelism (Megatron): each layer's weights split over one mesh axis by its plan role,
and with ``sequence`` the activations between layers split along S over the same axis (sp).

    column   x[b, S, D] · w[D, F_model] → y[b, S, F_model]      no communication forward
    row      y[b, S, F_model] · w[F_model, D] → z{U_model}      AllReduce (sp: ReduceScatter
                                                                along S; a column layer's
                                                                input AllGathered along S)

Layout: every leaf's split from its plan role (``models.strategies.plan``), a dim the axis does
not divide padded up to a multiple of it (the layers mask the padding); each device holds whole
attention heads. The kernels each role runs are ``shardops.layers``' (``Parallel.dense`` and the
other ``ctx`` layers pick them by role).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

import shardops
from shardops import entry_axes
from shardops_models.networks import contract
from shardops_models.strategies.kind import Kind, LayoutContext, is_spec, role_layout
from shardops_models.strategies.plan import HEAD, is_shape, logical_rules

_WHOLE_LOGITS = shardops.comm.Reason("whole_logits", forward={
    "all_gather": "a caller outside the mesh asks for all the logits, whose vocabulary is split "
                  "over {axis}",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TensorKind(Kind):
    """Tensor parallelism over one axis; ``sequence``: sequence parallelism on it too."""

    sequence: bool = False

    splits_layers: ClassVar[bool] = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return "sp" if self.sequence else "tp"

    def description(self) -> str:
        if self.sequence:
            return "tp, with activations split along the sequence between layers"
        return "each layer's weights split by its plan role (Megatron tensor parallelism)"

    @property
    def axis(self) -> str:
        return self.axes[0]

    def logical_rules(self) -> dict[str, str]:
        """The dims the plan roles split over the axis (``plan.logical_rules``: vocab, mlp,
        heads, kv_heads)."""
        return {dim: axis for dim, axis in logical_rules(self.axis).items() if axis is not None}

    def splits_heads(self, roles) -> bool:
        """Whether the plan gives any leaf the head role (its attention split over the axis)."""
        return HEAD in jax.tree.leaves(roles)

    def layout(self, specs, stored, context: LayoutContext):
        """The split by role is the core's (``specs``, through the strategy's rules); a dim
        this axis splits and does not divide is stored padded up to a multiple of it."""
        p = context.mesh.shape[self.axis]
        stored = jax.tree.map(
            lambda spec, shape: tuple(
                shardops.padded_size(n, p) if self.axis in entry_axes(e) else n
                for n, e in zip(shape, shardops.spec_entries(spec, len(shape)), strict=True)
            ),
            specs, stored, is_leaf=is_spec,
        )  # fmt: skip
        return specs, stored

    def gather_logits(self, logits, *, model, params, ctx):
        """``logits[b, ..., V_model]`` from a column (or vocab) output layer → the whole
        vocabulary, the padded columns dropped: AllGather over the axis. The model's
        ``output_layer`` says which layer made them; logits that vary over the axis without one
        are refused."""
        head = contract.declared(model).output_layer
        if head is None and self.axis in shardops.varying_axes(logits):
            raise ValueError(
                f"setup.logits: {type(model).__name__}'s logits{tuple(logits.shape)} (per "
                f"device) vary over the tp axis {self.axis!r}, and the model has no "
                f"output_layer(params) saying which layer makes them: define it (return the "
                f"head's parameter dict, as models.Gpt does) so that logits split over the "
                f"vocabulary are gathered"
            )
        if head is None or not ctx.is_split(head(params)):
            return logits
        logits = shardops.comm.all_gather(logits, self.axis, axis=logits.ndim - 1,
                                          to="invarying", reason=_WHOLE_LOGITS)  # fmt: skip
        return logits[..., : _output_features(head(params))]  # the padding's columns dropped

    def check_model(self, strategy, declared, model_name: str) -> None:
        if self.sequence and not declared.sequence:
            raise ValueError(
                f"strategy {strategy.name!r} splits activations along the sequence; "
                f"{model_name} has no sequence dimension. Use the same strategy with tp "
                f"instead of sp."
            )

    def check_mesh(self, strategy, mesh, context: LayoutContext) -> None:
        """Each device holds whole heads: the head counts, and every dim a head role splits,
        divide by the axis (a vocabulary or a width it does not divide is padded instead)."""
        axis, p = self.axis, mesh.shape[self.axis]
        heads, kv_heads = context.declared.num_heads, context.declared.kv_heads
        if heads is not None and self.splits_heads(context.roles):
            shardops.layers.check_head_counts("build", heads, kv_heads, axis, p)
        specs = role_layout(context)  # the split build makes: each leaf by its role's dims
        for (path, shape), spec, role in zip(
            jax.tree_util.tree_leaves_with_path(context.shapes, is_leaf=is_shape),
            jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(context.roles), strict=True,
        ):  # fmt: skip
            for dim, entry in enumerate(spec):
                if entry_axes(entry) and shape[dim] % p and role == HEAD:
                    raise ValueError(
                        f"params{jax.tree_util.keystr(path)} dim {dim} (heads × head_dim) = "
                        f"{shape[dim]} is not divisible by mesh axis {axis!r} (size {p}); the "
                        f"plan makes it head, and each device holds whole heads. Choose "
                        f"num_heads a multiple of {p}, a smaller {axis!r} axis, or role "
                        f"'replicated'"
                    )

    def check_batch(self, strategy, mesh, x) -> None:
        if self.sequence and not strategy.cp:  # (under cp the context kind checks S)
            shardops.check_divisible(
                argument="x", dim=1, dim_name="sequence", size=x.shape[1], mesh=mesh,
                axes=(self.axis,),
            )  # fmt: skip


def _output_features(head) -> int | None:
    """The model's own number of output features of the output layer (a dense ``w[D, V]`` or
    a tied ``table[V, D]``), or None where it is not padded."""
    leaf = head["table"] if "table" in head else head["w"]
    if leaf.logical is None:
        return None
    return leaf.logical[0] if "table" in head else leaf.logical[-1]
