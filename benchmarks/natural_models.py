"""The natural-instability benchmark's models and tasks (benchmarks/natural.py).

Two kinds of model whose too-high learning rate degrades the run by its own dynamics:

* ``chargpt``: a pre-LayerNorm character GPT on the Python standard library's source (the text
  examples/tinygpt.py and the demo train on), no qk-norm -- Wortsman et al. 2023's small proxy.
* ``vit``: a ViT-style classifier (4x4 patches, a class token, the same blocks without the causal
  mask) on synthetic 16x16 images: a smooth template per class, shifted, rescaled, in noise.

``qk_layernorm`` (LayerNorm of each head's queries and keys) and ``z_loss`` (PaLM's
``1e-4 * logsumexp(logits)^2``) are the model-side fixes, for both. Every attention block keeps
its largest attention logit (q.k / sqrt(d) over the positions it attends to) of the last forward
pass as a 0-d tensor: what the benchmark records per step, computed on the logits the softmax
needs anyway (no extra forward).

Every batch is a pure function of (seed, step): every method sees the same data at the same step.
A seed changes the initialisation and the batches drawn, not the task: the templates and the
held-out set are the same for every seed.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rescue_tasks import _corpus, gen  # noqa: E402

Z_LOSS = 1e-4  # PaLM's z-loss coefficient (Wortsman et al. 2023 use the same)


class Block(nn.Module):
    """Pre-LayerNorm transformer block; attention written out so its logits can be read."""

    def __init__(self, d: int, heads: int, causal: bool, qk_layernorm: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)  # q, k, v stacked: rows [0, d) are q, [d, 2d) are k
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.q_ln = nn.LayerNorm(d // heads) if qk_layernorm else nn.Identity()
        self.k_ln = nn.LayerNorm(d // heads) if qk_layernorm else nn.Identity()
        self.logit_max = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = self.attn(self.ln_1(x)).split(C, dim=2)
        q = self.q_ln(q.view(B, T, self.heads, hd)).transpose(1, 2)
        k = self.k_ln(k.view(B, T, self.heads, hd)).transpose(1, 2)
        v = v.view(B, T, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if self.causal:
            att = att.masked_fill(_causal_mask(T), -math.inf)
        self.logit_max = att.detach().amax()
        y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


@functools.lru_cache(maxsize=8)
def _causal_mask(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).triu(1)


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, d: int, block: int, qk_layernorm: bool, vocab: int = 128):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, True, qk_layernorm) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class ViT(nn.Module):
    def __init__(self, layers: int, heads: int, d: int, image: int, patch: int, classes: int, qk_layernorm: bool):
        super().__init__()
        self.patch = patch
        n = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, d))
        self.blocks = nn.ModuleList(Block(d, heads, False, qk_layernorm) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes, bias=False)
        self.apply(_init)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        p = self.patch
        x = img.unfold(1, p, p).unfold(2, p, p).reshape(img.shape[0], -1, p * p)  # (B, patches, p*p)
        x = torch.cat([self.cls.expand(len(x), -1, -1), self.embed(x)], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x[:, 0]))


class Task:
    """A model, its data stream and a fixed held-out set. ``loss`` returns (the loss to train on,
    the cross-entropy alone, the output logits detached); ``attention_blocks`` and
    ``qk_weights``/``head_weight`` name what the benchmark records."""

    eval_batch: dict
    clip = None  # no clip_grad_norm_ in the loop (rescue_peers' methods read it)

    def __init__(self, cfg: dict, seed: int, z_loss: bool):
        self.cfg, self.seed, self.z_loss = cfg, seed, z_loss
        self.model: nn.Module

    @property
    def models(self) -> list[nn.Module]:
        return [self.model]

    def params(self, k: int = 0) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def batch(self, it: int) -> dict:
        raise NotImplementedError

    def logits_targets(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, y = self.logits_targets(batch)
        ce = F.cross_entropy(logits, y)
        total = ce + Z_LOSS * torch.logsumexp(logits, -1).square().mean() if self.z_loss else ce
        return total, ce.detach(), logits.detach()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        try:
            logits, y = self.logits_targets(self.eval_batch)
            return float(F.cross_entropy(logits, y))
        finally:
            self.model.train()

    def attention_blocks(self) -> list[Block]:
        return list(self.model.blocks)

    def qk_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block, (the query projection's weight, the key projection's weight), views."""
        return [(b.attn.weight[:b.attn.in_features], b.attn.weight[b.attn.in_features:2 * b.attn.in_features])
                for b in self.model.blocks]

    def head_weight(self) -> torch.Tensor:
        return self.model.head.weight


