"""Bands: what the detector's state promises about the next steps, before it sees them.

A guard that defers the detector (``earlywarn.guard.calmstep``) tests each step's values against
bands taken from the state at the last fold. A step inside its bands cannot leave the calm path,
raise an alert or lift a run-level signal to ``spike_z`` (the episode's test, ``run_score``),
whatever the steps deferred before it were, as long as they were inside theirs: folding the
deferred steps into the detector later gives the state, the alerts (none) and the scores that
observing them one by one would have given. Bands are conservative by construction:

- each rule states, next to it in :mod:`earlywarn.detect.rules`, the band inside which it cannot
  fire for any state in a range (``*_band``), or is monotone so that an upper bound fed through
  it stays one (the CUSUMs, the together evidence);
- this module bounds the range the state can drift into over ``window`` deferred steps, each
  inside its band: the baseline and the width are EMAs of admitted values, so from the state at
  the fold they can move only so far (:func:`drift`);
- the learning-rate rule is evaluated exactly (its ring is the state's; the rates deferred stay
  in it), and the run-level evidence is carried as an upper bound step by step
  (:meth:`Bands.take`).

Bands exist only where the detector's own next step would be calm (``Work.fast``), for the
signals the guard gives (no update or parameter norm: a log that has them is never deferred).
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import numpy as np

from earlywarn.detect.rules import Thresholds, cusum, diverge_band, elevated_band, spike_band, together
from earlywarn.detect.state import GRAD, LAYERS_BIT, LOSS, LR_BIT, N_FIXED, USER_BIT
from earlywarn.detect.work import Work, cnz

LOWER = 2.0
"""The floor that bounds how far a baseline can sink over the deferred steps: its value at the
fold less this many widths (``admit_z`` scales). A value below it is no reason to judge its step
(nothing fires on a low value): the step is kept, and the bands end with it, since they assumed
the floor for the steps after it."""

_lt = operator.lt

EPS = 1e-9
"""Slack on every bound, in log units (relative in values): rounding (a log of a square root
against half a log of a square) never decides a band."""


class Drift:
    """How far the baseline (``mu``) and the width (``wd = admit_z * scale``) of a channel can
    move over ``window`` deferred steps from the state at the fold: row ``j`` bounds the state
    before the ``j``-th deferred step (``j`` steps deferred before it; row 0 is the fold's).

    The baseline moves by ``alpha * clip(y - mu, +-wd)``: by at most ``alpha * wd`` a step, and
    where the values are floored (kept above ``mu0 - LOWER * wd0``) by at most ``alpha`` of the
    way to that floor (``sink``: how far, in units of ``wd0``). The width moves by ``scale_alpha``
    toward ``admit_z * max(min(|y - mu|, wd), min_scale)``: it shrinks at most geometrically
    (``shrink``) and grows at most by ``1 + scale_alpha * (admit_z - 1)`` a step. Together, a
    baseline pulled down by a value far below widens the width by more than it sinks when
    ``lam * scale_alpha * admit_z * (1 - scale_alpha) ** (window - 2) >= alpha`` (the defaults'
    case, :meth:`joint_ok`): ``mu + lam * wd`` then falls no lower than ``mu0 + lam * wd_lo -
    j * alpha * min_scale``. The factors depend on the configuration and the window only."""

    def __init__(self, t: Thresholds, window: int):
        cfg = t.cfg
        self.t = t
        a, s, A = float(cfg.alpha), float(cfg.scale_alpha), t.admit_z
        self.alpha, self.sigma, self.window = a, s, window
        j = np.arange(window, dtype=np.float64)[:, None]  # steps deferred before
        self.steps = j
        self.shrink = (1.0 - s) ** j
        # sinking by alpha * wd a step, wd growing at most geometrically; floored: alpha of the way
        grown = np.concatenate([[0.0], np.cumsum((1.0 + s * (A - 1.0)) ** np.arange(max(window - 1, 0)))])[:, None]
        self.sink = a * grown
        self.sink_floored = np.minimum(self.sink, LOWER * (1.0 - (1.0 - a) ** j))
        self._sink_by: dict = {}

    def joint_ok(self, lam: float) -> bool:
        return lam * self.sigma * self.t.admit_z * (1.0 - self.sigma) ** max(self.window - 2, 0) >= self.alpha

    def bounds(self, mu0: np.ndarray, wd0: np.ndarray, min_scale: np.ndarray,
               floored: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """``(mu_lo, wd_lo)``, each ``(window, channels)``; ``floored``: a mask of the channels
        whose values are floored (``None``: all of them)."""
        floor_w = self.t.admit_z * min_scale
        wd_lo = (wd0 - floor_w) * self.shrink
        wd_lo += floor_w
        sink = self.sink_floored if floored is None else np.where(floored, self.sink_floored, self.sink)
        mu_lo = mu0 - wd0 * sink
        return mu_lo, wd_lo

    def lifted(self, lam: float, mu0: np.ndarray, mu_lo: np.ndarray, wd_lo: np.ndarray,
               min_scale: np.ndarray) -> np.ndarray:
        """A lower bound of ``mu + lam * wd`` at each row (see the class docstring)."""
        lw = wd_lo * lam
        apart = mu_lo + lw  # each bound alone: always valid
        if not self.joint_ok(lam):
            return apart
        # the baseline sinks by alpha * u a step while the width grows by scale_alpha * admit_z * u
        # (u = min(|dev|, wd) >= min_scale): worst at u = min_scale
        lw += mu0
        lw -= self._sinking(min_scale)
        return np.maximum(lw, apart, out=lw)

    def _sinking(self, min_scale: np.ndarray) -> np.ndarray:
        """``j * alpha * min_scale``, by row (made once per layout of channels)."""
        key = (min_scale.shape, min_scale.tobytes())
        got = self._sink_by.get(key)
        if got is None:
            got = self._sink_by[key] = self.steps * (self.alpha * min_scale)
        return got


def _drift(t: Thresholds, window: int) -> Drift:
    key = ("drift", window)
    d = t._by_layout.get(key)
    if d is None:
        d = t._by_layout[key] = Drift(t, window)
    return d


class Bands:
    """The bands of the next ``window`` steps, from a detector's working state at a fold.

    In log space per channel: ``lo`` (the floor) and ``hi[j]`` (the ``j``-th deferred step).
    :meth:`take` tests a step's values against them, and its run-level evidence and learning
    rate, and counts the steps taken (``taken``)."""

    __slots__ = ("window", "taken", "users", "lo", "hi", "_layers", "_zero_ok", "_young_absent", "_t", "_grad",
                 "_loss", "_users", "_together", "_joint", "_h_flat", "_h_rise", "_lr", "_scale", "_shift", "_cus",
                 "_tracked", "_sq_lo", "_sq_floor", "_sq_hi")

    def __init__(self, t: Thresholds, w: Work, window: int):
        pattern, le, n = w.pattern, w.layers_end, w.n
        self._t = t
        self.window = window
        self.taken = 0
        self.users = tuple(w.channels[le + i] for i in range(w.n_users) if pattern & (USER_BIT << i))
        k = w.consts
        # a layer that has been absent (an expert no token was routed to) may be absent again: not
        # floored, and 0 allowed where the calm path takes another set of absent layers (mature)
        floored = zero_ok = young_absent = None
        if pattern & LAYERS_BIT and (w.n_present < w.n_layers or cnz(w.absent_since)):
            sparse = ~w.layer_present | (w.absent_since != 0)
            floored = np.ones(n, dtype=bool)
            floored[N_FIXED:le] = ~sparse
            mature = w.count[N_FIXED:le] >= t.mature_n
            zero_ok = sparse & mature
            young_absent = ~w.layer_present & ~mature  # the general path admits its values: stays absent
        self._zero_ok, self._young_absent = zero_ok, young_absent
        self._layers = slice(N_FIXED, le) if pattern & LAYERS_BIT else None
        d = _drift(t, window)
        mu0, wd0, ms = w.baseline, w.width, k.min_scale
        mu_lo, wd_lo = d.bounds(mu0, wd0, ms, floored)
        lam = t.spike_z / t.admit_z
        hi = spike_band(mu_lo, d.lifted(lam, mu0, mu_lo, wd_lo, ms), k.log_min)
        hi -= EPS
        self.hi = hi
        lo = mu0 - LOWER * wd0
        lo += EPS
        if floored is not None:
            lo[~floored] = -np.inf
        self.lo = lo
        run = [c for c in (GRAD, LOSS) if pattern & (1 << c)]
        run += [le + i for i in range(w.n_users) if pattern & (USER_BIT << i)]
        self._grad = self._loss = self._together = None
        self._users: list = []
        self._tracked = False  # some run-level CUSUM can fire
        self._cus = list(w.cusums)
        self._shift = w.loss_shift
        if run:
            self._run_bounds(t, w, d, run, mu0, mu_lo, wd_lo, ms)
        self._joint = w.joint
        self._h_flat, self._h_rise = w.h_together
        self._lr = _LrBounds(t, w) if pattern & LR_BIT else None
        self._scale = w.loss_scale
        self._sq_lo = None
        if pattern & LAYERS_BIT:
            self._sq_lo, self._sq_floor, self._sq_hi = (a.tolist() for a in self._layer_bounds())

    def _run_bounds(self, t: Thresholds, w: Work, d: Drift, run: list[int], mu0: np.ndarray, mu_lo: np.ndarray,
                    wd_lo: np.ndarray, ms: np.ndarray) -> None:
        """The run-level signals' bands in their values (the gradient norm squared, the loss as
        given), and what their evidence needs: ``(lo, hi per step, CUSUM slot or None, threshold,
        baseline bounds, admit_z / width bounds)`` each."""
        le = w.layers_end
        # (the guard's: the gradient norm and the loss, channels 0 and 1: a view, no gather)
        at = slice(run[0], run[-1] + 1) if run[-1] - run[0] == len(run) - 1 else run
        lam = t.spike_z / t.admit_z
        rl = self.hi[:, at].copy()
        el = elevated_band(d.lifted(lam * (1.0 - d.sigma), mu0[at], mu_lo[:, at], wd_lo[:, at], ms[at]),
                           d.sigma, t, ms[at])
        el -= EPS
        np.minimum(rl, el, out=rl)
        if w.pattern & 2:
            i = run.index(LOSS)
            rl[:, i] = np.minimum(rl[:, i], diverge_band(mu_lo[:, LOSS], wd_lo[:, LOSS], t) - EPS)
        # in values: the gradient norm's squared, the loss's less its offset; a value must be > 0
        # (with the loss's offset), and at or below the floor it ends the bands
        power = np.array([2.0 if c == GRAD else 1.0 for c in run])
        shift = np.array([self._shift if c == LOSS else 0.0 for c in run])
        hi_v = (np.exp(rl * power) - shift).T.tolist()
        floor_v = (np.exp(self.lo[at] * power) - shift).tolist()
        mu_r, a_wd = mu_lo[:, at].T.tolist(), np.divide(t.admit_z, wd_lo[:, at]).T.tolist()
        for i, c in enumerate(run):
            h = w.h_alone[c] if c < N_FIXED else t.user_alone_h
            slot = (c if c < N_FIXED else N_FIXED + c - le) if h < math.inf else None  # CUSUMs that can fire
            self._tracked = self._tracked or slot is not None
            entry = (-shift[i], hi_v[i], slot, h, mu_r[i], a_wd[i], floor_v[i])
            if c == GRAD:
                self._grad = entry
            elif c == LOSS:
                self._loss = entry
            else:
                self._users.append(entry)
        if self._grad is not None and self._loss is not None and min(w.h_together) < math.inf:
            # the together evidence grows only on steps whose two z's both pass together_k: below
            # these values (z's bound at most together_k), the bound carried stays as it is
            trig = mu_lo[:, 0:2] + np.multiply((t.together_k - EPS) / t.admit_z, wd_lo[:, 0:2])
            trig -= EPS
            self._together = (np.exp(trig * power[:2]) - shift[:2]).T.tolist()

    def _layer_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lo, floor, hi)`` of the layers' squared norms, ``hi`` one row per deferred step: a
        step's layers are inside their bands when ``lo < v < hi[taken]`` holds for each; a value
        at or below its ``floor`` ends the bands with its step. ``lo`` is 0 (a layer present
        stays present), or -1 for a layer that has been absent and may report 0 again (no floor
        either); one absent and still warming up must stay absent (``hi``: the smallest positive
        float)."""
        floor = np.exp(self.lo[self._layers] * 2.0)
        hi = np.exp(self.hi[:, self._layers] * 2.0)
        lo = np.zeros_like(floor)
        if self._zero_ok is not None:
            lo[self._zero_ok | self._young_absent] = -1.0
            floor[self._zero_ok | self._young_absent] = -1.0
            hi[:, self._young_absent] = np.nextafter(0.0, 1.0)
        return lo, floor, hi

    def take(self, layer_sq: Sequence[float] | None, grad_norm_sq: float | None, loss: float | None,
             users: Sequence[float], lr: float | None, loss_scale: float | None) -> bool:
        """Test the next step, values as the guard has them: the layers' squared norms (a longer
        sequence is read up to the layers: the guard's whole vector), the squared global gradient
        norm, the loss, the user signals (those of :attr:`users`, in order), the learning rate
        and the loss scale (``None``: not given). True: inside its bands: the step may be kept
        unobserved, and it is counted; False: it must be observed (nothing was changed)."""
        j = self.taken
        g, lo_s, us = self._grad, self._loss, self._users
        if j >= self.window or (grad_norm_sq is None) != (g is None) or (loss is None) != (lo_s is None) \
                or (lr is None) != (self._lr is None) or len(users) != len(us) \
                or (layer_sq is None) != (self._sq_lo is None):
            return False
        low = False
        if layer_sq is not None:  # (each map stops at the layers: the bounds' length)
            if not all(map(_lt, layer_sq, self._sq_hi[j])):
                return False
            if not all(map(_lt, self._sq_floor, layer_sq)):
                if not all(map(_lt, self._sq_lo, layer_sq)):
                    return False  # a layer present before reports 0 (or NaN)
                low = True
        if g is not None and not g[0] < grad_norm_sq < g[1][j]:  # NaN fails
            return False
        if lo_s is not None and not lo_s[0] < loss < lo_s[1][j]:
            return False
        low = low or g is not None and not grad_norm_sq > g[6] or lo_s is not None and not loss > lo_s[6]
        if us:
            for e, v in zip(us, users):
                if not e[0] < v < e[1][j]:
                    return False
                low = low or not v > e[6]
        h_together = self._h_flat
        lrb = self._lr
        if lrb is not None:
            jump, rise_a, rise_b = lrb.at(j)
            if not 0.0 <= lr < jump:  # (as rules.lr_signals: a jump, or no finite LR >= 0)
                return False
            if lr > rise_a and lr >= rise_b:
                h_together = self._h_rise
        if loss_scale is not None and not loss_scale >= self._scale:
            return False  # a drop is an overflow's (NaN: unknown, judged)
        # the evidence: the CUSUMs that can fire and the together evidence, as upper bounds
        cus = None
        if self._tracked:  # (none with the defaults and no user signal: drift_alone_h is inf)
            cus = list(self._cus)
            for entry, v in ((g, grad_norm_sq), (lo_s, loss), *zip(us, users)):
                if entry is not None and entry[2] is not None:
                    c = cusum(cus[entry[2]], self._z(entry, v, j), self._t.spike_z, self._t.drift_k)
                    if c >= entry[3]:
                        return False
                    cus[entry[2]] = c
        joint = self._joint
        trig = self._together
        if trig is not None and grad_norm_sq > trig[0][j] and loss > trig[1][j]:
            # (_z of the two, written out: most steps come here)
            y, m = 0.5 * math.log(grad_norm_sq), g[4][j]
            zg = ((y - m) * g[5][j] if y > m else 0.0) + EPS
            y, m = math.log(loss + self._shift), lo_s[4][j]
            zl = ((y - m) * lo_s[5][j] if y > m else 0.0) + EPS
            joint = together(joint, zg, None, zl, self._t)[0]
        if joint >= h_together:
            return False
        # the step is inside its bands: carry its evidence
        if cus is not None:
            self._cus = cus
        self._joint = joint
        if loss_scale is not None:
            self._scale = loss_scale
        if lrb is not None:
            lrb.taken.append(lr)
        self.taken = j + 1
        if low:  # a value below its floor: the bands assumed none for the steps after it
            self.window = self.taken
        return True

    def _z(self, entry: tuple, v: float, j: int) -> float:
        """An upper bound of the z of value ``v`` (a run-level signal's, inside its band) at the
        ``j``-th deferred step, whatever the state then."""
        y = 0.5 * math.log(v) if entry is self._grad else math.log(v + self._shift if entry is self._loss else v)
        m = entry[4][j]
        return ((y - m) * entry[5][j] if y > m else 0.0) + EPS


