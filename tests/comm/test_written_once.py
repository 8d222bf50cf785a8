"""Communication written once: outside ``shardops/comm`` no code in ``shardops/`` or ``models/``
names one of ``lax``'s collectives (``psum``, ``pmax``, ``pmin``, ``all_gather``,
``psum_scatter``, ``all_to_all``, ``ppermute``) in any spelling (``lax.psum``, ``jax.lax.psum``,
``from jax.lax import psum``, an alias of any of them), called or passed on. Every collective
goes through a named mapping of ``shardops.comm`` (``all_reduce``, ``reduce_from_region``, …),
each carrying its ``Reason``, so ``explain`` and the budgets read them from one place.

The source is read with ``ast`` (docstrings, comments and strings never count); a violation is
named ``path:line``. ``ALLOWED`` lists the files that may call ``lax`` directly and why; a file there with no raw
collective left fails too, so the list only shrinks.
"""

import ast
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("shardops", "models")
COMM = "shardops/comm/"
COLLECTIVES = frozenset(
    {"psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute"}
)

ALLOWED = {
    # measures each collective's time on the hardware: the raw op is the thing being timed
    "models/search/_hardware.py": "the planner's microbenchmark times lax's collectives themselves",
}


def raw_collectives(source: str) -> list[tuple[int, str]]:
    """``(line, spelling)`` of every reference to a ``jax.lax`` collective in ``source``."""
    tree = ast.parse(source)
    # local name → the dotted module or object it stands for
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
            full = dotted(node)
            if full is None:
                continue
            module, _, name = full.rpartition(".")
            if module in ("jax.lax", "jax._src.lax.parallel") and name in COLLECTIVES:
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def scan(root: pathlib.Path) -> dict[str, list[tuple[int, str]]]:
    """Every ``.py`` file under ``root``'s packages outside ``shardops/comm`` with raw
    collectives: relative path → its ``(line, spelling)``s."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(COMM):
                continue
            hits = raw_collectives(path.read_text())
            if hits:
                out[rel] = hits
    return out


def problems(root: pathlib.Path) -> list[str]:
    found = scan(root)
    out = [
        f"{path}:{line}: {spelling} (route it through a shardops.comm mapping with its Reason, "
        f"e.g. shardops.comm.all_reduce(x, axis, reason=...))"
        for path, hits in found.items()
        if path not in ALLOWED
        for line, spelling in hits
    ]
    out += [f"{path} is in ALLOWED but has no raw collective: remove it" for path in ALLOWED
            if path not in found]  # fmt: skip
    return out


def test_every_collective_goes_through_shardops_comm():
    assert not problems(ROOT), "\n".join(problems(ROOT))


@pytest.mark.parametrize(
    "source",
    [
        "from jax import lax\nlax.psum(x, 'i')",
        "import jax\ny = jax.lax.pmax(x, 'i')",
        "from jax.lax import psum_scatter\npsum_scatter(x, 'i')",
        "from jax.lax import ppermute as pp\npp(x, 'i', [])",
        "import jax.lax as L\nL.all_to_all(x, 'i', 0, 1)",
        "from jax import lax as jl\nf = jl.all_gather",  # passed on, not called: still raw
        "import jax\njax.tree.map(lambda t: jax.lax.pmin(t, 'i'), x)",
    ],
)
def test_every_spelling_is_found(source):
    assert [line for line, _ in raw_collectives(source)] == [2]


@pytest.mark.parametrize(
    "source",
    [
        '"""lax.psum(x) in a docstring"""\nfrom jax import lax\ny = lax.axis_index("i")',
        "from shardops.comm import all_reduce\ny = all_reduce(x, 'i', reason=r)",
        "psum = 3\ny = psum + 1  # a local name",
        "# lax.psum(x, 'i')\nx = 'lax.ppermute'",
    ],
)
def test_what_is_not_a_raw_collective(source):
    assert raw_collectives(source) == []


def _copy(tmp_path) -> pathlib.Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return tmp_path


def test_a_raw_call_added_is_named_by_file_and_line(tmp_path):
    root = _copy(tmp_path)
    assert not problems(root)  # the unmutated copy passes
    target = root / "shardops/layers/_dense_kernels.py"
    lines = target.read_text().splitlines()
    added = ["from jax import lax as _lax", "_ = _lax.psum(1.0, 'model')", ""]
    target.write_text("\n".join([*lines, *added]))
    assert problems(root) == [
        f"shardops/layers/_dense_kernels.py:{len(lines) + 2}: _lax.psum (route it through a "
        "shardops.comm mapping with its Reason, e.g. shardops.comm.all_reduce(x, axis, "
        "reason=...))"
    ]


def test_an_allowed_file_without_raw_calls_must_leave_the_list(tmp_path):
    root = _copy(tmp_path)
    allowed = sorted(ALLOWED)[0]
    (root / allowed).write_text("x = 1\n")
    assert problems(root) == [f"{allowed} is in ALLOWED but has no raw collective: remove it"]
