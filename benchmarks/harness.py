"""The harness of the benchmark suites in ``benchmarks/`` (run from the repository root as
``PYTHONPATH=src python -m benchmarks.<suite>``): timing, the measuring loop and its time limit,
run metadata and the results folder, report files, and kernels loaded from files.

A measurement is an :class:`Item`: a row (a dataclass deriving from :class:`Measured`), the input
set it runs on and ``make(x) -> (fn, leaves)``, the callable to time on those inputs.
:func:`run_items` measures items in order; a failure (unsupported call, out of memory, a missing
backward) becomes the row's ``skip`` reason and the run goes on. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from flashjvp._launch import LaunchLog

# Live (B, H, Nq, Nk) float32 buffers of the math SDPA JVP (it upcasts half inputs to fp32).
MATH_NXN_BUFFERS = 6
MATH_MEMORY_FRACTION = 0.6


def math_memory_check(b: int, h: int, nq: int, nk: int, device="cuda") -> str | None:
    """Skip reason when the math SDPA JVP's fp32 score matrices would not fit comfortably
    (an estimate, made on CUDA only)."""
    if torch.device(device).type != "cuda":
        return None
    need = MATH_NXN_BUFFERS * 4 * b * h * nq * nk
    free = torch.cuda.mem_get_info()[0]
    if need > MATH_MEMORY_FRACTION * free:
        return (f"memory estimate {need / 2**30:.0f} GiB ({MATH_NXN_BUFFERS} fp32 Nq x Nk buffers) > "
                f"{MATH_MEMORY_FRACTION:.0%} of free {free / 2**30:.0f} GiB")
    return None


# --------------------------------------------------------------------------- run metadata, reports


def run_metadata(gpu: str, module: str, argv: list[str] | None) -> dict:
    """What every report records about its run: the GPU, the versions, the date and the command
    (``python -m module`` with ``argv``, or this process's arguments)."""
    import triton

    argv = sys.argv[1:] if argv is None else argv
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", module, *argv])}


def results_dir(gpu: str) -> Path:
    """The default output folder of a run on ``gpu``: ``benchmarks/results/<gpu-name-slug>``."""
    return Path("benchmarks/results") / re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body]
    return "\n".join(lines)


def fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def skip_reason(e: BaseException, caught) -> str:
    """One line: exception type and message (the failing source line when the message is empty),
    then the first warnings seen (SDPA explains a 'No available kernel' there)."""
    msg = " ".join(str(e).split())
    if not msg:
        tb = traceback.extract_tb(e.__traceback__)
        msg = f"{tb[-1].line} ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    hints = list(dict.fromkeys(" ".join(str(w.message).split()) for w in caught))[:3]
    text = f"{type(e).__name__}: {msg}" + (" | " + "; ".join(hints) if hints else "")
    return text[:400]


def describe_tiles(configs: dict[str, dict]) -> str | None:
    """``kernel: BLOCK_M=.. BLOCK_N=.. num_warps=.. num_stages=..`` per launched kernel."""
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    parts = [" ".join([name + ":"] + [f"{k}={c[k]}" for k in keys if k in c]).rstrip(":")
             for name, c in sorted(configs.items())]
    return "; ".join(parts) or None


def add_run_options(ap: argparse.ArgumentParser, time_limit: float) -> None:
    """The options every suite takes: --quick, --time-limit (default ``time_limit``), --out."""
    ap.add_argument("--quick", action="store_true", help="fewer do_bench repetitions (5 ms warmup, 20 ms)")
    ap.add_argument("--time-limit", type=float, default=time_limit, help="seconds after which remaining "
                    f"measurements are skipped (0: no limit; default {time_limit:g})")
    ap.add_argument("--out", type=Path, help="output folder; default benchmarks/results/<gpu-name-slug>/")


