"""The detector's rules, one function each, and the thresholds they read.

Both per-step paths call these: the calm path (:mod:`earlywarn.detect.calm`) to tell whether a
step may stay calm, the general path (:mod:`earlywarn.detect.general`) to update the evidence
and decide the alerts. A rule changed here changes both, so the three-path contract
(``tests/detector_paths.py``) keeps holding. The rules work on plain floats: ``z`` is a
channel's log-deviation in units of its robust scale, ``dev * admit_z / width``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from earlywarn.detect.config import DetectorConfig
from earlywarn.detect.state import LOSS, N_FIXED, PARAM, UPDATE


# -- a spike ------------------------------------------------------------------------------------
def spike_threshold(width: np.ndarray, k: "ChannelThresholds", out: np.ndarray | None = None) -> np.ndarray:
    """The log-deviation at and above which a channel is elevated: ``spike_z`` scales (the
    width is ``admit_z`` scales) and at least its minimum ratio."""
    out = np.multiply(width, k.spike_width, out)
    return np.fmax(out, k.log_min, out)


def spike_band(mu_lo: np.ndarray, lifted_lo: np.ndarray, log_min: np.ndarray) -> np.ndarray:
    """The band of :func:`spike_threshold`: a log-value below this is not elevated (and passes
    the calm path's test) for every state whose baseline is at least ``mu_lo`` and whose
    ``baseline + width * spike_width`` is at least ``lifted_lo``."""
    return np.maximum(lifted_lo, mu_lo + log_min)


def elevated_band(lifted_lo: np.ndarray, scale_alpha: float, t: "Thresholds", min_scale: np.ndarray) -> np.ndarray:
    """The band of a run-level signal's z after the step's own update (``run_score``, the
    episode's test: ``dev * admit_z / width' < spike_z``, with the width already moved toward
    this step's deviation, by at least ``scale_alpha`` of its floor): below this for every
    state whose ``baseline + width * spike_width * (1 - scale_alpha)`` is at least
    ``lifted_lo``."""
    return lifted_lo + t.spike_z * scale_alpha * min_scale


# -- evidence -------------------------------------------------------------------------------------
def cusum(c: float, z: float, cap: float, k: float) -> float:
    """One step of a one-sided CUSUM: the evidence ``c`` plus this step's ``z`` (winsorised at
    ``cap``) less the allowance ``k``, floored at 0. The run-level channels' CUSUMs (cap
    ``spike_z``, allowance ``drift_k``) and the together evidence (cap ``admit_z``, allowance
    ``together_k``) are both this. Its band: non-decreasing in ``c`` and ``z``, so upper bounds
    fed through it give an upper bound (``detect.bands``)."""
    v = c + (z if z < cap else cap) - k
    return v if v > 0.0 else 0.0


def together(e: float, z_grad: float | None, z_update: float | None, z_loss: float | None,
             t: "Thresholds") -> tuple[float, float | None]:
    """The together evidence of the gradient and the loss after this step, and this step's
    term: the smaller of the gradient's z and the loss's (both above their baselines when > 0).
    The evidence is a CUSUM of the terms, of :func:`cusum`'s form (written out here: this runs
    on every calm step) with its own cap ``admit_z`` and allowance ``together_k``. The update
    norm stands in for a gradient norm that is not given, or for a lower one with
    ``update_warns``. A side missing: no term, the evidence as it was. Its band: non-decreasing
    in ``e`` and both z's, as :func:`cusum`."""
    if z_update is not None and (z_grad is None or (t.update_warns and z_update > z_grad)):
        z_grad = z_update
    if z_grad is None or z_loss is None:
        return e, None
    m = z_grad if z_grad < z_loss else z_loss
    cap = t.together_cap
    v = e + (m if m < cap else cap) - t.together_k
    return (v if v > 0.0 else 0.0), m


def together_threshold(t: "Thresholds", lr_known: bool, lr_rising: bool) -> float:
    """The together evidence that warns: lower while the LR climbs (a run crosses its stability
    edge as its LR rises), its own where no LR is known."""
    if lr_rising:
        return t.rise_h
    return t.drift_h if lr_known else t.no_lr_h


