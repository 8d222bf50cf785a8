"""Every ``python …`` command the README and the docs pages show, run to its end as a user runs it.

A command runs in a scratch directory holding a copy of ``examples/`` (so a ``--plot
examples/…png`` writes there, not into the checkout), with the user's environment: the
examples simulate their 8 CPU devices themselves, so the suite's device-count flag is not passed
on (its compiler flags are, as in every test). Paths under ``/tmp/`` become paths under the
scratch directory. A command that takes over a minute on 2 cores runs with only its step, epoch
or compile count lowered (``LOWERED``), and its page says so next to it. Commands of one page
run in order (the resilience page's resume follows its run); a command two pages show runs once.
"""

import json
import math
import os
import pathlib
import re
import shlex
import shutil
import sys

import pytest
from _cover import FAST_COMPILE, FULL
from _processes import Run
from test_distributed import check_train_py
from test_docs import PAGES, ROOT, page_commands, python_blocks, rel
from test_examples import check_custom_gpt, check_mlp_2d_locate, check_pmap_gives_the_same_numbers
from test_real_data import require_fashion_mnist

from shardops.launch import free_port

SET_UP = (["python", "-m", "pytest"],)  # the README's test command: this suite
FASHION = "/usr/share/datasets/fashion-mnist"
# Command → the flags appended to it (argparse keeps the last value of a flag): each took over a
# minute on 2 cores as written (measured 2026-12-06, 8 simulated devices).
LOWERED = {
    f"python examples/mlp_2d.py --data-dir {FASHION}": "--epochs 1",  # 146 s
    "python examples/transformer_lm.py --compare-reference --steps 300 --mesh 4x2 "
    "--plot examples/transformer_lm.png --metrics-json /tmp/lm.json": "--steps 30",  # 205 s
    "python -m shardops.launch -n 2 -- examples/transformer_lm.py --strategy sp --mesh 2x4":
        "--steps 12",  # 146 s
    "python -m shardops.launch -n 2 -- examples/mlp_2d.py --checkpoint-dir /tmp/run "
    "--checkpoint-every 5": "--epochs 1",  # 69 s
    "python -m shardops.launch -n 2 -- examples/mlp_2d.py --checkpoint-dir /tmp/run "
    "--checkpoint-every 5 --resume": "--epochs 2",  # resumes after the lowered run: 1 epoch
    "python -m shardops_models.search --model gpt --batch 16 --devices 8 --hardware calibrate "
    "--compile-top 99 --recount": "--compile-top 3",  # 81 s
}  # fmt: skip
# Commands a page shows failing: command → (exit code, what its error says).
REFUSED = {
    "python examples/mlp_2d.py --strategy hsdp_tp --mesh 4x2": (
        1, "strategy 'hsdp_tp' needs mesh axes ('replica', 'data', 'model') (missing ('replica',))"
    ),
}  # fmt: skip
# The line each script prints last when it ran to its end (a script that stopped early with
# exit code 0 fails here), by the script's name; mlp_2d's is its last epoch's (``_end``).
ENDS = {
    "transformer_lm.py": r"^(?:\[p0\] )?Total [\d.]+ s$|within bound",
    "locate_divergence.py": r"first beyond its bound",
    "mlp_data_parallel.py": r"jax\.pmap: test accuracy",
    "custom_model.py": r"all-reduce|reduce-scatter",
    "shardops_models.search": r"^searched in",
    # Host 0's process prints 100 losses (CHECKS), which it cannot compute unless host 1's
    # process runs every step of the same program with it.
    "train.py": r"^\[p0\] 99 ",
}
MLP_2D_EPOCHS = 20  # examples/mlp_2d.py's default --epochs (test_the_default_epochs_are_mlp_2d_s)
HOST0 = "host0:8476"  # the several-hosts commands' coordinator: here both "hosts" are loopback


def commands() -> dict[str, list[tuple[str, int, str]]]:
    """Page → its commands ``(page, line, command)`` in order, each command under its first page."""
    seen, found = set(), {}
    for page in PAGES:
        for line, words in page_commands(page):
            command = shlex.join(words)
            if command in seen or words[:3] == ["python3", "-m", "venv"] or words in SET_UP:
                continue
            seen.add(command)
            found.setdefault(rel(page), []).append((rel(page), line, command))
    return found


COMMANDS = commands()


