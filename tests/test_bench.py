"""benchmarks/bench.py (and the harness it runs on) on the CPU: FLOP counting, the pure report
(table, JSON, plot), the command line and its `python -m flashjvp.bench` entry, the flash_attn stub
of the kernel loader, and one tiny end-to-end run with the CUDA calls faked."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench, harness
from benchmarks.bench import Row, Shape, attention_flops


def test_flops_forward_causal_and_modes():
    fwd = attention_flops(2, 3, 8, 8, 4, 4, False, "fwd")
    assert fwd == 4 * 2 * 3 * 8 * 8 * 4
    assert attention_flops(2, 3, 8, 8, 4, 4, True, "fwd") == fwd / 2
    assert attention_flops(2, 3, 8, 8, 4, 4, False, "fwd_jvp") == 3 * fwd
    assert attention_flops(2, 3, 8, 8, 4, 4, False, "fwd_jvp", all_tangents=False) == 2 * fwd
    assert attention_flops(2, 3, 8, 8, 4, 4, False, "bwd") == 2.5 * fwd
    assert attention_flops(2, 3, 8, 8, 4, 4, False, "scm") == (3 + 1 + 2.5) * fwd
    assert attention_flops(2, 3, 8, 8, 4, 4, True, "scm", all_tangents=False) == (2 + 1 + 2.5) * fwd / 2
    # Dqk != Dv: one matmul over each head dim
    assert attention_flops(1, 1, 8, 8, 16, 32, False, "fwd") == 2 * 8 * 8 * (16 + 32)
    # causal cross-attention (top-left): query i sees min(i + 1, Nk) keys
    assert attention_flops(1, 1, 4, 8, 4, 4, True, "fwd") == 2 * (1 + 2 + 3 + 4) * 8
    with pytest.raises(ValueError):
        attention_flops(1, 1, 4, 4, 4, 4, False, "nope")


def test_flops_of_named_shapes():
    by_id = {s.id: s for s in bench.SHAPES}
    assert by_id["1"].flops("fwd") == 4 * 4 * 32 * 4096 * 4096 * 64
    assert by_id["2"].flops("fwd_jvp") == by_id["1"].flops("fwd_jvp") / 2
    assert by_id["7"].flops("fwd_jvp") / by_id["7b"].flops("fwd_jvp") == pytest.approx(2 / 3)
    assert by_id["8"].flops("fwd") == 4 * 2 * 32 * 8192 * 8192 * 128 / 2  # GQA counts query heads
    assert by_id["8"].dims == "B2 Hq32/Hkv8 N8192 D128 causal"
    assert by_id["7"].dims == "B1 H40 Nq32760/Nk512 D128" and by_id["7"].tangents == "q"


def _row(shape, provider, mode, ms=None, skip=None, all_tangents=True):
    s = Shape(shape, f"name{shape}", 1, 2, 2, 64, 32 if shape.startswith("7") else 64, 16,
              all_tangents=all_tangents)
    tflops = None if ms is None else s.flops(mode) / ms / 1e9
    peak = None if ms is None else 12.0
    return Row(s.id, s.name, s.dims, s.tangents, provider, mode, ms=ms, tflops=tflops, peak_mib=peak, skip=skip)


def _rows():
    return [
        _row("1", "flashjvp", "fwd", 1.0),
        _row("1", "torch-flash", "fwd", 0.8),
        _row("1", "flashjvp", "fwd_jvp", 2.0),
        _row("1", "torch-math-jvp", "fwd_jvp", 10.0),
        _row("1", "reference", "fwd_jvp", 3.0),
        _row("1", "reference", "bwd", skip="NotImplementedError: flash_attn is not installed (stub) | x"),
        _row("1", "flashjvp", "scm", 5.0),
        _row("7", "flashjvp", "fwd_jvp", 1.0, all_tangents=False),
        _row("7b", "flashjvp", "fwd_jvp", 1.5),
        _row("7", "torch-math-jvp", "fwd_jvp", skip="memory estimate 999 GiB", all_tangents=False),
    ]


def test_speedups():
    rows = _rows()
    assert bench.speedups(rows) == {("1", "torch-math-jvp"): 5.0, ("1", "reference"): 1.5}
    assert bench.speedups(rows, "scm") == {}
    assert bench.skip_speedups(rows) == [("flashjvp", "7", "7b", 1.0, 1.5, 1.5)]


def test_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows()
    meta = {"gpu": "Fake GPU", "torch": "2.x", "triton": "3.x", "date": "2025-01-01T00:00:00+00:00",
            "command": "python -m benchmarks.bench --quick", "dtype": "bf16",
            "unavailable": {"jvp-flash-attention": "not importable"}}
    paths = bench.write_report(rows, meta, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    for key in ("gpu", "torch", "triton", "date", "command"):
        assert data[key] == meta[key]
    assert len(data["rows"]) == len(rows)
    r0 = data["rows"][0]
    assert {"shape", "name", "provider", "mode", "ms", "tflops", "peak_mib", "skip"} <= set(r0)
    assert r0["tflops"] == pytest.approx(rows[0].tflops) and r0["skip"] is None
    assert data["rows"][5]["skip"].startswith("NotImplementedError") and data["rows"][5]["ms"] is None
    assert paths["png"].exists() and paths["png"].stat().st_size > 1000
    md = paths["md"].read_text()
    assert "## fwd_jvp" in md and "5.00x" in md and "1.50x" in md and "Fake GPU" in md
    assert "jvp-flash-attention: not available" in md
    assert "| 1 name1 |" in md and "NotImplementedError" in md


def test_describe_tiles():
    configs = {"_attn_fwd_kernel": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
               "_attn_bwd_dq_kernel": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "num_ctas": 1}}
    assert harness.describe_tiles(configs) == (
        "_attn_bwd_dq_kernel: BLOCK_M=64 BLOCK_N=32 num_warps=4 num_stages=2; "
        "_attn_fwd_kernel: BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=2")
    assert harness.describe_tiles({}) is None


def test_merge_reports(tmp_path):
    """Runs split across GPU sessions: a later measurement wins, a later skip does not."""
    first = [_row("1", "flashjvp", "fwd_jvp", 2.0), _row("5", "flashjvp", "fwd_jvp", 9.0),
             _row("1", "reference", "fwd_jvp", 3.0)]
    second = [_row("5", "flashjvp", "fwd_jvp", 1.0), _row("1", "reference", "fwd_jvp", skip="time limit"),
              _row("1", "jvp-flash-attention", "fwd_jvp", 4.0)]
    # run 0 had the reference kernel and lacked the peer; run 1 the other way round
    metas = [{"kernels": {"reference": "ref.py:attention"}, "unavailable": {"jvp-flash-attention": "not importable"}},
             {"kernels": {}, "unavailable": {"torch-cudnn": "no cuDNN"}}]
    for i, rows in enumerate((first, second)):
        bench.write_report(rows, {"gpu": "Fake GPU", "date": f"day{i}", "command": f"cmd{i}", "partial": True,
                                  **metas[i]}, tmp_path / f"run{i}", with_plot=False)
    out = tmp_path / "merged"
    assert bench.main(["--merge", str(tmp_path / "run0/bench.json"), str(tmp_path / "run1/bench.json"),
                       "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    got = {(r["shape"], r["provider"]): r["ms"] for r in data["rows"]}
    assert got == {("1", "flashjvp"): 2.0, ("5", "flashjvp"): 1.0, ("1", "reference"): 3.0,
                   ("1", "jvp-flash-attention"): 4.0}
    assert [r["command"] for r in data["runs"]] == ["cmd0", "cmd1"] and "partial" not in data
    # a later run without --kernel keeps the earlier run's kernel note; a provider measured in
    # some run is not listed as unavailable
    assert data["kernels"] == {"reference": "ref.py:attention"}
    assert data["unavailable"] == {"torch-cudnn": "no cuDNN"}
    md = (out / "bench.md").read_text()
    assert "cmd0" in md and "cmd1" in md and "1.50x" in md
    assert "kernel reference: ref.py:attention" in md and "jvp-flash-attention: not available" not in md
    # a merged report merged again keeps one line per run
    again = tmp_path / "again"
    assert bench.main(["--merge", str(out / "bench.json"), str(tmp_path / "run1/bench.json"), "--out", str(again)]) == 0
    assert [r["command"] for r in json.loads((again / "bench.json").read_text())["runs"]] == ["cmd0", "cmd1", "cmd1"]
    assert "1. day0: `cmd0`\n2. day1: `cmd1`\n3. day1: `cmd1`" in (again / "bench.md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--merge", str(tmp_path / "run0/bench.json")])  # --out is required


def test_report_without_plot_and_empty(tmp_path):
    paths = bench.write_report([], {}, tmp_path, with_plot=False)
    assert set(paths) == {"json", "md"}
    assert json.loads(paths["json"].read_text())["rows"] == []


def test_cli(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--kernel" in out and "--quick" in out and "7b=video-xattn-tqkv" in out
    assert [s.id for s in bench.select_shapes(["1,7b", "gqa8k-causal"])] == ["1", "7b", "8"]
    assert len(bench.select_shapes(None)) == len(bench.SHAPES)
    with pytest.raises(ValueError, match="unknown shape"):
        bench.select_shapes(["9"])
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "nope"])


def test_package_entry_runs_the_suite():
    """`python -m flashjvp.bench` (the package keeps only this entry) runs benchmarks/bench.py."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "flashjvp.bench", "--help"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python -m benchmarks.bench" in done.stdout and "--kernel" in done.stdout


