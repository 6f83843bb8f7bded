"""Issue 34, step 1: the ceiling a CuTe-DSL kernel could reach, next to what we have.

One GPU run measures, at bf16 (triton.testing.do_bench, median):
  fa4-cute      FlashAttention-4's CuTe-DSL forward (flash_attn.cute, its SM90 path), plain attention;
  cudnn         torch SDPA, SDPBackend.CUDNN_ATTENTION;
  torch-flash   torch SDPA, SDPBackend.FLASH_ATTENTION;
  flashjvp      flashjvp.attention (Triton forward);
  flashjvp-jvp  flashjvp.attention_jvp with all three tangents, credited 3x forward FLOPs;
  gemm6         the six products of forward+JVP alone (S = Q Kt, tQ Kt, Q tKt, P V, tP V, P tV) as
                batched bf16 matmuls at the attention shape, dense, credited 3x (dense) forward FLOPs.
                The logits products write N x N outputs to memory, which a fused kernel never does,
                so this is a GEMM-only reference, not a strict upper bound;
and a plain 8192^3 bf16 GEMM. Forward FLOPs: 4*B*H*Nq*Nk*D, halved when causal.

Every provider runs inside try/except: an error is recorded as text, the run goes on.

The CuTe packages travel as archives (their libraries are too big for wheels within the carry
limit): --cute-archives DIR unpacks DIR/*.tar.xz into --cute-dir once, and --cute-dir (and its
nvidia_cutlass_dsl/dsl_packages, which the wheel's .pth would add) go on sys.path.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/cute_ceiling.py --out $OUT --cute-archives .whl-cute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import time
import traceback
from pathlib import Path

# (B, H, N, D): D128 shapes (the brief's square sweep and the suite's D128 self-attention), D64 a few.
SHAPES_D128 = [(16, 16, 1024), (8, 16, 2048), (4, 16, 4096), (2, 16, 8192), (1, 16, 16384), (2, 24, 4096),
               (1, 12, 32768)]
SHAPES_D64 = [(8, 16, 2048), (4, 32, 4096)]
QUICK = [(4, 16, 4096, 128), (4, 32, 4096, 64)]
PROVIDERS = ("fa4-cute", "cudnn", "torch-flash", "flashjvp", "flashjvp-jvp", "gemm6")
JVP_FACTOR = {"flashjvp-jvp": 3.0, "gemm6": 3.0}


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool) -> float:
    """Forward FLOPs: two products of 2*Nq*Nk*D each per head, half of them when causal."""
    return 4.0 * b * h * nq * nk * d * (0.5 if causal else 1.0)


def provider_flops(provider: str, b: int, h: int, n: int, d: int, causal: bool) -> float:
    if provider == "gemm6":  # the matmuls are dense whatever the mask
        causal = False
    return JVP_FACTOR.get(provider, 1.0) * attention_flops(b, h, n, n, d, causal)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def setup_cute(cute_dir: Path, archives: Path | None) -> str:
    """Unpack the carried archives (once) and put the CuTe packages on sys.path."""
    log = []
    if archives is not None:
        stamp = cute_dir / ".unpacked"
        if not stamp.exists():
            cute_dir.mkdir(parents=True, exist_ok=True)
            t = time.time()
            for a in sorted(archives.glob("*.tar.xz")):
                with tarfile.open(a) as tf:
                    tf.extractall(cute_dir)
                log.append(a.name)
            stamp.write_text("\n".join(log))
            log.append(f"unpacked in {time.time() - t:.1f} s")
    for p in (cute_dir / "nvidia_cutlass_dsl" / "dsl_packages", cute_dir):
        if p.is_dir() and str(p) not in sys.path:
            sys.path.insert(0, str(p))
    return "; ".join(log)


def make_fns(provider: str, b: int, h: int, n: int, d: int, causal: bool):
    """The callable to time for one provider and shape (inputs made here, on the GPU)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=g)

    if provider == "fa4-cute":
        from flash_attn.cute import flash_attn_func

        q, k, v = (rnd(b, n, h, d) for _ in range(3))  # (B, N, H, D)

        def fn():
            with torch.no_grad():
                return flash_attn_func(q, k, v, causal=causal)
        return fn
    if provider in ("cudnn", "torch-flash"):
        backend = SDPBackend.CUDNN_ATTENTION if provider == "cudnn" else SDPBackend.FLASH_ATTENTION
        q, k, v = (rnd(b, h, n, d) for _ in range(3))

        def fn():
            with sdpa_kernel([backend]), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn
    if provider == "flashjvp":
        import flashjvp

        q, k, v = (rnd(b, h, n, d) for _ in range(3))
        return lambda: flashjvp.attention(q, k, v, causal=causal)
    if provider == "flashjvp-jvp":
        import flashjvp

        q, k, v, tq, tk, tv = (rnd(b, h, n, d) for _ in range(6))
        return lambda: flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal)
    if provider == "gemm6":
        bh = b * h
        q, k, v, tq, tk, tv = (rnd(bh, n, d) for _ in range(6))
        p = rnd(bh, n, n)  # stands in for P and tP (values do not change the time)
        s = torch.empty(bh, n, n, device="cuda", dtype=dt)
        o = torch.empty(bh, n, d, device="cuda", dtype=dt)

        def fn():
            torch.bmm(q, k.mT, out=s)
            torch.bmm(tq, k.mT, out=s)
            torch.bmm(q, tk.mT, out=s)
            torch.bmm(p, v, out=o)
            torch.bmm(p, v, out=o)
            torch.bmm(p, tv, out=o)
        return fn
    raise ValueError(provider)


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def bench(fn, quick: bool) -> tuple[float, float]:
    """(first call s, median ms)."""
    import torch
    import triton.testing

    t = time.time()
    fn()
    torch.cuda.synchronize()
    first = time.time() - t
    ms = triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                 return_mode="median")
    return first, ms


