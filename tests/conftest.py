"""Test harness: 8 simulated CPU devices for the whole suite, hypothesis profiles, error report.

The device count must be set before JAX initialises its backend, so it happens here, at import,
before any test module imports jax.
"""

import os

from _cover import FAST_COMPILE, FULL

os.environ["JAX_PLATFORMS"] = "cpu"
# 8 simulated devices, and the default run's compiler (tests/_cover.py): measured on
# tests/layers/test_attention.py, 79 s → 32 s, of which compiling 59 s → 13 s.
_flags = ["--xla_force_host_platform_device_count=8", *(() if FULL else FAST_COMPILE)]
for _flag in _flags:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# One compilation cache for the session, this process and the ones it starts: tests that build
# the same program (a reference step, an unmutated copy, a strategy checked twice) compile it
# once. The key includes the HLO metadata, so programs that differ only in op names (which the
# pass readers read) are compiled apart. Measured: 32 strategy tests, 108 s → 73 s.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="shardops-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "true")

import _report  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# CI profile (the default): derandomized so a failure reproduces, no deadline because the first
# example of a shape compiles, and 40 examples per property; 200 under SHARDOPS_FULL=1, the full
# sweep run before an issue is resolved (tests/_cover.py). Each example of the layer properties
# compiles its own program (~0.45 s an example on 2 cores), so this is most of their time.
settings.register_profile(
    "ci",
    max_examples=200 if FULL else 40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("quick", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def straight_checkpoints(tmp_path_factory):
    """``get(example)``: the checkpoint folder of an uninterrupted run of ``"transformer_lm"``
    or ``"mlp_2d"`` (tests/_resume_checks.py), made once per session and never written to:
    each resume copies it."""
    from _resume_checks import lm_checkpoints, mlp_checkpoints

    made = {}

    def get(example: str):
        if example not in made:
            make = {"transformer_lm": lm_checkpoints, "mlp_2d": mlp_checkpoints}[example]
            made[example] = make(tmp_path_factory.mktemp(example))
        return made[example]

    return get


def pytest_configure(config):
    n = len(jax.devices())
    if n != 8:
        raise RuntimeError(f"the suite needs 8 simulated CPU devices; JAX started with {n}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml): one worker per core, at most 4. Tracing and compiling, most
    of the suite's time, run on one thread, so two workers on CI's 2 cores finish the suite in
    697 s instead of 1,068 s (measured one run after the other); each worker still simulates
    the 8 devices, and a test that starts processes bounds its own."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; macOS and Windows have none
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, min(cores, 4))


# The files that take longest (seconds in one worker of two, measured): they start first, so
# the rest of the suite fills the other worker instead of one of them running on alone at the
# end (a file runs in one worker).
LONGEST_FIRST = {"test_doc_commands.py": 374, "test_pipeline.py": 238,
                 "test_transformer_lm.py": 238, "test_distributed.py": 160,
                 "test_benchmark.py": 123, "test_resilience.py": 111,
                 "test_pipeline_memory.py": 105, "test_launch.py": 92}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # stable: files stay whole


def pytest_sessionfinish(session):
    """In an xdist worker: its figures go to the controller, which prints the report."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["shardops_figures"] = _report.sendable(_report.figures())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """In the xdist controller: merge a finished worker's figures into this process's tables."""
    sent = getattr(node, "workeroutput", {}).get("shardops_figures", {})
    _report.merge(_report.figures(), sent)


def pytest_terminal_summary(terminalreporter):
    figures = _report.figures()
    WORST, VOCAB_WORST, ATTENTION_WORST = figures["layers"], figures["vocab"], figures["attention"]
    NORM_WORST, TRAJECTORY_ERRORS = figures["norms"], figures["trajectories"]

    if WORST:
        terminalreporter.section("layers: worst errors against the float64 reference")
        for policy, (ratio, abs_err, where) in sorted(WORST.items()):
            terminalreporter.write_line(
                f"{policy:>15}: max |err| = {abs_err:.3e}; max |err|/bound = {ratio:.3e} ({where})"
            )
    if VOCAB_WORST:
        terminalreporter.section("vocab-parallel layers: worst errors against float64")
        for (kind, policy), (ratio, abs_err, where) in sorted(VOCAB_WORST.items()):
            terminalreporter.write_line(
                f"{kind:>14} {policy:>15}: max |err| = {abs_err:.3e}; max |err|/bound = "
                f"{ratio:.3e} ({where})"
            )
    if ATTENTION_WORST or NORM_WORST:
        terminalreporter.section("attention and norms: worst errors against float64")
        for policy, (ratio, abs_err, where) in sorted(ATTENTION_WORST.items()):
            terminalreporter.write_line(
                f"{policy:>15}: max |err| = {abs_err:.3e}; max |err|/bound = {ratio:.3e} ({where})"
            )
        for kind, ratio in sorted(NORM_WORST.items()):
            terminalreporter.write_line(f"{kind:>15}: max |err|/bound = {ratio:.3e}")
    if TRAJECTORY_ERRORS:
        terminalreporter.section("models: 5-step trajectories, max |sharded − reference|")
        terminalreporter.write_line(
            f"{'strategy':>8} {'mesh':>5} {'opt':>10} {'loss':>9} {'grads':>9} {'params':>9}"
        )
        for (strategy, mesh, opt), e in sorted(TRAJECTORY_ERRORS.items()):
            terminalreporter.write_line(
                f"{strategy:>8} {mesh:>5} {opt:>10} {e['loss']:9.2e} {e['grads']:9.2e} {e['params']:9.2e}"
            )
