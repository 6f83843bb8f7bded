"""Soak of the TMA path's tiles: many forward+JVP calls (bf16, all tangents), each on fresh copies
of one of two input sets, outputs NaN-filled first (FLASHJVP_POISON=1). A call fails when o, to,
lse or mu hold a NaN (a row never written) or differ by more than 0.05 from the pointer path's
result for that set. Prints, per tile and shape, the calls run and the failing calls.

    PYTHONPATH=src python3 benchmarks/experiments/ws_soak.py --calls 3000 1:128,64,4,2,1 1:64,64,4,2,1
        [--shapes b2h24n4096 gqa4-777x1333-br b1h12n32768 sa1000-causal] [--dtype fp16] [--layout bnhd]

Tiles as ``TMA:BM,BN,WARPS,STAGES,WS``, ``TMA`` the FLASHJVP_TMA value (a forced tile runs
whatever the prune says: ``1:...,1`` and ``ws:...,1`` both run the warp-specialized tile); run
from the repo root on the GPU."""
import os

os.environ["FLASHJVP_POISON"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

import flashjvp  # noqa: E402

sys.path.insert(0, "scripts")
from tile_sweep import _force, parse_tile  # noqa: E402

SHAPES = {  # (B, Hq, Hkv, N_q, N_k, D, causal)
    "b2h24n4096": (2, 24, 24, 4096, 4096, 128, False),
    "gqa4-777x1333-br": (1, 8, 2, 777, 1333, 128, "bottom_right"),
    "b1h12n32768": (1, 12, 12, 32768, 32768, 128, False),
    "sa1000-causal": (2, 4, 4, 1000, 1000, 128, True),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def inputs(b, hq, hkv, nq, nk, d, seed, dtype, layout):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(h, n):
        shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
        return torch.randn(shape, device="cuda", dtype=dtype, generator=g)

    return [r(hq, nq), r(hkv, nk), r(hkv, nk), r(hq, nq), r(hkv, nk), r(hkv, nk)]


ap = argparse.ArgumentParser()
ap.add_argument("--calls", type=int, default=1000)
ap.add_argument("--seconds", type=float, default=60.0, help="per tile and shape, at most")
ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["b2h24n4096", "gqa4-777x1333-br"])
ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
ap.add_argument("--layout", choices=["bhnd", "bnhd"], default="bhnd", help="bnhd: stored (B, N, H, D)")
ap.add_argument("tiles", nargs="+")
cli = ap.parse_args()
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
for name in cli.shapes:
    b, hq, hkv, nq, nk, d, causal = SHAPES[name]
    sets = [inputs(b, hq, hkv, nq, nk, d, seed, DTYPES[cli.dtype], cli.layout) for seed in (0, 1)]
    os.environ["FLASHJVP_TMA"] = "0"
    _force([parse_tile("128,64,8,2")])
    kw = {"causal": causal, "layout": cli.layout, "return_lse": True}
    base = [[t.clone() for t in flashjvp.attention_jvp(*xs, **kw)] for xs in sets]
    for spec in cli.tiles:
        path, tile_spec = spec.split(":")
        tile = tuple(int(x) for x in tile_spec.split(","))  # printed with the result
        os.environ["FLASHJVP_TMA"] = path
        _force([parse_tile(tile_spec)])
        bad, t0, i = [], time.time(), 0
        while i < cli.calls and time.time() - t0 < cli.seconds:
            args = [t.clone() for t in sets[i % 2]]
            out = flashjvp.attention_jvp(*args, **kw)
            nan = sum(int(torch.isnan(t).sum()) for t in out)
            wrong = sum(int(((t.float() - r.float()).abs() > 0.05).sum()) for t, r in zip(out, base[i % 2]))
            if nan or wrong:
                bad.append(f"call {i}: nan={nan} wrong={wrong}")
            i += 1
        print(f"{name} {cli.dtype} {cli.layout} tma={path} {tile}: {i} calls, {len(bad)} failed "
              + "; ".join(bad[:8]), flush=True)
