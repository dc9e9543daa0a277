"""A small character-level GPT and a real-text dataset (the Python standard library's own source).

Shared by the examples, the benchmarks and the end-to-end tests: real text, real training, no
downloads. Reads top to bottom, nanoGPT style.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 128  # ASCII; other characters map to 0
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    qk_layernorm: bool = False  # Wortsman et al. 2023: without it, attention logits blow up at high LR


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        head = cfg.n_embd // cfg.n_head
        self.q_ln = nn.LayerNorm(head) if cfg.qk_layernorm else nn.Identity()
        self.k_ln = nn.LayerNorm(head) if cfg.qk_layernorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(C, dim=2)
        q = self.q_ln(q.view(B, T, self.n_head, C // self.n_head)).transpose(1, 2)
        k = self.k_ln(k.view(B, T, self.n_head, C // self.n_head)).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def stdlib_text(max_bytes: int = 2_000_000) -> str:
    """Real text with no download: the standard library's .py files, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError):
                continue
            parts.append(text)
            total += len(text)
            if total >= max_bytes:
                return "".join(parts)[:max_bytes]
    return "".join(parts)


class CharDataset(torch.utils.data.Dataset):
    """Fixed, non-overlapping windows of ``block_size + 1`` characters: sample i is always the same."""

    def __init__(self, text: str, block_size: int = 256):
        data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
        self.block_size = block_size
        self.n = (len(data) - 1) // block_size
        self.data = data[: self.n * block_size + 1]
        self.fingerprint = hashlib.sha256(text[:100_000].encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def cosine_lr(step: int, *, base: float, warmup: int, total: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * 0.5 * (1 + math.cos(math.pi * progress))
