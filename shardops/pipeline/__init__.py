"""Pipeline parallelism in one SPMD program: schedules as tables, and the per-device program
that follows one with explicit per-stage ``jax.vjp`` calls.

- ``Schedule``, ``gpipe``, ``one_f_one_b``, ``schedule`` (by name, ``SCHEDULES``): the table of
  which microbatch each stage runs forward and backward in each round; ``render``,
  ``idle_fraction``, ``bubble``, ``in_flight``.
- ``pipeline_value_and_grad``: one step's loss and gradients by a schedule, per device inside
  ``jax.shard_map`` over the pipe axis (``shardops.PIPE_AXIS``).
"""

from shardops.pipeline._executor import BACKWARD_SCOPE, FORWARD_SCOPE, pipeline_value_and_grad
from shardops.pipeline._schedule import SCHEDULES, Schedule, gpipe, one_f_one_b, schedule

__all__ = [
    "BACKWARD_SCOPE",
    "FORWARD_SCOPE",
    "SCHEDULES",
    "Schedule",
    "gpipe",
    "one_f_one_b",
    "pipeline_value_and_grad",
    "schedule",
]
