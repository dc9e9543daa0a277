"""Accelerate: ``ew = watch_accelerated(accelerator, model, optimizer)`` after ``accelerator.prepare``.

``accelerator.prepare`` wraps the optimizer in an ``AcceleratedOptimizer`` (and the model in DDP
/ FSDP when distributed). earlywarn watches the torch optimizer inside, with the accelerator's
GradScaler (fp16), and names layers after the unwrapped model.

One accelerate detail matters: with a GradScaler, ``AcceleratedOptimizer.step`` swaps the inner
optimizer's ``step`` for a patched copy of the method it saw *at prepare time* and puts that one
back afterwards -- which would silently drop a watcher attached after ``prepare``. The saved
method is re-pointed at the watcher's guarded step here.

Gradients are observed at ``optimizer.step()``, after ``accelerator.clip_grad_norm_`` when the loop
clips. Outside FSDP1 and DeepSpeed that call ends in ``torch.nn.utils.clip_grad_norm_`` (or
``clip_grads_with_norm_``), which earlywarn follows (``earlywarn/capture/clipping.py``): it divides
the clip's factor back out, so the detector and the trackers see the norm *before* clipping. Under
FSDP1 (the model's own ``clip_grad_norm_``), DeepSpeed (its engine clips) or DTensor gradients the
statistics are the clipped ones: a spike larger than ``max_norm`` shows as ``max_norm``. Non-finite
gradients are caught and skipped either way.
"""

from __future__ import annotations

from typing import Any

import torch

import earlywarn
from earlywarn.guard import Watcher


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's (possibly nested) ``AcceleratedOptimizer``."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) or type(inner).__name__ == "AcceleratedOptimizer":
        nxt = getattr(inner, "optimizer", None)
        if nxt is None or nxt is inner:
            break
        inner = nxt
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"cannot find a torch.optim.Optimizer inside {type(optimizer).__name__}")
    return inner


def repoint_accelerated_step(optimizer: Any, inner: torch.optim.Optimizer) -> None:
    """Make an ``AcceleratedOptimizer`` with a scaler call ``inner.step`` as it is *now*."""
    if getattr(optimizer, "scaler", None) is None or not hasattr(optimizer, "_optimizer_original_step_method"):
        return
    from accelerate.optimizer import patch_optimizer_step

    optimizer._optimizer_original_step_method = inner.step
    optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, inner.step)


def watch_accelerated(accelerator: Any, model: torch.nn.Module, optimizer: Any, **kwargs: Any) -> Watcher:
    """:func:`earlywarn.watch` for objects returned by ``accelerator.prepare``.

    ``kwargs``: everything :func:`earlywarn.watch` takes (``loader``, ``scheduler``, ``sinks``...).
    ``scaler`` defaults to the accelerator's GradScaler (fp16 runs).
    """
    inner = unwrap_optimizer(optimizer)
    scaler = kwargs.pop("scaler", None)
    if scaler is None:
        scaler = getattr(optimizer, "scaler", None) or getattr(accelerator, "scaler", None)
    bare = accelerator.unwrap_model(model) if accelerator is not None else model
    watcher = earlywarn.watch(bare, inner, scaler=scaler, **kwargs)
    repoint_accelerated_step(optimizer, inner)
    return watcher