@dataclass(frozen=True)
class Report:
    """A suite's files in its output folder: ``<stem>.json`` (the run's meta and its rows),
    ``<stem>.md`` (``markdown(rows, meta)``) and, given ``plot(rows, path)`` and matplotlib,
    ``<stem>.png``."""

    stem: str
    markdown: Callable[[list, dict], str]
    plot: Callable[[list, Path], None] | None = None

    def write(self, rows: list, meta: dict, out_dir: Path, with_plot: bool = True) -> dict[str, Path]:
        """Write the files; returns their paths by kind (no "png" when the plot was not made)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"json": out_dir / f"{self.stem}.json", "md": out_dir / f"{self.stem}.md"}
        paths["json"].write_text(json.dumps({**meta, "rows": [_row_dict(r) for r in rows]}, indent=1) + "\n")
        paths["md"].write_text(self.markdown(rows, meta))
        if with_plot and self.plot is not None and importlib.util.find_spec("matplotlib") is not None:
            try:
                self.plot(rows, out_dir / f"{self.stem}.png")
                paths["png"] = out_dir / f"{self.stem}.png"
            except Exception as e:  # noqa: BLE001 - the numbers are written already
                print(f"{self.stem}: plot failed: {e!r}", file=sys.stderr)
        return paths

    def run(self, measure: Callable[..., list], meta: dict, out: Path) -> int:
        """``measure(log=, checkpoint=) -> rows``, its lines printed and a partial report (no plot)
        written at every checkpoint; then the final report, printed and written to ``out``."""
        t0 = time.perf_counter()
        rows = measure(log=lambda line: print(line, flush=True),
                       checkpoint=lambda rows: self.write(rows, {**meta, "partial": True}, out, with_plot=False))
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        paths = self.write(rows, meta, out)
        print("\n" + self.markdown(rows, meta))
        print("wrote " + ", ".join(str(p) for p in paths.values()) + f" ({meta['wall_s']:.0f} s)")
        return 0


def _row_dict(row) -> dict:
    """A row's fields, its own first and then those of :class:`Measured` (which asdict puts first)."""
    d = asdict(row)
    last = [f.name for f in fields(Measured)] if isinstance(row, Measured) else []
    return {k: d[k] for k in [*(k for k in d if k not in last), *last]}


# --------------------------------------------------------------------------- kernels from files


@contextlib.contextmanager
def scoped_env(env: dict[str, str] | None):
    """Set ``env`` for the duration of the block, then restore the previous values."""
    if not env:
        yield
        return
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def install_flash_attn_stub() -> None:
    """Put stand-ins for ``flash_attn`` and ``flash_attn.flash_attn_interface`` in ``sys.modules``:
    any function imported from them raises NotImplementedError when called."""
    def stub(name: str) -> types.ModuleType:
        def missing(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def fail(*args, **kwargs):
                raise NotImplementedError(f"flash_attn is not installed (stub): {name}.{attr} is unavailable")
            return fail

        mod = types.ModuleType(name)
        mod.__getattr__ = missing  # PEP 562: serves every `from ... import name`
        return mod

    pkg, sub = stub("flash_attn"), stub("flash_attn.flash_attn_interface")
    pkg.__path__, pkg.flash_attn_interface = [], sub
    sys.modules.update({"flash_attn": pkg, "flash_attn.flash_attn_interface": sub})


def load_function(spec: str) -> tuple[str, Callable, str]:
    """``NAME=path/to/file.py:attr`` -> (NAME, the function, a note). A failing ``flash_attn``
    import is replaced by a stub (:func:`install_flash_attn_stub`, said in the note): what does
    not call flash_attn still runs."""
    name, _, target = spec.partition("=")
    path, _, attr = target.rpartition(":")
    if not (name and path and attr):
        raise ValueError(f"--kernel wants NAME=path/to/file.py:attr, got {spec!r}")
    mod_name = "flashjvp_bench_kernel_" + re.sub(r"\W", "_", name)
    note = f"{path}:{attr}"
    for attempt in range(2):
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        if mod_spec is None:
            raise ValueError(f"cannot load {path!r}")
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = mod
        try:
            mod_spec.loader.exec_module(mod)
            break
        except ImportError as e:
            sys.modules.pop(mod_name, None)
            if attempt or not ((e.name or "").startswith("flash_attn") or "flash_attn" in str(e)):
                raise
            install_flash_attn_stub()
            note += " (flash_attn missing: stub installed, its backward is unavailable)"
    return name, getattr(mod, attr), note


# --------------------------------------------------------------------------- measuring


@dataclass(kw_only=True)
class Measured:
    """What a measurement fills in: median ms, TFLOP/s, the peak memory allocated beyond the
    inputs, the seconds of the untimed first call (compilation and autotuning when new) and the
    tiles flashjvp's kernels launched with; ``skip`` (the numbers None) when it did not run."""

    ms: float | None = None
    tflops: float | None = None
    peak_mib: float | None = None
    skip: str | None = None
    first_call_s: float | None = None
    tiles: str | None = None


@dataclass
class Item:
    """One measurement to take: ``make(x) -> (fn, leaves)`` builds the timed callable from the
    tensors ``x`` of the input set ``inputs``; ``check()`` returns a skip reason or None; ``flops``
    of one call give the TFLOP/s; ``env``: environment variables set while the callable is built,
    timed and its tiles logged."""

    row: Measured
    inputs: str
    make: Callable[[Any], tuple[Callable, list]]
    flops: float | None = None
    check: Callable[[], str | None] | None = None
    env: dict[str, str] | None = None


def measure(fn: Callable, leaves: list[torch.Tensor], quick: bool) -> tuple[float, float, float]:
    """(median ms of ``triton.testing.do_bench``, peak extra MiB, first-call seconds). The first
    call compiles and autotunes; the memory is measured on the second: peak allocated during it
    minus allocated before it. ``leaves``' gradients are reset between calls."""
    import triton.testing

    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for t in leaves:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del out
    for t in leaves:
        t.grad = None
    warmup, rep = (5, 20) if quick else (25, 100)
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=leaves or None,
                                 return_mode="median")
    return ms, peak, first


