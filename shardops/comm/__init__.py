"""Communication patterns for per-device code inside ``jax.shard_map``, each defined once.

- **Collectives**: ``all_reduce``, ``all_max``, ``all_min``, ``all_gather``, ``reduce_scatter``,
  ``all_to_all``, ``ring_pass`` and ``send`` are ``lax``'s own calls (``psum``, ``pmax``, ``pmin``,
  ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``) with a required
  ``reason=``: nothing in shardops calls ``lax``'s collectives but this package.
- **Regions** (Megatron's ``mappings.py``): ``copy_to_region``, ``gather_to_region`` and
  ``gather_many_to_region`` enter a model-parallel region, forward and backward side by side,
  with every gradient reduction in the accumulation dtype; ``reduce_from_region``,
  ``reduce_scatter_from_region`` and ``gather_from_region`` leave one.
- **Rings** of ``lax.ppermute``: ``ring_all_gather``, ``ring_reduce_scatter``, ``ring_all_reduce``
  (one-way or bidirectional), equal to the builtins and spelling out what they hide.
- **Collective matmul**: ``all_gather_matmul`` and ``matmul_reduce_scatter`` interleave a ring's
  steps with blocks of the matmul.
- **Reasons**: ``with because(Reason(...), axis_name):`` says, next to a collective, why it runs;
  ``shardops.inspect.explain`` reads it back from the program (``REASONS``: every one made).
  Shared by many kernels: ``REPLICATED_INPUT`` (a replicated ``x``'s partial ``dx`` summed) and
  ``REPLICATED_GRADIENT`` (the fallback for a replicated value's gradient sum).
"""

from shardops.comm._collective_matmul import all_gather_matmul, matmul_reduce_scatter
from shardops.comm._collectives import (
    all_gather,
    all_max,
    all_min,
    all_reduce,
    all_to_all,
    reduce_scatter,
    ring_pass,
    send,
)
from shardops.comm._mappings import (
    REPLICATED_GRADIENT,
    REPLICATED_INPUT,
    copy_to_region,
    gather_from_region,
    gather_many_to_region,
    gather_to_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import REASONS, Reason, because
from shardops.comm._ring import ring_all_gather, ring_all_reduce, ring_pairs, ring_reduce_scatter

__all__ = [
    "REASONS",
    "REPLICATED_GRADIENT",
    "REPLICATED_INPUT",
    "Reason",
    "all_gather",
    "all_gather_matmul",
    "all_max",
    "all_min",
    "all_reduce",
    "all_to_all",
    "because",
    "copy_to_region",
    "gather_from_region",
    "gather_many_to_region",
    "gather_to_region",
    "matmul_reduce_scatter",
    "reduce_from_region",
    "reduce_scatter",
    "reduce_scatter_from_region",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_pairs",
    "ring_pass",
    "ring_reduce_scatter",
    "send",
]
