"""The sCM training step against its parts, one process, default do_bench repetitions: forward+JVP
without grad, the training forward, its backward alone, and the whole step (bench.py's `scm`),
with flashjvp's builtin provider. Checks whether the step costs more than its parts."""
import sys

import torch
import triton
import triton.testing

from flashjvp import bench

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
p = bench.builtin_provider("flashjvp")
for key in sys.argv[1:] or ["3", "4"]:
    (shape,) = bench.select_shapes([key])
    x = bench.make_inputs(shape, torch.bfloat16)
    times = {}
    for mode in ("fwd_jvp", "fwd", "bwd", "scm"):
        fn, leaves = bench.build(p, mode, x)
        fn()
        torch.cuda.synchronize()
        times[mode] = triton.testing.do_bench(fn, warmup=25, rep=400, grad_to_none=leaves or None,
                                              return_mode="median")
    parts = times["fwd_jvp"] + times["fwd"] + times["bwd"]
    print(f"{shape.id} {shape.name} {shape.dims}: " + ", ".join(f"{m} {t:.3f} ms" for m, t in times.items())
          + f"; parts sum {parts:.3f} ms, step / parts {times['scm'] / parts:.3f}", flush=True)
