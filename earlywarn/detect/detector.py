"""The streaming detector: a pure ``init`` / ``update`` pair (optax style) and a stateful wrapper.

Every signal is a *channel*: ``grad_norm``, ``loss``, ``update_norm``, ``param_norm`` and one
``grad_norm/<layer>`` per layer. Each channel keeps, in log space (magnitudes differ by 1e6
between runs; ratios do not), a robust trailing baseline (EMA of admitted log-values,
winsorised), a robust scale (EMA of winsorised absolute deviations, floored), a one-sided CUSUM
of its z-scores, and a few counters. All channels are updated together by a handful of numpy
calls; a calm step of a mature run takes a mask-free path. A step costs O(channels) and
allocates nothing that grows.

What is alarming is *escalation*, not one spike:

- ``info`` GRAD_SPIKE: a gradient signal was elevated and came back without escalating
  (reported on the step it recovered; ``values["peak_step"]`` says when it peaked).
- ``warning`` COLLAPSE_RISK: (a) consecutive elevated steps that keep growing (BLOOM-176B's
  0.24 -> 0.95 -> 2.4 -> 16); (b) the gradient norm and the loss rising together over several
  steps (their CUSUMs past ``drift_h`` and ``loss_drift_h``); (c) one signal rising for long
  (``drift_alone_h``); optionally (d) several layers at once or (e) one enormous jump.
  Per-layer signals never warn on their own (small layers are spiky); they name the layer that
  moved first.
- ``critical``: NONFINITE_GRAD (before the optimizer step), LOSS_NONFINITE, LOSS_DIVERGED, or a
  loss scaler that keeps overflowing.

Spikes, skipped steps, overflow steps and non-finite values never enter a baseline.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from earlywarn.detect.config import DetectorConfig
from earlywarn.detect.observation import Observation
from earlywarn.events import Event, Kind, Level

# fixed channels, then one per layer
GRAD, LOSS, UPDATE, PARAM = 0, 1, 2, 3
N_FIXED = 4
FIXED_NAMES = ("grad_norm", "loss", "update_norm", "param_norm")
# rows of DetectorState.stats
MU, SCALE, COUNT, STREAK, GROW, PREV = range(6)  # the state proper
CUSUM = 6  # one-sided CUSUM of z (sustained rise)
RATE_M, SRATE_M = 7, 8  # steady EMA rates of the channels the calm path updates, 0 elsewhere
N_ROWS = 9
SCORE_CAP = 1000.0  # score of a non-finite step (metrics backends dislike inf)
_NAN = float("nan")
STATE_VERSION = 1


class DetectorState(NamedTuple):
    """Everything the detector remembers. Immutable from the outside: ``update`` returns a new one.

    ``stats`` is a ``(9, channels)`` float array with rows ``MU`` (baseline, log), ``SCALE``
    (robust scale, log units, floored), ``COUNT`` (values admitted; counting stops at maturity),
    ``STREAK`` (consecutive elevated steps), ``GROW`` (consecutive elevated steps, each above the
    last by the growth factor), ``PREV`` (last log-deviation), ``CUSUM`` (one-sided cumulative
    sum of ``z - drift_k``: evidence of a sustained rise), and ``RATE_M`` / ``SRATE_M`` (the
    EMA rates the calm path applies: the steady rates for mature channels of the current
    presence pattern, 0 elsewhere). ``dev`` is the latest log-deviation per channel.
    """

    step: int
    channels: tuple[str, ...]
    stats: np.ndarray
    dev: np.ndarray | None = None
    pattern: int = -1  # which of grad/loss/update/param/layers were given (bits 0-4)
    n_absent: int = 0  # channels absent under that pattern
    fast: bool = False  # the next step may take the calm path
    episode: bool = False  # some gradient signal is (or just was) elevated
    ep_start: int = -1
    ep_peak_step: int = -1
    ep_peak_chan: int = -1
    ep_peak_dev: float = 0.0
    ep_first_layer: int = -1
    ep_warned: bool = False
    calm: int = 1 << 30  # consecutive steps with nothing elevated
    warn_armed: bool = True
    loss_div: int = 0  # consecutive steps at or above loss_diverge_ratio
    loss_div_fired: bool = False
    nonfinite: int = 0  # consecutive non-finite-gradient steps
    overflow: int = 0  # consecutive loss-scaler overflows
    loss_scale: float = _NAN
    scale_pending: bool = False  # an overflow was seen before the scale reading dropped
    score_cap: bool = False  # latest step was non-finite
    level: int = 0
    hot: bool = False  # some STREAK/GROW/PREV entry is non-zero

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(c[len("grad_norm/"):] for c in self.channels[N_FIXED:])

    @property
    def score(self) -> float:
        """Largest robust z above baseline at the latest step (see StreamingDetector.score)."""
        if self.score_cap:
            return SCORE_CAP
        if self.dev is None or self.dev.size == 0:
            return 0.0
        m = float(np.fmax.reduce(self.dev / self.stats[SCALE]))  # NaN (absent) ignored
        return m if m > 0.0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = self._asdict()
        d["channels"] = list(self.channels)
        d["stats"] = self.stats.copy()
        d["dev"] = None if self.dev is None else self.dev.copy()
        d["version"] = STATE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DetectorState":
        if int(d.get("version", STATE_VERSION)) != STATE_VERSION:
            raise ValueError(f"detector state version {d.get('version')} is not {STATE_VERSION}")
        kw = {k: d[k] for k in cls._fields if k in d}
        kw["channels"] = tuple(str(c) for c in d["channels"])
        stats = np.array(d["stats"], dtype=np.float64)
        if stats.shape != (N_ROWS, len(kw["channels"])):
            raise ValueError(f"detector state: stats shape {stats.shape} does not match "
                             f"{len(kw['channels'])} channels")
        kw["stats"] = stats
        if kw.get("dev") is not None:
            kw["dev"] = np.array(kw["dev"], dtype=np.float64)
        for k in ("step", "pattern", "n_absent", "ep_start", "ep_peak_step", "ep_peak_chan",
                  "ep_first_layer", "calm", "loss_div", "nonfinite", "overflow", "level"):
            if k in kw:
                kw[k] = int(kw[k])
        for k in ("ep_peak_dev", "loss_scale"):
            if k in kw:
                kw[k] = float(kw[k])
        for k in ("fast", "episode", "ep_warned", "warn_armed", "loss_div_fired", "hot", "score_cap",
                  "scale_pending"):
            if k in kw:
                kw[k] = bool(kw[k])
        return cls(**kw)


class _Consts(NamedTuple):
    """Per channel count: thresholds as arrays (array compares are cheaper than scalar ones)."""

    lmin: np.ndarray  # log of the minimum ratio to count as elevated
    lgrowth: np.ndarray  # log growth factor of an escalation
    lwarn: np.ndarray  # log ratio an escalation must reach to warn
    gradlike: np.ndarray  # bool: gradient-type channels (all but the loss)
    fixed: np.ndarray  # bool: the run-level channels (grad, loss, update, param), not layers
    tiny: np.ndarray
    min_scale: np.ndarray  # per channel (the loss has its own floor)
    spike_z: np.ndarray
    drift_exit: np.ndarray  # CUSUM level at which a channel leaves the calm path (inf: never)
    drift_k: np.ndarray
    admit: np.ndarray
    neg_admit: np.ndarray
    zero: np.ndarray


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


class Detector:
    """Pure detector: ``state = init(layer_names)``, ``alerts, state = update(state, obs)``.

    ``update`` never mutates its input state, so a state can be kept, compared, checkpointed and
    replayed; the same object serves the live hook and the offline analyser. Deterministic: the
    same observations give the same alerts.
    """

    def __init__(self, cfg: DetectorConfig | None = None):
        self.cfg = cfg if cfg is not None else DetectorConfig()
        if not isinstance(self.cfg, DetectorConfig):
            raise TypeError(f"Detector(cfg=...) wants a DetectorConfig, got {type(cfg).__name__}")
        c = self.cfg
        self._log_jump = math.log(c.jump_ratio) if math.isfinite(c.jump_ratio) else math.inf
        self._log_div = math.log(c.loss_diverge_ratio)
        # a channel is mature once its EMA rates no longer depend on its count
        self._mature_n = float(max(c.warmup_steps, math.ceil(1.0 / c.alpha), math.ceil(1.0 / c.scale_alpha)))
        self._scale0 = max(c.prior_scale, c.min_scale, c.loss_min_scale)
        self._consts: dict[int, _Consts] = {}

    def _k(self, n: int) -> _Consts:
        k = self._consts.get(n)
        if k is None:
            c = self.cfg
            lmin = np.full(n, math.log(c.spike_ratio))
            lmin[LOSS] = math.log(c.loss_spike_ratio)
            lgrowth = np.full(n, math.log(c.growth))
            lgrowth[LOSS] = math.log(c.loss_growth)
            lwarn = np.full(n, math.log(c.warn_ratio))
            lwarn[LOSS] = math.log(c.loss_warn_ratio)
            gradlike = np.ones(n, dtype=bool)
            gradlike[LOSS] = False
            fixed = np.zeros(n, dtype=bool)
            fixed[:N_FIXED] = True
            min_scale = np.full(n, float(c.min_scale))
            min_scale[LOSS] = c.loss_min_scale
            drift_exit = np.full(n, np.inf)
            drift_exit[[GRAD, UPDATE]] = c.drift_h
            drift_exit[LOSS] = c.loss_drift_h
            drift_exit[PARAM] = c.drift_alone_h
            if c.layer_drift:
                drift_exit[N_FIXED:] = c.drift_h
            k = self._consts[n] = _Consts(
                lmin, lgrowth, lwarn, gradlike, fixed, np.full(n, 1e-300), min_scale,
                np.full(n, float(c.spike_z)), drift_exit, np.full(n, float(c.drift_k)),
                np.full(n, float(c.admit_z)), np.full(n, -float(c.admit_z)), np.zeros(n))
        return k

    # ------------------------------------------------------------------------------------------
    def init(self, layer_names: Sequence[str] = (),
             baseline: Mapping[str, float] | None = None) -> DetectorState:
        """A fresh state for a model whose per-layer norms come in ``layer_names`` order.

        ``baseline`` gives prior typical values (keys ``"grad_norm"``, ``"loss"``,
        ``"update_norm"``, ``"param_norm"``, ``"grad_norm/<layer>"``): those channels start warm,
        which lets a short snippet with no history of its own be judged (the BLOOM case).
        """
        layer_names = tuple(str(n) for n in layer_names)
        if len(set(layer_names)) != len(layer_names):
            raise ValueError("layer_names must be unique")
        channels = FIXED_NAMES + tuple(f"grad_norm/{n}" for n in layer_names)
        stats = np.zeros((N_ROWS, len(channels)))
        stats[SCALE] = self._scale0
        for key, value in (baseline or {}).items():
            if key not in channels:
                raise ValueError(f"baseline key {key!r} is not a signal of this detector; use one "
                                 f"of {list(FIXED_NAMES)} or 'grad_norm/<layer>'")
            v = float(value)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"baseline[{key!r}]={value!r}: use a finite value > 0")
            i = channels.index(key)
            stats[MU, i] = math.log(v)
            stats[COUNT, i] = float(self.cfg.warmup_steps)
        return DetectorState(step=-1, channels=channels, stats=stats)

    # ------------------------------------------------------------------------------------------
    def update(self, state: DetectorState, obs: Observation) -> tuple[list[Event], DetectorState]:
        """Feed one step; returns the alerts it raised and the next state."""
        n = len(state.channels)
        nl = n - N_FIXED
        # -- gather the step's values into one vector (NaN = absent) -------------------------
        x = np.empty(n)
        g = obs.grad_norm
        loss = obs.loss
        extras = obs.extras
        pattern = 0
        if g is None:
            x[GRAD] = _NAN
        else:
            x[GRAD] = g
            pattern = 1
        if loss is None:
            x[LOSS] = _NAN
        else:
            x[LOSS] = loss
            pattern |= 2
        loss_scale = None
        if extras:
            u, p = extras.get("update_norm"), extras.get("param_norm")
            if u is None:
                x[UPDATE] = _NAN
            else:
                x[UPDATE] = u
                pattern |= 4
            if p is None:
                x[PARAM] = _NAN
            else:
                x[PARAM] = p
                pattern |= 8
            loss_scale = extras.get("loss_scale")
        else:
            x[UPDATE] = x[PARAM] = _NAN
        ln = obs.layer_norms
        if nl:
            if ln is None:
                x[N_FIXED:] = _NAN
            else:
                if len(ln) != nl:
                    raise ValueError(f"step {obs.step}: {len(ln)} layer norms for a detector initialised "
                                     f"with {nl} layer names; pass the same layers in the same order")
                x[N_FIXED:] = ln
                pattern |= 16
        lnf = obs.layer_nonfinite

        # -- the calm path: a mature run, same signals as last step, nothing near a spike -----
        if (state.fast and pattern == state.pattern and not obs.skipped and not state.scale_pending
                and (loss_scale is None or not loss_scale < state.loss_scale)
                and (lnf is None or not np.count_nonzero(lnf))):
            k = self._consts.get(n) or self._k(n)
            stats = state.stats.copy()
            mu, sc = stats[MU], stats[SCALE]
            # a zero norm gives log(tiny) = -690: |z| huge sends the step to the general path,
            # which treats it as absent
            dev = np.log(np.maximum(x, k.tiny)) - mu
            z = dev / sc
            az = np.abs(z)
            # nothing within reach of a spike either way; absent channels are NaN and fail `<`
            if np.count_nonzero(az < k.spike_z) == n - state.n_absent:
                cus = stats[CUSUM]
                cus += z
                cus -= k.drift_k
                np.fmax(cus, k.zero, out=cus)  # absent (NaN) -> 0
                if not np.count_nonzero(cus >= k.drift_exit) and not dev[LOSS] >= self._log_div:
                    # winsorise in z (fmin/fmax turn NaN, the absent channels, into a finite
                    # bound that then meets a rate of 0)
                    mu += stats[RATE_M] * (np.fmin(np.fmax(z, k.neg_admit), k.admit) * sc)
                    # the floor applies to what enters: a rounding logger's zeros count as the floor
                    sc += stats[SRATE_M] * (np.fmax(np.fmin(az, k.admit) * sc, k.min_scale) - sc)
                    calm = state.calm + 1 if state.calm < (1 << 30) else state.calm
                    new_scale = state.loss_scale if loss_scale is None else float(loss_scale)
                    return [], tuple.__new__(DetectorState, (
                        int(obs.step), state.channels, stats, dev, pattern, state.n_absent, True,
                        False, -1, -1, -1, 0.0, -1, False, calm,
                        state.warn_armed or calm >= self.cfg.rearm_steps,
                        0, False, 0, 0, new_scale, False, False, 0, False))
        return self._update_full(state, obs, x, pattern, loss_scale, ln, lnf)

    def _update_full(self, state: DetectorState, obs: Observation, x: np.ndarray, pattern: int,
                     loss_scale, ln, lnf) -> tuple[list[Event], DetectorState]:
        """Warm-up, spikes, escalations, skipped and non-finite steps: the general, masked path."""
        cfg = self.cfg
        n = len(state.channels)
        nl = n - N_FIXED
        k = self._k(n)
        step = int(obs.step)
        g, loss = obs.grad_norm, obs.loss

        # -- what is wrong with this step ----------------------------------------------------
        grad_bad = g is not None and not math.isfinite(g)
        if nl and ln is not None and not bool(np.isfinite(x[N_FIXED:]).all()):
            grad_bad = True
        if lnf is not None and np.count_nonzero(lnf):
            grad_bad = True
        loss_bad = loss is not None and not math.isfinite(loss)
        overflow = False
        new_scale = state.loss_scale
        scale_pending = False
        if loss_scale is not None and math.isfinite(loss_scale):
            if grad_bad:
                # non-finite gradients under a scaler: an overflow the scaler skips; its scale
                # may drop now or on the next reading (which is then not a second overflow)
                overflow = True
                scale_pending = not loss_scale < state.loss_scale
            elif loss_scale < state.loss_scale and not state.scale_pending:
                overflow = True  # a log that only shows the scale drop (values may be stale)
            new_scale = float(loss_scale)
        skipped = obs.skipped or overflow or grad_bad

        # -- robust deviations --------------------------------------------------------------
        stats = state.stats.copy()
        mu, sc, cnt = stats[MU], stats[SCALE], stats[COUNT]
        y = np.log(np.maximum(x, k.tiny))
        y[y < -300.0] = _NAN  # a zero norm ("not computed", a frozen layer) is absent
        present = np.isfinite(y)
        dev = y - mu
        z = dev / sc
        warm = cnt >= cfg.warmup_steps  # as of before this step
        pw = present & warm
        elev = pw & (z >= cfg.spike_z) & (dev >= k.lmin)
        if skipped:
            elev[:] = False  # a skipped step's values are stale or non-finite: not a spike
        any_elev = bool(np.count_nonzero(elev))

        # -- baseline update: admitted values only, winsorised ------------------------------
        if not skipped:
            adm = present & ~elev  # spikes never enter; the rest enters winsorised
            first = adm & (cnt == 0)  # a channel's first value is its baseline
            lim = cfg.admit_z * sc
            d = np.where(first, dev, np.fmin(np.fmax(dev, -lim), lim))
            r = 1.0 / (cnt + 1.0)
            mu += np.where(adm, np.maximum(cfg.alpha, r) * d, 0.0)
            # the floor applies to what enters: a rounding logger's zeros count as the floor
            v = np.fmin(np.fmax(np.abs(dev), k.min_scale), lim)
            sc += np.where(adm & ~first, np.maximum(cfg.scale_alpha, r) * (v - sc), 0.0)
            cnt += adm & (cnt < self._mature_n)

        # -- sustained rise: one-sided CUSUM of z (warm channels; frozen on skipped steps) ------
        cus = stats[CUSUM]
        if not skipped:
            np.copyto(cus, np.where(warm, np.fmax(cus + np.fmin(z, cfg.spike_z) - cfg.drift_k, 0.0), 0.0))
        drifting = bool(np.count_nonzero(cus >= k.drift_exit))

        # -- streaks --------------------------------------------------------------------------
        hot = state.hot
        if (any_elev or hot) and not skipped:  # a skipped step leaves the streaks as they were
            streak, grow, prev = stats[STREAK], stats[GROW], stats[PREV]
            grows = elev & (streak > 0) & (dev >= prev + k.lgrowth)
            grow[:] = np.where(elev, np.where(grows, grow + 1.0, 1.0), 0.0)
            streak[:] = np.where(elev, streak + 1.0, 0.0)
            prev[:] = np.where(elev, dev, 0.0)
            hot = any_elev
            if any_elev:
                stale = streak >= cfg.readapt_steps
                if np.count_nonzero(stale):  # a plateau held this long is the new normal
                    np.copyto(mu, y, where=stale)
                    streak[stale] = 0.0
                    grow[stale] = 0.0
                    prev[stale] = 0.0

        alerts: list[Event] = []
        new: dict[str, Any] = dict(step=step, stats=stats, dev=np.where(pw, dev, _NAN),
                                   loss_scale=new_scale, scale_pending=scale_pending, hot=hot,
                                   score_cap=grad_bad or loss_bad)

        # -- critical: non-finite gradients, scaler overflows --------------------------------
        if overflow:
            nover = state.overflow + 1
            new["overflow"] = nover
            alerts.append(self._overflow_event(obs, state, loss_scale, nover, ln, lnf))
            if nover == cfg.overflow_steps:
                alerts.append(self._nonfinite_event(obs, state, ln, lnf, nover, scaler=True))
            new["nonfinite"] = 0
        else:
            new["overflow"] = 0
            if grad_bad:
                nbad = state.nonfinite + 1
                new["nonfinite"] = nbad
                alerts.append(self._nonfinite_event(obs, state, ln, lnf, nbad, scaler=False))
            else:
                new["nonfinite"] = 0

        # -- critical: loss ------------------------------------------------------------------
        loss_div, loss_div_fired = state.loss_div, state.loss_div_fired
        if loss_bad:
            loss = obs.loss
            alerts.append(Event(
                step=step, kind=Kind.LOSS_NONFINITE, level=Level.CRITICAL, signal="loss",
                message=(f"Loss is {loss} at step {step}; the run is diverging or a batch is "
                         "corrupt: rewind to the last clean checkpoint and skip this batch."),
                values={"value": float(loss),
                        "baseline": math.exp(state.stats[MU, LOSS]) if warm[LOSS] else _NAN,
                        "ratio": math.inf},
                batch=obs.batch))
        elif present[LOSS] and warm[LOSS]:
            dl = float(dev[LOSS])
            if dl >= self._log_div:
                loss_div += 1
                if loss_div >= cfg.loss_diverge_steps and not loss_div_fired:
                    loss_div_fired = True
                    base = math.exp(state.stats[MU, LOSS])
                    alerts.append(Event(
                        step=step, kind=Kind.LOSS_DIVERGED, level=Level.CRITICAL, signal="loss",
                        message=(f"Loss has stayed at {math.exp(dl):.2f}x its baseline ({_fmt(base)} -> "
                                 f"{_fmt(float(x[LOSS]))}) for {loss_div} steps; the run has diverged: "
                                 "rewind to the last clean checkpoint and lower the learning rate."),
                        values={"value": float(x[LOSS]), "baseline": base, "ratio": math.exp(dl),
                                "steps": float(loss_div)},
                        batch=obs.batch))
            else:
                loss_div = 0
                loss_div_fired = False
        new["loss_div"], new["loss_div_fired"] = loss_div, loss_div_fired

        # -- spikes and escalation -----------------------------------------------------------
        grad_elev = any_elev and bool(np.count_nonzero(elev & k.gradlike))
        calm = 0 if (any_elev or drifting) else min(state.calm + 1, 1 << 30)
        warn_armed = state.warn_armed or calm >= cfg.rearm_steps
        episode, ep = state.episode, {}
        if grad_elev:
            # the run-level norm names the spike when it moved; a layer only when it alone did
            sel = elev & k.gradlike & k.fixed
            if not np.count_nonzero(sel):
                sel = elev & k.gradlike
            dev_g = np.where(sel, dev, -np.inf)
            peak = int(np.argmax(dev_g))
            if not episode:
                episode = True
                ep = dict(ep_start=step, ep_peak_step=step, ep_peak_chan=peak,
                          ep_peak_dev=float(dev_g[peak]), ep_warned=False,
                          ep_first_layer=self._first_layer(elev, dev, stats[STREAK]))
            elif dev_g[peak] > state.ep_peak_dev:
                ep = dict(ep_peak_step=step, ep_peak_chan=peak, ep_peak_dev=float(dev_g[peak]))
        if (any_elev or drifting) and warn_armed:
            ev = self._warning(obs, state, stats, elev, dev, x, k)
            if ev is not None:
                alerts.append(ev)
                warn_armed = False
                ep["ep_warned"] = True
        if episode and not grad_elev and not skipped:
            warned = ep.get("ep_warned", state.ep_warned)
            if not warned:
                alerts.append(self._spike_event(obs, state))
            episode = False
            ep.update(ep_start=-1, ep_peak_step=-1, ep_peak_chan=-1, ep_peak_dev=0.0,
                      ep_first_layer=-1, ep_warned=False)
        new.update(ep, episode=episode, calm=calm, warn_armed=warn_armed)

        # -- what the calm path may assume next step -----------------------------------------
        expected = np.empty(n, dtype=bool)  # channels given this step (whatever their value)
        expected[GRAD], expected[LOSS] = bool(pattern & 1), bool(pattern & 2)
        expected[UPDATE], expected[PARAM] = bool(pattern & 4), bool(pattern & 8)
        expected[N_FIXED:] = bool(pattern & 16)
        steady = expected & (cnt >= self._mature_n)
        stats[RATE_M] = np.where(steady, cfg.alpha, 0.0)
        stats[SRATE_M] = np.where(steady, cfg.scale_alpha, 0.0)
        n_expected = int(np.count_nonzero(expected))
        new["pattern"], new["n_absent"] = pattern, n - n_expected
        new["fast"] = (int(np.count_nonzero(steady)) == n_expected and not hot and not episode
                       and not loss_div and not grad_bad and not loss_bad and not overflow
                       and not drifting)

        level = Level.NONE
        for a in alerts:
            if a.level > level:
                level = a.level
        new["level"] = int(level)
        return alerts, state._replace(**new)

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _first_layer(elev: np.ndarray, dev: np.ndarray, streak: np.ndarray) -> int:
        """Channel index of the layer that moved first: longest current streak, then highest."""
        lay = np.flatnonzero(elev[N_FIXED:])
        if lay.size == 0:
            return -1
        order = np.lexsort((-dev[N_FIXED:][lay], -streak[N_FIXED:][lay]))
        return int(lay[order[0]]) + N_FIXED

    def _ordered_layers(self, state: DetectorState, stats: np.ndarray, elev, dev) -> tuple[str, ...]:
        """Layers that moved, first mover first: elevated longest, then most accumulated rise
        (CUSUM), then highest now."""
        lay_dev = dev[N_FIXED:]
        streak, cus = stats[STREAK, N_FIXED:], stats[CUSUM, N_FIXED:]
        moved = np.flatnonzero(elev[N_FIXED:] | (cus > 0))
        if moved.size == 0:
            return ()
        order = np.lexsort((-np.nan_to_num(lay_dev[moved], nan=-np.inf), -cus[moved], -streak[moved]))
        names = state.channels
        out = [names[int(moved[i]) + N_FIXED][len("grad_norm/"):] for i in order]
        return tuple(out[: self.cfg.max_layers_listed])

    def _warning(self, obs, state, stats, elev, dev, x, k: _Consts) -> Event | None:
        """A COLLAPSE_RISK event if a warning rule holds at this step, else None."""
        cfg = self.cfg
        streak, grow, cus = stats[STREAK], stats[GROW], stats[CUSUM]
        fx = k.fixed  # per-layer signals never warn on their own
        esc = fx & elev & (grow >= cfg.escalate_steps) & (dev >= k.lwarn)
        jump = fx & elev & k.gradlike & (dev >= self._log_jump)
        g_cus = max(cus[GRAD], cus[UPDATE])
        if cfg.layer_drift and len(cus) > N_FIXED:
            g_cus = max(g_cus, float(cus[N_FIXED:].max()))
        grad_drift = g_cus >= cfg.drift_h
        together = bool(grad_drift and cus[LOSS] >= cfg.loss_drift_h)
        alone = fx & (cus >= cfg.drift_alone_h)
        nl = len(state.channels) - N_FIXED
        n_hot_layers = 0
        multi = False
        if nl and cfg.layers_at_once:
            n_hot_layers = int(np.count_nonzero(elev[N_FIXED:] & (dev[N_FIXED:] >= k.lwarn[N_FIXED:])))
            multi = n_hot_layers >= cfg.layers_at_once
        if not (esc.any() or jump.any() or together or alone.any() or multi):
            return None

        def pick(mask: np.ndarray) -> int:
            for c in (GRAD, UPDATE, LOSS, PARAM):
                if mask[c]:
                    return c
            return GRAD

        if esc.any():
            rule, chan = "escalating", pick(esc)
        elif jump.any():
            rule, chan = "jump", pick(jump)
        elif together:
            rule, chan = "together", GRAD if cus[GRAD] >= cus[UPDATE] else UPDATE
        elif alone.any():
            rule, chan = "alone", pick(alone)
        else:
            rule, chan = "layers", GRAD
        layers = self._ordered_layers(state, stats, elev, dev)
        signal = state.channels[chan]
        ratio = math.exp(float(dev[chan])) if math.isfinite(dev[chan]) else _NAN
        base = math.exp(float(state.stats[MU, chan]))
        value = float(x[chan])
        where = f", led by {layers[0]}" if layers else ""
        act = "save a checkpoint now and be ready to rewind; consider lowering the learning rate"
        if rule == "escalating":
            prev_ratio = math.exp(float(state.stats[PREV, chan]))
            msg = (f"{signal} is escalating: {prev_ratio:.3g}x -> {ratio:.3g}x its baseline "
                   f"({_fmt(base)} -> {_fmt(value)}), {int(grow[chan])} growing steps in a row{where}; "
                   f"collapse risk, {act}.")
        elif rule == "jump":
            msg = (f"{signal} jumped to {ratio:.3g}x its baseline ({_fmt(base)} -> {_fmt(value)}) "
                   f"in one step{where}; collapse risk, {act}.")
        elif rule == "together":
            lr = math.exp(float(dev[LOSS])) if math.isfinite(dev[LOSS]) else _NAN
            msg = (f"{signal} and the loss have been rising together for several steps (now "
                   f"{ratio:.3g}x and {lr:.3g}x their baselines){where}; collapse risk, {act}.")
        elif rule == "alone":
            msg = (f"{signal} has been rising for several steps, now {ratio:.3g}x its baseline "
                   f"({_fmt(base)} -> {_fmt(value)}){where}; collapse risk, {act}.")
        else:
            msg = (f"{n_hot_layers} layers jumped together{where}; collapse risk, {act}.")
        scale = float(state.stats[SCALE, chan])
        return Event(
            step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message=msg,
            signal=signal, layers=layers,
            values={"value": value, "baseline": base, "ratio": ratio,
                    "z": float(dev[chan]) / scale if math.isfinite(dev[chan]) else _NAN,
                    "cusum": float(cus[chan]), "steps": float(max(streak[chan], grow[chan])),
                    "layers_elevated": float(int(np.count_nonzero(elev[N_FIXED:])))},
            batch=obs.batch)

    def _spike_event(self, obs, state: DetectorState) -> Event:
        chan = state.ep_peak_chan
        signal = state.channels[chan]
        ratio = math.exp(state.ep_peak_dev)
        base = math.exp(float(state.stats[MU, chan]))
        first = state.ep_first_layer
        layers: tuple[str, ...] = ()
        if first >= 0:
            layers = (state.channels[first][len("grad_norm/"):],)
        if chan >= N_FIXED and (not layers or state.channels[chan][len("grad_norm/"):] != layers[0]):
            layers = layers + (state.channels[chan][len("grad_norm/"):],)
        dur = int(obs.step) - state.ep_start
        where = f" (first in {layers[0]})" if layers else ""
        return Event(
            step=int(obs.step), kind=Kind.GRAD_SPIKE, level=Level.INFO, signal=signal, layers=layers,
            message=(f"Isolated {signal} spike at step {state.ep_peak_step}: {ratio:.3g}x its baseline"
                     f"{where}, back to normal after {dur} step{'s' if dur != 1 else ''}; nothing to do "
                     "unless these become frequent."),
            values={"ratio": ratio, "value": ratio * base, "baseline": base,
                    "peak_step": float(state.ep_peak_step), "steps": float(dur)},
            batch=obs.batch)

    def _nonfinite_layers(self, state, ln, lnf) -> tuple[str, ...]:
        names = state.layer_names
        if not names:
            return ()
        bad = None
        if lnf is not None:
            bad = np.asarray(lnf).astype(bool)
        if ln is not None:
            nf = ~np.isfinite(np.asarray(ln, dtype=np.float64))
            bad = nf if bad is None else (bad | nf)
        if bad is None:
            return ()
        return tuple(names[i] for i in np.flatnonzero(bad))  # given (backward) order

    def _nonfinite_event(self, obs, state, ln, lnf, count: int, scaler: bool) -> Event:
        layers = self._nonfinite_layers(state, ln, lnf)
        g = obs.grad_norm
        base = math.exp(state.stats[MU, GRAD]) if state.stats[COUNT, GRAD] > 0 else _NAN
        where = f", first in {layers[0]}" if layers else ""
        if scaler:
            msg = (f"The loss scaler has overflowed {count} steps in a row{where}: gradients are "
                   "non-finite at every scale; rewind to the last clean checkpoint and check the "
                   "data and the learning rate.")
        else:
            run = f" ({count} steps in a row)" if count > 1 else ""
            msg = (f"Non-finite gradient at step {obs.step}{where}{run}; the step must be skipped, "
                   "and if it repeats rewind to the last clean checkpoint.")
        return Event(
            step=int(obs.step), kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL, signal="nonfinite",
            layers=layers, message=msg,
            values={"value": _NAN if g is None else float(g), "baseline": base, "ratio": math.inf,
                    "nonfinite_layers": float(len(layers)), "steps": float(count)},
            batch=obs.batch)

    def _overflow_event(self, obs, state, loss_scale, count, ln, lnf) -> Event:
        layers = self._nonfinite_layers(state, ln, lnf)
        prev = state.loss_scale
        return Event(
            step=int(obs.step), kind=Kind.SCALER_OVERFLOW, level=Level.INFO, signal="nonfinite",
            layers=layers,
            message=(f"Loss-scaler overflow at step {obs.step} (scale {_fmt(prev)} -> {_fmt(float(loss_scale))})"
                     f"; the scaler skipped the step, nothing to do unless it repeats."),
            values={"value": float(loss_scale), "baseline": float(prev),
                    "ratio": float(loss_scale) / prev if prev and math.isfinite(prev) else _NAN,
                    "steps": float(count)},
            batch=obs.batch)


class StreamingDetector:
    """Stateful convenience wrapper: ``alerts = sd.observe(obs)``.

    The live hook and the offline replay both use this class, so both see the same alerts.
    With no ``layer_names``, the first observation that carries layer norms names them
    ``layer0, layer1, ...``.
    """

    def __init__(self, cfg: DetectorConfig | None = None, layer_names: Sequence[str] = (),
                 baseline: Mapping[str, float] | None = None):
        self.detector = Detector(cfg)
        self.cfg = self.detector.cfg
        self._baseline = dict(baseline) if baseline else None
        self._lazy = not layer_names
        self.state = self.detector.init(layer_names, self._baseline)

    def observe(self, obs: Observation) -> list[Event]:
        if self._lazy and obs.layer_norms is not None:
            if self.state.step >= 0:
                raise ValueError("layer norms appeared mid-run; pass layer_names to StreamingDetector")
            names = [f"layer{i}" for i in range(len(obs.layer_norms))]
            self.state = self.detector.init(names, self._baseline)
            self._lazy = False
        alerts, self.state = self.detector.update(self.state, obs)
        if self._lazy and self.state.step >= 0:
            self._lazy = False  # a run without layer norms stays without them
        return alerts

    @property
    def score(self) -> float:
        """Latest instability score: the largest robust z of any signal above its baseline
        (0 when nothing is above it; ~0-3 in calm training; >= spike_z on a spike; 1000 for a
        non-finite step). Monotone in how alarming the step is."""
        return self.state.score

    @property
    def level(self) -> Level:
        """Worst level raised at the latest step."""
        return Level(self.state.level)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.state.layer_names

    def baselines(self) -> dict[str, float]:
        """Current typical value per signal (only signals that have data)."""
        st = self.state.stats
        return {c: math.exp(st[MU, i]) for i, c in enumerate(self.state.channels) if st[COUNT, i] > 0}

    def state_dict(self) -> dict[str, Any]:
        d = self.state.to_dict()
        d["config"] = self.cfg.to_dict()
        d["lazy"] = self._lazy
        return d

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        state = DetectorState.from_dict(d)
        if "config" in d and DetectorConfig.from_dict(d["config"]) != self.cfg:
            # a checkpoint from a differently configured detector: keep the state, say so
            import warnings

            warnings.warn("loading detector state saved under a different DetectorConfig", stacklevel=2)
        self.state = state
        self._lazy = bool(d.get("lazy", False))
