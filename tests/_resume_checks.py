"""What the examples print after ``--resume``: only what the resumed run trained (its steps, its
tokens and its throughput; a resumed epoch's steps), shared by tests/test_transformer_lm.py,
tests/test_examples.py and their mutation module (tests/test_examples_mutations.py).

The examples run in this process (``main(argv)``, a few steps of a tiny model each), so that a
mutated copy of an example (``load_example``) runs as cheaply as the real one. A checkpoint of
the last steps is deleted to resume from an earlier one: no process needs to be killed. They
run the unsharded strategy (``ref``, the cheapest to compile): what is reported after a resume
does not depend on the layout.
"""

import ast
import contextlib
import importlib.util
import io
import json
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def example_modules(path: pathlib.Path) -> list[pathlib.Path]:
    """The modules beside the script ``path`` that it imports, directly or through one another
    (``from _lm_experts import …``: examples/_lm_experts.py)."""
    found, todo = [], [path]
    while todo:
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for module in (EXAMPLES / f"{n}.py" for n in names):
                if module.exists() and module != path and module not in found:
                    found.append(module)
                    todo.append(module)
    return found


def _module(name: str, path: pathlib.Path, source: str, mutant: bool):
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, f"<{path.name}{' (mutant)' if mutant else ''}>", "exec"), module.__dict__)
    return module


def load_example(name: str, old: str | None = None, new: str | None = None):
    """``examples/{name}.py`` as a module, with the line ``old`` replaced by ``new``: in the
    script or in a module beside it that it imports (``example_modules``), found exactly once
    among them all. The script runs with examples/ on ``sys.path``, as Python puts a script's
    folder; a mutated module is the one it imports (those modules' other importers keep the
    real one)."""
    path = EXAMPLES / f"{name}.py"
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    sources = {p: p.read_text() for p in [path, *example_modules(path)]}
    mutated = None
    if old is not None:
        found = [p for p, source in sources.items() for _ in range(source.count(old))]
        assert len(found) == 1, (
            f"mutant: line not found once in {path.name} or the modules it imports "
            f"({', '.join(p.name for p in sources if p != path)}): {old!r}"
        )
        (mutated,) = found
        sources[mutated] = sources[mutated].replace(old, new)
    if mutated is None or mutated == path:
        return _module(f"{name}_under_test", path, sources[path], mutant=mutated is not None)
    real = sys.modules.get(mutated.stem)
    try:  # the script's `import` takes the mutated module from sys.modules
        _module(mutated.stem, mutated, sources[mutated], mutant=True)
        return _module(f"{name}_under_test", path, sources[path], mutant=True)
    finally:
        if real is None:
            sys.modules.pop(mutated.stem, None)
        else:
            sys.modules[mutated.stem] = real


def run_main(module, argv: list[str]) -> str:
    """What ``module.main(argv)`` prints (it must succeed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = module.main(argv)
    assert code in (0, None) or isinstance(code, tuple), f"main returned {code}:\n{out.getvalue()}"
    return out.getvalue()


def resumable(directory: pathlib.Path, into: pathlib.Path, keep_through: int) -> pathlib.Path:
    """A copy of a checkpoint folder without the steps after ``keep_through``."""
    shutil.copytree(directory, into)
    for step in into.iterdir():
        if step.name.isdigit() and int(step.name) > keep_through:
            shutil.rmtree(step)
    return into


# --- examples/transformer_lm.py: 4 steps of a one-block GPT, checkpoints at 2 and 4

LM_ARGS = ["--text-source", "stdlib", "--steps", "4", "--layers", "1", "--width", "16",
           "--heads", "2", "--context", "16", "--batch-size", "8", "--log-every", "1",
           "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
           "--checkpoint-every", "2", "--strategy", "ref"]  # fmt: skip
LM_TOKENS_PER_STEP = 8 * 16


def lm_checkpoints(workdir: pathlib.Path) -> pathlib.Path:
    directory = workdir / "lm-straight"
    run_main(load_example("transformer_lm"), [*LM_ARGS, "--checkpoint-dir", str(directory)])
    return directory


def check_lm_resume_report(module, straight: pathlib.Path, workdir: pathlib.Path) -> None:
    """Resumed at step 2 of 4: the run says it trained 2 steps (3–4), logs only those, and its
    JSON's tokens and tokens/s are those of 2 steps."""
    directory = resumable(straight, workdir / "lm-resumed", keep_through=2)
    metrics = workdir / "lm-resumed.json"
    out = run_main(module, [*LM_ARGS, "--checkpoint-dir", str(directory), "--resume",
                            "--metrics-json", str(metrics)])  # fmt: skip
    assert re.search(r"^Resume: step 2 from ", out, re.M), out
    assert re.findall(r"^step +(\d+)/4: loss", out, re.M) == ["3", "4"], out
    assert re.search(r"^Trained 2 steps \(3–4 of 4, resumed at step 2\) in [\d.]+ s \(", out,
                     re.M), out  # fmt: skip
    timing = json.loads(metrics.read_text())["timing"]
    assert timing["resumed_at"] == 2 and timing["steps_trained"] == 2, timing
    assert timing["tokens_trained"] == 2 * LM_TOKENS_PER_STEP, timing
    rate = timing["tokens_per_second"] * timing["train_seconds"]
    assert abs(rate - timing["tokens_trained"]) <= 1e-9 * timing["tokens_trained"], timing
    shown = re.search(r"; ([\d,]+) tokens/s\)", out)[1].replace(",", "")
    assert int(shown) == round(timing["tokens_per_second"]), (shown, timing)


# --- examples/mlp_2d.py: 2 epochs of 4 steps, checkpoints at 3, 4 (epoch end), 6, 8

MLP_ARGS = ["--dataset", "sample", "--train-size", "128", "--batch-size", "32", "--epochs", "2",
            "--checkpoint-every", "3", "--hidden", "32", "--strategy", "ref"]  # fmt: skip


def mlp_checkpoints(workdir: pathlib.Path) -> pathlib.Path:
    directory = workdir / "mlp-straight"
    run_main(load_example("mlp_2d"), [*MLP_ARGS, "--checkpoint-dir", str(directory)])
    return directory


def check_mlp_resume_report(module, straight: pathlib.Path, workdir: pathlib.Path) -> None:
    """Resumed at step 6 (epoch 1, batch 2): epoch 1's line says it trained 2 of its 4 steps,
    no line of epoch 0 is printed again, the progress lines are of steps it trained, and the
    metrics' history says each epoch's steps (epoch 0's, from the checkpoint: all 4)."""
    directory = resumable(straight, workdir / "mlp-resumed", keep_through=6)
    metrics = workdir / "mlp-resumed.json"
    out = run_main(module, [*MLP_ARGS, "--checkpoint-dir", str(directory), "--resume",
                            "--metrics-json", str(metrics)])  # fmt: skip
    assert re.search(r"^Resume: step 6 \(epoch 1, batch 2\) from ", out, re.M), out
    assert re.findall(r"^Epoch (\d+) in [\d.]+ sec(.*)$", out, re.M) == [
        ("1", " (2 of 4 steps, resumed at batch 2)")
    ], out
    steps = [int(s) for s in re.findall(r"^  epoch 1: step (\d+)/4", out, re.M)]
    assert steps and min(steps) > 2 and "  epoch 0:" not in out, out
    history = json.loads(metrics.read_text())["history"]
    assert [(row["epoch"], row["steps"]) for row in history] == [(0, 4), (1, 2)], history
