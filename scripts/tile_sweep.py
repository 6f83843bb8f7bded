"""GPU diagnostic: time every forward tile on given shapes, and the host's share of a call.

For each shape and mode (``fwd``: no tangents, ``fwd_jvp``: all tangents) it prints
- the config the autotuner picks and its time;
- each of the kernel's configs (or of ``--tiles``) forced alone (median of ``do_bench``, ms), or why it was pruned;
- the same call timed inside a CUDA graph (``do_bench_cudagraph``): GPU time without the
  Python side, so ``do_bench - cudagraph`` is what the host adds per call;
- with ``--check``, each tile's largest error per output (o, to, lse, mu) against the float64
  reference, as a multiple of the error of the same math done by PyTorch in the input dtype
  (the tests' measure: above ~3 plus the floor the tile is wrong).

    PYTHONPATH=src python scripts/tile_sweep.py --shapes 8,16,1024,72 32,16,256,72 2,24,4096,128
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

import flashjvp
from flashjvp import _common, _fwd
from flashjvp._common import use_tma


def _call(mode, q, k, v, tq, tk, tv):
    if mode == "fwd":
        return lambda: flashjvp.attention(q, k, v)
    return lambda: flashjvp.attention_jvp(q, k, v, tq, tk, tv)


def _errors(q, k, v, tq, tk, tv) -> str:
    """``name: kernel error / PyTorch-in-dtype error`` for o, to, lse, mu (one call)."""
    jvp = tq is not None
    args = (q, k, v, tq, tk, tv) if jvp else (q, k, v)
    got = flashjvp.attention_jvp(*args, return_lse=True)
    truth = flashjvp.attention_jvp_ref(*[x.double() for x in args], return_lse=True)
    lowp = flashjvp.attention_jvp_ref(*args, return_lse=True)
    parts = []
    for name, g, t, lp in zip(("o", "to", "lse", "mu"), got, truth, lowp):
        if g is None or t is None:
            continue
        err = (g.double() - t).abs().max().item()
        ref = (lp.double() - t).abs().max().item()
        parts.append(f"{name} {err:.2e} ({err / max(ref, 1e-30):.1f}x)")
    return ", ".join(parts)


def _force(configs):
    kernel = _fwd._attn_fwd_kernel
    kernel.configs = configs
    kernel.cache.clear()
    _common._TUNED.clear()  # launch_tuned's picked configs


def parse_tile(spec: str) -> triton.Config:
    """``BM,BN,WARPS,STAGES[,WS]`` -> one forward config (``WS`` 1: warp-specialized key loop)."""
    bm, bn, w, st, *ws = (int(x) for x in spec.split(","))
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": bool(ws) and ws[0] == 1}, num_warps=w, num_stages=st)


def _tile_name(c) -> str:
    ws = " WS" if c.kwargs.get("WS") else ""
    return f"BM{c.kwargs['BLOCK_M']} BN{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}{ws}"


def sweep(b, h, n, d, mode, dtype, tiles, check=False, autotune=True):
    x = [torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(6)]
    fn = _call(mode, *x)
    full = list(_fwd._attn_fwd_kernel.configs)
    print(f"B{b} H{h} N{n} D{d} {mode} {dtype}:", flush=True)
    if autotune:
        _force(full)
        fn()
        torch.cuda.synchronize()
        picked = ", ".join(_tile_name(c) for c in _fwd._attn_fwd_kernel.cache.values())
        t = triton.testing.do_bench(fn, return_mode="median")
        g = triton.testing.do_bench_cudagraph(fn, return_mode="median")
        print(f"  autotuned [{picked}] -> {t:.4f} ms, in a CUDA graph {g:.4f} ms "
              f"(host adds {t - g:+.4f} ms)", flush=True)
    tma = use_tma(x if mode != "fwd" else x[:3], kv_tangents=mode != "fwd", head_dims=(d, d), n_k=n)
    runnable = [c for c in full if not c.kwargs["WS"] or tma == 2]  # WS tiles: FLASHJVP_TMA=ws
    for c in tiles or runnable:
        _force([c])
        name = f"  {_tile_name(c)}"
        try:
            _fwd.launches["tma"] = 0
            fn()
            torch.cuda.synchronize()
            t = triton.testing.do_bench(fn, return_mode="median")
            g = triton.testing.do_bench_cudagraph(fn, return_mode="median")
            tma_ran = _fwd.launches["tma"] > 0
            print(f"{name}: {t:.4f} ms, graph {g:.4f} ms  [TMA path: {tma_ran}]", flush=True)
            if check:
                print(f"      errors: {_errors(*x[:3], *(x[3:] if mode != 'fwd' else (None,) * 3))}", flush=True)
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
    _force(full)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["8,16,1024,72", "32,16,256,72", "2,24,4096,128"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd_jvp"])
    p.add_argument("--dtype", nargs="+", default=["bfloat16"])
    p.add_argument("--check", action="store_true", help="also each tile's error against float64")
    p.add_argument("--no-autotune", dest="autotune", action="store_false",
                   help="skip the autotuned run (compiles every config) and time only the tiles")
    p.add_argument("--tiles", nargs="*", default=[],
                   help="BM,BN,WARPS,STAGES[,WS] tiles to time instead of the kernel's, e.g. 128,64,8,2 "
                        "or 128,64,4,2,1 (warp-specialized; needs the TMA path: FLASHJVP_TMA=1 or ws)")
    a = p.parse_args()
    tiles = [parse_tile(spec) for spec in a.tiles]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for s in a.shapes:
        for mode in a.modes:
            for dt in a.dtype:
                sweep(*map(int, s.split(",")), mode, getattr(torch, dt), tiles, a.check, a.autotune)


if __name__ == "__main__":
    main()
