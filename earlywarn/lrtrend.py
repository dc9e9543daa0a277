"""The learning rate's own trend, as the policy reads it: a rise that takes the run past the rates
it trained at. Pure Python.

A warm-up, a one-cycle ramp and a warm restart rise too, but from the run's first steps or in one
jump; a schedule bug that multiplies the learning rate a little every step (or a ramp without
end) rises step after step from a rate the run had been training at for a long while. That rate
is the one to hold when the run shows trouble: not the highest the creep reached calmly, which
is already far too high by the time the loss moves.

Trouble comes late on its own: the detector's baselines follow a loss that worsens slowly, and
on the generated lr_climb runs (``benchmarks/rescue.py``) its warnings came 220-360 steps into
a climb of 1.8-2.6% a step, the rate 100-600x where it began; and a warning alone held healthy
warm restarts and cycles. So a creep is trouble, warned or not, once it has gone well past the
highest rate the run ever took and the loss is clearly worse than before it began: a rise that
helps, or leaves the loss where it was, goes on (on the dying climbs it fired at 2-360x the rate
they rose from, before the collapse). A factor left in the loop grows its steps with the rate; a
scheduled linear ramp (a cyclic schedule's rise) adds the same each step and may worsen the loss at its
top for a while: it is held only far beyond (``RAMP_BEYOND``). A factor left in the loop that has
gone far past every rate the run took is held whatever the loss says (``CREEP_FAR``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Mapping

RISE_HISTORY = 50
"""A rise counts as a creep only when the run had trained this many steps before it began (a
warm-up or a one-cycle ramp rises from the first steps)."""

RISE_STEPS = 10
"""... and the learning rate has risen this many steps in a row (a jump or a restart rises once)."""

RISE_RATIO = 1.2
"""... and it is at least this many times the rate it rose from."""

BEYOND = 2.0
"""A creep at this many times the highest learning rate the run took before it began ..."""

LOSS_STEPS = 20
"""... with the mean loss of its last this-many steps above the mean of the this-many before
the rise by ``WORSE_SE`` standard errors of their difference (the per-step noise read from
step-to-step changes before the rise, robustly, so that the loss's own trend does not count as
noise) is trouble by itself."""

WORSE_SE = 3.0
"""See ``LOSS_STEPS``. A re-warm-up's loss bumps up as its rate rises, then improves: at one
standard error two of 21 healthy re-warm-ups on ``benchmarks/rescue.py`` (held-out seed 23) were
rewound; at three none of 63 re-warm-ups and cycles on three seed bases, and the rule still met
every one of 19 dying climbs (later on some: 39x where one error met it at 6x)."""


RAMP_BEYOND = 10.0
"""A creep that adds the same amount every step (its last ``RISE_STEPS`` increments within
``RAMP_EVEN`` of each other) is a scheduled linear ramp -- a cyclic schedule's rise, a linear
re-warm-up -- and is trouble only past this many times the highest rate the run took before it:
such a rise ends where the schedule turns, and its loss may worsen at its top and recover as it
comes down (a healthy cycle 1x to 7x over 54 steps was rewound so, at 6.9x). A factor left in the
loop grows its increments with the rate (1.01x a step: 10% over 10 steps); a ramp without end is
caught past this."""

RAMP_EVEN = 0.02
"""See ``RAMP_BEYOND``."""

CREEP_FAR = 16.0
"""A creep that grows its own steps (not a linear ramp: a factor left in the loop) this many times
past the highest rate the run took before it is held at the rate it rose from whatever the loss
says (:attr:`LrTrend.far`; no rewind: nothing is known to be damaged; the loss rule still rewinds
if the loss turns worse later). No schedule rises so -- a warm-up or a one-cycle ramp rises from
the first steps, a restart in one jump, a cycle or a linear re-warm-up adds the same each step, and
a re-warm-up that multiplies goes to ~10x and stops -- and the loss is a late witness: on
``benchmarks/rescue.py``'s climbs (13 seed bases) the loss rule alone met 60 of 76 dying runs, some
at 40-360x, and ten never, their train loss no worse than before the climb (one better than its
twin's) while the model the climb left was worse; with this, 71 (at 8x: 75, but a multiplying
re-warm-up to 10x would be held)."""


class LrTrend:
    """``trend.push(lr, loss)`` every step; :attr:`creeping`, :attr:`stalled`, :attr:`far` and
    :attr:`calm_lr` say where it stands; :attr:`held` is the policy's mark that it held this rise
    (:attr:`capped`: that it held it gone far, without a rewind). State: the step count, the
    previous LR, how many steps in a row it rose, the rate it rose from (NaN: no rise under way,
    or one from too early in the run to have a calm rate), the highest LR taken before the rise
    and ever, the last ``LOSS_STEPS`` losses, the loss's level and noise before the rise, the
    run's first loss, and the last few rates."""

    def __init__(self) -> None:
        self.seen = 0
        self.prev = math.nan
        self.rising = 0
        self.calm_lr = math.nan  # the rate the current rise began from
        self.peak = 0.0  # the highest LR taken so far
        self.peak_before = math.nan  # ... before the current rise began
        self.losses: deque[float] = deque(maxlen=LOSS_STEPS)
        self.level = (math.nan, math.nan)  # the mean loss before the rise, the standard error a change of it has
        self.held = False  # the policy held the learning rate for this rise already
        self.capped = False  # ... for this rise gone far (:attr:`far`), with no rewind
        self.first_loss = math.nan  # the run's first finite loss: what it knew at the start
        self.fine_at = 0  # the step count when a creep's loss was last within one error of its level
        self.recent: deque[float] = deque(maxlen=RISE_STEPS + 1)  # the last learning rates

    def push(self, lr: float, loss: float = math.nan) -> None:
        if not lr == lr:
            return
        if lr > self.prev:  # (False while prev is NaN)
            if self.rising == 0:
                self.calm_lr = self.prev if self.seen >= RISE_HISTORY and self.prev > 0.0 else math.nan
                self.peak_before = self.peak
                self.level = _level(self.losses) if self.calm_lr == self.calm_lr else (math.nan, math.nan)
                self.held = self.capped = False
            self.rising += 1
        else:
            self.rising, self.calm_lr, self.held, self.capped = 0, math.nan, False, False
        self.prev = lr
        self.recent.append(lr)
        self.peak = max(self.peak, lr)
        self.seen += 1
        if math.isfinite(loss):
            self.losses.append(loss)
            if self.first_loss != self.first_loss:
                self.first_loss = loss
        if self.rising >= RISE_STEPS and self.calm_lr == self.calm_lr:  # a creep (rare): where the loss was
            mean, err = self.level  # last no worse than before it (a warm-up has no level: nothing to read)
            if self.rising == RISE_STEPS or not self.losses or not math.fsum(self.losses) / len(self.losses) > mean + err:
                self.fine_at = self.seen

    @property
    def creeping(self) -> bool:
        """The learning rate has risen step after step, past the rate the run trained at before."""
        return self.rising >= RISE_STEPS and self.prev >= RISE_RATIO * self.calm_lr  # (False on NaN)

    @property
    def worse_for(self) -> int:
        """Steps since the creep's loss was last within one standard error of its level (the
        worsening a rewind goes back before)."""
        return self.seen - self.fine_at

    @property
    def stalled(self) -> bool:
        """A creep ``BEYOND`` the highest rate the run took before it, with the loss worse than
        before the rise (``LOSS_STEPS``, ``WORSE_SE``): trouble, warned or not."""
        mean, err = self.level
        return (self.creeping and self.prev >= BEYOND * self.peak_before and len(self.losses) == LOSS_STEPS
                and math.fsum(self.losses) / LOSS_STEPS > mean + WORSE_SE * err  # (False on NaN)
                and (not self._linear() or self.prev >= RAMP_BEYOND * self.peak_before))

    @property
    def far(self) -> bool:
        """A creep that grows its own steps ``CREEP_FAR`` times past the highest rate the run took
        before it, whatever the loss."""
        return self.creeping and self.prev >= CREEP_FAR * self.peak_before and not self._linear()

    def _linear(self) -> bool:
        """The creep's last increments are all the same (``RAMP_EVEN``): a scheduled linear ramp."""
        r = list(self.recent)
        steps = [b - a for a, b in zip(r, r[1:])]
        return len(steps) == RISE_STEPS and min(steps) > 0.0 and max(steps) <= (1.0 + RAMP_EVEN) * min(steps)

    def state_dict(self) -> dict[str, Any]:
        nan_none = lambda v: None if v != v else v  # noqa: E731
        return {"seen": self.seen, "prev": nan_none(self.prev), "rising": self.rising, "calm_lr": nan_none(self.calm_lr),
                "peak": self.peak, "peak_before": nan_none(self.peak_before), "losses": list(self.losses),
                "level": [nan_none(v) for v in self.level], "held": self.held, "capped": self.capped,
                "first_loss": nan_none(self.first_loss), "fine_at": self.fine_at,
                "recent": list(self.recent)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        none_nan = lambda v: math.nan if v is None else float(v)  # noqa: E731
        self.seen = int(d.get("seen", 0))
        self.prev = none_nan(d.get("prev"))
        self.rising = int(d.get("rising", 0))
        self.calm_lr = none_nan(d.get("calm_lr"))
        self.peak = float(d.get("peak", 0.0))
        self.peak_before = none_nan(d.get("peak_before"))
        self.losses = deque((float(v) for v in d.get("losses", [])), maxlen=LOSS_STEPS)
        level = d.get("level") or (None, None)
        self.level = (none_nan(level[0]), none_nan(level[1]))
        self.held = bool(d.get("held", False))
        self.capped = bool(d.get("capped", False))
        self.first_loss = none_nan(d.get("first_loss"))
        self.fine_at = int(d.get("fine_at", 0))
        self.recent = deque((float(v) for v in d.get("recent", [])), maxlen=RISE_STEPS + 1)


def _level(losses: deque[float]) -> tuple[float, float]:
    """The mean of ``losses`` and the standard error of the difference between two such means (NaN
    until ``LOSS_STEPS`` are known)."""
    if len(losses) < LOSS_STEPS:
        return math.nan, math.nan
    xs = list(losses)
    diffs = [b - a for a, b in zip(xs, xs[1:])]
    mid = statistics.median(diffs)
    noise = 1.4826 * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2.0)  # one step's, from its changes
    return math.fsum(xs) / LOSS_STEPS, noise * math.sqrt(2.0 / LOSS_STEPS)
