"""Model-level benchmark: training steps of real model configs with random weights (no downloads),
flashjvp against PyTorch (``PYTHONPATH=src python -m benchmarks.models``; see benchmarks/README.md).

Timed: one training step (forward, loss, ``backward()``; no optimizer): the median wall time of
``--repeat`` steps, each between two ``torch.cuda.synchronize()``, after ``--warmup`` untimed
steps (the first compiles and autotunes: ``first_s``); ``peak_mib`` is ``max_memory_allocated``
during one step (weights, gradients and inputs included). Steps: ``plain``, ``meanflow`` (loss
through the primal of ``torch.func.jvp``) and ``scm`` (the loss needs the tangent's gradient:
second-order backward). Providers: ``torch`` (plain steps: PyTorch's default SDPA; JVP steps: its
math backend, the only one with forward-mode AD), ``torch-math`` (plain steps, math backend),
``flashjvp`` (diffusers models through ``flashjvp.integrations.diffusers.apply``, the block inside
``flashjvp.patch_sdpa()``). Modes ``compile`` / ``reduce-overhead`` compile
forward + JVP + loss (``backward()`` runs the compiled backward), else the network alone
(``compiled`` says which). A failure (out of memory, a compile error) is a row with its reason.
With ``--bf16-weights`` on the GPU the JVP steps of both providers compute layer norms in float32
(``float_layer_norm``: PyTorch's CUDA layer norm promotes a bf16 tangent to float32 otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashjvp
from benchmarks.harness import Report, md_table, results_dir, run_metadata, skip_reason
from flashjvp._launch import LaunchLog
from flashjvp.sdpa import SDPAFallbackWarning

STEPS = ("plain", "meanflow", "scm")
MODES = ("eager", "compile", "reduce-overhead")
PROVIDERS = ("torch", "torch-math", "flashjvp", "no-attention")
DEFAULT_PROVIDERS = ("torch", "flashjvp")


@dataclass
class Case:
    """A model with random inputs: ``fn(*primals)`` is the network's output, ``tangents`` the JVP
    direction (the velocity ``v`` of the latent, then 1 for the time where the network takes one),
    ``h = t - r`` the MeanFlow interval, ``target`` a random regression target."""

    dims: str
    fn: Callable
    params: list
    primals: tuple
    tangents: tuple
    target: torch.Tensor
    h: torch.Tensor
    name: str = ""
    model: nn.Module | None = None


class AttentionBlock(nn.Module):
    """DiT-XL's attention sublayer: qkv Linear -> F.scaled_dot_product_attention -> proj Linear."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


def _case(model: nn.Module, fn: Callable, x: torch.Tensor, dims: str, with_time: bool) -> Case:
    """Random velocity, times 0 <= r <= t <= 1 and target for the network ``fn`` at input ``x``."""
    b = x.shape[0]
    t = torch.rand(b, device=x.device)
    r = t * torch.rand(b, device=x.device)
    v = torch.randn_like(x)
    primals, tangents = ((x, t), (v, torch.ones_like(t))) if with_time else ((x,), (v,))
    params = list(model.parameters())
    dims += f", {sum(p.numel() for p in params) / 1e6:.3g}M params"
    return Case(dims, fn, params, primals, tangents, torch.randn_like(x),
                (t - r).view(b, *[1] * (x.dim() - 1)), model=model)


def in_dtype(case: Case, dtype: torch.dtype) -> Case:
    """``case`` with its model's weights and buffers and its float inputs in ``dtype`` (``--bf16-weights``)."""
    case.model.to(dtype)
    cast = lambda xs: tuple(x.to(dtype) for x in xs)  # noqa: E731
    return replace(case, primals=cast(case.primals), tangents=cast(case.tangents), target=case.target.to(dtype),
                   h=case.h.to(dtype))


def build_block(cfg: dict, b: int, device) -> Case:
    """The plain attention sublayer of DiT-XL; no time input: the JVP is w.r.t. x."""
    model = AttentionBlock(cfg["dim"], cfg["heads"]).to(device).train()
    x = torch.randn(b, cfg["n"], cfg["dim"], device=device)
    dims = f"B{b} N{cfg['n']} C{cfg['dim']} H{cfg['heads']}x{cfg['dim'] // cfg['heads']}"
    return _case(model, model, x, dims, with_time=False)


