"""Covering designs: the cases a parametrized test runs by default, and the full product behind
``SHARDOPS_FULL=1``.

A test over factors (meshes × strategies × policies × options …) rarely needs every combination:
a bug shows in one value of a factor, or in one pair of values of two factors. ``cover`` returns
the cases of a covering array of strength ``t``: every ``t``-tuple of values of any ``t`` factors
appears in some case (``t = 2``: every pair of values, so every value, appears). By default
``t = min(2, number of factors − 1)``: with two factors every value of each appears (a pair
would be the whole product); with three or more, every pair. Under ``SHARDOPS_FULL=1`` it is
the full product, in the same order, run before an issue is resolved.

The design is greedy and deterministic (the same cases in every run and on every machine, so
programs compiled for one test are the ones the next one asks for): each new case is the one
that covers the most ``t``-tuples not covered yet, ties broken by product order.
"""

from __future__ import annotations

import itertools
import os

FULL = os.environ.get("SHARDOPS_FULL", "") == "1"

# The default run's compiler: XLA:CPU's LLVM back end at -O0 and its classic (not MLIR) fusion
# emitters, set in XLA_FLAGS by conftest.py for the suite and every process it starts.
# Compiling is three quarters of the suite's time; these halve it. The program is the same
# where the tests look (the collectives, their axes and bytes); the fusion and the machine
# code differ, so results move by float32 rounding (tests/test_compiler.py measures both). The
# full sweep compiles as a user does, with XLA's defaults.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def cover(*factors, t: int | None = None, full: bool | None = None, valid=None) -> list[tuple]:
    """Cases over ``factors`` (each a sequence of values): a ``t``-wise covering array, or the
    full product under ``SHARDOPS_FULL=1`` (or ``full=True``).

    ``valid(*case)``, if given, keeps only the cases it accepts (a strategy only on the meshes
    it has axes for): then every ``t``-tuple that some valid case holds appears.
    """
    factors = [list(f) for f in factors]
    if any(not f for f in factors):
        raise ValueError("cover: every factor needs at least one value")
    # Work on value indices, so that values need not be hashable (option dicts, meshes).
    product = [
        c for c in itertools.product(*(range(len(f)) for f in factors))
        if valid is None or valid(*(f[i] for f, i in zip(factors, c, strict=True)))
    ]  # fmt: skip
    if not product:
        raise ValueError("cover: no valid case")
    k = len(factors)
    t = min(2, k - 1) if t is None else t
    if (FULL if full is None else full) or k == 1 or t >= k:
        chosen = product
    else:
        t = max(t, 1)
        groups = list(itertools.combinations(range(k), t))
        todo = {(g, tuple(case[i] for i in g)) for case in product for g in groups}
        chosen = []
        while todo:
            best = max(
                product,
                key=lambda case: sum((g, tuple(case[i] for i in g)) in todo for g in groups),
            )
            chosen.append(best)
            todo -= {(g, tuple(best[i] for i in g)) for g in groups}
        chosen.sort(key=product.index)
    return [tuple(f[i] for f, i in zip(factors, c, strict=True)) for c in chosen]


def covered(cases, *factors, t: int, valid=None) -> bool:
    """Whether every ``t``-tuple of values of any ``t`` of ``factors`` (that a ``valid`` case
    holds) appears in ``cases``."""
    product = [c for c in itertools.product(*factors) if valid is None or valid(*c)]
    for g in itertools.combinations(range(len(factors)), t):
        want = {tuple(c[i] for i in g) for c in product}
        if want - {tuple(case[i] for i in g) for case in cases}:
            return False
    return True


def cover_meshes(meshes, *factors, t: int | None = None, full: bool | None = None) -> list[tuple]:
    """``cover`` with each mesh shape as two factors, its data-axis size (``None`` on a 1-axis
    mesh ``(model,)``) and its model-axis size: every option then meets every model size and
    every data size, without every pair of (mesh, option). Returns ``(mesh_shape, *values)``."""
    axes = [(None, m[0]) if len(m) == 1 else tuple(m) for m in meshes]
    data = list(dict.fromkeys(d for d, _ in axes))
    model = list(dict.fromkeys(m for _, m in axes))
    cases = cover(data, model, *factors, t=t, full=full, valid=lambda d, m, *_: (d, m) in axes)
    return [(meshes[axes.index((d, m))], *rest) for d, m, *rest in cases]
