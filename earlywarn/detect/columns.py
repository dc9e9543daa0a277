"""A logged run's columns through the detector, exactly as one step per row.

Calm rows skip the Observation: their log-values are taken for a chunk of rows at once and
handed to :func:`earlywarn.detect.calm.calm_rows`; every other row goes through the detector's
step. Absent signals (a run-level signal not logged on a row, no layer norms on a row, a layer
reporting 0) are parked on their baselines, as :meth:`Work.refresh` parks them for the live
step.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from earlywarn.detect.calm import calm_rows
from earlywarn.detect.observation import Observation, StepColumns
from earlywarn.detect.rules import Thresholds
from earlywarn.detect.state import GRAD, LAYERS_BIT, LOSS, LR_BIT, N_FIXED, PARAM, PATTERN_BITS, UPDATE, USER_BIT
from earlywarn.detect.work import Work
from earlywarn.events import Event

CHUNK_ROWS = 2048  # rows whose log-values are taken at once
_log = math.log


class Rows(NamedTuple):
    """What each row of ``[start, stop)`` gives, as arrays over those rows."""

    pattern: np.ndarray  # the signals given (DetectorState.pattern)
    ok: np.ndarray  # may be calm: every value given finite and > 0, not skipped, no non-finite flag, no scale reading
    run_level: list  # (channel, values, known) of each run-level signal logged
    lr: np.ndarray | None
    layers: np.ndarray | None  # (rows, layers)
    zero: np.ndarray | None  # (rows, layers): a layer reporting 0 (absent on that row); None if none does
    has_zero: np.ndarray  # some layer reports 0
    no_layers: np.ndarray | None  # the row has no layer norms; None if every row has them
    absent: list  # (channel, rows without it) of the run-level channels missing on some row
    steps: np.ndarray


def classify_rows(w: Work, cols: StepColumns, start: int, stop: int) -> Rows:
    T = stop - start
    nl = w.n_layers

    def known(mask) -> np.ndarray:
        return np.ones(T, dtype=bool) if mask is None else np.asarray(mask[start:stop], dtype=bool)

    pat = np.zeros(T, dtype=np.int64)
    ok = np.ones(T, dtype=bool)
    ex = cols.extras
    fixed = []
    users = tuple((USER_BIT << i, w.layers_end + i) for i in range(w.n_users))
    for bit, chan, vals, kmask in ((1, GRAD, cols.grad_norm, cols.grad_known),
                                   (2, LOSS, cols.loss, cols.loss_known),
                                   (4, UPDATE, *ex.get("update_norm", (None, None))),
                                   (8, PARAM, *ex.get("param_norm", (None, None))),
                                   *((bit, c, *ex.get(w.channels[c], (None, None))) for bit, c in users)):
        if vals is None:
            continue
        kn = known(kmask)
        v = np.asarray(vals[start:stop], dtype=np.float64)
        pat[kn] |= bit
        with np.errstate(invalid="ignore"):
            # the loss is tested per chunk, against its offset then (see general.shift_loss)
            ok &= ~kn | ((v > (-math.inf if chan == LOSS else 0.0)) & (v < math.inf))
        fixed.append((chan, v, kn))
    lr_col = None
    if "lr" in ex:
        lv, lkm = ex["lr"]
        lk = known(lkm)
        lr_col = np.asarray(lv[start:stop], dtype=np.float64)
        pat[lk] |= LR_BIT
        with np.errstate(invalid="ignore"):
            ok &= ~lk | ((lr_col >= 0.0) & (lr_col < math.inf))
    lay = zero = None
    if cols.layer_norms is not None and nl:
        lay = np.asarray(cols.layer_norms[start:stop], dtype=np.float64)
        if lay.ndim != 2 or lay.shape[1] != nl:
            raise ValueError(f"layer_norms has shape {lay.shape} for a detector initialised with {nl} "
                             "layer names; pass (rows, layers) in the same layer order")
        lk = known(cols.layers_known)
        pat[lk] |= LAYERS_BIT
        with np.errstate(invalid="ignore"):
            ok &= ~lk | ((lay >= 0.0) & (lay < math.inf)).all(axis=1)
        zero = (lay == 0.0) & lk[:, None]  # a layer reporting 0 is absent on that row (frozen)
        if not zero.any():
            zero = None
    if cols.skipped is not None:
        ok &= ~np.asarray(cols.skipped[start:stop], dtype=bool)
    if cols.layer_nonfinite is not None:
        ok &= ~(np.asarray(cols.layer_nonfinite[start:stop]) != 0).any(axis=1)
    if "loss_scale" in ex:
        ok &= ~known(ex["loss_scale"][1])  # a scaler reading may be an overflow: per step
    steps = np.asarray(cols.step[start:stop]).astype(np.int64, copy=False)  # as observation() gives it
    absent = [(c, ab) for c, ab in ((c, (pat & bit) == 0) for bit, c in PATTERN_BITS + users) if ab.any()]
    no_layers = (pat & LAYERS_BIT) == 0 if nl else None
    if no_layers is not None and not no_layers.any():
        no_layers = None
    has_zero = np.zeros(T, dtype=bool) if zero is None else zero.any(axis=1)
    return Rows(pat, ok, fixed, lr_col, lay, zero, has_zero, no_layers, absent, steps)


def replay_columns(t: Thresholds, w: Work, cols: StepColumns, start: int, stop: int,
                   step: Callable[[Work, Observation], list[Event]], calm: bool = True) -> list[tuple[int, Event]]:
    """Rows ``[start, stop)`` of ``cols``, exactly as ``step(w, cols.observation(i))`` per row
    (same state, same alerts), as ``(row, alert)`` pairs. ``calm=False``: every row through
    ``step``."""
    out: list[tuple[int, Event]] = []
    if stop <= start:
        return out
    rows = classify_rows(w, cols, start, stop)
    T = stop - start
    a = 0
    while a < T:
        b = min(T, a + CHUNK_ROWS)
        shift = w.loss_shift
        Y, okc = _chunk_log_values(w, rows, a, b)
        Y_rows = list(Y)  # the rows as views, made at once (cheaper than Y[r] per calm row)
        # after a row that took the step, the rest of the chunk is parked again; a signal absent
        # on every row of the chunk keeps its baseline (nothing updates it) and stays parked
        absent = [(c, ab) for c, ab in rows.absent if not ab[a:b].all()]
        no_layers = rows.no_layers if rows.no_layers is not None and not rows.no_layers[a:b].all() else None
        zero = rows.zero if rows.zero is not None and rows.zero[a:b].any() else None  # (none in this chunk)
        # runs of rows that may be calm under one pattern and one set of zero layers:
        # run_end[r] is where r's run ends
        m = b - a
        pat = rows.pattern
        brk = ~okc
        brk[1:] |= pat[a + 1:b] != pat[a:b - 1]
        if zero is not None:
            brk[1:] |= (zero[a + 1:b] != zero[a:b - 1]).any(axis=1)
        cuts = np.append(np.flatnonzero(brk), m)
        run_end = cuts[np.searchsorted(cuts, np.arange(m), side="right")].tolist()
        okl, patl, stepl, zl = okc.tolist(), pat[a:b].tolist(), rows.steps[a:b].tolist(), rows.has_zero[a:b].tolist()
        lrl = None if rows.lr is None else rows.lr[a:b].tolist()
        nl = w.n_layers
        r = 0
        nxt = b
        while r < m:
            # calm as the step would take it: the same signals as the last step, and layers
            # reporting 0 exactly the ones already absent
            if (calm and okl[r] and w.fast and patl[r] == w.pattern
                    and (not (patl[r] & LAYERS_BIT) or (np.array_equal(zero[a + r], ~w.layer_present) if zl[r]
                                                         else w.n_present == nl))):
                e = run_end[r]
                r = calm_rows(t, w, Y_rows, r, e, patl[r], stepl, lrl if patl[r] & LR_BIT else None)
                if r == e:
                    continue
            i = start + a + r
            for ev in step(w, cols.observation(i)):
                out.append((i, ev))
            r += 1
            if w.loss_shift != shift:  # the loss's offset moved: take the rest afresh
                nxt = a + r
                break
            if r < m:
                _park(w, Y, a, b, r, absent, no_layers, zero)
        a = nxt
    return out


def _chunk_log_values(w: Work, rows: Rows, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """The log-values of rows ``[a, b)`` (one row each, absent channels parked) and which of
    them may be calm (a loss that needs a larger offset may not)."""
    Y = np.empty((b - a, w.n))
    okc = rows.ok[a:b].copy()
    shift = w.loss_shift
    for chan, v, kn in rows.run_level:  # math.log, as the live step takes a run-level value
        vc = v[a:b]
        if chan == LOSS:
            vc = vc + shift  # exactly as the live step adds it
            with np.errstate(invalid="ignore"):
                okc &= ~kn[a:b] | (vc > 0.0)
        sel = okc & kn[a:b]
        Y[sel, chan] = list(map(_log, vc[sel].tolist()))
    if rows.layers is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            np.log(rows.layers[a:b], Y[:, N_FIXED:w.layers_end])
    _park(w, Y, a, b, 0, rows.absent, rows.no_layers, rows.zero)
    return Y, okc


def _park(w: Work, Y: np.ndarray, a: int, b: int, r0: int, absent: list, no_layers: np.ndarray | None,
          zero: np.ndarray | None) -> None:
    """Absent channels of rows ``[a + r0, b)`` onto their baseline (deviation exactly 0), as
    :meth:`Work.refresh` parks them for the live step (``absent``, ``no_layers``, ``zero``: as
    in :class:`Rows`). Their baselines only move on rows that have them, which go through the
    step, after which the rest of the chunk is parked again."""
    mu = w.baseline
    mu_lay = mu[N_FIXED:w.layers_end]
    for c, ab in absent:
        Y[r0:, c][ab[a + r0:b]] = mu[c]
    if no_layers is not None:
        Y[r0:, N_FIXED:w.layers_end][no_layers[a + r0:b]] = mu_lay
    if zero is not None:
        np.copyto(Y[r0:, N_FIXED:w.layers_end], mu_lay, where=zero[a + r0:b])
