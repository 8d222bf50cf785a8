"""Mutants: a copy of a module with one exact line replaced, loaded as a module of its own
(``mutant``), copies of the training modules that ``build`` runs (``training``), and copies of
any modules of a package, one of them mutated (``copies``).

The line must occur exactly once in the real source, so a mutant cannot drift from the code
it mutates without its test failing.
"""

import inspect
import sys
import types


def mutant(module: types.ModuleType, name: str, line: str, replacement: str) -> types.ModuleType:
    source = inspect.getsource(module)
    assert source.count(line) == 1, f"mutant {name}: line not found once in {module.__name__}"
    out = types.ModuleType(f"{module.__name__}_{name}")
    sys.modules[out.__name__] = out  # dataclasses look their module up while they are built
    out.__file__ = getattr(module, "__file__", None)  # a script's paths are relative to it
    exec(compile(source.replace(line, replacement), f"<mutant {name}>", "exec"), out.__dict__)
    return out


TRAINING = ("_optimizer", "_tokens", "_placement", "_setup", "_step", "_train")
"""The modules of ``models/training`` that ``build`` runs, each importing only earlier ones
(``_state``'s ``TrainState`` and ``Metrics`` stay the real ones: a state made outside the copy
must fit its step)."""


def training(name: str, line: str | None = None, replacement: str | None = None, **names):
    """A copy of ``models/training/_train.py`` whose ``build`` runs copies of every module of
    ``TRAINING``: the one module holding ``line`` (exactly once, among them all) has it replaced
    by ``replacement``, and every copy takes ``names`` (name → object, e.g. a mutated
    ``Parallel``) in place of what it imported under those names. Each copy reaches the others'
    names through the copies, so a mutated ``_Body`` or ``Padding`` is the one ``build`` uses."""
    return copies("shardops_models.training", TRAINING, name, line, replacement, **names)["_train"]


def copies(
    package: str,
    modules,
    name: str,
    line: str | None = None,
    replacement: str | None = None,
    **names,
) -> dict[str, types.ModuleType]:
    """Copies of ``package``'s ``modules`` (each importing only earlier ones), by name: the one
    module holding ``line`` (exactly once, among them all) has it replaced by ``replacement``,
    every copy takes ``names`` in place of what it imported under those names, and each copy
    reaches the others' names through the copies."""
    import importlib

    real = {m: importlib.import_module(f"{package}.{m}") for m in modules}
    if line is not None:
        holding = [m for m, mod in real.items() if inspect.getsource(mod).count(line) == 1]
        total = sum(inspect.getsource(mod).count(line) for mod in real.values())
        assert len(holding) == 1 and total == 1, (
            f"mutant {name}: line found {total} times in {package}'s {', '.join(modules)}"
        )
    made = {}
    for m, mod in real.items():
        source = inspect.getsource(mod)
        if line is not None and source.count(line) == 1:
            source = source.replace(line, replacement)
        out = types.ModuleType(f"{mod.__name__}_{name}")
        sys.modules[out.__name__] = out  # dataclasses look their module up while they are built
        out.__file__ = mod.__file__
        exec(compile(source, f"<copy {name}: {m}>", "exec"), out.__dict__)
        made[m] = out
    originals = {id(v): (m, k) for m, mod in real.items() for k, v in vars(mod).items()
                 if getattr(v, "__module__", None) == mod.__name__}  # fmt: skip
    replaced = set()
    for out in made.values():
        for k, v in list(vars(out).items()):
            if k in names:
                setattr(out, k, names[k])
                replaced.add(k)
            elif id(v) in originals:
                m, key = originals[id(v)]
                setattr(out, k, getattr(made[m], key))
    assert replaced == set(names), f"copies {name}: no copy holds {set(names) - replaced}"
    return made
