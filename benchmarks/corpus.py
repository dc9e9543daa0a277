"""Detection-benchmark corpus: tiny char-level GPTs really trained on CPU until some become unstable.

Text: the Python standard library's own ``.py`` files (sorted, so every machine trains on the
same bytes). Per step we log what the live guard would hand the detector: the loss, the global
gradient norm before clipping, every per-module gradient norm (in backward order) and per-module
non-finite flags. Runs are cached as ``.npz`` under ``benchmarks/.cache/corpus_v1/``; a second call
reads the cache and trains nothing.

Groups (the run name says which):
- ``sweep``: learning-rate sweep, with and without warm-up, with and without qk-layernorm and
  z-loss (Wortsman et al. 2023: attention-logit growth and output-logit divergence at high LR),
  unclipped and clipped.
- ``badbatch``: one corrupted batch (random bytes, or one repeated byte, with the loss scaled
  up) injected mid-run.
- ``healthy``: conservative learning rates, clipping, different seeds and shapes.

A second, held-out set (``holdout_specs``, run names ``ho_*``) repeats the recipe families with
other seeds, learning rates and warm-ups; it was generated after earlywarn's defaults had been
chosen on the first set, and the detection benchmark reports the two separately.

Runs stop at the first non-finite loss, or 40 steps into a loss divergence (nothing is left to
detect after that; it keeps generation to a few minutes).

Usage: ``python benchmarks/corpus.py [--regenerate] [--only NAME] [--holdout]``. Whole corpus: a
few minutes on one core (``torch.set_num_threads(1)``: the machines are shared).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parent / ".cache" / "corpus_v1"
VOCAB = 128  # bytes folded to 7 bits: the stdlib is almost all ASCII


@dataclass(frozen=True)
class RunSpec:
    name: str
    group: str  # "sweep" | "badbatch" | "healthy"
    lr: float
    warmup: int = 0
    qk_norm: bool = False
    z_loss: float = 0.0
    steps: int = 500
    seed: int = 0
    n_layer: int = 2
    d_model: int = 48
    bad_step: int = -1  # step at which one corrupted batch is fed (-1: none)
    bad_kind: str = "random"  # "random" bytes or one "repeat"ed byte
    bad_scale: float = 1.0  # loss multiplier on the bad batch (a mis-weighted / unmasked batch)
    clip: float = 1.0  # max global grad norm (0: no clipping)
    beta2: float = 0.95


def run_specs() -> list[RunSpec]:
    """The corpus, fixed in code so that the table is reproducible."""
    specs: list[RunSpec] = []
    # LR sweep, no clipping, beta2 0.99 (a common LLM recipe before clipping was universal), with
    # and without warm-up, without and with the stabilisers (qk-layernorm + z-loss, Wortsman et
    # al. 2023). The high end diverges: loss x10 within tens of steps, mid warm-up.
    for lr in (0.1, 0.3, 1.0, 3.0):
        for warmup in (0, 150):
            for seed in (0, 1):
                specs.append(RunSpec(f"sweep_lr{lr:g}_wu{warmup}_s{seed}", "sweep", lr, warmup,
                                     seed=seed, steps=300, clip=0.0, beta2=0.99))
            specs.append(RunSpec(f"sweep_qkz_lr{lr:g}_wu{warmup}", "sweep", lr, warmup, qk_norm=True,
                                 z_loss=1e-4, seed=2, steps=300, clip=0.0, beta2=0.99))
    # The same high LRs with clipping at 1.0 and beta2 0.95: slower, partly recovering divergences.
    for lr in (0.3, 1.0, 3.0):
        specs.append(RunSpec(f"sweep_clip_lr{lr:g}_wu150", "sweep", lr, 150, seed=3, steps=300))
    # More seeds and shapes of the diverging end of the sweep (the events the benchmark scores).
    for lr in (0.5, 1.0, 2.0):
        for warmup in (150, 300):
            for seed in (4, 5):
                specs.append(RunSpec(f"sweep_lr{lr:g}_wu{warmup}_s{seed}", "sweep", lr, warmup,
                                     seed=seed, steps=400, clip=0.0, beta2=0.99))
    for lr in (0.7, 1.5):
        for seed in (6, 7):
            specs.append(RunSpec(f"sweep_qkz_lr{lr:g}_wu200_s{seed}", "sweep", lr, 200, qk_norm=True,
                                 z_loss=1e-4, seed=seed, steps=400, clip=0.0, beta2=0.99))
    for lr in (2.0, 5.0):
        for seed in (8, 9):
            specs.append(RunSpec(f"sweep_clip_lr{lr:g}_wu200_s{seed}", "sweep", lr, 200, seed=seed,
                                 steps=400))
    for lr in (1.0, 2.0):
        specs.append(RunSpec(f"sweep_deep_lr{lr:g}_wu200", "sweep", lr, 200, seed=12, n_layer=3,
                             steps=400, clip=0.0, beta2=0.99))
    # One bad batch (random bytes, or one repeated byte, its loss scaled up as an unmasked or
    # mis-weighted batch would be), at modest and aggressive LRs.
    for i, (lr, kind, scale, clip) in enumerate(
        [(3e-3, "random", 1.0, 1.0), (3e-3, "repeat", 50.0, 1.0), (1e-2, "random", 20.0, 1.0),
         (3e-2, "repeat", 100.0, 1.0), (1e-2, "random", 200.0, 0.0), (3e-2, "repeat", 1000.0, 0.0)]
    ):
        specs.append(
            RunSpec(f"badbatch_{kind}_x{scale:g}_lr{lr:g}_clip{clip:g}", "badbatch", lr, warmup=30,
                    bad_step=150, bad_kind=kind, bad_scale=scale, seed=10 + i, steps=300, clip=clip)
        )
    # Healthy runs: conservative LRs, warm-up, clipping, different seeds and shapes.
    for lr in (1e-3, 3e-3, 1e-2):
        for seed in (20, 21, 22):
            specs.append(RunSpec(f"healthy_lr{lr:g}_s{seed}", "healthy", lr, warmup=50, seed=seed,
                                 qk_norm=seed % 2 == 0, steps=400))
    specs.append(RunSpec("healthy_deep_lr3e-3", "healthy", 3e-3, warmup=50, seed=30, n_layer=3, steps=400))
    specs.append(RunSpec("healthy_wide_lr3e-3", "healthy", 3e-3, warmup=50, seed=31, d_model=64, steps=400))
    return specs


def holdout_specs() -> list[RunSpec]:
    """A second corpus from the same recipe families, with seeds, learning rates and warm-ups the
    development corpus does not use. It was generated after earlywarn's defaults were chosen on
    :func:`run_specs` and is reported separately, as a check that the defaults were not fitted
    to the development runs."""
    specs: list[RunSpec] = []
    for lr in (0.7, 1.4, 2.5):
        for warmup in (120, 250):
            for seed in (40, 41):
                specs.append(RunSpec(f"ho_sweep_lr{lr:g}_wu{warmup}_s{seed}", "sweep", lr, warmup,
                                     seed=seed, steps=400, clip=0.0, beta2=0.99))
    for lr in (1.0, 2.0):
        for seed in (42, 43):
            specs.append(RunSpec(f"ho_sweep_qkz_lr{lr:g}_wu200_s{seed}", "sweep", lr, 200, qk_norm=True,
                                 z_loss=1e-4, seed=seed, steps=400, clip=0.0, beta2=0.99))
    for lr in (1.5, 3.0):
        for seed in (44, 45):
            specs.append(RunSpec(f"ho_sweep_clip_lr{lr:g}_wu200_s{seed}", "sweep", lr, 200, seed=seed,
                                 steps=400))
    specs.append(RunSpec("ho_sweep_deep_lr1.5_wu200", "sweep", 1.5, 200, seed=46, n_layer=3,
                         steps=400, clip=0.0, beta2=0.99))
    specs.append(RunSpec("ho_sweep_wide_lr1_wu200", "sweep", 1.0, 200, seed=47, d_model=64,
                         steps=400, clip=0.0, beta2=0.99))
    for i, (lr, kind, scale, clip) in enumerate(
        [(1e-2, "random", 30.0, 1.0), (2e-2, "repeat", 300.0, 1.0), (5e-3, "random", 100.0, 0.0)]
    ):
        specs.append(
            RunSpec(f"ho_badbatch_{kind}_x{scale:g}_lr{lr:g}_clip{clip:g}", "badbatch", lr, warmup=30,
                    bad_step=150, bad_kind=kind, bad_scale=scale, seed=48 + i, steps=300, clip=clip)
        )
    for lr in (2e-3, 5e-3):
        for seed in (50, 51):
            specs.append(RunSpec(f"ho_healthy_lr{lr:g}_s{seed}", "healthy", lr, warmup=50, seed=seed,
                                 qk_norm=seed % 2 == 0, steps=400))
    specs.append(RunSpec("ho_healthy_deep_lr5e-3", "healthy", 5e-3, warmup=50, seed=52, n_layer=3, steps=400))
    specs.append(RunSpec("ho_healthy_wide_lr2e-3", "healthy", 2e-3, warmup=50, seed=53, d_model=64, steps=400))
    return specs


# ----------------------------------------------------------------------------------------------
# data


def load_text(max_bytes: int = 3_000_000) -> np.ndarray:
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    chunks, total = [], 0
    for p in paths:
        with open(p, "rb") as f:
            b = f.read()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8) & 0x7F
    return data.astype(np.int64)


# ----------------------------------------------------------------------------------------------
# model (a tiny GPT; kept here so the benchmark depends on nothing else in the repository)


def build_model(spec: RunSpec, ctx: int):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self, d: int, heads: int, qk_norm: bool):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.q_norm = nn.LayerNorm(d // heads) if qk_norm else None
            self.k_norm = nn.LayerNorm(d // heads) if qk_norm else None

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, qk_norm: bool):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = Attention(d, heads, qk_norm)
            self.ln_2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = spec.d_model
            self.wte = nn.Embedding(VOCAB, d)
            self.wpe = nn.Embedding(ctx, d)
            self.h = nn.ModuleList(Block(d, 4, spec.qk_norm) for _ in range(spec.n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, VOCAB, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.h:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


def module_groups(model) -> tuple[list[str], list[list]]:
    """Parameters grouped by the module that owns them, in backward order (last module first)."""
    names, groups = [], []
    for mname, mod in model.named_modules():
        params = [p for p in mod.parameters(recurse=False)]
        if params:
            names.append(mname)
            groups.append(params)
    return names[::-1], groups[::-1]


# ----------------------------------------------------------------------------------------------
# training


def train_run(spec: RunSpec, text: np.ndarray, ctx: int = 48, batch: int = 16) -> dict:
    import torch
    from torch.nn import functional as F

    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)
    model = build_model(spec, ctx)
    names, groups = module_groups(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, spec.beta2), eps=1e-8,
    )
    flat = [p for g in groups for p in g]
    sizes = [len(g) for g in groups]
    group_index = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))

    T = spec.steps
    loss_log = np.full(T, np.nan)
    gnorm = np.full(T, np.nan)
    layer = np.full((T, len(names)), np.nan, dtype=np.float32)
    layer_nf = np.zeros((T, len(names)), dtype=np.uint8)
    lr_log = np.zeros(T)
    diverged_for = 0
    last = T
    for step in range(T):
        if spec.warmup and step < spec.warmup:
            lr = spec.lr * (step + 1) / spec.warmup
        else:
            frac = (step - spec.warmup) / max(1, T - spec.warmup)
            lr = spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        lr_log[step] = lr
        starts = rng.integers(0, len(text) - ctx - 1, size=batch)
        xy = torch.from_numpy(np.stack([text[s : s + ctx + 1] for s in starts]))
        scale = 1.0
        if step == spec.bad_step:
            if spec.bad_kind == "random":
                xy = torch.from_numpy(rng.integers(0, VOCAB, size=(batch, ctx + 1)))
            else:
                xy = torch.full((batch, ctx + 1), int(rng.integers(32, 127)), dtype=torch.long)
            scale = spec.bad_scale
        x, y = xy[:, :-1], xy[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        total = loss * scale
        if spec.z_loss:
            total = total + spec.z_loss * torch.logsumexp(logits, dim=-1).square().mean()
        opt.zero_grad(set_to_none=True)
        total.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in flat]
        sq = torch.stack(torch._foreach_norm(grads)).double().square()
        per_group = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, group_index, sq).sqrt()
        loss_log[step] = float(loss.detach())  # the unscaled loss is what a logger shows
        gnorm[step] = float(per_group.square().sum().sqrt())
        layer[step] = per_group.numpy()
        # a module's norm is non-finite exactly when one of its gradient values is
        layer_nf[step] = ~np.isfinite(layer[step])
        if not math.isfinite(loss_log[step]) or not math.isfinite(gnorm[step]):
            last = step + 1
            break
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        # Stop a run that has clearly collapsed (saves minutes; nothing left to detect).
        base = np.nanmedian(loss_log[max(0, step - 100) : max(1, step - 20)]) if step > 40 else np.inf
        diverged_for = diverged_for + 1 if loss_log[step] > 1.5 * base else 0
        if diverged_for >= 40:
            last = step + 1
            break
    return {
        "loss": loss_log[:last],
        "grad_norm": gnorm[:last],
        "layer_norms": layer[:last],
        "layer_nonfinite": layer_nf[:last],
        "lr": lr_log[:last],
        "layer_names": np.array(names),
    }


@dataclass
class RunLog:
    """One cached run: per-step arrays (steps are 0..n-1)."""

    spec: RunSpec
    loss: np.ndarray
    grad_norm: np.ndarray
    layer_norms: np.ndarray
    layer_nonfinite: np.ndarray
    lr: np.ndarray
    layer_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.spec.name


def _path(spec: RunSpec) -> Path:
    return CACHE / f"{spec.name}.npz"


def load_corpus(regenerate: bool = False, only: str | None = None, verbose: bool = True,
                holdout: bool = False) -> list[RunLog]:
    """All runs of :func:`run_specs` (or :func:`holdout_specs`), training (and caching) any that
    are missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    specs = [s for s in (holdout_specs() if holdout else run_specs()) if only is None or only in s.name]
    text = None
    runs = []
    t_all = time.perf_counter()
    for spec in specs:
        path = _path(spec)
        meta_ok = False
        if path.exists() and not regenerate:
            with np.load(path, allow_pickle=False) as z:
                meta_ok = json.loads(str(z["spec"])) == asdict(spec)
                if meta_ok:
                    d = {k: z[k] for k in z.files}
        if not meta_ok:
            import torch

            torch.set_num_threads(1)
            if text is None:
                text = load_text()
            t0 = time.perf_counter()
            d = train_run(spec, text)
            np.savez_compressed(path, spec=json.dumps(asdict(spec)), **d)
            if verbose:
                print(f"  trained {spec.name}: {len(d['loss'])} steps in {time.perf_counter() - t0:.1f}s, "
                      f"final loss {d['loss'][-1]:.3f}", file=sys.stderr, flush=True)
        runs.append(RunLog(spec, d["loss"], d["grad_norm"], d["layer_norms"], d["layer_nonfinite"],
                           d["lr"], tuple(str(n) for n in d["layer_names"])))
    if verbose and text is not None:
        print(f"corpus generated in {time.perf_counter() - t_all:.0f}s", file=sys.stderr)
    return runs


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regenerate", action="store_true", help="retrain even when cached")
    ap.add_argument("--only", default=None, help="only runs whose name contains this")
    ap.add_argument("--holdout", action="store_true", help="the held-out corpus (holdout_specs)")
    a = ap.parse_args()
    for r in load_corpus(a.regenerate, a.only, holdout=a.holdout):
        print(f"{r.name:40s} steps={len(r.loss):4d} loss {r.loss[0]:.2f} -> {r.loss[-1]:.2f} "
              f"gn median {np.nanmedian(r.grad_norm):.3f} max {np.nanmax(r.grad_norm):.3g}")
