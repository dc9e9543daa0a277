"""The streaming detector: a pure ``init`` / ``update`` pair (optax style) and a stateful wrapper.

Every signal is a *channel*: ``grad_norm``, ``loss``, ``update_norm``, ``param_norm``, one
``grad_norm/<layer>`` per layer, then one ``user/<name>`` per signal of the user's own
(``Watcher.report``; added at the first observation that carries ``extras["user/<name>"]``, a
run-level channel like the grad norm). Each channel keeps, in log space (magnitudes differ by 1e6
between runs; ratios do not), a robust trailing baseline (EMA of admitted log-values,
winsorised) and a robust scale (EMA of absolute deviations, floored). The run-level channels
also keep a one-sided CUSUM of their z-scores, and the gradient and the loss together feed one
more CUSUM, the *together* evidence.

Cost: a step is O(channels) with no allocation. All channels live in preallocated vectors and a
calm step of a mature run is ~10 numpy calls on them (log, deviation, one outlier test, the
EMA updates as two stacked multiply-adds) plus scalar Python for the run-level channels.
Anything unusual (warm-up, a spike, a skipped or non-finite step, a changed set of signals, a
rule about to fire) takes the general path, which applies the same arithmetic with masks.

What is alarming is *escalation*, not one spike:

- ``info`` GRAD_SPIKE: a gradient signal was elevated and came back without escalating
  (reported on the step it recovered; ``values["peak_step"]`` says when it peaked).
- ``warning`` COLLAPSE_RISK: (a) consecutive elevated steps that keep growing (BLOOM-176B's
  0.24 -> 0.95 -> 2.4 -> 16); (b) the gradient and the loss rising together over several steps
  (the together evidence reaches ``drift_h``, or ``lr_rise_factor * drift_h`` on a step whose
  LR is at a new high: a run crosses its stability edge while its LR climbs); (c) one run-level
  signal rising for long (``drift_alone_h``; a user signal: ``user_alone_h``), or a user signal
  that is NaN / inf; optionally (d) several layers at once or (e) one enormous jump.
  Per-layer signals never warn on their own (small layers are spiky); they name the layers that
  moved. A warning consumes its evidence; another may follow ``rearm_steps`` later if the rise
  goes on.
- ``warning`` COLLAPSE_RISK on the learning rate (``extras["lr"]``): a step's LR at least
  ``lr_jump_ratio`` times the highest LR of the steps ``lr_ref_steps`` back (a pulse or a steep
  re-warm-up; seen before the update it scales). A log with the loss and no gradient: the loss
  rising for several steps on its own (``loss_only_h``).
- ``critical``: NONFINITE_GRAD (before the optimizer step), LOSS_NONFINITE, LOSS_DIVERGED (the
  loss at least ``loss_diverge_ratio`` times its baseline *and* ``loss_diverge_z`` of its own
  scales above it for ``loss_diverge_steps`` steps in a row: a noisy small-batch loss is judged
  in its own noise, and a two-step excursion is never a divergence), or a loss scaler that keeps
  overflowing. A loss <= 0 moves the loss channel to ``log(loss + c)`` (see ``general.shift_loss``).

Spikes, skipped steps, overflow steps and non-finite values never enter a baseline.

Where things are: the state and its field table (:mod:`~earlywarn.detect.state`), the working
state (:mod:`~earlywarn.detect.work`), the rules and thresholds (:mod:`~earlywarn.detect.rules`),
the calm path (:mod:`~earlywarn.detect.calm`), the general path (:mod:`~earlywarn.detect.general`,
its records :mod:`~earlywarn.detect.findings`), logged columns (:mod:`~earlywarn.detect.columns`),
the alerts' wording (:mod:`~earlywarn.detect.messages`), what the state promises about steps not
yet seen (:mod:`~earlywarn.detect.bands`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from earlywarn.detect.bands import Bands, bands_of
from earlywarn.detect.calm import calm_frozen_layers, calm_rows, calm_update_values
from earlywarn.detect.columns import replay_columns
from earlywarn.detect.config import DetectorConfig
from earlywarn.detect.general import general_step
from earlywarn.detect.messages import fmt as _fmt, times as _times  # noqa: F401 - the old import path
from earlywarn.detect.observation import Observation, StepColumns
from earlywarn.detect.rules import Thresholds
from earlywarn.detect.state import (  # noqa: F401 - names importable from here before the split
    COUNT, CUSUM, FIXED_NAMES, GRAD, GROW, LAYER, LAYERS_BIT, LOSS, LR_BIT, MU, N_FIXED, N_ROWS, PARAM, PREV,
    SCALE, SCORE_CAP, STATE_VERSION, STREAK, UPDATE, USER, USER_BIT, WIDTH, DetectorState, loss_shift_for,
    tracked_user, user_channel, with_user_signals)
from earlywarn.detect.work import Work, cnz
from earlywarn.events import Event, Level

_log, _np_log = math.log, np.log
_F64DT = np.dtype(np.float64)
_LEVELS = tuple(Level(i) for i in range(max(Level) + 1))


class Detector:
    """Pure detector: ``state = init(layer_names)``, ``alerts, state = update(state, obs)``.

    ``update`` never mutates its input state, so a state can be kept, compared, checkpointed and
    replayed; the same object serves the live hook and the offline analyser (through
    :class:`StreamingDetector`, which updates one working state in place with :meth:`working`,
    :meth:`step`, :meth:`step_columns` and :meth:`snapshot`). Deterministic: the same
    observations give the same alerts.
    """

    def __init__(self, cfg: DetectorConfig | None = None):
        self.cfg = cfg if cfg is not None else DetectorConfig()
        if not isinstance(self.cfg, DetectorConfig):
            raise TypeError(f"Detector(cfg=...) wants a DetectorConfig, got {type(cfg).__name__}")
        self.thresholds = Thresholds.of(self.cfg)
        self._force_full = False  # tests: run every step through the general path

    def init(self, layer_names: Sequence[str] = (),
             baseline: Mapping[str, float] | None = None, user_names: Sequence[str] = ()) -> DetectorState:
        """A fresh state for a model whose per-layer norms come in ``layer_names`` order.

        ``baseline`` gives prior typical values (keys ``"grad_norm"``, ``"loss"``,
        ``"update_norm"``, ``"param_norm"``, ``"grad_norm/<layer>"``, ``"user/<name>"``): those
        channels start warm, which lets a short snippet with no history of its own be judged (the
        BLOOM case). ``user_names`` (``"user/<name>"``) are user signals known from the start;
        others join when an observation first carries them (``extras["user/<name>"]``).
        """
        layer_names = tuple(str(n) for n in layer_names)
        if len(set(layer_names)) != len(layer_names):
            raise ValueError("layer_names must be unique")
        users = [user_channel(u) for u in user_names]
        users += [k for k in (baseline or {}) if isinstance(k, str) and tracked_user(k) and k not in users]
        if len(set(users)) != len(users):
            raise ValueError("user_names must be unique")
        channels = FIXED_NAMES + tuple(LAYER + n for n in layer_names) + tuple(users)
        t = self.thresholds
        stats = np.zeros((N_ROWS, len(channels)))
        stats[SCALE] = t.scale0
        stats[WIDTH] = t.scale0 * t.admit_z
        shift = 0.0
        for key, value in (baseline or {}).items():
            if key not in channels:
                raise ValueError(f"baseline key {key!r} is not a signal of this detector; use one "
                                 f"of {list(FIXED_NAMES)}, 'grad_norm/<layer>' or 'user/<name>'")
            try:
                v = float(value)
            except (TypeError, ValueError):
                v = math.nan
            if key == "loss" and math.isfinite(v) and v <= 0:
                shift = loss_shift_for(v, 0.0)  # a loss that is negative by nature (an NLL)
            elif not (math.isfinite(v) and v > 0):
                raise ValueError(f"baseline[{key!r}]={value!r}: use a finite number > 0 "
                                 "(a loss may be any finite number)")
            i = channels.index(key)
            stats[MU, i] = math.log(v + shift) if key == "loss" else math.log(v)
            stats[COUNT, i] = float(self.cfg.warmup_steps)
        return DetectorState(step=-1, channels=channels, stats=stats, loss_shift=shift)

    def update(self, state: DetectorState, obs: Observation) -> tuple[list[Event], DetectorState]:
        """Feed one step; returns the alerts it raised and the next state (``state`` is left as
        it was)."""
        w = self.working(state)
        new = w.new_users(obs.extras)
        if new:
            w = self.working(self.with_users(state, new))
        alerts = self.step(w, obs)
        return alerts, self.snapshot(w)

    # -- in place: one working state, updated step by step ----------------------------------------
    def working(self, state: DetectorState) -> Work:
        """A working copy of ``state`` for :meth:`step` to update in place."""
        return Work.load(state, self.thresholds)

    def snapshot(self, w: Work) -> DetectorState:
        """The state ``w`` holds now (a copy)."""
        return w.snapshot(self.thresholds)

    def with_users(self, state: DetectorState, names: Sequence[str]) -> DetectorState:
        """``state`` with cold channels for the user signals ``names`` appended."""
        return with_user_signals(state, names, self.thresholds.scale0, self.thresholds.admit_z)

    def step(self, w: Work, obs: Observation) -> list[Event]:
        """One step, in place. A calm step of a mature run (the same signals as last step, every
        value finite, no channel elevated, no rule about to fire) takes the calm path; anything
        else the general path, which starts from the untouched state and computes the same
        numbers for the calm channels."""
        g, loss, ex, ln = obs.grad_norm, obs.loss, obs.extras, obs.layer_norms
        pattern = 0 if g is None else 1
        if loss is not None:
            pattern |= 2
        u = p = loss_scale = lr = users = None
        if ex:
            u, p, loss_scale, lr = ex.get("update_norm"), ex.get("param_norm"), ex.get("loss_scale"), ex.get("lr")
            if u is not None:
                pattern |= 4
            if p is not None:
                pattern |= 8
            if lr is not None:
                pattern |= LR_BIT
            if w.n_users and len(ex) > (u is not None) + (p is not None) + (loss_scale is not None) + (lr is not None):
                users = []  # (channel, value) of the user signals given
                le = w.layers_end
                for i, name in enumerate(w.channels[le:]):
                    v = ex.get(name)
                    if v is not None:
                        pattern |= USER_BIT << i
                        users.append((le + i, v))
        nl = w.n_layers
        if ln is not None and nl:
            if len(ln) != nl:
                raise ValueError(f"step {obs.step}: {len(ln)} layer norms for a detector initialised "
                                 f"with {nl} layer names; pass the same layers in the same order")
            pattern |= LAYERS_BIT
        lnf = obs.layer_nonfinite
        if not (w.fast and pattern == w.pattern and not obs.skipped and not self._force_full
                and (loss_scale is None or not loss_scale < w.loss_scale) and (lnf is None or not cnz(lnf))):
            return self._general(w, obs, pattern)
        # the calm path: this step's log-values into w.logv (absent channels stay parked on their
        # baselines). A run-level value must be finite and > 0 (NaN fails `>`; inf fails the
        # outlier test), the layers too, except those reporting 0 that were absent already.
        y = w.logv
        if g is not None:
            if not g > 0.0:
                return self._general(w, obs, pattern)
            y[0] = _log(g)
        if loss is not None:
            lv = loss + w.loss_shift  # + 0.0 unless the loss has gone <= 0 (see general.shift_loss)
            if not lv > 0.0:
                return self._general(w, obs, pattern)
            y[1] = _log(lv)
        if pattern & 12 and not calm_update_values(w, u, p):
            return self._general(w, obs, pattern)
        if users:
            for c, v in users:
                if not v > 0.0:
                    return self._general(w, obs, pattern)
                y[c] = _log(v)
        if pattern & LAYERS_BIT:
            nz = cnz(ln)
            if nz == nl and w.n_present == nl:
                if type(ln) is np.ndarray and ln.dtype is _F64DT:
                    _np_log(ln, w.logv_layers)
                else:  # computed in float64, as the general path does
                    _np_log(ln, out=w.logv_layers, dtype=np.float64)
            elif not calm_frozen_layers(self.thresholds, w, ln, nz, obs.step):
                return self._general(w, obs, pattern)
        lrs = None
        if lr is not None:
            lr = float(lr)
            if not 0.0 <= lr < math.inf:
                return self._general(w, obs, pattern)
            lrs = (lr,)
        if not calm_rows(self.thresholds, w, w.logv_row, 0, 1, pattern, (obs.step,), lrs):
            return self._general(w, obs, pattern)
        if loss_scale is not None:
            w.loss_scale = float(loss_scale)
        return []

    _step = step  # the per-row step of step_columns (tests wrap it to count the rows it takes)

    def _general(self, w: Work, obs: Observation, pattern: int) -> list[Event]:
        """The general path (a method: tests wrap it to count the steps that take it)."""
        return general_step(self.thresholds, w, obs, pattern)

    def step_columns(self, w: Work, cols: StepColumns, start: int, stop: int) -> list[tuple[int, Event]]:
        """Rows ``[start, stop)`` of ``cols``, in place, exactly as one :meth:`step` per row (same
        state, same alerts), as ``(row, alert)`` pairs; calm rows skip the Observation."""
        return replay_columns(self.thresholds, w, cols, start, stop, self._step, calm=not self._force_full)


class StreamingDetector:
    """Stateful convenience wrapper: ``alerts = sd.observe(obs)``.

    The live hook and the offline replay both use this class, so both see the same alerts. It
    updates one working state in place (no per-step allocation); ``state`` returns a snapshot.
    With no ``layer_names``, the first observation that carries layer norms names them
    ``layer0, layer1, ...``. A user signal (``extras["user/<name>"]``) gets its channel at the
    first observation that carries it.
    """

    def __init__(self, cfg: DetectorConfig | None = None, layer_names: Sequence[str] = (),
                 baseline: Mapping[str, float] | None = None):
        self.detector = Detector(cfg)
        self.cfg = self.detector.cfg
        self._baseline = dict(baseline) if baseline else None
        self._lazy = not layer_names
        self._w = self.detector.working(self.detector.init(layer_names, self._baseline))
        self._step = self.detector.step
        self._A = self.detector.thresholds.admit_z

    def observe(self, obs: Observation) -> list[Event]:
        if self._lazy:
            if obs.layer_norms is not None:
                if self._w.step >= 0:
                    raise ValueError("layer norms appeared mid-run; pass layer_names to StreamingDetector")
                names = [f"layer{i}" for i in range(len(obs.layer_norms))]
                self._w = self.detector.working(self.detector.init(names, self._baseline))
                self._lazy = False
            if obs.extras:
                self._add_users(self._w.new_users(obs.extras))
            alerts = self._step(self._w, obs)
            if self._w.step >= 0:
                self._lazy = False  # a run without layer norms stays without them
            return alerts
        ex = obs.extras
        if ex and not self._w.known_extras.issuperset(ex):  # (a cheap test first: a calm step is ~6 us)
            us = self._w.user_set
            for key in ex:
                if tracked_user(key) and key not in us:
                    self._add_users(self._w.new_users(ex))
                    break
        return self._step(self._w, obs)

    def _add_users(self, names: Sequence[str]) -> None:
        if names:
            d = self.detector
            self._w = d.working(d.with_users(d.snapshot(self._w), names))

    def observe_columns(self, cols: StepColumns, start: int = 0, stop: int | None = None) -> list[tuple[int, Event]]:
        """Rows ``[start, stop)`` of a logged run, in order: exactly what calling
        ``observe(cols.observation(i))`` for each row gives (the same alerts, the same state
        after), as ``(row, alert)`` pairs. Faster for long runs: calm rows skip the Observation
        and their logarithms are taken a chunk of rows at a time."""
        stop = len(cols) if stop is None else min(int(stop), len(cols))
        start = max(0, int(start))
        out: list[tuple[int, Event]] = []
        while self._lazy and start < stop:  # the first rows decide the layer names
            out.extend((start, e) for e in self.observe(cols.observation(start)))
            start += 1
        while start < stop:
            # a user signal gets its channel at its first known row, as observe() gives it one
            first: dict[int, list[str]] = {}
            for key, (_, known) in cols.extras.items():
                if tracked_user(key) and key not in self._w.user_set:
                    kn = np.ones(stop - start, dtype=bool) if known is None else np.asarray(known[start:stop], dtype=bool)
                    if kn.any():
                        first.setdefault(start + int(np.argmax(kn)), []).append(key)
            r = min(first) if first else stop
            out.extend(self.detector.step_columns(self._w, cols, start, r))
            if r < stop:
                self._add_users(first[r])
            start = r
        return out

    def observe_calm(self, cols: StepColumns, scores: list[float]) -> list[tuple[int, Event]]:
        """Rows of steps a guard kept inside their bands (:mod:`earlywarn.detect.bands`), in
        order: exactly what ``observe(cols.observation(i))`` of each row gives (the same state,
        no alerts), with the detector's ``score`` after each row appended to ``scores``. The rows
        go through the calm path as one block when each passes the calm step's own tests (the
        same signals, values finite and > 0, every layer present as before, no scale drop);
        otherwise, from the first that does not, one by one. Alerts as ``(row, alert)`` pairs."""
        k = len(cols)
        Y = None if self._lazy else _calm_block(self._w, cols)
        r = 0
        if Y is not None:
            lr = cols.extras.get("lr")
            r = calm_rows(self.detector.thresholds, self._w, Y, 0, k, self._w.pattern, cols.step.tolist(),
                          None if lr is None else lr[0].tolist(), scores)
            scale = cols.extras.get("loss_scale")
            if r and scale is not None:
                self._w.loss_scale = float(scale[0][r - 1])
        out: list[tuple[int, Event]] = []
        for i in range(r, k):
            out.extend((i, e) for e in self.observe(cols.observation(i)))
            scores.append(self.score)
        return out

    def bands(self, window: int) -> Bands | None:
        """What the state promises about the next ``window`` steps before they are observed
        (:mod:`earlywarn.detect.bands`); None where no step may be deferred now."""
        return bands_of(self.detector.thresholds, self._w, window)

    @property
    def state(self) -> DetectorState:
        """A snapshot of the detector's state (a copy: changing it changes nothing)."""
        return self.detector.snapshot(self._w)

    @state.setter
    def state(self, value: DetectorState) -> None:
        self._w = self.detector.working(value)

    @property
    def score(self) -> float:
        """Latest instability score: the largest robust z of any signal above its baseline
        (0 when nothing is above it; ~0-3 in calm training; >= spike_z on a spike; 1000 for a
        non-finite step). Monotone in how alarming the step is."""
        return self._largest_z(layers=True)

    @property
    def run_score(self) -> float:
        """:attr:`score` over the run's own signals -- gradient norm, loss, update and parameter
        norms, the loop's reported ones -- not its layers': among hundreds of layers one is above
        ``spike_z`` by chance at many a calm step, and that is no episode building."""
        return self._largest_z(layers=False)

    def _largest_z(self, *, layers: bool) -> float:
        return self._w.largest_z(self._A, layers=layers)

    def ratios(self) -> tuple[float, float]:
        """The latest step's global gradient norm and loss over their typical values (NaN where a
        signal was absent or has no baseline yet): what the guard's response reads besides the
        alerts. Two exponentials, no allocation."""
        w = self._w
        if not w.has_dev:
            return math.nan, math.nan
        g, loss = float(w.dev[GRAD]), float(w.dev[LOSS])
        return (math.exp(g) if g == g else math.nan), (math.exp(loss) if loss == loss else math.nan)

    @property
    def level(self) -> Level:
        """Worst level raised at the latest step."""
        return _LEVELS[self._w.level]

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(c[len(LAYER):] for c in self._w.channels[N_FIXED:self._w.layers_end])

    @property
    def user_names(self) -> tuple[str, ...]:
        """The user signals seen so far, as ``"user/<name>"``."""
        return self._w.channels[self._w.layers_end:]

    def baselines(self) -> dict[str, float]:
        """Current typical value per signal (only signals that have data)."""
        w = self._w
        return {c: math.exp(w.baseline[i]) - (w.loss_shift if i == LOSS else 0.0)
                for i, c in enumerate(w.channels) if w.count[i] > 0}

    def state_dict(self) -> dict[str, Any]:
        d = self.state.to_dict()
        d["config"] = self.cfg.to_dict()
        d["lazy"] = self._lazy
        return d

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if int(d.get("version", STATE_VERSION)) != STATE_VERSION:
            # a checkpoint from an older earlywarn: resuming the run matters more than the
            # detector's memory, which re-learns its baselines within warmup_steps
            warnings.warn(f"detector state version {d.get('version')} (an older earlywarn) cannot be "
                          f"loaded into version {STATE_VERSION}; the detector starts afresh", stacklevel=2)
            self._w = self.detector.working(self.detector.init(self.layer_names, self._baseline))
            return
        state = DetectorState.from_dict(d)
        if "config" in d and DetectorConfig.from_dict(d["config"]) != self.cfg:
            # a checkpoint from a differently configured detector: keep the state, say so
            warnings.warn("loading detector state saved under a different DetectorConfig", stacklevel=2)
        self._w = self.detector.working(state)
        self._lazy = bool(d.get("lazy", False))


