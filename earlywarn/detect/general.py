"""The general path: warm-up, spikes, escalations, skipped and non-finite steps, with masks.

:func:`general_step` is one step in named phases, in this order: the step's values in log space,
what is wrong with it, the robust deviations, the baseline update, the learning rate, the
run-level evidence, the streaks, the critical alerts, the spikes and warnings, the commit. On a
calm step it computes exactly what the calm path (:mod:`earlywarn.detect.calm`) computes.
"""

from __future__ import annotations

import math

import numpy as np

from earlywarn.detect import messages
from earlywarn.detect.findings import Chosen, Deviations, Evidence, Lr, Trouble, Values
from earlywarn.detect.observation import Observation
from earlywarn.detect.rules import (LR_JUMPED, LR_RISING, Thresholds, alone_thresholds, cusum, loss_diverging,
                                    lr_push, lr_signals, spike_threshold, together, together_threshold)
from earlywarn.detect.state import (BIG, GRAD, LAYERS_BIT, LOSS, LR_BIT, N_FIXED, NAN, PARAM, PATTERN_BITS,
                                    UPDATE, USER_BIT, loss_shift_for)
from earlywarn.detect.work import Work, cnz
from earlywarn.events import Event, Level

_log = math.log
_TINY = 1e-300


def general_step(t: Thresholds, w: Work, obs: Observation, pattern: int) -> list[Event]:
    """One step through the general path; ``pattern`` says which signals it gave."""
    loss = obs.loss
    if loss is not None:
        lv = float(loss)
        if lv + w.loss_shift <= 0.0 and lv > -math.inf:  # finite and <= 0: re-base the loss channel
            shift_loss(t, w, lv)
    v = log_values(w, obs, pattern)
    bad = trouble(w, obs, v.layer_norms)
    d = deviations(t, w, v.logv, bad.skipped)
    if not bad.skipped:
        admit(t, w, d)
    lr = learning_rate(t, w, obs, pattern)
    ev = evidence(t, w, d, bad.skipped)
    # the run-level channels' last elevated deviations: an escalation's message quotes the step before
    prev_run = w.prev[:N_FIXED].tolist() + w.prev[w.layers_end:].tolist()
    grad_streak = int(w.streak[GRAD])  # elevated steps in a row before this one
    hot = streaks(t, w, d, v.logv, bad.skipped)
    alerts = critical(t, w, obs, bad, d, v)
    moved = episode_moves(w, d, int(obs.step))
    alerts += outlier(t, w, obs, d, bad, prev_run[GRAD], grad_streak)
    alerts += early(t, w, obs, d, v)
    since = w.since_warn + 1 if w.since_warn < BIG else BIG
    if since >= t.cfg.rearm_steps and not bad.skipped:
        warning = warn(t, w, obs, pattern, d, v, ev, lr, prev_run)
        if warning is not None:
            alerts.append(warning)
            since = 0
            # a warning consumes its evidence: another needs the rise to go on
            ev = ev._replace(cusums=[0.0] * (N_FIXED + w.n_users), joint=0.0)
    if w.episode and not moved and not bad.skipped and d.present[w.ep_peak_chan]:
        alerts += episode_ends(w, obs)
    commit(t, w, obs, pattern, bad, d, ev, since, hot)
    level = Level.NONE
    for a in alerts:
        if a.level > level:
            level = a.level
    w.level = int(level)
    return alerts


# -- the step's values ----------------------------------------------------------------------------
def shift_loss(t: Thresholds, w: Work, loss: float) -> None:
    """A finite loss <= 0 (minus its offset): the loss channel moves to ``log(loss + c)`` with a
    larger offset ``c``, so that it keeps its baseline, its noise scale and its rules (a
    log of a loss <= 0 would be undefined and would switch protection off). Its baseline and
    scale are mapped to the new offset; its run-level evidence restarts."""
    old = w.loss_shift
    new = loss_shift_for(loss, old)
    i = LOSS
    if w.count[i] > 0:
        m = math.exp(float(w.baseline[i])) - old  # the baseline loss itself
        w.baseline[i] = _log(m + new)
        # d log(l + c) = dl / (l + c): the same spread is a smaller relative one
        w.width[i] = max(float(w.width[i]) * (m + old) / (m + new), t.admit_z * t.cfg.loss_min_scale)
    w.loss_shift = new
    w.cusums[i] = 0.0
    w.streak[i] = w.grow[i] = w.prev[i] = 0.0
    w.loss_div, w.loss_div_fired = 0, False