def run_gemm(quick: bool) -> dict:
    import torch

    n = 4096 if quick else 8192
    row = {"name": f"gemm-{n}^3", "flops": 2.0 * n ** 3}
    try:
        x = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        row["first_s"], row["ms"] = bench(lambda: x[0] @ x[1], quick)
        row["tflops"] = tflops(row["flops"], row["ms"])
    except Exception as e:  # noqa: BLE001 - a failed provider is a result
        row["error"] = short_error(e)
    return row


def cases(quick: bool) -> list[tuple[int, int, int, int, bool]]:
    shapes = QUICK if quick else [s + (128,) for s in SHAPES_D128] + [s + (64,) for s in SHAPES_D64]
    return [(b, h, n, d, c) for (b, h, n, d) in shapes for c in (False, True)]


def run_all(args) -> dict:
    import torch

    t0 = time.time()
    meta = {"argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "python": sys.version.split()[0]}
    meta["cute_setup"] = setup_cute(Path(args.cute_dir), Path(args.cute_archives) if args.cute_archives else None)
    versions = {"torch": torch.__version__}
    for mod in ("triton", "cutlass", "flash_attn.cute", "quack", "tvm_ffi", "flashjvp"):
        try:
            m = __import__(mod, fromlist=["_"])
            versions[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            versions[mod] = "import failed: " + short_error(e)
    meta["versions"] = versions
    meta["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    meta["cudnn"] = torch.backends.cudnn.version()
    print(json.dumps(meta, indent=1), flush=True)

    out = {"meta": meta, "gemm": run_gemm(args.quick), "rows": []}
    print(f"gemm: {out['gemm']}", flush=True)
    skipped = set()
    for (b, h, n, d, causal) in cases(args.quick):
        for prov in args.providers:
            row = {"b": b, "h": h, "n": n, "d": d, "causal": causal, "provider": prov,
                   "flops": provider_flops(prov, b, h, n, d, causal)}
            out["rows"].append(row)
            if args.time_limit and time.time() - t0 > args.time_limit:
                row["error"] = "skipped: time limit"
                continue
            if prov in skipped:
                row["error"] = "skipped: provider failed to import"
                continue
            if prov == "gemm6" and causal:
                row["error"] = "same as non-causal (dense matmuls)"
                continue
            fn = None
            try:
                fn = make_fns(prov, b, h, n, d, causal)
                row["first_s"], row["ms"] = bench(fn, args.quick)
                row["tflops"] = tflops(row["flops"], row["ms"])
            except Exception as e:  # noqa: BLE001 - a failed provider is a result
                row["error"] = short_error(e)
                if isinstance(e, ImportError):
                    skipped.add(prov)
                if args.verbose:
                    traceback.print_exc()
            finally:
                del fn
                torch.cuda.empty_cache()
            print(f"{prov:13s} B{b} H{h} N{n} D{d} causal={causal}: "
                  f"{row.get('ms', float('nan')):.3f} ms {row.get('tflops') or 0:.0f} TFLOP/s "
                  f"{row.get('error', '')}", flush=True)
    meta["wall_s"] = round(time.time() - t0, 1)
    return out


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def format_report(out: dict) -> str:
    meta, rows = out["meta"], out["rows"]
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    by = {}
    for r in rows:
        by.setdefault((r["b"], r["h"], r["n"], r["d"], r["causal"]), {})[r["provider"]] = r
    lines = [f"# CuTe ceiling ({meta.get('gpu')}, {meta.get('time')})", "",
             "bf16, do_bench median. TFLOP/s: forward 4·B·H·N²·D (halved when causal); flashjvp-jvp 3× "
             "forward; gemm6 = the six products of forward+JVP as batched matmuls, dense, 3× dense forward.",
             ""]
    g = out.get("gemm", {})
    lines += [f"Plain GEMM {g.get('name')}: {_f(g.get('ms'), '.3f')} ms, {_f(g.get('tflops'), '.0f')} TFLOP/s"
              + (f" ({g['error']})" if g.get("error") else ""), ""]
    head = ["B,H,N,D", "causal"] + [f"{p} ms / TF" for p in provs] + ["fa4-cute / cudnn"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (b, h, n, d, c), cell in by.items():
        vals = []
        for p in provs:
            r = cell.get(p, {})
            vals.append(f"{_f(r.get('ms'), '.3f')} / {_f(r.get('tflops'), '.0f')}" if r.get("ms") else "err")
        fa, cu = cell.get("fa4-cute", {}).get("tflops"), cell.get("cudnn", {}).get("tflops")
        vals.append(_f(fa / cu if fa and cu else None, ".2f"))
        lines.append("| " + " | ".join([f"{b},{h},{n},{d}", "yes" if c else "no"] + vals) + " |")
    errs = sorted({(r["provider"], r["error"]) for r in rows if r.get("error") and not r["error"].startswith(
        ("skipped", "same as"))})
    if errs:
        lines += ["", "Errors:"] + [f"- {p}: {e}" for p, e in errs]
    lines += ["", f"Versions: {json.dumps(meta.get('versions'))}", f"CuTe setup: {meta.get('cute_setup')}",
              f"Wall time: {meta.get('wall_s')} s"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for cute_ceiling.json and cute_ceiling.md")
    ap.add_argument("--quick", action="store_true", help="two shapes, short timing")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds; cases after it are recorded as skipped (0 = none)")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--cute-dir", default=os.environ.get("CUTE_DIR", "/tmp/cute"))
    ap.add_argument("--cute-archives", default=None, help="folder of *.tar.xz to unpack into --cute-dir")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    try:
        out = run_all(args)
    except Exception as e:  # noqa: BLE001 - still write what we know
        traceback.print_exc()
        out = {"meta": {"error": short_error(e)}, "gemm": {}, "rows": []}
    (outdir / "cute_ceiling.json").write_text(json.dumps(out, indent=1))
    md = format_report(out)
    (outdir / "cute_ceiling.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