def _calm_block(w: Work, cols: StepColumns) -> np.ndarray | None:
    """The rows' log-values, one row per step (absent channels parked on their baselines), if
    every row passes what :meth:`Detector.step` asks of a calm step before its calm path: the
    signals of the latest step (every value known: no ``*_known`` mask), finite and > 0 (the
    loss with its offset; an LR >= 0), every layer present as at the latest step (none
    reporting 0), nothing skipped or non-finite, no loss scale below the one before. Else None."""
    pattern = w.pattern
    if not w.fast or pattern < 0 or cols.skipped is not None or cols.layer_nonfinite is not None:
        return None
    ex = cols.extras
    given = 0
    for bit, col, known in ((1, cols.grad_norm, cols.grad_known), (2, cols.loss, cols.loss_known),
                            (LAYERS_BIT, cols.layer_norms, cols.layers_known)):
        if col is not None:
            if known is not None:
                return None
            given |= bit
    le = w.layers_end
    for name, (_, known) in ex.items():
        if known is not None:
            return None
        if name == "lr":
            given |= LR_BIT
        elif name.startswith(USER):
            if name not in w.user_set:
                return None
            given |= USER_BIT << (w.channels.index(name) - le)
        elif name != "loss_scale":
            return None  # an update or parameter norm: not the guard's
    if given != pattern or (pattern & LAYERS_BIT and w.n_present != w.n_layers):
        return None
    k = len(cols)
    Y = np.empty((k, w.n))
    Y[:] = w.logv  # absent channels parked on their baselines
    run = []
    if pattern & 1:
        run.append((GRAD, cols.grad_norm.tolist(), 0.0))
    if pattern & 2:
        run.append((LOSS, cols.loss.tolist(), w.loss_shift))
    for name, (vals, _) in ex.items():
        if name.startswith(USER):
            run.append((w.channels.index(name), vals.tolist(), 0.0))
    for c, vals, shift in run:
        col = Y[:, c]
        for i, v in enumerate(vals):
            v = v + shift  # (+ 0.0 unless the loss has gone <= 0, as the calm path takes it)
            if not 0.0 < v < math.inf:
                return None
            col[i] = _log(v)
    if pattern & LAYERS_BIT:
        ln = np.asarray(cols.layer_norms, dtype=np.float64)
        if cnz(ln > 0.0) != ln.size or not np.isfinite(ln).all():
            return None
        np.log(ln, out=Y[:, N_FIXED:le])
    if pattern & LR_BIT:
        lr = ex["lr"][0]
        if not ((lr >= 0.0) & (lr < math.inf)).all():
            return None
    scale = ex.get("loss_scale")
    if scale is not None:  # a drop is an overflow's (NaN compares as no drop, as the step takes it)
        s = np.asarray(scale[0], dtype=np.float64)
        if cnz(s < np.concatenate([[w.loss_scale], s[:-1]])):
            return None
    return Y

