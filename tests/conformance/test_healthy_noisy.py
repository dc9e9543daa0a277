"""Healthy runs whose loss is noisy from step to step -- small batches, classification, regression near
its floor, a loss that goes negative, LR decay, a GradScaler that overflows now and then -- must
finish under ``earlywarn.watch`` defaults with no CRITICAL, no rewind and no halt.

Four of six such runs were halted by earlywarn itself before (``loss_diverged`` from per-batch
noise, three rewinds, ``Halt``): a safety tool that kills healthy training is worse than none.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import earlywarn
from earlywarn.events import Kind, Level
from harness import CellResult, Fault, Injector, check_invariants, guarded_run

torch.set_num_threads(1)


def mlp(inp: int, out: int, width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(inp, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, out))


def run(name: str, model: nn.Module, opt: torch.optim.Optimizer, batch: Callable[[int], tuple[Any, Any]],
        loss_fn: Callable[[Any, Any], torch.Tensor], steps: int, *, scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None, options: dict[str, Any] | None = None) -> CellResult:
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    inj = Injector(Fault("none"), model=model, param=first.weight, input_module=first, optimizer=lambda: opt)

    def one_step(w: earlywarn.Watcher, step: int) -> float:
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = loss_fn(out.float(), y)
            w.report_loss(loss)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss = loss_fn(model(x), y)
            w.report_loss(loss)
            loss.backward()
            opt.step()
        if scheduler is not None:
            scheduler.step()
        return float(loss.detach())

    return guarded_run(name, Fault("none"), model, opt, inj, range(steps), one_step, scheduler=scheduler, scaler=scaler,
                       **(options or {"sinks": []}))


def regression(batch_size: int, seed: int, *, scale: float, noise: float):
    """A realizable target (a fixed random teacher of the same shape) times ``scale``, plus noise:
    the student's loss falls from ~scale^2 towards the noise floor noise^2."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 100)
    teacher = mlp(8, 4)
    for p in teacher.parameters():
        p.requires_grad_(False)

    def batch(step: int):
        x = torch.randn(batch_size, 8, generator=g)
        return x, scale * teacher(x) / teacher(x).std() + noise * torch.randn(batch_size, 4, generator=g)

    torch.manual_seed(seed)
    return mlp(8, 4), batch


def case_mlp_regression_b32_adamw():
    # the first run: its loss falls from ~12 to ~0.05 with AdamW at batch 32
    model, batch = regression(32, seed=0, scale=3.5, noise=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    r = run("mse_b32_adamw", model, opt, batch, F.mse_loss, 500)
    assert r.losses[0] > 8 and min(r.losses) < 0.15, (r.losses[0], min(r.losses))
    return r


def case_mse_b256_near_convergence():
    # near convergence: loss ~0.1 wobbling 0.06-0.18, as Adam does at its floor
    model, batch = regression(256, seed=1, scale=1.0, noise=0.3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    r = run("mse_b256_floor", model, opt, batch, F.mse_loss, 500)
    tail = r.losses[-200:]
    assert 0.05 < min(tail) and max(tail) < 0.3, (min(tail), max(tail))
    return r


def case_classification_teacher_b8_sgd_momentum():
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    teacher = mlp(16, 10, width=32)
    for p in teacher.parameters():
        p.requires_grad_(False)

    def batch(step: int):
        x = torch.randn(8, 16, generator=g)
        return x, teacher(x).argmax(1)

    model = mlp(16, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return run("classify_b8_sgdm", model, opt, batch, F.cross_entropy, 500)


def case_cosine_finetune_b4():
    # fine-tune a "pre-trained" model at batch 4 with a cosine-decayed LR: every batch is noisy
    model, batch = regression(4, seed=3, scale=1.0, noise=0.3)
    pre = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):  # pre-training, unwatched
        x, y = batch(step)
        pre.zero_grad()
        F.mse_loss(model(x), y).backward()
        pre.step()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=400)
    return run("cosine_finetune_b4", model, opt, batch, F.mse_loss, 400, scheduler=sched)


def case_gaussian_nll_goes_negative():
    # a learned variance: the negative log-likelihood crosses zero and keeps falling
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    w_true = torch.randn(8, 1, generator=g)

    def batch(step: int):
        x = torch.randn(16, 8, generator=g)
        return x, x @ w_true + 0.05 * torch.randn(16, 1, generator=g)

    model = mlp(8, 2)

    def nll(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mean, log_var = out[:, :1], out[:, 1:]
        return (0.5 * (log_var + (y - mean) ** 2 / log_var.exp())).mean()

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    r = run("gaussian_nll_negative", model, opt, batch, nll, 400)
    assert min(r.losses) < -1.0, "the test needs a loss that goes negative"
    return r


def case_step_lr_decay_b16():
    model, batch = regression(16, seed=5, scale=2.0, noise=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.3)
    return run("steplr_b16_sgdm", model, opt, batch, F.mse_loss, 400, scheduler=sched)


def case_fp16_gradscaler_regrowth():
    # the scaler overflows at start-up and after each growth (every 25 steps here): info, never critical
    model, batch = regression(32, seed=6, scale=1.0, noise=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=25)
    r = run("fp16_gradscaler", model, opt, batch, F.mse_loss, 300, scaler=scaler)
    assert any(e.kind is Kind.SKIP and e.level == Level.INFO for e in r.events), "the test needs overflow steps"
    return r


CASES = {f.__name__.removeprefix("case_"): f for f in (
    case_mlp_regression_b32_adamw, case_mse_b256_near_convergence, case_classification_teacher_b8_sgd_momentum,
    case_cosine_finetune_b4, case_gaussian_nll_goes_negative, case_step_lr_decay_b16, case_fp16_gradscaler_regrowth)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_healthy_noisy_run_finishes_untouched(name, cell):
    cell(f"healthy_{name}", "none")
    r = CASES[name]()
    check_invariants(r)
    assert all(math.isfinite(v) for v in r.losses)
