"""D=64 forward+JVP on the H200 (B4 H32 N4096 bf16, all tangents, non-causal and causal): the
pointer path autotuned against tiles forced on the TMA path (warp-specialized and plain), and
the reference kernel (benchmarks/third_party/reference_jvp.py) in the same run. Prints median ms
of ``do_bench``, TFLOP/s (3x a forward; causal halves it) and each tile's largest difference
from the pointer path's outputs. Run from the repo root on the GPU:

    PYTHONPATH=src python3 benchmarks/experiments/d64_ws.py [BM,BN,W,S[,WS] ...]
"""
import os
import sys

import torch
import triton
import triton.testing

import flashjvp
from flashjvp import _common, _fwd
from flashjvp.bench import load_kernel

sys.path.insert(0, "scripts")
from tile_sweep import _force, _tile_name, parse_tile  # noqa: E402

FULL = list(_fwd._attn_fwd_kernel.configs)
SPECS = sys.argv[1:] or ["128,64,4,2,1", "128,64,4,3,1", "128,128,4,2,1", "128,64,8,3", "128,64,8,2"]
TILES = [parse_tile(spec) for spec in SPECS]
try:  # the benchmark's loader stubs the missing flash_attn package (needed for backward only)
    load_kernel("reference=benchmarks/third_party/reference_jvp.py:attention")
    ref = sys.modules["flashjvp_bench_kernel_reference"]
except Exception as e:  # noqa: BLE001 - a diagnostic: go on without it
    print(f"reference kernel not loaded: {type(e).__name__} {e}")
    ref = None
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
b, h, n, d = 4, 32, 4096, 64
x = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(6)]


def report(name, f, flop, base=None):
    """Time ``f`` and print ms, TFLOP/s and its largest difference from ``base``; its outputs."""
    try:
        o, to = f()
        torch.cuda.synchronize()
        diff = "" if base is None else (
            f" max|diff| {max((a.float() - r.float()).abs().max().item() for a, r in zip((o, to), base)):.3g}")
        ms = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
        print(f"  {name}: {ms:.4f} ms {flop / ms / 1e9:.1f} TFLOP/s{diff}", flush=True)
        return o.clone(), to.clone()
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: {type(e).__name__} {str(e).splitlines()[0][:160]}", flush=True)


for causal in (False, True):
    flop = 3 * 4 * b * h * n * n * d / (2 if causal else 1)
    fn = lambda causal=causal: flashjvp.attention_jvp(*x, causal=causal)  # noqa: E731
    print(f"B{b} H{h} N{n} D{d} causal={causal}", flush=True)
    os.environ["FLASHJVP_TMA"] = "0"
    _force(FULL)
    base = report("pointer path autotuned", fn, flop)
    print(f"    picked {_common.last_config.get('_attn_fwd_kernel')}", flush=True)
    if ref is not None:
        report("reference kernel", lambda causal=causal: ref.attention(*x, causal, d ** -0.5), flop, base)
    os.environ["FLASHJVP_TMA"] = "1"
    for c in TILES:
        _force([c])
        report(f"tma {_tile_name(c)}", fn, flop, base)
    _force(FULL)
    report("tma autotuned", fn, flop, base)
    print(f"    picked {_common.last_config.get('_attn_fwd_kernel')}", flush=True)
