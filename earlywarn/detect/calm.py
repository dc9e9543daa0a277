"""The calm path: a calm step of a mature run as a fixed sequence of in-place numpy calls.

A step is calm when it gives the same signals as the step before (layers reporting 0 aside: the
live step takes another set of them, see :func:`calm_frozen_layers`), every value finite (and > 0),
no channel elevated and no rule about to fire. :func:`calm_rows` takes such steps one row of
log-values each (the live step one row, the offline replay a chunk of rows) and stops at the
first row that is not calm, leaving it to the general path (:mod:`earlywarn.detect.general`),
which computes the same numbers with masks. The run-level evidence goes through the same rule
functions (:mod:`earlywarn.detect.rules`) on both paths.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from earlywarn.detect.rules import (LR_JUMPED, LR_RISING, Thresholds, cusum, loss_diverging, lr_push, lr_signals,
                                    spike_threshold, together)
from earlywarn.detect.state import BIG, N_FIXED, USER_BIT
from earlywarn.detect.work import Work, cnz

_log = math.log
_np_log, _subtract, _absolute, _less = np.log, np.subtract, np.absolute, np.less
_copysign, _greater, _not_equal = np.copysign, np.greater, np.not_equal
_fmax, _fmin, _multiply, _add = np.fmax, np.fmin, np.multiply, np.add
_logical_and, _divide = np.logical_and, np.divide
_F64 = np.float64


# The live step (Detector.step) takes a calm step's log-values itself; these are its rarer cases.
# Each writes log-values into w.logv and returns False if a value rules the calm path out.
def calm_update_values(w: Work, u: float | None, p: float | None) -> bool:
    """The update and param norms (finite and > 0)."""
    y = w.logv
    if u is not None:
        if not u > 0.0:
            return False
        y[2] = _log(u)
    if p is not None:
        if not p > 0.0:
            return False
        y[3] = _log(p)
    return True


def calm_frozen_layers(t: Thresholds, w: Work, ln: np.ndarray, nz: int, step: int) -> bool:
    """Layer norms of which ``nz`` are not 0: layers reporting 0 are absent (a frozen layer, an
    expert no token was routed to); NaN and negative values are not calm. Another set of absent
    layers than last step is calm when every layer present is mature: the set is then taken as
    the general path's commit takes it (``Work.refresh``: the present layers' EMA rates, the
    absent ones' values parked on their baselines), so a mixture of experts whose idle experts
    change at every step stays on the calm path."""
    lm = w.layers_ok
    _greater(ln, 0.0, lm)
    if cnz(lm) != nz:
        return False
    moved = young = w.layers_scratch  # (the second use once the first is read)
    _not_equal(lm, w.layer_present, moved)
    if nz != w.n_present or cnz(moved):
        _less(w.count[N_FIXED:w.layers_end], t.mature_n, young)
        _logical_and(young, lm, young)
        if cnz(young):
            return False  # a layer still warming up: the general path admits its values
        w.set_presence(lm, step)
        w.refresh_layers(t)
    _np_log(ln, out=w.logv_layers, where=w.layer_present, dtype=_F64)
    return True


def calm_rows(t: Thresholds, w: Work, Y: Sequence[np.ndarray], r0: int, r1: int, pattern: int, steps: Sequence[int],
              lrs: Sequence[float] | None = None, scores: list[float] | None = None) -> int:
    """Calm steps, one per row of ``Y[r0:r1]`` (each row a step's log-values, absent channels
    parked on their baseline; same ``pattern`` as the last step; every given value finite
    and > 0), with ``steps[r]`` the step of row ``r`` and ``lrs[r]`` its learning rate (finite,
    >= 0) when the pattern has one. Commits rows while they are calm and returns the first row
    that is not (``r1`` if all were): that row needs the general path, and nothing but scratch
    vectors was changed for it. ``scores``: each committed row's score is appended to it (the
    detector's ``score`` after that row).

    The one long function of the detector: it runs once per calm step (~6 us), where each
    extra Python call costs ~1%; the rules it applies are rules.py's, as the general path's."""
    # (assignments in threes: Python swaps up to three values without building a tuple)
    dev, abs_dev, ok = w.dev, w.abs_dev, w.ok
    n, k, fixed = w.n, w.consts, w.fixed_wd
    mu, wd, min_scale = w.baseline, w.width, w.consts.min_scale
    ema, keep, rates = w.ema, w.keep, w.rates
    incr = w.incr
    S, kd, A = t.spike_z, t.drift_k, t.admit_z
    h_grad, h_loss, h_update, h_param = w.h_alone  # the thresholds under this pattern (see Work.refresh)
    h_flat, h_rise = w.h_together
    cus = w.cusums  # the fixed channels' CUSUMs, then the user signals' (updated in place)
    c0, c1, c2 = cus[0], cus[1], cus[2]
    c3, joint = cus[3], w.joint
    uon = pattern >= USER_BIT  # some user signal given
    if uon:
        uc, h_user = cus[N_FIXED:], t.user_alone_h
    ring, lpos = w.lr_ring, w.lr_pos
    seen, lref = w.lr_n, w.lr_ref
    r = r0
    while r < r1:
        _subtract(Y[r], mu, dev)
        _absolute(dev, abs_dev)
        _less(abs_dev, wd, ok)  # within admit_z scales either way; NaN / inf fail
        clip = cnz(ok) != n
        if clip:
            # some channel beyond admit_z: still calm if it is finite and not elevated (below
            # rules.spike_threshold); it enters winsorised. Below the minimum ratio everywhere
            # is enough (the usual case: 2 calls, not 4).
            _less(dev, k.log_min, ok)  # NaN / inf fail
            if cnz(ok) != n:
                _less(dev, spike_threshold(wd, k, w.incr_mu), ok)
                if cnz(ok) != n:
                    break
        # run-level channels: z, the CUSUMs and the together evidence, in scalars
        s4, d4 = fixed.tolist()
        zg = d4[0] * A / s4[0] if pattern & 1 else None
        zl = d4[1] * A / s4[1] if pattern & 2 else None
        if zl is not None and loss_diverging(d4[1], zl, t):
            break  # the general path counts the steps of a divergence
        n0 = c0 if zg is None else cusum(c0, zg, S, kd)
        n1 = c1 if zl is None else cusum(c1, zl, S, kd)
        zu, n2, n3 = None, c2, c3
        if pattern & 12:  # the update and param norms (rarely logged)
            if pattern & 4:
                zu = d4[2] * A / s4[2]
                n2 = cusum(c2, zu, S, kd)
            if pattern & 8:
                n3 = cusum(c3, d4[3] * A / s4[3], S, kd)
        uhit = False
        if uon:  # the user signals' CUSUMs, as the fixed channels'
            su, du = w.user_wd.tolist()
            nuc = uc[:]
            for i in range(len(nuc)):
                if pattern & (USER_BIT << i):
                    nuc[i] = cusum(nuc[i], du[i] * A / su[i], S, kd)
                    if nuc[i] >= h_user:
                        uhit = True
        nj = together(joint, zg, zu, zl, t)[0]
        said = 0 if lrs is None else lr_signals(lrs[r], ring, lpos, seen, lref, t)
        if said & LR_JUMPED:
            break  # the LR jumped beyond what the run has survived: a warning
        h_together = h_rise if said & LR_RISING else h_flat
        if nj >= h_together or n0 >= h_grad or n1 >= h_loss or n2 >= h_update or n3 >= h_param or uhit:
            break  # a warning may be due: the general path decides and words it
        if lrs is not None:
            lpos, seen, lref = lr_push(lrs[r], ring, lpos, seen, lref, t)
        # commit: both EMAs as one stacked multiply-add (see Work)
        if clip:
            # clip(dev, +-width) as |dev| capped with dev's sign (exactly fmin(fmax(dev, -wd), wd))
            P1 = w.incr_width
            _fmin(abs_dev, wd, P1)
            _copysign(P1, dev, w.incr_mu)
            _fmax(P1, min_scale, P1)
            _multiply(incr, rates, incr)
        else:
            _fmax(abs_dev, min_scale, abs_dev)
            _multiply(w.ema_in, rates, incr)
        _multiply(ema, keep, ema)
        _add(ema, incr, ema)
        c0, c1, c2 = n0, n1, n2
        c3, joint = n3, nj
        if uon:
            uc = nuc
        if scores is not None:  # as Work.largest_z takes it of a calm step
            zs = w.z_scratch
            _divide(dev, wd, zs)
            m = float(zs[zs.argmax()]) * A
            scores.append(m if m > 0.0 else 0.0)
        r += 1
    if r > r0:
        cus[0], cus[1], cus[2] = c0, c1, c2
        cus[3], w.joint = c3, joint
        if uon:
            cus[N_FIXED:] = uc
        w.lr_pos, w.lr_n, w.lr_ref = lpos, seen, lref
        w.step = steps[r - 1]
        w.has_dev = True
        w.dev_nan = False
        if w.since_warn < BIG:
            w.since_warn = min(w.since_warn + (r - r0), BIG)
        w.level = 0
        w.score_cap = False
    return r