def log_values(w: Work, obs: Observation, pattern: int) -> Values:
    ex = obs.extras
    le = w.layers_end
    x = [NAN] * (N_FIXED + w.n_users)
    y = np.full(w.n, NAN)
    run = (obs.grad_norm, obs.loss, ex.get("update_norm"), ex.get("param_norm"))
    for c, v in enumerate(run):
        if v is not None:
            x[c] = v = float(v)
            if c == LOSS:
                v = v + w.loss_shift  # as the calm path takes it
            if v > 0.0:
                y[c] = _log(v)  # as the calm path takes it (math.log, not np.log)
    user_bad = []
    if pattern >= USER_BIT:
        for i in range(w.n_users):
            if pattern & (USER_BIT << i):
                x[N_FIXED + i] = v = float(ex[w.channels[le + i]])
                if 0.0 < v < math.inf:
                    y[le + i] = _log(v)
                elif not math.isfinite(v):
                    user_bad.append(le + i)
    lnv = None
    if pattern & LAYERS_BIT:
        lnv = np.asarray(obs.layer_norms, dtype=np.float64)
        yl = y[N_FIXED:le]
        np.log(np.maximum(lnv, _TINY), out=yl)  # inf stays inf: a non-finite gradient
        if cnz(lnv) != w.n_layers:
            yl[lnv == 0.0] = NAN  # a zero norm ("not computed", a frozen layer) is absent
        yl[lnv < 0.0] = NAN
    return Values(x, y, user_bad, lnv)


def trouble(w: Work, obs: Observation, lnv: np.ndarray | None) -> Trouble:
    g, loss, lnf = obs.grad_norm, obs.loss, obs.layer_nonfinite
    loss_scale = obs.extras.get("loss_scale")
    grad_bad = g is not None and not math.isfinite(g)
    if lnv is not None and cnz(np.isfinite(lnv)) != w.n_layers:
        grad_bad = True
    if lnf is not None and cnz(lnf):
        grad_bad = True
    loss_bad = loss is not None and not math.isfinite(loss)
    overflow = False
    new_scale = w.loss_scale
    scale_pending = False
    if loss_scale is not None and math.isfinite(loss_scale):
        if grad_bad:
            # non-finite gradients under a scaler: an overflow the scaler skips; its scale
            # may drop now or on the next reading (which is then not a second overflow)
            overflow = True
            scale_pending = not loss_scale < w.loss_scale
        elif loss_scale < w.loss_scale and not w.scale_pending:
            overflow = True  # a log that only shows the scale drop (values may be stale)
        new_scale = float(loss_scale)
    skipped = bool(obs.skipped) or overflow or grad_bad
    return Trouble(grad_bad, loss_bad, overflow, scale_pending, new_scale, skipped)


# -- deviations and the baseline --------------------------------------------------------------
def deviations(t: Thresholds, w: Work, y: np.ndarray, skipped: bool) -> Deviations:
    k, wd = w.consts, w.width
    present = np.isfinite(y)
    dev = y - w.baseline
    z = (dev * t.admit_z) / wd  # as the calm path computes it
    warm = w.count >= t.cfg.warmup_steps  # as of before this step
    pw = present & warm
    # elevated: z >= spike_z and a ratio of at least the minimum, i.e. dev >= this threshold
    elev = pw & (dev >= spike_threshold(wd, k))
    if skipped:
        elev[:] = False  # a skipped step's values are stale or non-finite: not a spike
    zf = [float(v) for v in z[:N_FIXED]]
    return Deviations(present, dev, z, warm, pw, elev, bool(np.count_nonzero(elev)), zf,
                      [bool(v) for v in pw[:N_FIXED]], bool(loss_diverging(float(dev[LOSS]), zf[LOSS], t)))


