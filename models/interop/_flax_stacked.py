"""Blocks stacked by ``nnx.vmap`` and run by ``nnx.scan``, as Flax's guide to scanning over layers
writes them (``FlaxModel(stacked="blocks")``):

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs):
        return Block(config, rngs=rngs)
    self.blocks = create_block(rngs)          # every Param [L, …]
    ...
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return block(x)
    x = forward(x, self.blocks)

The stacked sub-module's plan is one block's (``stacked(...)``: the layers dim in front), read
from one block's abstract slice (``one_block``). While the module runs, ``nnx.scan`` is patched
(``scanned_by``): called over the stacked blocks it runs ``ctx.scan``, which gives each layer a
unit of its own (FSDP gathers one block at a time) and under pp runs this stage's layers
alone; each block is rebuilt from the graph with its layers swapped for the strategy's kernels
on that layer's parameters. Any other ``nnx.scan`` runs as Flax runs it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax
from flax import nnx
from flax.typing import Missing

from shardops_models.interop._flax_layers import EMBED, LINEAR, NORM, at
from shardops_models.interop._foreign import Refusing

_SUPPORTED = "nnx.scan(f, in_axes=(nnx.Carry, 0[, None …]), out_axes=nnx.Carry)"


def one_block(blocks, where: str):
    """``(graphdef, state)``: the stacked sub-module's graph and one block's abstract
    parameters, each ``Param[L, …]`` as ``[…]`` with its logical names (Flax's
    ``out_sharding``) without the layers' (``nnx.vmap``'s ``transform_metadata`` puts one in
    front). A ValueError where a parameter is not stacked or the layers differ in number."""
    graphdef, state = nnx.split(blocks)
    flat = list(nnx.to_flat_state(state))
    if not flat:
        raise ValueError(f"FlaxModel(stacked={where!r}): the sub-module holds no nnx.Param")
    layers = {getattr(v, "shape", ())[:1] for _, v in flat}
    if len(layers) != 1 or layers == {()}:
        shapes = {".".join(map(str, p)): tuple(v.shape) for p, v in flat}
        raise ValueError(
            f"FlaxModel(stacked={where!r}): every parameter of the stacked blocks holds [L, …], "
            f"one layer per index of dim 0 (as nnx.vmap makes them); got {shapes}"
        )

    def one(variable):
        shape = tuple(variable.shape)
        names = variable.get_metadata().get("out_sharding")
        metadata = {} if names is None or len(names) != len(shape) else {
            "out_sharding": tuple(names[1:])}  # fmt: skip
        value = jax.ShapeDtypeStruct(shape[1:], variable.dtype)
        return variable.replace(value=value, **metadata)

    leading = {v.get_metadata().get("out_sharding")[0] for _, v in flat
               if len(v.get_metadata().get("out_sharding") or ()) == v.ndim}  # fmt: skip
    if len(leading) > 1:
        raise ValueError(
            f"FlaxModel(stacked={where!r}): dim 0 of the stacked parameters is named "
            f"{sorted(map(str, leading))}; the layers' dim is one (nnx.vmap's out_axes=0, "
            f"transform_metadata={{nnx.PARTITION_NAME: 'layers'}})"
        )
    state = jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return graphdef, state


def check_sizes(block, layers: dict, where: str) -> None:
    """One block's layers hold the parameters their sizes say (a Linear ``kernel[in, out]``,
    an Embed's table, a norm's scale): else dim 0 was not the layers'."""
    for path, kind in layers.items():
        m = at(block, path)
        name, want = {
            LINEAR: ("kernel", (getattr(m, "in_features", 0), getattr(m, "out_features", 0))),
            EMBED: ("embedding", (getattr(m, "num_embeddings", 0), getattr(m, "features", 0))),
            NORM: ("scale", (getattr(m, "num_features", 0),)),
        }.get(kind, (None, None))
        got = getattr(m, name, None) if name else None
        if got is not None and tuple(got.shape) != want:
            raise ValueError(
                f"FlaxModel(stacked={where!r}): {'.'.join(map(str, path))}.{name} of one block "
                f"has shape {tuple(got.shape)}, but the {type(m).__name__} holds {want}; the "
                f"stacked blocks hold [L, …], the layers along dim 0 (nnx.vmap's out_axes=0)"
            )


class StackedBlocks(Refusing):
    """The stacked sub-module's place in the module during a forward: ``nnx.scan`` over it
    (``scanned_by``) runs ``ctx.scan(fn, params, carry)`` with ``block(layer)`` the block of
    one layer's parameters. A plain object: anything else the module's code does with it is
    refused, naming the path."""

    def __init__(self, ctx, params, block, where: str, layers: int):
        self.ctx, self.params, self.block, self.where = ctx, params, block, where
        self.layers = layers  # L, all of them (under pp a device holds its stage's)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        raise ValueError(
            f"{self.where}: the stacked blocks were called directly; FlaxModel runs them when "
            f"the module's forward scans over them with {_SUPPORTED} inside its __call__ (a "
            f"__call__ decorated with nnx.scan at class definition is not run yet)"
        )

    # Anything else the module's code reads of the stacked blocks is refused (``Refusing``).
    OWN = ("ctx", "params", "block", "layers")
    REFUSAL = (
        "{where}.{name}: the module's code reads an attribute of the stacked blocks, whose "
        f"parameters are laid out by the strategy; scan over them with {_SUPPORTED}"
    )