def _environment() -> dict[str, str]:
    """A user's environment: no simulated-device flag (the examples set their own), the suite's
    compiler flags and compilation cache."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(() if FULL else FAST_COMPILE)
    return env


def _argv(command: str, scratch: pathlib.Path, port: int) -> list[str]:
    words = shlex.split(command) + shlex.split(LOWERED.get(command, ""))
    words = [w.replace("/tmp/", f"{scratch}/").replace(HOST0, f"127.0.0.1:{port}") for w in words]
    return [sys.executable if w == "python" else w for w in words]


def _script(command: str) -> str:
    words = shlex.split(command)
    if "shardops_models.search" in words:
        return "shardops_models.search"
    return pathlib.Path(next(w for w in reversed(words) if w.endswith(".py"))).name


def _end(command: str) -> str:
    """The pattern of the line ``command`` prints last when it runs to its end."""
    script = _script(command)
    if script == "train.py" and "--node-rank 1" in command:
        return r"^$"  # host 1 prints nothing of its own: host 0's 100 losses need its process
    if script != "mlp_2d.py":
        return ENDS[script]
    if "--locate" in command:
        return r"within bound"
    epochs = re.findall(r"--epochs (\d+)", f"{command} {LOWERED.get(command, '')}")
    last = int(epochs[-1]) - 1 if epochs else MLP_2D_EPOCHS - 1
    return rf"^(?:\[p0\] )?Epoch {last} in "


def _problem(command: str, run: Run, code: int) -> str | None:
    """Why ``command`` did not run to its end (or, a refusal a page shows, end as it shows)."""
    stdout, out = run.out.read_text(), run.out.read_text() + run.err.read_text()
    expected_code, says = REFUSED.get(command, (0, None))
    end = _end(command) if says is None else re.escape(says)
    if code != expected_code:
        return f"exited with {code}, not {expected_code}:\n{run.output()}"
    if "Traceback" in out or not re.search(end, stdout if says is None else out, re.M):
        return f"did not run to its end (no line matching {end!r}, or a traceback):\n{run.output()}"
    return None


def run_commands(page: str, scratch: pathlib.Path, timeout: float = 300) -> dict[str, str]:
    """Run ``page``'s commands in order; command → its stdout, after asserting each ran to its end.
    Commands that share a coordinator (several hosts) run together."""
    shutil.copytree(ROOT / "examples", scratch / "examples")
    for _, body, runs in python_blocks(ROOT / page):
        if not runs and "SHARDOPS_COORDINATOR" in body:
            (scratch / "train.py").write_text(body)  # the several-hosts page's script
    outputs, problems, port = {}, [], free_port()
    pending = [c for _, _, c in COMMANDS[page] if FASHION not in c or _has_fashion_mnist()]
    while pending:
        group = [c for c in pending if HOST0 in c] if HOST0 in pending[0] else pending[:1]
        env, names = _environment(), [f"cmd{len(outputs) + i}" for i in range(len(group))]
        started = [
            (c, Run(_argv(c, scratch, port), scratch, name, env, cwd=scratch))
            for c, name in zip(group, names, strict=True)
        ]
        for command, run in started:
            try:
                code = run.wait(timeout)
            except AssertionError as e:
                problems.append(f"{command}: {e}")
                continue
            finally:
                run.kill()
            outputs[command] = run.out.read_text()
            if (problem := _problem(command, run, code)) is not None:
                problems.append(f"{command}: {problem}")
        pending = [c for c in pending if c not in group]
        port = free_port()
    assert problems == [], "\n\n".join(problems)
    return outputs


def test_every_command_belongs_to_a_page_and_each_lowered_one_is_named_on_its_page():
    """Each ``LOWERED`` and ``REFUSED`` key is a command a page shows, and the page names the
    lowered flags (`` `--steps 12` ``) so that a reader knows which figures the tests do not
    reproduce."""
    shown = {c: page for page, cs in COMMANDS.items() for _, _, c in cs}
    assert set(LOWERED) <= set(shown), set(LOWERED) - set(shown)
    assert set(REFUSED) <= set(shown), set(REFUSED) - set(shown)
    for command, flags in LOWERED.items():
        text = (ROOT / shown[command]).read_text()
        assert f"`{flags}`" in text, (
            f"{shown[command]} does not say the tests run {command!r} with {flags}"
        )
    assert sum(map(len, COMMANDS.values())) >= 25


def _has_fashion_mnist() -> bool:
    """Whether Debian's Fashion-MNIST is here: under CI=true its absence fails (with apt's
    output); elsewhere only the command that reads it is left out."""
    try:
        require_fashion_mnist()
    except pytest.skip.Exception:
        return False
    return True


def test_the_default_epochs_are_mlp_2d_s():
    from _resume_checks import load_example

    assert load_example("mlp_2d").parse_args([]).epochs == MLP_2D_EPOCHS


@pytest.mark.timeout(1500)  # a page's commands run one after another, each under 300 s
@pytest.mark.parametrize("page", sorted(COMMANDS))
def test_each_command_of_the_page_runs_to_its_end(page, tmp_path):
    outputs = run_commands(page, tmp_path)
    for command, out in outputs.items():
        if command in CHECKS:
            CHECKS[command](out, tmp_path)


# --- what the commands print that the pages quote


def check_shown(out: str, *parts: str) -> None:
    """``out`` has a line holding each of ``parts`` in order (a line the page shows)."""
    pattern = ".*".join(map(re.escape, parts))
    assert re.search(pattern, out), f"no line matching {pattern!r}:\n{out}"


TWO_HOSTS = [c for _, _, c in COMMANDS["docs/multi-process.md"] if HOST0 in c]
LM_RUN = ("python examples/transformer_lm.py --compare-reference --steps 300 --mesh 4x2 "
          "--plot examples/transformer_lm.png --metrics-json /tmp/lm.json")  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_lm_run(out: str, scratch: pathlib.Path) -> None:
    """The getting-started page's run (fsdp_tp on 4 × 2 beside the unsharded reference, 30
    steps of 8 × 128 bytes): the loss falls from the uniform ln 256 by a fifth and the two runs
    agree to 1e-3 relative (Adam's chaotic divergence takes hundreds of steps), the validation
    at the end, a sample by KV-cache decoding on 4 rows, the metrics and the plot written."""
    assert out.startswith("text: "), out  # the corpus message comes first
    assert "step    30/30: loss " in out and "(reference " in out, out
    record = json.loads((scratch / "lm.json").read_text())
    assert record["strategy"] == "fsdp_tp" and record["steps"] == list(range(1, 31))
    assert record["corpus_message"] in out
    losses = record["losses"]
    assert losses[0] > math.log(256) - 0.2, losses[:3]  # the init predicts ~uniform bytes
    assert record["final_loss"] < 0.8 * losses[0], losses
    assert record["valid"][-1]["step"] == 30 and record["final_valid_loss"] < 0.8 * losses[0]
    assert len(record["reference_losses"]) == 30
    assert record["final_relative_diff"] < 1e-3, record["final_relative_diff"]
    assert record["timing"]["train_seconds"] > 0
    sample = record["sample"]
    assert len(sample["prompt"]) > 0 and f"{sample['prompt']}⟦" in out
    assert "KV-cache decoding: 4 × " in out, out  # 8 devices: model = 2 splits the heads
    assert (scratch / "examples/transformer_lm.png").read_bytes()[:8] == PNG_MAGIC


CHECKS = {
    TWO_HOSTS[0]: lambda out, _: check_train_py(out),  # process 0 prints the losses ...
    TWO_HOSTS[1]: lambda out, _: not re.search(r"^\[p\d\] \d+ ", out, re.M) or pytest.fail(out),
    # the page's resume, after its 2-process save: the step and layout it shows
    "python examples/mlp_2d.py --strategy tp --mesh 1x8 --epochs 3 --checkpoint-dir /tmp/demo "
    "--resume": lambda out, _: check_shown(
        out, "Resume: step 92 (epoch 2, batch 0) from ", "saved by 2d on {'data': 4, 'model': 2}"
    ),
    "python examples/mlp_data_parallel.py --with-pmap": lambda out, _: (
        check_pmap_gives_the_same_numbers(out)
    ),
    "python examples/custom_model.py": lambda out, _: check_custom_gpt(
        out, sequence_parallel=False
    ),
    "python examples/mlp_2d.py --locate --strategy fsdp_tp --mesh 2x4": lambda out, _: (
        check_mlp_2d_locate(out)
    ),
    LM_RUN: check_lm_run,
}
