"""Error messages checked whole: what was wrong and what to do about it, not only the first
clause.

    with refused(ValueError, argument="w dim 1 (out features)", got="= 30",
                 expected="mesh axis 'model' (size 4)", fix="Pad it to 32"):
        ...

Each part is a literal phrase (no regex escaping) or a tuple of them; every one must occur in
the message, and the fix after the argument. A message whose advice carries a wrong number
(pad to 28, a multiple of 12) fails the test where a match on its first clause would pass.
"""

import contextlib

import pytest


def _phrases(part) -> tuple[str, ...]:
    return (part,) if isinstance(part, str) else tuple(part)


@contextlib.contextmanager
def refused(exc, *, argument, got, expected, fix):
    """``pytest.raises(exc)`` for a message that names the ``argument``, the value that arrived
    (``got``), the one expected (``expected``) and the ``fix``; yields the ``ExceptionInfo``."""
    with pytest.raises(exc) as info:
        yield info
    message = str(info.value)
    parts = {"argument": argument, "got": got, "expected": expected, "fix": fix}
    missing = [f"{k}: {p!r}" for k, v in parts.items() for p in _phrases(v) if p not in message]
    assert not missing, f"the message lacks {missing}:\n{message}"
    last_argument = max(message.index(p) for p in _phrases(argument))
    assert all(message.rindex(p) > last_argument for p in _phrases(fix)), (
        f"the fix should follow the argument it fixes:\n{message}"
    )
