"""The README and the docs/ site: every ```python block runs as written, and the site builds.

Blocks of one page run in order in one namespace (each page in a fresh one, in a temporary
working directory); a block whose first line is ``# docs: no-run`` is shown, not run, and
``NOT_RUN`` lists every such block, so the marker cannot swallow a block unnoticed. Then the
values the pages claim (the collectives of the layer example, one loss under every strategy,
the padded vocabulary's zero gradient, …) are checked in the namespaces the pages left.
"""

import contextlib
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_src" not in p.parts)]
NO_RUN = "# docs: no-run"
# Every block marked not to run: (page, a phrase of the block) → why it cannot run here.
NOT_RUN = {
    ("docs/multi-process.md", "SHARDOPS_COORDINATOR"): "a script for several hosts: "
    "tests/test_doc_commands.py runs it with the page's two launcher commands, as two hosts on loopback",
}
# A fenced block opens with ``` and an info string; its body ends at the same indentation.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)  # fmt: skip


def rel(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


def fences(page: pathlib.Path, text: str | None = None):
    """(info string, first line number of the body, body) of every fenced block of ``page``
    (or of ``text``, given as the page's)."""
    text = page.read_text() if text is None else text
    for m in FENCE.finditer(text):
        body = "".join(
            line[len(m["indent"]) :] if line.startswith(m["indent"]) else line
            for line in m["body"].splitlines(keepends=True)
        )
        yield m["info"].strip(), text.count("\n", 0, m.start("body")) + 1, body


def python_blocks(page: pathlib.Path):
    """(line, body, runs) of the ```python blocks of ``page``."""
    return [
        (line, body, not body.startswith(NO_RUN))
        for info, line, body in fences(page)
        if info.split()[:1] == ["python"]
    ]


def requires(module: str):
    """Import ``module``; skip without it, except under CI=true, where a missing one fails."""
    if os.environ.get("CI") == "true":
        return __import__(module)
    return pytest.importorskip(module)


_RUNS: dict[str, object] = {}  # page → its namespace, or the exception its blocks raised


def run_page(page: str, tmp_path_factory) -> dict:
    """The namespace ``page``'s python blocks leave, run once per session."""
    if page not in _RUNS:
        namespace: dict = {"__name__": f"docs:{page}"}
        path = ROOT / page
        try:
            with contextlib.chdir(tmp_path_factory.mktemp(path.stem)):
                for line, body, runs in python_blocks(path):
                    if runs:  # padded so that a traceback names the page's own line
                        exec(compile("\n" * (line - 1) + body, str(path), "exec"), namespace)
        except BaseException as e:
            _RUNS[page] = e
            raise
        _RUNS[page] = namespace
    if isinstance(_RUNS[page], BaseException):
        pytest.fail(f"{page}'s blocks failed: {_RUNS[page]!r} (see test_python_blocks_run)")
    return _RUNS[page]


RUNNABLE = [rel(p) for p in PAGES if any(runs for _, _, runs in python_blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE)
def test_python_blocks_run(page, tmp_path_factory):
    run_page(page, tmp_path_factory)


def test_every_page_with_code_is_run_and_no_python_block_hides_under_another_name():
    assert {"README.md", "docs/layers.md", "docs/strategies.md"} <= set(RUNNABLE)
    for page in PAGES:
        for info, line, _ in fences(page):
            lang = info.split()[:1]
            assert lang != ["py"] and lang != ["python3"] and lang != ["pycon"], (
                f"{rel(page)}:{line}: write ```python (only those run)"
            )
            assert "```" not in info, f"{rel(page)}:{line}: unbalanced fence"


def test_the_no_run_marker_covers_exactly_the_listed_blocks():
    marked = [
        (rel(page), line, body)
        for page in PAGES
        for line, body, runs in python_blocks(page)
        if not runs
    ]
    found = {}
    for page, line, body in marked:
        compile(body, f"{page}:{line}", "exec")  # shown, not run: still valid Python
        keys = [k for k in NOT_RUN if k[0] == page and k[1] in body]
        assert len(keys) == 1, f"{page}:{line}: a no-run block that NOT_RUN does not list"
        assert keys[0] not in found, f"{page}:{line}: two no-run blocks match {keys[0]}"
        found[keys[0]] = line
    assert set(found) == set(NOT_RUN), f"listed but not marked: {set(NOT_RUN) - set(found)}"
    runnable = sum(runs for page in PAGES for _, _, runs in python_blocks(page))
    assert runnable >= 10 * len(marked), (runnable, len(marked))


def test_the_index_table_and_the_readme_list_every_page():
    """Each page of docs/ (but the index and the API pages) is a row of docs/index.md's page
    table and a link of the README's "Read on" list."""
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    index = (ROOT / "docs" / "index.md").read_text()
    table = set(re.findall(r"^\| \[[^]]+\]\(([a-z-]+\.md)\)", index, re.M))
    assert pages - table == set(), f"docs/index.md's table lacks {sorted(pages - table)}"
    readme = (ROOT / "README.md").read_text()
    read_on = readme[readme.index("## Read on") :]
    listed = set(re.findall(r"\(docs/([a-z-]+\.md)\)", read_on))
    assert pages - listed == set(), f"the README's Read on lacks {sorted(pages - listed)}"


def test_readme_is_short_and_starts_with_the_set_up_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    ci = (ROOT / ".ci" / "run").read_text()
    install = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[examples,test]"'
    assert install in ci and "\npython -m pytest\n" in ci + "\n"
    setup = next(body for info, _, body in fences(README) if info == "bash")  # the first
    assert [line.split("#")[0].strip() for line in setup.splitlines()] == [
        install,
        "python examples/mlp_2d.py",
        "python -m pytest",
    ]
    assert "Test set accuracy 0.8280" in text and "Epoch 19 in" in text


def page_commands(page: pathlib.Path, text: str | None = None) -> list[tuple[int, list[str]]]:
    """(line, words) of each ``python …`` command in the page's bash and text blocks: lines
    continued with ``\\`` joined, a ``$ `` or ``host0$ `` prompt, comments and ``&`` dropped."""
    found = []
    for info, start, body in fences(page, text):
        if info not in ("bash", "text"):
            continue
        for i, line in enumerate(body.replace("\\\n", " ").splitlines()):
            line = re.sub(r"^\w*\$ ", "", line.strip())
            if line.startswith("python "):
                found.append((start + i, [w for w in shlex.split(line, comments=True) if w != "&"]))
    return found


class _Parsed(Exception):
    """Raised by ``parse_args`` once a command line has parsed: nothing after it runs."""


def _parses(main, argv: list[str], monkeypatch) -> None:
    """``main(argv)`` up to its parser: its ``parse_args`` runs (exit 2 on a bad flag)."""
    import argparse

    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(_Parsed):
        main(argv)
    monkeypatch.undo()


def command_problems(page: pathlib.Path, monkeypatch, text: str | None = None) -> list[str]:
    """What is wrong with each ``python …`` command of ``page`` (``test_every_command…``)."""
    from _resume_checks import load_example

    from shardops import launch
    from shardops_models.search import _cli

    problems = []
    for line, words in page_commands(page, text):
        where = f"{rel(page)}:{line}: {shlex.join(words)}"
        if words[:3] == ["python3", "-m", "venv"] or words == ["python", "-m", "pytest"]:
            continue  # the set-up CI runs (test_readme_is_short_and_starts_with_the_set_up…)
        command = words[1:]
        try:
            assert words[0] == "python", "not `python …`"
            if command[:2] == ["-m", "shardops.launch"]:
                split = command.index("--")
                args, extra = launch._parser().parse_known_args(command[2:split])
                assert not extra, f"the launcher has no {extra}"
                launch.devices_per_process(args.devices, args.nproc)
                if args.coordinator:
                    launch.parse_coordinator(args.coordinator)
                command = command[split + 1 :]
            if command == ["train.py"] and rel(page) == "docs/multi-process.md":
                continue  # the page's script, which names no flags
            if command[:2] == ["-m", "shardops_models.search"]:
                main, flags = _cli.main, command[2:]
            else:
                name = re.fullmatch(r"examples/(\w+)\.py", command[0])
                assert name and (ROOT / command[0]).exists(), "not an example"
                main, flags = load_example(name[1]).main, command[1:]
            _parses(main, flags, monkeypatch)
        except (AssertionError, ValueError, SystemExit) as e:
            problems.append(f"{where}: {type(e).__name__} {e}")
    return problems


def test_every_command_the_pages_show_parses(monkeypatch):
    """The ``python …`` commands in bash and text blocks of the README and every page (which
    the blocks' tests cannot run: they train for minutes, or need several hosts) name a script
    or module that exists and flags its parser takes: an example's, the launcher's (its
    ``--devices`` and ``--coordinator`` too), the strategy search's; ``train.py`` is the
    multi-process page's script. tests/test_doc_commands.py runs them all."""
    commands = sum(len(page_commands(page)) for page in PAGES)
    assert commands >= 30, commands
    assert [p for page in PAGES for p in command_problems(page, monkeypatch)] == []


@pytest.mark.parametrize(("page", "old", "new"), [
    ("docs/getting-started.md", "--compare-reference --steps 300", "--compare --steps 300"),
    ("docs/diagnostics.md", "--bug extra-psum --layer 5", "--bug extra_psum --layer 5"),
    ("docs/strategy-search.md", "--hardware h100-ib", "--hardware-preset h100-ib"),
    ("docs/multi-process.md", "-n 2 -- examples/transformer_lm.py", "-n 2 examples/transformer_lm.py"),
    ("docs/resilience.md", "--checkpoint-every 5 &", "--checkpoint-every five &"),
    ("docs/strategies.md", "examples/mlp_2d.py --strategy hsdp_tp --mesh 4x2", "examples/mlp2d.py --strategy hsdp_tp --mesh 4x2"),
])  # fmt: skip
def test_a_command_out_of_date_is_caught(monkeypatch, page, old, new):
    text = (ROOT / page).read_text()
    assert text.count(old) == 1, old
    assert len(command_problems(ROOT / page, monkeypatch, text.replace(old, new))) == 1


def _api_lists():
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_lists", ROOT / "docs/_src/api_lists.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_pages_list_every_public_name_as_the_modules_give_them():
    """docs/api/*.md read in a checkout list each documented module's public names (its
    ``__all__``) with their docstrings' first paragraphs, as ``docs/_src/api_lists.py``
    writes them now: a name added, removed or redocumented without rewriting them fails."""
    api_lists = _api_lists()
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    assert len(pages) >= 13
    stale = [rel(page) for page in pages if api_lists.written(page.read_text()) != page.read_text()]
    assert not stale, f"run `python docs/_src/api_lists.py`: stale name lists in {stale}"
    models_page = (ROOT / "docs/api/models.md").read_text()
    import shardops_models

    for name in shardops_models.__all__:
        assert f"| `{name}` |" in models_page, name


@pytest.mark.parametrize(("old", "new"), [
    ("| `PAD_LABEL` | `= -1` |\n", ""),  # a name missing
    ("| `seed_sgd` | The seed's optimizer", "| `seed_sgd` | The optimizer"),  # an old summary
])  # fmt: skip
def test_a_stale_api_list_is_caught(old, new):
    text = (ROOT / "docs/api/models.md").read_text()
    assert text.count(old) == 1, old
    mutated = text.replace(old, new)
    assert _api_lists().written(mutated) != mutated


# Every block that shows text (a run's output, a message, a tree) rather than code: (page, a
# phrase of the block) → (a test file, a phrase both the block and that file hold: the test
# asserts that text), or (None, why it is shown unchecked). Commands are checked above.
SHOWN = {
    ("README.md", "Data: tfds cannot download"): ("tests/test_examples.py", "Test set accuracy "),
    ("docs/getting-started.md", "Data: tfds cannot download"): ("tests/test_examples.py",
                                                                "Test set accuracy "),
    ("docs/code-map.md", "the library (never imports shardops_models)"): (
        "tests/test_docs.py", "  _clip.py "),  # test_the_code_map_names_every_library_file…
    ("docs/diagnostics.md", "expect_collectives: loss moves"): ("tests/inspect/test_expect.py",
                                                                "1 of 3 rows"),
    ("docs/diagnostics.md", "layout"): (None, "a rich table of explain's, abridged"),
    ("docs/diagnostics.md", "┏━━━━━━━━┳"): (None, "the divergence locator's table for one bug, "
                                                  "a run's output"),
    ("docs/getting-started.md", "GPT: 2 blocks"): (None, "a 300-step run's log (minutes)"),
    ("docs/getting-started.md", "_IS_BLANK_OR_COMMENT"): (None, "a Python traceback excerpt"),
    ("docs/multi-process.md", "shardops.launch: coordinator"): ("tests/test_launch.py",
                                                               "simulated CPU device(s) per process"),
    ("docs/multi-process.md", "--checkpoint-dir /tmp/demo"): ("tests/_resume_checks.py",
                                                            "Resume: step "),
    ("docs/multi-process.md", "CheckpointMismatch"): ("tests/training/test_checkpoint.py",
                                                      "model config sizes: [16, 32, 8] in the "
                                                      "checkpoint, [16, 24, 8] here"),
    ("docs/resilience.md", "--checkpoint-every 5 &"): ("tests/_resume_checks.py", "Resume: step "),
    ("docs/resilience.md", "shardops.watchdog: process 3"): ("tests/test_resilience.py",
                                                             "process 3 is stuck: it has done 20 "
                                                             "steps and has not reached step "),
    ("docs/resilience.md", "step 3: the loss is nan"): ("tests/test_transformer_lm.py",
                                                        "the loss is nan; "),
    ("docs/resilience.md", "CheckpointDamaged: checkpoint step 6"): (
        "tests/training/test_checkpoint_damage.py", "cannot read the file "),
    ("docs/resilience.md", "falling back to step 4"): ("tests/test_transformer_lm.py",
                                                       "falling back to step "),
    ("docs/strategies.md", "--mesh replica=2,data=2,model=2"): (None, "two commands, checked "
                                                                "above; no output"),
    ("docs/adding-a-kind.md", "replicas_tp:"): ("tests/strategies/test_kinds.py",
                                                "  tp       model            each layer's"),
}  # fmt: skip


def test_every_block_of_shown_text_is_listed_and_its_test_asserts_it():
    """A block of output or messages cannot go stale unnoticed: each is listed in ``SHOWN``,
    once, and where a test asserts its text, that test's file holds a phrase of the block."""
    found = {}
    for page in PAGES:
        for info, line, body in fences(page):
            joined = body.replace("\\\n", " ").splitlines()
            lines = [re.sub(r"^\w*\$ ", "", x.strip()) for x in joined if x.strip()]
            if info.startswith("python") or (info == "bash" and all(
                    x.startswith(("python", "#")) for x in lines)):  # fmt: skip
                continue  # run, or checked by test_every_command_the_pages_show_parses
            keys = [k for k in SHOWN if k[0] == rel(page) and k[1] in body]
            assert len(keys) == 1, f"{rel(page)}:{line}: a block of shown text SHOWN lists {keys}"
            assert keys[0] not in found, f"{rel(page)}:{line}: {keys[0]} matches two blocks"
            found[keys[0]] = body
    assert set(found) == set(SHOWN), f"listed, not on the page: {set(SHOWN) - set(found)}"
    for key, (test, phrase) in SHOWN.items():
        if test is not None:
            assert phrase in found[key], f"{key}: the block lacks {phrase!r}"
            assert phrase in (ROOT / test).read_text(), f"{key}: {test} lacks {phrase!r}"


def code_map_paths(text: str) -> list[str]:
    """The files and folders the code map's tree names, as paths (nesting by indentation)."""
    (tree,) = [body for info, _, body in fences(ROOT / "docs/code-map.md", text) if info == "text"]
    stack, paths = [], []
    for line in tree.splitlines():
        m = re.match(r"( {0,12})(\w+/|\w+\.\w+)(?:,|\s|$)", line)
        if not m or m[2] == "docs/":
            continue  # a description's continuation, or the site
        depth = len(m[1]) // 2
        stack[depth:] = [m[2]]
        paths.append("".join(stack))
    return paths


def library_modules() -> set[str]:
    """shardops/'s modules; a subpackage's ``__init__.py`` goes without saying."""
    return {str(p.relative_to(ROOT)) for p in (ROOT / "shardops").rglob("*.py")
            if p.name != "__init__.py" or p.parent.name == "shardops"}  # fmt: skip


def test_the_code_map_names_every_library_file_and_no_other():
    """Each file and folder in docs/code-map.md's tree exists, and every module of the library
    (shardops/) is in it: a module added, moved or removed fails until the map says so."""
    paths = code_map_paths((ROOT / "docs/code-map.md").read_text())
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the code map names what does not exist: {missing}"
    library = library_modules()
    assert library - set(paths) == set(), f"modules the code map lacks: {library - set(paths)}"


def test_a_stale_code_map_is_caught():
    text = (ROOT / "docs/code-map.md").read_text()
    for old, new in [
        ("  _clip.py ", "  _clipping.py "),
        ("    _norms.py             layer_norm, rms_norm\n", ""),
    ]:
        assert text.count(old) == 1, old
        paths = code_map_paths(text.replace(old, new))
        library = library_modules()
        assert any(not (ROOT / p).exists() for p in paths) or library - set(paths)


def test_relative_links_resolve():
    """README links into docs/ and the repository; docs pages link to each other (mkdocs
    checks those too, strictly) and to the figures."""
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{rel(page)}: link to {target}, which does not exist"


def test_repository_paths_exist():
    """Files the pages name in `code` (`models/strategies/fsdp.py`, a test module, …) exist;
    the migration page names old ones on purpose."""
    path = re.compile(r"`((?:shardops|models|tests|examples|benchmarks|docs)/[\w/.-]+)`")
    missing = [
        f"{rel(page)}: {m[1]}"
        for page in PAGES
        if page.name != "migration.md"
        for m in path.finditer(page.read_text())
        if not (ROOT / m[1]).exists()
    ]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.fixture(scope="module", autouse=True)
def docs_build(tmp_path_factory):
    """``mkdocs build --strict`` into a temporary folder, started in the background as soon as
    this module's tests start (it takes seconds, and runs beside the pages' blocks)."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings_handlers.python  # noqa: F401
    except ImportError:
        yield None  # test_docs_build_strict skips, or fails under CI=true
        return
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    yield proc, site
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_docs_build_strict(docs_build):
    requires("mkdocs")
    requires("material")
    requires("mkdocstrings_handlers.python")
    proc, site = docs_build
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"mkdocs build took over 300 s: {proc.communicate()[0]}")
    assert proc.returncode == 0, out
    assert not re.search(r"\bWARNING\b", out), out
    for page in ("layers", "strategies", "strategy-search", "api/shardops", "api/models"):
        assert (site / page / "index.html").exists(), page
    assert (site / "img" / "mlp_2d.png").stat().st_size > 10_000  # the figure, not its symlink
    html = (site / "api" / "shardops" / "index.html").read_text()
    assert 'id="shardops.make_mesh"' in html and 'id="shardops.column_parallel_dense"' in html


# `shardops.x.y`, `shardops_models.x` and `models.x` (the pages' alias) in prose and code.
NAME = re.compile(r"(?<![\w./])(shardops_models|shardops|models)((?:\.[A-Za-z_]\w*)+)")


def resolves(root: str, dotted: str) -> bool:
    import importlib

    parts = ["shardops_models" if root == "models" else root, *dotted.strip(".").split(".")]
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_name_the_pages_use_exists():
    """The migration page lists the old names on purpose; every other page uses today's."""
    missing = [
        f"{rel(page)}: {m[0]}"
        for page in PAGES
        if page.name != "migration.md"
        for m in NAME.finditer(page.read_text())
        if m[2] not in (".md", ".py", ".png", ".json") and not resolves(m[1], m[2])  # not files
    ]
    assert not missing, "names that do not exist:\n" + "\n".join(sorted(set(missing)))


# The values the pages claim, checked in the namespaces their blocks left.


def test_readme_layer_example_moves_one_all_reduce(tmp_path_factory):
    import shardops

    ns = run_page("README.md", tmp_path_factory)
    (c,) = shardops.inspect.collectives(ns["mesh"], ns["mlp"], ns["x"], ns["p1"], ns["p2"])
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("model",), 64 * 10 * 4)
    assert ns["y"].shape == (256, 10)
    assert int(ns["metrics"].count) == 256 and ns["setup"].strategy.name == "2d"


def test_layers_page_kernels_and_global_layers(tmp_path_factory):
    import shardops

    ns = run_page("docs/layers.md", tmp_path_factory)
    (c,) = shardops.inspect.collectives(ns["mesh"], ns["mlp"], ns["x"], ns["p1"], ns["p2"])
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("model",), 64 * 10 * 4)
    p1, p2 = ns["p1"], ns["p2"]
    assert ns["f"](ns["x"], p1["w"], p1["b"], p2["w"], p2["b"]).shape == (256, 10)