def build_dit(cfg: dict, b: int, device) -> Case:
    """diffusers' DiTTransformer2DModel. Its ada_norm_zero embedding takes a float timestep
    (sinusoidal features of ``1000 t``), so the tangent runs through the time too. The first
    ``in_channels`` outputs are the prediction (the others DiT's learned variance)."""
    from diffusers import DiTTransformer2DModel

    with torch.device(device):  # initialised on the device; .to() moves any buffer made elsewhere
        model = DiTTransformer2DModel(**cfg).to(device).train()
    c, s, p = cfg["in_channels"], cfg["sample_size"], cfg["patch_size"]
    x = torch.randn(b, c, s, s, device=device)
    labels = torch.randint(0, cfg["num_embeds_ada_norm"], (b,), device=device)
    fn = lambda x, t: model(x, timestep=1000 * t, class_labels=labels).sample[:, :c]
    dims = (f"depth {cfg['num_layers']}, B{b}, latent {c}x{s}x{s} -> N{(s // p) ** 2}, "
            f"H{cfg['num_attention_heads']}x{cfg['attention_head_dim']}")
    return _case(model, fn, x, dims, with_time=True)


def build_wan(cfg: dict, b: int, device) -> Case:
    """diffusers' WanTransformer3DModel with ``num_layers`` blocks (patch and text embedding, RoPE,
    self-attention over the video tokens, cross-attention to ``text`` text tokens, output head);
    float timestep, tangent through the latent and the time."""
    from diffusers import WanTransformer3DModel

    cfg = dict(cfg)
    f, hgt, wid, text = (cfg.pop(k) for k in ("frames", "height", "width", "text"))
    with torch.device(device):
        model = WanTransformer3DModel(**cfg).to(device).train()
    x = torch.randn(b, cfg["in_channels"], f, hgt, wid, device=device)
    ctx = torch.randn(b, text, cfg["text_dim"], device=device)
    fn = lambda x, t: model(x, timestep=1000 * t, encoder_hidden_states=ctx.to(x.dtype)).sample
    grid = (f, hgt // cfg["patch_size"][1], wid // cfg["patch_size"][2])
    dims = (f"depth {cfg['num_layers']}, B{b}, N{grid[0] * grid[1] * grid[2]} ({grid}) + {text} text tokens, "
            f"H{cfg['num_attention_heads']}x{cfg['attention_head_dim']}, ffn {cfg['ffn_dim']}")
    return _case(model, fn, x, dims, with_time=True)


DIT_XL2 = dict(num_layers=28, num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
               patch_size=2, num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
DIT_TINY = DIT_XL2 | dict(num_layers=1, num_attention_heads=2, attention_head_dim=8, num_embeds_ada_norm=10)
WAN_1_3B = dict(num_layers=1, patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", frames=21, height=60, width=104, text=512)
WAN_TINY = WAN_1_3B | dict(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
                           freq_dim=16, ffn_dim=32, frames=2, height=4, width=8, text=8)
# name -> (builder, batch, full config, tiny config); --tiny runs batch 2 in float32
MODELS = {
    "dit-xl-block": (build_block, 32, dict(n=256, dim=1152, heads=16), dict(n=16, dim=32, heads=2)),
    "dit-xl-block-1024": (build_block, 8, dict(n=1024, dim=1152, heads=16), dict(n=32, dim=32, heads=2)),
    "dit-xl2-256": (build_dit, 32, DIT_XL2 | dict(sample_size=32), DIT_TINY | dict(sample_size=8)),
    "sit-xl2-512": (build_dit, 8, DIT_XL2 | dict(sample_size=64), DIT_TINY | dict(sample_size=12)),
    "wan-block-32k": (build_wan, 1, WAN_1_3B, WAN_TINY),
}


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).square().mean()


def plain_loss(c: Case) -> torch.Tensor:
    """Plain training step: the output against a random target."""
    return mse(c.fn(*c.primals), c.target)


def meanflow_loss(c: Case) -> torch.Tensor:
    """MeanFlow: u, du = JVP along (v, 1); target v - (t - r) du, detached: gradients through u only."""
    u, du = torch.func.jvp(c.fn, c.primals, c.tangents)
    return mse(u, (c.tangents[0] - c.h * du).detach())


def scm_loss(c: Case) -> torch.Tensor:
    """sCM-style step with the tangent in the loss: backward through u and du (second order)."""
    u, du = torch.func.jvp(c.fn, c.primals, c.tangents)
    return mse(u, c.target) + mse(du, c.tangents[0])


LOSSES = {"plain": plain_loss, "meanflow": meanflow_loss, "scm": scm_loss}


@dataclass
class Row:
    """One measurement; ``status`` "ok", "failed" (``reason``: the error) or "skipped"."""

    model: str
    dims: str
    step: str
    mode: str
    provider: str
    ms: float | None = None
    peak_mib: float | None = None
    first_s: float | None = None
    launches: int | None = None  # flashjvp kernel launches in the warm-up steps
    compiled: str = ""  # "step" (forward + JVP + loss) or "model" (the network only)
    graphs: int | None = None  # compiled modes: graphs Dynamo compiled, graph breaks
    breaks: int | None = None
    status: str = "ok"
    reason: str = ""


def layer_norm_tangent_mixes(device) -> bool:
    """Whether ``F.layer_norm`` on bf16 input gives a tangent of another dtype under forward AD:
    PyTorch's CUDA kernel keeps its statistics in float32 and the JVP formula promotes the tangent
    with them, and the next bf16 Linear then refuses the mix ("mat1 and mat2 must have the same
    dtype"). The CPU kernel keeps bf16 statistics."""
    x = torch.randn(2, 8, device=device, dtype=torch.bfloat16)
    return torch.func.jvp(lambda x: F.layer_norm(x, (8,)), (x,), (x,))[1].dtype != x.dtype


@contextlib.contextmanager
def float_layer_norm():
    """Layer norms computed in float32 and cast back to the input's dtype (diffusers' FP32LayerNorm):
    the cast takes the tangent back to bf16 (``layer_norm_tangent_mixes``). Used for both providers."""
    layer_norm = F.layer_norm

    def in_float(x, shape, weight=None, bias=None, eps=1e-5):
        f = lambda t: None if t is None else t.float()  # noqa: E731
        return layer_norm(x.float(), shape, f(weight), f(bias), eps).to(x.dtype)

    torch.nn.functional.layer_norm = in_float
    try:
        yield
    finally:
        torch.nn.functional.layer_norm = layer_norm


@contextlib.contextmanager
def no_attention():
    """``F.scaled_dot_product_attention`` replaced by returning ``value``: the same step with
    attention's cost removed (the ceiling a faster attention could reach)."""
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda q, k, v, *args, **kwargs: v
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def sdpa_context(provider: str, step: str, patch: bool = True):
    """flashjvp: patch_sdpa (unless ``patch`` is False: the model runs flashjvp through its
    integration, ``flashjvp_in``); torch: the math backend for JVP steps (the others lack forward AD);
    no-attention: SDPA returns its value input."""
    if provider == "no-attention":
        return no_attention()
    if provider == "flashjvp":
        return flashjvp.patch_sdpa() if patch else contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH) if provider == "torch-math" or step != "plain" else contextlib.nullcontext()


@contextlib.contextmanager
def flashjvp_in(model: nn.Module | None):
    """A diffusers model on flashjvp through ``flashjvp.integrations.diffusers.apply`` (what its
    users would write; undone on exit); yields False. Other models yield True: they need
    ``patch_sdpa``, whose TorchFunctionMode adds Python to every torch call of the model."""
    if model is None or not type(model).__module__.startswith("diffusers."):
        yield True
        return
    from flashjvp.integrations import diffusers as fjd

    saved = [(m, m.processor, getattr(m.processor, "_attention_backend", None))
             for m in model.modules() if getattr(m, "processor", None) is not None]
    fjd.apply(model)
    try:
        yield False
    finally:
        for module, processor, backend in saved:
            module.processor = processor
            if hasattr(processor, "_attention_backend"):
                processor._attention_backend = backend


def measure(step: Callable, params: list, warmup: int, repeat: int, cuda: bool) -> tuple:
    """(median ms, peak MiB, first step s, launches); gradients are reset between steps, untimed."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def one():
        for p in params:
            p.grad = None
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - t0

    with LaunchLog() as log:
        first = [one() for _ in range(warmup)][0]
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        one()
        peak = torch.cuda.max_memory_allocated() / 2**20
    ms = 1e3 * statistics.median(one() for _ in range(repeat))
    return ms, peak, first, len(log.launches)


def run_row(case: Case, row: Row, args, cuda: bool) -> Row:
    """Measure ``row`` (compiled modes: the whole step first, the network alone if that fails); on
    the GPU under bf16 autocast with float32 weights, as mixed-precision training runs. flashjvp
    rows run diffusers models through the diffusers integration, others inside ``patch_sdpa``."""
    with flashjvp_in(case.model) if row.provider == "flashjvp" else contextlib.nullcontext(True) as patch:
        return _run_row(case, row, args, cuda, patch)


def _run_row(case: Case, row: Row, args, cuda: bool, patch: bool) -> Row:
    loss = LOSSES[row.step]
    plain = args.tiny or args.bf16_weights
    # context managers made anew for every step: a generator-based one can be entered only once
    cast = contextlib.nullcontext if plain else lambda: torch.autocast(case.target.device.type, dtype=torch.bfloat16)
    norm = float_layer_norm if row.step != "plain" and args.float_layer_norm else contextlib.nullcontext
    kw = {"mode": "reduce-overhead"} if row.mode == "reduce-overhead" else {}

    def step_of(fn: Callable) -> Callable:
        def step():
            if row.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with sdpa_context(row.provider, row.step, patch), cast(), norm():
                fn().backward()
        return step

    tries = {"": lambda: loss(case)}
    if row.mode != "eager":
        net = replace(case, fn=torch.compile(case.fn, **kw))
        tries = {"step": torch.compile(lambda: loss(case), **kw), "model": lambda: loss(net)}
    notes, oom, row.status = [], False, "failed"
    for compiled, fn in tries.items():
        # The guard restores the thread's dispatch keys: a compile of torch.func.jvp that Dynamo failed
        # to trace (torch 2.13) left autograd keys excluded, and no later step had gradients.
        keys = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
        with warnings.catch_warnings(record=True) as caught, torch._C._ForceDispatchKeyGuard(*keys):
            warnings.simplefilter("always")
            counters.clear()
            try:
                row.ms, row.peak_mib, row.first_s, row.launches = measure(step_of(fn), case.params, args.warmup,
                                                                          args.repeat, cuda)
                row.status, row.compiled = "ok", compiled
                if compiled:
                    row.graphs, row.breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
                oom = isinstance(e, torch.cuda.OutOfMemoryError)
                hints = [w for w in caught if "attention" in str(w.message).lower()]
                notes.append((f"{compiled}: " if compiled else "") + skip_reason(e, hints))
            finally:  # nothing of the step may stay alive (e: its traceback holds the step's tensors)
                for p in case.params:
                    p.grad = None
                torch._dynamo.reset()
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        if row.status == "ok":
            if compiled and not row.graphs:  # e.g. torch.func.jvp of a compiled function: Dynamo leaves it eager
                notes.append("nothing was compiled: the step ran eagerly")
            notes += sorted({str(w.message) for w in caught if issubclass(w.category, SDPAFallbackWarning)})
            break
        if oom:
            break
    row.reason = " / ".join(notes)[:600]
    return row


def plan(models: list[str], steps: list[str], modes: list[str], providers: list[str]) -> list[Row]:
    """The rows in run order: the first model in every mode, then the others mode by mode (eager
    first), so that a --time-limit cuts the compiled rows of the large models. torch-math: plain only."""
    def rows(model, mode):
        return [Row(model, "", s, mode, p) for s in steps for p in providers if p != "torch-math" or s == "plain"]
    return ([r for m in modes for r in rows(models[0], m)]
            + [r for m in modes for model in models[1:] for r in rows(model, m)])


def _mib(r: Row) -> str:
    return "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"


def format_report(rows: list[Row], meta: dict) -> str:
    """Markdown: run details, the models, one line per (model, step, mode) with every provider's
    ms and peak MiB and each provider's ms over flashjvp's, then the rows that did not run."""
    parts = [f"# flashjvp model benchmark: {meta['gpu']}",
             f"torch {meta['torch']}, triton {meta['triton']}, diffusers {meta['diffusers']}, {meta['dtype']}, "
             f"warmup {meta['warmup']}, repeat {meta['repeat']}, {meta['date']}  \n`{meta['command']}`",
             "ms: median wall time of one training step (forward, loss, backward); peak MiB: "
             "max_memory_allocated during a step (weights, gradients, inputs included); "
             "`x / flashjvp`: ms ratio (> 1: flashjvp faster)."
             + (" JVP steps of both providers compute layer norms in float32: PyTorch's CUDA layer norm "
                "gives a bf16 input a float32 tangent, which the next bf16 Linear refuses."
                if meta.get("float_layer_norm") else "")]
    dims = {r.model: r.dims for r in rows if r.dims}
    parts.append(md_table(["model", "config"], [[m, d] for m, d in dims.items()]))
    providers = list(dict.fromkeys(r.provider for r in rows))
    others = [p for p in providers if p != "flashjvp"] if "flashjvp" in providers else []
    by = {(r.model, r.step, r.mode, r.provider): r for r in rows if r.status == "ok"}
    keys = list(dict.fromkeys((r.model, r.step, r.mode) for r in rows))
    body = []
    for key in keys:
        cells = [f"{by[(*key, p)].ms:.2f} / {_mib(by[(*key, p)])}" if (*key, p) in by else "" for p in providers]
        fj = by.get((*key, "flashjvp"))
        ratios = [f"{by[(*key, p)].ms / fj.ms:.3g}x" if fj and (*key, p) in by else "" for p in others]
        body.append([*key, *cells, *ratios])
    header = ["model", "step", "mode", *[f"{p} ms / MiB" for p in providers], *[f"{p} / flashjvp" for p in others]]
    parts.append(md_table(header, body))
    comp = [[r.model, r.step, r.mode, r.provider, r.compiled, str(r.graphs), str(r.breaks), f"{r.first_s:.1f}"]
            for r in rows if r.status == "ok" and r.compiled]
    if comp:
        parts += ["## Compiled rows (graphs Dynamo compiled, graph breaks, first step s incl. compilation)",
                  md_table(["model", "step", "mode", "provider", "compiled", "graphs", "breaks", "first s"], comp)]
    notes = [[r.model, r.step, r.mode, r.provider, r.status, r.reason[:300]] for r in rows if r.reason]
    if notes:
        parts += ["## Not measured, fallbacks and notes",
                  md_table(["model", "step", "mode", "provider", "status", "reason"], notes)]
    return "\n\n".join(parts) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    """ms per (model, mode), bars per provider, one panel per step (log scale; no bar: not measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in STEPS if any(r.step == s for r in rows)]
    groups = list(dict.fromkeys((r.model, r.mode) for r in rows))
    providers = list(dict.fromkeys(r.provider for r in rows))
    ms = {(r.model, r.mode, r.step, r.provider): r.ms for r in rows if r.status == "ok"}
    fig, axes = plt.subplots(len(steps), 1, figsize=(max(8.0, 0.9 * len(groups) + 2), 3.4 * len(steps)), squeeze=False)
    width = 0.8 / len(providers)
    for ax, step in zip(axes[:, 0], steps):
        for i, p in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, [ms.get((m, mode, step, p)) or 0.0 for m, mode in groups], width, label=p, color=f"C{i}")
        ax.set_xticks(range(len(groups)), [f"{m}\n{mode}" for m, mode in groups], fontsize=7)
        ax.set(yscale="log", ylabel="ms per step", title=f"{step} step (no bar: not measured)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


REPORT = Report("models", format_report, plot)


def write_report(rows: list[Row], meta: dict, out: Path, with_plot: bool) -> dict[str, Path]:
    """``models.json`` (meta + rows), ``models.md`` and, with matplotlib and a measured row, ``models.png``."""
    return REPORT.write(rows, meta, out, with_plot and any(r.status == "ok" for r in rows))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(DEFAULT_PROVIDERS),
                    help="torch-math: plain steps on the math backend (default: torch flashjvp)")
    ap.add_argument("--batch", type=int, help="batch size of every model (default: per model)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized configs, batch 2, float32 (the smoke test)")
    ap.add_argument("--warmup", type=int, help="untimed steps, the first compiles (default 3; --tiny 1)")
    ap.add_argument("--repeat", type=int, help="timed steps per row (default 20; --tiny 2)")
    ap.add_argument("--bf16-weights", action="store_true", help="weights and inputs in bf16, no autocast (PyTorch's "
                    "math SDPA fails under autocast with torch.func.jvp: 'expected input and grad types to match')")
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds, then rows are skipped (0: none)")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<gpu-name-slug>)")
    ap.add_argument("--append", action="store_true", help="keep the rows of --out's models.json that this run "
                    "does not measure (a skip here never replaces a measurement there)")
    return ap