def admit(t: Thresholds, w: Work, d: Deviations) -> None:
    """The baseline and width EMAs over the admitted values (same arithmetic as the calm path):
    spikes never enter, the rest enters winsorised; warm-up is an exact running mean."""
    cfg, k, cnt, dev, wd, n = t.cfg, w.consts, w.count, d.dev, w.width, w.n
    adm = d.present & ~d.elevated
    if w.loss_div and adm[LOSS] and d.warm[LOSS] and d.diverging:
        adm[LOSS] = False  # a divergence under way (its 2nd step on) does not become the baseline
    P2 = np.empty((2, n))
    R2 = np.empty((2, n))
    np.fmin(np.fmax(dev, -wd), wd, out=P2[0])
    np.fmax(np.fmin(np.abs(dev), wd), k.min_scale, out=P2[1])
    P2[:, ~adm] = 0.0  # absent values are NaN: zero them before the rates do
    np.multiply(adm, cfg.alpha, out=R2[0])
    np.multiply(adm, cfg.scale_alpha, out=R2[1])
    young = adm & (cnt < t.mature_n)
    if cnz(young):
        # warm-up: an exact running mean of the first values (rate 1/count), and a channel's
        # first value is its baseline
        r = np.where(young, 1.0 / (cnt + 1.0), 0.0)
        np.maximum(R2[0], r, out=R2[0])
        np.maximum(R2[1], r, out=R2[1])
        first = young & (cnt == 0)
        if cnz(first):
            P2[0, first] = dev[first]
            R2[0, first] = 1.0
            R2[1, first] = 0.0
        cnt += young
    M2 = np.ones((2, n))
    np.subtract(1.0, R2[1], out=M2[1])
    np.multiply(R2[1], t.admit_z, out=R2[1])  # the width moves admit_z times the scale
    P2 *= R2
    w.ema *= M2
    w.ema += P2


# -- evidence ---------------------------------------------------------------------------------------
def learning_rate(t: Thresholds, w: Work, obs: Observation, pattern: int) -> Lr:
    """The LR rules read the ring as it was, then the step's LR goes in (nothing else reads it)."""
    lr = float(obs.extras["lr"]) if pattern & LR_BIT else NAN
    if not 0.0 <= lr < math.inf:
        return Lr(False, None)
    ring, pos, seen, ref = w.lr_ring, w.lr_pos, w.lr_n, w.lr_ref
    said = lr_signals(lr, ring, pos, seen, ref, t)
    w.lr_pos, w.lr_n, w.lr_ref = lr_push(lr, ring, pos, seen, ref, t)
    return Lr(bool(said & LR_RISING), (lr, ref) if said & LR_JUMPED else None)


def evidence(t: Thresholds, w: Work, d: Deviations, skipped: bool) -> Evidence:
    """The run-level CUSUMs and the together evidence after this step (frozen on skipped
    steps; a channel still warming up restarts its CUSUM)."""
    cus = list(w.cusums)
    if skipped:
        return Evidence(cus, w.joint, NAN)
    S, kd, zf, pwf, present = t.spike_z, t.drift_k, d.z_fixed, d.judged_fixed, d.present
    for c in range(N_FIXED):
        if pwf[c]:
            cus[c] = cusum(cus[c], zf[c], S, kd)
        elif present[c]:
            cus[c] = 0.0
    for i in range(w.n_users):
        c = w.layers_end + i
        if d.judged[c]:
            cus[N_FIXED + i] = cusum(cus[N_FIXED + i], float(d.z[c]), S, kd)
        elif present[c]:
            cus[N_FIXED + i] = 0.0
    joint, m = together(w.joint, zf[GRAD] if pwf[GRAD] else None, zf[UPDATE] if pwf[UPDATE] else None,
                        zf[LOSS] if pwf[LOSS] else None, t)
    return Evidence(cus, joint, NAN if m is None else m)


def streaks(t: Thresholds, w: Work, d: Deviations, y: np.ndarray, skipped: bool) -> bool:
    """Consecutive elevated (and growing) steps per channel; a plateau held ``readapt_steps``
    becomes the new baseline. Returns whether some streak is under way."""
    if not (d.any_elevated or w.hot) or skipped:  # a skipped step leaves the streaks as they were
        return w.hot
    elev, dev = d.elevated, d.dev
    streak, grow, prev = w.streak, w.grow, w.prev
    grows = elev & (streak > 0) & (dev >= prev + w.consts.log_growth)
    grow[:] = np.where(elev, np.where(grows, grow + 1.0, 1.0), 0.0)
    streak[:] = np.where(elev, streak + 1.0, 0.0)
    prev[:] = np.where(elev, dev, 0.0)
    if d.any_elevated:
        stale = streak >= t.cfg.readapt_steps
        if np.count_nonzero(stale):  # a plateau held this long is the new normal
            np.copyto(w.baseline, y, where=stale)
            streak[stale] = 0.0
            grow[stale] = 0.0
            prev[stale] = 0.0
    return d.any_elevated


