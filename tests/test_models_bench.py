"""benchmarks/models.py end to end with ``--tiny`` (CPU-sized configs; on the CPU flashjvp's
kernels run in Triton's interpreter): every step of the DiT-XL attention block and of diffusers'
DiT measures, the flashjvp rows launch flashjvp's kernels and the torch rows do not, one compiled
row compiles the whole step, and a time limit turns rows into skips without building a model."""

import importlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from flashjvp._policy import interpreting

pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()), reason="needs the kernels"),
              pytest.mark.usefixtures("one_thread")]
STEPS = {"plain", "meanflow", "scm"}


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.models")


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny models are far faster so on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run(bench, out: Path, *args) -> tuple[dict, list[dict]]:
    assert bench.main(["--tiny", "--repeat", "1", "--out", str(out), *args]) == 0
    data = json.loads((out / "models.json").read_text())
    return data, data["rows"]


def check_measured(rows, model, providers):
    """Every step x provider measured, with a finite time; flashjvp's kernels ran exactly in the
    flashjvp rows (its sdpa, no fallback to PyTorch's math)."""
    mine = [r for r in rows if r["model"] == model]
    expected = {(s, p) for s in STEPS for p in providers if p != "torch-math" or s == "plain"}
    assert {(r["step"], r["provider"]) for r in mine} == expected
    for r in mine:
        assert r["status"] == "ok" and r["reason"] == "", r
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["first_s"] > 0, r
        assert (r["launches"] > 0) == (r["provider"] == "flashjvp"), r
        assert r["dims"] and r["mode"] == "eager" and r["compiled"] == ""


def test_block_every_step_and_provider(bench, tmp_path):
    data, rows = run(bench, tmp_path, "--models", "dit-xl-block", "--modes", "eager",
                     "--providers", "torch", "torch-math", "flashjvp")
    check_measured(rows, "dit-xl-block", ["torch", "torch-math", "flashjvp"])
    assert data["tiny"] and data["dtype"] == "fp32" and data["command"].startswith("python -m benchmarks.models")
    md = (tmp_path / "models.md").read_text()
    assert md.startswith("# flashjvp model benchmark: ") and "torch / flashjvp" in md and "--tiny" in md
    assert "| dit-xl-block | scm | eager |" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "models.png").stat().st_size > 0
    # --append: a later run's skips never replace these measurements; its new rows are added
    data, again = run(bench, tmp_path, "--models", "dit-xl-block", "--modes", "eager", "compile", "--append",
                      "--time-limit", "1e-9")
    assert again[: len(rows)] == rows and data["command"].count("benchmarks.models") == 2
    assert {r["mode"] for r in again[len(rows):]} == {"compile"} and len(again) == len(rows) + 6


def test_diffusers_dit_every_step(bench, tmp_path):
    from test_models import _import_torchvision

    _import_torchvision()  # diffusers imports torchvision where installed
    pytest.importorskip("diffusers")
    _, rows = run(bench, tmp_path, "--models", "dit-xl2-256", "--modes", "eager")
    check_measured(rows, "dit-xl2-256", ["torch", "flashjvp"])
    assert "depth 1" in rows[0]["dims"] and "N16" in rows[0]["dims"]


def test_flashjvp_in_applies_and_restores(bench):
    """flashjvp rows run a diffusers model through the diffusers integration (no patch_sdpa needed),
    and the torch rows after them get the model's own processors back."""
    from test_models import _import_torchvision

    _import_torchvision()
    pytest.importorskip("diffusers")
    from flashjvp.integrations.diffusers import FlashJVPAttnProcessor

    builder, _, _, tiny = bench.MODELS["dit-xl2-256"]
    model = builder(tiny, 2, torch.device("cpu")).model
    processors = lambda: [type(m.processor) for m in model.modules() if hasattr(m, "processor")]  # noqa: E731
    before = processors()
    with bench.flashjvp_in(model) as patch:
        assert patch is False
        assert set(processors()) == {FlashJVPAttnProcessor}
    assert processors() == before and before and FlashJVPAttnProcessor not in before
    with bench.flashjvp_in(None) as patch:  # the block: patch_sdpa
        assert patch is True


def test_compiled_step(bench, tmp_path):
    """One compiled row: forward + loss in one torch.compile region, flashjvp's kernels inside."""
    _, rows = run(bench, tmp_path, "--models", "dit-xl-block", "--steps", "plain", "--modes", "compile",
                  "--providers", "flashjvp")
    (r,) = rows
    assert r["status"] == "ok" and r["compiled"] == "step" and r["graphs"] >= 1 and r["launches"] > 0, r


def test_time_limit_skips(bench, tmp_path):
    _, rows = run(bench, tmp_path, "--models", "dit-xl-block", "wan-block-32k", "--time-limit", "1e-9")
    assert rows and all(r["status"] == "skipped" and "time limit" in r["reason"] for r in rows)
    assert [r["mode"] for r in rows[:6]] == ["eager"] * 6 and rows[6]["model"] == "dit-xl-block"


def test_float_layer_norm(bench):
    """The bf16 workaround for PyTorch's CUDA layer norm: inside ``float_layer_norm`` the tangent
    keeps the input's dtype and both outputs match float32 math; outside, F.layer_norm is PyTorch's."""
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    t = torch.randn_like(x)
    w, b = torch.randn(16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    layer_norm = torch.nn.functional.layer_norm
    with bench.float_layer_norm():
        assert torch.nn.functional.layer_norm is not layer_norm  # what nn.LayerNorm calls, replaced
        o, to = torch.func.jvp(lambda x: torch.nn.LayerNorm(16, dtype=torch.bfloat16)(x), (x,), (t,))
        o2 = torch.nn.functional.layer_norm(x, (16,), w, b)
    assert torch.nn.functional.layer_norm is layer_norm
    assert o.dtype == to.dtype == o2.dtype == torch.bfloat16
    ref, tref = torch.func.jvp(lambda x: layer_norm(x, (16,)), (x.float(),), (t.float(),))
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(to.float(), tref, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(o2.float(), layer_norm(x.float(), (16,), w.float(), b.float()), atol=3e-2, rtol=2e-2)
    assert isinstance(bench.layer_norm_tangent_mixes(torch.device("cpu")), bool)
