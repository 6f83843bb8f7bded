"""benchmarks/sequence_parallel.py's correctness part: on 2 gloo CPU ranks at tiny sizes (always),
and through torchrun on NCCL over 2 and 4 GPUs where that many are visible."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashjvp

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sequence_parallel.py"


def _worker(rank, world, path):
    sys.path.insert(0, str(SCRIPT.parent))
    import sequence_parallel

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        rows = sequence_parallel.correctness(rank, world, torch.device("cpu"), torch.float32, quick=True)
        bad = [r for r in rows if not r["passed"]]
        assert not bad, f"rank {rank}: {bad}"
    finally:
        dist.destroy_process_group()


def test_correctness_on_gloo_ranks():
    if not flashjvp.interface._use_kernels(torch.empty(0)):
        pytest.skip("the CPU ranks run the kernels through TRITON_INTERPRET=1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "rendezvous")), nprocs=2)


@pytest.mark.parametrize("world", [2, 4])
def test_correctness_on_gpus(world, tmp_path):
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < world:
        pytest.skip(f"needs {world} CUDA GPUs, {visible} visible")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(SCRIPT),
           "--backend", "nccl", "--correctness-only", "--out", str(tmp_path), "--timeout", "120"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "sequence_parallel.json").exists()
