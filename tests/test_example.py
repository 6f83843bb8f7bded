"""examples/meanflow_digits.py runs end to end in ``--smoke`` mode and writes its outputs.

The example runs in a subprocess without ``TRITON_INTERPRET`` (conftest.py may set it for the
kernel tests), so flashjvp takes its fast math path on the CPU.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "meanflow_digits.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_meanflow_digits_smoke(tmp_path):
    pytest.importorskip("sklearn", reason="the example needs scikit-learn")
    pytest.importorskip("matplotlib", reason="the example needs matplotlib")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env["MPLBACKEND"] = "Agg"
    call_main = ("import runpy, sys; "
                 "runpy.run_path(sys.argv[1])['main'](['--smoke', '--out', sys.argv[2]])")
    proc = subprocess.run([sys.executable, "-c", call_main, str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "CPU: PyTorch math fallback" in proc.stdout and "1-step samples classified" in proc.stdout

    for name in ("samples.png", "loss.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("classifier_test_accuracy", "accuracy_1step", "accuracy_2step", "final_mse", "steps_per_s"):
        assert isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]), (key, metrics[key])
    for key in ("classifier_test_accuracy", "accuracy_1step", "accuracy_2step"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics[key])
    assert metrics["classifier_test_accuracy"] > 0.9  # logistic regression on real digits
    assert metrics["steps_per_s"] > 0 and metrics["params"] > 0
