"""Where earlywarn sits: ``optimizer.step`` (and ``scaler.step``) of one optimizer, and how a
decided update is applied.

``optimizer.step`` becomes a plain function bound to the optimizer (:func:`_watched_step`) that
finds its watcher on the optimizer, so wrappers that rebind ``optimizer.step.__func__`` (LR
schedulers do) keep working, and :meth:`Installation.remove` puts everything back exactly.

An update is described by an :class:`Update` before it runs: whether the optimizer's ``step`` is
called at all, and the device skip flag (``found_inf``) a fused optimizer reads. Skipping is never
"multiply by 0" (``0 * NaN = NaN``): a non-fused step is simply not called, a fused one skips
inside its kernel.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

_BELOW = "_earlywarn_step_below"  # the optimizer's own `step` attribute before earlywarn installed itself


@dataclass(frozen=True)
class PendingStep:
    """A decided update: whether to run the optimizer, and the device skip flag a fused
    optimizer gets (``None`` for the others). :meth:`Watcher.decide_step` returns one;
    :meth:`Watcher.apply_step` runs it."""

    apply: bool
    found_inf: torch.Tensor | None
    tag: Any = None  # async mode: the step recovery records once the update is applied


Update = PendingStep
NO_UPDATE = PendingStep(apply=False, found_inf=None)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    # torch's fused Adam/AdamW/SGD honour `optimizer.found_inf` inside the kernel: a sync-free skip.
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
        return False
    return all(bool(g.get("fused")) for g in optimizer.param_groups)


class Installation:
    """earlywarn on ``optimizer.step`` and ``scaler.step``; ``real_step`` is what stepped the
    optimizer before (an LR scheduler's wrapper, a compiled step, or the class's own), wrapped
    by ``wrap`` (recovery lowers the learning rate around it while a recurrence asks)."""

    def __init__(self, watcher: Any, optimizer: torch.optim.Optimizer, scaler: Any,
                 wrap: Callable[[Callable[..., Any]], Callable[..., Any]], *, fused: bool, flag_device: torch.device):
        self.optimizer = optimizer
        self.scaler = scaler
        self.fused = fused
        self.dry_run = bool(watcher.config.dry_run)  # every update as the loop asks: no skip flag either
        self._sgd = isinstance(optimizer, torch.optim.SGD)  # (its first skipped fused step is special: _fused_step)
        self._flag_device = flag_device
        self._flags: tuple[torch.Tensor, torch.Tensor] | None = None  # found_inf constants, made once
        self._updates: tuple[PendingStep, PendingStep] | None = None  # (apply, skip) of a sync step
        self.scaler_decided: bool | None = None  # scaler.step decided this step (skip?) before its inner step()
        below = _step_below(optimizer)
        self.real_step = wrap(below if below is not None else types.MethodType(type(optimizer).step, optimizer))
        # An instance attribute shadows the class's step; remove() deletes it again.
        optimizer.step = types.MethodType(_watched_step_fn(), optimizer)  # type: ignore[method-assign]
        optimizer._earlywarn_watcher = watcher  # type: ignore[attr-defined]
        if scaler is not None:
            self._had_scaler_attr = "step" in scaler.__dict__
            self._prev_scaler_step = scaler.__dict__.get("step")
            self.real_scaler_step = scaler.step
            scaler.step = watcher._scaler_step  # type: ignore[method-assign]

    # -- what an update is -------------------------------------------------------------------------
    def update(self, skip: "bool | torch.Tensor", record: Any = None) -> PendingStep:
        """The update for a decided step: ``skip`` from the host (sync) or a device flag (async)."""
        if self.dry_run:
            return PendingStep(True, None, record)
        if isinstance(skip, torch.Tensor):
            return PendingStep(True, skip, record)
        if record is None:  # (sync mode: the two updates made once, as the flags are)
            if self._updates is None:
                self._updates = (self._make(False, None), self._make(True, None))
            return self._updates[int(skip)]
        return self._make(skip, record)

    def _make(self, skip: bool, record: Any) -> PendingStep:
        if self.fused:  # the kernel reads the flag: one code path for applied and skipped steps
            return PendingStep(True, self._flag(skip), record)
        return PendingStep(not skip, None, record)

    def run(self, update: PendingStep, args: tuple, kwargs: dict) -> Any:
        if not update.apply:
            return None
        if update.found_inf is None:
            return self.real_step(*args, **kwargs)
        return self._fused_step(update.found_inf, args, kwargs)

    def _flag(self, skip: bool) -> torch.Tensor:
        # On the CPU unless every parameter is on CUDA: the fused step copies found_inf to each
        # parameter's device with non_blocking=True, and a non-blocking copy to the CPU is read
        # before it lands.
        if self._flags is None:
            dev = self._flag_device
            self._flags = (torch.zeros((), device=dev), torch.ones((), device=dev))
        return self._flags[int(skip)]

    def _fused_step(self, found: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        opt = self.optimizer
        prior = getattr(opt, "found_inf", None)  # GradScaler's own flag, for fused optimizers
        if isinstance(prior, torch.Tensor):
            # GradScaler's found_inf is a *sum* over devices (2.0 on two); the fused kernels skip
            # only when it == 1 (and _fused_adam then subtracts it from `step`): 0 or 1, nothing else.
            found = ((found + prior.to(found.device, found.dtype)) > 0).to(found.dtype)
        if self._sgd and _first_step_with_momentum(opt) and bool(found.item()):
            # A skipped first fused-SGD step leaves the momentum buffers torch just allocated
            # uninitialised (empty_like): decide on the host (one read, first step only).
            return None
        opt.found_inf = found  # type: ignore[attr-defined]
        try:
            return self.real_step(*args, **kwargs)
        finally:
            if prior is None:
                del opt.found_inf
            else:
                opt.found_inf = prior  # type: ignore[attr-defined]

    # -- removal -----------------------------------------------------------------------------------
    def remove(self, watcher: Any) -> None:
        opt = self.optimizer
        if _is_watched_step(opt.__dict__.get("step")):
            below = opt.__dict__.pop(_BELOW, None)
            if below is not None:
                opt.step = below  # type: ignore[method-assign]
            else:
                del opt.step
        # else: someone wrapped our step (an LR scheduler created later); it now passes through
        # to the step that was there before earlywarn (kept under _BELOW; None: the class's).
        opt.__dict__.pop("_earlywarn_watcher", None)
        scaler = self.scaler
        if scaler is not None and scaler.__dict__.get("step") == watcher._scaler_step:
            if self._had_scaler_attr:
                scaler.step = self._prev_scaler_step  # type: ignore[method-assign]
            else:
                del scaler.step


def _first_step_with_momentum(opt: torch.optim.Optimizer) -> bool:
    return not opt.state and any(g.get("momentum", 0) != 0 for g in opt.param_groups)


def _watched_step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step`` while watched. A plain function bound to the optimizer: an LR scheduler
    created after ``watch()`` rebinds ``optimizer.step.__func__`` to the optimizer, and any other
    wrapper that calls it finds its watcher here (or, once detached, the step that was below)."""
    if _is_compiling():
        # torch.compile(optimizer.step) after watch() must not trace the host-side guard (numpy,
        # Python control flow): dynamo runs it eagerly instead. Only while tracing: the
        # compiler.disable wrapper costs 10-25 us a step in eager mode, on caches backward emptied.
        return _EAGER_STEP(optimizer, *args, **kwargs)
    optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's own wrapper records
    watcher = optimizer.__dict__.get("_earlywarn_watcher")
    if watcher is not None:
        return watcher._optimizer_step(args, kwargs)
    below = optimizer.__dict__.get(_BELOW)
    if below is not None:
        return below(*args, **kwargs)
    return type(optimizer).step(optimizer, *args, **kwargs)


_is_compiling = torch.compiler.is_compiling
_EAGER_STEP: Any = None  # _watched_step as dynamo's tracing meets it: run eagerly, never traced


def _watched_step_fn() -> Any:
    global _EAGER_STEP
    if _EAGER_STEP is None:  # made at the first watch(), not while dynamo traces a step
        _EAGER_STEP = torch.compiler.disable(_watched_step)
        # LR schedulers check this marker (and wrap the step to set _opt_called, which
        # _watched_step does itself): a scheduler built before watch() must not warn that
        # "optimizer.step() has been overridden after learning rate scheduler initialization".
        _watched_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return _watched_step


def _is_watched_step(fn: Any) -> bool:
    return getattr(fn, "__func__", None) is _watched_step


def _step_below(optimizer: torch.optim.Optimizer) -> Any:
    """What really steps the optimizer under earlywarn: the instance ``step`` that was there when
    earlywarn first attached (an LR scheduler's wrapper, a compiled step), or None for the class's.
    Re-watching an optimizer whose step was wrapped over ours keeps the first one."""
    d = optimizer.__dict__
    if _BELOW not in d:
        current = d.get("step")
        d[_BELOW] = current if current is not None and not _is_watched_step(current) else None
    return d[_BELOW]
