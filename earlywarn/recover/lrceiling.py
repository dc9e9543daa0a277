"""The learning-rate ceiling: after an instability that an LR jump or a rising LR caused, the
optimizer steps at no more than the highest learning rate the run had survived, for as long as
the loop's own learning rate stays above it (an LR pulse ends, a ramp decays).

It acts around each optimizer step only (every param group's ``lr`` scaled for the call and put
back right after), so whoever sets the learning rate -- a scheduler, the loop -- keeps its values,
and it lifts itself once the loop's learning rate is back within ``release`` times the ceiling.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from ..capture.updates import learning_rate


class LrCeiling:
    """``release``: the ceiling lifts once the loop's learning rate is at most this times it."""

    def __init__(self, optimizer: torch.optim.Optimizer, release: float = 1.5) -> None:
        self.optimizer = optimizer
        self.release = release
        self.ceiling: float | None = None

    def hold(self, ceiling: float) -> None:
        if not (math.isfinite(ceiling) and ceiling > 0.0):
            raise ValueError(f"an LR ceiling must be a finite number > 0, got {ceiling!r}")
        self.ceiling = ceiling

    def factor(self, lr: float | None) -> float:
        """What the loop's learning rate ``lr`` is scaled by now (1.0 without a ceiling over it)."""
        c = self.ceiling
        return 1.0 if c is None or lr is None or lr <= c else c / lr

    def after_step(self) -> bool:
        """Lift the ceiling once the loop's learning rate has come back; True when it just did."""
        if self.ceiling is None:
            return False
        lr = learning_rate(self.optimizer)
        if lr is not None and lr <= self.release * self.ceiling:
            self.ceiling = None
            return True
        return False

    def wrap_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the ceiling applied around it (one check when none is in force)."""
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.ceiling is None:
                return step_fn(*args, **kwargs)
            f = self.factor(learning_rate(self.optimizer))
            return step_fn(*args, **kwargs) if f == 1.0 else scaled_step(self.optimizer, f, step_fn, args, kwargs)
        return step

    def state_dict(self) -> dict[str, Any]:
        return {"lr_ceiling": self.ceiling}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        c = d.get("lr_ceiling")
        self.ceiling = None if c is None else float(c)


def scaled_step(optimizer: torch.optim.Optimizer, factor: float, step_fn: Callable[..., Any], args: Any,
                kwargs: Any) -> Any:
    """``step_fn(*args, **kwargs)`` with every param group's ``lr`` times ``factor``, put back after."""
    groups = optimizer.param_groups
    saved = []
    for g in groups:
        lr = g["lr"]
        if isinstance(lr, torch.Tensor):  # a tensor lr is held by compiled / capturable steps: in place
            saved.append(lr.clone())
            lr.mul_(factor)
        else:
            saved.append(lr)
            g["lr"] = lr * factor
    try:
        return step_fn(*args, **kwargs)
    finally:
        for g, lr in zip(groups, saved):
            if isinstance(lr, torch.Tensor):
                g["lr"].copy_(lr)
            else:
                g["lr"] = lr