# -- alerts -----------------------------------------------------------------------------------------
def critical(t: Thresholds, w: Work, obs: Observation, bad: Trouble, d: Deviations, v: Values) -> list[Event]:
    """Non-finite gradients, scaler overflows, a non-finite or diverged loss."""
    cfg, alerts = t.cfg, []
    if bad.overflow:
        w.overflow += 1
        alerts.append(messages.overflow_event(obs, w, w.loss_scale, obs.extras["loss_scale"], w.overflow))
        if w.overflow == cfg.overflow_steps:
            alerts.append(messages.nonfinite_event(obs, w, w.overflow, scaler=True))
        w.nonfinite = 0
    else:
        w.overflow = 0
        if bad.grad_bad:
            w.nonfinite += 1
            alerts.append(messages.nonfinite_event(obs, w, w.nonfinite, scaler=False))
        else:
            w.nonfinite = 0
    if bad.loss_bad:
        base = math.exp(float(w.baseline[LOSS])) - w.loss_shift if d.warm[LOSS] else NAN
        alerts.append(messages.loss_nonfinite_event(obs, base))
    elif d.present[LOSS] and d.warm[LOSS]:
        # diverged: far above the baseline both as a ratio and in the loss's own noise (a
        # batch-8 loss wobbles by 2x; its scale says so), and for long, not a 2-step excursion
        if d.diverging:
            w.loss_div += 1
            if w.loss_div >= cfg.loss_diverge_steps and not w.loss_div_fired:
                w.loss_div_fired = True
                alerts.append(messages.loss_diverged_event(obs, w, float(d.dev[LOSS]), float(v.logv[LOSS]),
                                                           v.given[LOSS], d.z_fixed[LOSS]))
        else:
            w.loss_div = 0
            w.loss_div_fired = False
    return alerts


def outlier(t: Thresholds, w: Work, obs: Observation, d: Deviations, bad: Trouble, prev_dev: float,
            prev_streak: int) -> list[Event]:
    """GRAD_OUTLIER: the global gradient norm elevated and ``outlier_ratio`` times its typical
    value or more, reported at its own step (the guard reads it before the update). ``prev_dev``
    and ``prev_streak``: the step before's log-ratio where it was elevated (else 0), and how many
    steps in a row it had been -- a gradient that climbed into the outliers, or one that jumped."""
    if bad.skipped or not d.elevated[GRAD] or d.dev[GRAD] < t.log_outlier:
        w.outliers = 0
        return []
    w.outliers += 1
    w.ep_warned = True  # said now, at the step itself: no spike info when the episode ends
    loss_ratio = math.exp(float(d.dev[LOSS])) if d.judged[LOSS] else NAN
    return [messages.outlier_event(obs, w, float(d.dev[GRAD]), loss_ratio, ordered_layers(w, d, t.cfg.max_layers_listed),
                                   joined=_layers_joined(w, d, int(obs.step)), prev_ratio=math.exp(prev_dev),
                                   prev_elevated=prev_streak)]


def _layers_joined(w: Work, d: Deviations, step: int) -> str:
    """Why the global norm's jump is the run's own, if it is: ``"new"`` -- layers that never had a
    gradient have one now (a frozen part unfrozen); ``"idle"`` -- layers absent for IDLE_STEPS
    steps or more have one again (a part that trains only on some steps: a rarely sampled task's
    head, an expert), so this step is another kind of step, not a corrupt one of the usual kind.
    ``""`` otherwise. (A layer back from a step or two at 0 -- dead units under a corrupt batch --
    does not count.) Only the first outlier of a run of them is explained so: one inside a burst
    of corrupt batches, already an outlier at the step before, is not the joined layers' doing.
    The calm path may have taken this step's set of layers already."""
    if w.outliers > 1 or not w.n_layers or not w.has_dev or not d.present[N_FIXED:w.layers_end].any():
        return ""
    present = d.present[N_FIXED:w.layers_end]
    if np.any(present & ~w.layer_present & (w.count[N_FIXED:w.layers_end] == 0)):
        return "new"
    return "idle" if w.back_idle_at == step or w.back_from_idle(present, step) else ""