class AloneThresholds(NamedTuple):
    grad: float
    loss: float
    update: float
    param: float


def alone_thresholds(t: "Thresholds", pattern: int) -> AloneThresholds:
    """The CUSUM that warns for the grad norm, the loss, the update and the param norm rising
    alone (a user signal: ``user_alone_h``). The loss of a log without any gradient signal
    (no grad or update norm in ``pattern``) has its own, lower one."""
    h = t.drift_alone_h
    return AloneThresholds(h, h if pattern & 5 else t.loss_only_h, t.update_alone_h, t.update_alone_h)


def loss_diverging(dev: float, z: float, t: "Thresholds") -> bool:
    """The loss far above its baseline as a ratio (``loss_diverge_ratio``) and in its own noise
    (``loss_diverge_z`` scales): one step of a divergence (``loss_diverge_steps`` in a row
    are one)."""
    return dev >= t.log_diverge and z >= t.diverge_z


def diverge_band(mu_lo: np.ndarray, wd_lo: np.ndarray, t: "Thresholds") -> np.ndarray:
    """The band of :func:`loss_diverging`: a log-loss below this is no step of a divergence for
    every state whose baseline is at least ``mu_lo`` and width at least ``wd_lo``."""
    return mu_lo + np.maximum(t.log_diverge, t.diverge_z * wd_lo / t.admit_z)


# -- the learning rate --------------------------------------------------------------------------
# The last lr_ref_steps LRs sit in a ring (list, position of the oldest, count seen); ``ref`` is
# the highest LR of the steps at least lr_ref_steps back: what the run has survived.
LR_RISING, LR_JUMPED = 1, 2


def lr_signals(lr: float, ring: list[float], pos: int, seen: int, ref: float, t: "Thresholds") -> int:
    """What this step's LR says, read before it enters the ring: ``LR_RISING`` (at a new high:
    above the LR ``lr_ref_steps`` back and the highest before it) and ``LR_JUMPED`` (at least
    ``lr_jump_ratio`` times the highest it had run at, once the ring has seen enough steps to
    know: a pulse, a steep re-warm-up), as bits. No band: the bands run it exactly, on a copy
    of the ring."""
    out = LR_RISING if seen >= t.lr_ref_steps and lr > ring[pos] and lr >= ref else 0
    if seen >= t.lr_ready and ref > 0.0 and lr >= t.lr_jump * ref:
        out |= LR_JUMPED
    return out


def lr_push(lr: float, ring: list[float], pos: int, seen: int, ref: float,
            t: "Thresholds") -> tuple[int, int, float]:
    """``lr`` into the ring (in place); returns the new ``(pos, seen, ref)``: the LR leaving the
    ring is now ``lr_ref_steps`` back and may raise ``ref``."""
    k = t.lr_ref_steps  # the ring's length
    if seen >= k:
        old = ring[pos]
        if old > ref:
            ref = old
    ring[pos] = lr
    pos = pos + 1 if pos + 1 < k else 0
    return pos, seen + 1, ref


# -- thresholds ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class ChannelThresholds:
    """Per-channel thresholds as arrays over the channels (array compares are cheaper than
    scalar ones). Slots: the calm path reads them every step."""

    log_min: np.ndarray  # log of the minimum ratio to count as elevated
    log_growth: np.ndarray  # log growth factor of an escalation
    log_warn: np.ndarray  # log ratio an escalation must reach to warn
    gradient_like: np.ndarray  # bool: gradient-type channels (all but the loss)
    run_level: np.ndarray  # bool: grad, loss, update, param and the user signals, not layers
    min_scale: np.ndarray  # the scale's floor (the loss has its own)
    spike_width: np.ndarray  # spike_z / admit_z: the spike threshold in units of the width
    may_warn: np.ndarray  # bool: the run-level channels that may escalate or jump into a warning