class CharGPT(Task):
    """The stdlib's source (the first 90% to train, batches of random windows; eval: ``eval_n``
    fixed windows of the last 10%)."""

    def __init__(self, cfg: dict, seed: int, z_loss: bool, qk_layernorm: bool):
        super().__init__(cfg, seed, z_loss)
        data = _corpus()
        cut = int(len(data) * 0.9)
        self.train_data, self.eval_data = data[:cut], data[cut:]
        torch.manual_seed(seed)
        self.model = GPT(cfg["layers"], cfg["heads"], cfg["embd"], cfg["block"], qk_layernorm)
        self.eval_batch = self._windows(self.eval_data, gen("eval"), cfg["eval_n"])

    def _windows(self, data: torch.Tensor, g: torch.Generator, n: int) -> dict:
        ix = torch.randint(0, len(data) - self.cfg["block"] - 1, (n,), generator=g)
        chunk = data[ix[:, None] + torch.arange(self.cfg["block"] + 1)]
        return {"x": chunk[:, :-1], "y": chunk[:, 1:]}

    def batch(self, it):
        return self._windows(self.train_data, gen(self.seed, "train", it), self.cfg["batch"])

    def logits_targets(self, batch):
        logits = self.model(batch["x"])
        return logits.reshape(-1, logits.size(-1)), batch["y"].reshape(-1)


class ImageViT(Task):
    """16x16 images: a smooth random template per class (the same for every seed), rolled by up to
    ``shift`` pixels each way, its contrast scaled by U(0.5, 1.5), plus N(0, noise) pixels."""

    def __init__(self, cfg: dict, seed: int, z_loss: bool, qk_layernorm: bool):
        super().__init__(cfg, seed, z_loss)
        t = torch.randn(cfg["classes"], 1, 20, 20, generator=gen("templates"))
        t = F.avg_pool2d(t, 5, stride=1, padding=2)[:, 0, 2:18, 2:18]
        self.templates = t / t.flatten(1).std(1).view(-1, 1, 1)
        torch.manual_seed(seed)
        self.model = ViT(cfg["layers"], cfg["heads"], cfg["embd"], 16, cfg["patch"], cfg["classes"], qk_layernorm)
        self.eval_batch = self._images(gen("eval"), cfg["eval_n"])

    def _images(self, g: torch.Generator, n: int) -> dict:
        s = self.cfg["shift"]
        y = torch.randint(0, self.cfg["classes"], (n,), generator=g)
        shifts = torch.randint(-s, s + 1, (n, 2), generator=g)
        rows = (torch.arange(16)[None, :] - shifts[:, :1]) % 16  # a roll per sample, by gather
        cols = (torch.arange(16)[None, :] - shifts[:, 1:]) % 16
        x = self.templates[y][torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
        x = x * (0.5 + torch.rand(n, 1, 1, generator=g)) + self.cfg["noise"] * torch.randn(n, 16, 16, generator=g)
        return {"x": x, "y": y}

    def batch(self, it):
        return self._images(gen(self.seed, "train", it), self.cfg["batch"])

    def logits_targets(self, batch):
        return self.model(batch["x"]), batch["y"]


TASKS = {"chargpt": CharGPT, "vit": ImageViT}


def make_task(config: dict, *, qk_layernorm: bool = False, z_loss: bool = False) -> Task:
    spec = config["task"]
    return TASKS[spec["name"]](spec, config["seed"], z_loss, qk_layernorm)
