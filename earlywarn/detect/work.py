"""The working state: preallocated vectors a step updates in place, loaded from a
:class:`DetectorState` and snapshot back into one, both by the field table ``STATE_FIELDS``."""

from __future__ import annotations

import math

import numpy as np

from earlywarn.detect.rules import Thresholds, alone_thresholds, together_threshold
from earlywarn.detect.state import (COUNT, CUSUM, EXTRAS, GROW, LAYERS_BIT, LR_BIT, MU, N_FIXED, N_ROWS,
                                    PATTERN_BITS, PREV, SCALARS, SCALE, SCORE_CAP, STREAK, USER, USER_BIT, WIDTH,
                                    DetectorState, tracked_user)

IDLE_STEPS = 3
"""Steps a layer must have been absent (no gradient, or 0) for its return to be a part of the model
that trains only on some steps (a rarely sampled task's head, an expert) and not a layer that a
corrupt batch left at 0 for a step."""

try:  # the C function itself: np.count_nonzero adds a Python wrapper and a dispatcher per call
    from numpy._core._multiarray_umath import count_nonzero as cnz
except ImportError:  # pragma: no cover - older numpy layouts
    cnz = np.count_nonzero


class Work:
    """The mutable working state of one detector: the state's scalar fields (``SCALARS``) as
    attributes, its per-channel statistics as vectors, and the scratch vectors of a step.

    ``ema`` stacks the baseline and the admission width ``width = admit_z * scale`` so that both
    EMAs are one multiply-add: ``ema = ema * keep + ema_in * rates`` with ``ema_in = [dev;
    max(|dev|, min_scale)]``, ``rates = [alpha; admit_z * scale_alpha]`` and ``keep = [1; 1 -
    scale_alpha]`` for the channels the calm path updates (0 / 1 elsewhere). Keeping the width
    rather than the scale makes the outlier test ``|dev| < width`` one call, with no per-step
    rescaling."""

    __slots__ = (
        # layout: the four fixed channels, the layers, then the user signals (run-level, like the
        # fixed ones: CUSUMs, escalation, spikes)
        "channels", "n", "n_layers", "layers_end", "n_users", "user_set", "known_extras",
        # [baseline; width; dev; |dev|] in one (4, n) block and its views: the run-level widths
        # and deviations are one (2, 4) view, read with one tolist()
        "block", "ema", "baseline", "width", "ema_in", "dev", "abs_dev", "fixed_wd", "user_wd",
        # per-channel history (rows of DetectorState.stats) and the run-level CUSUMs (the fixed
        # channels', then the user signals')
        "count", "streak", "grow", "prev", "cusums",
        # this step's log-values (absent channels parked on their baseline), as a vector, as the
        # one row calm_rows takes, and the layers' slice
        "logv", "logv_row", "logv_layers",
        # the calm path's EMA rates and rule thresholds under the current pattern (see refresh),
        # the per-channel thresholds, scratch (incr: the EMA increments)
        "rates", "keep", "h_alone", "h_together", "consts", "incr", "incr_mu", "incr_width", "ok", "layers_ok",
        "z_scratch",
        # layers present under the pattern (a layer reporting 0 is absent) and how many; a scratch
        # mask for the calm path's test of another set of them; the step each absent layer went
        # absent, and the latest step at which a layer came back from IDLE_STEPS or more absent
        "layer_present", "n_present", "layers_scratch", "absent_since", "back_idle_at",
        # dev holds NaN (absent / not warm channels, set by the general path); dev was computed
        "dev_nan", "has_dev",
        # the lr ring (DetectorState.lr_ring, as a list)
        "lr_ring",
    ) + SCALARS

    def __init__(self, channels: tuple[str, ...]):
        n = len(channels)
        nu = sum(1 for c in channels[N_FIXED:] if c.startswith(USER))
        self.channels, self.n, self.n_users = channels, n, nu
        self.n_layers = n - N_FIXED - nu
        self.layers_end = N_FIXED + self.n_layers
        self.user_set = frozenset(channels[self.layers_end:])
        self.known_extras = self.user_set | frozenset(EXTRAS)  # extras keys that add no channel
        self.block = np.zeros((4, n))
        self.ema, self.ema_in = self.block[0:2], self.block[2:4]
        self.baseline, self.width = self.ema[0], self.ema[1]
        self.dev, self.abs_dev = self.ema_in[0], self.ema_in[1]
        self.fixed_wd = self.block[1:3, :N_FIXED]
        self.user_wd = self.block[1:3, self.layers_end:]
        self.count = np.zeros(n)
        self.streak, self.grow, self.prev = np.zeros(n), np.zeros(n), np.zeros(n)
        self.cusums = [0.0] * (N_FIXED + nu)
        self.logv = np.zeros(n)
        self.logv_row = (self.logv,)  # one row of log-values, for calm_rows
        self.logv_layers = self.logv[N_FIXED:self.layers_end]
        self.incr = np.zeros((2, n))
        self.incr_mu, self.incr_width = self.incr[0], self.incr[1]
        self.rates = np.zeros((2, n))
        self.keep = np.ones((2, n))
        self.ok = np.zeros(n, dtype=bool)
        self.layer_present = np.ones(self.n_layers, dtype=bool)
        self.layers_ok = np.zeros(self.n_layers, dtype=bool)
        self.layers_scratch = np.zeros(self.n_layers, dtype=bool)
        self.n_present = self.n_layers
        self.absent_since = np.zeros(self.n_layers, dtype=np.int64)
        self.back_idle_at = -1
        self.z_scratch = np.zeros(n)
        self.dev_nan = False
        self.has_dev = False

    @classmethod
    def load(cls, s: DetectorState, t: Thresholds) -> "Work":
        w = cls(s.channels)
        st = s.stats
        w.baseline[:] = st[MU]
        w.width[:] = st[WIDTH]
        w.count[:] = st[COUNT]
        w.streak[:], w.grow[:], w.prev[:] = st[STREAK], st[GROW], st[PREV]
        w.cusums = [float(v) for v in st[CUSUM, :N_FIXED]] + [float(v) for v in st[CUSUM, w.layers_end:]]
        for name in SCALARS:
            setattr(w, name, getattr(s, name))
        w.joint = float(s.joint)
        if s.dev is not None:
            w.dev[:] = s.dev
            w.has_dev = True
            w.dev_nan = bool(np.isnan(s.dev).any())
        w.layer_present[:] = True
        w.layer_present[list(s.absent)] = False
        w.n_present = int(cnz(w.layer_present))
        # (a state saved before absent_since was kept: its absent layers count from the saved step)
        w.absent_since[list(s.absent)] = s.absent_since if len(s.absent_since) == len(s.absent) else s.step
        K = t.lr_ref_steps
        w.lr_ring = list(s.lr_ring) if len(s.lr_ring) == K else [0.0] * K
        if len(s.lr_ring) != K:  # saved under another lr_ref_steps: the ring starts over
            w.lr_pos = w.lr_n = 0
            w.lr_ref = 0.0
        w.refresh(t)
        return w

    def set_presence(self, present: np.ndarray, step: int) -> None:
        """The layers present at ``step`` (norm > 0) become the set the next step expects;
        remembers when each absent one went absent, and whether one came back at this step."""
        if self.back_from_idle(present, step):
            self.back_idle_at = step
        self.absent_since[self.layer_present & ~present] = step
        np.copyto(self.layer_present, present)
        self.n_present = int(cnz(present))

    def back_from_idle(self, present: np.ndarray, step: int) -> bool:
        """A layer absent at the last step, for IDLE_STEPS steps or more, is present at ``step``
        (one never present before included)."""
        return bool(cnz(present & ~self.layer_present & (step - self.absent_since >= IDLE_STEPS)))

    def snapshot(self, t: Thresholds) -> DetectorState:
        absent = np.flatnonzero(~self.layer_present)
        stats = np.zeros((N_ROWS, self.n))
        stats[MU], stats[SCALE], stats[COUNT] = self.baseline, self.width / t.admit_z, self.count
        stats[WIDTH] = self.width
        stats[STREAK], stats[GROW], stats[PREV] = self.streak, self.grow, self.prev
        stats[CUSUM, :N_FIXED] = self.cusums[:N_FIXED]
        stats[CUSUM, self.layers_end:] = self.cusums[N_FIXED:]
        return DetectorState(
            channels=self.channels, stats=stats, dev=self.dev.copy() if self.has_dev else None,
            lr_ring=tuple(self.lr_ring), absent=tuple(int(i) for i in absent),
            absent_since=tuple(int(v) for v in self.absent_since[absent]),
            **{name: getattr(self, name) for name in SCALARS})

    def expected(self) -> np.ndarray:
        """The channels the latest step's pattern gave (the layers: those present)."""
        pattern = self.pattern
        expected = np.zeros(self.n, dtype=bool)
        if pattern >= 0:
            for bit, c in PATTERN_BITS:
                expected[c] = bool(pattern & bit)
            if pattern & LAYERS_BIT:
                expected[N_FIXED:self.layers_end] = self.layer_present
            for i in range(self.n_users):
                expected[self.layers_end + i] = bool(pattern & (USER_BIT << i))
        return expected

    def refresh(self, t: Thresholds) -> None:
        """What the calm path assumes, derived from the state: its EMA rates (steady rates for
        the mature channels given under the current pattern, 0 elsewhere), the thresholds of
        the rules under that pattern (rules.alone_thresholds; rules.together_threshold with a flat
        or unknown LR, then a rising one), and absent channels' log-values parked on their baseline (so their deviation
        is exactly 0)."""
        cfg = t.cfg
        expected = self.expected()
        steady = expected & (self.count >= t.mature_n)
        b = np.where(steady, cfg.scale_alpha, 0.0)
        self.rates[0] = np.where(steady, cfg.alpha, 0.0)
        np.multiply(b, t.admit_z, out=self.rates[1])  # as the general path computes it
        self.keep[0] = 1.0
        np.subtract(1.0, b, out=self.keep[1])
        self.consts = t.per_channel(self.n, self.layers_end)
        pattern = max(self.pattern, 0)
        self.h_alone = alone_thresholds(t, pattern)
        self.h_together = (together_threshold(t, bool(pattern & LR_BIT), False), together_threshold(t, True, True))
        np.copyto(self.logv, self.baseline, where=~expected)

    def refresh_layers(self, t: Thresholds) -> None:
        """:meth:`refresh` after the calm path took another set of absent layers
        (:meth:`set_presence`): the layers' slice is all that moves. The pattern, and with it the
        thresholds and the other channels' rates, is the last refresh's, no count has moved since
        (counts move on the general path only, whose commit refreshes), and a channel not given
        keeps its baseline on the calm path (rate 0): its parked value stands."""
        cfg, layers, present = t.cfg, slice(N_FIXED, self.layers_end), self.layer_present
        steady = present & (self.count[layers] >= t.mature_n)
        b = np.where(steady, cfg.scale_alpha, 0.0)
        self.rates[0, layers] = np.where(steady, cfg.alpha, 0.0)
        np.multiply(b, t.admit_z, out=self.rates[1, layers])
        np.subtract(1.0, b, out=self.keep[1, layers])
        np.copyto(self.logv_layers, self.baseline[layers], where=~present)

    def largest_z(self, admit_z: float, *, layers: bool) -> float:
        """The largest robust z of the latest step above its baseline (``StreamingDetector.score``;
        without the layers: ``run_score``)."""
        if self.score_cap:
            return SCORE_CAP
        if not self.has_dev or not self.n:
            return 0.0
        if not layers:
            # the run's few channels, in Python: the same divisions and maximum as numpy's, which
            # costs ~60 us a reduction on caches a training step has emptied (this, a few)
            width, dev = self.fixed_wd.tolist()
            m = _largest_ratio(dev, width)
            if self.n_users:
                width, dev = self.user_wd.tolist()
                m = max(m, _largest_ratio(dev, width))
        else:
            t = self.z_scratch
            np.divide(self.dev, self.width, t)
            if self.dev_nan:
                m = float(np.fmax.reduce(t))  # NaN (absent) ignored
            else:
                m = float(t[t.argmax()])  # a calm step: no NaN, and argmax is the cheap reduction
        m *= admit_z
        return m if m > 0.0 else 0.0

    def new_users(self, extras) -> list[str]:
        """User signals in ``extras`` that have no channel yet (in the order given)."""
        if not extras:
            return []
        us = self.user_set
        return [k for k in extras if tracked_user(k) and k not in us]


def _largest_ratio(dev: list[float], width: list[float]) -> float:
    """``np.fmax.reduce(dev / width)`` of a few channels: the largest ratio, NaN (an absent
    channel) ignored, NaN when every one is."""
    # (a zero width is never set; were it, numpy's inf / NaN, not ZeroDivisionError)
    zs = [d / s if s else float(np.divide(d, s)) for d, s in zip(dev, width)]
    zs = [z for z in zs if z == z]
    return max(zs) if zs else math.nan