def test_layers_page_transformer_example_starts_at_log_v_and_pads_cleanly(tmp_path_factory):
    """At a near-zero init the loss is log(50), and the padded table rows (50, 51) get exactly
    zero gradient."""
    import numpy as np

    ns = run_page("docs/layers.md", tmp_path_factory)
    loss, table = float(ns["tloss"]), np.asarray(ns["tgrads"]["table"])  # jit(value_and_grad)
    assert ns["tparams"]["table"].shape == table.shape == (52, 32)
    assert abs(loss - math.log(50)) < 0.01
    assert not np.any(table[50:]) and np.any(table[:50])


def test_strategies_page_any_model_one_loss_and_the_plan_s_budget(tmp_path_factory):
    """The user-defined TinyLM: one loss under every strategy, and the plan-derived budget is
    what the compiled fsdp_sp step moves."""
    import jax

    import shardops

    ns = run_page("docs/strategies.md", tmp_path_factory)
    losses = {k: float(v) for k, v in ns["losses"].items()}
    assert set(losses) == {"ref", "2d", "fsdp_tp", "fsdp_sp"}
    # To float32 rounding: 1e-6 of the loss (≈ 4.2), 8 ulps; observed 2.4e-6.
    assert all(abs(v - losses["ref"]) <= 1e-6 * losses["ref"] for v in losses.values()), losses
    # The auxiliary-loss example: the same objective without and with sp and 2 microbatches.
    penalised = {k: float(v) for k, v in ns["penalised"].items()}
    assert abs(penalised["fsdp_sp"] - penalised["ref"]) <= 1e-6 * penalised["ref"], penalised
    lm = ns["lm"]
    state = lm.init(jax.random.key(0))
    ids, labels = lm.place_batch(ns["lm_ids"], ns["lm_labels"])
    totals = shardops.inspect.ledger(lm.mesh, lm.train_step, state, ids, labels).totals()
    assert totals == lm.collective_budget(8, 16)