def merge(old: list[dict], done: list[Row]) -> list[Row]:
    """--append: the rows of an earlier report that ``done`` does not measure, then ``done`` (a
    skip in ``done`` never replaces a measurement)."""
    key = lambda r: (r.model, r.step, r.mode, r.provider)
    new = {key(r): r for r in done}
    kept = {key(r): r for r in (Row(**d) for d in old)
            if key(r) not in new or (r.status == "ok" and new[key(r)].status == "skipped")}
    return list(kept.values()) + [r for r in done if key(r) not in kept]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.tiny):
        print("the full configs need a CUDA GPU (use --tiny on the CPU)", file=sys.stderr)
        return 2
    args.warmup = max(1, args.warmup or (1 if args.tiny else 3))
    args.repeat = max(1, args.repeat or (2 if args.tiny else 20))
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    meta = {**run_metadata(gpu, "benchmarks.models", argv), "tiny": args.tiny, "warmup": args.warmup,
            "dtype": "fp32" if args.tiny else "bf16 weights" if args.bf16_weights else "bf16 autocast, fp32 weights",
            "repeat": args.repeat,
            "diffusers": importlib.metadata.version("diffusers") if importlib.util.find_spec("diffusers") else "none"}
    # bf16 weights on the GPU: JVP steps take float32 layer norms (both providers; see float_layer_norm)
    args.float_layer_norm = args.bf16_weights and not args.tiny and layer_norm_tangent_mixes(
        torch.device("cuda" if cuda else "cpu"))
    meta["float_layer_norm"] = args.float_layer_norm
    out = args.out or results_dir(gpu)
    old = json.loads((out / "models.json").read_text()) if args.append and (out / "models.json").exists() else {}
    if old:
        meta["command"] = f"{old['command']}`; `{meta['command']}"
    rows = plan(args.models, args.steps, args.modes, args.providers)
    start, case, failed = time.perf_counter(), None, {}
    for i, row in enumerate(rows):
        elapsed = time.perf_counter() - start
        if args.time_limit and elapsed > args.time_limit:
            row.status, row.reason = "skipped", f"time limit reached (--time-limit {args.time_limit:g} s)"
        elif row.model not in failed and (case is None or case.name != row.model):
            case = None  # one model in memory at a time
            gc.collect()
            builder, batch, full, tiny = MODELS[row.model]
            torch.manual_seed(0)
            try:
                case = builder(tiny if args.tiny else full, 2 if args.tiny else args.batch or batch,
                               torch.device("cuda" if cuda else "cpu"))
                case.name = row.model
                if args.bf16_weights and not args.tiny:
                    case = in_dtype(case, torch.bfloat16)
            except Exception as e:  # noqa: BLE001 - e.g. diffusers missing: the model's rows are skipped
                failed[row.model] = f"model not built: {skip_reason(e, [])}"
        if row.status == "ok" and row.model in failed:
            row.status, row.reason = "skipped", failed[row.model]
        elif row.status == "ok":
            row.dims = case.dims
            run_row(case, row, args, cuda)
        res = f"{row.ms:9.2f} ms {_mib(row):>8} MiB" if row.status == "ok" else f"{row.status}: {row.reason}"
        print(f"[{i + 1:3d}/{len(rows)} {elapsed:5.0f}s] {row.model:<14} {row.step:<8} {row.mode:<15} "
              f"{row.provider:<10} {res[:150]}", flush=True)
        write_report(merge(old.get("rows", []), rows[: i + 1]), meta, out, with_plot=False)
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    rows = merge(old.get("rows", []), rows)
    paths = write_report(rows, meta, out, with_plot=True)
    print("\n" + format_report(rows, meta) + "\nwrote " + ", ".join(map(str, paths.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
