"""The layer context of one pipeline stage's forward of one microbatch (``pipe.PipeKind``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from shardops.pipeline import zero_after
from shardops_models.strategies.parallel import Parallel, is_param


@dataclasses.dataclass(frozen=True)
class StageContext(Parallel):
    """``Parallel`` but for ``scan``: it takes ``h`` (this stage's input) in place of the
    scan's input except on the ``first`` stage (which starts from the model's embedding), runs
    this stage's layers, records their output in ``outputs`` and hands the rest of the forward
    (the head) zeros except on the ``last`` stage. ``first``, ``last``: traced bools. With
    ``stop`` it raises ``StageExit`` after the layers (a forward phase, which needs their
    output alone: nothing past them is traced)."""

    h: Any = None
    first: Any = None
    last: Any = None
    stop: bool = False
    ready: bool = False
    outputs: list = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, base: Parallel, h, first, last, *, stop: bool = False,
           ready: bool = False) -> StageContext:  # fmt: skip
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Parallel)}
        return cls(**fields, h=h, first=first, last=last, stop=stop, ready=ready)

    # With ``ready``, the parameters arrive made ready for the whole step (gathered over fsdp's
    # axes, varying over the axes that sum gradients: ``pipe._ready``): no unit gathers or
    # enters them again.

    def _materialise_all(self, params, used=None):
        if not self.ready:
            return super()._materialise_all(params, used)
        return jax.tree.map(lambda p: p.replace(ready=True) if is_param(p) else p, params,
                            is_leaf=is_param)  # fmt: skip

    def _materialise(self, p):
        return p.replace(ready=True) if self.ready else super()._materialise(p)

    def split_dim(self, spec):
        return None if self.ready else super().split_dim(spec)

    def scan(self, fn, params, x, *, outputs: bool = False):
        """This stage's layers on its input; with ``outputs``, also their outputs ``[L_pipe,
        …]`` (the model's auxiliary losses then cover this stage's layers alone)."""
        if self.h is None:  # the stacked layers' input type only (``entry_type``)
            raise _Entry(jax.typeof(x))
        if self.outputs:
            raise ValueError(
                "pp: the model's forward calls ctx.scan twice; pipeline parallelism cuts the "
                "model at its one stack of layers. Stack every block in one ctx.scan, or train "
                "the model without pp"
            )
        # Unrolled: a scan's stacked residuals would be zero-initialised by copies XLA:CPU
        # schedules at the program's start, one set per backward phase, so 1F1B's memory
        # would grow with M (benchmarks/pipeline_memory.py); unrolled, it stays flat.
        out = self.scan_layers(fn, params, jnp.where(self.first, x, self.h), outputs=outputs,
                               unroll=True)  # fmt: skip
        h, outs = out if outputs else (out, None)  # h[b, S, D]
        self.outputs.append(h)
        if self.stop:
            raise StageExit
        h = jnp.where(self.last, h, jnp.zeros_like(h))
        return (h, outs) if outputs else h


@jax.custom_vjp
def lookup(table, ids):
    """``table[ids]`` as ``jnp.take`` (``table[V, D]``, ``ids[b, S]`` → ``x[b, S, D]``), whose
    gradient ``dtable[V, D]`` is scattered into zeros XLA cannot compute before ``dx``.

    ``jnp.take``'s own gradient scatters into a constant ``zeros[V, D]``: XLA makes one constant
    for every backward phase of the pipeline, copies it once per phase (the scatter-add writes
    in place) and schedules every copy at the program's start, so each phase's ``V·D`` buffer
    lived from the start to its phase (temp growing by ``V·D`` a backward phase: 1F1B by one a
    microbatch, circular by V). Tied to ``dx`` (a zero whose range XLA does not know, as
    ``shardops.pipeline``'s cuts are tied), each phase's zeros are made in that phase. The table
    must vary over every axis ``ids`` vary over (``PipeKind.embed`` checks): ``dtable`` varies
    as ``dx``."""
    return jnp.take(table, ids, axis=0)  # x[b, S, D]


def _lookup_fwd(table, ids):
    # table[:, :0] carries the table's rows, dtype and varying axes into the backward
    return lookup(table, ids), (ids, table[:, :0])


def _lookup_bwd(residuals, dx):
    ids, kind = residuals  # ids[b, S], kind[V, 0]
    after = zero_after(dx)  # 0, after dx
    zeros = jnp.zeros((kind.shape[0], dx.shape[-1]), dx.dtype) + after.astype(dx.dtype)
    return zeros.at[ids].add(dx, mode="drop"), None  # dtable[V, D], varying as dx


lookup.defvjp(_lookup_fwd, _lookup_bwd)


class StageExit(Exception):
    """Raised by ``StageContext.scan`` after the layers, under ``stop``."""


class _Entry(Exception):
    """Raised by ``StageContext.scan`` with the type of the stacked layers' input."""

    def __init__(self, type_):
        super().__init__("the stacked layers' input")
        self.type = type_


def entry_type(body, params, x):
    """The type (``jax.typeof``) of what the model's forward gives its stacked layers, for a
    microbatch ``x``: its forward run up to ``ctx.scan``."""
    try:
        body.forward(StageContext.of(body.ctx, None, True, True), params, x)
    except _Entry as entry:
        return entry.type
    raise ValueError(f"pp: {type(body.model).__name__}.apply never called ctx.scan; pipeline "
                     f"parallelism splits the stacked layers ctx.scan runs")  # fmt: skip
