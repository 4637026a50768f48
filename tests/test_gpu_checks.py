"""torchtitan_amp/tools/gpu_checks.py runs on CPU with tiny shapes, so its first GPU run is not its first run."""

from __future__ import annotations

import json
import sys

from tests.support import run_command


def test_gpu_checks_trial_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_checks.json"
    result = run_command([sys.executable, "-m", "torchtitan_amp.tools.gpu_checks", "--device", "cpu", "--tiny",
                          "--steps", "4", "--json", str(out)], timeout=300, env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.describe()
    results = json.loads(out.read_text())
    assert {k for k, v in results.items() if k != "env" and v["ok"]} == {"probe", "curves", "resume", "fp8"}
    probe = results["probe"]
    assert probe["linear_out"] == {"bfloat16": probe["linear_out"]["bfloat16"]}
    assert any(op.startswith("mm:") for op in probe["forward_ops"])
    assert any("attention" in op for op in probe["backward_ops"])
    assert results["resume"]["resumed"] == {k: v for k, v in results["resume"]["uninterrupted"].items()
                                            if int(k) > 3}
    # A bad --only is a usage error naming the choices.
    bad = run_command([sys.executable, "-m", "torchtitan_amp.tools.gpu_checks", "--device", "cpu", "--only", "nope"],
                      timeout=120)
    assert bad.returncode == 2 and "unknown check 'nope'" in bad.stderr
