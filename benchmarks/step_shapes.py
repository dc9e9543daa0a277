"""The model shapes the per-step overhead is measured on (``benchmarks/overhead.py``).

Each ``make_<shape>(seed)`` returns ``(model, optimizer, loss_of)``: ``loss_of(i)`` runs the forward
pass of step ``i`` on fixed, pre-drawn data and returns the loss. Every shape runs with one torch
thread; step times are those of this project's 2-core CPU machines.

- ``small``: 291 small tensors (145 residual ``Linear(8, 8)`` blocks and a head), compute
  negligible, AdamW(foreach=True): what earlywarn pays per tensor, against one ``clip_grad_norm_``.
- ``gpt``: the fast step of ``examples/tinygpt.py`` (2 layers, d=128, batch 8 x 64, fused AdamW, ~18 ms).
- ``lora``: peft LoRA (r=4 on q/v, 3.6k trainable parameters) on a Llama of 0.86M frozen ones (~14 ms).
- ``tinylm``: what a user tries first: ``nn.TransformerEncoder`` (2 layers, d=128) between an
  embedding and a head, plain AdamW (~15 ms).
- ``cnn``: a small ResNet with BatchNorm (buffers in every snapshot) on 32x32 images, SGD with
  Nesterov momentum (~15 ms).
- ``moe``: a mixture of experts whose idle experts -- parameters without a gradient -- change from
  step to step (top-1 routing of 8 tokens over 8 experts in each of 4 layers, ~15 ms).
- ``moe_wide``: the same at 32 experts in each of 8 layers, 16 tokens (522 layers, 1043 tensors,
  ~45 ms): hundreds of noisy layers. Not in the table's default shapes (``--shapes moe_wide``).

Three more kinds of model, none of which any change was tuned on, for measuring "other model shapes
the same way" (not in the default shapes either: ``--shapes vit,unet,gru``; they need timm and
diffusers, which ``scripts/setup.sh`` installs):

- ``vit``: a timm ViT (4 blocks, d=96, 4x4 patches) classifying 32x32 images, AdamW (56 tensors, ~40 ms).
- ``unet``: a diffusers ``UNet2DModel`` with attention blocks denoising 16x16 images, AdamW (144
  tensors, ~35 ms).
- ``gru``: a 2-layer GRU language model, RMSprop (11 tensors, ~22 ms): few large tensors.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tinygpt import GPT, GPTConfig  # noqa: E402

Shape = tuple[nn.Module, torch.optim.Optimizer, Callable[[int], torch.Tensor]]


class ResidualStack(nn.Module):
    """291 small tensors: 145 residual ``Linear(8, 8)`` blocks and a bias-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(145))
        self.head = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + 0.1 * torch.tanh(b(x))
        return self.head(x)


def make_small(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    model = ResidualStack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)) for _ in range(256)]
    return model, opt, lambda i: F.mse_loss(model(data[i % 256][0]), data[i % 256][1])


def make_gpt(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 128, (8, 64), generator=g), torch.randint(0, 128, (8, 64), generator=g))
            for _ in range(16)]
    return model, opt, lambda i: model(*data[i % 16])[1]


def make_lora(seed: int = 0) -> Shape:
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=112, intermediate_size=448, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 2048, (4, 65), generator=g) for _ in range(16)]
    return model, opt, lambda i: model(input_ids=data[i % 16][:, :-1], labels=data[i % 16][:, 1:]).loss


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(self.emb(x), mask=mask, is_causal=True))


def _next_token(model: nn.Module, lr: float, shape: tuple[int, int], batches: int, *,
                optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW) -> Shape:
    """``optimizer`` (AdamW) on next-token prediction over 256 symbols, ``batches`` fixed batches of ``shape``."""
    opt = optimizer(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, shape, generator=g) for _ in range(batches)]

    def loss_of(i: int) -> torch.Tensor:
        x = data[i % batches]
        return F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
    return model, opt, loss_of


def make_tinylm(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    return _next_token(TinyLM(), 3e-4, (4, 65), 16)


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.skip(x))


def make_cnn(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          _Block(16, 16, 1), _Block(16, 32, 2), _Block(32, 64, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(16)]
    return model, opt, lambda i: F.cross_entropy(model(data[i % 16][0]), data[i % 16][1])


class MoE(nn.Module):
    """A mixture of experts: top-1 routing over 8 experts in each of 4 layers, 8 tokens a batch,
    so that some experts get no token -- and their parameters no gradient -- at a step, and
    which ones changes from step to step (139 tensors)."""

    def __init__(self, d: int = 64, experts: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.gates = nn.ModuleList(nn.Linear(d, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts))
            for _ in range(layers))
        self.head = nn.Linear(d, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for gate, experts in zip(self.gates, self.experts):
            choice = gate(h).argmax(-1)
            out = torch.zeros_like(h)
            for e, expert in enumerate(experts):
                chosen = choice == e
                if chosen.any():
                    out[chosen] = expert(h[chosen])
            h = h + out
        return self.head(h)


def make_moe(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    return _next_token(MoE(), 1e-3, (1, 9), 64)


def make_moe_wide(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    return _next_token(MoE(d=32, experts=32, layers=8), 1e-3, (1, 17), 64)


def make_vit(seed: int = 0) -> Shape:
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10,
                              depth=4, embed_dim=96, num_heads=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(16)]
    return model, opt, lambda i: F.cross_entropy(model(data[i % 16][0]), data[i % 16][1])


def make_unet(seed: int = 0) -> Shape:
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                        norm_num_groups=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 1000, (4,), generator=g)) for _ in range(16)]
    return model, opt, lambda i: F.mse_loss(model(*data[i % 16]).sample, data[i % 16][0])


class GRULM(nn.Module):
    """A 2-layer GRU between an embedding and a head: 11 tensors, most of them large."""

    def __init__(self, d: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.rnn = nn.GRU(d, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


def make_gru(seed: int = 0) -> Shape:
    torch.manual_seed(seed)
    return _next_token(GRULM(), 1e-3, (8, 33), 16, optimizer=torch.optim.RMSprop)


SHAPES: dict[str, Callable[[int], Shape]] = {
    "small": make_small, "gpt": make_gpt, "lora": make_lora, "tinylm": make_tinylm, "cnn": make_cnn,
    "moe": make_moe, "moe_wide": make_moe_wide, "vit": make_vit, "unet": make_unet, "gru": make_gru}
