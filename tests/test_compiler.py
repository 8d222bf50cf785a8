"""The default run's compiler (tests/_cover.py ``FAST_COMPILE``: LLVM at -O0, the classic fusion
emitters) runs the same program as XLA's defaults: the same collectives, and results equal to
float32 rounding. Both runs are subprocesses with their own XLA_FLAGS (tests/_compiler_probe.py).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
from _cover import FAST_COMPILE

HERE = pathlib.Path(__file__).parent


def probe(out, flags) -> dict:
    env = dict(os.environ, XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=8", *flags]),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    proc = subprocess.run([sys.executable, str(HERE / "_compiler_probe.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as f:
        return dict(f)


def test_fast_compile_runs_the_same_program_as_xla_defaults(tmp_path):
    fast = probe(tmp_path / "fast.npz", FAST_COMPILE)
    default = probe(tmp_path / "default.npz", ())
    for model in ("mlp", "gpt"):
        assert list(fast[f"{model}.collectives"]) == list(default[f"{model}.collectives"])
        assert len(fast[f"{model}.collectives"]) > 0, f"{model}: the probe's step has no collective"
        for what in ("losses", "params"):
            a, b = fast[f"{model}.{what}"], default[f"{model}.{what}"]
            # float32 rounding: the fused loops sum in another order (a few ulps), no more.
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{model} {what}")