@dataclass(frozen=True, eq=False)
class Thresholds:
    """The detector's scalar thresholds, derived once from its config (see DetectorConfig for
    each), and its per-channel thresholds by channel layout."""

    cfg: DetectorConfig
    admit_z: float  # width = admit_z * scale, so z = dev * admit_z / width
    spike_z: float
    drift_k: float
    together_k: float
    together_cap: float  # each step's together term is winsorised at admit_z, as admitted values are
    drift_h: float
    rise_h: float  # the together threshold while the LR climbs
    no_lr_h: float  # ... and where no LR is known
    drift_alone_h: float
    loss_only_h: float
    update_alone_h: float  # inf unless update_warns
    user_alone_h: float
    update_warns: bool
    log_diverge: float
    diverge_z: float
    log_jump: float  # log jump_ratio (inf: off)
    log_outlier: float  # log outlier_ratio (inf: off)
    log_init: float  # log init_loss_ratio (inf: off)
    lr_jump: float
    lr_ref_steps: int
    lr_ready: int  # LR values seen before the LR rule may fire
    mature_n: float  # a channel is mature once its EMA rates no longer depend on its count
    scale0: float  # the scale a channel starts with
    _by_layout: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, c: DetectorConfig) -> "Thresholds":
        return cls(
            cfg=c, admit_z=float(c.admit_z), spike_z=float(c.spike_z), drift_k=float(c.drift_k),
            together_k=float(c.together_k), together_cap=float(c.admit_z), drift_h=float(c.drift_h),
            rise_h=float(c.drift_h) * float(c.lr_rise_factor), no_lr_h=float(c.drift_h) * float(c.no_lr_factor),
            drift_alone_h=float(c.drift_alone_h), loss_only_h=float(c.loss_only_h),
            update_alone_h=float(c.update_alone_h) if c.update_warns else math.inf,
            user_alone_h=float(c.user_alone_h), update_warns=bool(c.update_warns),
            log_diverge=math.log(c.loss_diverge_ratio), diverge_z=float(c.loss_diverge_z),
            log_jump=math.log(c.jump_ratio) if math.isfinite(c.jump_ratio) else math.inf,
            log_outlier=math.log(c.outlier_ratio) if math.isfinite(c.outlier_ratio) else math.inf,
            log_init=math.log(c.init_loss_ratio) if math.isfinite(c.init_loss_ratio) else math.inf,
            lr_jump=float(c.lr_jump_ratio), lr_ref_steps=int(c.lr_ref_steps),
            lr_ready=max(int(c.warmup_steps), int(c.lr_ref_steps)),
            mature_n=float(max(c.warmup_steps, math.ceil(1.0 / c.alpha), math.ceil(1.0 / c.scale_alpha))),
            scale0=max(c.prior_scale, c.min_scale, c.loss_min_scale))

    def per_channel(self, n: int, users_at: int) -> ChannelThresholds:
        """The per-channel thresholds of ``n`` channels whose user signals start at ``users_at``."""
        k = self._by_layout.get((n, users_at))
        if k is None:
            c = self.cfg
            log_min = np.full(n, math.log(c.spike_ratio))
            log_min[LOSS] = math.log(c.loss_spike_ratio)
            log_growth = np.full(n, math.log(c.growth))
            log_growth[LOSS] = math.log(c.loss_growth)
            log_warn = np.full(n, math.log(c.warn_ratio))
            log_warn[LOSS] = math.log(c.loss_warn_ratio)
            gradient_like = np.ones(n, dtype=bool)
            gradient_like[LOSS] = False
            run_level = np.zeros(n, dtype=bool)
            run_level[:N_FIXED] = True
            run_level[users_at:] = True
            min_scale = np.full(n, float(c.min_scale))
            min_scale[LOSS] = c.loss_min_scale
            may_warn = run_level.copy()
            if not c.update_warns:
                may_warn[UPDATE] = may_warn[PARAM] = False
            k = self._by_layout[(n, users_at)] = ChannelThresholds(
                log_min, log_growth, log_warn, gradient_like, run_level, min_scale,
                np.full(n, float(c.spike_z) / float(c.admit_z)), may_warn)
        return k
