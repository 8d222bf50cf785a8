"""Mutants: a copy of a module with one exact line replaced, loaded as a module of its own.

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