class _LrBounds:
    """What :func:`rules.lr_signals` says of a learning rate at each deferred step ``j``: it
    jumped at and above ``jump``; it is rising above ``rise_a`` and at or above ``rise_b``. The
    ring is the state's, each step's push taken as :func:`rules.lr_push` takes it: the rate
    ``lr_ref_steps`` back is the ring's until the deferred steps' own rates (``taken``) reach
    that far back."""

    __slots__ = ("t", "ring", "pos", "seen", "ref", "taken", "_at")

    def __init__(self, t: Thresholds, w: Work):
        self.t = t
        self.ring, self.pos, self.seen, self.ref = w.lr_ring, w.lr_pos, w.lr_n, w.lr_ref
        self.taken: list[float] = []
        self._at: list[tuple[float, float, float]] = []

    def at(self, j: int) -> tuple[float, float, float]:
        at = self._at
        t, k = self.t, self.t.lr_ref_steps
        while len(at) <= j:  # (each step's from the one before: j is at most one past)
            i = len(at)
            back = self.ring[(self.pos + i) % k] if i < k else self.taken[i - k]
            n, ref = self.seen + i, self.ref
            at.append((t.lr_jump * ref if n >= t.lr_ready and ref > 0.0 else math.inf,
                       back if n >= k else math.inf, ref))
            if n >= k and back > ref:
                self.ref = back  # it leaves the ring with this step's push
        return at[j]


def bands_of(t: Thresholds, w: Work, window: int) -> Bands | None:
    """The bands of the next ``window`` steps (at least 1), or None where no step may be deferred:
    the detector's next step would not be calm (warm-up, an episode, a streak, a divergence, a
    non-finite or skipped step: ``Work.fast``), or the signals include an update or parameter norm."""
    if not w.fast or w.pattern < 0 or w.pattern & 12 or w.score_cap:
        return None
    return Bands(t, w, max(int(window), 1))
