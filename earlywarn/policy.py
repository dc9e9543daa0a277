"""Alerts -> actions, with hysteresis, cooldowns and rate limits. Pure Python.

The detector says what is wrong; the policy decides what to do about it, once, and not again every
step the condition persists. Call :meth:`Policy.decide` on every step (with an empty list when
the detector raised nothing): the cooldowns count those calls, i.e. steps as the run lives them,
including steps replayed after a rewind. The actions themselves (saving, skipping, rewinding,
halting) are carried out by the guard and ``earlywarn.recover``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple

from earlywarn.attention import LogitWatch
from earlywarn.events import Event, Kind, Level
from earlywarn.lrtrend import LOSS_STEPS, LrTrend
from earlywarn.outlier_rules import (  # noqa: F401 (the rules' constants, importable from here too)
    BURST_AGAIN_NOTE, BURST_END_DROP, BURST_END_LOSS, BURST_END_LOST, BURST_END_TRAINED, BURST_END_WITHIN,
    BURST_HEAL_FALL, BURST_HEAL_STEPS, HEAL_MEAN, RUN_ELEMENT_RMS,
    CLIMB_GROWTH, CLIMB_NOTE, CLIMB_STEPS, IDLE_NOTE, IDLE_STEP_CAP, OUTLIER_GROWTH, TAIL_BOUND, TAIL_DAMAGE,
    TAIL_LOSS, TAIL_NOTE, TAIL_RECALL, TAIL_SEEN, TAIL_SIGNAL_NOTE, TAIL_SIGNAL_Z, TAIL_WATCH, damaged, loss_at_level,
    loss_jump, outlier_note)
from earlywarn.policy_config import SEVERITY, Action, PolicyConfig

__all__ = ["Action", "Evidence", "Policy", "PolicyConfig", "PolicyDecision"]

_KIND_FIELD = {
    Kind.NONFINITE_GRAD: "on_nonfinite_grad",
    Kind.COLLAPSE_RISK: "on_collapse_risk",
    Kind.LOSS_NONFINITE: "on_loss_nonfinite",
    Kind.LOSS_DIVERGED: "on_loss_diverged",
    Kind.GRAD_SPIKE: "on_grad_spike",
    Kind.GRAD_OUTLIER: "on_grad_outlier",
    Kind.SCALER_OVERFLOW: "on_scaler_overflow",
}


def _with_state(action: Action, kind: Kind, state_finite: bool | None) -> Action:
    """A non-finite alert's action once the state check is known: finite state -> no rewind (one
    bad batch, nothing was written); poisoned state -> no mere skip (it cannot fix it)."""
    if kind not in (Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE) or state_finite is None:
        return action
    if state_finite and action is Action.REWIND:
        return Action.SKIP
    if not state_finite and action is Action.SKIP:
        return Action.REWIND
    return action


def _size(ev: "Evidence") -> float:
    """The step's gradient size a run of outliers is followed by: its norm, or where a caller
    knows only the ratio, that (the same within a run whose baseline holds)."""
    return ev.grad_norm if ev.grad_norm == ev.grad_norm else ev.grad_ratio


def _progress_lost(loss: float, level: float, first: float) -> float:
    """The fraction of the progress from the run's ``first`` loss down to ``level`` that ``loss`` has
    lost (NaN where the loss is not positive, or did not fall)."""
    return (loss - level) / (first - level) if first > level > 0.0 else math.nan


class Evidence(NamedTuple):
    """What the policy reads of a step besides its alerts (NaN: not known, e.g. before a baseline)."""

    grad_ratio: float = math.nan
    """The global gradient norm over its typical value."""
    loss_ratio: float = math.nan
    """The loss over its typical value (as the detector's loss channel tracks it)."""
    lr: float = math.nan
    """The learning rate the step takes."""
    loss: float = math.nan
    """The step's loss as reported (the learning rate's trend reads it)."""
    grad_norm: float = math.nan
    """The global gradient norm itself: a run of outliers ends where it falls (its ratio also falls
    where the detector's baseline moves to the run's level)."""


@dataclass(frozen=True)
class PolicyDecision:
    """Everything :meth:`Policy.decide` decided at one step (nothing is read off the policy after)."""

    actions: tuple[Action, ...] = ()
    """Most drastic first; empty for none."""
    reasons: tuple[str, ...] = ()
    """One line per action, and per action wanted and not taken."""
    suppressed: tuple[str, ...] = ()
    """The lines of rewinds that were wanted and not taken (a cooldown): the guard says why."""
    rewind_triggers: tuple[str, ...] = ()
    """What asked for this step's rewind or repair (alert kinds, ``"nonfinite_streak"``, or
    ``"state_left"``: a repair left the optimizer state non-finite)."""
    halt_reason: str | None = None
    """Why this step halts."""
    nonfinite_streak: int = 0
    """Non-finite steps in a row up to this one (before a granted rewind starts it over)."""
    onset_back: int = 0
    """A rewind's incident began this many steps back, this one counted (1: this step; 0: the
    alerts say when); the rewind goes back to before it."""
    lr_ceiling: float | None = None
    """After this step's rewind, step at no more than this learning rate while the loop's is above it."""
    hold_lr_at_target: bool = False
    """After this step's rewind, step at no more than the learning rate of the restored state while
    the loop's is above it (a divergence a rising learning rate led into)."""
    clip_factor: float | None = None
    """Scale this step's gradients by this before its update (a persistent outlier, clipped)."""
    clip_note: str = ""
    """Why an outlier's step is clipped (or skipped), when it is not one more of a run of them."""
    hold_rest: bool = False
    """Keep what this step's bound takes off its gradient (the run's first outlier with the loss at
    its level: a rare large gradient of the run's own, or a corrupted one): it is added to the
    gradient of the next such outlier taken as the run's heavy tail (``add_held``), else let go."""
    add_held: bool = False
    """Add the rest kept at ``hold_rest`` to this step's gradient before its update: the outlier it
    came from was the first of the run's heavy tail."""
    clip_rms: float | None = None
    """The clip bounds each element of the gradient: to at most this many times its running RMS
    where the optimizer keeps one, never under ``clip_factor`` (:mod:`earlywarn.guard.bound`).
    None: the whole scaled by ``clip_factor``."""
    lr_copy: bool = False
    """Save a clean copy now, before this step's update (an LR jump the next steps will judge)."""
    lr_hold: float | None = None
    """From this step on, step at no more than this learning rate while the loop's is above it: the
    rate the run trained at before its learning rate crept up into this trouble, or a lower one
    for attention logits that grew (flat, no warming)."""
    lr_hold_why: str = ""
    """Why ``lr_hold`` (the ``lr_hold`` event says it)."""

    def __contains__(self, action: object) -> bool:
        return action in self.actions

    @property
    def first(self) -> Action:
        """The most drastic action (``Action.NONE`` when there is none)."""
        return self.actions[0] if self.actions else Action.NONE


_NOTHING = PolicyDecision()  # a calm step's decision (immutable: one for all)

_NONFINITE_KINDS = frozenset({str(Kind.NONFINITE_GRAD), str(Kind.LOSS_NONFINITE)})


class Policy:
    """``policy.decide(step, alerts, evidence) -> PolicyDecision``. ``scale_free``: the optimizer's
    step hardly depends on the gradient's scale (:func:`earlywarn.capture.updates.scale_free`). The policy's own state (cooldowns,
    rate limits, the non-finite streak, the run of outliers, the latest abnormal update, the LR
    jump under watch) is declared in ``__init__`` and saved by :meth:`state_dict`."""

    def __init__(self, cfg: PolicyConfig | None = None, *, scale_free: bool = True):
        self.cfg = cfg if cfg is not None else PolicyConfig()
        # the optimizer's step hardly depends on the gradient's scale (Adam, not plain SGD): a run of
        # outliers is held at outlier_clip_ratio; for plain SGD the bound grows (OUTLIER_GROWTH)
        self.scale_free = scale_free
        if not isinstance(self.cfg, PolicyConfig):
            raise TypeError(f"Policy(cfg=...) wants a PolicyConfig, got {type(cfg).__name__}")
        self.tick = 0
        self.nonfinite_streak = 0
        self.last_checkpoint = -(1 << 60)
        self.last_warning = -(1 << 60)
        self.checkpoints: deque[int] = deque()
        self.last_rewind = -(1 << 60)
        self.rewinds: deque[int] = deque()
        self.outliers = 0  # outliers since the gradient was last under outlier_clip_ratio x typical
        self.climb = math.nan  # in a run that climbed into the outliers: the ratio it has reached (CLIMB_GROWTH)
        # the run's heavy tail (TAIL_LOSS): outliers with the loss at its level seen, the largest, the
        # tick the latest was taken, and whether one taken was followed by damage (never again)
        self.tail_seen, self.tail_max, self.tail_taken, self.tail_revoked = 0, 0.0, None, False
        # (tick, ratio) of the outlier whose bounded rest the guard keeps (TAIL_RECALL; not in
        # state_dict: the rest itself is not saved)
        self.tail_held: tuple[int, float] | None = None
        self.tail_loss = 0.0  # the highest loss ratio among the tail's outliers
        self.run_start: int | None = None  # tick of the run's first outlier
        self.trained_on: int | None = None  # tick the run, past the skip budget, was first trained on (BURST_END_*)
        # the run's gradient norms so far (BURST_END_DROP): (the sum of their logs, how many, the last one's log)
        self.run_level: tuple[float, int, float] = (0.0, 0, 0.0)
        # the typical gradient norm and the loss's level before the run (NaN: not known): the
        # detector's move to a run it takes as its new normal (readapt_steps)
        self.run_before: tuple[float, float] = (math.nan, math.nan)
        self.burst_rewound: int | None = None  # tick of the latest rewind to before a burst (BURST_END_*)
        # a run ended with the loss damaged, watched for BURST_HEAL_STEPS: (the run's first tick, its
        # end's, the loss's level before it, the run's first loss) and the losses since
        self.burst_watch: tuple[int, int, float, float] | None = None
        self.burst_losses: list[float] = []
        self.big_applied: int | None = None  # tick of the latest update applied with an outlier-sized gradient
        self.abnormal: int | None = None  # tick of the latest abnormal update applied (an outlier, an LR jump)
        # an LR jump under watch: (tick its watch began, tick of the jump, the highest LR survived before it)
        self.probe: tuple[int, int, float] | None = None
        self.lrs: deque[tuple[int, float]] = deque(maxlen=self.cfg.divergence_lookback + 16)  # (tick, LR taken)
        self.lr_trend = LrTrend()  # a learning rate creeping up past the rates the run trained at
        self.logits = LogitWatch()  # the attention logits the user reports (earlywarn.attention)
        self.logit_lr = math.nan  # the rate the latest LOGIT_GROWTH lowered the learning rate to

    def decide(self, step: int, alerts: Iterable[Event], evidence: Evidence = Evidence(), *,
               state_finite: bool | None = None, skipped: bool = False, repairable: bool = False,
               unrepaired: str = "") -> PolicyDecision:
        """``state_finite``: on a step with a non-finite loss or gradient, whether the guard found
        parameters and optimizer state finite (``None``: not checked). ``True``: the bad step was
        never applied and a lone non-finite step is one bad batch -- a rewind it would ask for
        becomes a skip (the streak rule, ``rewind_after_nonfinite``, still applies). ``False``:
        the state is poisoned already -- a skip becomes a rewind. ``repairable``: only the
        optimizer state is poisoned (parameters finite): a rewind asked for by the non-finite
        alerts alone becomes a REPAIR in place, which counts toward no rewind limit (the streak
        starts over: the repair acted on what made the steps non-finite). ``skipped``: the guard
        skips this step for a reason of its own (a finite gradient whose square overflows): it
        counts toward the streak like a non-finite one (a state that gives every batch such a
        gradient is broken). ``evidence``: the step's gradient and loss over their typical values.
        ``unrepaired``: what a repair left non-finite (and why): no update may read it, a rewind
        is wanted (the guard skips the step when the rewind is not taken)."""
        cfg = self.cfg
        self.tick += 1
        t = self.tick
        alerts = list(alerts)
        if self.tail_held is not None and (t - self.tail_held[0] > TAIL_RECALL or self.tail_revoked):
            self.tail_held = None
        held = self.tail_held
        wanted: dict[Action, str] = {}
        reasons: list[str] = []
        triggers: list[str] = []
        back, ceiling, lr_copy, hold_target, clip, clip_note, rms = 0, None, False, False, None, "", None
        if evidence.lr == evidence.lr:
            self.lrs.append((t, evidence.lr))
            self.lr_trend.push(evidence.lr, evidence.loss)
        nonfinite_now = warned_now = False
        for a in alerts:
            field = _KIND_FIELD.get(a.kind)
            if field is None:
                continue  # action / outcome events are not the policy's input
            nonfinite_now |= a.kind in (Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE)
            warned_now |= a.kind is Kind.COLLAPSE_RISK
            action = _with_state(getattr(cfg, field), a.kind, state_finite)
            if a.kind is Kind.GRAD_OUTLIER:
                # (the trend holds this step's loss last when it took it: a known LR, a finite loss)
                pushed = evidence.lr == evidence.lr and math.isfinite(evidence.loss)
                action, clip, clip_note, rms = self._outlier(a, action, t, self.lr_trend.losses if pushed else ())
            elif a.kind is Kind.LOSS_DIVERGED and action is Action.REWIND:
                action, back, hold_target = self._divergence(a, t, reasons)
            elif a.kind is Kind.COLLAPSE_RISK and "lr_ref" in a.values and cfg.lr_probe_steps:
                lr_copy = self.probe is None  # a new jump: the state before it; one still in force has its copy
                self.probe = self._jump(t, float(a.values["lr_ref"]))
            if action is Action.REWIND:
                triggers.append(str(a.kind))
            if action is not Action.NONE:
                wanted.setdefault(action, f"{a.kind} ({a.level}) at step {a.step}")

        if unrepaired:
            triggers.append("state_left")
            wanted.setdefault(Action.REWIND, f"the optimizer state a repair left non-finite ({unrepaired})")
        self.nonfinite_streak = self.nonfinite_streak + 1 if (nonfinite_now or skipped) else 0
        streak = self.nonfinite_streak
        if cfg.rewind_after_nonfinite and streak >= cfg.rewind_after_nonfinite:
            triggers.append("nonfinite_streak")
            wanted.setdefault(Action.REWIND, f"{streak} non-finite steps in a row")
        if self.probe is not None and self.probe[0] != t:
            probe_back, ceiling = self._probe(alerts, evidence, t, nonfinite_now or skipped)
            if self.probe is not None and evidence.lr <= 2.0 * self.probe[2]:
                self.probe = None  # the learning rate came back: the jump is over, taken calmly
            if probe_back:
                triggers.append("lr_jump")
                wanted.setdefault(Action.REWIND, f"the run became unstable {probe_back - 1} step(s) after "
                                                 "a learning-rate jump")
                back = max(back, probe_back)

        # (judged on the steps between the tail's outliers: theirs is the tail's own loss)
        if self.tail_taken is not None and 0 < t - self.tail_taken <= TAIL_WATCH and (
                nonfinite_now or any(a.kind is Kind.LOSS_DIVERGED for a in alerts)
                or evidence.loss_ratio >= TAIL_DAMAGE and not any(a.kind is Kind.GRAD_OUTLIER for a in alerts)):
            self.tail_revoked = True  # taking the run's tail damaged it: such outliers are skipped again
            reasons.append(f"outliers with the loss at its level are bounded again: the loss rose after one taken at "
                           f"step {self.tail_taken}")
        hold, hold_why = None, ""
        trend = self.lr_trend
        if trend.stalled and not trend.held:
            # the learning rate crept up into a worse loss: back to the rate it rose from, not the
            # highest it took calmly (a warning alone held healthy warm restarts and cycles)
            hold, ceiling, trend.held = trend.calm_lr, None, True
            # and back to before the loss began to worsen: its steps at the highest rates did the damage
            triggers.append("lr_creep")
            wanted.setdefault(Action.REWIND, "the learning rate crept up into a worse loss")
            back = max(back, trend.worse_for + LOSS_STEPS)
            hold_why = (f"it crept up {trend.rising} steps in a row to {trend.prev / hold:.3g}x the rate the run "
                        f"trained at before ({trend.prev / trend.peak_before:.3g}x the highest it had taken) while the "
                        f"loss got worse than before it began to rise (mean of the last {LOSS_STEPS} steps); held at "
                        "the rate it rose from")
            reasons.append(f"learning rate held at {hold:.3g}: {hold_why}")
        elif trend.far and not trend.held and not trend.capped:
            # a factor left in the loop, gone far: no schedule rises so, and the loss may never say
            hold, trend.capped = trend.calm_lr, True
            hold_why = (f"it crept up {trend.rising} steps in a row, each step larger than the last, to "
                        f"{trend.prev / hold:.3g}x the rate the run trained at before ({trend.prev / trend.peak_before:.3g}x "
                        "the highest it had taken): no schedule rises so; held at the rate it rose from")
            reasons.append(f"learning rate held at {hold:.3g}: {hold_why}")
        grown = next((a for a in alerts if a.kind is Kind.LOGIT_GROWTH), None)
        if grown is not None and hold is None and cfg.logit_lr_factor < 1.0 and evidence.lr > 0.0:
            # a rate too high for the model: lower it, again at each doubling of the logit
            rate = min(evidence.lr, self.logit_lr) if self.logit_lr == self.logit_lr else evidence.lr
            hold = self.logit_lr = cfg.logit_lr_factor * rate
            hold_why = (f"the attention logits grew to {grown.values.get('value', math.nan):.3g} at {rate:.3g} "
                        "(attention-logit growth)")
            reasons.append(f"learning rate held at {hold:.3g}: {hold_why}")
        if self.trained_on is not None and self.burst_watch is None and Action.REWIND not in wanted:
            self._burst_end(alerts, evidence, t)
        if self.burst_watch is not None and Action.REWIND not in wanted:
            burst_back, why = self._burst_healed(evidence, t)
            if burst_back:
                self.burst_rewound = t
                triggers.append("burst_end")
                wanted[Action.REWIND] = why
                back = max(back, burst_back)
        reasons += self._checkpoint(wanted, warned_now, t)
        suppressed: tuple[str, ...] = ()
        if Action.REWIND in wanted:
            if repairable and set(triggers) <= _NONFINITE_KINDS:
                # only the optimizer state is poisoned: repaired in place, no rewind to count
                wanted[Action.REPAIR] = wanted.pop(Action.REWIND)
                self.nonfinite_streak = 0
            else:
                note = self._rewind(wanted, t)
                if note:
                    reasons.append(note)
                    suppressed = (note,)
        actions = tuple(sorted(wanted, key=SEVERITY.__getitem__, reverse=True))
        self._after(actions, alerts, t, nonfinite_now or skipped, evidence)
        restores = Action.REWIND in wanted or Action.REPAIR in wanted
        bounded_first = self.tail_held is not None and self.tail_held[0] == t
        hold_rest = bounded_first and Action.CLIP in wanted and not restores
        if bounded_first and not hold_rest:
            self.tail_held = None  # this step's bound is not applied: no rest is kept
        return PolicyDecision(
            actions=actions, reasons=tuple(f"{a.value}: {wanted[a]}" for a in actions) + tuple(reasons),
            suppressed=suppressed, rewind_triggers=tuple(triggers) if restores else (),
            halt_reason=wanted.get(Action.HALT), nonfinite_streak=streak,
            onset_back=back if Action.REWIND in wanted else 0,
            lr_ceiling=ceiling if Action.REWIND in wanted else None, lr_copy=lr_copy and not restores,
            hold_lr_at_target=hold_target and Action.REWIND in wanted and ceiling is None and hold is None,
            lr_hold=hold, lr_hold_why=hold_why if hold is not None else "",
            clip_factor=clip if Action.CLIP in wanted and not restores else None,
            clip_rms=rms if Action.CLIP in wanted and not restores else None,
            hold_rest=hold_rest,
            add_held=self._rest_joins(held, alerts, t) and not restores and not any(
                a in wanted for a in (Action.SKIP, Action.HALT)),
            clip_note=clip_note if (clip is not None and Action.CLIP in wanted or Action.SKIP in wanted) and not restores
            else "")

    def _rest_joins(self, held: tuple[int, float] | None, alerts: list[Event], t: int) -> bool:
        """The rest kept from the first outlier with the loss at its level goes with the next one
        taken as the run's heavy tail (this step), where the first was of the tail's size: a
        gradient corrupted 1e4x, then a rare reward, is no tail of its own."""
        if held is None or self.tail_taken != t:
            return False
        ratio = next((a.values.get("ratio", math.nan) for a in alerts if a.kind is Kind.GRAD_OUTLIER), math.nan)
        return held[1] <= TAIL_BOUND * ratio  # (False on NaN)

    # -- the rules that read more than one alert -----------------------------------------------
    def _outlier(self, a: Event, action: Action, t: int,
                 losses: Iterable[float] = ()) -> tuple[Action, float | None, str, float | None]:
        """An outlier is taken, bounded (``on_grad_outlier="clip"``), or skipped first
        (``"skip"``); the run's own kinds of outlier have rules of their own (-> the action, the
        factor the gradients are scaled by, why, and the bound of each element in running RMS: the
        first of a run ``bound``, the rest ``RUN_ELEMENT_RMS``, never under the whole's factor).
        ``losses``: the run's latest losses, this step's last (empty: not known)."""
        self.outliers += 1
        if self.outliers == 1:
            self.run_start = t
        ratio = a.values.get("ratio", math.nan)
        if action not in (Action.CLIP, Action.SKIP):  # a configured response of another kind: as configured
            return action, None, "", None
        if a.values.get("joined", 0.0):
            # a part of the model starts or resumes training: the run's own step; one that resumes
            # (idle experts may come back at any step) is bounded
            if a.values.get("idle", 0.0) and ratio > IDLE_STEP_CAP:
                return Action.CLIP, IDLE_STEP_CAP / ratio, IDLE_NOTE, None
            return Action.NONE, None, "", None
        if self.big_applied is not None and t - self.big_applied <= 3:
            return Action.NONE, None, "", None  # the run recovering from its own large update: let it
        loss = a.values.get("loss_ratio", math.nan)
        at_level = loss_at_level(loss, ratio)  # (False on NaN)
        known = self.tail_seen >= TAIL_SEEN
        # the loss at its level, or (a tail known) within twice the loss its outliers had (False on NaN)
        # (the first outlier of a run, or one more of a run whose outliers were all the tail's)
        if ((at_level or known and loss <= 2.0 * self.tail_loss) and not self.tail_revoked and ratio == ratio
                and (self.outliers == 1 or self.tail_taken == t - 1)):
            self.tail_loss = max(self.tail_loss, loss)
            if known:
                cap = TAIL_BOUND * self.tail_max
                self.tail_taken, self.tail_max, self.tail_held = t, max(self.tail_max, min(ratio, cap)), None
                return (Action.NONE, None, TAIL_NOTE, None) if ratio <= cap else (Action.CLIP, cap / ratio, TAIL_NOTE, None)
            self.tail_seen += 1
            self.tail_max = max(self.tail_max, ratio)
            if self.outliers == 1 and loss_jump(losses) >= TAIL_SIGNAL_Z:  # (at its level: no tail known)
                self.tail_taken = t  # the batch moved a loss that had all but stood still: the run's signal
                return Action.NONE, None, TAIL_SIGNAL_NOTE, None
        prev = a.values.get("prev_ratio", 1.0)
        if (self.outliers == 1 and prev >= self.cfg.outlier_clip_ratio
                and a.values.get("prev_elevated", 0.0) >= CLIMB_STEPS and ratio <= CLIMB_GROWTH * prev):
            self.climb = prev  # the run climbed here: from now on its growth is bounded
        if self.climb == self.climb:
            allowed = CLIMB_GROWTH * self.climb
            self.climb = min(ratio, allowed) if ratio == ratio else allowed
            return (Action.NONE, None, "", None) if ratio <= allowed else (Action.CLIP, allowed / ratio, CLIMB_NOTE, None)
        if self.burst_rewound is not None and t - self.burst_rewound <= BURST_END_WITHIN:
            action = Action.SKIP  # a burst was rewound just now: more of it is the same bad data, not the run's
        if action is Action.SKIP and self.outliers <= self.cfg.outlier_skips:
            return action, None, BURST_AGAIN_NOTE if action is not self.cfg.on_grad_outlier else "", None
        if self.trained_on is None:
            self.trained_on = t
        # a steady bound keeps a burst from inflating a scale-free optimizer's second moment (the
        # first of a run element by element; one whose loss says the batch is wrong, or in a run
        # whose heavy tail did damage, does one ordinary step); a plain SGD step grows with the regime
        k = self.outliers - 1
        first_at_level = k == 0 and at_level and not self.tail_revoked
        if not self.scale_free:
            bound = OUTLIER_GROWTH ** k
        elif k == 0 and not first_at_level:
            bound = 1.0
        else:
            bound = self.cfg.outlier_clip_ratio
        if not (ratio == ratio and ratio > bound):
            return Action.NONE, None, "", None
        if first_at_level and self.scale_free:
            self.tail_held = (t, ratio)  # the rest kept: it may be the run's heavy tail
        # (the rest of a run: each element may take half an ordinary step, so that none is all but frozen)
        return (Action.CLIP, bound / ratio, outlier_note(int(a.values.get("steps", 1.0)), bound, self.scale_free),
                bound if k == 0 else RUN_ELEMENT_RMS if self.scale_free else None)

    def _burst_end(self, alerts: list[Event], ev: Evidence, t: int) -> None:
        """A run trained on past the skip budget that ends in one step -- its gradient
        ``BURST_END_DROP`` times under its level in the run and under the step before's, and no
        outlier any more (a model that forgot data it had memorized meets it again at outlier
        size) -- with the loss ``BURST_END_LOSS`` times its level before the run or more (or
        ``BURST_END_LOST`` of the run's progress lost), trained on for ``BURST_END_TRAINED`` steps
        or more and within ``BURST_END_WITHIN`` steps of its start (the detector's baselines are
        still the run's before): a burst of bad batches that damaged the model, or a phase of other
        data the run recovers from. Watched for ``BURST_HEAL_STEPS`` (:meth:`_burst_healed`); the run
        itself is ended the step after, unless an outlier there shows the end was a dip (:meth:`_after`)."""
        start, (logs, n, last) = self.run_start, self.run_level
        if (start is None or self.trained_on is None or t - start >= BURST_END_WITHIN
                or t - self.trained_on < BURST_END_TRAINED or not n or not _size(ev) > 0.0
                or any(a.kind is Kind.GRAD_OUTLIER for a in alerts)):
            return
        # against the loss's level before the run: the detector's moved to a run it took as its new normal
        level, ratio = ev.loss / ev.loss_ratio, ev.loss_ratio
        before = self.run_before[1]
        if before == before and before > 0.0:
            level, ratio = before, ev.loss / before
        first = self.lr_trend.first_loss
        if not damaged(ratio, _progress_lost(ev.loss, level, first)):
            return
        level_in_run = logs / n
        fell = math.log(_size(ev) * BURST_END_DROP)
        if fell <= level_in_run and fell <= last:
            self.burst_watch, self.burst_losses = (start, t, level, first), []

    def _burst_healed(self, ev: Evidence, t: int) -> tuple[int, str]:
        """A run that ended with the loss damaged, ``BURST_HEAL_STEPS`` later: the loss (the mean
        of the last ``HEAL_MEAN`` steps) damaged still -> (steps back to before the run, why);
        recovered (a phase of other data the run has come back from), or still falling fast with
        under half the run's progress lost (a new stage being learned, ``BURST_HEAL_FALL``) -> (0, "")."""
        start, end, level, first = self.burst_watch  # type: ignore[misc]
        if ev.loss == ev.loss:
            self.burst_losses.append(ev.loss)  # (BURST_HEAL_STEPS of them at most: judged then)
        if t - end < BURST_HEAL_STEPS:
            return 0, ""
        self.burst_watch = None
        losses, self.burst_losses = self.burst_losses, []
        last = losses[-HEAL_MEAN:]
        now = sum(last) / len(last) if last else math.nan
        # (a loss that is not positive has no ratio to its level: the detector's own, this step's)
        ratio = now / level if level > 0.0 else ev.loss_ratio
        lost = _progress_lost(now, level, first)
        if not damaged(ratio, lost):
            return 0, ""
        if lost < BURST_END_LOST and len(losses) >= 2 * HEAL_MEAN and level > 0.0:
            early = sum(losses[:HEAL_MEAN]) / HEAL_MEAN
            if now - level <= BURST_HEAL_FALL * (early - level):
                return 0, ""  # far above a memorized level, but falling fast: a new stage being learned
        return t - start + 1, (f"a run of {end - start} steps of outlier gradients, trained on bounded, ended in one "
                               f"step at step {end} with the loss damaged, and {t - end} steps later it is still "
                               f"{ratio:.3g}x its level before the run"
                               + (f", {lost:.0%} of the run's progress lost" if lost == lost else "")
                               + ": a burst of bad batches that damaged the model (a phase of other data is "
                               "recovered from by then)")

    def _divergence(self, a: Event, t: int, reasons: list[str]) -> tuple[Action, int, bool]:
        """A loss far above its level is rewound only when the run's own updates led into it: an
        abnormal update before its rise (back to before it), or a learning rate that rose into it
        (holding it at the restored state's). -> (action, steps back to the onset, hold the LR)."""
        cfg = self.cfg
        onset = t - int(a.values.get("steps", 1.0)) + 1
        ab = self.abnormal
        if ab is not None and onset - cfg.divergence_lookback <= ab < onset:
            return Action.REWIND, t - ab + 1, False
        before = [(k, lr) for k, lr in self.lrs if onset - cfg.divergence_lookback <= k <= onset]
        if before and before[0][1] > 0.0:
            top = max(lr for _, lr in before)
            reached = next(k for k, lr in before if lr >= 0.95 * top)
            if top >= cfg.lr_rise_ratio * before[0][1] and onset - reached < cfg.lr_rise_settle:
                return Action.REWIND, 0, True
        reasons.append(f"no rewind for {a.kind} at step {a.step}: the loss rose with no abnormal update and no "
                       "rising learning rate before it (a change in the data?); a rewind would meet the same data again")
        return Action.NONE, 0, False

    def _jump(self, t: int, survived: float) -> tuple[int, int, float]:
        """An LR jump: watched from now; a jump still in force (the alert repeats while the LR stays
        up) keeps its first step and the LR survived before it, where a rewind goes back to."""
        p = self.probe
        return (t, t, survived) if p is None else (t, p[1], p[2])

    def _probe(self, alerts: list[Event], ev: Evidence, t: int, bad: bool) -> tuple[int, float | None]:
        """The steps after an LR jump: unstable -> (steps back to the jump, the LR to hold)."""
        cfg = self.cfg
        t0, first, survived = self.probe  # type: ignore[misc]
        if t - t0 > cfg.lr_probe_steps:
            return 0, None  # taken calmly so far (the LR still up: a repeated alert watches again)
        unstable = (bad or ev.grad_ratio >= cfg.lr_probe_grad_ratio or ev.loss_ratio >= cfg.lr_probe_loss_ratio
                    or any(x.level >= Level.WARNING and x.kind in _KIND_FIELD for x in alerts))
        if not unstable:
            return 0, None
        self.probe = None
        return t - first, survived if survived == survived and survived > 0 else None

    @property
    def run_unjudged(self) -> bool:
        """A run of outliers is in progress (also once the detector took it as its new normal and
        its steps raise no alert) or its end is watched (``BURST_HEAL_STEPS``): no copy of these
        steps is clean. A rewind at a burst's end goes back to before it; clean copies taken
        meanwhile would push that one out of the ring."""
        return self.run_start is not None or self.burst_watch is not None

    @property
    def watching(self) -> bool:
        """A step without alerts still needs :meth:`decide`: a learning-rate jump is being watched,
        or a non-finite streak or a run of outliers is to be ended (that needs the step's gradient
        ratio), or a learning rate creeps up with nothing held yet (:attr:`LrTrend.stalled`).
        Otherwise :meth:`calm` answers it."""
        return (self.probe is not None or self.nonfinite_streak != 0 or self.outliers != 0
                or self.burst_watch is not None
                or self.lr_trend.creeping and not self.lr_trend.held
                or self.tail_taken is not None and self.tick - self.tail_taken < TAIL_WATCH and not self.tail_revoked)

    def calm(self, lr: float = math.nan, loss: float = math.nan) -> PolicyDecision:
        """:meth:`decide` of a step with no alerts and nothing skipped while nothing is
        :attr:`watching` (most steps): the same bookkeeping and the same decision, without
        building the evidence. ``lr``: the learning rate the step takes, ``loss`` its loss (NaN:
        unknown)."""
        self.tick += 1
        if lr == lr:
            self.lrs.append((self.tick, lr))
            self.lr_trend.push(lr, loss)
        return _NOTHING  # (no run of outliers to end: that is watched)

    def _after(self, actions: tuple[Action, ...], alerts: list[Event], t: int, bad: bool, ev: Evidence) -> None:
        """What the update of this step (when it is applied) leaves for later judgements."""
        kinds = {a.kind for a in alerts}
        watch = self.burst_watch
        if watch is not None and watch[1] == t - 1 and self.run_start is not None and Kind.GRAD_OUTLIER in kinds:
            # an outlier again the step after the run's end: that end was a dip inside the run, which goes on
            self.burst_watch, self.burst_losses = None, []
        if (Kind.GRAD_OUTLIER not in kinds and not ev.grad_ratio >= self.cfg.outlier_clip_ratio
                and not self._at_run_level(ev, t)):
            if watch is None or watch[1] != t:  # (a run's end judged at this step: confirmed at the next)
                self._end_run()  # the gradient is back near its typical norm
        elif self.outliers and 0.0 < _size(ev) < math.inf:  # (an empty batch's 0 is no level)
            logs, n, _ = self.run_level
            log = math.log(_size(ev))
            self.run_level = (logs + log, n + 1, log)
            if n == 0:  # the run's first step: the detector's levels are still those before it (NaN stays NaN)
                self.run_before = (ev.grad_norm / ev.grad_ratio if ev.grad_ratio > 0.0 else math.nan,
                                   ev.loss / ev.loss_ratio if ev.loss_ratio > 0.0 else math.nan)
        if bad or any(a in actions for a in (Action.SKIP, Action.REWIND, Action.REPAIR, Action.HALT)):
            if Action.REWIND in actions:  # the trajectory after it is undone
                self.abnormal, self.probe, self.big_applied, self.burst_watch = None, None, None, None
                self.tail_held = None
                self._end_run()
                self.lrs.clear()
            return
        # (a climb's steps are the run's regime, bounded: not abnormal, not a large update to recover from)
        # (the run's heavy tail is its own kind of step; a run taken bounded outgrew its bound: its regime)
        applied = (Kind.GRAD_OUTLIER in kinds and Action.CLIP not in actions and self.climb != self.climb
                   and self.tail_taken != t and self.trained_on is None)
        if applied or self.probe is not None and self.probe[1] == t:
            self.abnormal = t  # an outlier or an LR jump applied in full: a loss that rises after it is the run's
        if applied:
            self.big_applied = t  # an outlier-sized update of the run's own: what follows may be its recovery

    def _at_run_level(self, ev: Evidence, t: int) -> bool:
        """A run the detector took as its new normal (its baseline re-anchored: no outlier any more)
        whose gradient norm is still ``outlier_clip_ratio`` times the typical norm before the run
        or more -- where the run would go on had the baseline stayed: still the run, its end still
        to be judged (``BURST_END_*``) within ``BURST_END_WITHIN`` steps of its start. Only where
        the norm is known: a ratio alone falls as much where the run ends as where its baseline moved."""
        typical = self.run_before[0]
        return (self.run_start is not None and t - self.run_start < BURST_END_WITHIN
                and ev.grad_norm >= self.cfg.outlier_clip_ratio * typical)  # (False on NaN)

    def _end_run(self) -> None:
        """No run of outliers in progress any more: every field of one back as ``__init__`` sets it."""
        self.outliers, self.climb, self.run_start, self.trained_on = 0, math.nan, None, None
        self.run_level, self.run_before = (0.0, 0, 0.0), (math.nan, math.nan)

    def _checkpoint(self, wanted: dict[Action, str], warned_now: bool, t: int) -> list[str]:
        """Cooldown, hysteresis and rate limit of warning checkpoints; the lines of those not taken."""
        cfg, reasons = self.cfg, []
        if Action.CHECKPOINT in wanted:
            why = wanted.pop(Action.CHECKPOINT)
            while self.checkpoints and t - self.checkpoints[0] >= cfg.checkpoint_window:
                self.checkpoints.popleft()
            quiet = t - self.last_warning - 1  # steps since the previous warning
            if t - self.last_checkpoint < cfg.checkpoint_cooldown:
                reasons.append(f"no checkpoint for {why}: cooldown ({t - self.last_checkpoint} < "
                               f"{cfg.checkpoint_cooldown} steps since the last)")
            elif self.last_checkpoint > -(1 << 59) and quiet < cfg.checkpoint_rearm and warned_now:
                reasons.append(f"no checkpoint for {why}: not re-armed ({quiet} quiet steps < "
                               f"{cfg.checkpoint_rearm})")
            elif len(self.checkpoints) >= cfg.max_checkpoints:
                reasons.append(f"no checkpoint for {why}: rate limit ({cfg.max_checkpoints} per "
                               f"{cfg.checkpoint_window} steps)")
            else:
                wanted[Action.CHECKPOINT] = why
                self.last_checkpoint = t
                self.checkpoints.append(t)
        if warned_now:
            self.last_warning = t
        return reasons

    def _rewind(self, wanted: dict[Action, str], t: int) -> str | None:
        """Cooldown, then the limit that turns a rewind into a halt; the line of a rewind not taken."""
        cfg = self.cfg
        why = wanted.pop(Action.REWIND)
        while self.rewinds and t - self.rewinds[0] >= cfg.rewind_window:
            self.rewinds.popleft()
        if t - self.last_rewind <= cfg.rewind_cooldown:
            return (f"no rewind for {why}: cooldown ({t - self.last_rewind} <= "
                    f"{cfg.rewind_cooldown} steps since the last; PolicyConfig.rewind_cooldown)")
        if len(self.rewinds) >= cfg.max_rewinds_per_window:
            wanted.setdefault(Action.HALT, f"{why}, but already {len(self.rewinds)} rewinds within "
                                           f"{cfg.rewind_window} steps (PolicyConfig.max_rewinds_per_window="
                                           f"{cfg.max_rewinds_per_window})")
            return None
        wanted[Action.REWIND] = why
        self.last_rewind = t
        self.rewinds.append(t)
        self.nonfinite_streak = 0
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"tick": self.tick, "nonfinite_streak": self.nonfinite_streak,
                "last_checkpoint": self.last_checkpoint, "last_warning": self.last_warning,
                "checkpoints": list(self.checkpoints), "last_rewind": self.last_rewind,
                "rewinds": list(self.rewinds), "outliers": self.outliers,
                "climb": None if self.climb != self.climb else self.climb,
                "big_applied": self.big_applied, "run_start": self.run_start, "trained_on": self.trained_on,
                "run_level": list(self.run_level), "run_before": [None if v != v else v for v in self.run_before],
                "burst_rewound": self.burst_rewound,
                "burst_watch": None if self.burst_watch is None else [*self.burst_watch, self.burst_losses], "tail": [self.tail_seen, self.tail_max, self.tail_taken,
                                                              self.tail_revoked, self.tail_loss],
                "abnormal": self.abnormal, "probe": None if self.probe is None else list(self.probe),
                "lrs": [list(x) for x in self.lrs], "lr_trend": self.lr_trend.state_dict(),
                "logits": self.logits.state_dict(), "logit_lr": None if self.logit_lr != self.logit_lr else self.logit_lr}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.tick = int(d["tick"])
        self.nonfinite_streak = int(d["nonfinite_streak"])
        self.last_checkpoint = int(d["last_checkpoint"])
        self.last_warning = int(d["last_warning"])
        self.checkpoints = deque(int(v) for v in d["checkpoints"])
        self.last_rewind = int(d["last_rewind"])
        self.rewinds = deque(int(v) for v in d["rewinds"])
        self.outliers = int(d.get("outliers", 0))
        self.climb = math.nan if d.get("climb") is None else float(d["climb"])
        self.big_applied = None if d.get("big_applied") is None else int(d["big_applied"])
        self.run_start = None if d.get("run_start") is None else int(d["run_start"])
        self.trained_on = None if d.get("trained_on") is None else int(d["trained_on"])
        self.burst_rewound = None if d.get("burst_rewound") is None else int(d["burst_rewound"])
        watch = d.get("burst_watch")
        self.burst_watch = None if watch is None else (int(watch[0]), int(watch[1]), float(watch[2]), float(watch[3]))
        self.burst_losses = [] if watch is None else [float(x) for x in watch[4]]
        logs, n, last = d.get("run_level", (0.0, 0, 0.0))
        self.run_level = (float(logs), int(n), float(last))
        typical, level = d.get("run_before", (None, None))
        self.run_before = (math.nan if typical is None else float(typical), math.nan if level is None else float(level))
        seen, top, taken, revoked, tail_loss = d.get("tail", (0, 0.0, None, False, 0.0))
        self.tail_seen, self.tail_max, self.tail_loss = int(seen), float(top), float(tail_loss)
        self.tail_taken, self.tail_revoked = (None if taken is None else int(taken)), bool(revoked)
        self.abnormal = None if d.get("abnormal") is None else int(d["abnormal"])
        probe = d.get("probe")
        self.probe = None if probe is None else (int(probe[0]), int(probe[1]), float(probe[2]))
        self.lrs.clear()
        self.lrs.extend((int(k), float(lr)) for k, lr in d.get("lrs", []))
        self.lr_trend.load_state_dict(d.get("lr_trend", {}))
        self.logits.load_state_dict(d.get("logits", {}))
        self.logit_lr = math.nan if d.get("logit_lr") is None else float(d["logit_lr"])
