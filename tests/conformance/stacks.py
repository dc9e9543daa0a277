"""Training code a new user brings (issue 46), each with ``earlywarn.watch`` added the way its docs
say: torchao's low-bit AdamW (quantized moments as tensor subclasses), bitsandbytes' 8-bit Adam
(a ``state_dict()`` that nests its quantization state) and its paged variant, transformers'
Adafactor (relative step and a fixed LR), a Mixtral MoE with its router loss, Mamba, accelerate
with gradient accumulation and its ``clip_grad_norm_``, bf16 autocast, bf16 weights, ``SparseAdam``
on a sparse embedding, and a compiled, checkpointed, weight-tied LM. Tiny configs built in code,
no downloads; CPU only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from codebases import VOCAB, _plain_loop, lm_batches
from ecosystem import TinyLM, _lm_loss, _regression
from harness import CellResult, Fault, Injector


class WideMLP(nn.Module):
    """An MLP whose hidden weight (128 x 64) is large enough for the 8-bit and 4-bit optimizers to
    quantize its moments (they keep tensors under 4096 elements in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.hidden = nn.Linear(64, 128)
        self.out = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def _mse(m: nn.Module, b: Any) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


# ------------------------------------------------------------------------------ low-bit optimizers
def _torchao(bits: int) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if bits == 8 else AdamW4bit)(params, lr=3e-3)
    return make


def _bnb(paged: bool) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        # (on a CPU the paged one falls back to the plain one at its first step, with a UserWarning)
        return (bnb.optim.PagedAdam8bit if paged else bnb.optim.Adam8bit)(params, lr=3e-3)
    return make


def _adafactor(relative_step: bool) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        from transformers.optimization import Adafactor

        if relative_step:  # its own schedule: lr=None, warm-up init, parameter scaling
            return Adafactor(params, lr=None, relative_step=True, scale_parameter=True, warmup_init=True)
        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)
    return make


LOW_BIT: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "torchao_adamw8bit": _torchao(8),
    "torchao_adamw4bit": _torchao(4),
    "bnb_adam8bit": _bnb(False),
    "bnb_paged_adam8bit": _bnb(True),
    "adafactor_relative_step": _adafactor(True),
    "adafactor_fixed_lr": _adafactor(False),
}


def low_bit(name: str, fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """A regression MLP under an optimizer whose state is not torch.optim's (the poisoned weight:
    the one whose moments are quantized)."""
    torch.manual_seed(0)
    model = WideMLP()
    opt = LOW_BIT[name](model.parameters())
    return _plain_loop(name, fault, model, opt, model.hidden.weight, model.inp, _regression(steps), _mse, options)


# ------------------------------------------------------------------------------ transformers models
def _hf_lm(kind: str) -> tuple[nn.Module, torch.Tensor, nn.Module]:
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
                                         router_aux_loss_coef=0.02)
        model = transformers.MixtralForCausalLM(cfg)
        return model, model.model.layers[0].self_attn.q_proj.weight, model.model.embed_tokens
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, use_cache=False)
    model = transformers.MambaForCausalLM(cfg)
    return model, model.backbone.layers[0].mixer.in_proj.weight, model.backbone.embeddings


def hf_lm(kind: str, fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """Mixtral (its loss includes the router's load-balancing loss: ``output_router_logits``) and
    Mamba (the sequential scan: no CUDA kernels on a CPU), in a plain loop."""
    torch.manual_seed(0)
    model, param, emb = _hf_lm(kind)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(input_ids=b[:, :-1], labels=b[:, :-1])
        if kind == "mixtral":
            assert out.aux_loss is not None  # the router loss is part of out.loss
        return out.loss

    return _plain_loop(f"{kind}_lm", fault, model, opt, param, emb, lm_batches(steps, 4, 16, seed=21), loss_fn, options)


# ------------------------------------------------------------------------------ accelerate
def accelerate_accumulation(fault: Fault, options: dict[str, Any], steps: int = 30, accum: int = 2) -> CellResult:
    """accelerate's loop with ``gradient_accumulation_steps`` and ``accelerator.clip_grad_norm_``
    on the syncing micro-batch, watched with ``watch_accelerated`` after ``prepare``."""
    import accelerate
    from accelerate.utils import GradientAccumulationPlugin
    from earlywarn.integrations.accelerate_support import watch_accelerated

    plugin = GradientAccumulationPlugin(num_steps=accum, sync_with_dataloader=False)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    torch.manual_seed(0)
    model = WideMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    raw = model
    model, opt = accelerator.prepare(model, opt)
    inj = Injector(fault, model=raw, param=raw.hidden.weight, input_module=raw.inp, optimizer=lambda: opt.optimizer,
                   accum=accum)
    data = _regression(steps * accum, seed=6)
    w, exc = None, None
    try:
        w = watch_accelerated(accelerator, model, opt, **options)
        for b in data:
            with accelerator.accumulate(model):
                loss = _mse(model, b)
                w.report_loss(loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - Halt included: the invariants report it
        exc = e
    finally:
        if w is not None:
            w.close()
    inj.remove()
    return CellResult("accelerate_accumulation", fault, list(w.events) if w else [], dict(w.counters) if w else {},
                      exc, inj, raw, opt.optimizer, [])


# ------------------------------------------------------------------------------ precision, sparse, compile
def bf16(kind: str, fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """``bf16_autocast``: float32 weights, the forward under ``torch.autocast("cpu", bfloat16)``;
    ``bf16_weights``: the model and its AdamW state in bfloat16."""
    torch.manual_seed(0)
    lm = TinyLM()
    if kind == "bf16_weights":
        lm = lm.to(torch.bfloat16)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16_autocast"):
            return _lm_loss(m, b).float()

    return _plain_loop(kind, fault, lm, opt, lm.blocks[0][1].weight, lm.emb, lm_batches(steps, 8, 16, seed=22), loss_fn,
                       options)


class SkipGram(nn.Module):
    """word2vec's skip-gram with negative sampling: two sparse embeddings (``sparse=True``: their
    gradients are sparse COO tensors), nothing dense."""

    def __init__(self) -> None:
        super().__init__()
        self.center = nn.Embedding(VOCAB, 32, sparse=True)
        self.context = nn.Embedding(VOCAB, 32, sparse=True)

    def forward(self, b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        c, o, neg = b
        v = self.center(c)
        pos = (v * self.context(o)).sum(-1)
        negs = torch.einsum("bd,bkd->bk", v, self.context(neg))
        return -(F.logsigmoid(pos).mean() + F.logsigmoid(-negs).mean())


def sparse_adam(fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """``SparseAdam`` over both sparse embeddings."""
    torch.manual_seed(0)
    model = SkipGram()
    opt = torch.optim.SparseAdam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(23)
    data = [(b[:, :-1].reshape(-1), b[:, 1:].reshape(-1), torch.randint(0, VOCAB, (b[:, 1:].numel(), 4), generator=g))
            for b in lm_batches(steps, 8, 16, seed=23)]
    return _plain_loop("sparse_adam", fault, model, opt, model.center.weight, model.center, data,
                       lambda m, b: m(b), options)


def compiled_checkpointed_tied(fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """TinyLM with tied embeddings and activation checkpointing, under ``torch.compile`` (dynamo
    and AOT autograd; inductor's C++ build would add a minute per cell without changing what
    earlywarn sees)."""
    torch.manual_seed(0)
    lm = TinyLM(tie=True, checkpoint=True)
    model = torch.compile(lm, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return _plain_loop("compile_checkpoint_tied", fault, model, opt, lm.head.weight, lm.emb,
                       lm_batches(steps, 8, 16, seed=24), _lm_loss, options)
