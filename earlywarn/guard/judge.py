"""Judging a step: its Observation -> one immutable :class:`Decision`, for every entry point.

The detector says what is wrong, a state scan (rare: only after a non-finite value) says whether
anything was written, the policy says what to do. Nothing is carried out here: the watcher
applies or skips the update and the responses (:mod:`earlywarn.guard.respond`) do the rest.

Two rules hold whatever the policy: optimizer state a repair left non-finite is never read by an
update (the step is rewound, or skipped when the rewind is not taken); and with ``dry_run`` the
decision acts on nothing -- what it would have done rides along (``Decision.would``) for the
responses to report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from earlywarn.detect import Observation, StreamingDetector
from earlywarn.events import Event
from earlywarn.guard.episode import Episode
from earlywarn.guard.statistics import SQ_OVERFLOW
from earlywarn.events import Kind
from earlywarn.policy import Action, Evidence, Policy, PolicyDecision


@dataclass(frozen=True)
class Decision:
    """What was seen at one step and what is to be done about it."""

    obs: Observation
    alerts: tuple[Event, ...]
    policy: PolicyDecision
    nonfinite: bool
    """A gradient held NaN/Inf."""
    overflow: bool
    """Finite, but a layer's squared norm overflows float32 (|g| >~ 1.8e19)."""
    loss_bad: bool
    """The reported loss is NaN/Inf."""
    scan: Any
    """The state scan of a non-finite step (None: not taken)."""
    bad_batch: bool
    """A non-finite step with the state verified finite: the batch's fault."""
    skip: bool
    """The update is not applied (sync: decided here; async: what the device flag skipped)."""
    clean_before: bool
    """No warning-or-worse alert in the clean window before this step: a copy taken now, before
    this step's update, is clean."""
    would: PolicyDecision | None = None
    """Dry run: what the policy decided (``policy`` then acts on nothing but copies)."""
    would_skip: bool = False
    """Dry run: the update would have been skipped."""

    @property
    def restores(self) -> bool:
        """The step ends in a rewind or an in-place repair instead of an update."""
        return Action.REWIND in self.policy or Action.REPAIR in self.policy

    @property
    def repair(self) -> bool:
        return Action.REPAIR in self.policy

    @property
    def halt(self) -> bool:
        return Action.HALT in self.policy

    @property
    def checkpoint(self) -> bool:
        """A warning copy now, before this step's update (the run is still clean)."""
        return Action.CHECKPOINT in self.policy and Action.REWIND not in self.policy

    @property
    def outlier(self) -> Event | None:
        """The GRAD_OUTLIER alert of a step skipped for it."""
        if not self.skip or self.nonfinite or self.overflow:
            return None
        return next((a for a in self.alerts if a.kind is Kind.GRAD_OUTLIER), None)


class Judge:
    """``judge(obs, layer_sq, episode) -> Decision``. ``recovery``: its state scan (one host read,
    only on a non-finite step) and the repair it could not finish (``unrepaired``); ``scaler``: a
    GradScaler owns non-finite steps (its overflow steps are routine, nothing to scan); ``late``:
    async mode, where the device already skipped exactly the non-finite steps and a finite step's
    update is applied before it is judged; ``dry_run``: decide, act on nothing."""

    def __init__(self, detector: StreamingDetector, policy: Policy, recovery: Any, *, scaler: bool, late: bool,
                 dry_run: bool = False):
        self.detector = detector
        self.policy = policy
        self._recovery = recovery
        self._scaler = scaler
        self._late = late
        self._dry = dry_run

    def __call__(self, obs: Observation, layer_sq: np.ndarray, counted: bool, step: int, episode: Episode) -> Decision:
        alerts = tuple(self.detector.observe(obs))
        if obs.extras:  # the user's attention logits (earlywarn.attention): reported ones only
            grown = self.policy.logits.push(obs.step, obs.extras)
            if grown is not None:
                alerts += (grown,)
        # the global norm is finite iff every layer's is (a recount's non-finite elements show in it)
        nonfinite = not obs.grad_finite if counted else not math.isfinite(obs.grad_norm)
        loss_bad = obs.loss is not None and not math.isfinite(obs.loss)
        # no layer's square can overflow unless their sum does
        overflow = (not nonfinite and obs.grad_norm * obs.grad_norm > SQ_OVERFLOW
                    and bool(np.any(layer_sq > SQ_OVERFLOW)))
        scan = None
        if loss_bad or (nonfinite and not self._scaler):
            # Rare path: was anything written? Finite parameters and optimizer state mean the bad
            # step was never applied: one bad batch, skipped, not a reason to rewind.
            scan = self._recovery.scan()
        left = self._recovery.unrepaired  # a repair that could not make the state finite
        if left is not None and scan is None:
            scan = left.after
        # Finite state proves the bad step was never applied: skipping it is safe, whatever came
        # before (an instability that goes on is the streak's and the divergence rule's to answer).
        state_finite = None if scan is None else not (scan.weights_poisoned or scan.state_poisoned)
        repairable = scan is not None and scan.state_poisoned and not scan.params_poisoned
        lr = obs.extras.get("lr", math.nan)
        loss = math.nan if obs.loss is None else obs.loss
        norm = math.nan if obs.grad_norm is None else obs.grad_norm
        if alerts or overflow or scan is not None or self.policy.watching:
            policy = self.policy.decide(obs.step, alerts, Evidence(*self.detector.ratios(), lr, loss, norm),
                                        state_finite=state_finite, skipped=overflow, repairable=repairable,
                                        unrepaired=_left(left))
        else:
            policy = self.policy.calm(lr, loss)  # most steps: nothing to decide, no evidence to build
        # async: a policy SKIP cannot be honoured, the update was queued before it was judged
        wanted = Action.SKIP in policy and not self._late or loss_bad and not self._late
        skip = nonfinite or overflow or wanted or Action.REPAIR in policy or left is not None
        decision = Decision(obs=obs, alerts=alerts, policy=policy, nonfinite=nonfinite, overflow=overflow,
                            loss_bad=loss_bad, scan=scan, bad_batch=bool(state_finite) and Action.REPAIR not in policy,
                            skip=skip, clean_before=episode.clean(step - 1))
        if self._dry and (skip or policy.actions):
            # copies are all a dry run takes (they touch nothing); the rest is reported as not done
            acts = tuple(a for a in policy.actions if a is Action.CHECKPOINT)
            decision = replace(decision, skip=False, would=policy, would_skip=skip, policy=replace(
                policy, actions=acts, suppressed=(), rewind_triggers=(), halt_reason=None, lr_ceiling=None,
                hold_lr_at_target=False, clip_factor=None, lr_hold=None))
        return decision


def _left(report: Any) -> str:
    """What a repair left non-finite, and why (``""``: nothing)."""
    if report is None:
        return ""
    told = [str(a) for a in report.unrepaired]
    return "; ".join(told) if told else report.after.summary()
