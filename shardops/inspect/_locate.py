"""The divergence locator: which layer makes a sharded model differ from its unsharded twin?

    report = shardops.inspect.compare(sharded_loss, reference_loss, params, x, y)
    print(report)            # per layer: output and gradient error against the K-scaled bound
    report.first             # the first layer beyond its bound, or None: "within float reordering"

    shardops.inspect.first_non_finite(sharded_loss, params, x, y)  # where a NaN or inf starts

A model marks its layers with ``shardops.inspect.tap(y, name)`` (the models of ``shardops_models`` tap
every layer of their context by itself). ``compare`` runs the sharded function once and records
every tap's value and the gradient arriving at it; inside ``jax.shard_map`` each device records
its block and the blocks are put together by the tap's ``spec`` (the global layout, like an
``out_specs`` entry), and the blocks that ``spec`` says are replicas must agree.

The twin then runs **teacher-forced**: at every tap it records its own value and hands on the
sharded run's value instead, and in the backward pass it records its own gradient and hands on
the sharded one. So the reference computes each layer from exactly the sharded layer's inputs,
and each difference belongs to the layer that made it, not to the layers before it that only
passed rounding on (without forcing, a rounding difference in layer 1 grows through every later
layer, and on a long model the first layer "beyond a bound" would be arbitrary). Per tap:

- ``output``: the tap's value, made by the layer's forward;
- ``gradient``: the gradient at the tap, made by the backward of the layers after it (named as
  the gradient *into* the tap's layer);
- ``param``: the gradient of each parameter, named by its path, from forced inputs and forced
  output gradients: its layer's own backward.

The bound is ``shardops.testing.error_bound`` of two roundings of a K-term contraction (each
side rounds once, the layers were fed the same inputs): elementwise

    2 · [(K + 2) · eps(accum) · Â  +  eps(dtype) · |r_ref|],        Â = √K · max |r_ref|

with K the contraction that made the value (``tap(..., k=K)``; a dense layer's D, the batch's
rows for a weight gradient), ``accum`` the policy's accumulation dtype and ``dtype`` the value's
own dtype. ``Â`` stands in for ``Σ_k |x_k||w_k|``, which a tap cannot see: for products of
independent terms ``Σ|x_k w_k| ≈ √K · |Σ x_k w_k|``. A layer beyond the bound is a bug (an
extra or missing reduction, a bias added on every device, a head taken from the wrong device
moves a value by O(|r|), 10²–10⁶ × the bound); a layer within it differs by float reordering.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from shardops._mesh import entry_axes
from shardops._precision import FLOAT32, Precision
from shardops.inspect._ledger import _Null
from shardops.testing import error_bound

OUTPUT, GRADIENT, PARAM = "output", "gradient", "param"
LOSS = "loss"  # the owner of the gradient at the last tap


class _Session:
    """What one ``compare`` records: per tap, the blocks of each device, by mesh coordinates."""

    def __init__(self, mode: str, forced: dict | None = None):
        self.mode = mode  # "record" (the sharded run) or "replay" (the teacher-forced twin)
        self.forced = forced or {}  # name → (value, gradient) of the sharded run, global
        self.order: list[str] = []  # taps in trace order (the forward's order)
        self.k: dict[str, int] = {}
        self.layout: dict[str, tuple] = {}  # name → (spec, axis names, axis sizes)
        self.blocks: dict[tuple[str, str], dict] = {}  # (name, what) → {coords: array}
        self.recorded: list = []  # (name, what, coords, value) as the callbacks gave them
        self.lock = threading.Lock()

    def traced(self, name, k, spec, axes, sizes, shape=None):
        if name not in self.k:
            self.order.append(name)
        self.k[name], self.layout[name] = k, (spec, axes, sizes, shape)

    def record(self, name, what, coords, value):
        """Called on a device's thread, in the middle of its program: keep the arrays as they
        are. Reading them here (``np.asarray``, ``int``) would wait for that device, which
        waits for this callback: a deadlock once the values are large enough."""
        with self.lock:
            self.recorded.append((name, what, coords, value))

    def value(self, name: str, what: str):
        """The global array of ``name`` put together from its blocks, and the largest
        difference between blocks its spec says are replicas. (After the program ran.)"""
        with self.lock:
            recorded, self.recorded = self.recorded, []
        for tap, kind, coords, value in recorded:
            key = tuple(int(c) for c in coords)
            self.blocks.setdefault((tap, kind), {})[key] = np.asarray(value)
        blocks = self.blocks.get((name, what))
        if not blocks:
            return None, 0.0
        spec, axes, sizes, shape = self.layout[name]
        value, replicas = _assemble(blocks, spec, axes, sizes)
        if shape is not None:  # the padding cut off
            value = value[tuple(slice(None) if n is None else slice(0, n) for n in shape)]
        return value, replicas


_STATE = threading.local()


def _session() -> _Session | None:
    return getattr(_STATE, "session", None)


@contextlib.contextmanager
def _active(session: _Session):
    previous = _session()
    _STATE.session = session
    try:
        yield session
    finally:
        _STATE.session = previous


def tapping() -> bool:
    """Whether a ``compare`` (or ``first_non_finite``) is recording taps now (a model may then
    unroll a ``lax.scan`` of layers so that each layer is tapped under a name of its own)."""
    return _session() is not None


def tap(x: jax.Array, name: str, *, spec=None, k: int = 1, shape=None) -> jax.Array:
    """``x`` unchanged; under ``shardops.inspect.compare`` (or ``first_non_finite``), records ``x``
    and its gradient as layer ``name``.

    Arguments:
        x: a layer's output. Outside ``jax.shard_map`` the global array; inside, this device's
            block of it.
        name: the layer's name, the same in the sharded model and its reference.
        spec: inside ``shard_map``, the ``PartitionSpec`` of the global value whose block ``x``
            is (as in ``out_specs``): ``P("data", None, "model")`` for ``x[B_data, S,
            F_model]``. Mesh axes it leaves out hold replicas, which must agree. Outside
            ``shard_map``: None.
        k: the contraction length K that made ``x`` (a dense layer's input features), for the
            bound of float reordering.
        shape: the global value's own shape where the blocks hold padding (a vocabulary of 97
            stored as 100): an int per dim to cut the assembled value to, or None to keep the
            dim whole, e.g. ``(None, None, 97)``.

    Costs nothing outside ``compare`` and ``first_non_finite``: it is the identity, traced away.
    """
    session = _session()
    if session is None:
        return x
    if not isinstance(name, str) or not name:
        raise TypeError(f"tap: name must be a non-empty str; got {name!r}")
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in mesh.axis_names if a in getattr(mesh, "manual_axes", ()))
    if spec is None:
        spec = P()
    if not isinstance(spec, P):
        raise TypeError(f"tap {name!r}: spec must be a PartitionSpec; got {spec!r}")
    if len(spec) > x.ndim:
        raise ValueError(
            f"tap {name!r}: spec {spec} has {len(spec)} entries but x has rank {x.ndim}"
        )
    unknown = sorted({a for e in spec for a in entry_axes(e)} - set(axes))
    if unknown:
        raise ValueError(
            f"tap {name!r}: spec {spec} names mesh axes {unknown} that this code is not "
            f"manual over (shard_map axes here: {axes}); outside shard_map pass spec=None"
        )
    if session.mode == "replay" and axes:
        raise ValueError(
            f"tap {name!r}: the reference runs inside shard_map (axes {axes}); compare needs "
            f"an unsharded reference_fn, e.g. the same model built with strategy 'ref'"
        )
    sizes = tuple(mesh.shape[a] for a in axes)
    session.traced(name, int(k), spec, axes, sizes, shape)

    def record(what, value):
        coords = [lax.axis_index(a) for a in axes]  # here: the backward is traced apart
        jax.debug.callback(
            lambda *c, v: session.record(name, what, c, v), *coords, v=value
        )  # one call per device, with its mesh coordinates

    forced_value, forced_grad = session.forced.get(name, (None, None))
    for forced in (forced_value, forced_grad):
        if forced is not None and forced.shape != x.shape:
            raise ValueError(
                f"tap {name!r}: the sharded model's value has global shape {forced.shape}, the "
                f"reference's {tuple(x.shape)}; the two models must tap the same layers"
            )

    @jax.custom_vjp
    def identity(x):
        record(OUTPUT, x)
        return x if forced_value is None else _opaque(forced_value, x.dtype)

    def forward(x):
        return identity(x), None

    def backward(_, g):
        record(GRADIENT, g)
        return (g if forced_grad is None else _opaque(forced_grad, g.dtype),)

    identity.defvjp(forward, backward)
    return identity(x)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compared value."""

    layer: str
    what: str  # OUTPUT, GRADIENT or PARAM
    name: str  # the tap, or the parameter's path
    shape: tuple[int, ...]
    k: int
    error: float  # max |sharded − reference|
    ratio: float  # max over elements of error / bound; ≤ 1: float reordering
    replicas: float  # max difference between blocks that should be replicas
    end_to_end: float | None  # max |sharded − unforced reference| (propagated, for context)

    @property
    def beyond(self) -> bool:
        return self.ratio > 1 or self.replicas > 0


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-layer comparison of a sharded model with its teacher-forced twin."""

    rows: tuple[Row, ...]
    layers: tuple[str, ...]  # in forward order
    loss: tuple[float, float]  # sharded, reference (unforced)
    precision: Precision
    missing: tuple[str, ...]  # taps only one side has

    @property
    def first(self) -> str | None:
        """The first layer (forward order) with a value beyond its bound, else None."""
        bad = {r.layer for r in self.rows if r.beyond}
        return next((layer for layer in self.layers if layer in bad), None)

    @property
    def within_bound(self) -> bool:
        return self.first is None and not self.missing

    def verdict(self) -> str:
        if self.missing:
            return f"cannot compare: taps on one side only: {', '.join(self.missing)}"
        if self.first is None:
            worst = max((r.ratio for r in self.rows), default=0.0)
            return (
                f"within bound: every layer differs from the reference by float reordering "
                f"only (worst {worst:.2g} of its bound, {self.precision.name})"
            )
        rows = [r for r in self.rows if r.layer == self.first and r.beyond]
        what = "; ".join(
            f"{r.what} {r.name}: {r.ratio:.3g}× its bound"
            + (f", replicas differ by {r.replicas:.3g}" if r.replicas else "")
            for r in rows
        )
        return f"bug: layer {self.first} is the first beyond its bound ({what})"

    def table(self):
        """A ``rich.table.Table``: one row per value, the first layer beyond its bound marked."""
        from rich.table import Table

        table = Table(title=f"sharded vs reference, per layer ({self.precision.name})")
        for column, justify in (("layer", "left"), ("value", "left"), ("shape", "left"),
                                ("K", "right"), ("max error", "right"), ("÷ bound", "right"),
                                ("end-to-end", "right"), ("", "left")):  # fmt: skip
            table.add_column(column, justify=justify)
        first = self.first
        for r in self.rows:
            mark = "← first beyond bound" if r.layer == first and r.beyond else (
                "beyond" if r.beyond else "")  # fmt: skip
            style = "bold red" if mark.startswith("←") else None
            table.add_row(
                r.layer, _what(r),
                "×".join(map(str, r.shape)), str(r.k), f"{r.error:.3g}", f"{r.ratio:.3g}",
                "" if r.end_to_end is None else f"{r.end_to_end:.3g}", mark, style=style,
            )  # fmt: skip
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=140, record=True, file=_Null(), color_system=None)
        console.print(self.table())
        console.print(f"loss: sharded {self.loss[0]:.8g}, reference {self.loss[1]:.8g}")
        console.print(self.verdict())
        return console.export_text()


def compare(
    sharded_fn: Callable,
    reference_fn: Callable,
    params,
    *batch,
    reference_params=None,
    reference_batch=None,
    precision: Precision = FLOAT32,
    grad_k: int | None = None,
    end_to_end: bool = True,
) -> Report:
    """Run ``sharded_fn`` and its unsharded twin ``reference_fn`` on the same batch and report,
    per tapped layer (``shardops.inspect.tap``), how far each output and gradient is from the
    reference against the bound of float reordering (module docstring).

    Arguments:
        sharded_fn, reference_fn: ``fn(params, *batch)`` returning a scalar loss (``compare``
            differentiates it) or ``(loss, grads)`` with ``grads`` shaped like ``params``
            (e.g. ``setup.loss_and_grads`` of ``shardops_models``). Jitted or not; both are
            traced afresh (JAX's caches are cleared before and after, so no tapped program
            outlives the call).
        params: the sharded function's parameters (global arrays, sharded or not).
        *batch: the batch, given to both.
        reference_params: the reference's parameters if they differ in layout (default:
            ``params`` gathered to host).
        reference_batch: the reference's batch, a tuple (default: ``batch`` on host).
        precision: the policy both run under (its ``accum_dtype`` sets the bound).
        grad_k: K of the parameter gradients (the rows each weight gradient sums over);
            default: the first batch argument's rows (times its columns for integer token ids).
        end_to_end: also run the reference unforced and show how far each difference travelled
            (the ``end-to-end`` column; one more compile of the reference).

    Returns:
        A ``Report``: ``report.first`` names the first layer beyond its bound (None: within
        float reordering), ``print(report)`` shows the table.
    """
    if not isinstance(precision, Precision):
        raise TypeError(f"compare: precision must be a shardops.Precision; got {precision!r}")
    _check_batch("compare", batch, "compare(f, g, params, x, y)")
    if grad_k is None:
        grad_k = _default_grad_k(batch[0])
    host_params = jax.device_get(params if reference_params is None else reference_params)
    host_batch = jax.device_get(tuple(batch if reference_batch is None else reference_batch))

    try:
        with _active(_Session("record")) as sharded:
            loss, grads = _run(sharded_fn, params, batch)
        forced = {
            n: (sharded.value(n, OUTPUT)[0], sharded.value(n, GRADIENT)[0]) for n in sharded.order
        }
        with _active(_Session("replay", forced)) as twin:
            ref_loss, ref_grads = _run(reference_fn, host_params, host_batch)
        with _active(_Session("replay")) as free:  # unforced: how far errors travelled
            if end_to_end:  # else the loss shown is the forced reference's
                ref_loss, free_grads = _run(reference_fn, host_params, host_batch)
            else:
                free_grads = jax.tree.map(lambda _: None, ref_grads)
    finally:
        jax.clear_caches()  # no tapped program outlives the call

    missing = tuple(sorted(set(sharded.order) ^ set(twin.order)))
    layers = tuple(n for n in sharded.order if n in twin.k)
    rows = _tap_rows(sharded, twin, free, layers, precision)
    rows += _param_rows(grads, ref_grads, free_grads, layers, grad_k, precision)
    owners = (*layers, LOSS)
    owners += tuple(sorted({r.layer for r in rows} - set(owners)))  # params of untapped layers
    order = {n: i for i, n in enumerate(owners)}
    rows.sort(key=lambda r: (order[r.layer], (OUTPUT, GRADIENT, PARAM).index(r.what)))
    return Report(
        tuple(rows),
        owners,
        (float(loss), float(ref_loss)),
        precision,
        missing,
    )


def _default_grad_k(first) -> int:
    """The default K of the parameter gradients: the rows of the first batch argument (times
    its columns for integer token ids ``[B, S]``)."""
    first = np.asarray(first) if not hasattr(first, "shape") else first
    integer = jnp.issubdtype(first.dtype, jnp.integer)
    return math.prod(first.shape[: 2 if integer and first.ndim > 1 else 1])


def _tap_rows(
    sharded: _Session, twin: _Session, free: _Session, layers: tuple, precision: Precision
) -> list[Row]:
    """One ``Row`` per tapped layer's output and per gradient at it: the sharded run's value
    against the forced reference's (``twin``) and the unforced one's (``free``), each owned by
    the layer that makes it."""
    rows = []
    for i, name in enumerate(layers):
        for what in (OUTPUT, GRADIENT):
            got, replicas = sharded.value(name, what)
            want, _ = twin.value(name, what)
            free_value, _ = free.value(name, what)
            if got is None or want is None:
                continue
            # A tap's value is made by its layer; the gradient at it by the backward of the
            # layer after it (the loss, after the last).
            owner = name if what == OUTPUT else (layers[i + 1] if i + 1 < len(layers) else LOSS)
            k = twin.k[owner] if owner in twin.k else twin.k[name]
            rows.append(_row(owner, what, name, got, want, free_value, k, replicas, precision))
    return rows


def _param_rows(
    grads, ref_grads, free_grads, layers: tuple, grad_k: int, precision: Precision
) -> list[Row]:
    """One ``Row`` per parameter gradient (sharded against the forced and the unforced
    reference, summed over ``grad_k`` rows), owned by the tapped layer its path names."""
    rows = []
    flat = jax.tree_util.tree_flatten_with_path
    for (path, g), r, f in zip(
        flat(jax.device_get(grads))[0], jax.tree.leaves(jax.device_get(ref_grads)),
        jax.tree.leaves(jax.device_get(free_grads), is_leaf=lambda a: a is None), strict=True,
    ):  # fmt: skip
        key = jax.tree_util.keystr(path)
        layer = _owner(key, layers)
        rows.append(_row(layer, PARAM, key, g, r, f, grad_k, 0.0, precision))
    return rows


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """Where one loss-and-gradient computation first holds a NaN or an inf
    (``first_non_finite``). Every count is of elements."""

    layer: str | None
    """The tapped layer: whose output is non-finite (``what == "output"``), at whose output
    the arriving gradient is non-finite (``"gradient"``) or that owns the parameter
    (``"param"``); None for the loss, and when every value is finite."""
    what: str | None
    """``"output"``, ``"loss"``, ``"gradient"`` or ``"param"``; None: every value finite."""
    name: str | None
    """The value: the tap's name, ``"loss"``, or the parameter's path (``['blocks'][1]['w']``)."""
    nan: int
    inf: int
    size: int
    """Elements of that value (0 when every value is finite)."""
    loss: float
    layers: tuple[str, ...]
    """The tapped layers, in forward order."""
    non_finite: tuple[tuple[str, str], ...]
    """``(what, name)`` of every non-finite value, in the order they are checked."""

    @property
    def count(self) -> int:
        """Non-finite elements (NaN or ±inf) of the value named."""
        return self.nan + self.inf

    @property
    def finite(self) -> bool:
        """Whether every value (outputs, loss, gradients) is finite."""
        return self.what is None

    def __str__(self) -> str:
        if self.finite:
            return (
                f"every value is finite: the outputs of {len(self.layers)} tapped layers and the "
                f"gradients arriving at them, the loss ({self.loss:.8g}) and the parameter "
                f"gradients"
            )
        counts = f"{self.count} of {self.size} elements: {self.nan} NaN, {self.inf} ±inf"
        lines = [f"first non-finite value: {_non_finite_value(self.what, self.name, self.layers)}"
                 f" ({counts})", f"loss: {self.loss:.8g}"]  # fmt: skip
        later = collections.Counter(what for what, _ in self.non_finite[1:])
        if later:
            words = {OUTPUT: "layer output", GRADIENT: "arriving gradient",
                     PARAM: "parameter gradient"}  # fmt: skip
            lines.append("also non-finite, after it: " + ", ".join(
                "the loss" if what == LOSS else f"{n} {words[what]}{'s' if n > 1 else ''}"
                for what, n in later.items()))  # fmt: skip
        return "\n".join(lines)


def first_non_finite(fn: Callable, params, *batch) -> NonFiniteReport:
    """Run ``fn`` once with every tap recording and name the first value that holds a NaN or
    an inf, in the order the computation makes them.

    The order: the tapped layers' outputs in forward order, then the loss, then the gradient
    arriving at each tapped layer's output in backward order (from the loss back towards the
    input), then the parameters' gradients by path. So a NaN weight is named by its layer's
    output, a loss that overflows by the loss, and a backward that turns finite values into
    inf (``√`` at 0, an overflowing product) by the layer nearest the loss whose arriving
    gradient it spoils. Inside ``jax.shard_map`` each device records its block, as for
    ``compare``; the blocks are put together by the tap's ``spec``.

    Arguments:
        fn: ``fn(params, *batch)`` returning a scalar loss (differentiated here) or
            ``(loss, grads)`` with ``grads`` shaped like ``params`` (as ``compare``'s
            ``sharded_fn``). Traced afresh, and JAX's caches are cleared after it.
        params: its parameters (global arrays, sharded or not).
        *batch: the batch.

    Returns:
        A ``NonFiniteReport``: ``report.layer`` and ``report.what`` say where (``what`` None:
        every value finite), ``print(report)`` says it in words with the counts.
    """
    _check_batch("first_non_finite", batch, "first_non_finite(f, params, x, y)")
    try:
        with _active(_Session("record")) as session:
            loss, grads = _run(fn, params, batch, caller="first_non_finite")
    finally:
        jax.clear_caches()  # no tapped program outlives the call
    layers = tuple(session.order)
    values = [(OUTPUT, n, session.value(n, OUTPUT)[0]) for n in layers]  # forward order
    values.append((LOSS, LOSS, loss))
    values += [(GRADIENT, n, session.value(n, GRADIENT)[0]) for n in reversed(layers)]
    values += [(PARAM, jax.tree_util.keystr(path), g)
               for path, g in jax.tree_util.tree_leaves_with_path(grads)]  # fmt: skip
    counts = [(what, name, _non_finite_count(value)) for what, name, value in values]
    bad = [(what, name, c) for what, name, c in counts if c[0] + c[1]]
    what, name, (nan, inf, size) = bad[0] if bad else (None, None, (0, 0, 0))
    layer = {OUTPUT: name, GRADIENT: name, PARAM: _owner(name or "", layers), LOSS: None}.get(what)
    return NonFiniteReport(layer, what, name, nan, inf, size, float(loss), layers,
                           tuple((w, n) for w, n, _ in bad))  # fmt: skip


def _non_finite_count(value) -> tuple[int, int, int]:
    """``(NaN elements, ±inf elements, elements)`` of ``value`` (None: nothing recorded)."""
    if value is None:
        return 0, 0, 0
    value = np.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.inexact):
        return 0, 0, value.size
    value = value.astype(np.float32) if value.dtype.itemsize < 4 else value  # bfloat16
    return int(np.isnan(value).sum()), int(np.isinf(value).sum()), value.size


def _non_finite_value(what: str, name: str, layers) -> str:
    """The value ``first_non_finite`` names, in words."""
    if what == OUTPUT:
        return f"the output of layer {name}"
    if what == LOSS:
        return "the loss (every tapped layer's output is finite)"
    if what == GRADIENT:
        i = layers.index(name)
        after = f"layer {layers[i + 1]}" if i + 1 < len(layers) else "the loss"
        return (f"the gradient arriving at layer {name}'s output, from the backward of what "
                f"follows it up to {after}")  # fmt: skip
    owner = _owner(name, layers)
    return f"the gradient of parameter {name}" + (f" (layer {owner})" if owner != name else "")


def _check_batch(caller: str, batch: tuple, example: str) -> None:
    if not batch:
        raise ValueError(f"{caller}: pass the batch after params, e.g. {example}")


def _run(fn, params, batch, caller: str = "compare"):
    """``(loss, grads)`` of ``fn(params, *batch)``, finished (callbacks flushed). Traced
    afresh: a cached trace would hold another session's taps."""
    jax.clear_caches()
    fn = jax.jit(fn)  # eager shard_map would run a tap's callback once per replica group
    out = jax.eval_shape(fn, params, *batch)
    if isinstance(out, tuple) and len(out) == 2:
        loss, grads = fn(params, *batch)
    elif hasattr(out, "shape") and out.shape == ():
        loss, grads = jax.value_and_grad(fn)(params, *batch)
    else:
        raise ValueError(
            f"{caller}: fn(params, *batch) must return a scalar loss or (loss, grads); got "
            f"{jax.tree.map(lambda a: a.shape, out)}"
        )
    jax.block_until_ready((loss, grads))
    jax.effects_barrier()
    return loss, grads


