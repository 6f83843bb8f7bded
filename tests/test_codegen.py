"""What the kernels compile to on the H200, checked on a machine without a GPU.

``scripts/compile_report.py`` compiles the real launches for sm_90a with Triton's bundled LLVM and
ptxas. Guarded here: head dims and strides that are multiples of 8 but not of 16 (D = 72, DiT-XL/2)
must still give 16-byte vector loads and pipelined async copies (``ALIGN``; without it every load
was a 2-byte ``ld.global.b16``, 3.3x slower on the H200), while a head dim of 37 must not claim it.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="Triton without its CUDA backend")


def compile_report(*args: str, **extra_env: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | extra_env
    res = subprocess.run([sys.executable, str(ROOT / "scripts/compile_report.py"), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize(("d", "vector"), [(72, True), (37, False)], ids=["d72", "d37"])
def test_forward_loads_are_vectorized_when_aligned(d, vector):
    out = compile_report("--b", "2", "--h", "2", "--n", "256", "--d", str(d), "--mode", "fwd",
                         "--tile", "64", "32", "4", "2")
    assert "_attn_fwd_kernel" in out, out
    align = "'ALIGN': 8" in out
    assert align == vector, out
    if vector:
        assert "ld.global.v4.b32" in out and "ld.global.b16" not in out, out
        assert "cp.async bytes ['0x10']" in out, out  # K/V tiles pipelined with 16-byte copies
    else:
        assert "ld.global.b16" in out, out


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"], ids=["head-major", "seq-major"])
def test_tma_path_descriptors(layout, tmp_path):
    """On the TMA path K, V, tK and tV are loaded with 4-D TMA copies through descriptors made on
    the host, q and tq with 2-D copies through descriptors built in the kernel, and o, to, lse
    and mu are stored with plain stores: TMA stores through device-built descriptors left whole
    row blocks unwritten on the H200. Sequence-major storage ((B, N, H, D)) compiles the same way."""
    ptx = tmp_path / "tma.ptx"
    compile_report("--b", "1", "--h", "2", "--n", "1024", "--d", "128", "--layout", layout, "--tma",
                   "--tile", "128", "64", "8", "2", DUMP_PTX=str(ptx))
    text = ptx.read_text()
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::(?:cluster|cta)\.global", text)  # cta: Triton 3.9
    assert "4" in loads, f"no 4-D (host-made descriptor) TMA loads: {loads}"
    assert "2" in loads, f"no 2-D (device-built descriptor) TMA loads of q: {loads}"
    assert set(loads) == {"2", "4"}, f"unexpected TMA copies: {loads}"
    builds = len(re.findall(r"tensormap\.cp_fenceproxy", text))
    assert builds == 2, f"descriptors built on the device: {builds}, expected 2 (q and tq)"
    stores = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared[^\n]*", text)
    assert not stores, f"TMA store: {stores[0]}"
    assert re.search(r"st\.global", text), "no plain stores"


def _kernel_report(out: str, name: str) -> str:
    """The lines compile_report printed for kernel ``name`` (empty if it was not compiled)."""
    m = re.search(rf"^{name}:.*(?:\n    .*)*", out, re.MULTILINE)
    return m.group(0) if m else ""


def test_tail_split_compiles_like_whole_blocks():
    """The tail-split launch of B1 H12 N32768 D128 (the default TMA tile; _split.py) compiles like
    the plain one: no register spills, the same wgmma and TMA copies; its merge kernel spills
    nothing either (its 16-row programs keep three float32 tiles in registers)."""
    args = ["--b", "1", "--h", "12", "--n", "32768", "--d", "128", "--tma", "--tile", "128", "64", "8", "2"]
    plain = _kernel_report(compile_report(*args), "_attn_fwd_kernel")
    out = compile_report(*args, "--split", "132")
    split, merge = _kernel_report(out, "_attn_fwd_kernel"), _kernel_report(out, "_attn_merge_kernel")
    assert plain and split and merge, out
    for report in (split, merge):
        assert re.search(r"\b0 bytes spill stores", report), report
    for what in (r"wgmma (\d+)", r"TMA copies (\d+)"):
        assert re.search(what, split).group(1) == re.search(what, plain).group(1), (plain, split)


@pytest.mark.parametrize("mode", ["fwd_jvp", "bwd"])
def test_block_mask_kernels_compile(mode):
    """A frame-causal block mask (frames of 130 tokens: partial blocks on both sides of every frame
    edge): the SPARSE forward+JVP, dQ and dK/dV kernels compile for sm_90a without spills. The CPU
    interpreter runs kernels as Python, so it cannot see a kernel that fails to compile."""
    out = compile_report("--b", "1", "--h", "2", "--n", "1000", "--d", "64", "--frame", "130", "--mode", mode)
    names = ["_attn_fwd_kernel"] if mode == "fwd_jvp" else ["_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"]
    for name in names:
        report = _kernel_report(out, name)
        assert "'SPARSE': True" in report, out
        assert re.search(r"\b0 bytes spill stores", report), report
