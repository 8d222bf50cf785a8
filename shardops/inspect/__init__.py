"""Seeing what a sharded program does: its collectives, their bytes and passes, the layout of
its arrays, and where it first differs from its unsharded twin.

- **Collectives**: ``collectives(mesh, fn, *args)`` lists what the compiled program runs;
  ``ledger`` adds mesh axes, passes and ring bytes; ``explain`` says each in plain words.
  ``hlo_collectives`` / ``lowered_collectives`` read HLO and StableHLO text of your own.
  ``traced_ledger`` / ``traced_collectives`` read the same from the traced jaxpr, compiling
  nothing (an ``AbstractMesh`` will do): the collective budget of any step.
- **Layouts**: ``show_layout`` / ``layout_table`` / ``layouts`` print where every leaf of a tree
  lives; ``layout_png`` draws weight tilings.
- **The divergence locator**: ``tap`` marks activations in a model, ``compare`` runs a sharded
  and an unsharded twin and reports the first tap out of bound; ``first_non_finite`` runs one
  and names the first tap output, loss or gradient that holds a NaN or an inf.
"""

from shardops.inspect._explain import explain
from shardops.inspect._hlo import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_PERMUTE,
    KINDS,
    REDUCE_SCATTER,
    Collective,
    collectives,
    hlo_collectives,
    lowered_collectives,
)
from shardops.inspect._ledger import Ledger, ledger, ring_bytes
from shardops.inspect._locate import (
    NonFiniteReport,
    Report,
    compare,
    first_non_finite,
    tap,
    tapping,
)
from shardops.inspect._passes import OPTIMIZER_SCOPE, PASSES, pass_of, split_op_name
from shardops.inspect._traced import (
    KEEP_REMAT,
    PRIMITIVE_KINDS,
    RUNS_AS,
    jaxpr_collectives,
    runs_as,
    traced_collectives,
    traced_ledger,
)
from shardops.inspect._views import (
    LeafLayout,
    grid_sharding,
    layout_png,
    layout_table,
    layouts,
    show_layout,
    tiles_of,
)

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVE_PERMUTE",
    "KEEP_REMAT",
    "KINDS",
    "OPTIMIZER_SCOPE",
    "PASSES",
    "PRIMITIVE_KINDS",
    "REDUCE_SCATTER",
    "RUNS_AS",
    "Collective",
    "LeafLayout",
    "Ledger",
    "NonFiniteReport",
    "Report",
    "collectives",
    "compare",
    "explain",
    "first_non_finite",
    "grid_sharding",
    "hlo_collectives",
    "jaxpr_collectives",
    "layout_png",
    "layout_table",
    "layouts",
    "ledger",
    "lowered_collectives",
    "pass_of",
    "ring_bytes",
    "runs_as",
    "show_layout",
    "split_op_name",
    "tap",
    "tapping",
    "tiles_of",
    "traced_collectives",
    "traced_ledger",
]
