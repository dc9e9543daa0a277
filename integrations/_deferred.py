"""Decide a step early, apply it at ``optimizer.step``: for trainers that clip between the two.

The watcher takes its statistics inside ``optimizer.step``. Frameworks that call
``optimizer.step(closure)`` run backward *inside* that call, and clip gradients after the
"before optimizer step" hook: statistics taken at ``step`` would see clipped gradients (a
spike clipped to ``max_norm`` is no spike) or none at all (the closure has not run yet).

:class:`DeferredStep` splits the watcher's step in two: :meth:`observe` runs the watcher's
whole decision (statistics, one host read, detector, policy, skip / rewind / halt) at the hook,
on unclipped and unscaled gradients, but records the optimizer update instead of applying it;
the wrapper it installs on ``optimizer.step`` runs the closure first, then applies the recorded
decision. A step that the hook did not see (no hook call, e.g. outside the trainer) goes through
the watcher unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from earlywarn.guard import PendingStep, Watcher


class DeferredStep:
    """Installs itself on ``watcher.optimizer.step`` (over the watcher's own wrapper)."""

    def __init__(self, watcher: Watcher, scaler: "torch.amp.GradScaler | None" = None):
        self.watcher = watcher
        self.optimizer = watcher.optimizer
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        self._pending: PendingStep | None = None
        self._guarded: Callable[..., Any] = self.optimizer.step
        self.optimizer.step = self._step  # type: ignore[method-assign]

    def observe(self) -> None:
        """The watcher's decision for this step, now. Call once per optimizer step, after
        backward and before any gradient clipping."""
        w, opt = self.watcher, self.optimizer
        # A fused optimizer unscales inside its kernel, so its gradients are still scaled here:
        # hand the watcher the scale as GradScaler.step would (the norms are then unscaled).
        set_scale = self.scaler is not None and w._install.fused and getattr(opt, "grad_scale", None) is None
        if set_scale:
            opt.grad_scale = self.scaler._scale  # type: ignore[attr-defined, union-attr]
        try:
            self._pending = w.decide_step()
        finally:
            if set_scale:
                del opt.grad_scale

    def _step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's wrapper records
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # backward, the trainer's hook (-> observe), clipping
        pending, self._pending = self._pending, None
        if pending is None:
            out = self._guarded(**kwargs)
            return loss if closure is not None else out
        self.watcher.apply_step(pending, **kwargs)
        return loss

    # An LR scheduler built before this wrapper checks for its own marker on optimizer.step at its
    # first step ("optimizer.step() has been overridden after learning rate scheduler
    # initialization"): _step records the call the way the scheduler's wrapper would.
    _step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def remove(self) -> None:
        """Put the watcher's own wrapper back (before ``watcher.detach()``)."""
        if self.optimizer.__dict__.get("step") == self._step:
            self.optimizer.step = self._guarded  # type: ignore[method-assign]
        self._pending = None
