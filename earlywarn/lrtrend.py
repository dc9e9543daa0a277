"""The learning rate's own trend, as the policy reads it: a rise that takes the run past the rates
it trained at. Pure Python.

A warm-up, a one-cycle ramp and a warm restart rise too, but from the run's first steps or in one
jump; a schedule bug that multiplies the learning rate a little every step (or a ramp without
end) rises step after step from a rate the run had been training at for a long while. That rate
is the one to hold when the run shows trouble: not the highest the creep reached calmly, which
is already far too high by the time the loss moves.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

RISE_HISTORY = 50
"""A rise counts as a creep only when the run had trained this many steps before it began (a
warm-up or a one-cycle ramp rises from the first steps)."""

RISE_STEPS = 10
"""... and the learning rate has risen this many steps in a row (a jump or a restart rises once)."""

RISE_RATIO = 1.2
"""... and it is at least this many times the rate it rose from."""


class LrTrend:
    """``trend.push(lr)`` every step; :attr:`creeping` and :attr:`calm_lr` say where it stands.
    State: the step count, the previous LR, how many steps in a row it rose and the rate it rose
    from (NaN: no rise under way, or one from too early in the run to have a calm rate)."""

    def __init__(self) -> None:
        self.seen = 0
        self.prev = math.nan
        self.rising = 0
        self.calm_lr = math.nan  # the rate the current rise began from

    def push(self, lr: float) -> None:
        if not lr == lr:
            return
        if lr > self.prev:  # (False while prev is NaN)
            if self.rising == 0:
                self.calm_lr = self.prev if self.seen >= RISE_HISTORY and self.prev > 0.0 else math.nan
            self.rising += 1
        else:
            self.rising, self.calm_lr = 0, math.nan
        self.prev = lr
        self.seen += 1

    @property
    def creeping(self) -> bool:
        """The learning rate has risen step after step, past the rate the run trained at before."""
        return self.rising >= RISE_STEPS and self.prev >= RISE_RATIO * self.calm_lr  # (False on NaN)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "prev": None if self.prev != self.prev else self.prev, "rising": self.rising,
                "calm_lr": None if self.calm_lr != self.calm_lr else self.calm_lr}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.seen = int(d.get("seen", 0))
        self.prev = math.nan if d.get("prev") is None else float(d["prev"])
        self.rising = int(d.get("rising", 0))
        self.calm_lr = math.nan if d.get("calm_lr") is None else float(d["calm_lr"])