def early(t: Thresholds, w: Work, obs: Observation, d: Deviations, v: Values) -> list[Event]:
    """The first steps, before the loss has a baseline: its value at initialisation is the prior.
    A loss ``init_loss_ratio`` times that ``init_loss_steps`` steps in a row is a COLLAPSE_RISK
    warning, once."""
    y = v.logv[LOSS]
    if not y == y or w.init_warned:  # no (finite, shifted > 0) loss this step, or said already
        return []
    if not w.loss_first == w.loss_first:
        w.loss_first = v.given[LOSS]
        return []
    first = w.loss_first + w.loss_shift
    if d.warm[LOSS] or not first > 0.0:
        return []
    ratio_log = y - _log(first)
    w.init_high = w.init_high + 1 if ratio_log >= t.log_init else 0
    if w.init_high < t.cfg.init_loss_steps:
        return []
    w.init_warned = True
    return [messages.early_event(obs, w, math.exp(ratio_log), v.given[LOSS])]


def episode_moves(w: Work, d: Deviations, step: int) -> bool:
    """A gradient signal elevated: an episode starts or reaches a new peak. Returns whether one
    was."""
    k = w.consts
    if not (d.any_elevated and np.count_nonzero(d.elevated & k.gradient_like)):
        return False
    # the run-level norm names the spike when it moved; a layer only when it alone did
    sel = d.elevated & k.gradient_like & k.run_level
    if not np.count_nonzero(sel):
        sel = d.elevated & k.gradient_like
    dev_g = np.where(sel, d.dev, -np.inf)
    peak = int(np.argmax(dev_g))
    if not w.episode:
        w.episode = True
        w.ep_start, w.ep_peak_step, w.ep_peak_chan = step, step, peak
        w.ep_peak_dev, w.ep_warned = float(dev_g[peak]), False
        w.ep_first_layer = first_layer(w, d)
    elif dev_g[peak] > w.ep_peak_dev:
        w.ep_peak_step, w.ep_peak_chan, w.ep_peak_dev = step, peak, float(dev_g[peak])
    return True


def episode_ends(w: Work, obs: Observation) -> list[Event]:
    """The episode is over (its peak signal is back, not just absent: a user signal not reported
    ends nothing): a GRAD_SPIKE info unless it raised a warning."""
    out = [] if w.ep_warned else [messages.spike_event(obs, w)]
    w.episode = False
    w.ep_start = w.ep_peak_step = w.ep_peak_chan = w.ep_first_layer = -1
    w.ep_peak_dev, w.ep_warned = 0.0, False
    return out


def warn(t: Thresholds, w: Work, obs: Observation, pattern: int, d: Deviations, v: Values, ev: Evidence,
         lr: Lr, prev_run: list[float]) -> Event | None:
    """The COLLAPSE_RISK event of this step, if a warning rule holds."""
    h_together = together_threshold(t, bool(pattern & LR_BIT), lr.rising)
    chosen = choose_warning(t, w, d, ev, h_together, pattern, lr, v.user_bad)
    if chosen is None:
        return None
    w.ep_warned = True
    named = chosen.rule not in ("user_value", "lr_jump")  # those name no layers
    layers = ordered_layers(w, d, t.cfg.max_layers_listed) if named else ()
    return messages.warning_event(obs, w, chosen, d, v, ev, prev_run, lr.jump, layers)


def first_layer(w: Work, d: Deviations) -> int:
    """Channel index of the layer that moved first: longest current streak, then highest."""
    le = w.layers_end
    lay = np.flatnonzero(d.elevated[N_FIXED:le])
    if lay.size == 0:
        return -1
    order = np.lexsort((-d.dev[N_FIXED:le][lay], -w.streak[N_FIXED:le][lay]))
    return int(lay[order[0]]) + N_FIXED


def ordered_layers(w: Work, d: Deviations, max_listed: int) -> tuple[str, ...]:
    """Layers that moved, first mover first: elevated longest, then highest now. Without an
    elevated layer, the layers at least two scales above their baselines."""
    le = w.layers_end
    lay_z = np.nan_to_num(d.z[N_FIXED:le], nan=-np.inf)
    streak = w.streak[N_FIXED:le]
    moved = np.flatnonzero(d.elevated[N_FIXED:le])
    if moved.size == 0:
        moved = np.flatnonzero(lay_z >= 2.0)
    if moved.size == 0:
        return ()
    order = np.lexsort((-lay_z[moved], -streak[moved]))
    names = w.channels
    out = [messages.layer_of(names[int(moved[i]) + N_FIXED]) for i in order]
    return tuple(out[:max_listed])


