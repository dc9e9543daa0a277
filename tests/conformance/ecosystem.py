"""The ecosystems people fine-tune and train with, each with ``earlywarn.watch`` added the way its
docs say (issue 22): peft LoRA (a plain loop and the HF Trainer), timm (its optimizer factory:
Lamb, AdamP, Lion), diffusers (UNet2D + EMAModel), trl's SFTTrainer, litgpt under Lightning
Fabric (its pretraining loop: ``fabric.clip_gradients``, error_if_nonfinite by default),
schedulefree, lion-pytorch, heavyball (nested state), a GAN with two watchers, ``torch.compile``,
activation checkpointing, weight tying, a frozen param group (lr 0) and
``zero_grad(set_to_none=False)``. Tiny configs built in code, no downloads.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import earlywarn
from codebases import VOCAB, _plain_loop, _trainer_run, lm_batches
from harness import CellResult, Fault, Injector, guarded_run


def _regression(steps: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        out.append((x, torch.sin(x @ w) + 0.05 * torch.randn(32, 1, generator=g)))
    return out


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def _mse(m: nn.Module, b: Any) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


# ------------------------------------------------------------------------------ optimizer libraries
def _heavyball_adamw(params: Any) -> torch.optim.Optimizer:
    import heavyball

    heavyball.utils.compile_mode = None  # eager: compiling each fused update on a CPU takes a minute
    return heavyball.AdamW(params, lr=3e-3)


def _schedulefree(params: Any) -> torch.optim.Optimizer:
    import schedulefree

    return schedulefree.AdamWScheduleFree(params, lr=3e-3, warmup_steps=5)


def _lion_pytorch(params: Any) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(params, lr=3e-4, weight_decay=1e-2)


OPTIMIZER_LIBS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "heavyball_adamw": _heavyball_adamw,
    "schedulefree_adamw": _schedulefree,
    "lion_pytorch": _lion_pytorch,
}


def optimizer_lib(name: str, fault: Fault, options: dict[str, Any], steps: int = 36) -> CellResult:
    """A regression MLP under a third-party optimizer (schedulefree's train() / eval() included)."""
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZER_LIBS[name](model.parameters())
    if hasattr(opt, "train"):
        opt.train()  # schedulefree: the optimizer's own train mode, as its README says
    return _plain_loop(name, fault, model, opt, model.hidden.weight, model.inp, _regression(steps), _mse, options)


# ------------------------------------------------------------------------------ timm
def timm_optimizers() -> list[str]:
    """Every optimizer timm's factory makes on a CPU without extras: not bitsandbytes' (``bnb*``)
    or apex's (``fused*``), not AdaHessian (its loop backpropagates with ``create_graph``); and
    its ``lookahead_`` wrapper around a few kinds (it keeps their state in the wrapped optimizer)."""
    from timm.optim import list_optimizers

    names = [n for n in list_optimizers() if not n.startswith(("bnb", "fused")) and n != "adahessian"]
    return names + [f"lookahead_{n}" for n in ("adamw", "lamb", "sgd", "lion", "adan") if n in names]


def _timm_lr(opt_name: str) -> float:
    """A learning rate of the optimizer's family (sign updates small, SGD large, Adadelta's 1)."""
    if "lion" in opt_name:
        return 3e-4
    if any(k in opt_name for k in ("sgd", "momentum", "nesterov", "lars", "larc")):
        return 3e-2
    if "muon" in opt_name:
        return 2e-2
    return 1.0 if "adadelta" in opt_name else 3e-3


def timm_vit(opt_name: str, fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """A tiny ViT (timm's VisionTransformer from a config) with timm's optimizer factory."""
    import timm
    from timm.optim import create_optimizer_v2

    torch.manual_seed(0)
    model = timm.models.VisionTransformer(img_size=16, patch_size=4, num_classes=4, embed_dim=32, depth=2,
                                          num_heads=2, mlp_ratio=2.0)
    opt = create_optimizer_v2(model, opt_name, lr=_timm_lr(opt_name), weight_decay=0.05)
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(3 * 16 * 16, 4, generator=g)
    data = []
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=g)
        data.append((x, (x.flatten(1) @ teacher).argmax(1)))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    return _plain_loop(f"timm_vit_{opt_name}", fault, model, opt, model.blocks[0].mlp.fc1.weight, model.patch_embed.proj,
                       data, loss_fn, options)


# ------------------------------------------------------------------------------ peft LoRA
def _lora_llama() -> nn.Module:
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))


def _lora_parts(model: nn.Module) -> tuple[torch.Tensor, nn.Module]:
    inner = model.base_model.model
    return inner.model.layers[0].self_attn.q_proj.lora_B["default"].weight, inner.model.embed_tokens


