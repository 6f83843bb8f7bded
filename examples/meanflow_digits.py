"""MeanFlow on scikit-learn's 8x8 digits: one-step class-conditional generation with flashjvp.

MeanFlow (Geng et al. 2025, "Mean Flows for One-step Generative Modeling") trains a network
``u(z_t, r, t, c)`` to predict the *average* velocity of the flow between times ``r`` and ``t``.
With ``z_t = (1 - t) x + t e`` and ``v = e - x`` the target is

    u_tgt = v - (t - r) * d/dt u(z_t, r, t, c),   d/dt u = jvp(u, (z, r, t), (v, 0, 1)),

so every training step needs the forward-mode derivative of the whole network. Here it comes
from ``torch.func.jvp`` over a small DiT whose attention is ``flashjvp.attention``: on a GPU the
attention output and its tangent come from one fused Triton kernel, and the loss's backward
runs flashjvp's Triton backward. Sampling is ``x = e - u(e, 0, 1)`` (one step) or two steps
``1 -> 0.5 -> 0``. Quality is judged by a logistic-regression digit classifier trained on the
real training digits: how often does it read a generated sample as the class it was asked for?

    python examples/meanflow_digits.py              # GPU if present: bf16 autocast, 2.9M params
    python examples/meanflow_digits.py --smoke      # tiny CPU run (CI)
    python examples/meanflow_digits.py --ref        # same, attention from flashjvp.attention_ref
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import flashjvp
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import flashjvp

try:
    from tqdm.auto import tqdm
except ImportError:
    tqdm = None

SIDE, CLASSES = 8, 10
CPU_HINT = "--steps 1500 --dim 64 --depth 4 --heads 4 --batch-size 128 --lr 1e-3"


# ----------------------------------------------------------------------------------- model


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of ``t`` in [0, 1]; (B,) -> (B, dim).

    ``t`` is not scaled up (DiT multiplies by 1000): steep features make ``du/dt``, and so the
    target, explode; with frequencies <= 1 training is stable."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimeEmbedder(nn.Module):
    """Sinusoidal features followed by a two-layer MLP."""

    def __init__(self, dim: int, freq_dim: int = 128):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t):
        return self.mlp(timestep_embedding(t, self.freq_dim))


def modulate(x, shift, scale):
    """``x * (1 + scale) + shift``, written without the Python scalar: under forward AD a scalar
    operand gets a zero tangent, and ops on zero tangents are slow on the host in recent PyTorch."""
    return x + x * scale + shift


class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaLN-Zero conditioning; attention through ``attn``."""

    def __init__(self, dim: int, heads: int, attn, mlp_ratio: int = 4):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x, c):
        b, n, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c))[:, None].chunk(6, dim=-1)
        h = modulate(self.norm1(x), shift1, scale1)
        # (B, N, 3, H, D).unbind(2): strided views in the "bnhd" layout, no copies.
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        o = self.attn(q, k, v, layout="bnhd").reshape(b, n, d)
        x = x + gate1 * self.proj(o)
        return x + gate2 * self.mlp(modulate(self.norm2(x), shift2, scale2))


class MeanFlowDiT(nn.Module):
    """``u(z, r, t, y)``: average velocity of an 8x8 image, conditioned on t, t - r and the class."""

    def __init__(self, dim=192, depth=4, heads=6, patch=2, attn=flashjvp.attention):
        super().__init__()
        assert SIDE % patch == 0 and dim % heads == 0
        self.patch, self.grid = patch, SIDE // patch
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, self.grid**2, dim))
        self.t_embed, self.h_embed = TimeEmbedder(dim), TimeEmbedder(dim)
        self.y_embed = nn.Embedding(CLASSES, dim)
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, attn) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, patch * patch)
        for layer in (self.ada, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, z, r, t, y):
        b, p, g = z.shape[0], self.patch, self.grid
        x = z.view(b, g, p, g, p).transpose(2, 3).reshape(b, g * g, p * p)
        x = self.embed(x) + self.pos
        c = self.t_embed(t) + self.h_embed(t - r) + self.y_embed(y)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.ada(F.silu(c))[:, None].chunk(2, dim=-1)
        x = self.out(modulate(self.norm(x), shift, scale))
        return x.view(b, g, g, p, p).transpose(2, 3).reshape(b, SIDE * SIDE).float()


# -------------------------------------------------------------------------------- training


