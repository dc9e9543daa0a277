"""Framework adapters: a few real training steps in Lightning, the Hugging Face Trainer and
Accelerate on CPU, with a fault injected; the step must really be skipped (parameters and
optimizer state bit-identical across it) and the run must stay finite."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from earlywarn.events import Kind
from earlywarn.guard import _is_watched_step

torch.set_num_threads(1)

FAULT = 3  # optimizer step whose batch holds an inf


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().double().numpy().tobytes())
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v):
                h.update(v.detach().double().numpy().tobytes())
    return h.hexdigest()


def finite(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    ts = [p.detach() for p in model.parameters()]
    ts += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in ts)


def regression_data(n: int = 64, scale: float = 1.0) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, scale * (x @ torch.randn(8, 1, generator=g)))


# --------------------------------------------------------------------------------- Lightning
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def make_lightning_module(optimizer: str) -> Any:
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.digests: dict[str, str] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.global_step == FAULT:
                x = x.clone()
                x[0, 0] = float("inf")  # a corrupt sample: finite loss, non-finite gradients
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return OPTIMIZERS[optimizer](self.parameters())

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == FAULT:
                self.digests["before"] = digest(self, self.trainer.optimizers[0])

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == FAULT:
                self.digests["after"] = digest(self, self.trainer.optimizers[0])

    return Lit()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_lightning_callback_skips_the_faulty_step(optimizer, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from earlywarn.integrations.lightning_callback import EarlywarnCallback

    torch.manual_seed(0)
    module = make_lightning_module(optimizer)
    cb = EarlywarnCallback(sinks=[])
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(regression_data(), batch_size=8))
    ew = cb.watcher
    assert ew.step == 8
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [FAULT]
    assert module.digests["before"] == module.digests["after"]  # the update really did not happen
    assert finite(module, trainer.optimizers[0])
    assert ew.counters["skipped_steps"] == 1
    assert "step" not in trainer.optimizers[0].__dict__  # detached at the end of fit


def test_lightning_with_a_step_scheduler_gets_no_scheduler_order_warning(tmp_path, recwarn):
    # The scheduler is built in configure_optimizers, before the callback's wrapper goes on
    # optimizer.step: torch warns at the scheduler's first step unless the wrapper carries the
    # scheduler's marker and records the optimizer call.
    pl = pytest.importorskip("lightning.pytorch")
    from earlywarn.integrations.lightning_callback import EarlywarnCallback

    class Scheduled(type(make_lightning_module("adamw"))):  # type: ignore[misc]
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    cb = EarlywarnCallback(sinks=[])
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=tmp_path)
    trainer.fit(Scheduled(), DataLoader(regression_data(), batch_size=8))
    order = [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]
    assert order == []
    assert [e.step for e in cb.watcher.events if e.kind is Kind.SKIP] == [FAULT]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8  # the schedule advanced every step


def test_lightning_callback_sees_gradients_before_clipping_and_the_loss():
    pl = pytest.importorskip("lightning.pytorch")
    from earlywarn.integrations.lightning_callback import EarlywarnCallback

    torch.manual_seed(0)
    module = make_lightning_module("sgd")
    cb = EarlywarnCallback(sinks=[])
    seen: list[Any] = []
    grad_norms: list[float] = []

    class Probe(pl.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            w = cb.watcher
            orig = w.detector.observe
            w.detector.observe = lambda obs: (seen.append(obs), orig(obs))[1]

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            norms = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
            grad_norms.append(float(torch.linalg.vector_norm(torch.stack(norms))))

    # Both hooks run before Lightning clips (observing changes no gradient).
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, Probe()], gradient_clip_val=0.01)
    trainer.fit(module, DataLoader(regression_data(scale=20.0), batch_size=8))
    assert len(seen) == 3
    for obs, want in zip(seen, grad_norms):
        assert obs.grad_norm == pytest.approx(want, rel=1e-5)
        assert obs.grad_norm > 0.01  # what clipping would have capped it at
        assert obs.loss is not None and math.isfinite(obs.loss) and obs.loss > 0


def test_lightning_callback_state_round_trips():
    pytest.importorskip("lightning.pytorch")
    from earlywarn.integrations.lightning_callback import EarlywarnCallback

    cb = EarlywarnCallback(sinks=[])
    cb.load_state_dict({"watchers": [{"step": 5}]})  # before fit: kept until watchers exist
    assert cb._saved == [{"step": 5}]
    with pytest.raises(RuntimeError, match="on_fit_start"):
        _ = cb.watcher


# --------------------------------------------------------------------------------- Hugging Face
class HFData(Dataset):
    def __init__(self, n: int = 32, vocab: int = 50, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg)  # built from a config: nothing is downloaded


def test_hf_trainer_callback_skips_the_faulty_step(tmp_path):
    transformers = pytest.importorskip("transformers")
    from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback

    model = tiny_gpt2()
    digests: dict[str, str] = {}

    class Fault(transformers.TrainerCallback):
        """Puts an inf into one gradient after backward (and after clipping), before the step."""

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                                  optimizer: Any = None, **kw: Any) -> None:
            if state.global_step == FAULT:
                model.transformer.h[1].mlp.c_fc.weight.grad[0, 0] = float("inf")
                digests["before"] = digest(model, optimizer.optimizer)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                              optimizer: Any = None, **kw: Any) -> None:
            if state.global_step == FAULT:
                digests["after"] = digest(model, optimizer.optimizer)

    cb = EarlywarnTrainerCallback(sinks=[])
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    # Fault runs after earlywarn's hook; earlywarn checks gradients inside optimizer.step.
    trainer = transformers.Trainer(model=model, args=args, train_dataset=HFData(), callbacks=[cb, Fault()])
    trainer.train()
    ew = cb.watcher
    assert ew is not None and ew.step == 6
    skips = [e for e in ew.events if e.kind is Kind.SKIP]
    assert [e.step for e in skips] == [FAULT]
    assert skips[0].layers[0] == "transformer.h.1.mlp.c_fc"
    assert digests["before"] == digests["after"]
    inner = trainer.optimizer.optimizer
    assert isinstance(inner, torch.optim.AdamW) and finite(model, inner)
    assert "step" not in inner.__dict__  # detached at the end of training


def train_hf_observed(tmp_path: Any, **training_args: Any) -> tuple[list[Any], Any]:
    """A tiny GPT-2 under the Trainer with earlywarn's callback; every observation the detector got."""
    transformers = pytest.importorskip("transformers")
    from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback

    cb = EarlywarnTrainerCallback(sinks=[])
    seen: list[Any] = []

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            orig = cb.watcher.detector.observe
            cb.watcher.detector.observe = lambda obs: (seen.append(obs), orig(obs))[1]

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True, **training_args)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=HFData(), callbacks=[cb, Probe()])
    trainer.train()
    return seen, trainer


