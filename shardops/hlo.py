"""Diagnostics: the compiled-HLO and lowered-module readers behind ``shardops.collectives``,
``shardops.ledger`` and ``shardops.explain``, for tools of your own.

    from shardops import hlo
    hlo.hlo_collectives(compiled.as_text(), mesh)      # [Collective(kind, axes, shapes, bytes, …)]
    hlo.lowered_collectives(lowered.as_text(), mesh)   # what the program asked for
    hlo.pass_of(op_name)                               # "forward", "backward" or "optimizer"
"""

from shardops._hlo import KINDS, Collective, hlo_collectives, lowered_collectives
from shardops._passes import PASSES, pass_of, split_op_name

__all__ = [
    "KINDS",
    "PASSES",
    "Collective",
    "hlo_collectives",
    "lowered_collectives",
    "pass_of",
    "split_op_name",
]
