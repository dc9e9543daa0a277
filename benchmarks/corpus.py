"""Detection-benchmark corpus: small models really trained on CPU until some become unstable.

Every run logs, per optimizer step, what a logger or the live guard can hand the detector: the
loss, the global gradient norm before clipping, every per-module gradient norm (backward order),
per-module non-finite flags, and the leading-signal candidates of issue 14: the learning rate of
the step, the norm of the parameter change it applied (``update_norm``), the parameter norm before
it (``param_norm``), Adam's g^2 / v decoupling (``gv``: this step's mean squared gradient over
the bias-corrected second moment of the step before, global and the largest per module), and for
fp16 runs the loss scale and whether the scaler skipped the step.

Families (``RunSpec.family``; the detection benchmark leaves each out in turn):

- ``sweep_wu`` / ``sweep_nowu``: learning-rate sweeps with and without warm-up;
- ``rewarm``: a cosine decay, then a re-warm-up to the old peak or above;
- ``pulse``: a short LR pulse (x3-x100 for 1-5 steps);
- ``badbatch``: injected bad batches (random bytes, one repeated byte, a loss scaled up);
- ``ramp``: a gradual, geometric LR ramp through the stable range (an LR range test);
- ``healthy_lm``: conservative language-model runs (cosine, constant, SGDR restarts, fp16);
- ``small_batch``: language models at batch 4-8 (a noisy loss);
- ``teacher_cls``: classification against a fixed random teacher, SGD momentum, batch 8;
- ``regression``: MSE regression to the noise floor (loss ~0.1, batch 256) and from loss ~10
  (batch 32);
- ``negative_loss``: heteroscedastic Gaussian NLL, whose loss crosses 0 and stays negative;
- ``finetune``: a pretrained GPT fine-tuned on English at batch 4, cosine-decayed;
- ``gru`` (architecture held out from every tuning: a GRU language model under the LR-sweep,
  re-warm, pulse, bad-batch and healthy recipes).

Models: char-level GPT and MLP language models on real text (the Python standard library's
``.py`` files and the English text of ``pydoc_data.topics``, both shipped with Python, so every
machine trains on the same bytes), MLP students; Adam, AdamW, SGD (momentum); fp32 and fp16
(``torch.autocast`` with a ``GradScaler``). Runs stop at the first non-finite loss, 40 steps into
a loss divergence, or 30 scaler overflows in a row.

Cached as ``.npz`` under ``benchmarks/.cache/corpus_v2/`` (gitignored); a second call trains
nothing. Whole corpus: ~10 minutes on one core (``torch.set_num_threads(1)``: the machines are
shared). Usage: ``python benchmarks/corpus.py [--regenerate] [--only NAME] [--list]``.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

CACHE = Path(__file__).resolve().parent / ".cache" / "corpus_v2"
VOCAB = 128  # bytes folded to 7 bits: both texts are almost all ASCII


@dataclass(frozen=True)
class RunSpec:
    name: str
    family: str
    arch: str = "gpt"  # gpt | mlp | gru (language models), cls | reg | nll (MLP students)
    opt: str = "adamw"  # adamw | adam | sgd
    lr: float = 3e-3  # peak learning rate
    warmup: int = 0
    decay: str = "cos"  # cos (to 10% of the peak) | const | ramp (geometric, lr_end at the end)
    lr_end: float = 0.0  # ramp only
    rewarm_at: int = -1  # cosine to 10% by this step, then a linear re-warm ...
    rewarm_len: int = 30  # ... over this many steps ...
    rewarm_mult: float = 1.0  # ... to this multiple of the peak, held there
    pulse_at: int = -1
    pulse_len: int = 1
    pulse_mult: float = 10.0
    bad_steps: tuple[int, ...] = ()
    bad_kind: str = "random"  # random | repeat | shuffle (labels / targets of a random batch)
    bad_scale: float = 1.0
    clip: float = 0.0
    fp16: bool = False
    batch: int = 16
    steps: int = 400
    seed: int = 0
    text: str = "py"  # py | en
    d_model: int = 48
    n_layer: int = 2
    beta2: float = 0.99
    momentum: float = 0.9
    pretrain: int = 0  # unlogged steps on the other text first (fine-tunes)
    noise: float = 0.3  # regression / NLL target noise


def _lm_family(fam: str, base: RunSpec, variants: list[dict]) -> list[RunSpec]:
    out = []
    for v in variants:
        s = replace(base, family=fam, **v)
        out.append(s)
    return out


def _name(s: RunSpec) -> str:
    parts = [s.family, s.arch, s.opt, f"lr{s.lr:g}"]
    if s.warmup:
        parts.append(f"wu{s.warmup}")
    if s.decay != "cos":
        parts.append(s.decay + (f"{s.lr_end:g}" if s.decay == "ramp" else ""))
    if s.rewarm_at >= 0:
        parts.append(f"rw{s.rewarm_at}x{s.rewarm_mult:g}")
    if s.pulse_at >= 0:
        parts.append(f"p{s.pulse_at}x{s.pulse_mult:g}l{s.pulse_len}")
    if s.bad_steps:
        parts.append(f"bad{s.bad_kind}{'-'.join(map(str, s.bad_steps))}x{s.bad_scale:g}")
    if s.clip:
        parts.append(f"clip{s.clip:g}")
    if s.fp16:
        parts.append("fp16")
    if s.batch != 16:
        parts.append(f"b{s.batch}")
    if s.text != "py":
        parts.append(s.text)
    parts.append(f"s{s.seed}")
    return "_".join(parts)


def run_specs() -> list[RunSpec]:
    """The corpus, fixed in code so that every table is reproducible."""
    S: list[RunSpec] = []
    seed = iter(range(1000, 100000))

    def add(fam: str, **kw) -> None:
        s = RunSpec(name="", family=fam, seed=next(seed), **kw)
        S.append(replace(s, name=_name(s)))

    # -- LR sweeps with warm-up: the high end turns unstable during or after the warm-up
    for arch, opt, lrs in (("gpt", "adamw", (0.03, 0.1, 0.3, 1.0)), ("gpt", "adam", (0.05, 0.5)),
                           ("mlp", "adam", (0.03, 0.1, 0.3)), ("gpt", "sgd", (3.0, 10.0, 30.0)),
                           ("mlp", "sgd", (3.0, 10.0))):
        for lr in lrs:
            add("sweep_wu", arch=arch, opt=opt, lr=lr, warmup=150)
    for lr in (0.1, 0.5):
        add("sweep_wu", arch="gpt", opt="adamw", lr=lr, warmup=100, fp16=True)
    add("sweep_wu", arch="gpt", opt="adamw", lr=0.3, warmup=200, clip=1.0, beta2=0.95)
    add("sweep_wu", arch="gpt", opt="adamw", lr=0.3, warmup=200, text="en")
    # -- without warm-up (constant LR from step 0; many collapse too early to be scored)
    for arch, opt, lrs in (("gpt", "adamw", (0.01, 0.02, 0.05)), ("mlp", "adam", (0.01, 0.03)),
                           ("gpt", "sgd", (1.0, 3.0)), ("mlp", "sgd", (1.0, 3.0))):
        for lr in lrs:
            add("sweep_nowu", arch=arch, opt=opt, lr=lr, decay="const")
    add("sweep_nowu", arch="gpt", opt="adamw", lr=0.02, decay="const", fp16=True)
    add("sweep_nowu", arch="gpt", opt="adamw", lr=0.03, decay="const", text="en")
    # -- re-warm-ups: peak 3e-3 (Adam) / 0.3 (SGD), cosine to 10% by step 200, back up x k
    for arch, opt, peak, mults in (("gpt", "adamw", 3e-3, (1.0, 10.0, 30.0, 100.0)),
                                   ("mlp", "adam", 3e-3, (10.0, 30.0, 100.0)),
                                   ("gpt", "sgd", 0.3, (10.0, 30.0)), ("mlp", "sgd", 0.3, (10.0, 30.0))):
        for m in mults:
            add("rewarm", arch=arch, opt=opt, lr=peak, warmup=50, rewarm_at=200, rewarm_mult=m)
    add("rewarm", arch="gpt", opt="adamw", lr=3e-3, warmup=50, rewarm_at=200, rewarm_mult=30.0, fp16=True)
    add("rewarm", arch="gpt", opt="adamw", lr=3e-3, warmup=50, rewarm_at=180, rewarm_len=10,
        rewarm_mult=50.0, text="en")
    # -- short LR pulses at step 200
    for arch, opt, peak, pulses in (("gpt", "adamw", 3e-3, ((30.0, 1), (100.0, 1), (30.0, 3), (10.0, 5), (3.0, 5))),
                                    ("mlp", "adam", 3e-3, ((30.0, 3), (100.0, 1), (10.0, 5))),
                                    ("gpt", "sgd", 0.3, ((30.0, 3), (10.0, 5))), ("mlp", "sgd", 0.3, ((30.0, 3),))):
        for m, ln in pulses:
            add("pulse", arch=arch, opt=opt, lr=peak, warmup=50, pulse_at=200, pulse_len=ln, pulse_mult=m)
    add("pulse", arch="gpt", opt="adamw", lr=3e-3, warmup=50, pulse_at=200, pulse_len=3, pulse_mult=30.0, fp16=True)
    add("pulse", arch="gpt", opt="adamw", lr=3e-3, warmup=50, pulse_at=220, pulse_len=2, pulse_mult=50.0, text="en")
    # -- bad batches at step 200 (and a second one)
    for arch, opt, lr, kind, scale, clip in (("gpt", "adamw", 3e-3, "random", 1.0, 1.0),
                                             ("gpt", "adamw", 1e-2, "repeat", 100.0, 1.0),
                                             ("gpt", "adamw", 1e-2, "random", 300.0, 0.0),
                                             ("gpt", "adamw", 3e-2, "repeat", 1000.0, 0.0),
                                             ("mlp", "adam", 1e-2, "random", 300.0, 0.0),
                                             ("mlp", "adam", 3e-3, "repeat", 1000.0, 0.0),
                                             ("gpt", "sgd", 0.3, "repeat", 30.0, 0.0),
                                             ("mlp", "sgd", 0.3, "random", 100.0, 0.0)):
        add("badbatch", arch=arch, opt=opt, lr=lr, warmup=30, bad_steps=(200,), bad_kind=kind,
            bad_scale=scale, clip=clip)
    add("badbatch", arch="gpt", opt="adamw", lr=1e-2, warmup=30, bad_steps=(150, 230), bad_kind="repeat",
        bad_scale=300.0)
    add("badbatch", arch="gpt", opt="adamw", lr=1e-2, warmup=30, bad_steps=(200,), bad_kind="random",
        bad_scale=300.0, fp16=True)
    # -- gradual LR ramps (geometric over the whole run)
    for arch, opt, lo, hi in (("gpt", "adamw", 1e-4, 1.0), ("gpt", "adamw", 1e-3, 0.3), ("gpt", "adam", 3e-4, 3.0),
                              ("mlp", "adam", 1e-4, 1.0), ("mlp", "adam", 1e-3, 3.0),
                              ("gpt", "sgd", 1e-2, 100.0), ("mlp", "sgd", 1e-2, 100.0)):
        add("ramp", arch=arch, opt=opt, lr=lo, decay="ramp", lr_end=hi)
    add("ramp", arch="gpt", opt="adamw", lr=3e-4, decay="ramp", lr_end=1.0, fp16=True)
    add("ramp", arch="gpt", opt="adamw", lr=3e-4, decay="ramp", lr_end=1.0, text="en")
    # -- healthy language models
    for arch, opt, lr, kw in (("gpt", "adamw", 1e-3, {}), ("gpt", "adamw", 3e-3, {"clip": 1.0}),
                              ("gpt", "adam", 2e-3, {"decay": "const"}), ("mlp", "adam", 1e-3, {}),
                              ("mlp", "adamw", 3e-3, {"decay": "const"}), ("gpt", "sgd", 0.3, {}),
                              ("mlp", "sgd", 0.3, {"decay": "const"}),
                              ("gpt", "adamw", 3e-3, {"rewarm_at": 200, "rewarm_mult": 1.0}),
                              ("gpt", "adamw", 3e-3, {"fp16": True}), ("mlp", "adam", 1e-3, {"fp16": True}),
                              ("gpt", "adamw", 2e-3, {"text": "en"}), ("gpt", "adamw", 3e-3, {"n_layer": 3})):
        add("healthy_lm", arch=arch, opt=opt, lr=lr, warmup=50, **kw)
    # -- small batches
    for arch, opt, lr, b, kw in (("gpt", "adamw", 1e-3, 4, {}), ("gpt", "adamw", 3e-3, 8, {}),
                                 ("mlp", "adam", 1e-3, 4, {}), ("mlp", "sgd", 0.1, 8, {}),
                                 ("gpt", "adamw", 1e-3, 4, {"text": "en"}), ("gpt", "sgd", 0.1, 4, {}),
                                 ("gpt", "adamw", 1e-3, 8, {"fp16": True})):
        add("small_batch", arch=arch, opt=opt, lr=lr, warmup=20, batch=b, **kw)
    # -- classification against a fixed teacher, SGD momentum, batch 8
    for lr, mom, b in ((0.05, 0.9, 8), (0.1, 0.9, 8), (0.02, 0.9, 4), (0.05, 0.0, 8), (0.2, 0.9, 32)):
        add("teacher_cls", arch="cls", opt="sgd", lr=lr, momentum=mom, batch=b, decay="const", steps=500)
    add("teacher_cls", arch="cls", opt="adam", lr=3e-3, batch=8, decay="const", steps=500)
    # -- regression: to the floor at batch 256, and from a large loss at batch 32
    for opt, lr, b, dec in (("adamw", 1e-2, 256, "const"), ("adam", 3e-3, 256, "const"),
                            ("adamw", 1e-2, 32, "cos"), ("adam", 1e-2, 32, "const"),
                            ("sgd", 0.03, 256, "const"), ("adamw", 3e-2, 256, "const")):
        add("regression", arch="reg", opt=opt, lr=lr, batch=b, decay=dec, steps=1200, noise=0.25)
    # -- a loss that goes negative (Gaussian NLL with a learned variance)
    for opt, lr, b, noise in (("adamw", 3e-3, 64, 0.05), ("adam", 1e-2, 32, 0.1), ("adamw", 1e-3, 256, 0.02),
                              ("sgd", 0.01, 64, 0.05)):
        add("negative_loss", arch="nll", opt=opt, lr=lr, batch=b, decay="const", steps=800, noise=noise)
    # -- fine-tunes: pretrained on code, fine-tuned on English at batch 4, cosine to 10%
    for opt, lr, wu in (("adamw", 1e-3, 0), ("adamw", 3e-4, 10), ("adam", 1e-3, 20), ("sgd", 0.1, 0)):
        add("finetune", arch="gpt", opt=opt, lr=lr, warmup=wu, batch=4, text="en", pretrain=200)
    # -- a held-out architecture: the GRU language model under the same recipes
    for kw in ({"family": "sweep_wu", "lr": 0.3, "warmup": 150}, {"family": "sweep_wu", "lr": 1.0, "warmup": 150},
               {"family": "rewarm", "lr": 3e-3, "warmup": 50, "rewarm_at": 200, "rewarm_mult": 30.0},
               {"family": "pulse", "lr": 3e-3, "warmup": 50, "pulse_at": 200, "pulse_len": 3, "pulse_mult": 30.0},
               {"family": "badbatch", "lr": 1e-2, "warmup": 30, "bad_steps": (200,), "bad_kind": "repeat",
                "bad_scale": 1000.0},
               {"family": "ramp", "lr": 1e-4, "decay": "ramp", "lr_end": 3.0},
               {"family": "healthy", "lr": 3e-3, "warmup": 50}, {"family": "healthy", "lr": 1e-3, "warmup": 20, "batch": 4},
               {"family": "healthy", "lr": 3e-3, "warmup": 50, "fp16": True}):
        fam = kw.pop("family")
        s = RunSpec(name="", family="gru", arch="gru", opt="adamw", seed=next(seed), **kw)
        S.append(replace(s, name=_name(s).replace("gru_gru", f"gru_{fam}")))

    # -- more runs at the edges of stability (seeds from 2000: the runs above keep theirs)
    seed = iter(range(2000, 100000))
    for arch, opt, lr in (("gpt", "adamw", 0.1), ("gpt", "adamw", 0.2), ("gpt", "adamw", 0.3), ("gpt", "adam", 0.15),
                          ("mlp", "adam", 0.1), ("mlp", "adam", 0.3), ("gpt", "sgd", 0.5), ("gpt", "sgd", 0.7),
                          ("mlp", "sgd", 0.5), ("mlp", "sgd", 0.7)):
        add("sweep_nowu", arch=arch, opt=opt, lr=lr, decay="const")
    add("sweep_nowu", arch="gpt", opt="adamw", lr=0.1, decay="const", fp16=True)
    add("sweep_nowu", arch="gpt", opt="sgd", lr=0.5, text="en")
    for arch, opt, lr, wu in (("gpt", "adamw", 1.0, 150), ("gpt", "adamw", 0.7, 150), ("gpt", "adamw", 0.5, 150),
                              ("gpt", "adamw", 1.0, 300), ("gpt", "sgd", 1.5, 150), ("gpt", "sgd", 2.0, 150),
                              ("mlp", "sgd", 5.0, 150), ("mlp", "adam", 1.0, 150), ("gpt", "adam", 1.0, 200)):
        add("sweep_wu", arch=arch, opt=opt, lr=lr, warmup=wu)
    add("sweep_wu", arch="gpt", opt="sgd", lr=2.0, warmup=150, fp16=True)
    for arch, opt, peak, m in (("gpt", "adamw", 1e-2, 100.0), ("gpt", "adamw", 1e-2, 30.0), ("gpt", "adam", 3e-3, 300.0),
                               ("mlp", "adam", 1e-2, 30.0), ("gpt", "sgd", 0.3, 3.0), ("gpt", "sgd", 0.3, 5.0),
                               ("mlp", "sgd", 0.3, 5.0)):
        add("rewarm", arch=arch, opt=opt, lr=peak, warmup=50, rewarm_at=200, rewarm_mult=m)
    add("rewarm", arch="gpt", opt="sgd", lr=0.3, warmup=50, rewarm_at=200, rewarm_mult=5.0, fp16=True)
    for arch, opt, peak, m, ln in (("gpt", "adamw", 3e-3, 300.0, 3), ("gpt", "adamw", 3e-3, 1000.0, 1),
                                   ("gpt", "adam", 1e-2, 100.0, 3), ("mlp", "adam", 3e-3, 300.0, 3),
                                   ("gpt", "sgd", 0.3, 5.0, 3), ("gpt", "sgd", 0.3, 3.0, 5), ("mlp", "sgd", 0.3, 5.0, 3),
                                   ("mlp", "sgd", 0.3, 10.0, 1)):
        add("pulse", arch=arch, opt=opt, lr=peak, warmup=50, pulse_at=200, pulse_len=ln, pulse_mult=m)
    add("pulse", arch="gpt", opt="sgd", lr=0.3, warmup=50, pulse_at=200, pulse_len=3, pulse_mult=5.0, fp16=True)
    for arch, opt, lr, kind, scale, steps in (("gpt", "sgd", 0.3, "random", 3.0, (200,)),
                                              ("gpt", "sgd", 0.3, "repeat", 10.0, (200,)),
                                              ("mlp", "sgd", 0.3, "repeat", 10.0, (200,)),
                                              ("gpt", "adamw", 3e-2, "repeat", 1e4, (200, 201, 202)),
                                              ("mlp", "adam", 3e-2, "random", 1e4, (200, 201, 202)),
                                              ("gpt", "sgd", 0.1, "random", 30.0, (200,))):
        add("badbatch", arch=arch, opt=opt, lr=lr, warmup=30, bad_steps=steps, bad_kind=kind, bad_scale=scale)
    add("badbatch", arch="gpt", opt="sgd", lr=0.3, warmup=30, bad_steps=(200,), bad_kind="repeat",
        bad_scale=10.0, fp16=True)
    for arch, opt, lo, hi in (("mlp", "adam", 1e-3, 10.0), ("gpt", "sgd", 1e-3, 30.0), ("mlp", "sgd", 1e-3, 30.0),
                              ("gpt", "adam", 1e-4, 3.0)):
        add("ramp", arch=arch, opt=opt, lr=lo, decay="ramp", lr_end=hi)
    for arch, opt, lr, kw in (("gpt", "adamw", 2e-3, {"decay": "const", "text": "en"}), ("mlp", "sgd", 0.1, {}),
                              ("gpt", "sgd", 0.1, {"rewarm_at": 200, "rewarm_mult": 1.0}),
                              ("mlp", "adam", 3e-3, {"pulse_at": 200, "pulse_len": 2, "pulse_mult": 2.0}),
                              ("gpt", "adamw", 1e-3, {"fp16": True, "text": "en"}),
                              ("gpt", "adamw", 3e-3, {"bad_steps": (200,), "bad_kind": "random", "clip": 1.0})):
        add("healthy_lm", arch=arch, opt=opt, lr=lr, warmup=50, **kw)
    for arch, opt, lr, b in (("gpt", "adam", 2e-3, 4), ("mlp", "adamw", 3e-3, 4), ("gpt", "sgd", 0.05, 8)):
        add("small_batch", arch=arch, opt=opt, lr=lr, warmup=20, batch=b)
    for lr, b in ((0.05, 8), (0.1, 4)):
        add("teacher_cls", arch="cls", opt="sgd", lr=lr, momentum=0.9, batch=b, decay="const", steps=500)
    for opt, lr, b in (("adamw", 2e-2, 256), ("adam", 1e-2, 128)):
        add("regression", arch="reg", opt=opt, lr=lr, batch=b, decay="const", steps=1200, noise=0.25)
    for opt, lr, b, noise in (("adam", 3e-3, 16, 0.05), ("adamw", 1e-2, 128, 0.1)):
        add("negative_loss", arch="nll", opt=opt, lr=lr, batch=b, decay="const", steps=800, noise=noise)
    for opt, lr in (("adamw", 2e-3), ("sgd", 0.05)):
        add("finetune", arch="gpt", opt=opt, lr=lr, warmup=10, batch=4, text="en", pretrain=200)
    return S


# ----------------------------------------------------------------------------------------------
# data


def load_text(which: str, max_bytes: int = 2_000_000) -> np.ndarray:
    if which == "en":
        import pydoc_data.topics as topics

        raw = "".join(topics.topics[k] for k in sorted(topics.topics)).encode("ascii", "replace")
    else:
        paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        chunks, total = [], 0
        for p in paths:
            with open(p, "rb") as f:
                b = f.read()
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                break
        raw = b"".join(chunks)
    return (np.frombuffer(raw[:max_bytes], dtype=np.uint8) & 0x7F).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# models (kept here so the benchmark depends on nothing else in the repository)

CTX = 32  # context of the language models
MLP_CTX = 8  # the MLP LM sees the last 8 characters


def build_model(spec: RunSpec):
    import torch
    from torch import nn
    from torch.nn import functional as F

    d = spec.d_model

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(), nn.LayerNorm(d)
            self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(CTX, d)
            self.h = nn.ModuleList(Block() for _ in range(spec.n_layer))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.h:
                x = blk(x)
            return self.head(self.ln_f(x))

    class MLPLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, d)
            self.fc1, self.fc2 = nn.Linear(MLP_CTX * d, 4 * d), nn.Linear(4 * d, 4 * d)
            self.head = nn.Linear(4 * d, VOCAB)

        def forward(self, idx):  # (b, MLP_CTX) -> (b, VOCAB)
            x = self.wte(idx).flatten(1)
            return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))

    class GRULM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, d)
            self.rnn = nn.GRU(d, 2 * d, batch_first=True)
            self.head = nn.Linear(2 * d, VOCAB)

        def forward(self, idx):
            return self.head(self.rnn(self.wte(idx))[0])

    class Student(nn.Module):
        def __init__(self, n_in: int, n_out: int):
            super().__init__()
            self.fc1, self.fc2, self.head = nn.Linear(n_in, 64), nn.Linear(64, 64), nn.Linear(64, n_out)

        def forward(self, x):
            return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))

    if spec.arch == "gpt":
        return GPT()
    if spec.arch == "mlp":
        return MLPLM()
    if spec.arch == "gru":
        return GRULM()
    return Student(N_IN, {"cls": N_CLASSES, "reg": 1, "nll": 2}[spec.arch])


N_IN, N_CLASSES = 16, 10


def module_groups(model) -> tuple[list[str], list[list]]:
    """Parameters grouped by the module that owns them, in backward order (last module first)."""
    names, groups = [], []
    for mname, mod in model.named_modules():
        params = [p for p in mod.parameters(recurse=False)]
        if params:
            names.append(mname)
            groups.append(params)
    return names[::-1], groups[::-1]


def lr_at(spec: RunSpec, step: int) -> float:
    T, peak = spec.steps, spec.lr
    if spec.decay == "ramp":
        return peak * (spec.lr_end / peak) ** (step / max(1, T - 1))
    if spec.warmup and step < spec.warmup:
        lr = peak * (step + 1) / spec.warmup
    elif spec.decay == "const":
        lr = peak
    else:
        end = spec.rewarm_at if spec.rewarm_at >= 0 else T
        frac = min(1.0, (step - spec.warmup) / max(1, end - spec.warmup))
        lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        if spec.rewarm_at >= 0 and step >= spec.rewarm_at:
            top = peak * spec.rewarm_mult
            lr = 0.1 * peak + (top - 0.1 * peak) * min(1.0, (step - spec.rewarm_at + 1) / spec.rewarm_len)
    if spec.pulse_at >= 0 and spec.pulse_at <= step < spec.pulse_at + spec.pulse_len:
        lr *= spec.pulse_mult
    return lr


class Data:
    """Batches for one run (its own RNG: the same spec gives the same batches)."""

    def __init__(self, spec: RunSpec, texts: dict):
        import torch

        self.spec, self.rng = spec, np.random.default_rng(spec.seed)
        self.text = texts.get(spec.text)
        if spec.arch in ("cls", "reg", "nll"):
            g = torch.Generator().manual_seed(spec.seed + 7)
            n_out = N_CLASSES if spec.arch == "cls" else 1
            self.w1 = torch.randn(N_IN, 32, generator=g) / math.sqrt(N_IN)
            self.w2 = torch.randn(32, n_out, generator=g) * (3.0 if spec.arch == "cls" else 2.0) / math.sqrt(32)

    def lm(self, text: np.ndarray, bad: bool):
        import torch

        s, rng = self.spec, self.rng
        ctx = MLP_CTX if s.arch == "mlp" else CTX
        b = s.batch * (8 if s.arch == "mlp" else 1)  # the MLP LM predicts one char per window
        if bad and s.bad_kind == "random":
            xy = rng.integers(0, VOCAB, size=(b, ctx + 1))
        elif bad and s.bad_kind == "repeat":
            xy = np.full((b, ctx + 1), int(rng.integers(32, 127)))
        else:
            starts = rng.integers(0, len(text) - ctx - 1, size=b)
            xy = np.stack([text[i:i + ctx + 1] for i in starts])
        xy = torch.from_numpy(xy)
        if s.arch == "mlp":
            return xy[:, :-1], xy[:, -1]
        return xy[:, :-1], xy[:, 1:]

    def student(self, bad: bool):
        import torch

        s = self.spec
        x = torch.from_numpy(self.rng.standard_normal((s.batch, N_IN)).astype(np.float32))
        t = torch.tanh(x @ self.w1) @ self.w2
        if s.arch == "cls":
            u = torch.from_numpy(self.rng.random((s.batch, N_CLASSES)).astype(np.float32))
            y = (2.0 * t - torch.log(-torch.log(u.clamp_min(1e-9)))).argmax(1)  # sampled from softmax(2t)
            if bad:
                y = torch.from_numpy(self.rng.integers(0, N_CLASSES, s.batch))
            return x, y
        noise = torch.from_numpy(self.rng.standard_normal((s.batch, 1)).astype(np.float32))
        y = (3.0 if s.arch == "reg" else 1.0) * t + s.noise * noise
        if bad:
            y = y[torch.randperm(s.batch)] * 10
        return x, y


def loss_fn(spec: RunSpec, model, x, y):
    import torch
    from torch.nn import functional as F

    out = model(x)
    if spec.arch in ("gpt", "gru", "mlp"):
        return F.cross_entropy(out.reshape(-1, VOCAB).float(), y.reshape(-1))
    if spec.arch == "cls":
        return F.cross_entropy(out.float(), y)
    if spec.arch == "reg":
        return F.mse_loss(out.float(), y)
    mu, logvar = out.float()[:, :1], out.float()[:, 1:].clamp(-12, 12)
    return (0.5 * (logvar + (y - mu) ** 2 * torch.exp(-logvar)) + 0.5 * math.log(2 * math.pi)).mean()


def make_optimizer(spec: RunSpec, model):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1 if spec.opt == "adamw" else 0.0},
              {"params": no_decay, "weight_decay": 0.0}]
    if spec.opt == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)
    cls = torch.optim.AdamW if spec.opt == "adamw" else torch.optim.Adam
    return cls(groups, lr=spec.lr, betas=(0.9, spec.beta2), eps=1e-8, foreach=True)


# ----------------------------------------------------------------------------------------------
# training


def train_run(spec: RunSpec, texts: dict) -> dict:
    import torch

    torch.manual_seed(spec.seed)
    model = build_model(spec)
    data = Data(spec, texts)
    lm = spec.arch in ("gpt", "mlp", "gru")
    if spec.pretrain:  # a pretrained model: trained on the other text first, not logged
        pre = replace(spec, opt="adamw", lr=3e-3, batch=16, fp16=False)
        popt = make_optimizer(pre, model)
        pdata = Data(pre, texts)
        other = texts["py" if spec.text == "en" else "en"]
        for _ in range(spec.pretrain):
            x, y = pdata.lm(other, False)
            popt.zero_grad(set_to_none=True)
            loss_fn(pre, model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            popt.step()
    names, groups = module_groups(model)
    opt = make_optimizer(spec, model)
    flat = [p for g in groups for p in g]
    group_index = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([len(g) for g in groups]))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if spec.fp16 else None
    adam = spec.opt in ("adam", "adamw")
    beta2 = spec.beta2

    T, L = spec.steps, len(names)
    cols = {k: np.full(T, np.nan) for k in ("loss", "grad_norm", "lr", "update_norm", "param_norm",
                                            "gv", "gv_max", "loss_scale")}
    cols["skipped"] = np.zeros(T, dtype=np.uint8)
    layer = np.full((T, L), np.nan, dtype=np.float32)
    layer_nf = np.zeros((T, L), dtype=np.uint8)
    numel = torch.tensor([float(sum(p.numel() for p in g)) for g in groups], dtype=torch.float64)
    diverged_for = overflows = 0
    last = T
    for step in range(T):
        lr = lr_at(spec, step)
        for g in opt.param_groups:
            g["lr"] = lr
        cols["lr"][step] = lr
        bad = step in spec.bad_steps
        x, y = data.lm(data.text, bad) if lm else data.student(bad)
        with torch.autocast("cpu", dtype=torch.float16, enabled=spec.fp16):
            loss = loss_fn(spec, model, x, y)
        total = loss * (spec.bad_scale if bad else 1.0)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            cols["loss_scale"][step] = scaler.get_scale()
            scaler.scale(total).backward()
            scaler.unscale_(opt)
        else:
            total.backward()
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in flat]
            sq = torch.stack(torch._foreach_norm(grads)).double().square()
            per_group = torch.zeros(L, dtype=torch.float64).index_add_(0, group_index, sq)
            cols["loss"][step] = float(loss.detach())  # the unscaled loss is what a logger shows
            cols["grad_norm"][step] = float(per_group.sum().sqrt())
            layer[step] = per_group.sqrt().numpy()
            layer_nf[step] = ~np.isfinite(layer[step])
            before = [p.detach().clone() for p in flat]
            cols["param_norm"][step] = float(torch.stack(torch._foreach_norm(before)).double().square().sum().sqrt())
            if adam and step > 0:
                # this step's g^2 over the second moment the optimizer holds from the step before
                v_sum = torch.zeros(L, dtype=torch.float64)
                for i, p in enumerate(flat):
                    st = opt.state.get(p, {})
                    if "exp_avg_sq" in st:
                        k = float(st["step"])
                        v_sum[group_index[i]] += float(st["exp_avg_sq"].double().sum()) / (1 - beta2 ** k)
                ratio = per_group / v_sum.clamp_min(1e-300)
                cols["gv"][step] = float(per_group.sum() / v_sum.sum().clamp_min(1e-300))
                cols["gv_max"][step] = float(ratio[numel > 0].max())
        if not math.isfinite(cols["loss"][step]):
            last = step + 1
            break
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        if scaler is not None:
            scale0 = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < scale0
            cols["skipped"][step] = skipped
            overflows = overflows + 1 if skipped else 0
        elif not math.isfinite(cols["grad_norm"][step]):
            last = step + 1  # a non-finite gradient without a scaler poisons the optimizer
            break
        else:
            opt.step()
        with torch.no_grad():
            delta = torch._foreach_sub([p.detach() for p in flat], before)
            cols["update_norm"][step] = float(torch.stack(torch._foreach_norm(delta)).double().square().sum().sqrt())
        # stop a run that has clearly collapsed (nothing is left to detect after that)
        hist = cols["loss"][max(0, step - 100):max(1, step - 20)]
        base = np.nanmedian(hist) if step > 40 else np.inf
        up = cols["loss"][step] - base > 0.5 * abs(base) if math.isfinite(base) else False
        diverged_for = diverged_for + 1 if up else 0
        if diverged_for >= 40 or overflows >= 30:
            last = step + 1
            break
    out = {k: v[:last] for k, v in cols.items()}
    out.update(layer_norms=layer[:last], layer_nonfinite=layer_nf[:last], layer_names=np.array(names))
    return out


@dataclass
class RunLog:
    """One cached run: per-step arrays (steps are 0..n-1)."""

    spec: RunSpec
    cols: dict

    @property
    def name(self) -> str:
        return self.spec.name

    def __getattr__(self, key):
        try:
            return self.__dict__["cols"][key]
        except KeyError:
            raise AttributeError(key) from None

    @property
    def layer_names_tuple(self) -> tuple[str, ...]:
        return tuple(str(n) for n in self.cols["layer_names"])


def _spec_json(spec: RunSpec) -> str:
    d = asdict(spec)
    d["bad_steps"] = list(d["bad_steps"])
    return json.dumps(d, sort_keys=True)


def load_corpus(regenerate: bool = False, only: str | None = None, verbose: bool = True) -> list[RunLog]:
    """All runs of :func:`run_specs`, training (and caching) any that are missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    specs = [s for s in run_specs() if only is None or only in s.name]
    texts: dict | None = None
    runs = []
    t_all = time.perf_counter()
    for spec in specs:
        path = CACHE / f"{spec.name}.npz"
        d = None
        if path.exists() and not regenerate:
            with np.load(path, allow_pickle=False) as z:
                if str(z["spec"]) == _spec_json(spec):
                    d = {k: z[k] for k in z.files if k != "spec"}
        if d is None:
            import torch

            torch.set_num_threads(1)
            if texts is None:
                texts = {"py": load_text("py"), "en": load_text("en")}
            t0 = time.perf_counter()
            d = train_run(spec, texts)
            tmp = path.with_suffix(".tmp.npz")
            np.savez_compressed(tmp, spec=_spec_json(spec), **d)
            os.replace(tmp, path)
            if verbose:
                print(f"  trained {spec.name}: {len(d['loss'])} steps in {time.perf_counter() - t0:.1f}s, "
                      f"loss {d['loss'][0]:.3f} -> {d['loss'][-1]:.3f}", file=sys.stderr, flush=True)
        runs.append(RunLog(spec, d))
    if verbose and texts is not None:
        print(f"corpus generated in {time.perf_counter() - t_all:.0f}s", file=sys.stderr)
    return runs


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regenerate", action="store_true", help="retrain even when cached")
    ap.add_argument("--only", default=None, help="only runs whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the specs, train nothing")
    a = ap.parse_args()
    if a.list:
        for s in run_specs():
            print(s.name)
        print(len(run_specs()), "runs")
        raise SystemExit(0)
    for r in load_corpus(a.regenerate, a.only):
        print(f"{r.name:60s} steps={len(r.loss):4d} loss {r.loss[0]:.2f} -> {r.loss[-1]:.2f} "
              f"gn median {np.nanmedian(r.grad_norm):.3f} max {np.nanmax(r.grad_norm):.3g}")