def peft_lora_loop(fault: Fault, options: dict[str, Any], steps: int = 36) -> CellResult:
    model = _lora_llama()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    param, emb = _lora_parts(model)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(input_ids=b[:, :-1], labels=b[:, :-1]).loss

    return _plain_loop("peft_lora_loop", fault, model, opt, param, emb, lm_batches(steps, 8, 32, seed=11), loss_fn,
                       options)


def peft_lora_hf_trainer(fault: Fault, options: dict[str, Any], tmp_path: Any, steps: int = 36) -> CellResult:
    import transformers
    from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback

    model = _lora_llama()
    param, emb = _lora_parts(model)
    rows = [r for b in lm_batches(steps + 1, 8, 32, seed=12) for r in b]
    dataset = [{"input_ids": r[:-1], "labels": r[:-1]} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=3, logging_strategy="no", save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    cb = EarlywarnTrainerCallback(**options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[cb])
    return _trainer_run("peft_lora_hf_trainer", fault, trainer, cb, model, param, emb)


# ------------------------------------------------------------------------------ trl
def _char_tokenizer() -> Any:
    """A character-level tokenizer built in code (no download): what SFTTrainer pads with."""
    import tokenizers
    import transformers

    vocab = {chr(i): i for i in range(32, 127)}
    vocab.update({"<pad>": 0, "<eos>": 1, "<unk>": 2})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def trl_sft(fault: Fault, options: dict[str, Any], tmp_path: Any, steps: int = 32) -> CellResult:
    import datasets
    import transformers
    import trl
    from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    rows = [r for b in lm_batches(steps + 1, 8, 32, seed=13) for r in b]
    data = datasets.Dataset.from_dict({"input_ids": [r[:-1].tolist() for r in rows]})
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=steps, per_device_train_batch_size=8,
                         learning_rate=3e-3, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
                         dataloader_num_workers=0, disable_tqdm=True, seed=0, max_length=32, packing=False)
    cb = EarlywarnTrainerCallback(**options)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_char_tokenizer(),
                             callbacks=[cb])
    return _trainer_run("trl_sft", fault, trainer, cb, model, model.model.layers[0].mlp.gate_proj.weight,
                        model.model.embed_tokens)