def measure_cpu(fn: Callable, leaves: list, quick: bool) -> tuple[float, float | None, float]:
    """(median ms of a few calls, no memory figure, first-call seconds): the timer of CPU smoke tests."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(1 if quick else 3):
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), None, first


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def measure_item(it: Item, x, quick: bool, timer: Callable = measure) -> Measured:
    """Measure one item into its row (returned); any exception becomes the row's skip reason."""
    row = it.row
    caught: list = []
    before = torch.cuda.memory_allocated() if _cuda() else 0
    try:
        row.skip = it.check() if it.check else None
        if row.skip is None:
            with warnings.catch_warnings(record=True) as caught, scoped_env(it.env):
                warnings.simplefilter("always")
                fn, leaves = it.make(x)
                row.ms, row.peak_mib, row.first_call_s = timer(fn, leaves, quick)
                if _cuda():
                    with LaunchLog() as log:  # one more call, not timed: the tiles it ran
                        fn()
                    row.tiles = describe_tiles({r.kernel: r.config for r in log.launches})
            row.tflops = it.flops / row.ms / 1e9 if it.flops else None
    except Exception as e:  # noqa: BLE001 - recorded as a skip, the run goes on
        row.ms = row.peak_mib = row.tflops = None
        row.skip = skip_reason(e, caught)
    fn = leaves = None
    if _cuda():
        if torch.cuda.memory_allocated() > before:  # kept alive by a cycle (a traceback): collect it
            gc.collect()
        torch.cuda.empty_cache()
    return row


def run_items(items: list[Item], inputs: dict[str, Callable[[], Any]], *, label: Callable[[Any], str],
              note: Callable[[Any], str] = lambda row: "", annotate: Callable[[list], Any] | None = None,
              quick: bool = False, time_limit: float = 0.0, log: Callable = print,
              clock: Callable[[], float] = time.perf_counter, timer: Callable | None = None,
              checkpoint: Callable[[list], Any] | None = None) -> list:
    """Every item in order, its row logged as ``label(row)``, the result and ``note(row)``; past
    ``time_limit`` seconds (0: none) of ``clock`` the remaining ones are recorded as skipped.
    ``inputs[it.inputs]()`` makes an input set when an item needs a new one (the previous set is
    freed first; a failure skips every item of the set); ``checkpoint(rows)`` runs before each new
    set, ``annotate(rows)`` after each row. ``timer`` (default :func:`measure`) as ``measure``."""
    timer = timer or measure
    rows: list = []
    start, current, x, x_err = clock(), None, None, None
    n = len(items)
    for i, it in enumerate(items):
        row = it.row
        elapsed = clock() - start
        if time_limit and elapsed > time_limit:
            if not any((r.skip or "").startswith("time limit") for r in rows):
                log(f"time limit {time_limit:g} s reached: skipping the last {n - i} measurements")
            row.skip = f"time limit reached (--time-limit {time_limit:g} s)"
            rows.append(row)
            continue
        if it.inputs != current:
            if checkpoint and rows:
                checkpoint(rows)
            x = None
            gc.collect()
            if _cuda():
                torch.cuda.empty_cache()
            current = it.inputs
            try:
                x, x_err = inputs[it.inputs](), None
            except Exception as e:  # noqa: BLE001 - every item of this input set is skipped
                x, x_err = None, "inputs: " + skip_reason(e, [])
        if x_err is not None:
            row.skip = x_err
        else:
            measure_item(it, x, quick, timer)
        rows.append(row)
        if annotate:
            annotate(rows)
        res = (f"{row.ms:9.3f} ms {fmt(row.tflops, '7.1f'):>7} TFLOP/s"
               + ("" if row.peak_mib is None else f" {row.peak_mib:7.0f} MiB") + note(row)
               if row.skip is None else f"skipped: {row.skip[:110]}")
        log(f"[{i + 1:3d}/{n} {elapsed:5.0f}s] {label(row)} {res}")
    return rows