KERNEL = """
import torch
from flash_attn.flash_attn_interface import _flash_attn_backward

import flashjvp


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tq, tk, tv, causal, scale):
        return flashjvp.attention_jvp_ref(q, k, v, tq, tk, tv, causal=causal, scale=scale)

    @staticmethod
    def backward(ctx, do, dto):
        _flash_attn_backward(do)


attention = _F.apply
"""


@pytest.fixture
def kernel_file(tmp_path):
    """A kernel file that needs flash_attn (absent here) for its backward, like the reference."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed: no stub needed")
    path = tmp_path / "kern.py"
    path.write_text(KERNEL)
    yield path
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flashjvp_bench_kernel_kern"):
        sys.modules.pop(name, None)


def test_load_kernel_with_flash_attn_stub(kernel_file):
    provider, note = bench.load_kernel(f"kern={kernel_file}:attention")
    assert provider.name == "kern" and "stub" in note and provider.zero_fill
    with pytest.raises(NotImplementedError, match="flash_attn is not installed"):
        sys.modules["flash_attn.flash_attn_interface"]._flash_attn_backward()
    with pytest.raises(ValueError):
        bench.load_kernel("no-equals-sign")


def test_tiny_run_on_cpu(kernel_file, monkeypatch):
    """The measuring loop end to end on a tiny shape, CUDA memory calls and do_bench faked;
    flashjvp takes its plain-PyTorch CPU path (the interpreter is too slow for a smoke test)."""
    import triton.testing

    import flashjvp.interface

    monkeypatch.setattr(flashjvp.interface, "interpreting", lambda: False)
    for fn in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2**20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**40, 2**40))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.5)[1])
    monkeypatch.setattr(bench, "make_inputs", functools.partial(bench.make_inputs, device="cpu"))
    shapes = [Shape("t", "tiny", 1, 2, 2, 16, 16, 16),
              Shape("tq", "tiny-q", 1, 2, 2, 16, 8, 16, all_tangents=False)]
    providers = [bench.builtin_provider(n) for n in ("flashjvp", "torch-cudnn", "torch-math-jvp")]
    providers.append(bench.load_kernel(f"kern={kernel_file}:attention")[0])
    lines = []
    rows = bench.run(shapes, providers, bench.MODES, torch.float32, quick=True, log=lines.append)
    assert len(rows) == len(lines) == 2 * (5 + 2 + 3 + 3)  # modes of flashjvp, cudnn, math-jvp, kern
    got = {(r.shape, r.provider, r.mode): r for r in rows}
    for r in rows:
        assert (r.skip is None) == (r.ms is not None)
    for mode in bench.MODES:
        r = got[("t", "flashjvp", mode)]
        assert r.ms == 0.5 and r.peak_mib == 1.0
        assert r.tflops == pytest.approx(shapes[0].flops(mode) / 0.5e9)
    assert got[("t", "torch-math-jvp", "fwd_jvp")].tiles is None
    assert got[("tq", "torch-math-jvp", "fwd_jvp")].ms == 0.5
    assert got[("t", "torch-math-jvp", "jvp_bwd")].ms == 0.5
    assert got[("t", "kern", "fwd_jvp")].ms == 0.5
    assert "flash_attn is not installed" in got[("t", "kern", "bwd")].skip
    assert "flash_attn is not installed" in got[("t", "kern", "scm")].skip
    assert got[("t", "torch-cudnn", "fwd")].skip  # no cuDNN attention on the CPU
    late = bench.run(shapes[:1], providers[:1], ["fwd"], torch.float32, time_limit=1e-9, log=lines.append)
    assert "time limit" in late[0].skip


def test_flashjvp_path_providers(monkeypatch):
    """flashjvp-triton / flashjvp-cudnn: flashjvp with FLASHJVP_CUDNN forced to 0 / 1 while the
    provider is built, measured and logged (the backward of bwd and scm included), then restored."""
    import os

    import triton.testing

    import flashjvp

    assert bench.builtin_provider("flashjvp-triton").env == {"FLASHJVP_CUDNN": "0"}
    cudnn = bench.builtin_provider("flashjvp-cudnn")
    assert cudnn.env == {"FLASHJVP_CUDNN": "1"} and cudnn.modes == ("fwd", "bwd", "scm")
    assert bench.builtin_provider("flashjvp").env is None
    assert "flashjvp-cudnn" not in bench.DEFAULT_PROVIDERS and "flashjvp-cudnn" in bench.BUILTIN_PROVIDERS
    monkeypatch.setenv("FLASHJVP_CUDNN", "auto")
    with harness.scoped_env(cudnn.env):
        assert os.environ["FLASHJVP_CUDNN"] == "1"
    assert os.environ["FLASHJVP_CUDNN"] == "auto"
    monkeypatch.delenv("FLASHJVP_CUDNN")
    with harness.scoped_env(cudnn.env):
        assert os.environ["FLASHJVP_CUDNN"] == "1"
    assert "FLASHJVP_CUDNN" not in os.environ

    for fn in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2**20)
    seen = []
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **kw: (seen.append(("do_bench", os.environ.get("FLASHJVP_CUDNN"))), fn(), 0.5)[2])

    def fwd(x):
        seen.append(("fwd", os.environ.get("FLASHJVP_CUDNN")))
        return flashjvp.attention_ref(x.q, x.k, x.v)

    p = bench.Provider("probe", ("fwd", "bwd"), fwd=fwd, env={"FLASHJVP_CUDNN": "1"})
    monkeypatch.setattr(bench, "make_inputs", functools.partial(bench.make_inputs, device="cpu"))
    rows = bench.run([Shape("t", "tiny", 1, 2, 2, 16, 16, 16)], [p], ["fwd", "bwd"], torch.float32, quick=True,
                     log=lambda line: None)
    assert all(r.ms == 0.5 for r in rows) and seen and all(v == "1" for _, v in seen)
    assert "FLASHJVP_CUDNN" not in os.environ


def test_path_speedups_in_report():
    rows = [_row("1", "flashjvp-triton", "fwd", 1.2), _row("1", "flashjvp-cudnn", "fwd", 1.0),
            _row("1", "flashjvp-triton", "bwd", 4.0), _row("1", "flashjvp-cudnn", "bwd", 3.2),
            _row("3", "flashjvp-triton", "scm", 5.0), _row("3", "flashjvp-cudnn", "scm", skip="x")]
    assert bench.path_speedups(rows) == {("1", "fwd"): pytest.approx(1.2), ("1", "bwd"): pytest.approx(1.25)}
    md = bench.format_report(rows, {})
    assert "## flashjvp's cuDNN dispatch" in md and "1.20x" in md and "1.25x" in md
    assert "cuDNN dispatch" not in bench.format_report(_rows(), {})
    assert harness.describe_tiles({"cudnn_sdpa_bwd": {}}) == "cudnn_sdpa_bwd"
