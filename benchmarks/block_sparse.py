"""Block-sparse attention (``block_mask=``) against the dense-mask path and full attention.

A frame-causal mask (token i sees token j iff frame(j) <= frame(i)) over 21 frames of 1560 tokens
(N = 32760, the latent length of a 480p Wan video clip), B1 H12 D128 bf16 by default. Per mask
kind (none: full attention; ``block_mask``: ``flashjvp.block_masks.frame_causal``; ``attn_mask``:
the same mask as a dense (N, N) bool tensor) two timings, medians of ``triton.testing.do_bench``:

* ``fwd_jvp``: ``attention_jvp(q, k, v, tq, tk, tv)`` (primal and tangent, one launch);
* ``step``: the same with q, k, v and the tangents requiring grad, then the backward of a loss
  on the primal output, ``(o * do).sum()``.

``ideal`` is the share of visible (query, key) pairs times full attention's time; ``ratio`` is
a row's time over that ideal (the target: ``block_mask`` fwd_jvp within 1.15). Two causal rows
give the yardstick: ``causal`` (the dense kernel's causal loop, about half the pairs) and
``block_mask causal`` (the same mask as a BlockMask). A ``check`` row
compares ``block_mask`` with ``attn_mask`` outputs (both flashjvp kernels; the float64 reference
is in tests/test_block_mask.py). A failing row is recorded with its error, not fatal.

    PYTHONPATH=src python benchmarks/block_sparse.py [--quick] [--out DIR] [--time-limit S]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path

import torch


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 frames, 4 heads: a smoke run")
    p.add_argument("--out", type=Path, default=None, help="directory for block_sparse.{json,md} "
                   "(default benchmarks/results/<device>)")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds; rows after it are skipped")
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--frame-len", type=int, default=1560)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block", type=int, default=128, help="the BlockMask's BLOCK_SIZE")
    args = p.parse_args(argv)
    if args.quick:
        args.frames, args.heads = 4, 4
    return args


def _device_dir() -> str:
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    for tag in ("h200", "h100", "a100", "l40s", "b200"):
        if tag in name:
            return f"nvidia-{tag}"
    return name.replace(" ", "-")


def _bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median"))


def _inputs(args, grad: bool):
    n = args.frames * args.frame_len
    shape = (args.batch, args.heads, n, args.dim)
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    return [x.requires_grad_(grad) for x in xs]


def _fwd_jvp(xs, kw):
    import flashjvp

    def run():
        with torch.no_grad():
            flashjvp.attention_jvp(*xs, **kw)
    return run


def _step(xs, kw):
    import flashjvp

    do = torch.randn_like(xs[0])

    def run():
        for x in xs:
            x.grad = None
        o, _ = flashjvp.attention_jvp(*xs, **kw)
        (o * do).sum().backward()
    return run


def _markdown(meta, rows) -> str:
    lines = [f"# Block-sparse attention: frame-causal, N = {meta['n']} ({meta['frames']} frames of "
             f"{meta['frame_len']} tokens)", "",
             f"{meta['device']}; B{meta['batch']} H{meta['heads']} D{meta['dim']} bf16; BlockMask BLOCK_SIZE "
             f"{meta['block']}; frame-causal visible share {meta['visible']:.4f}; torch {meta['torch']}, "
             f"triton {meta['triton']}. Medians of triton.testing.do_bench, ms. ideal = the row's visible share x "
             "full time; ratio = time / ideal.",
             "", f"{meta.get('date', '')}  ", f"`{meta.get('command', '')}`",
             "", "| mask | what | share | ms | ideal ms | ratio | note |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ms = "" if r.get("ms") is None else f"{r['ms']:.3f}"
        ideal = "" if r.get("ideal_ms") is None else f"{r['ideal_ms']:.3f}"
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.3f}"
        share = "" if r.get("share") is None else f"{r['share']:.4f}"
        lines.append(f"| {r['mask']} | {r['what']} | {share} | {ms} | {ideal} | {ratio} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("block_sparse.py needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton
    from torch.nn.attention.flex_attention import create_block_mask

    import flashjvp
    from flashjvp import block_masks

    t_start = time.perf_counter()
    out = args.out or Path(__file__).resolve().parent / "results" / _device_dir()
    out.mkdir(parents=True, exist_ok=True)
    n = args.frames * args.frame_len
    f = args.frame_len
    t0 = time.perf_counter()
    bm = block_masks.frame_causal(n, f, device="cuda", block_size=args.block)
    torch.cuda.synchronize()
    prep_s = time.perf_counter() - t0
    plan = flashjvp._sparse.plan_of(bm)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), n=n, frames=args.frames, frame_len=f, batch=args.batch,
                heads=args.heads, dim=args.dim, block=args.block, visible=plan.visible,
                mask_prep_s=prep_s, partial_blocks=int(plan.bits.shape[0] - 1),
                bitmask_bytes=plan.bits.numel() * 4,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join(["python", "benchmarks/block_sparse.py",
                                    *(sys.argv[1:] if argv is None else argv)]))
    rows: list[dict] = []

    def save():
        (out / "block_sparse.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
        (out / "block_sparse.md").write_text(_markdown(meta, rows))

    def dense_mask():
        i = torch.arange(n, device="cuda")
        return (i[None, :] // f <= i[:, None] // f)[None, None]  # (1, 1, N, N) bool

    causal_bm = create_block_mask(lambda b, h, q, k: k <= q, None, None, n, n, device="cuda",
                                  BLOCK_SIZE=args.block)
    causal_share = flashjvp._sparse.plan_of(causal_bm).visible
    # name -> (keyword arguments, visible share); the causal rows are the frame-causal rows' yardstick:
    # the same share of work in the dense kernel's own causal loop, and as a block mask
    masks = {"none": (lambda: {}, 1.0), "block_mask": (lambda: dict(block_mask=bm), plan.visible),
             "attn_mask": (lambda: dict(attn_mask=dense_mask()), plan.visible),
             "causal": (lambda: dict(causal=True), causal_share),
             "block_mask causal": (lambda: dict(block_mask=causal_bm), causal_share)}
    full = {}
    for what, make in (("fwd_jvp", _fwd_jvp), ("step", _step)):
        for name, (kw_of, share) in masks.items():
            row = dict(mask=name, what=what, share=share, ms=None, ideal_ms=None, ratio=None)
            if time.perf_counter() - t_start > args.time_limit:
                row["note"] = "skipped: time limit"
                rows.append(row)
                continue
            try:
                kw = kw_of()
                xs = _inputs(args, grad=what == "step")
                row["ms"] = _bench_ms(make(xs, kw))
                if name == "none":
                    full[what] = row["ms"]
                if what in full and name != "none":
                    row["ideal_ms"] = share * full[what]
                    row["ratio"] = row["ms"] / row["ideal_ms"]
                del xs, kw
            except Exception as e:  # noqa: BLE001  (a failed row is recorded)
                row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc()
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
            save()
    try:
        xs = _inputs(args, grad=False)
        with torch.no_grad():
            o1, t1 = flashjvp.attention_jvp(*xs, block_mask=bm)
            o2, t2 = flashjvp.attention_jvp(*xs, attn_mask=dense_mask())
        note = (f"max |o diff| {(o1.float() - o2.float()).abs().max().item():.3e}, "
                f"max |to diff| {(t1.float() - t2.float()).abs().max().item():.3e}, "
                f"max |to| {t2.float().abs().max().item():.3e}")
    except Exception as e:  # noqa: BLE001
        note = f"error: {type(e).__name__}: {e}"
    rows.append(dict(mask="block_mask vs attn_mask", what="check", ms=None, ideal_ms=None, ratio=None, note=note))
    save()
    print(_markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
