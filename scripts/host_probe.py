"""GPU diagnostic: how much of a call is GPU work and how much is the host, per kernel.

For each benchmark shape, provider and mode it prints the median of ``do_bench`` (what the
benchmark reports) next to the GPU time of the kernels one call launches (torch.profiler,
summed over 20 calls, per kernel name). ``do_bench`` well above the kernel sum means the
call is host-bound: Python, argument binding and launch latency, not the kernels.

    PYTHONPATH=src python scripts/host_probe.py --shapes 5 6 --modes fwd bwd fwd_jvp

It also prints the host time of one call (calls issued back to back, GPU queue not waited
for) and, with ``--profile``, the top functions of a cProfile of the backward launcher called
directly (autograd runs a custom Function's backward on its CUDA worker thread, which
cProfile does not see).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import torch
import triton
import triton.testing
from torch.profiler import ProfilerActivity, profile

from flashjvp import bench

CALLS = 20


def kernel_times(fn, leaves) -> dict[str, float]:
    """GPU microseconds per call, per kernel name, over CALLS calls."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            for t in leaves:
                t.grad = None
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time / CALLS
    return dict(per)


def host_ms(fn, leaves, calls: int = 50) -> float:
    """Milliseconds of host time per call: ``calls`` calls issued without waiting for the GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        for t in leaves:
            t.grad = None
        fn()
    ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return ms


def profile_bwd_launcher(x) -> None:
    """cProfile of ``attn_bwd`` called directly, 200 calls, top 15 by own time."""
    from flashjvp._bwd import attn_bwd
    from flashjvp._fwd import attn_fwd
    from flashjvp._validate import check_inputs

    a = check_inputs(x.q, x.k, x.v, causal=x.s.causal, allow_float64=False)
    o, _, lse, _ = attn_fwd(x.q, x.k, x.v, None, None, None, a)
    attn_bwd(x.do, x.q, x.k, x.v, o, lse, a)
    print(f"    attn_bwd host {host_ms(lambda: attn_bwd(x.do, x.q, x.k, x.v, o, lse, a), []):.4f} ms/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        attn_bwd(x.do, x.q, x.k, x.v, o, lse, a)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["5", "6"])
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd", "fwd_jvp"])
    p.add_argument("--providers", nargs="+", default=["flashjvp", "torch-flash"])
    p.add_argument("--profile", action="store_true", help="cProfile the backward launcher (flashjvp)")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for s in bench.select_shapes(a.shapes):
        x = bench.make_inputs(s, torch.bfloat16)
        for mode in a.modes:
            for name in a.providers:
                prov = bench.builtin_provider(name)
                if mode not in prov.modes:
                    continue
                fn, leaves = bench.build(prov, mode, x)
                fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, grad_to_none=leaves or None, return_mode="median")
                per = kernel_times(fn, leaves)
                gpu = sum(per.values()) / 1e3
                host = host_ms(fn, leaves)
                print(f"{s.name} {s.dims} {mode} {name}: do_bench {ms:.4f} ms, kernels {gpu:.4f} ms "
                      f"(host-bound by {ms - gpu:+.4f} ms), host {host:.4f} ms/call", flush=True)
                for k, us in sorted(per.items(), key=lambda kv: -kv[1]):
                    print(f"    {us:9.1f} us  {k}", flush=True)
                if a.profile and mode == "bwd" and name == "flashjvp":
                    profile_bwd_launcher(x)


if __name__ == "__main__":
    main()
