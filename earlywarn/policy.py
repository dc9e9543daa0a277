"""Alerts -> actions, with hysteresis, cooldowns and rate limits. Pure Python.

The detector says what is wrong; the policy decides what to do about it, once, and not again every
step the condition persists. Call :meth:`Policy.decide` on every step (with an empty list when
the detector raised nothing): the cooldowns count those calls, i.e. steps as the run lives them,
including steps replayed after a rewind. The actions themselves (saving, skipping, rewinding,
halting) are carried out by the guard and ``earlywarn.recover``.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Mapping

from earlywarn._renamed import renamed
from earlywarn.events import Event, Kind

__all__ = ["Action", "Policy", "PolicyConfig", "PolicyDecision"]


class Action(str, enum.Enum):
    """What the guard should do at this step, least to most drastic."""

    NONE = "none"
    CHECKPOINT = "checkpoint"
    SKIP = "skip"
    REPAIR = "repair"
    REWIND = "rewind"
    HALT = "halt"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "Action | str") -> "Action":
        if isinstance(value, Action):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"unknown action {value!r}: use one of "
                             f"{', '.join(a.value for a in cls)}") from None


_SEVERITY = {Action.NONE: 0, Action.CHECKPOINT: 1, Action.SKIP: 2, Action.REPAIR: 3, Action.REWIND: 4, Action.HALT: 5}


@renamed("max_rewinds", "max_rewinds_per_window")
@dataclass
class PolicyConfig:
    """How alerts become actions. Counts of steps are counts of :meth:`Policy.decide` calls."""

    on_nonfinite_grad: Action | str = Action.SKIP
    """NONFINITE_GRAD (critical): skip the step. The guard skips non-finite steps regardless;
    this keeps the decision visible and counts toward ``rewind_after_nonfinite``."""

    on_collapse_risk: Action | str = Action.CHECKPOINT
    """COLLAPSE_RISK (warning): save a checkpoint while the weights are still clean, so a later
    rewind loses little. Subject to ``checkpoint_cooldown``, ``checkpoint_rearm`` and the rate
    limit."""

    on_loss_nonfinite: Action | str = Action.REWIND
    """LOSS_NONFINITE (critical): the weights are suspect; rewind to the last clean checkpoint.
    The guard checks first: when parameters and optimizer state are finite the bad step was
    never applied and one batch is at fault -- it skips that step, quarantines the batch and
    withdraws the rewind (:meth:`Policy.withdraw_rewind`)."""

    on_loss_diverged: Action | str = Action.REWIND
    """LOSS_DIVERGED (critical): a divergence that did not recover; rewind."""

    on_grad_spike: Action | str = Action.NONE
    """GRAD_SPIKE (info): an isolated spike that already recovered; nothing to do."""

    on_scaler_overflow: Action | str = Action.NONE
    """SCALER_OVERFLOW (info): the fp16 scaler already skipped the step and lowered its scale."""

    rewind_after_nonfinite: int = 3
    """Consecutive steps with a non-finite gradient or loss (or a gradient the guard skips as
    too large) after which skipping is not enough and the policy rewinds (the run, not one
    batch, is broken). 0 disables."""

    checkpoint_cooldown: int = 200
    """Minimum steps between two warning checkpoints (a spiky phase must not write one per
    step)."""

    checkpoint_rearm: int = 50
    """Hysteresis: after a warning checkpoint, this many steps without any warning must pass
    before a new warning may checkpoint again, even once the cooldown is over."""

    max_checkpoints: int = 10
    """At most this many warning checkpoints within ``checkpoint_window`` steps."""

    checkpoint_window: int = 10_000
    """Window of the checkpoint rate limit, in steps."""

    rewind_cooldown: int = 0
    """After a rewind, rewind triggers are ignored for this many steps; the guard then says so
    in an event. 0: none -- a rewind restores the detector too, so a trigger right after it is
    news, and an instability that comes back is the recovery's to diagnose (a recurrence),
    which a cooldown would only hide."""

    max_rewinds_per_window: int = 3
    """More than this many rewinds within ``rewind_window`` steps halts the run instead: it keeps
    failing the same way and needs a person (lower LR, inspect data). (Rewinds of one episode
    are ``RecoveryConfig.max_rewinds_per_episode``.)"""

    rewind_window: int = 2_000
    """Window of the rewind limit, in steps."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.startswith("on_"):
                try:
                    setattr(self, f.name, Action.parse(getattr(self, f.name)))
                except ValueError as e:
                    raise ValueError(f"PolicyConfig.{f.name}={getattr(self, f.name)!r} is invalid: {e}") from None
                if getattr(self, f.name) is Action.REPAIR:
                    raise ValueError(f"PolicyConfig.{f.name}='repair' is invalid: a repair is the guard's answer to "
                                     "poisoned optimizer state; use none, checkpoint, skip, rewind or halt")
        for name in ("rewind_after_nonfinite", "checkpoint_cooldown", "checkpoint_rearm",
                     "max_checkpoints", "checkpoint_window", "rewind_cooldown", "max_rewinds_per_window",
                     "rewind_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PolicyConfig.{name}={v!r} is invalid: use an int >= 0")
        for name in ("checkpoint_window", "rewind_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"PolicyConfig.{name}={getattr(self, name)!r} is invalid: use a window of >= 1 step")

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Action) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyConfig":
        known = {f.name for f in fields(cls)} | {"max_rewinds"}  # the deprecated name still loads
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"PolicyConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(d))


