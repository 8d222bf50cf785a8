"""The name lists of the API pages, so that ``docs/api/*.md`` read in a checkout (not the built
site, where mkdocstrings renders each ``::: module`` in full) says what each module holds.

    python docs/_src/api_lists.py      # rewrites the lists; tests/test_docs.py checks them

Each ``::: module`` directive gets a table above the page's directives: every public name
(the module's ``__all__``, else the classes and functions it defines) with the first paragraph
of its docstring, or, for a constant, its value. The lists sit between two HTML comments, so
the rest of the page stays hand-written.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api"
BEGIN = "<!-- names: written by `python docs/_src/api_lists.py` from the modules; do not edit -->"
END = "<!-- end of names -->"
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)
WIDTH = 160  # characters of a summary before it is cut


def public_names(module) -> list[str]:
    """``__all__`` in its order, else the classes and functions ``module`` defines."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    ]


def summary(value) -> str:
    """The first paragraph of a module's, class's or function's docstring, on one line (cut
    at ``WIDTH``); a constant's value."""
    if inspect.ismodule(value) or inspect.isclass(value) or callable(value):
        doc = inspect.getdoc(value) or ""
        text = " ".join(doc.split("\n\n")[0].split())
    elif isinstance(value, dict):
        text = f"a dict of {len(value)}: " + ", ".join(f"`{k}`" for k in value)
    else:
        text = f"`= {value!r}`" if len(repr(value)) <= WIDTH else f"a {type(value).__name__}"
    if len(text) > WIDTH:
        text = text[: WIDTH - 1].rsplit(" ", 1)[0] + " …"
    return text.replace("|", "\\|")


def table(module_name: str) -> str:
    module = importlib.import_module(module_name)
    rows = [f"| `{name}` | {summary(getattr(module, name))} |" for name in public_names(module)]
    return "\n".join([f"`{module_name}`:", "", "| name | |", "|---|---|", *rows])


def lists(text: str) -> str:
    """The names block of an API page whose text is ``text``."""
    modules = DIRECTIVE.findall(text)
    return "\n".join([BEGIN, "", "\n\n".join(table(m) for m in modules), "", END])


def written(text: str) -> str:
    """``text`` with its names block (before the first directive) as ``lists`` writes it."""
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
    else:
        first = DIRECTIVE.search(text)
        head, tail = text[: first.start()], text[first.start() :]
    return f"{head.rstrip()}\n\n{lists(text)}\n\n{tail}"


def main() -> int:
    sys.path.insert(0, str(ROOT))
    for page in sorted(API.glob("*.md")):
        text = page.read_text()
        new = written(text)
        if new != text:
            page.write_text(new)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