def test_diagnostics_page_ledger_is_the_budget_and_the_reference_agrees(tmp_path_factory):
    ns = run_page("docs/diagnostics.md", tmp_path_factory)
    assert ns["led"].totals() == ns["setup"].collective_budget(256)
    assert ns["report"].first is None
    assert set(ns["fsdp_ledger"].by_pass()) >= {"forward", "backward"}


def test_multi_process_page_checkpoint_moves_bit_for_bit(tmp_path_factory):
    import jax
    import numpy as np

    ns = run_page("docs/multi-process.md", tmp_path_factory)
    assert ns["extra"] == {"epoch": 0}
    for a, b in zip(jax.tree.leaves(ns["state"]), jax.tree.leaves(ns["moved"]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_hugging_face_page_matches_transformers_and_decodes(tmp_path_factory):
    import numpy as np

    ns = run_page("docs/hugging-face-and-decoding.md", tmp_path_factory)
    assert np.abs(ns["logits"] - ns["theirs"].numpy()).max() < 1e-4
    model = ns["ckpt"].model()
    assert (model.num_heads, model.num_kv_heads, model.vocab_size) == (8, 2, 97)
    assert np.asarray(ns["greedy"]).shape == np.asarray(ns["sampled"]).shape == (8, 16)
    assert ns["ep_decoder"].setup.strategy.name == "2d+ep"
    np.testing.assert_array_equal(ns["ep_tokens"], ns["moe_tokens"])


def test_context_parallelism_page_matches_attention_and_the_reference(tmp_path_factory):
    """The three context-parallel attentions equal ``shardops.attention`` on the page's input,
    and 2 Adam steps of the GPT under ``2d+ring`` end at the unsharded loss."""
    ns = run_page("docs/context-parallelism.md", tmp_path_factory)
    import numpy as np

    assert set(ns["got"]) == {"allgather", "ring", "ulysses"}
    for y in ns["got"].values():
        np.testing.assert_allclose(np.asarray(y), np.asarray(ns["want"]), rtol=1e-5, atol=1e-5)
    losses = ns["cp_losses"]
    assert abs(losses["2d+ring"] - losses["ref"]) <= 1e-6 * losses["ref"], losses
