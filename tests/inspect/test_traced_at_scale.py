"""The budget traced on an AbstractMesh equals the compiled step: at 64 devices, and at 4,096
where each device's blocks are those of the 64 (``tests/_scale_probe.py``, in a subprocess
with 64 simulated CPU devices; the 4,096 are only traced)."""

import json
import os
import subprocess
import sys

from _processes import ROOT


def test_an_abstract_trace_at_64_and_4096_devices_equals_the_compiled_step_at_64():
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=64".strip()}  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_scale_probe.py")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    compiled = found["compiled_64"]
    assert compiled["backward"], compiled  # something moved: the check can fail
    assert found["traced_64"] == compiled
    assert found["traced_4096"] == compiled
