"""A zero that XLA cannot compute before a given value: ordering for XLA's scheduler where the
data flow alone leaves it free.

XLA schedules an instruction whose operands are ready as early as it likes. In an unrolled
program (a pipeline's phases) that moves work to the program's start and keeps its result
alive until it is used: a constant ``zeros[V, D]`` that a scatter-add writes in place is copied
once per use, and every copy is made at the start; a slice of a parameter at an index known in
advance is cut at the start. Adding ``zero_after(x)`` (to an index, or to the zeros) makes the
work wait for ``x`` at the cost of one scalar op, whatever the backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zero_after(x) -> jax.Array:
    """An int32 zero that XLA cannot compute before ``x`` (varying over ``x``'s mesh axes):
    ``min(isnan(max(x[:2])), 0)``, whose range XLA does not know. Should XLA learn to fold it,
    the work it orders would move to the program's start again: tests/strategies/
    test_pipeline_memory.py's and tests/test_benchmark_pipeline_memory.py's mutants show what
    that costs.

    Taken of a reduction, which XLA computes once into a scalar: ``isnan(x[0])`` alone is an
    elementwise chain from ``x`` that XLA duplicates into each consumer of what it ties, and a
    consumer it schedules late then keeps ``x`` alive to it (under tp + pp, a backward phase's
    labels read fused into its loss, behind the vocab-parallel cross entropy's psums that XLA
    combines into one all-reduce at the program's end: every forward phase's output lived to
    the end, one stage input a microbatch)."""
    first = x.reshape(-1)[:2]  # (one element if x has one)
    return jnp.minimum(jnp.isnan(jnp.max(first)).astype(jnp.int32), 0)
