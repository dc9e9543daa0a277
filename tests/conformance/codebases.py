"""Training code earlywarn did not write, each with ``earlywarn.watch`` added the way its docs say.

Each runner trains for a few dozen steps with one :class:`~harness.Fault` and returns a
:class:`~harness.CellResult`. The loops are written the way their authors write them: the
Hugging Face models in a plain loop and under ``transformers.Trainer``; a Lightning LM on
``nn.TransformerEncoder`` with a float causal mask buffer; torchvision's ResNet-18 (BatchNorm);
a nanoGPT-style loop (batches drawn with the global torch RNG, the LR computed from the loop's own
``iter_num``, ``clip_grad_norm_``, a ``GradScaler`` with fp16 autocast, gradient accumulation).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import earlywarn
from harness import CellResult, Fault, Injector, guarded_run
from thirdparty import import_torchvision, text_tokens

VOCAB = 128


def lm_batches(n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    data = text_tokens()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (n, batch), generator=g)
    return [torch.stack([data[s:s + seq + 1] for s in row.tolist()]) for row in starts]


def _finish(codebase: str, fault: Fault, w: earlywarn.Watcher | None, inj: Injector, model: nn.Module,
            opt: torch.optim.Optimizer, exc: BaseException | None, losses: list[float]) -> CellResult:
    inj.remove()
    events, counters = (list(w.events), dict(w.counters)) if w is not None else ([], {})
    return CellResult(codebase, fault, events, counters, exc, inj, model, opt, losses)


def _plain_loop(codebase: str, fault: Fault, model: nn.Module, opt: torch.optim.Optimizer, param: torch.Tensor,
                input_module: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                options: dict[str, Any], scheduler: Any = None) -> CellResult:
    inj = Injector(fault, model=model, param=param, input_module=input_module, optimizer=lambda: opt)

    def one_step(w: earlywarn.Watcher, b: Any) -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, b)
        w.report_loss(loss)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        return float(loss.detach())

    return guarded_run(codebase, fault, model, opt, inj, batches, one_step, scheduler=scheduler, **options)


# ------------------------------------------------------------------------------ Hugging Face
def _hf_causal_lm(kind: str) -> tuple[nn.Module, torch.Tensor, nn.Module]:
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        return model, model.transformer.h[0].mlp.c_fc.weight, model.transformer.wte
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    return model, model.model.layers[0].mlp.gate_proj.weight, model.model.embed_tokens


def hf_loop(kind: str, fault: Fault, options: dict[str, Any], steps: int = 45) -> CellResult:
    torch.manual_seed(0)
    model, param, emb = _hf_causal_lm(kind)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batches = lm_batches(steps, 8, 32, seed=1)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(input_ids=b[:, :-1], labels=b[:, :-1]).loss

    return _plain_loop(f"hf_{kind}_loop", fault, model, opt, param, emb, batches, loss_fn, options)


def hf_trainer(fault: Fault, options: dict[str, Any], tmp_path: Any, steps: int = 40) -> CellResult:
    import transformers
    from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback

    torch.manual_seed(0)
    model, param, emb = _hf_causal_lm("gpt2")
    rows = [b for b in lm_batches(steps * 8 // 8 + 1, 8, 32, seed=2) for b in b]
    dataset = [{"input_ids": r[:-1], "labels": r[:-1]} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=5, logging_strategy="no", save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    cb = EarlywarnTrainerCallback(**options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[cb])
    return _trainer_run("hf_trainer", fault, trainer, cb, model, param, emb)


def _trainer_run(codebase: str, fault: Fault, trainer: Any, cb: Any, model: nn.Module, param: torch.Tensor,
                 emb: nn.Module) -> CellResult:
    def torch_opt() -> torch.optim.Optimizer | None:
        return cb.watcher.optimizer if cb.watcher is not None else None

    inj = Injector(fault, model=model, param=param, input_module=emb, optimizer=torch_opt)
    exc: BaseException | None = None
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - Halt included: the invariants report it
        exc = e
    w = cb.watcher
    opt = w.optimizer if w is not None else trainer.optimizer
    return _finish(codebase, fault, w, inj, model, opt, exc, [])


# ------------------------------------------------------------------------------ Lightning
def lightning_encoder(fault: Fault, options: dict[str, Any], tmp_path: Any, steps: int = 40) -> CellResult:
    import lightning.pytorch as pl
    from earlywarn.integrations.lightning_callback import EarlywarnCallback

    T = 32

    class EncoderLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 32)
            self.pos = nn.Parameter(torch.zeros(T, 32))
            layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, VOCAB)
            # the float causal mask: 0 on and below the diagonal, -inf above (PyTorch's own helper)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x) + self.pos[: x.shape[1]]
            return self.head(self.encoder(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))

        def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
            logits = self(batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    model = EncoderLM()
    loader = torch.utils.data.DataLoader(torch.cat(lm_batches(steps + 1, 8, T, seed=3)), batch_size=8)
    cb = EarlywarnCallback(**options)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=str(tmp_path), gradient_clip_val=1.0, num_sanity_val_steps=0)

    def torch_opt() -> torch.optim.Optimizer | None:
        return cb.watchers[0].optimizer if cb.watchers else None

    inj = Injector(fault, model=model, param=model.encoder.layers[0].linear1.weight, input_module=model.emb,
                   optimizer=torch_opt)
    exc: BaseException | None = None
    try:
        trainer.fit(model, loader)
    except Exception as e:  # noqa: BLE001 - Halt included: the invariants report it
        exc = e
    w = cb.watchers[0] if cb.watchers else None
    opt = w.optimizer if w is not None else trainer.optimizers[0]
    return _finish("lightning_encoder", fault, w, inj, model, opt, exc, [])


# ------------------------------------------------------------------------------ torchvision
def resnet18(fault: Fault, options: dict[str, Any], steps: int = 36) -> CellResult:
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=10)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(4)
    teacher = torch.randn(3 * 8 * 8, 10, generator=g)
    batches = []
    for _ in range(steps):
        x = torch.randn(8, 3, 32, 32, generator=g)
        y = (F.avg_pool2d(x, 4).flatten(1) @ teacher).argmax(1)
        batches.append((x, y))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    return _plain_loop("torchvision_resnet18", fault, model, opt, model.layer1[0].conv1.weight, model.conv1,
                       batches, loss_fn, options)


# ------------------------------------------------------------------------------ nanoGPT
class _NanoAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class _NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _NanoAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model.py in miniature: tied input/output embeddings, pre-LN blocks."""

    def __init__(self, block_size: int = 32, n_layer: int = 2, n_head: int = 2, n_embd: int = 32) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([_NanoBlock(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt(fault: Fault, options: dict[str, Any], max_iters: int = 45, dtype: str = "float16") -> CellResult:
    """nanoGPT's train.py loop, trimmed to what matters here."""
    torch.manual_seed(1337)
    data = text_tokens()
    block_size, batch_size, gradient_accumulation_steps = 32, 8, 2
    learning_rate, warmup_iters, lr_decay_iters, min_lr = 3e-3, 10, max_iters, 3e-4

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block_size, (batch_size,))  # the global RNG, as nanoGPT does
        x = torch.stack([data[i:i + block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    model = NanoGPT(block_size)
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    ctx = torch.autocast(device_type="cpu", dtype=torch.float16 if dtype == "float16" else torch.bfloat16)
    inj = Injector(fault, model=model, param=model.transformer.h[0].mlp[0].weight, input_module=model.transformer.wte,
                   optimizer=lambda: optimizer, accum=gradient_accumulation_steps)
    batch = list(get_batch())

    def one_iter(w: earlywarn.Watcher, iter_num: int) -> float:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(gradient_accumulation_steps):
            with ctx:
                logits, loss = model(*batch)
                loss = loss / gradient_accumulation_steps
            w.report_loss(loss)
            batch[:] = get_batch()
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()) * gradient_accumulation_steps

    return guarded_run(f"nanogpt_{dtype}", fault, model, optimizer, inj, range(max_iters), one_iter, scaler=scaler,
                       **options)


# ------------------------------------------------------------------------------ every torch.optim optimizer
class Regressor(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32, bias=bias)
        self.hidden = nn.Linear(32, 32, bias=bias)
        self.out = nn.Linear(32, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


class SparseRegressor(nn.Module):
    """An embedding with sparse gradients (what SparseAdam is for) read out by a fixed projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16, sparse=True)
        self.register_buffer("readout", torch.randn(16, 1, generator=torch.Generator().manual_seed(6)) / 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.emb(idx)) @ self.readout).mean(1)


def _make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    o = torch.optim
    params = list(model.parameters())
    table: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "SGD": lambda: o.SGD(params, lr=0.05),
        "SGD_momentum": lambda: o.SGD(params, lr=0.02, momentum=0.9, nesterov=True),
        "Adam": lambda: o.Adam(params, lr=3e-3),
        "Adam_amsgrad": lambda: o.Adam(params, lr=3e-3, amsgrad=True),
        "AdamW": lambda: o.AdamW(params, lr=3e-3, foreach=True),
        "AdamW_fused": lambda: o.AdamW(params, lr=3e-3, fused=True),
        "Adamax": lambda: o.Adamax(params, lr=3e-3),
        "NAdam": lambda: o.NAdam(params, lr=3e-3),
        "RAdam": lambda: o.RAdam(params, lr=3e-3),
        "Adagrad": lambda: o.Adagrad(params, lr=0.05),
        "Adadelta": lambda: o.Adadelta(params, lr=1.0),
        "RMSprop": lambda: o.RMSprop(params, lr=1e-3, momentum=0.5),
        "Rprop": lambda: o.Rprop(params, lr=1e-3),
        "ASGD": lambda: o.ASGD(params, lr=0.02),
        "Adafactor": lambda: o.Adafactor(params, lr=1e-2),
        "Muon": lambda: o.Muon(params, lr=0.02),
        "SparseAdam": lambda: o.SparseAdam(params, lr=3e-2),
        "LBFGS": lambda: o.LBFGS(params, lr=0.5),
    }
    return table[name]()


# every optimizer class in torch.optim is trained here or refused at watch() (a test checks none is missing)
OPTIMIZERS = ("SGD", "SGD_momentum", "Adam", "Adam_amsgrad", "AdamW", "AdamW_fused", "Adamax", "NAdam", "RAdam",
              "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD", "Adafactor", "Muon", "SparseAdam")
REFUSED = ("LBFGS",)


def optimizer_loop(name: str, fault: Fault, options: dict[str, Any], steps: int = 40) -> CellResult:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    if name == "SparseAdam":
        model: nn.Module = SparseRegressor()
        table = torch.randn(64, generator=g)
        batches = []
        for _ in range(steps):
            idx = torch.randint(0, 64, (32, 4), generator=g)
            batches.append((idx, table[idx].mean(1, keepdim=True)))
        param, input_module = model.emb.weight, model.emb
    else:
        model = Regressor(bias=(name != "Muon"))  # Muon updates 2-D weights only
        w_true = torch.randn(8, 1, generator=g)
        batches = []
        for _ in range(steps):
            x = torch.randn(32, 8, generator=g)
            batches.append((x, torch.sin(x @ w_true) + 0.05 * torch.randn(32, 1, generator=g)))
        param, input_module = model.hidden.weight, model.inp
    opt = _make_optimizer(name, model)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(m(b[0]), b[1])

    return _plain_loop(f"optim_{name}", fault, model, opt, param, input_module, batches, loss_fn, options)


def make_optimizer(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = SparseRegressor() if name == "SparseAdam" else Regressor(bias=(name != "Muon"))
    return model, _make_optimizer(name, model)
