"""The worst errors of passing checks, which the check modules gather for the report at the end of
a run (tests/conftest.py), and their trip from xdist workers to the controller."""


def figures() -> dict[str, dict]:
    """The check modules' tables, by name."""
    from _attention_checks import NORM_WORST
    from _attention_checks import WORST as ATTENTION_WORST
    from _dense_checks import WORST
    from _model_checks import TRAJECTORY_ERRORS
    from _vocab_checks import WORST as VOCAB_WORST

    return {
        "layers": WORST,
        "vocab": VOCAB_WORST,
        "attention": ATTENTION_WORST,
        "norms": NORM_WORST,
        "trajectories": TRAJECTORY_ERRORS,
    }


def worse(old, new):
    """The worse of two figures of one key: a ``(ratio, abs, where)`` by its ratio, a ratio, or a
    dict of errors field by field."""
    if old is None:
        return new
    if isinstance(new, dict):
        return {k: max(new.get(k, 0.0), old.get(k, 0.0)) for k in {*new, *old}}
    if isinstance(new, tuple):
        return new if new[0] > old[0] else old
    return max(old, new)


def _listed(value):
    return list(value) if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(value) if isinstance(value, list) else value


def sendable(tables: dict[str, dict]) -> dict[str, list]:
    """``tables`` as lists of (key, value) pairs of lists, which execnet carries (tuple keys)."""
    return {name: [(_listed(k), _listed(v)) for k, v in t.items()] for name, t in tables.items()}


def merge(tables: dict[str, dict], sent: dict[str, list]) -> None:
    """Fold a worker's ``sendable`` figures into ``tables``, keeping the worse one per key."""
    for name, items in sent.items():
        table = tables[name]
        for key, value in items:
            key, value = _tupled(key), _tupled(value)
            table[key] = worse(table.get(key), value)
