"""How alerts become actions: :class:`PolicyConfig` (one field per alert kind and per rule's
bound, validated) and :class:`Action`. Pure Python; the rules themselves are
:class:`earlywarn.policy.Policy`'s.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from earlywarn._renamed import renamed

class Action(str, enum.Enum):
    """What the guard should do at this step, least to most drastic."""

    NONE = "none"
    CHECKPOINT = "checkpoint"
    CLIP = "clip"
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


SEVERITY = {Action.NONE: 0, Action.CHECKPOINT: 1, Action.CLIP: 2, Action.SKIP: 3, Action.REPAIR: 4, Action.REWIND: 5,
             Action.HALT: 6}


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
    limit. A warning (this or LOSS_DIVERGED) that comes while the learning rate creeps up -- risen
    step after step, past the rate the run had trained at for 50 steps or more (a schedule bug
    multiplying it a little every step, a ramp without end; :mod:`earlywarn.lrtrend`) -- also
    holds the learning rate at the rate it rose from, flat, while the loop's stays above it: not
    the highest it reached calmly, which by then is already many times too high."""

    on_loss_nonfinite: Action | str = Action.REWIND
    """LOSS_NONFINITE (critical): the weights are suspect; rewind to the last clean checkpoint.
    The guard checks first: when parameters and optimizer state are finite the bad step was
    never applied and one batch is at fault -- it skips that step, quarantines the batch and
    withdraws the rewind (:meth:`Policy.withdraw_rewind`)."""

    on_loss_diverged: Action | str = Action.REWIND
    """LOSS_DIVERGED (warning): the loss has stayed far above its level. Rewind -- but only when the
    run is losing what it learned through its own updates: an abnormal update (an outlier gradient
    taken, an LR jump taken) in the ``divergence_lookback`` steps before the loss began to rise;
    the rewind then goes back to before that update. A loss that moved to a new level with
    ordinary updates before it is a change in the data (a new domain, a curriculum stage): the
    warning stands, nothing is rewound (a rewind would meet the same data again)."""

    on_grad_outlier: Action | str = Action.CLIP
    """GRAD_OUTLIER (warning): a finite gradient far above its typical norm, read before its update
    (sync mode). ``clip`` (the default): the update is taken, bounded -- the first outlier of a run
    at its typical size (each element held to its running RMS where the optimizer keeps one:
    ``earlywarn.guard.bound``; to ``outlier_clip_ratio`` times it where the batch's loss is at its
    level, so a policy gradient's first rare reward keeps part of its signal), the rest scaled to
    ``outlier_clip_ratio`` typical norms, each element free up to half an ordinary step
    (``earlywarn.outlier_rules.RUN_ELEMENT_RMS``; plain SGD: growing,
    ``earlywarn.outlier_rules.OUTLIER_GROWTH``) -- so Adam's second moment is never inflated by a
    1e4x gradient (which would stall the run for thousands of steps) and no batch goes untrained: a
    spike of the model's own heals as it does under clipping, a new regime or a loss weight raised
    on purpose trains at the optimizer's steady rate (taken whole it would go further while Adam's
    second moment caught up: ~2x over 100 steps at beta2 0.999), a bad batch takes one step of
    ordinary size; a run held ``DetectorConfig.readapt_steps`` (30) steps is the detector's new
    normal and trains whole from then on. What tells a bad batch from the run's own outlier comes after it: a run of
    outliers that ends in one step with the loss far above its level before it (and 1% of the
    run's progress lost), or half the run's progress lost, and is so still 30 steps later (a phase
    of other data has recovered by then), was a burst of bad batches and is rewound to before it
    (``BURST_END_LOSS``, ``BURST_END_MATTERS``, ``BURST_HEAL_STEPS``), and outliers in the
    ``BURST_END_WITHIN`` steps after are more of it: skipped; the run's own kinds of outlier (a part
    unfrozen or idle trains again, a climb, a heavy tail) are taken with their own bounds.
    ``skip``: the first ``outlier_skips`` outliers of every run are skipped and quarantined, then
    bounded as above (measured on ``benchmarks/rescue.py``: healthy runs that change their
    loss's scale, start a new stage or a phase lost 6-21% of their steps so, and a spike of the
    model's own is refused every time: a skip leaves the model where the spike put it). Async mode
    reads it after its update was applied and can do neither."""

    outlier_skips: int = 40
    """With ``on_grad_outlier="skip"``: the outliers of one run skipped (a burst of corrupt
    batches: PaLM skipped 200-500) before the rest are bounded. A run ends at a gradient back
    under ``outlier_clip_ratio`` times its typical norm, not at any step under the outlier ratio: in
    a noisy new regime every few steps fall under it."""

    outlier_clip_ratio: float = 3.0
    """The norm, in typical norms, the outliers of a run after its first are scaled to (an
    optimizer whose step hardly depends on the gradient's scale), and the first's elements to this
    many times their running RMS where its batch's loss is at its level; a run of outliers ends at
    a gradient back under it (see ``outlier_skips``)."""

    logit_lr_factor: float = 0.5
    """LOGIT_GROWTH (warning; only for a run that reports its attention logits,
    ``ew.report("attn_logit_max/<layer>", ...)``, see :mod:`earlywarn.attention`): the learning
    rate is lowered to this factor of the rate it steps at, again at each doubling of the logit,
    and stays so (a flat ceiling) while the loop's rate stays above it. 1.0: warn only."""

    lr_probe_steps: int = 5
    """After an LR jump (COLLAPSE_RISK on the learning rate, a clean copy saved before its update),
    the next this-many steps are watched. A gradient ``lr_probe_grad_ratio`` times its typical
    norm, a loss ``lr_probe_loss_ratio`` times its level, a warning or a non-finite value there
    rewinds to that copy and holds the learning rate at the highest the run had survived, warming
    back up (doubling every 10 calm steps) for as long as the loop's stays above it: an LR pulse
    ends before the ceiling gets far, a jump the schedule meant (a low-LR phase, then the real
    one) trains on at its own rate a few dozen steps later, and a rate too high for the run meets
    the instability again and is held flat where it did. A jump the run takes calmly is kept.
    0: an LR jump is only checkpointed."""

    lr_probe_grad_ratio: float = 2.5
    """See ``lr_probe_steps``."""

    lr_probe_loss_ratio: float = 1.5
    """See ``lr_probe_steps``."""

    divergence_lookback: int = 50
    """See ``on_loss_diverged``: how far before the loss began to rise an abnormal update counts."""

    lr_rise_ratio: float = 2.0
    """A LOSS_DIVERGED warning also rewinds when the learning rate rose at least this much over the
    ``divergence_lookback`` steps before the loss began to rise (a ramp the run could not take):
    the rewind then holds the learning rate at the restored state's while the loop's stays above
    it. Together with ``on_recurrence`` a ramp without end trains on at the highest rate it took.
    Only a rate still rising into the loss's rise counts: see ``lr_rise_settle``."""

    lr_rise_settle: int = 10
    """See ``lr_rise_ratio``: a learning rate the run had reached this many steps or more before its
    loss began to rise is one it took calmly, and did not lead into the rise (a warm-up that ended
    40 steps before a change in the data). The LR counts as reached where it first came within 5%
    of its highest in the lookback."""

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
                act = getattr(self, f.name)
                if act is Action.REPAIR or act is Action.CLIP and f.name != "on_grad_outlier":
                    raise ValueError(f"PolicyConfig.{f.name}={act.value!r} is invalid: the guard decides repairs "
                                     "(poisoned optimizer state) itself, and clips only outlier gradients "
                                     "(on_grad_outlier); use none, checkpoint, skip, rewind or halt")
        for name in ("rewind_after_nonfinite", "checkpoint_cooldown", "checkpoint_rearm",
                     "max_checkpoints", "checkpoint_window", "rewind_cooldown", "max_rewinds_per_window",
                     "rewind_window", "outlier_skips", "lr_probe_steps", "divergence_lookback", "lr_rise_settle"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PolicyConfig.{name}={v!r} is invalid: use an int >= 0")
        for name in ("lr_probe_grad_ratio", "lr_probe_loss_ratio", "lr_rise_ratio", "outlier_clip_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 1.0:
                raise ValueError(f"PolicyConfig.{name}={v!r} is invalid: use a ratio > 1 (value / its typical value)")
        v = self.logit_lr_factor
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise ValueError(f"PolicyConfig.logit_lr_factor={v!r} is invalid: use a factor in (0, 1] (1: warn only)")
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
