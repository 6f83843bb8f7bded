"""The measurements behind the ``auto`` policy of the plain forward and backward (``_route.CUDNN_FASTER``).

For a grid of shapes (head dims 64/72/128, sequence lengths 256 to 8192, causal or not, and cross
attention with 512 keys), bf16, it times flashjvp's plain forward (no grad) and backward (of one
forward with grad) on its Triton kernels (``FLASHJVP_CUDNN=0``) and on PyTorch's cuDNN attention
(``FLASHJVP_CUDNN=1``), and PyTorch's own SDPA with its default backend beside them: median of
``triton.testing.do_bench``, ms. Writes ``dispatch_table.{json,md}`` under the GPU's results folder.

    PYTHONPATH=src python -m benchmarks.dispatch_table [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashjvp
from benchmarks.harness import results_dir, run_metadata

# (B, H, Nq, Nk, D, causal)
SHAPES = [(b, h, n, n, d, c) for d in (64, 72, 128) for (b, h, n) in ((32, 16, 256), (8, 16, 1024), (2, 16, 4096),
                                                                      (1, 16, 8192)) for c in (False, True)]
SHAPES += [(8, 16, 1024, 512, 72, False), (1, 40, 8192, 512, 128, False)]
# provider -> FLASHJVP_CUDNN for flashjvp, or PyTorch's SDPA backend (None: its default choice)
PROVIDERS = {"triton": "0", "cudnn": "1", "torch": None, "flash": SDPBackend.FLASH_ATTENTION}
FLASHJVP = ("triton", "cudnn")


def _time(fn, quick: bool) -> float:
    return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")


def measure(shape, provider: str, quick: bool) -> dict:
    b, h, nq, nk, d, causal = shape
    if provider in FLASHJVP:
        os.environ["FLASHJVP_CUDNN"] = PROVIDERS[provider]
    q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if provider in FLASHJVP:
        fn = lambda q, k, v: flashjvp.attention(q, k, v, causal=causal)  # noqa: E731
    else:
        backend = PROVIDERS[provider]

        def fn(q, k, v):
            with contextlib.nullcontext() if backend is None else sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with torch.no_grad():
        fwd = _time(lambda: fn(q, k, v), quick)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o = fn(*leaves)
    do = torch.randn_like(o)
    bwd = _time(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True), quick)
    return {"fwd_ms": fwd, "bwd_ms": bwd}


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    """``dispatch_table.json`` and ``dispatch_table.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    gpu = meta["gpu"]
    (out / "dispatch_table.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    f = lambda r, key: f"{r[key]:.3f}" if key in r else r.get(key.split("_")[0] + "_error", "")  # noqa: E731
    lines = [f"# Plain forward and backward: Triton against cuDNN ({gpu})", "",
             f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}, bf16; `{meta['command']}`", "",
             "Median ms (`triton.testing.do_bench`). triton: flashjvp with FLASHJVP_CUDNN=0; cudnn: with "
             "FLASHJVP_CUDNN=1 (PyTorch's cuDNN attention operators); torch: F.scaled_dot_product_attention "
             "with its default backend; flash: its flash backend. Ratio: triton / cudnn.", "",
             "| B | H | Nq | Nk | D | causal | fwd triton | fwd cudnn | fwd torch | fwd flash | fwd ratio "
             "| bwd triton | bwd cudnn | bwd torch | bwd flash | bwd ratio |", "|" + "---|" * 16]
    for r in rows:
        b, h, nq, nk, d, c = r["shape"]
        ratio = lambda k, r=r: (f"{r['triton_' + k] / r['cudnn_' + k]:.2f}"  # noqa: E731
                                if "triton_" + k in r and "cudnn_" + k in r else "")
        lines.append(f"| {b} | {h} | {nq} | {nk} | {d} | {c} | {f(r, 'triton_fwd_ms')} | {f(r, 'cudnn_fwd_ms')} | "
                     f"{f(r, 'torch_fwd_ms')} | {f(r, 'flash_fwd_ms')} | {ratio('fwd_ms')} | {f(r, 'triton_bwd_ms')} | "
                     f"{f(r, 'cudnn_bwd_ms')} | {f(r, 'torch_bwd_ms')} | {f(r, 'flash_bwd_ms')} | {ratio('bwd_ms')} |")
    (out / "dispatch_table.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dims", type=int, nargs="+", default=None, help="only these head dims")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    out = args.out or results_dir(gpu)
    meta = run_metadata(gpu, "benchmarks.dispatch_table", argv)
    rows = []
    for shape in [s for s in SHAPES if args.dims is None or s[4] in args.dims]:
        row = {"shape": list(shape)}
        for provider in PROVIDERS:
            try:
                for key, value in measure(shape, provider, args.quick).items():
                    row[f"{provider}_{key}"] = value
            except Exception as e:  # noqa: BLE001 - a row with the reason, the run goes on
                row[f"{provider}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
        print(row, flush=True)
        write_report(rows, meta, out)  # after every row: a run cut short still leaves its report
    os.environ.pop("FLASHJVP_CUDNN", None)
    print(f"wrote {out / 'dispatch_table.md'}")


if __name__ == "__main__":
    main()
