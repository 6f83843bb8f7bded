"""Host (Python) time per eager call of flashjvp's public functions, against PyTorch's SDPA.

On a GPU every call runs for real on tensors so small (B1 H1 N64 D64 by default) that the kernels
take a few microseconds: the wall time per call of a long run of calls is the host's time, what
eager DiT-sized models are bound by. Each row is the best of ``--repeat`` runs of ``--calls``
calls (as ``timeit`` does: the least disturbed), with one synchronisation after each run, in
microseconds per call. Without a GPU the Triton launches are stubbed out (the CPU tensors take
the kernel path through the interpreter flag), which measures flashjvp's own Python only.

    PYTHONPATH=src python -m benchmarks.host_time [--out DIR]     # writes host_time.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernel path (launches stubbed below)

import torch.nn.functional as F  # noqa: E402

import flashjvp  # noqa: E402
from benchmarks.harness import results_dir, run_metadata  # noqa: E402
from flashjvp.sdpa import _math_sdpa  # noqa: E402


def per_call_us(fn, calls: int, repeat: int) -> float:
    fn()  # warm-up: plans, compilation, cuDNN graphs
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _stub_launches() -> None:
    """Without a GPU: every Triton launch returns at once (no kernel, no plan)."""
    from flashjvp import _bwd, _fwd

    stub = lambda *a, **k: ({"BLOCK_M": 16}, None)  # noqa: E731
    _fwd.plan_tuned = _bwd.plan_tuned = stub


def cases(q, k, v, tq, tk, tv, qg, kg, vg):
    """name -> (torch's call, flashjvp's call): the same computation both ways."""
    def fwd_bwd(f):
        def run():
            f(qg, kg, vg).sum().backward()
        return run

    def func_jvp(f):
        return lambda: torch.func.jvp(f, (q, k, v), (tq, tk, tv))

    def meanflow(f):  # the MeanFlow pattern: JVP, then a backward through the primal
        def run():
            o, _ = torch.func.jvp(f, (qg, kg, vg), (tq, tk, tv))
            o.sum().backward()
        return run

    return {
        "forward": (lambda: F.scaled_dot_product_attention(q, k, v), lambda: flashjvp.attention(q, k, v)),
        "sdpa forward": (lambda: F.scaled_dot_product_attention(q, k, v), lambda: flashjvp.sdpa(q, k, v)),
        "forward+backward": (fwd_bwd(F.scaled_dot_product_attention), fwd_bwd(flashjvp.attention)),
        "attention_jvp": (None, lambda: flashjvp.attention_jvp(q, k, v, tq, tk, tv)),
        "torch.func.jvp": (func_jvp(_math_sdpa), func_jvp(flashjvp.sdpa)),
        "MeanFlow (jvp + backward)": (meanflow(_math_sdpa), meanflow(flashjvp.sdpa)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--shape", type=int, nargs=4, default=(1, 1, 64, 64), metavar=("B", "H", "N", "D"))
    parser.add_argument("--out", type=Path, default=None, help="write host_time.json and .md here")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        _stub_launches()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    x = [torch.randn(*args.shape, device=device, dtype=dtype) for _ in range(6)]
    grads = [t.clone().requires_grad_() for t in x[:3]]
    rows = []
    for name, (ref, ours) in cases(*x, *grads).items():
        t_ref = None if ref is None or not gpu else per_call_us(ref, args.calls, args.repeat)
        t_ours = per_call_us(ours, args.calls, args.repeat)
        rows.append({"call": name, "torch_us": t_ref, "flashjvp_us": t_ours})
        ref_s = "" if t_ref is None else f"{t_ref:8.1f}"
        print(f"{name:28s} torch {ref_s:>8s} us   flashjvp {t_ours:8.1f} us", flush=True)
    name = torch.cuda.get_device_name() if gpu else "cpu"
    meta = run_metadata(name, "benchmarks.host_time", argv)
    meta["shape"] = list(args.shape)
    if args.out is not None or gpu:
        out = args.out or results_dir(name)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [f"# Host time per eager call ({name})", "",
                 f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}; "
                 f"B, H, N, D = {tuple(args.shape)}, {dtype}; `{meta['command']}`", "",
                 "PyTorch's side: SDPA's default backend for plain calls, math SDPA (plain ops) under torch.func.jvp. "
                 "Best of the runs, microseconds per call (wall time; the kernels take less).", "",
                 "| call | torch (us) | flashjvp (us) |", "|---|---|---|"]
        fmt = lambda t: "" if t is None else f"{t:.1f}"  # noqa: E731
        lines += [f"| {r['call']} | {fmt(r['torch_us'])} | {fmt(r['flashjvp_us'])} |" for r in rows]
        (out / "host_time.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out / 'host_time.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
