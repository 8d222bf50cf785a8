"""A mixture of experts a Flax NNX module writes itself, run as shardops' ``ctx.moe``.

Flax has no mixture-of-experts layer: a module holds its experts stacked in parameters of its
own (``wi_0[E, D, F]``, ``wo[E, F, D]``), a router, and routes in its own code. That code
cannot run split (it would route this device's tokens to experts it does not hold), so the
sub-module is swapped whole, like a layer, for the strategy's kernel: ``FlaxExperts``
declares which parameters are the router and the experts' SwiGLU, and how tokens are routed;
``FlaxModel(moe={"blocks.*.moe": FlaxExperts(...)})`` says where such sub-modules sit.

What the declaration claims (and the module's own code must compute, which the tests check
against Flax's own run): ``probs = softmax(x · router)`` (or ``sigmoid``), each token's ``k``
best experts weighted by their ``probs`` renormalised over the ``k`` (so with ``k = 1`` the
weight is 1: Switch's ``p · expert(x)`` is not this), each expert
``(silu(x · gate) · (x · up)) · down``, the weighted sum, returned alone (``y[B, S, D]``);
every token kept (dropless) unless a ``capacity_factor`` is declared, and then dropped exactly
as ``shardops.layers.moe_kernel`` drops (GShard's capacity per sequence, filled by choice rank
first: every token's first choice before any second choice, then by position).

Under expert parallelism a dropless declaration runs at ``capacity_factor = E / k``: ``S``
slots per expert per sequence, so nothing can drop and the result is the dropless one. It costs
what the capacity does: a dispatch ``[S, E, S]`` per sequence (``O(S² · E · D)`` to dispatch
and combine) and each expert computing on ``S`` slots a sequence, ``E / k`` × what its tokens
need (XLA:CPU has no ragged AllToAll to send each expert exactly its tokens).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

from flax import nnx

from shardops_models.interop._foreign import Refusing, at_dict
from shardops_models.strategies.expert import ExpertKind
from shardops_models.strategies.plan import Role

__all__ = ["FlaxExperts"]

KEYS = ("router", "gate", "up", "down")
SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class FlaxExperts:
    """The parameters and routing of a mixture-of-experts sub-module (module docstring).

    Arguments:
        router, gate, up, down: dotted paths, inside the sub-module, of its ``nnx.Param``s:
            ``router[D, E]`` (an ``nnx.Linear``'s kernel: ``"router.kernel"``; no bias),
            ``gate[E, D, F]`` and ``up[E, D, F]`` (``silu(x · gate) · (x · up)``) and
            ``down[E, F, D]``. Every ``Param`` of the sub-module is one of them.
        k: the experts each token is routed to.
        score: ``"softmax"`` or ``"sigmoid"`` of the router's logits.
        capacity_factor: ``None``: dropless (every choice kept); else the slots per expert
            per sequence, ``min(S, ceil(capacity_factor · S · k / E))``, as
            ``shardops.layers.moe_capacity``.
        load_balance: how the load-balancing loss is averaged (``ctx.moe``'s): ``"global"``
            over the whole batch (Switch's), or ``"group"`` per sequence (GShard's; the one a
            step split into microbatches, a pipeline's or accumulation's, can take).

    The ``F`` dim of ``gate``, ``up`` and ``down`` is split over the tp axis where its
    logical name maps to ``"model"``; the experts dim is the strategy's (ep's axis).
    """

    router: str
    gate: str
    up: str
    down: str
    k: int
    score: str = "softmax"
    capacity_factor: float | None = None
    load_balance: str = "global"

    def __post_init__(self):
        for key in KEYS:
            path = getattr(self, key)
            if not isinstance(path, str) or not path or any(not p for p in path.split(".")):
                raise ValueError(f"FlaxExperts: {key} must be a dotted path inside the "
                                 f"sub-module (e.g. 'router.kernel', 'wi_0'); got {path!r}")  # fmt: skip
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"FlaxExperts: k must be a positive int (the experts each token "
                             f"is routed to); got {self.k!r}")  # fmt: skip
        if self.score not in SCORES:
            raise ValueError(f"FlaxExperts: score must be one of {SCORES}; got {self.score!r}")
        if self.load_balance not in ("global", "group"):
            raise ValueError(f"FlaxExperts: load_balance must be 'global' or 'group'; got "
                             f"{self.load_balance!r}")  # fmt: skip
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float)
                                   or not math.isfinite(factor) or factor <= 0):  # fmt: skip
            raise ValueError(f"FlaxExperts: capacity_factor must be None (dropless) or a "
                             f"positive finite number; got {factor!r}")  # fmt: skip


def declared_at(module, experts, dotted) -> dict[tuple, FlaxExperts]:
    """Module path → the declaration of each sub-module ``experts`` (``FlaxModel.moe``: ``(pattern,
    FlaxExperts)`` pairs, the first match wins) names; ``dotted(path)`` is a path's name.
    A pattern that matches no sub-module is an error listing the ones there are."""
    found, used = {}, set()
    # parents before their children (Flax lists children first): a sub-module of a mixture
    # already found is the mixture's, whatever a pattern says of it
    for path, _ in sorted(nnx.iter_modules(module), key=lambda item: len(item[0])):
        match = next(((p, d) for p, d in experts if fnmatch.fnmatchcase(dotted(path), p)), None)
        if not path or match is None:
            continue
        used.add(match[0])
        if not any(path[:i] in found for i in range(1, len(path))):  # else inside a mixture
            found[path] = match[1]
    unused = [p for p, _ in experts if p not in used]
    if unused:
        names = [dotted(p) for p, _ in nnx.iter_modules(module) if p]
        raise ValueError(f"FlaxModel: moe pattern {unused[0]!r} matches no sub-module; the "
                         f"module's are {names[:12]}{' …' if len(names) > 12 else ''}")  # fmt: skip
    return found


def _key_path(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.split("."))


def parameters(sub, declared: FlaxExperts, where: str) -> dict[str, tuple]:
    """``ctx.moe``'s key → the path of its ``Param`` in the sub-module ``sub``, their shapes
    checked (``router[D, E]``, ``gate, up[E, D, F]``, ``down[E, F, D]``) and every ``Param``
    of ``sub`` one of them; else a ValueError naming the parameter and what it should be."""
    params = {path: v for path, v in nnx.to_flat_state(nnx.state(sub, nnx.Param))}
    paths = {key: _key_path(getattr(declared, key)) for key in KEYS}
    for key, path in paths.items():
        if path not in params:
            raise ValueError(f"{where}: FlaxExperts({key}={getattr(declared, key)!r}) names no "
                             f"nnx.Param of {type(sub).__name__}; its parameters are "
                             f"{['.'.join(map(str, p)) for p in params]}")  # fmt: skip
    twice = [k for k in KEYS if [*paths.values()].count(paths[k]) > 1]
    if twice:
        raise ValueError(f"{where}: FlaxExperts declares {getattr(declared, twice[0])!r} as "
                         f"{' and '.join(twice)}; each is a parameter of its own")  # fmt: skip
    others = [p for p in params if p not in paths.values()]
    if others:
        raise ValueError(
            f"{where}.{'.'.join(map(str, others[0]))}: a parameter of the mixture of experts that "
            f"FlaxExperts does not declare (a router bias, a shared expert); shardops runs the "
            f"sub-module as ctx.moe, which has router, gate, up and down only. Move it out of the "
            f"sub-module, or drop it"
        )
    shape = {key: tuple(params[path].shape) for key, path in paths.items()}
    if len(shape["router"]) != 2 or len(shape["gate"]) != 3:
        raise ValueError(f"{where}: FlaxExperts needs router[D, E] and gate[E, D, F]; got router"
                         f"{shape['router']} and gate{shape['gate']}")  # fmt: skip
    (d, e), gate = shape["router"], shape["gate"]
    if gate[:2] == (d, e) != (e, d):
        raise ValueError(f"{where}: {declared.router} has shape {(d, e)}, which reads as router"
                         f"[E, D] beside gate{gate}; FlaxExperts reads router[D, E] (x · router: "
                         f"the experts' logits). Store it [D, E] (an nnx.Linear(D, E)'s kernel)")  # fmt: skip
    if gate[:2] != (e, d):
        raise ValueError(f"{where}: {declared.gate} has shape {gate}; with router[D={d}, E={e}] "
                         f"FlaxExperts reads gate[E, D, F]: ({e}, {d}, F). Declare the "
                         f"parameter that has that layout")  # fmt: skip
    f = gate[2]
    want = {"up": (e, d, f), "down": (e, f, d)}
    for key, expected in want.items():
        if shape[key] != expected:
            raise ValueError(
                f"{where}: {getattr(declared, key)} has shape {shape[key]}; with router[D={d}, "
                f"E={e}] and F={f} FlaxExperts reads {key}[{', '.join('EDF'[i] for i in _order(key))}]"
                f" = {expected} (each expert's {'output' if key == 'down' else 'input'} "
                f"projection). Declare the parameter that has that layout"
            )
    if declared.k > e:
        raise ValueError(f"{where}: FlaxExperts(k={declared.k}) but the router has {e} experts")
    return paths


def _order(key: str) -> tuple[int, ...]:
    return (0, 2, 1) if key == "down" else (0, 1, 2)


def role(paths: dict[str, tuple], hidden_split: bool, where: str) -> Role:
    """The plan role of the sub-module's parameters: ``EXPERTS``' layout under the leaf keys
    the module uses (the experts over ep's axis, ``F`` over tp's where ``hidden_split``)."""
    f = "mlp" if hidden_split else None
    dims = {"router": ("embed", None), "gate": ("experts", "embed", f),
            "up": ("experts", "embed", f), "down": ("experts", f, "embed")}  # fmt: skip
    by_leaf, owner = {}, {}
    for key, path in paths.items():
        leaf = str(path[-1])
        if by_leaf.setdefault(leaf, dims[key]) != dims[key]:
            raise ValueError(
                f"{where}: {owner[leaf]} and {key} share the leaf name {leaf!r} "
                f"({'.'.join(map(str, path))}) but not a layout; shardops lays a leaf out by its "
                f"name. Rename one"
            )
        owner.setdefault(leaf, key)
    return Role("experts", by_leaf)


class SwappedExperts(Refusing):
    """The sub-module's place in the module, run as ``ctx.moe`` on its ``Param``s (``p``: its
    dict, Flax's keys); each call's statistics kept in ``stats`` (the auxiliary losses)."""

    def __init__(self, ctx, declared: FlaxExperts, paths, p, where: str, stats: list):
        self.ctx, self.declared, self.where, self.stats = ctx, declared, where, stats
        self.p = {key: at_dict(p, path) for key, path in paths.items()}
        self.calls = 0

    def __call__(self, x, *args, **kwargs):
        given = [f"{k}={v!r}" for k, v in [*enumerate(args), *kwargs.items()] if v is not None]
        if given:
            raise ValueError(f"{self.where}: called with {', '.join(given)}; under FlaxModel "
                             f"a mixture of experts takes its input alone")  # fmt: skip
        if x.ndim != 3:
            raise ValueError(
                f"{self.where}: x{tuple(x.shape)}; FlaxModel runs a mixture of experts on x[B, "
                f"S, D] (each sequence one capacity group): call it before flattening the tokens"
            )
        ctx, declared = self.ctx, self.declared
        factor = declared.capacity_factor
        splits = any(isinstance(kind, ExpertKind) and kind.splits(self.p)
                     for kind in ctx.strategy.kinds)  # fmt: skip
        if factor is None and splits:  # dropless, as S slots per expert per sequence
            factor = self.p["router"].value.shape[-1] / declared.k

        def run(q, x):
            return ctx.moe(q, x, k=declared.k, capacity_factor=factor, score=declared.score,
                           load_balance=declared.load_balance)  # fmt: skip

        y, stats = ctx.unit(run, self.p, x)
        self.stats.append(stats)
        self.calls += 1
        return y

    # Its parameters are the strategy's: reading them is refused (``Refusing``).
    OWN = ("ctx", "declared", "stats", "p", "calls")
    REFUSAL = (
        "{where}.{name}: the module's code reads an attribute of a mixture of experts FlaxModel "
        "runs as ctx.moe, whose parameters are laid out by the strategy; call the sub-module "
        "instead"
    )
