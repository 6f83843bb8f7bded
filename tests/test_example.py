"""examples/meanflow_digits.py: its model's training step runs flashjvp's kernels, and the script
runs end to end in ``--smoke`` mode and writes its outputs.

The end-to-end run is a subprocess without ``TRITON_INTERPRET`` (conftest.py sets it for the
kernel tests), so that on the CPU flashjvp takes its fast math path there; the kernels themselves
(Triton's interpreter on the CPU) run the example's MeanFlow step in-process, on a tiny model.
"""

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashjvp
from flashjvp._launch import LaunchLog
from helpers import DEVICE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "meanflow_digits.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_meanflow_step_runs_the_kernels():
    """One MeanFlow training step of the example's DiT (torch.func.jvp through the model, then
    the loss's backward) on flashjvp's kernels: one fused forward+JVP launch and one backward per
    attention layer, with the loss and the gradients of the same model on flashjvp.attention_ref."""
    example = runpy.run_path(str(SCRIPT))  # definitions only: main() runs under __main__
    depth = 2
    torch.manual_seed(0)
    fast = example["MeanFlowDiT"](dim=16, depth=depth, heads=2, patch=2, attn=flashjvp.attention).to(DEVICE)
    for p in fast.parameters():  # adaLN-Zero starts at zero: without this attention would not matter
        torch.nn.init.normal_(p, std=0.2)
    ref = example["MeanFlowDiT"](dim=16, depth=depth, heads=2, patch=2, attn=flashjvp.attention_ref).to(DEVICE)
    ref.load_state_dict(fast.state_dict())
    x = torch.rand(4, 64, device=DEVICE) * 2 - 1
    y = torch.arange(4, device=DEVICE)
    losses = []
    for model in (fast, ref):
        torch.manual_seed(1)  # the same r, t and noise for both
        with LaunchLog() as log:
            loss, _ = example["meanflow_loss"](model, x, y, flow_ratio=0.5, adaptive_p=0.0)
            loss.backward()
        losses.append(loss)
        if model is fast:
            assert log.count("_attn_fwd_kernel", HAS_TQ=True, HAS_TK=True, HAS_TV=True) == depth, log.launches
            assert log.count("_attn_fwd_kernel") == depth
            assert log.count("_attn_bwd_dq_kernel") == depth
        else:
            assert log.launches == []
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


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
