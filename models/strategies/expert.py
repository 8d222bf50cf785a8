"""Expert parallelism (GShard): the experts of every mixture-of-experts layer split over one mesh
axis, the tokens sent to their experts' devices and back by all-to-all.

    the batch      split over the axis (as dp's: each device routes its own tokens)
    experts        gate, up[E_expert, D, F], down[E_expert, F, D]: by the plan role
                   ``experts`` (the rules row ``experts`` → the axis)
    other params   replicated over the axis, gradients AllReduced (as dp's)
    ctx.moe        dispatch ``[E, G·C, D]`` AllToAll → ``[E_expert, N·G·C, D]``, the local
                   experts, AllToAll back (``shardops.layers.moe_kernel(expert_axis=...)``);
                   an expert's gradients stay on its device (never summed over the axis)

On the data axis it is GShard's and DeepSpeed-MoE's layout (``Strategy("ep", ep="data")``: data
parallelism whose experts are split); on an axis of its own beside dp
(``with_experts("2d")``: ``data × expert × model``) it adds devices for experts. Tensor
parallelism splits each expert's hidden units over its axis (the rules row ``mlp``).

A dropless mixture of experts (``capacity_factor=None``) is refused when the setup builds:
each expert would get a ragged number of tokens from each device, which needs a ragged
AllToAll (``lax.ragged_all_to_all``, not implemented on XLA:CPU, where shardops is tested).
Such a layer's plan role names no ``experts`` dim
(``shardops_models.networks.llama.DROPLESS_EXPERTS``); a layer split by ``EXPERTS`` but called
dropless is refused by ``ctx.moe`` when it traces.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from shardops import entry_axes
from shardops_models.strategies.kind import Kind, LayoutContext, is_spec, role_layout
from shardops_models.strategies.plan import is_shape


@dataclasses.dataclass(frozen=True)
class ExpertKind(Kind):
    """Expert parallelism over one axis (module docstring)."""

    name: ClassVar[str] = "ep"
    doc: ClassVar[str] = ("the batch split; each mixture-of-experts layer's experts split, "
                          "tokens sent to them by AllToAll; other gradients summed")  # fmt: skip
    splits_batch: ClassVar[bool] = True
    sums_gradients: ClassVar[bool] = True

    @property
    def axis(self) -> str:
        return self.axes[0]

    def logical_rules(self) -> dict[str, str]:
        return {"experts": self.axis}

    def splits(self, p) -> bool:
        """Whether the mixture-of-experts layer ``p`` (``ctx.moe``'s parameters) has its
        experts split over this kind's axis."""
        return any(self.axis in entry_axes(e) for e in p["gate"].spec)

    def moe_options(self, ctx, p, options: dict) -> dict:
        """The experts' axis, where the layer's experts are split over it (not dropless)."""
        if self.splits(p):
            if options.get("capacity_factor", 0) is None:
                raise ValueError(
                    f"ctx.moe: capacity_factor=None (dropless) under strategy "
                    f"{ctx.strategy.name!r}, whose ep splits this layer's experts over "
                    f"{self.axis!r}: {_DROPLESS_REASON}. {_dropless_fix(ctx.strategy.name)}"
                )
            return {**options, "expert_axis": self.axis}
        return options

    def check_mesh(self, strategy, mesh, context: LayoutContext) -> None:
        """The model has experts, none dropless, and their number divides by the axis."""
        whole = _whole_experts(context)
        if whole:
            raise ValueError(
                f"strategy {strategy.name!r} splits experts over {self.axis!r} (ep), and the "
                f"model's mixture of experts is dropless: params{whole[0]}'s plan role "
                f"'experts' names no 'experts' dim (every expert whole on each device: "
                f"Experts(capacity_factor=None)). {_DROPLESS_REASON[0].upper()}"
                f"{_DROPLESS_REASON[1:]}. {_dropless_fix(strategy.name)}"
            )
        n, found = mesh.shape[self.axis], False
        specs = role_layout(context)
        for (path, shape), spec in zip(
            jax.tree_util.tree_leaves_with_path(context.shapes, is_leaf=is_shape),
            jax.tree.leaves(specs, is_leaf=is_spec), strict=True,
        ):  # fmt: skip
            for dim, entry in enumerate(spec):
                if self.axis not in entry_axes(entry):
                    continue
                found = True
                if shape[dim] % n:
                    raise ValueError(
                        f"params{jax.tree_util.keystr(path)}: {shape[dim]} experts do not split "
                        f"over mesh axis {self.axis!r} (size {n}) of strategy {strategy.name!r} "
                        f"(expert parallelism holds whole experts on each device). Use a "
                        f"number of experts {n} divides, or a smaller {self.axis!r} axis"
                    )
        if not found:
            raise ValueError(
                f"strategy {strategy.name!r} splits experts over {self.axis!r} (ep), and the "
                f"model's plan gives no parameter the role 'experts' (a mixture-of-experts "
                f"layer, models.strategies.plan.EXPERTS). Use the strategy without ep (dp on "
                f"that axis is the same for a dense model)"
            )


_DROPLESS_REASON = (
    "dropless routing sends each expert a ragged number of tokens from each device, which "
    "needs a ragged AllToAll (lax.ragged_all_to_all, not implemented on XLA:CPU)"
)


def _dropless_fix(strategy: str) -> str:
    """How to build a model ``strategy`` (with ep) can split."""
    return (f"A Hugging Face Mixtral's model for this strategy is interop.HfMixtral(path).model("
            f"strategy={strategy!r}), at the capacity E / k. A model of your own: use "
            f"Experts(capacity_factor=E / k) under ep (C = S slots per expert: it drops nothing "
            f"either), or keep capacity_factor=None and use the strategy without ep (dp on that "
            f"axis)")  # fmt: skip


def _whole_experts(context: LayoutContext) -> list[str]:
    """The paths of the expert leaves (``gate``, ``up``, ``down``) whose plan role is named
    ``experts`` but names no ``experts`` dim: a dropless layer's, whole on each device."""
    found = []
    for (path, shape), role in zip(
        jax.tree_util.tree_leaves_with_path(context.shapes, is_leaf=is_shape),
        jax.tree.leaves(context.roles), strict=True,
    ):  # fmt: skip
        key = getattr(path[-1], "key", None) if path else None
        if role == "experts" and key in ("gate", "up", "down"):
            where = f"params{jax.tree_util.keystr(path)}"
            if "experts" not in role.logical_dims(key, tuple(shape), where):
                found.append(jax.tree_util.keystr(path))
    return found