def unseen_scan(where: str, error: Exception) -> ValueError:
    """The error for stacked blocks that reached a scan ``scanned_by`` could not patch (JAX
    refusing them as an argument: ``error``)."""
    return ValueError(
        f"{where}: the stacked blocks reached a scan FlaxModel does not run "
        f"({str(error).splitlines()[0]}); scan them with {_SUPPORTED} built inside the module's "
        f"__call__, as nnx.scan (which FlaxModel patches while the module runs), not one built "
        f"before (@nnx.scan at class definition, a scanned function made at import, "
        f"from flax.nnx import scan)"
    )


@contextlib.contextmanager
def scanned_by():
    """``nnx.scan`` patched while the module runs: over a ``StackedBlocks`` it runs the
    layers by ``ctx.scan`` (``_run``), over anything else as Flax runs it; restored after
    (to what it was), whatever happens."""
    flax_scan = nnx.scan

    def scan(f=Missing, **options):
        inspect.signature(flax_scan).bind(f, **options)  # Flax's TypeError for a wrong option
        if f is Missing:
            return functools.partial(scan, **options)

        def wrapper(*args, **kwargs):
            if not any(isinstance(a, StackedBlocks) for a in (*args, *kwargs.values())):
                return flax_scan(f, **options)(*args, **kwargs)
            if kwargs:  # as Flax binds them: by position, defaults filled in
                bound = inspect.signature(f).bind(*args, **kwargs)
                bound.apply_defaults()
                args, kwargs = bound.args, bound.kwargs
            if kwargs:
                raise ValueError(f"nnx.scan over stacked blocks: the scanned function takes "
                                 f"{sorted(kwargs)} by keyword only; take them by position")  # fmt: skip
            return _run(f, tuple(args), options)

        return functools.update_wrapper(wrapper, f) if callable(f) else wrapper

    nnx.scan = scan
    try:
        yield
    finally:
        nnx.scan = flax_scan


def _run(f, args: tuple, options: dict):
    """``f`` scanned over the stacked blocks in ``args`` by ``ctx.scan``: the carry is the
    residual stream, the other arguments are closed over (``in_axes`` None)."""
    ours = [i for i, a in enumerate(args) if isinstance(a, StackedBlocks)]
    blocks, carries, wrong = args[ours[0]], *_check_options(args, ours, options)
    if wrong:
        raise ValueError(
            f"{blocks.where}: nnx.scan over the stacked blocks with {', '.join(wrong)}; "
            f"FlaxModel runs {_SUPPORTED}: the residual stream carried from block to block, "
            f"the blocks scanned along dim 0, other arguments broadcast"
        )
    carry = args[carries[0]]
    if not isinstance(carry, jax.Array):
        raise ValueError(
            f"{blocks.where}: nnx.scan over the stacked blocks carries a "
            f"{type(carry).__name__}; FlaxModel carries one array from block to block, the "
            f"residual stream x[B, S, D] (ctx.scan, which pipeline parallelism sends between "
            f"stages)"
        )
    blocks.calls += 1

    def layer(p, h):
        call = list(args)
        call[carries[0]], call[ours[0]] = h, blocks.block(p)
        try:
            return f(*call)
        except TypeError as e:  # a transform tracing the block: its layers are not arrays
            if "Swapped" not in str(e):
                raise
            raise ValueError(
                f"{blocks.where}: a transform inside the function nnx.scan runs over the "
                f"stacked blocks (nnx.remat, nnx.jit, jax.checkpoint) traced a block, whose "
                f"layers FlaxModel runs with the strategy's kernels: {e}. Scan the function "
                f"itself; shardops' remat policy is build(remat=...)"
            ) from e

    return blocks.ctx.scan(layer, blocks.params, carry)


def _check_options(args: tuple, ours: list[int], options: dict):
    """``(carries, wrong)``: the positions of ``in_axes``' carries, and each option (Flax's
    defaults for those not given: ``in_axes=(Carry, 0)``, ``out_axes=(Carry, 0)``) that the
    scan over the stacked blocks does not run as Flax would. ``unroll``, ``transform_metadata``,
    ``graph``, ``graph_updates`` and ``_split_transpose`` change nothing it computes: ``ctx.scan``
    decides the unrolling (a pipeline stage unrolls its layers), the rest is Flax's bookkeeping
    of the graph and its metadata."""
    in_axes = options.get("in_axes", (nnx.Carry, 0))
    in_axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    carries = [i for i, a in enumerate(in_axes) if a is nnx.Carry]
    allowed = {"out_axes": lambda v: v is nnx.Carry, "reverse": lambda v: not v,
               "length": lambda v: v in (None, args[ours[0]].layers)}  # fmt: skip
    given = {"out_axes": (nnx.Carry, 0), **options}
    wrong = [f"{k}={given[k]!r}" for k, ok in allowed.items() if k in given and not ok(given[k])]
    if len(in_axes) != len(args) or len(ours) != 1 or in_axes[ours[0]] != 0 or len(carries) != 1:
        wrong.insert(0, f"in_axes={options.get('in_axes', (nnx.Carry, 0))!r} over {len(args)} "
                        f"arguments ({len(ours)} of them the stacked blocks)")  # fmt: skip
    wrong += [f"in_axes[{i}]={a!r}" for i, a in enumerate(in_axes)
              if i not in (*carries, *ours) and a is not None]  # fmt: skip
    return carries, wrong