# ------------------------------------------------------------------------------ diffusers
def diffusers_unet_ema(fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """A tiny UNet2DModel trained on the DDPM noise-prediction loss, with diffusers' EMAModel
    passed in extra_state (what a rewind must restore beside the model) and stepped after each
    optimizer step, as diffusers' training scripts do."""
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
                        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    ema = EMAModel(model.parameters(), decay=0.99)
    noise_sched = DDPMScheduler(num_train_timesteps=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(8)
    data = [(torch.randn(4, 1, 8, 8, generator=g), torch.randn(4, 1, 8, 8, generator=g),
             torch.randint(0, 100, (4,), generator=g)) for _ in range(steps)]
    inj = Injector(fault, model=model, param=model.down_blocks[0].resnets[0].conv1.weight, input_module=model.conv_in,
                   optimizer=lambda: opt)

    def one_step(w: earlywarn.Watcher, b: Any) -> float:
        clean, noise, t = b
        noisy = noise_sched.add_noise(clean, noise, t)
        loss = F.mse_loss(model(noisy, t).sample, noise)
        w.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.step(model.parameters())
        return float(loss.detach())

    result = guarded_run("diffusers_unet_ema", fault, model, opt, inj, data, one_step, extra_state={"ema": ema},
                         **options)
    # the EMA is what diffusers saves: it must be finite too
    result.extra_tensors = {f"ema.shadow_params[{i}]": t for i, t in enumerate(ema.shadow_params)}
    return result


# ------------------------------------------------------------------------------ litgpt under Fabric
def litgpt_fabric(fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    """litgpt's GPT from a tiny Config, set up with Lightning Fabric, trained by the body of
    litgpt's pretraining loop (``litgpt/pretrain.py``: the LR written into every param group,
    ``fabric.backward``, ``fabric.clip_gradients(model, optimizer, max_norm=...)`` with Fabric's
    default ``error_if_nonfinite=True``, ``optimizer.step()``, ``optimizer.zero_grad()``)."""
    import lightning as L
    from litgpt import GPT, Config

    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    config = Config(block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32,
                    rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                    mlp_class_name="LLaMAMLP", intermediate_size=64)
    with fabric.init_module():
        raw = GPT(config)
    model = fabric.setup(raw)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                                                          betas=(0.9, 0.95)))
    data = lm_batches(steps, 8, 32, seed=14)
    inj = Injector(fault, model=raw, param=raw.transformer.h[0].mlp.fc_1.weight, input_module=raw.transformer.wte,
                   optimizer=lambda: optimizer)
    state = {"iter_num": 0}

    def one_step(w: earlywarn.Watcher, train_data: torch.Tensor) -> float:
        lr = 3e-3 * min(1.0, (state["iter_num"] + 1) / 5)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        state["iter_num"] += 1
        input_ids, targets = train_data[:, :-1].contiguous(), train_data[:, 1:].contiguous()
        logits = model(input_ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        w.report_loss(loss)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    return guarded_run("litgpt_fabric", fault, model, optimizer, inj, data, one_step, **options)


# ------------------------------------------------------------------------------ a GAN, two watchers
def gan_two_watchers(fault: Fault, options: dict[str, Any], steps: int = 36) -> CellResult:
    """A small GAN: generator and discriminator, each with its own Adam and its own watcher. The
    fault goes into the discriminator's step (its real-data input, its weight, its state); the
    generator's watcher must stay quiet."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    real_in = nn.Identity()  # where real samples enter the discriminator's loss (the NaN sample's door)
    disc = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(9)
    data = [(torch.randn(32, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0]), torch.randn(32, 4, generator=g))
            for _ in range(steps)]
    inj = Injector(fault, model=disc, param=disc[0].weight, input_module=real_in, optimizer=lambda: opt_d)
    watchers: list[earlywarn.Watcher] = []
    exc: BaseException | None = None
    try:
        watchers = [earlywarn.watch(disc, opt_d, **options), earlywarn.watch(gen, opt_g, **options)]
        w_d, w_g = watchers
        for real, z in data:
            ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
            fake = gen(z)
            loss_d = (F.binary_cross_entropy_with_logits(disc(real_in(real)), ones)
                      + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros))
            w_d.report_loss(loss_d)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = F.binary_cross_entropy_with_logits(disc(fake), ones)
            w_g.report_loss(loss_g)
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
    except Exception as e:  # noqa: BLE001 - Halt included: the invariants report it
        exc = e
    finally:
        for w in watchers:
            w.close()
    inj.remove()
    events = [e for w in watchers for e in w.events]
    counters: dict[str, int] = {}
    for w in watchers:
        for k, v in w.counters.items():
            counters[k] = counters.get(k, 0) + v
    both = nn.ModuleDict({"generator": gen, "discriminator": disc})
    state = types.SimpleNamespace(state={**opt_d.state, **opt_g.state})  # both optimizers' state, for the check
    return CellResult("gan_two_watchers", fault, events, counters, exc, inj, both, state, [])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ torch features
class TinyLM(nn.Module):
    """A small LM: tied input / output embeddings (``tie``), optional activation checkpointing."""

    def __init__(self, tie: bool = False, checkpoint: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                     for _ in range(2)])
        self.head = nn.Linear(32, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.checkpoint = checkpoint

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            if self.checkpoint and self.training:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return self.head(x)


def _lm_loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    logits = m(b[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), b[:, 1:].reshape(-1))


def torch_feature(name: str, fault: Fault, options: dict[str, Any], steps: int = 32) -> CellResult:
    torch.manual_seed(0)
    data = lm_batches(steps, 8, 16, seed=15)
    lm = TinyLM(tie=name == "weight_tying", checkpoint=name == "activation_checkpointing")
    param, inp = lm.blocks[0][1].weight, lm.emb
    model: nn.Module = lm
    if name == "weight_tying":
        param = lm.head.weight  # the tied matrix: one tensor, two modules
    if name == "torch_compile":
        # dynamo and AOT autograd (what changes the names and the graph); inductor's C++ build
        # would add a minute per cell on a CPU without changing what earlywarn sees
        model = torch.compile(lm, backend="aot_eager")
    if name == "frozen_param_group":
        opt = torch.optim.AdamW([{"params": [lm.emb.weight], "lr": 0.0},  # a frozen group first (group 0)
                                 {"params": [p for n, p in lm.named_parameters() if n != "emb.weight"], "lr": 3e-3}])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if name != "zero_grad_keep":
        return _plain_loop(name, fault, model, opt, param, inp, data, _lm_loss, options)
    inj = Injector(fault, model=model, param=param, input_module=inp, optimizer=lambda: opt)

    def one_step(w: earlywarn.Watcher, b: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)  # gradients kept as zero tensors between steps
        loss = _lm_loss(model, b)
        w.report_loss(loss)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return guarded_run(name, fault, model, opt, inj, data, one_step, **options)


TORCH_FEATURES = ("torch_compile", "activation_checkpointing", "weight_tying", "frozen_param_group", "zero_grad_keep")
