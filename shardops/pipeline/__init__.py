"""Pipeline parallelism in one SPMD program: schedules as tables, and the per-device program
that follows one with explicit per-stage ``jax.vjp`` calls.

- ``Schedule``, ``gpipe``, ``one_f_one_b``, ``circular``, ``schedule`` (by name,
  ``SCHEDULES``): the table of which microbatch each stage runs forward and backward in each
  round (on which virtual stage, for ``circular``); ``render``, ``idle_fraction``, ``bubble``,
  ``in_flight``.
- ``stage_order``: the stored order of the stacked layers that gives each stage its circular
  chunks as one contiguous block.
- ``pipeline_value_and_grad``: one step's loss and gradients by a schedule, per device inside
  ``jax.shard_map`` over the pipe axis (``shardops.PIPE_AXIS``).
- ``zero_after``: an int32 zero that XLA cannot compute before a value, to keep a phase's work
  (a gradient's zeros, a cut) in its phase instead of at the program's start.
"""

from shardops._after import zero_after
from shardops.pipeline._executor import BACKWARD_SCOPE, FORWARD_SCOPE, pipeline_value_and_grad
from shardops.pipeline._schedule import (
    SCHEDULES,
    Schedule,
    circular,
    gpipe,
    one_f_one_b,
    schedule,
    stage_order,
)

__all__ = [
    "BACKWARD_SCOPE",
    "FORWARD_SCOPE",
    "SCHEDULES",
    "Schedule",
    "circular",
    "gpipe",
    "one_f_one_b",
    "pipeline_value_and_grad",
    "schedule",
    "stage_order",
    "zero_after",
]
