"""Compile flashjvp's kernels for the H200 (sm_90a) on a machine WITHOUT a GPU and report what
ptxas made of them: registers, spills, shared memory, vector width of global loads, async copies,
wgmma, TMA copies and ``setmaxnreg`` (present only when a loop was warp-specialized).

GPU time is scarce; register spills and scalar (2-byte) loads are visible here for free.
Tensors are CPU tensors; every Triton launch is intercepted, compiled for the target and skipped.

    python scripts/compile_report.py --b 8 --h 16 --n 1024 --d 72 [--mode fwd_jvp|fwd|bwd]
        [--tile 128 64 8 3] [--layout bnhd] [--dtype bf16] [--tma] [--tangents q] [--split 132]
        [--frame 1560]   (a frame-causal block mask of frames of that many tokens: the SPARSE path)

``DUMP_PTX=FILE`` / ``DUMP_TTGIR=FILE`` write the (last) kernel's PTX / TritonGPU IR.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("FLASHJVP_AUTOTUNE", "0")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from flashjvp import _bwd, _fwd, _policy  # noqa: E402
from flashjvp._validate import check_inputs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# the ptxas Triton itself uses for sm_90 (3.9 switched it to its bundled "ptxas-blackwell")
PTXAS = Path(get_ptxas(90).path)
reports: list[str] = []


def _compile_only(self, *args, grid, warmup, **kwargs):
    """Stand-in for JITFunction.run: bind and specialise like a launch, compile, report."""
    for hook in self.pre_run_hooks:  # as JITFunction.run does (the forward sets its TMA boxes)
        hook(*args, **kwargs)
    backend = CUDABackend(TARGET)
    binder = create_function_from_signature(self.signature, self.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET,
                            options=options.__dict__)
    ptx = kernel.asm["ptx"]
    if os.environ.get("DUMP_TTGIR"):
        Path(os.environ["DUMP_TTGIR"]).write_text(kernel.asm["ttgir"])
    if os.environ.get("DUMP_PTX"):
        Path(os.environ["DUMP_PTX"]).write_text(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    info = " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads", res.stderr))
    loads = sorted(set(re.findall(r"ld\.global[.\w]*", ptx)))
    copies = sorted(set(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)))
    wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
    setmaxnreg = len(re.findall(r"setmaxnreg", ptx))  # > 0 only in a warp-specialized kernel
    tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    shown = ("BLOCK", "ALIGN", "EVEN", "HAS", "SPARSE")
    consts = {k: v for k, v in bound.items() if k.isupper() and k.startswith(shown)}
    reports.append(f"{self.__name__}: warps={options.num_warps} stages={options.num_stages} {consts}\n"
                   f"    {info}; shared memory {kernel.metadata.shared} B (H200 limit 232448)\n"
                   f"    global loads {loads}; cp.async bytes {copies}; wgmma {wgmma}; "
                   f"TMA copies {tma}; setmaxnreg {setmaxnreg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--h", type=int, default=4)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dv", type=int)
    ap.add_argument("--layout", default="bhnd", choices=["bhnd", "bnhd"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--mode", default="fwd_jvp", choices=["fwd", "fwd_jvp", "bwd"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tangents", default="qkv", choices=["qkv", "q"], help="fwd_jvp: all tangents or tq only")
    ap.add_argument("--tile", type=int, nargs=4, metavar=("BM", "BN", "WARPS", "STAGES"),
                    help="one tile to compile (default: each kernel's default tile)")
    ap.add_argument("--tma", action="store_true", help="forward: the tensor-descriptor path (FLASHJVP_TMA=1)")
    ap.add_argument("--frame", type=int, default=0, metavar="TOKENS",
                    help="a frame-causal block mask with frames of TOKENS tokens (flashjvp.block_masks)")
    ap.add_argument("--split", type=int, default=0, metavar="SLOTS",
                    help="forward: tail splitting as on a GPU with SLOTS SMs (e.g. 132; _split.py)")
    args = ap.parse_args()
    if args.split:  # the SM count the tail-split policy sees (0 off the GPU)
        _policy.sm_count = lambda device: args.split
    if args.tma:
        os.environ["FLASHJVP_TMA"] = "1"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dv = args.dv or args.d

    def t(d):
        shape = (args.b, args.h, args.n, d) if args.layout == "bhnd" else (args.b, args.n, args.h, d)
        return torch.zeros(shape, dtype=dtype)

    q, k, v = t(args.d), t(args.d), t(dv)
    block_mask = None
    if args.frame:
        from flashjvp.block_masks import frame_causal

        block_mask = frame_causal(args.n, args.frame, device="cpu")
    a = check_inputs(q, k, v, causal=args.causal, scale=None, layout=args.layout, block_mask=block_mask)
    for kern, tiles in ((_fwd._attn_fwd_kernel, _policy.FWD_TILES), (_bwd._attn_bwd_dkdv_kernel, _policy.BWD_TILES),
                        (_bwd._attn_bwd_dq_kernel, _policy.BWD_TILES)):
        bm, bn, w, s = args.tile or tiles[0]  # one config: the autotuner then just launches it
        kern.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)]
    JITFunction.run = _compile_only
    if args.mode == "bwd":
        lse = torch.zeros(args.b, args.h, args.n)
        _bwd.attn_bwd(t(dv), q, k, v, t(dv), lse, a)
    else:
        jvp = args.mode == "fwd_jvp"
        tkv = jvp and args.tangents == "qkv"
        _fwd.attn_fwd(q, k, v, t(args.d) if jvp else None, t(args.d) if tkv else None,
                      t(dv) if tkv else None, a)
    print("\n".join(reports))


if __name__ == "__main__":
    main()
