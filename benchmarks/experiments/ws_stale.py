"""Stale tensor descriptors on the TMA path? Forward+JVP at B2 H24 N4096 D128 (bf16, all
tangents), eight calls per tile alternating two input sets, each call on fresh copies of the
inputs (kept alive: no address repeats) writing fresh outputs, all NaN-filled first
(FLASHJVP_POISON=1). Per call: NaN elements of o/to/lse/mu (rows never written) and elements
differing by more than 0.05 from the pointer path's result for that input set (reads through a
descriptor of another call's tensors), then the tile's median time. Arguments (optional):
``--calls N`` and tiles as ``TMA:BM,BN,WARPS,STAGES,WS`` (e.g. ``1:64,64,4,2,1``); the default is
the list below. Run from the repo root with PYTHONPATH=src on the GPU."""
import os

os.environ["FLASHJVP_POISON"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

import flashjvp  # noqa: E402

sys.path.insert(0, "scripts")
from tile_sweep import _force  # noqa: E402

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
sets = [[torch.randn(2, 24, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(6)] for _ in range(2)]


def config(bm, bn, w, st, ws):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": ws}, num_warps=w, num_stages=st)


os.environ["FLASHJVP_TMA"] = "0"
_force([config(128, 64, 8, 2, False)])
base = [[t.clone() for t in flashjvp.attention_jvp(*xs, return_lse=True)] for xs in sets]
ap = argparse.ArgumentParser()
ap.add_argument("--calls", type=int, default=8)
ap.add_argument("tiles", nargs="*")
cli = ap.parse_args()
TILES = [("0", (128, 64, 8, 2, False)), ("1", (128, 64, 8, 2, False)), ("1", (128, 64, 4, 2, True)),
         ("1", (64, 64, 4, 2, True))]
if cli.tiles:
    TILES = [(t.split(":")[0], tuple(int(x) for x in t.split(":")[1].split(","))) for t in cli.tiles]
for path, tile in TILES:
    tile = (*tile[:4], bool(tile[4]))
    os.environ["FLASHJVP_TMA"] = path
    _force([config(*tile)])
    kept = []
    for i in range(cli.calls):
        args = [t.clone() for t in sets[i % 2]]
        out = flashjvp.attention_jvp(*args, return_lse=True)
        torch.cuda.synchronize()
        kept.append((args, out))
        parts = []
        for name, t, b in zip(("o", "to", "lse", "mu"), out, base[i % 2]):
            nan = int(torch.isnan(t).sum())
            wrong = int(((t.float() - b.float()).abs() > 0.05).sum())  # NaN compares False
            parts.append(f"{name} nan={nan} wrong={wrong}")
        print(f"tma={path} {tile} call {i} (set {i % 2}): " + "; ".join(parts), flush=True)
    del kept
    ms = triton.testing.do_bench(lambda: flashjvp.attention_jvp(*sets[0]), warmup=25, rep=100, return_mode="median")
    print(f"tma={path} {tile}: {ms:.4f} ms", flush=True)
