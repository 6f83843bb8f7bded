"""Forward+JVP on tensors stored (B, N, H, D) (flash-attn's layout, contiguous; ``layout="bnhd"``),
bf16, all tangents: the pointer path (FLASHJVP_TMA=0) against the TMA path (FLASHJVP_TMA=1; in
run w that mode included the warp-specialized tile), both autotuned, and the TMA path on the
same data stored (B, H, N, D) for comparison. Prints median ms, TFLOP/s (3x a forward) and the
largest difference from the pointer path's outputs. Run from the repo root with PYTHONPATH=src on
the GPU:

    PYTHONPATH=src python3 benchmarks/experiments/seq_major.py
"""
import os

import torch
import triton
import triton.testing

import flashjvp
from flashjvp import _common

SHAPES = [(2, 24, 4096, 128), (1, 12, 32768, 128)]  # (B, H, N, D)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
for b, h, n, d in SHAPES:
    seq = [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(6)]  # (B, N, H, D)
    head = [x.transpose(1, 2).contiguous() for x in seq]  # the same values stored (B, H, N, D)
    flop = 3 * 4 * b * h * n * n * d
    base = None
    for path, xs, layout in (("0", seq, "bnhd"), ("1", seq, "bnhd"), ("1", head, "bhnd")):
        os.environ["FLASHJVP_TMA"] = path
        fn = lambda xs=xs, layout=layout: flashjvp.attention_jvp(*xs, layout=layout)  # noqa: E731
        name = f"B{b} H{h} N{n} D{d} stored {'BNHD' if xs is seq else 'BHND'} tma={path}"
        try:
            o, to = fn()
            torch.cuda.synchronize()
            if layout == "bhnd":
                o, to = o.transpose(1, 2), to.transpose(1, 2)
            if base is None:
                base = (o.clone(), to.clone())
            diff = max((a.float() - r.float()).abs().max().item() for a, r in zip((o, to), base))
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"{name}: {ms:.3f} ms {flop / ms / 1e9:.1f} TFLOP/s max|diff| {diff:.3g} "
                  f"{_common.last_config.get('_attn_fwd_kernel')}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__} {str(e)[:200]}", flush=True)
