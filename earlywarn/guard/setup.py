"""What ``watch()`` checks and sets up once, before the first step: the arguments it refuses,
the mode it runs in, the policy options async mode cannot honour, and the forward pre-hook that
fingerprints the model's inputs."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import torch

from earlywarn.guard.config import WatchConfig
from earlywarn.policy import Action, PolicyConfig
from earlywarn.recover import Recovery
from earlywarn.recover.holders import ZeroState, state_view

_is_compiling = torch.compiler.is_compiling


def check_arguments(optimizer: torch.optim.Optimizer, scaler: Any, scheduler: Any,
                     extra_state: Mapping[str, Any] | None) -> None:
    if getattr(optimizer, "_earlywarn_watcher", None) is not None:
        raise RuntimeError(
            "this optimizer is already watched by earlywarn: call .detach() on the first watcher "
            "(or reuse it) before calling earlywarn.watch again")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "earlywarn cannot guard torch.optim.LBFGS: its step() evaluates the closure up to "
            "max_iter times and moves the parameters between evaluations, so a NaN gradient met "
            "inside the line search is applied before any guard could see it. Train LBFGS "
            "without earlywarn (its own tolerance checks stop on non-finite losses), or use a "
            "first-order optimizer")
    if isinstance(state_view(optimizer), ZeroState) and getattr(optimizer, "_overlap_with_ddp", False):
        raise ValueError(
            "earlywarn cannot guard a ZeroRedundancyOptimizer built with overlap_with_ddp=True: DDP's "
            "communication hook steps each rank's share inside backward, and the loop calls no step(), so "
            "there is no single step to check or skip. Build it with overlap_with_ddp=False (the default) "
            "to use earlywarn")
    for what, obj in (("scheduler", scheduler), *((f"extra_state[{k!r}]", v) for k, v in (extra_state or {}).items())):
        if obj is not None and not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"{what}= takes an object with state_dict() and load_state_dict() (e.g. a "
                f"torch.optim.lr_scheduler.LRScheduler), got {type(obj).__name__}: earlywarn "
                "restores it on a rewind")


def run_mode(config: WatchConfig, fused: bool, devices: set) -> str:
    all_cuda = all(d.type == "cuda" for d in devices)
    if config.mode == "async" and not fused:
        raise ValueError(
            "mode='async' needs an optimizer that can skip on the device, but the optimizer is not fused: "
            "pass fused=True to torch.optim.Adam/AdamW/SGD, or use mode='sync' (one host read per step)")
    if config.mode == "async" and not all_cuda and any(d.type == "cuda" for d in devices):
        raise ValueError(
            "mode='async' needs every parameter on a CUDA device, but some are on "
            f"{sorted(str(d) for d in devices if d.type != 'cuda')} (offloaded): the fused step would copy "
            "the device skip flag to them with non_blocking=True and read it before it lands. Use mode='sync'")
    # Async only when every parameter is on CUDA (params[0] alone says nothing about the rest).
    return "async" if config.mode == "async" or (config.mode == "auto" and fused and all_cuda) else "sync"


def warn_unskippable(cfg: PolicyConfig) -> None:
    ignored = [n for n in ("on_collapse_risk", "on_loss_nonfinite", "on_loss_diverged", "on_grad_spike",
                           "on_scaler_overflow") if getattr(cfg, n) is Action.SKIP]
    if ignored:
        warnings.warn(f"earlywarn: PolicyConfig {', '.join(f'{n}=skip' for n in ignored)} cannot act in "
                      "async mode: a finite step's update is applied before its statistics arrive "
                      "(only non-finite steps are skipped, on the device); use mode='sync' to skip spikes")


def input_fingerprint(recovery: Recovery) -> Callable[..., None]:
    """A forward pre-hook folding the model's inputs (its first tensor argument) into the
    step's batch fingerprint: training forwards only, on the device, no host sync."""
    fps = recovery.fingerprints

    def observe(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled() and not fps.explicit:
            for a in args:  # (a loop, not next() of a generator: the usual call, a frame fewer)
                if isinstance(a, torch.Tensor):
                    fps.observe(a)
                    return
            first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if first is not None:
                fps.observe(first)

    eager = torch.compiler.disable(observe)  # never traced into a compiled model

    def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        # the disabled twin only while dynamo traces: its wrapper costs 10-25 us a call in eager
        # mode (as optimizer.step's did, install._watched_step)
        return eager(module, args, kwargs) if _is_compiling() else observe(module, args, kwargs)

    return hook
