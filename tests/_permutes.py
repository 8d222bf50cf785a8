"""Which way the collective-permutes of a compiled program go round a ring of mesh devices.

A ring option that only changes the schedule (``bidirectional=True`` sends half of each block
each way) gives the same values and the same bytes as a one-way ring, so value and budget
tests cannot tell them apart; the compiled program's ``source_target_pairs`` can.
"""

import re
from collections import Counter

import numpy as np

# A collective-permute (or the -start of an async one) and its source → target pairs, in the
# program's logical device ids (positions in ``mesh.devices.flat``).
_PERMUTE = re.compile(
    r"collective-permute(?:-start)?\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}"
)


def permute_shifts(hlo_text: str, mesh, axis: str) -> Counter:
    """``{shift: count}`` over the compiled program's collective-permutes that move data along
    ``axis``: each sends device i to device i + shift along it (shift in (−n/2, n/2], so a
    step one way is +1 and one the other way −1). A permute that moves along another axis, or
    by different shifts for different devices, is an ``AssertionError``."""
    names = list(mesh.axis_names)
    k, n = names.index(axis), mesh.shape[axis]
    shifts: Counter = Counter()
    for pairs in _PERMUTE.findall(hlo_text):
        found = set()
        for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs):
            ca = np.unravel_index(int(a), mesh.devices.shape)
            cb = np.unravel_index(int(b), mesh.devices.shape)
            others = [i for i in range(len(names)) if i != k]
            assert all(ca[i] == cb[i] for i in others), f"a permute across {names}: {pairs}"
            found.add((int(cb[k]) - int(ca[k])) % n)
        found.discard(0)
        if not found:
            continue  # a permute that moves nothing
        assert len(found) == 1, f"a permute with several shifts along {axis!r}: {pairs}"
        shift = found.pop()
        shifts[shift if shift <= n // 2 else shift - n] += 1
    return shifts


def check_ring_directions(shifts: Counter, bidirectional: bool, what: str) -> None:
    """One-way rings step +1 only; bidirectional rings as many +1 as −1 steps."""
    assert shifts, f"{what}: no collective-permute moves data"
    if bidirectional:
        assert set(shifts) == {1, -1} and shifts[1] == shifts[-1], (
            f"{what}: a bidirectional ring must send as many blocks each way; got {dict(shifts)}"
        )
    else:
        assert set(shifts) == {1}, f"{what}: a one-way ring steps i → i + 1; got {dict(shifts)}"