def choose_warning(t: Thresholds, w: Work, d: Deviations, ev: Evidence, h_together: float, pattern: int,
                   lr: Lr, user_bad: list[int]) -> Chosen | None:
    """The COLLAPSE_RISK rule that holds at this step, if one does, in order of precedence:
    an escalation, an enormous jump, the gradient and the loss rising together, one run-level
    signal rising alone, several layers at once; then a user signal gone NaN / inf, then an LR
    jump."""
    cfg, k, le, cus = t.cfg, w.consts, w.layers_end, ev.cusums
    elev, dev = d.elevated, d.dev
    h = alone_thresholds(t, pattern)
    alone = [c for c, hc in ((GRAD, h.grad), (UPDATE, h.update), (LOSS, h.loss), (PARAM, h.param)) if cus[c] >= hc]
    alone += [le + i for i in range(w.n_users) if cus[N_FIXED + i] >= t.user_alone_h]
    if not (ev.joint >= h_together or alone or cnz(elev) or lr.jump or user_bad):
        return None
    esc = k.may_warn & elev & (w.grow >= cfg.escalate_steps) & (dev >= k.log_warn)
    jump = k.may_warn & elev & k.gradient_like & (dev >= t.log_jump)
    together = ev.joint >= h_together and ev.term > 0.0  # not on the step the values came back
    hot_layers = 0
    multi = False
    if w.n_layers and cfg.layers_at_once:
        hot_layers = int(np.count_nonzero(elev[N_FIXED:le] & (dev[N_FIXED:le] >= k.log_warn[N_FIXED:le])))
        multi = hot_layers >= cfg.layers_at_once
    if esc.any():
        return Chosen("escalating", _first(esc, w), hot_layers)
    if jump.any():
        return Chosen("jump", _first(jump, w), hot_layers)
    if together:
        zg, zu = d.z[GRAD], d.z[UPDATE]
        chan = UPDATE if (cfg.update_warns and zu == zu and not zu <= zg) else GRAD
        if chan == GRAD and zg != zg:
            chan = UPDATE  # no gradient norm logged: the update norm stood in for it
        return Chosen("together", chan, hot_layers)
    if alone:
        return Chosen("alone", alone[0], hot_layers)
    if multi:
        return Chosen("layers", GRAD, hot_layers)
    if user_bad:
        return Chosen("user_value", user_bad[0], hot_layers)
    if lr.jump is not None:
        return Chosen("lr_jump", GRAD, hot_layers)
    return None


def _first(mask: np.ndarray, w: Work) -> int:
    """The channel a warning names among ``mask``: grad, update, loss, param, then the users."""
    for c in (GRAD, UPDATE, LOSS, PARAM, *range(w.layers_end, w.n)):
        if mask[c]:
            return c
    return GRAD


# -- commit -----------------------------------------------------------------------------------------
def commit(t: Thresholds, w: Work, obs: Observation, pattern: int, bad: Trouble, d: Deviations,
           ev: Evidence, since: int, hot: bool) -> None:
    """The step's results into the working state, and whether the next step may be calm."""
    le = w.layers_end
    w.cusums, w.joint, w.since_warn = ev.cusums, ev.joint, since
    w.hot = hot
    w.loss_scale, w.scale_pending = bad.new_scale, bad.scale_pending
    w.score_cap = bad.grad_bad or bad.loss_bad
    w.step = int(obs.step)
    np.copyto(w.dev, np.where(d.judged, d.dev, NAN))
    w.has_dev = True
    w.dev_nan = not bool(d.judged.all())
    w.pattern = pattern
    if pattern & LAYERS_BIT:  # layers reporting 0 are absent: the calm path expects the same ones
        w.set_presence(d.present[N_FIXED:le], w.step)
    else:
        w.layer_present[:] = True
        w.n_present = w.n_layers
    mature = w.count >= t.mature_n
    expected_mature = True
    for bit, c in PATTERN_BITS:
        if pattern & bit and not mature[c]:
            expected_mature = False
    for i in range(w.n_users):
        if pattern & (USER_BIT << i) and not mature[le + i]:
            expected_mature = False
    if pattern & LAYERS_BIT and not mature[N_FIXED:le][w.layer_present].all():
        expected_mature = False
    w.fast = (expected_mature and not hot and not w.episode and not w.loss_div and not bad.grad_bad
              and not bad.loss_bad and not bad.overflow and not bad.scale_pending)
    w.refresh(t)