def test_hf_trainer_callback_reports_the_model_loss(tmp_path):
    seen, _ = train_hf_observed(tmp_path, max_steps=2, gradient_accumulation_steps=2, logging_strategy="no")
    assert len(seen) == 2
    for obs in seen:  # mean token cross-entropy of a random 50-token vocabulary: about log(50)
        assert obs.loss == pytest.approx(math.log(50), rel=0.2)


def test_hf_trainer_gradients_are_read_as_they_were_before_max_grad_norm(tmp_path):
    # The Trainer clips (accelerate -> torch.nn.utils.clip_grad_norm_) before any callback runs;
    # earlywarn undoes the clip's factor, so it reads the norm the Trainer itself logs as grad_norm.
    seen, trainer = train_hf_observed(tmp_path, max_steps=4, max_grad_norm=1e-3, logging_steps=1)
    logged = [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    norms = [obs.grad_norm for obs in seen]
    assert len(norms) == len(logged) == 4
    assert norms == pytest.approx(logged, rel=1e-4)
    assert min(norms) > 1e-2  # not the clipped 1e-3


# --------------------------------------------------------------------------------- Accelerate
def test_accelerate_watch_skips_the_faulty_step():
    accelerate = pytest.importorskip("accelerate")
    from earlywarn.integrations.accelerate_support import watch_accelerated

    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(regression_data(), batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ew = watch_accelerated(accelerator, model, opt, sinks=[])
    assert ew.optimizer is opt.optimizer
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        accelerator.backward(loss)
        if step == FAULT:
            model[2].weight.grad[0, 0] = float("inf")
            before = digest(model, opt.optimizer)
        opt.step()
        if step == FAULT:
            assert digest(model, opt.optimizer) == before
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [FAULT]
    assert finite(model, opt.optimizer)
    ew.close()


def test_accelerate_with_a_grad_scaler_keeps_the_watcher_installed():
    # accelerate swaps the inner optimizer's step during a scaled step and puts back the method
    # it saw at prepare time; watch_accelerated re-points it, so a spike skip still holds.
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    from earlywarn.integrations.accelerate_support import watch_accelerated

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)
    ew = watch_accelerated(None, model, opt, sinks=[])
    assert ew.scaler is scaler
    x, y = regression_data()[:8]
    for step in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == FAULT:
            model[0].weight.grad[1, 1] = float("inf")
            before = digest(model, inner)
        opt.step()
        assert _is_watched_step(inner.__dict__.get("step"))  # still watched after the swap
        if step == FAULT:
            assert digest(model, inner) == before
    assert ew.step == 5
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [FAULT]
    assert finite(model, inner)
    ew.close()