def _row(layer, what, name, got, want, free, k, replicas, precision):
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    dtype = np.asarray(want).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = precision.accum_dtype
    error = np.abs(got64 - want64)
    scale = math.sqrt(k) * float(np.max(np.abs(want64), initial=0.0))
    inputs = float(jnp.finfo(precision.compute_dtype).eps) * scale  # operands rounded, or not
    bound = 2 * (error_bound(scale, k, precision, exact=want64, out_dtype=dtype) + inputs)
    end = None if free is None else float(np.max(np.abs(got64 - np.asarray(free, np.float64)),
                                                  initial=0.0))  # fmt: skip
    return Row(
        layer, what, name, tuple(got64.shape), k, float(np.max(error, initial=0.0)),
        float(np.max(error / bound, initial=0.0)), replicas, end,
    )  # fmt: skip


def _owner(path: str, layers) -> str:
    """The tapped layer a parameter path belongs to: the longest layer name that prefixes it
    (``['blocks'][1]`` owns ``['blocks'][1]['w']``, not ``['blocks'][10]['w']``)."""
    owners = [n for n in layers if path.startswith(n) and path[len(n) : len(n) + 1] in ("", "[")]
    owners += [n for n in layers if path.startswith(f"['{n}']")]  # params {"layer1": {...}}
    return max(owners, key=len) if owners else path


