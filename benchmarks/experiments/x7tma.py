"""512-key video cross-attention (B1 H40 Nq32760 Nk512 D128), tq only and all tangents: the
pointer path against the TMA path (FLASHJVP_TMA=1, plain and warp-specialized tiles), tiles
forced one at a time, outputs compared with the first (pointer) tile of the same case.
Run from the repo root with PYTHONPATH=src on the GPU."""
import os
import sys

import torch
import triton
import triton.testing

import flashjvp
from flashjvp import _common, _fwd

sys.path.insert(0, "scripts")
from tile_sweep import _force  # noqa: E402

FULL = list(_fwd._attn_fwd_kernel.configs)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
x = [torch.randn(1, 40, n, 128, device="cuda", dtype=torch.bfloat16) for n in (32760, 512, 512, 32760, 512, 512)]
# (path, BLOCK_M, BLOCK_N, num_warps, num_stages, WS)
TILES = [("0", 128, 64, 8, 3, False), ("0", 128, 64, 8, 2, False),
         ("1", 128, 64, 8, 3, False), ("1", 128, 64, 8, 2, False),
         ("1", 128, 64, 4, 2, True), ("1", 64, 64, 4, 2, True), ("1", 64, 64, 4, 3, False)]
for label, args in (("q", x[:4]), ("qkv", x)):
    fn = lambda args=args: flashjvp.attention_jvp(*args)  # noqa: E731
    base = None
    for path, bm, bn, w, s, ws in TILES:
        os.environ["FLASHJVP_TMA"] = path
        _force([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": ws}, num_warps=w, num_stages=s)])
        name = f"{label} tma={path} {bm}x{bn} w{w} s{s}{' WS' if ws else ''}"
        try:
            o, to = fn()
            torch.cuda.synchronize()
            if base is None:
                base = (o.clone(), to.clone())
            diff = max((o - base[0]).abs().max().item(), (to - base[1]).abs().max().item())
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(f"{name}: {ms:.4f} ms  launches.tma={_fwd.launches['tma']}  max|diff| {diff:.3g}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__} {str(e)[:160]}", flush=True)
os.environ.pop("FLASHJVP_TMA")
_force(FULL)
for _round in range(2):
    for label, args in (("qkv", x), ("q", x[:4])):
        fn = lambda args=args: flashjvp.attention_jvp(*args)  # noqa: E731
        fn()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"autotuned {label}: {ms:.4f} ms {_common.last_config.get('_attn_fwd_kernel')}", flush=True)
