"""The layers of the code: ``shardops`` (the library) never imports ``shardops_models`` (what is
built on it), read from the import statements of every module, at any depth of the function."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = sorted((ROOT / "shardops").rglob("*.py"))


def imported_modules(source: str) -> set[str]:
    """Every module an ``import`` or ``from … import`` anywhere in ``source`` names."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_library_has_modules_to_read():
    assert len(LIBRARY) > 20, LIBRARY


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_models(path):
    found = {m for m in imported_modules(path.read_text()) if m.split(".")[0] == "shardops_models"}
    assert not found, (
        f"{path.relative_to(ROOT)} imports {sorted(found)}: shardops must not depend on shardops_models"
    )


@pytest.mark.parametrize(
    "source",
    [
        "import shardops_models\n",
        "from shardops_models.training import _train\n",
        "def f():\n    import shardops_models.search as s\n",
        "class A:\n    def f(self):\n        from shardops_models import build\n",
    ],
)
def test_an_import_of_the_models_at_any_depth_is_found(source):
    assert any(m.split(".")[0] == "shardops_models" for m in imported_modules(source))


def test_no_import_is_an_empty_set():
    assert imported_modules("import shardops\nfrom jax import lax\nx = 'shardops_models'\n") == {
        "shardops",
        "jax",
    }


def test_every_package_folder_is_installed():
    """A wheel holds only the packages ``pyproject.toml`` lists (an editable install finds the
    others on disk, so only a real install would miss one): every folder of ``shardops`` and
    ``models`` with an ``__init__.py`` is listed, and nothing else."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    names = {"shardops": "shardops", "models": "shardops_models"}
    on_disk = {
        ".".join([names[init.parent.relative_to(ROOT).parts[0]],
                  *init.parent.relative_to(ROOT).parts[1:]])
        for top in names for init in (ROOT / top).rglob("__init__.py")
    }  # fmt: skip
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))