_KIND_FIELD = {
    Kind.NONFINITE_GRAD: "on_nonfinite_grad",
    Kind.COLLAPSE_RISK: "on_collapse_risk",
    Kind.LOSS_NONFINITE: "on_loss_nonfinite",
    Kind.LOSS_DIVERGED: "on_loss_diverged",
    Kind.GRAD_SPIKE: "on_grad_spike",
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
    """What asked for this step's rewind or repair (alert kinds, or ``"nonfinite_streak"``)."""
    halt_reason: str | None = None
    """Why this step halts."""
    nonfinite_streak: int = 0
    """Non-finite steps in a row up to this one (before a granted rewind starts it over)."""

    def __contains__(self, action: object) -> bool:
        return action in self.actions

    @property
    def first(self) -> Action:
        """The most drastic action (``Action.NONE`` when there is none)."""
        return self.actions[0] if self.actions else Action.NONE


_NONFINITE_KINDS = frozenset({str(Kind.NONFINITE_GRAD), str(Kind.LOSS_NONFINITE)})


class Policy:
    """``policy.decide(step, alerts) -> PolicyDecision``. The policy's own state (cooldowns, rate
    limits, the non-finite streak) is declared in ``__init__`` and saved by :meth:`state_dict`."""

    def __init__(self, cfg: PolicyConfig | None = None):
        self.cfg = cfg if cfg is not None else PolicyConfig()
        if not isinstance(self.cfg, PolicyConfig):
            raise TypeError(f"Policy(cfg=...) wants a PolicyConfig, got {type(cfg).__name__}")
        self.tick = 0
        self.nonfinite_streak = 0
        self.last_checkpoint = -(1 << 60)
        self.last_warning = -(1 << 60)
        self.checkpoints: deque[int] = deque()
        self.last_rewind = -(1 << 60)
        self.rewinds: deque[int] = deque()

    def decide(self, step: int, alerts: Iterable[Event], *, state_finite: bool | None = None,
               skipped: bool = False, repairable: bool = False) -> PolicyDecision:
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
        gradient is broken)."""
        cfg = self.cfg
        self.tick += 1
        t = self.tick
        wanted: dict[Action, str] = {}
        triggers: list[str] = []
        nonfinite_now = warned_now = False
        for a in alerts:
            field = _KIND_FIELD.get(a.kind)
            if field is None:
                continue  # action / outcome events are not the policy's input
            nonfinite_now |= a.kind in (Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE)
            warned_now |= a.kind is Kind.COLLAPSE_RISK
            action = _with_state(getattr(cfg, field), a.kind, state_finite)
            if action is Action.REWIND:
                triggers.append(str(a.kind))
            if action is not Action.NONE:
                wanted.setdefault(action, f"{a.kind} ({a.level}) at step {a.step}")

        self.nonfinite_streak = self.nonfinite_streak + 1 if (nonfinite_now or skipped) else 0
        streak = self.nonfinite_streak
        if cfg.rewind_after_nonfinite and streak >= cfg.rewind_after_nonfinite:
            triggers.append("nonfinite_streak")
            wanted.setdefault(Action.REWIND, f"{streak} non-finite steps in a row")

        reasons = self._checkpoint(wanted, warned_now, t)
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
        actions = tuple(sorted(wanted, key=_SEVERITY.__getitem__, reverse=True))
        return PolicyDecision(
            actions=actions, reasons=tuple(f"{a.value}: {wanted[a]}" for a in actions) + tuple(reasons),
            suppressed=suppressed, rewind_triggers=tuple(triggers) if Action.REWIND in wanted
            or Action.REPAIR in wanted else (), halt_reason=wanted.get(Action.HALT), nonfinite_streak=streak)

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
                "rewinds": list(self.rewinds)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.tick = int(d["tick"])
        self.nonfinite_streak = int(d["nonfinite_streak"])
        self.last_checkpoint = int(d["last_checkpoint"])
        self.last_warning = int(d["last_warning"])
        self.checkpoints = deque(int(v) for v in d["checkpoints"])
        self.last_rewind = int(d["last_rewind"])
        self.rewinds = deque(int(v) for v in d["rewinds"])