def _what(r: Row) -> str:
    if r.what == OUTPUT:
        return "output"
    if r.what == GRADIENT:
        return f"gradient at {r.name}" if r.name != r.layer else "gradient"
    return f"param grad {r.name.removeprefix(r.layer)}"


def _assemble(blocks: dict, spec, axes, sizes):
    """The global array from ``{coords: block}`` by ``spec``, and the largest difference among
    blocks that ``spec`` makes replicas of each other."""
    entries = [entry_axes(e) for e in spec]
    some = next(iter(blocks.values()))
    entries += [()] * (some.ndim - len(entries))
    size = dict(zip(axes, sizes, strict=True))
    shape = tuple(
        d * math.prod(size[a] for a in e) for d, e in zip(some.shape, entries, strict=True)
    )
    out = np.zeros(shape, some.dtype)
    seen: dict[tuple, np.ndarray] = {}
    replicas = 0.0
    for coords, block in sorted(blocks.items()):
        where = dict(zip(axes, coords, strict=True))
        index = []
        for d, e in zip(block.shape, entries, strict=True):
            i = 0
            for a in e:  # the first axis of an entry is the major one
                i = i * size[a] + where[a]
            index.append(slice(i * d, (i + 1) * d))
        key = tuple((s.start, s.stop) for s in index)
        if key in seen:  # (inf - inf among non-finite replicas: NaN, quietly)
            with np.errstate(invalid="ignore"):
                diff = np.abs(np.asarray(block, np.float64) - np.asarray(seen[key], np.float64))
            replicas = max(replicas, float(np.max(diff, initial=0.0)))
            continue
        seen[key] = block
        out[tuple(index)] = block
    return out, replicas


def _opaque(value: np.ndarray, dtype):
    """``value`` as a runtime value XLA cannot fold: a constant would let the compiler's
    constant folder evaluate the layers after it at compile time, with other roundings."""
    return lax.optimization_barrier(jnp.asarray(value, dtype))
