"""The learning-rate ceiling: after an instability that an LR jump or a rising LR caused, the
optimizer steps at no more than the highest learning rate the run had survived, for as long as
the loop's own learning rate stays above it (an LR pulse ends, a ramp decays).

After a jump the ceiling warms back up: it doubles every ``rewarm`` calm steps while the loop's
learning rate is above it. A pulse ends long before it gets there; a jump the schedule meant (a
low-LR phase, then the real one) was only unstable for a step or two, and a flat ceiling held it
at the low phase's rate for the rest of the run. After a rising LR (the instability came at the
end of a climb, not one step after it) the ceiling stays flat: climbing again would meet it again.

It acts around each optimizer step only (every param group's ``lr`` scaled for the call and put
back right after), so whoever sets the learning rate -- a scheduler, the loop -- keeps its values,
and it lifts itself once the loop's learning rate has stayed within ``release`` times the ceiling
for ``settle`` steps in a row. One step back under it is not enough: a rewind that restores the
scheduler (or a loop that counts its schedule from ``ew.step``) sets the loop's learning rate back
below the ceiling for the few steps until its ramp passes it again.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from ..capture.updates import learning_rate


class LrCeiling:
    """``release``, ``settle``: the ceiling lifts once the loop's learning rate has been at most
    ``release`` times it for ``settle`` optimizer steps in a row. ``rewarm``: calm steps per
    doubling of a warming ceiling (one held with ``rewarm=True``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, release: float = 1.5, settle: int = 50,
                 rewarm: int = 10) -> None:
        self.optimizer = optimizer
        self.release = release
        self.settle = settle
        self.rewarm = rewarm
        self.ceiling: float | None = None
        self.warming = False  # the ceiling rises on calm steps (after a jump)
        self.calm = 0  # steps in a row with the loop's learning rate back within release x the ceiling

    def hold(self, ceiling: float, *, rewarm: bool = False) -> None:
        if not (math.isfinite(ceiling) and ceiling > 0.0):
            raise ValueError(f"an LR ceiling must be a finite number > 0, got {ceiling!r}")
        self.ceiling, self.calm, self.warming = ceiling, 0, rewarm

    def factor(self, lr: float | None) -> float:
        """What the loop's learning rate ``lr`` is scaled by now (1.0 without a ceiling over it)."""
        c = self.ceiling
        return 1.0 if c is None or lr is None or lr <= c else c / lr

    def after_step(self, lr: float | None, calm: bool = False) -> bool:
        """Lift the ceiling once the loop's learning rate (``lr``) has stayed back; True when it
        just did. ``calm``: the step was calm (no incident near it, nothing building), so a
        warming ceiling rises."""
        if self.ceiling is None:
            return False
        if self.warming and calm and lr is not None and lr > self.ceiling:
            self.ceiling *= 2.0 ** (1.0 / self.rewarm)
        self.calm = self.calm + 1 if lr is not None and lr <= self.release * self.ceiling else 0
        if self.calm >= self.settle:
            self.ceiling, self.calm, self.warming = None, 0, False
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
        return {"lr_ceiling": self.ceiling, "lr_ceiling_calm": self.calm, "lr_ceiling_warming": self.warming}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        c = d.get("lr_ceiling")
        self.ceiling = None if c is None else float(c)
        self.calm = int(d.get("lr_ceiling_calm", 0))
        self.warming = bool(d.get("lr_ceiling_warming", False))


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