def sample_r_t(n: int, flow_ratio: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit-normal(-0.4, 1) pairs with r <= t; a ``flow_ratio`` fraction gets r = t."""
    rt = torch.sigmoid(torch.randn(2, n, device=device) - 0.4)
    t, r = rt.max(dim=0).values, rt.min(dim=0).values
    r = torch.where(torch.rand(n, device=device) < flow_ratio, t, r)
    return r, t


def meanflow_loss(model, x, y, flow_ratio: float, adaptive_p: float):
    """MeanFlow loss of one batch; returns (loss to minimise, plain per-pixel MSE for logging)."""
    r, t = sample_r_t(x.shape[0], flow_ratio, x.device)
    e = torch.randn_like(x)
    z = (1 - t[:, None]) * x + t[:, None] * e
    v = e - x
    # One pass: u keeps its autograd graph (parameters are captured by the closure) and
    # dudt = du/dz . v + du/dt comes from forward mode (flashjvp's fused kernel for attention).
    u, dudt = torch.func.jvp(lambda z_, r_, t_: model(z_, r_, t_, y), (z, r, t),
                             (v, torch.zeros_like(r), torch.ones_like(t)))
    u_tgt = (v - (t - r)[:, None] * dudt).detach()
    sq = ((u - u_tgt) ** 2).sum(dim=1)
    weight = (sq.detach() + 1e-3) ** -adaptive_p  # adaptive weighting; p = 0 is plain MSE
    return (weight * sq).mean(), sq.detach().mean() / x.shape[1]


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float):
    """``ema = decay * ema + (1 - decay) * model``, parameter by parameter, in one foreach call."""
    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)


@torch.no_grad()
def generate(model, y: torch.Tensor, steps: int, autocast, seed: int = 0) -> torch.Tensor:
    """``steps``-step MeanFlow sampling ``z_r = z_t - (t - r) u(z_t, r, t)`` from t = 1 to 0."""
    gen = torch.Generator(device=y.device).manual_seed(seed)
    z = torch.randn(y.shape[0], SIDE * SIDE, device=y.device, generator=gen)
    times = torch.linspace(1.0, 0.0, steps + 1, device=y.device)
    for t, r in zip(times[:-1], times[1:]):
        with autocast():
            u = model(z, r.expand(y.shape[0]), t.expand(y.shape[0]), y)
        z = z - (t - r) * u
    return z.clamp(-1, 1)


def train(args, model, data, labels, autocast):
    """Adam + warmup + EMA; returns the EMA model, the per-step MSE history and steps/s."""
    ema = copy.deepcopy(model).requires_grad_(False)
    fused = args.device.startswith("cuda")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), fused=fused, foreach=not fused)
    history = torch.zeros(args.steps, device=args.device)
    warmup = max(1, min(1000, args.steps // 10))
    bar = tqdm(range(args.steps), desc="train", mininterval=1.0) if tqdm else range(args.steps)
    warm = min(10, args.steps // 2)  # steps/s leaves out the first steps (Triton compile, autotune)
    for step in bar:
        if step == warm:
            sync(args.device)
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup)
        idx = torch.randint(0, data.shape[0], (args.batch_size,), device=args.device)
        with autocast():
            loss, mse = meanflow_loss(model, data[idx], labels[idx], args.flow_ratio, args.adaptive_p)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema_update(ema, model, min(args.ema, (1 + step) / (10 + step)))
        history[step] = mse
        if (step + 1) % 200 == 0 or step + 1 == args.steps:
            recent = history[max(0, step - 199) : step + 1].mean().item()  # syncs every 200 steps
            if tqdm:
                bar.set_postfix(mse=f"{recent:.4f}")
            else:
                rate = (step + 1 - warm) / (time.perf_counter() - start)
                print(f"step {step + 1}/{args.steps}  mse {recent:.4f}  {rate:.2f} steps/s", flush=True)
    sync(args.device)
    rate = (args.steps - warm) / (time.perf_counter() - start)
    return ema, history.cpu().numpy(), rate


def sync(device: str):
    """Wait for the GPU (for honest timings); nothing on a CPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------ data and outputs


def load_data(seed: int):
    """Digits scaled to [-1, 1] (background -1), split 80/20 stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 8.0 - 1.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.2, stratify=digits.target, random_state=seed)


def save_grid(path: Path, panels: dict[str, np.ndarray], per_class: int):
    """One panel per entry: row c holds ``per_class`` samples of class c (ink dark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4))
    for ax, (title, imgs) in zip(np.atleast_1d(axes), panels.items()):
        tiles = np.full((CLASSES, per_class, SIDE + 1, SIDE + 1), np.nan, dtype=np.float32)
        tiles[:, :, :SIDE, :SIDE] = imgs.reshape(CLASSES, per_class, SIDE, SIDE)
        mosaic = tiles.transpose(0, 2, 1, 3).reshape(CLASSES * (SIDE + 1), per_class * (SIDE + 1))
        ax.imshow(np.ma.masked_invalid(mosaic), cmap="gray_r", vmin=-1, vmax=1, interpolation="nearest")
        ax.set_title(title)
        ax.set_yticks(np.arange(CLASSES) * (SIDE + 1) + SIDE / 2 - 0.5, [str(c) for c in range(CLASSES)])
        ax.set_xticks([])
        ax.set_ylabel("class")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_loss_curve(path: Path, history: np.ndarray):
    """Per-step MSE (faint) and its moving average, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(history) // 100)
    smooth = np.convolve(history, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(np.arange(1, len(history) + 1), history, color="tab:blue", alpha=0.25, lw=0.5, label="per step")
    ax.plot(np.arange(window, len(history) + 1), smooth, color="tab:blue", label=f"mean of {window}")
    ax.set(xlabel="step", ylabel="MSE(u, u_tgt) per pixel", yscale="log", title="MeanFlow training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main


def attention_path(args) -> str:
    """Which attention runs, in words (flashjvp falls back to PyTorch math on a CPU)."""
    if args.ref:
        return "flashjvp.attention_ref (PyTorch math)"
    if args.device.startswith("cuda"):
        return "flashjvp.attention (Triton kernels)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "flashjvp.attention (Triton CPU interpreter, slow)"
    return "flashjvp.attention (CPU: PyTorch math fallback)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/meanflow_digits", help="output folder")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--dim", type=int, default=192, help="model width")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--patch", type=int, default=2, choices=(1, 2, 4), help="2: 16 tokens, 1: 64 tokens")
    p.add_argument("--flow-ratio", type=float, default=0.75, help="fraction of the batch with r = t")
    p.add_argument("--adaptive-p", type=float, default=1.0, help="adaptive loss weight power (0: MSE)")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the weights used to sample")
    p.add_argument("--per-class", type=int, default=100, help="samples per class for the metric")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="autocast dtype; auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref", action="store_true", help="use flashjvp.attention_ref (plain PyTorch math)")
    p.add_argument("--smoke", action="store_true", help="a few steps of a tiny model on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.steps, args.batch_size = "cpu", "fp32", 30, 64
        args.dim, args.depth, args.heads, args.per_class, args.lr = 32, 2, 2, 10, 1e-3
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    return args


def main(argv=None) -> dict:
    """Train, sample, score, and write ``samples.png``, ``loss.png`` and ``metrics.json``."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    amp_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    device_type = torch.device(args.device).type

    def autocast():
        return torch.autocast(device_type, dtype=amp_dtype, enabled=amp_dtype is not None)

    x_train, x_test, y_train, y_test = load_data(args.seed)
    data = torch.from_numpy(x_train).to(args.device)
    labels = torch.from_numpy(y_train).long().to(args.device)
    config = dict(dim=args.dim, depth=args.depth, heads=args.heads, patch=args.patch,
                  attn=flashjvp.attention_ref if args.ref else flashjvp.attention)
    model = MeanFlowDiT(**config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MeanFlow DiT: {n_params / 1e6:.2f}M parameters, {(SIDE // args.patch) ** 2} tokens, "
          f"attention: {attention_path(args)}, device={args.device}, "
          f"dtype={args.dtype}, {len(x_train)} training digits")

    if args.device == "cpu" and n_params > 1e6:
        print(f"note: the default size is meant for a GPU; on a CPU, {CPU_HINT} trains to ~98% in ~10 min")
    start = time.perf_counter()
    ema, history, rate = train(args, model, data, labels, autocast)
    train_s = time.perf_counter() - start
    print(f"trained {args.steps} steps in {train_s:.0f} s, {rate:.2f} steps/s")

    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(max_iter=5000).fit(x_train, y_train)
    metrics = {"classifier_test_accuracy": float(clf.score(x_test, y_test))}
    y_gen = torch.arange(CLASSES, device=args.device).repeat_interleave(args.per_class)
    panels = {}
    for steps in (1, 2):
        imgs = generate(ema, y_gen, steps, autocast, seed=args.seed).cpu().numpy()
        acc = float(np.mean(clf.predict(imgs) == y_gen.cpu().numpy()))
        metrics[f"accuracy_{steps}step"] = acc
        shown = imgs.reshape(CLASSES, args.per_class, -1)[:, : min(10, args.per_class)]
        panels[f"{steps}-step samples ({100 * acc:.0f}% as intended)"] = shown
    tail = history[-max(1, len(history) // 20) :]
    metrics.update(final_mse=float(tail.mean()), steps=args.steps, steps_per_s=rate, train_seconds=train_s,
                   params=n_params, batch_size=args.batch_size, attention=attention_path(args),
                   device=args.device, dtype=args.dtype, seed=args.seed)

    save_grid(out / "samples.png", panels, min(10, args.per_class))
    save_loss_curve(out / "loss.png", history)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    ceiling = 100 * metrics["classifier_test_accuracy"]
    print(f"classifier accuracy on real held-out digits (ceiling): {ceiling:.1f}%")
    for steps in (1, 2):
        print(f"{steps}-step samples classified as their intended class: "
              f"{100 * metrics[f'accuracy_{steps}step']:.1f}% (chance 10%)")
    print(f"pictures: {out / 'samples.png'}, {out / 'loss.png'}; metrics: {out / 'metrics.json'}")
    return metrics


if __name__ == "__main__":
    main()
