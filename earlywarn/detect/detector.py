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
  overflowing. A loss <= 0 moves the loss channel to ``log(loss + c)`` (see ``_shift_loss``).

Spikes, skipped steps, overflow steps and non-finite values never enter a baseline.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from earlywarn.detect.config import DetectorConfig
from earlywarn.detect.observation import Observation, StepColumns
from earlywarn.events import Event, Kind, Level

# fixed channels, then one per layer
GRAD, LOSS, UPDATE, PARAM = 0, 1, 2, 3
N_FIXED = 4
FIXED_NAMES = ("grad_norm", "loss", "update_norm", "param_norm")
# rows of DetectorState.stats
MU, SCALE, COUNT, STREAK, GROW, PREV, CUSUM, WIDTH = range(8)
N_ROWS = 8
SCORE_CAP = 1000.0  # score of a non-finite step (metrics backends dislike inf)
_NAN = float("nan")
_TINY = 1e-300
_BIG = 1 << 30
STATE_VERSION = 3
_F64 = np.float64
_F64DT = np.dtype(np.float64)
try:  # the C function itself: np.count_nonzero adds a Python wrapper and a dispatcher per call
    from numpy._core._multiarray_umath import count_nonzero as _cnz
except ImportError:  # pragma: no cover - older numpy layouts
    _cnz = np.count_nonzero
_log = math.log
_np_log, _subtract, _absolute, _less, _divide = np.log, np.subtract, np.absolute, np.less, np.divide
_copysign, _greater, _not_equal = np.copysign, np.greater, np.not_equal
_fmax, _fmin, _multiply, _add = np.fmax, np.fmin, np.multiply, np.add
_LEVELS = tuple(Level(i) for i in range(max(Level) + 1))
_PAT_KEYS = ((1, GRAD), (2, LOSS), (4, UPDATE), (8, PARAM))
USER = "user/"  # a user's own run-level signal (``Watcher.report``; a log column ``earlywarn/user/<name>``)
_USER_BIT = 64  # pattern bit of the first user signal (the next ones: 128, 256, ...)
_CHUNK_ROWS = 2048  # rows whose log-values StreamingDetector.observe_columns takes at once


class DetectorState(NamedTuple):
    """Everything the detector remembers (a snapshot: ``update`` returns a new one).

    ``stats`` is an ``(8, channels)`` float array with rows ``MU`` (baseline, log), ``SCALE``
    (robust scale, log units, floored), ``COUNT`` (values admitted; counting stops at maturity),
    ``STREAK`` (consecutive elevated steps), ``GROW`` (consecutive elevated steps, each above the
    last by the growth factor), ``PREV`` (last elevated log-deviation), ``CUSUM`` (one-sided
    cumulative sum of ``z - drift_k``, run-level channels only; 0 for layers) and ``WIDTH``
    (``admit_z * scale``, the form the detector keeps the scale in; ``SCALE`` is derived from it). ``dev`` is the
    latest log-deviation per channel (NaN or 0 where the channel was absent). ``joint`` is the
    together evidence of the gradient and the loss.
    """

    step: int
    channels: tuple[str, ...]
    stats: np.ndarray
    dev: np.ndarray | None = None
    joint: float = 0.0
    pattern: int = -1  # which of grad/loss/update/param/layers were given (bits 0-4)
    fast: bool = False  # the next step may take the calm path
    episode: bool = False  # some gradient signal is (or just was) elevated
    ep_start: int = -1
    ep_peak_step: int = -1
    ep_peak_chan: int = -1
    ep_peak_dev: float = 0.0
    ep_first_layer: int = -1
    ep_warned: bool = False
    since_warn: int = _BIG  # steps since the last warning
    loss_div: int = 0  # consecutive steps at or above the divergence threshold
    loss_div_fired: bool = False
    loss_shift: float = 0.0  # the loss channel tracks log(loss + loss_shift); > 0 once a loss <= 0 was seen
    lr_ring: tuple[float, ...] = ()  # the last lr_ref_steps learning rates (a ring)
    lr_pos: int = 0
    lr_n: int = 0  # learning rates seen
    lr_ref: float = 0.0  # the highest LR of the steps at least lr_ref_steps back
    nonfinite: int = 0  # consecutive non-finite-gradient steps
    overflow: int = 0  # consecutive loss-scaler overflows
    loss_scale: float = _NAN
    scale_pending: bool = False  # an overflow was seen before the scale reading dropped
    score_cap: bool = False  # latest step was non-finite
    level: int = 0
    hot: bool = False  # some STREAK/GROW/PREV entry is non-zero
    absent: tuple[int, ...] = ()  # layers (by position) reporting 0 under the pattern

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(c[len("grad_norm/"):] for c in self.channels[N_FIXED:] if not c.startswith(USER))

    @property
    def user_names(self) -> tuple[str, ...]:
        """The user signals, as ``"user/<name>"`` (the channels after the layers)."""
        return tuple(c for c in self.channels[N_FIXED:] if c.startswith(USER))

    @property
    def score(self) -> float:
        """Largest robust z above baseline at the latest step (see StreamingDetector.score)."""
        return _score(self.score_cap, self.dev, self.stats[SCALE])

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
            raise ValueError(f"detector state version {d.get('version')} is not {STATE_VERSION} "
                             "(saved by an older earlywarn; start the detector afresh)")
        kw = {k: d[k] for k in cls._fields if k in d}
        kw["channels"] = tuple(str(c) for c in d["channels"])
        stats = np.array(d["stats"], dtype=np.float64)
        if stats.shape != (N_ROWS, len(kw["channels"])):
            raise ValueError(f"detector state: stats shape {stats.shape} does not match "
                             f"{len(kw['channels'])} channels")
        kw["stats"] = stats
        if "absent" in kw:
            kw["absent"] = tuple(int(i) for i in kw["absent"])
        if kw.get("dev") is not None:
            kw["dev"] = np.array(kw["dev"], dtype=np.float64)
        if "lr_ring" in kw:
            kw["lr_ring"] = tuple(float(v) for v in kw["lr_ring"])
        for k in ("step", "pattern", "ep_start", "ep_peak_step", "ep_peak_chan", "ep_first_layer",
                  "since_warn", "loss_div", "nonfinite", "overflow", "level", "lr_pos", "lr_n"):
            if k in kw:
                kw[k] = int(kw[k])
        for k in ("joint", "ep_peak_dev", "loss_scale", "loss_shift", "lr_ref"):
            if k in kw:
                kw[k] = float(kw[k])
        for k in ("fast", "episode", "ep_warned", "loss_div_fired", "hot", "score_cap", "scale_pending"):
            if k in kw:
                kw[k] = bool(kw[k])
        return cls(**kw)


def user_channel(name: str) -> str:
    """The channel (and ``Observation.extras`` key) of a user signal: ``"user/<name>"``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a user signal needs a non-empty name, got {name!r}")
    name = name.strip()
    return name if name.startswith(USER) and len(name) > len(USER) else USER + name


def with_user_signals(state: "DetectorState", names: Sequence[str], scale0: float, admit_z: float) -> "DetectorState":
    """``state`` with user-signal channels ``names`` (``"user/<name>"``) appended, cold (no history;
    nothing else changes: the layers keep their positions)."""
    names = tuple(n for n in names if n not in state.channels)
    if not names:
        return state
    k = len(names)
    stats = np.zeros((N_ROWS, len(state.channels) + k))
    stats[:, :len(state.channels)] = state.stats
    stats[SCALE, -k:] = scale0
    stats[WIDTH, -k:] = scale0 * admit_z
    dev = None if state.dev is None else np.concatenate([state.dev, np.full(k, _NAN)])
    return state._replace(channels=state.channels + names, stats=stats, dev=dev)


def _loss_shift_for(loss: float, shift: float) -> float:
    """The offset that makes ``loss + offset`` comfortably positive: a power of two at least
    ``1 + 2 |loss|`` and at least twice the old one (so it changes rarely, and never back)."""
    need = 1.0 + 2.0 * abs(loss)
    return max(2.0 * shift, 2.0 ** math.ceil(math.log2(need)))


def _score(cap: bool, dev: np.ndarray | None, scale: np.ndarray) -> float:
    if cap:
        return SCORE_CAP
    if dev is None or dev.size == 0:
        return 0.0
    m = float(np.fmax.reduce(dev / scale))  # NaN (absent) ignored
    return m if m > 0.0 else 0.0


class _Work:
    """The mutable working state: preallocated vectors the step updates in place.

    ``S2`` stacks the baseline and the admission width ``wd = admit_z * scale`` (its rows ``mu``,
    ``wd``) so that both EMAs are one multiply-add: ``S2 = S2 * M2 + D2 * R2`` with
    ``D2 = [dev; max(|dev|, min_scale)]``, ``R2 = [alpha; admit_z * scale_alpha]`` and
    ``M2 = [1; 1 - scale_alpha]`` for the channels the calm path updates (0 / 1 elsewhere).
    Keeping ``wd`` rather than the scale makes the outlier test ``|dev| < wd`` one call, with no
    per-step rescaling."""

    __slots__ = ("channels", "n", "nl", "le", "nu", "uset", "ufix", "S2", "mu", "wd", "cnt", "streak", "grow", "prev", "cus",
                 "joint", "y", "y2", "yl", "W", "D2", "dev", "adev", "P2", "P0", "P1", "R2", "M2", "bb", "fixed",
                 "k", "lmask", "lcmp", "n_lay", "ztmp", "dev_nan", "has_dev", "step", "pattern",
                 "fast", "episode", "ep_start", "ep_peak_step", "ep_peak_chan", "ep_peak_dev", "ep_first_layer", "ep_warned", "since_warn",
                 "loss_div", "loss_div_fired", "nonfinite", "overflow", "loss_scale", "scale_pending",
                 "score_cap", "level", "hot", "loss_shift", "lr_ring", "lr_pos", "lr_n", "lr_ref")

    def __init__(self, channels: tuple[str, ...]):
        n = len(channels)
        # channels: the four fixed ones, the layers, then the user signals (run-level, like the
        # fixed ones: CUSUMs, escalation, spikes); le is where the layers end
        nu = sum(1 for c in channels[N_FIXED:] if c.startswith(USER))
        self.channels, self.n, self.nu = channels, n, nu
        self.nl = n - N_FIXED - nu
        self.le = N_FIXED + self.nl
        self.uset = frozenset(channels[self.le:])
        # [mu; wd; dev; |dev|] in one block, so that the run-level widths and deviations are one
        # (2, 4) view, read with one tolist()
        self.W = np.zeros((4, n))
        self.S2, self.D2 = self.W[0:2], self.W[2:4]
        self.mu, self.wd = self.S2[0], self.S2[1]
        self.dev, self.adev = self.D2[0], self.D2[1]
        self.fixed = self.W[1:3, :N_FIXED]
        self.ufix = self.W[1:3, self.le:]  # the same for the user signals
        self.cnt = np.zeros(n)
        self.streak, self.grow, self.prev = np.zeros(n), np.zeros(n), np.zeros(n)
        self.cus = [0.0] * (N_FIXED + nu)  # the fixed channels', then the user signals'
        self.joint = 0.0
        self.y = np.zeros(n)
        self.y2 = self.y[None, :]  # the same memory as one row, for _calm_rows
        self.yl = self.y[N_FIXED:self.le]
        self.P2 = np.zeros((2, n))
        self.P0, self.P1 = self.P2[0], self.P2[1]
        self.R2 = np.zeros((2, n))
        self.M2 = np.ones((2, n))
        self.bb = np.zeros(n, dtype=bool)
        self.lmask = np.ones(self.nl, dtype=bool)  # layers present under the pattern
        self.lcmp = np.zeros(self.nl, dtype=bool)
        self.n_lay = self.nl
        self.ztmp = np.zeros(n)
        self.dev_nan = False  # dev holds NaN (absent / not warm channels, set by _general)
        self.has_dev = False


class _Consts(NamedTuple):
    """Per channel count: thresholds as arrays (array compares are cheaper than scalar ones)."""

    lmin: np.ndarray  # log of the minimum ratio to count as elevated
    lgrowth: np.ndarray  # log growth factor of an escalation
    lwarn: np.ndarray  # log ratio an escalation must reach to warn
    gradlike: np.ndarray  # bool: gradient-type channels (all but the loss)
    fixed: np.ndarray  # bool: the run-level channels (grad, loss, update, param), not layers
    min_scale: np.ndarray  # per channel (the loss has its own floor)
    spike_w: np.ndarray  # spike_z / admit_z: the spike threshold in units of the width
    warns: np.ndarray  # bool: the run-level channels that may escalate or jump into a warning


def _fmt(x: float) -> str:
    """A value for a message: 3 significant digits, non-finite values as words ("NaN", "inf")."""
    if x != x:
        return "NaN"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def _times(r: float) -> str:
    """A ratio for a message: "2.4x", or "NaN" / "inf" (never "nanx")."""
    return f"{_fmt(r)}x" if math.isfinite(r) else _fmt(r)


class Detector:
    """Pure detector: ``state = init(layer_names)``, ``alerts, state = update(state, obs)``.

    ``update`` never mutates its input state, so a state can be kept, compared, checkpointed and
    replayed; the same object serves the live hook and the offline analyser (through
    :class:`StreamingDetector`, which updates one working state in place). Deterministic: the
    same observations give the same alerts.
    """

    def __init__(self, cfg: DetectorConfig | None = None):
        self.cfg = cfg if cfg is not None else DetectorConfig()
        if not isinstance(self.cfg, DetectorConfig):
            raise TypeError(f"Detector(cfg=...) wants a DetectorConfig, got {type(cfg).__name__}")
        c = self.cfg
        self._log_jump = math.log(c.jump_ratio) if math.isfinite(c.jump_ratio) else math.inf
        self._log_div = math.log(c.loss_diverge_ratio)
        self._div_z = float(c.loss_diverge_z)
        # a channel is mature once its EMA rates no longer depend on its count
        self._mature_n = float(max(c.warmup_steps, math.ceil(1.0 / c.alpha), math.ceil(1.0 / c.scale_alpha)))
        self._scale0 = max(c.prior_scale, c.min_scale, c.loss_min_scale)
        self._consts: dict[int, _Consts] = {}
        self._kd, self._tk, self._spike_z = float(c.drift_k), float(c.together_k), float(c.spike_z)
        self._drift_h, self._alone_h = float(c.drift_h), float(c.drift_alone_h)
        self._rise_h = float(c.drift_h) * float(c.lr_rise_factor)  # the together threshold while the LR climbs
        self._no_lr_h = float(c.drift_h) * float(c.no_lr_factor)  # ... and where no LR is known
        # each step's evidence is winsorised at admit_z, as values entering a baseline are
        self._tcap = self._A = float(c.admit_z)
        self._alone_u = float(c.update_alone_h) if c.update_warns else math.inf
        self._loss_only_h = float(c.loss_only_h)
        self._lr_jump, self._lr_k = float(c.lr_jump_ratio), int(c.lr_ref_steps)
        self._lr_ready = max(int(c.warmup_steps), self._lr_k)  # LR values seen before the rule may fire
        self._calm_consts = (self._kd, self._spike_z, self._A, self._tcap, self._tk, self._drift_h,
                             self._alone_h, self._log_div, self._div_z, self._alone_u, bool(c.update_warns),
                             self._lr_jump, self._lr_k, self._lr_ready, self._loss_only_h, self._rise_h,
                             float(c.user_alone_h), self._no_lr_h)
        self._force_full = False  # tests: run every step through the general path

    def _k(self, n: int, le: int | None = None) -> _Consts:
        le = n if le is None else le  # channels from le on are user signals (run-level)
        k = self._consts.get((n, le))
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
            fixed[le:] = True
            min_scale = np.full(n, float(c.min_scale))
            min_scale[LOSS] = c.loss_min_scale
            warns = fixed.copy()
            if not c.update_warns:
                warns[UPDATE] = warns[PARAM] = False
            k = self._consts[(n, le)] = _Consts(lmin, lgrowth, lwarn, gradlike, fixed, min_scale,
                                          np.full(n, float(c.spike_z) / float(c.admit_z)), warns)
        return k

    # ------------------------------------------------------------------------------------------
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
        users += [k for k in (baseline or {}) if isinstance(k, str) and k.startswith(USER) and k not in users]
        if len(set(users)) != len(users):
            raise ValueError("user_names must be unique")
        channels = FIXED_NAMES + tuple(f"grad_norm/{n}" for n in layer_names) + tuple(users)
        stats = np.zeros((N_ROWS, len(channels)))
        stats[SCALE] = self._scale0
        stats[WIDTH] = self._scale0 * self._A
        shift = 0.0
        for key, value in (baseline or {}).items():
            if key not in channels:
                raise ValueError(f"baseline key {key!r} is not a signal of this detector; use one "
                                 f"of {list(FIXED_NAMES)}, 'grad_norm/<layer>' or 'user/<name>'")
            try:
                v = float(value)
            except (TypeError, ValueError):
                v = _NAN
            if key == "loss" and math.isfinite(v) and v <= 0:
                shift = _loss_shift_for(v, 0.0)  # a loss that is negative by nature (an NLL)
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
        w = self._load(state)
        new = self._new_users(w, obs.extras)
        if new:
            w = self._load(with_user_signals(state, new, self._scale0, self._A))
        alerts = self._step(w, obs)
        return alerts, self._snapshot(w)

    @staticmethod
    def _new_users(w: "_Work", ex: Mapping[str, float]) -> list[str]:
        """User signals in ``ex`` that have no channel yet (in the order given)."""
        if not ex:
            return []
        us = w.uset
        return [k for k in ex if k.startswith(USER) and k not in us]

    # -- working state <-> snapshot -------------------------------------------------------------
    def _load(self, s: DetectorState) -> _Work:
        w = _Work(s.channels)
        st = s.stats
        w.mu[:] = st[MU]
        w.wd[:] = st[WIDTH]
        w.cnt[:] = st[COUNT]
        w.streak[:], w.grow[:], w.prev[:] = st[STREAK], st[GROW], st[PREV]
        w.cus = [float(v) for v in st[CUSUM, :N_FIXED]] + [float(v) for v in st[CUSUM, w.le:]]
        w.joint = float(s.joint)
        if s.dev is not None:
            w.dev[:] = s.dev
            w.has_dev = True
            w.dev_nan = bool(np.isnan(s.dev).any())
        w.lmask[:] = True
        w.lmask[list(s.absent)] = False
        w.n_lay = int(_cnz(w.lmask))
        for name in ("step", "pattern", "fast", "episode", "ep_start", "ep_peak_step", "ep_peak_chan",
                     "ep_peak_dev", "ep_first_layer", "ep_warned", "since_warn", "loss_div",
                     "loss_div_fired", "nonfinite", "overflow", "loss_scale", "scale_pending",
                     "score_cap", "level", "hot", "loss_shift", "lr_pos", "lr_n", "lr_ref"):
            setattr(w, name, getattr(s, name))
        K = self.cfg.lr_ref_steps
        w.lr_ring = list(s.lr_ring) if len(s.lr_ring) == K else [0.0] * K
        if len(s.lr_ring) != K:
            w.lr_pos = w.lr_n = 0
            w.lr_ref = 0.0
        self._refresh(w)
        return w

    def _snapshot(self, w: _Work) -> DetectorState:
        stats = np.zeros((N_ROWS, w.n))
        stats[MU], stats[SCALE], stats[COUNT] = w.mu, w.wd / self._A, w.cnt
        stats[WIDTH] = w.wd
        stats[STREAK], stats[GROW], stats[PREV] = w.streak, w.grow, w.prev
        stats[CUSUM, :N_FIXED] = w.cus[:N_FIXED]
        stats[CUSUM, w.le:] = w.cus[N_FIXED:]
        return DetectorState(
            step=w.step, channels=w.channels, stats=stats, dev=w.dev.copy() if w.has_dev else None,
            joint=w.joint, pattern=w.pattern, fast=w.fast, episode=w.episode, ep_start=w.ep_start,
            ep_peak_step=w.ep_peak_step, ep_peak_chan=w.ep_peak_chan, ep_peak_dev=w.ep_peak_dev,
            ep_first_layer=w.ep_first_layer, ep_warned=w.ep_warned, since_warn=w.since_warn,
            loss_div=w.loss_div, loss_div_fired=w.loss_div_fired, nonfinite=w.nonfinite,
            overflow=w.overflow, loss_scale=w.loss_scale, scale_pending=w.scale_pending,
            score_cap=w.score_cap, level=w.level, hot=w.hot, loss_shift=w.loss_shift,
            lr_ring=tuple(w.lr_ring), lr_pos=w.lr_pos, lr_n=w.lr_n, lr_ref=w.lr_ref,
            absent=tuple(int(i) for i in np.flatnonzero(~w.lmask)))

    def _refresh(self, w: _Work) -> None:
        """What the calm path assumes, derived from the state: its EMA rates (steady rates for
        the mature channels given under the current pattern, 0 elsewhere), and absent channels'
        log-values parked on their baseline (so their deviation is exactly 0)."""
        cfg = self.cfg
        n, pattern = w.n, w.pattern
        expected = np.zeros(n, dtype=bool)
        if pattern >= 0:
            for bit, c in _PAT_KEYS:
                expected[c] = bool(pattern & bit)
            if pattern & 16:
                expected[N_FIXED:w.le] = w.lmask
            for i in range(w.nu):
                expected[w.le + i] = bool(pattern & (_USER_BIT << i))
        steady = expected & (w.cnt >= self._mature_n)
        b = np.where(steady, cfg.scale_alpha, 0.0)
        w.R2[0] = np.where(steady, cfg.alpha, 0.0)
        np.multiply(b, self._A, out=w.R2[1])  # as _general computes it
        w.M2[0] = 1.0
        np.subtract(1.0, b, out=w.M2[1])
        w.k = self._k(n, w.le)
        np.copyto(w.y, w.mu, where=~expected)

    # -- one step -------------------------------------------------------------------------------
    def _step(self, w: _Work, obs: Observation) -> list[Event]:
        """One step. A calm step of a mature run (the same signals as last step, every value
        finite, no channel elevated, no rule about to fire) is handled here with a fixed sequence
        of in-place numpy calls; anything else goes to :meth:`_general`, which starts from the
        untouched state and computes the same numbers for the calm channels."""
        g, loss, ex, ln = obs.grad_norm, obs.loss, obs.extras, obs.layer_norms
        pattern = 0 if g is None else 1
        if loss is not None:
            pattern |= 2
        u = p = loss_scale = lr = None
        if ex:
            u, p, loss_scale, lr = ex.get("update_norm"), ex.get("param_norm"), ex.get("loss_scale"), ex.get("lr")
            if u is not None:
                pattern |= 4
            if p is not None:
                pattern |= 8
            if lr is not None:
                pattern |= 32
        uv = None
        if w.nu and ex and len(ex) > (u is not None) + (p is not None) + (loss_scale is not None) + (lr is not None):
            uv = []  # (channel, value) of the user signals given
            ch, le = w.channels, w.le
            for i in range(w.nu):
                v = ex.get(ch[le + i])
                if v is not None:
                    pattern |= _USER_BIT << i
                    uv.append((le + i, v))
        nl = w.nl
        if ln is not None and nl:
            if len(ln) != nl:
                raise ValueError(f"step {obs.step}: {len(ln)} layer norms for a detector initialised "
                                 f"with {nl} layer names; pass the same layers in the same order")
            pattern |= 16
        lnf = obs.layer_nonfinite
        if not (w.fast and pattern == w.pattern and not obs.skipped
                and (loss_scale is None or not loss_scale < w.loss_scale)
                and (lnf is None or not _cnz(lnf))):
            return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)

        # -- the calm path -------------------------------------------------------------------
        # run-level values must be finite and > 0 (NaN fails `>`; inf fails the outlier test)
        y = w.y
        if g is not None:
            if not g > 0.0:
                return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
            y[0] = _log(g)
        if loss is not None:
            lv = loss + w.loss_shift  # + 0.0 unless the loss has gone <= 0 (see _shift_loss)
            if not lv > 0.0:
                return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
            y[1] = _log(lv)
        if pattern & 12:
            if u is not None:
                if not u > 0.0:
                    return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
                y[2] = _log(u)
            if p is not None:
                if not p > 0.0:
                    return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
                y[3] = _log(p)
        if uv:
            for c, v in uv:
                if not v > 0.0:
                    return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
                y[c] = _log(v)
        if pattern & 16:
            nz = _cnz(ln)
            if nz == nl and w.n_lay == nl:
                if type(ln) is np.ndarray and ln.dtype is _F64DT:
                    _np_log(ln, w.yl)
                else:  # computed in float64, as the general path does
                    _np_log(ln, out=w.yl, dtype=_F64)
            else:
                # layers reporting 0 are absent (a frozen layer): calm only if they are the same
                # ones as last step (their values stay parked on the baseline)
                lm = w.lcmp
                _greater(ln, 0.0, lm)  # NaN and negative values fail: the general path
                if nz != w.n_lay or _cnz(lm) != nz:
                    return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
                _not_equal(lm, w.lmask, lm)
                if _cnz(lm):
                    return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
                _np_log(ln, out=w.yl, where=w.lmask, dtype=_F64)
        lrs = None
        if lr is not None:
            lr = float(lr)
            if not 0.0 <= lr < math.inf:
                return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)
            lrs = (lr,)
        if self._calm_rows(w, w.y2, 0, 1, pattern, (obs.step,), lrs):
            if loss_scale is not None:
                w.loss_scale = float(loss_scale)
            return []
        return self._general(w, obs, pattern, g, loss, u, p, ln, lnf, loss_scale)

    def _columns(self, w: _Work, cols: StepColumns, start: int, stop: int) -> list[tuple[int, Event]]:
        """Rows ``[start, stop)`` of ``cols``, exactly as one :meth:`_step` per row (same state,
        same alerts), without building an Observation for the calm rows: their log-values are
        taken for a chunk of rows at once and handed to :meth:`_calm_rows`; every other row goes
        through :meth:`_step`. Absent signals (a run-level signal not logged on a row, no layer
        norms on a row, a layer reporting 0) are parked on their baselines, as ``_refresh``
        parks them for the live step."""
        n, nl = w.n, w.nl
        T = stop - start
        out: list[tuple[int, Event]] = []
        if T <= 0:
            return out

        def known(mask) -> np.ndarray:
            return np.ones(T, dtype=bool) if mask is None else np.asarray(mask[start:stop], dtype=bool)

        # which signals each row has (the pattern) and whether it may be calm: every given value
        # finite and > 0, not skipped, no non-finite flag, no loss-scale reading
        pat = np.zeros(T, dtype=np.int64)
        ok = np.ones(T, dtype=bool)
        ex = cols.extras
        fixed = []
        le = w.le
        users = tuple((_USER_BIT << i, le + i) for i in range(w.nu))
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
                # the loss is tested per chunk, against its offset then (see _shift_loss)
                ok &= ~kn | ((v > (-math.inf if chan == LOSS else 0.0)) & (v < math.inf))
            fixed.append((chan, v, kn))
        lr_col = None
        if "lr" in ex:
            lv, lkm = ex["lr"]
            lk = known(lkm)
            lr_col = np.asarray(lv[start:stop], dtype=np.float64)
            pat[lk] |= 32
            with np.errstate(invalid="ignore"):
                ok &= ~lk | ((lr_col >= 0.0) & (lr_col < math.inf))
        lay = zero = None
        if cols.layer_norms is not None and nl:
            lay = np.asarray(cols.layer_norms[start:stop], dtype=np.float64)
            if lay.ndim != 2 or lay.shape[1] != nl:
                raise ValueError(f"layer_norms has shape {lay.shape} for a detector initialised with {nl} "
                                 "layer names; pass (rows, layers) in the same layer order")
            lk = known(cols.layers_known)
            pat[lk] |= 16
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
        absent = [(c, ab) for c, ab in ((c, (pat & bit) == 0) for bit, c in _PAT_KEYS + users) if ab.any()]
        no_layers = (pat & 16) == 0 if nl else None
        if no_layers is not None and not no_layers.any():
            no_layers = None
        has_zero = np.zeros(T, dtype=bool) if zero is None else zero.any(axis=1)
        calm_rows, step_fn, mu, mu_lay = self._calm_rows, self._step, w.mu, w.mu[N_FIXED:le]

        a = 0
        while a < T:
            b = min(T, a + _CHUNK_ROWS)
            Y = np.empty((b - a, n))
            okc = ok[a:b].copy()
            shift = w.loss_shift
            for chan, v, kn in fixed:  # math.log, as _step takes a run-level value
                vc = v[a:b]
                if chan == LOSS:
                    vc = vc + shift  # exactly as _step adds it
                    with np.errstate(invalid="ignore"):
                        okc &= ~kn[a:b] | (vc > 0.0)
                sel = okc & kn[a:b]
                Y[sel, chan] = list(map(_log, vc[sel].tolist()))
            if lay is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    _np_log(lay[a:b], Y[:, N_FIXED:le])

            def park(r0: int) -> None:
                # absent channels sit on their baseline (deviation exactly 0), as _refresh parks
                # them for the live step; their baselines only move on rows that have them, which
                # go through _step, after which the rest of the chunk is parked again
                for c, ab in absent:
                    Y[r0:, c][ab[a + r0:b]] = mu[c]
                if no_layers is not None:
                    Y[r0:, N_FIXED:le][no_layers[a + r0:b]] = mu_lay
                if zero is not None:
                    np.copyto(Y[r0:, N_FIXED:le], mu_lay, where=zero[a + r0:b])

            park(0)
            # runs of rows that may be calm under one pattern and one set of zero layers:
            # run_end[r] is where r's run ends
            m = b - a
            brk = ~okc
            brk[1:] |= pat[a + 1:b] != pat[a:b - 1]
            if zero is not None:
                brk[1:] |= (zero[a + 1:b] != zero[a:b - 1]).any(axis=1)
            cuts = np.append(np.flatnonzero(brk), m)
            run_end = cuts[np.searchsorted(cuts, np.arange(m), side="right")].tolist()
            okl, patl, stepl, zl = okc.tolist(), pat[a:b].tolist(), steps[a:b].tolist(), has_zero[a:b].tolist()
            lrl = None if lr_col is None else lr_col[a:b].tolist()
            r = 0
            nxt = b
            while r < m:
                # calm as _step would take it: the same signals as the last step, and layers
                # reporting 0 exactly the ones already absent
                if (okl[r] and w.fast and patl[r] == w.pattern
                        and (not (patl[r] & 16) or (np.array_equal(zero[a + r], ~w.lmask) if zl[r]
                                                    else w.n_lay == nl))):
                    e = run_end[r]
                    r = calm_rows(w, Y, r, e, patl[r], stepl, lrl if patl[r] & 32 else None)
                    if r == e:
                        continue
                i = start + a + r
                for ev in step_fn(w, cols.observation(i)):
                    out.append((i, ev))
                r += 1
                if w.loss_shift != shift:  # the loss's offset moved: take the rest afresh
                    nxt = a + r
                    break
                if r < m:
                    park(r)
            a = nxt
        return out

    def _calm_rows(self, w: _Work, Y: np.ndarray, r0: int, r1: int, pattern: int, steps, lrs=None) -> int:
        """Calm steps, one per row of ``Y[r0:r1]`` (each row a step's log-values, absent channels
        parked on their baseline; same ``pattern`` as the last step; every given value finite
        and > 0), with ``steps[r]`` the step of row ``r``. Commits rows while they are calm and
        returns the first row that is not (``r1`` if all were): that row needs the general path,
        and nothing but scratch vectors was changed for it. The live hook calls this with one
        row, the offline replay with a chunk: one sequence of operations per step for both.
        ``lrs[r]`` is row ``r``'s learning rate (finite, >= 0) when the pattern has one."""
        dev, adev, bb, n, k, mu, wd, fixed = w.dev, w.adev, w.bb, w.n, w.k, w.mu, w.wd, w.fixed
        kd, S, A, tcap, tk, dh0, h, ldiv, dz, hu, t_upd, lrj, lrk, lr_ready, hlo, dhr, hus, dhn = self._calm_consts
        if lrs is None:
            dh0 = dhn  # no LR known: its own together threshold
        h1 = h if pattern & 5 else hlo  # the loss alone: loss_only_h when no gradient is logged
        c0, c1, c2, c3 = w.cus[:N_FIXED]
        uc = w.cus[N_FIXED:]  # the user signals' CUSUMs ([] without any)
        uon = pattern >= _USER_BIT  # some user signal given (bits from _USER_BIT up)
        joint = w.joint
        ring, lpos, ln_, lref = w.lr_ring, w.lr_pos, w.lr_n, w.lr_ref
        r = r0
        while r < r1:
            _subtract(Y[r], mu, dev)
            _absolute(dev, adev)
            _less(adev, wd, bb)  # within admit_z scales either way; NaN / inf fail
            clip = _cnz(bb) != n
            if clip:
                # some channel beyond admit_z: still calm if it is finite and not elevated, i.e.
                # below max(spike_z * scale, log of the minimum ratio); it enters winsorised.
                # Below the minimum ratio everywhere is enough (the usual case: 2 calls, not 4).
                _less(dev, k.lmin, bb)  # NaN / inf fail
                if _cnz(bb) != n:
                    _multiply(wd, k.spike_w, w.P0)
                    _fmax(w.P0, k.lmin, w.P0)
                    _less(dev, w.P0, bb)
                    if _cnz(bb) != n:
                        break
            # run-level channels: CUSUMs and the together evidence, in scalars (as _general does)
            s4, d4 = fixed.tolist()
            if pattern & 2 and d4[1] >= ldiv and d4[1] * A / s4[1] >= dz:
                break  # the loss may be diverging: the general path counts the steps
            n0, n1, n2, n3 = c0, c1, c2, c3
            zl = zgl = None
            if pattern & 1:
                zgl = d4[0] * A / s4[0]
                n0 = n0 + (zgl if zgl < S else S) - kd
                if n0 < 0.0:
                    n0 = 0.0
            if pattern & 2:
                zl = d4[1] * A / s4[1]
                n1 = n1 + (zl if zl < S else S) - kd
                if n1 < 0.0:
                    n1 = 0.0
            if pattern & 12:
                if pattern & 4:
                    zu = d4[2] * A / s4[2]
                    n2 = n2 + (zu if zu < S else S) - kd
                    if n2 < 0.0:
                        n2 = 0.0
                    if zgl is None or (t_upd and zu > zgl):
                        zgl = zu
                if pattern & 8:
                    zp = d4[3] * A / s4[3]
                    n3 = n3 + (zp if zp < S else S) - kd
                    if n3 < 0.0:
                        n3 = 0.0
            nuc = None
            uhit = False
            if uon:  # the user signals' CUSUMs, as the fixed ones
                su, du = w.ufix.tolist()
                nuc = uc[:]
                for i in range(len(nuc)):
                    if pattern & (_USER_BIT << i):
                        zq = du[i] * A / su[i]
                        v = nuc[i] + (zq if zq < S else S) - kd
                        nuc[i] = v if v > 0.0 else 0.0
                        if nuc[i] >= hus:
                            uhit = True
            dh = dh0
            if lrs is not None and ln_ >= lrk:
                lr = lrs[r]
                if lr > ring[lpos] and lr >= lref:  # the LR at a new high (see _general)
                    dh = dhr
            nj = joint
            if zl is not None and zgl is not None:
                m = zgl if zgl < zl else zl
                nj = nj + (m if m < tcap else tcap) - tk
                if nj < 0.0:
                    nj = 0.0
            if nj >= dh or n0 >= h or n1 >= h1 or n2 >= hu or n3 >= hu or uhit or self._force_full:
                break  # a warning may be due: the general path decides and words it
            if lrs is not None:
                lr = lrs[r]
                if ln_ >= lr_ready and lref > 0.0 and lr >= lrj * lref:
                    break  # the LR jumped beyond what the run has survived
                if ln_ >= lrk:  # the LR that leaves the ring is now lrk steps back
                    old = ring[lpos]
                    if old > lref:
                        lref = old
                ring[lpos] = lr
                lpos = lpos + 1 if lpos + 1 < lrk else 0
                ln_ += 1
            # commit: both EMAs as one stacked multiply-add (see _Work)
            if clip:
                # clip(dev, +-wd) as |dev| capped with dev's sign (exactly fmin(fmax(dev, -wd), wd))
                P1 = w.P1
                _fmin(adev, wd, P1)
                _copysign(P1, dev, w.P0)
                _fmax(P1, k.min_scale, P1)
                _multiply(w.P2, w.R2, w.P2)
            else:
                _fmax(adev, k.min_scale, adev)
                _multiply(w.D2, w.R2, w.P2)
            S2 = w.S2
            _multiply(S2, w.M2, S2)
            _add(S2, w.P2, S2)
            c0, c1, c2, c3, joint = n0, n1, n2, n3, nj
            if nuc is not None:
                uc = nuc
            r += 1
        if r > r0:
            w.cus = [c0, c1, c2, c3] + uc if uc else [c0, c1, c2, c3]
            w.joint = joint
            w.lr_pos, w.lr_n, w.lr_ref = lpos, ln_, lref
            w.step = steps[r - 1]
            w.has_dev = True
            w.dev_nan = False
            if w.since_warn < _BIG:
                w.since_warn = min(w.since_warn + (r - r0), _BIG)
            w.level = 0
            w.score_cap = False
        return r

    def _general(self, w: _Work, obs: Observation, pattern: int, g, loss, u, p, ln, lnf,
                 loss_scale) -> list[Event]:
        """Warm-up, spikes, escalations, skipped and non-finite steps: the general, masked path.
        On a calm step it computes exactly what the calm path computes."""
        cfg = self.cfg
        n, nl, le, nu = w.n, w.nl, w.le, w.nu
        k = self._k(n, le)
        step = int(obs.step)
        mu, wd, cnt = w.mu, w.wd, w.cnt

        # -- the step's values in log space (NaN = absent; a zero norm is absent too) ---------
        x = [_NAN] * (N_FIXED + nu)  # run-level values as given: the fixed ones, then the user signals
        y = np.full(n, _NAN)
        if loss is not None:
            lv = float(loss)
            if lv + w.loss_shift <= 0.0 and lv > -math.inf:  # finite and <= 0: re-base the loss channel
                self._shift_loss(w, lv)
        for c, v in enumerate((g, loss, u, p)):
            if v is not None:
                x[c] = v = float(v)
                if c == LOSS:
                    v = v + w.loss_shift  # as the calm path takes it
                if v > 0.0:
                    y[c] = _log(v)  # as the calm path takes it (math.log, not np.log)
        user_bad = []  # user signals given as NaN / inf (absent from every baseline)
        if pattern >= _USER_BIT:
            ex = obs.extras
            for i in range(nu):
                if pattern & (_USER_BIT << i):
                    x[N_FIXED + i] = v = float(ex[w.channels[le + i]])
                    if 0.0 < v < math.inf:
                        y[le + i] = _log(v)
                    elif not math.isfinite(v):
                        user_bad.append(le + i)
        lnv = None
        if pattern & 16:
            lnv = np.asarray(ln, dtype=np.float64)
            yl = y[N_FIXED:le]
            np.log(np.maximum(lnv, _TINY), out=yl)  # inf stays inf: a non-finite gradient
            if _cnz(lnv) != nl:
                yl[lnv == 0.0] = _NAN  # a zero norm ("not computed", a frozen layer) is absent
            yl[lnv < 0.0] = _NAN

        # -- what is wrong with this step ----------------------------------------------------
        grad_bad = g is not None and not math.isfinite(g)
        if lnv is not None and _cnz(np.isfinite(lnv)) != nl:
            grad_bad = True
        if lnf is not None and _cnz(lnf):
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

        # -- robust deviations --------------------------------------------------------------
        present = np.isfinite(y)
        dev = y - mu
        z = (dev * self._A) / wd  # as the calm path computes it
        warm = cnt >= cfg.warmup_steps  # as of before this step
        pw = present & warm
        # elevated: z >= spike_z and a ratio of at least the minimum, i.e. dev >= this threshold
        elev = pw & (dev >= np.fmax(wd * k.spike_w, k.lmin))
        if skipped:
            elev[:] = False  # a skipped step's values are stale or non-finite: not a spike
        any_elev = bool(np.count_nonzero(elev))
        zf = [float(v) for v in z[:N_FIXED]]
        pwf = [bool(v) for v in pw[:N_FIXED]]
        # the loss far above its baseline as a ratio and in its own noise (a divergence's step)
        div_now = bool(dev[LOSS] >= self._log_div) and zf[LOSS] >= self._div_z

        # -- baseline update: admitted values only, winsorised (same arithmetic as _calm_rows) ----
        if not skipped:
            adm = present & ~elev  # spikes never enter; the rest enters winsorised
            if w.loss_div and adm[LOSS] and warm[LOSS] and div_now:
                adm[LOSS] = False  # a divergence under way (its 2nd step on) does not become the baseline
            P2 = np.empty((2, n))
            R2 = np.empty((2, n))
            np.fmin(np.fmax(dev, -wd), wd, out=P2[0])
            np.fmax(np.fmin(np.abs(dev), wd), k.min_scale, out=P2[1])
            P2[:, ~adm] = 0.0  # absent values are NaN: zero them before the rates do
            np.multiply(adm, cfg.alpha, out=R2[0])
            np.multiply(adm, cfg.scale_alpha, out=R2[1])
            young = adm & (cnt < self._mature_n)
            if _cnz(young):
                # warm-up: an exact running mean of the first values (rate 1/count), and a
                # channel's first value is its baseline
                r = np.where(young, 1.0 / (cnt + 1.0), 0.0)
                np.maximum(R2[0], r, out=R2[0])
                np.maximum(R2[1], r, out=R2[1])
                first = young & (cnt == 0)
                if _cnz(first):
                    P2[0, first] = dev[first]
                    R2[0, first] = 1.0
                    R2[1, first] = 0.0
                cnt += young
            M2 = np.ones((2, n))
            np.subtract(1.0, R2[1], out=M2[1])
            np.multiply(R2[1], self._A, out=R2[1])  # the width moves admit_z times the scale
            P2 *= R2
            w.S2 *= M2
            w.S2 += P2

        # -- the LR at a new high: above the LR lr_ref_steps back and the highest before it --------
        lr = float(obs.extras["lr"]) if pattern & 32 else _NAN
        lr_ok = 0.0 <= lr < math.inf
        rising = lr_ok and w.lr_n >= self._lr_k and lr > w.lr_ring[w.lr_pos] and lr >= w.lr_ref

        # -- run-level CUSUMs and the together evidence (frozen on skipped steps) -------------
        cus = list(w.cus)
        joint = w.joint
        m_now = _NAN  # this step's together evidence (both above their baselines when > 0)
        if not skipped:
            kd, S = cfg.drift_k, float(cfg.spike_z)
            for c in range(N_FIXED):
                if pwf[c]:
                    v = cus[c] + (zf[c] if zf[c] < S else S) - kd
                    cus[c] = v if v > 0.0 else 0.0
                elif present[c]:
                    cus[c] = 0.0  # warming up
            for i in range(nu):  # the user signals, as the fixed channels
                c = le + i
                if pw[c]:
                    zc = float(z[c])
                    v = cus[N_FIXED + i] + (zc if zc < S else S) - kd
                    cus[N_FIXED + i] = v if v > 0.0 else 0.0
                elif present[c]:
                    cus[N_FIXED + i] = 0.0
            zgl = None
            for c in (GRAD, UPDATE):
                if pwf[c] and (zgl is None or (cfg.update_warns and zf[c] > zgl)):
                    zgl = zf[c]
            if zgl is not None and pwf[LOSS]:
                m_now = min(zgl, zf[LOSS])
                joint = joint + min(m_now, self._tcap) - cfg.together_k
                joint = joint if joint > 0.0 else 0.0

        # -- streaks --------------------------------------------------------------------------
        prev4 = w.prev[:N_FIXED].tolist() + w.prev[le:].tolist()  # the escalation message quotes the step before
        hot = w.hot
        if (any_elev or hot) and not skipped:  # a skipped step leaves the streaks as they were
            streak, grow, prev = w.streak, w.grow, w.prev
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

        # -- critical: non-finite gradients, scaler overflows --------------------------------
        if overflow:
            w.overflow += 1
            alerts.append(self._overflow_event(obs, w, w.loss_scale, loss_scale, w.overflow, ln, lnf))
            if w.overflow == cfg.overflow_steps:
                alerts.append(self._nonfinite_event(obs, w, ln, lnf, w.overflow, scaler=True))
            w.nonfinite = 0
        else:
            w.overflow = 0
            if grad_bad:
                w.nonfinite += 1
                alerts.append(self._nonfinite_event(obs, w, ln, lnf, w.nonfinite, scaler=False))
            else:
                w.nonfinite = 0

        # -- critical: loss ------------------------------------------------------------------
        shift = w.loss_shift
        base_loss = math.exp(float(mu[LOSS])) - shift if warm[LOSS] else _NAN
        if loss_bad:
            alerts.append(Event(
                step=step, kind=Kind.LOSS_NONFINITE, level=Level.CRITICAL, signal="loss",
                message=(f"Loss is {_fmt(float(loss))} at step {step}; the run is diverging or a batch is "
                         "corrupt: rewind to the last clean checkpoint and skip this batch."),
                values={"value": float(loss), "baseline": base_loss, "ratio": math.inf},
                batch=obs.batch))
        elif present[LOSS] and warm[LOSS]:
            dl = float(dev[LOSS])
            # diverged: far above the baseline both as a ratio and in the loss's own noise (a
            # batch-8 loss wobbles by 2x; its scale says so), and for long, not a 2-step excursion
            if div_now:
                w.loss_div += 1
                if w.loss_div >= cfg.loss_diverge_steps and not w.loss_div_fired:
                    w.loss_div_fired = True
                    base = math.exp(float(y[LOSS]) - dl) - shift
                    now = float(x[LOSS])
                    how = (f"at {_times(math.exp(dl))} its baseline" if shift == 0.0 else
                           "far above its baseline")
                    alerts.append(Event(
                        step=step, kind=Kind.LOSS_DIVERGED, level=Level.CRITICAL, signal="loss",
                        message=(f"Loss has stayed {how} ({_fmt(base)} -> {_fmt(now)}, "
                                 f"{zf[LOSS]:.0f} times its usual step-to-step deviation) for {w.loss_div} "
                                 "steps; the run has diverged: rewind to the last clean checkpoint and "
                                 "lower the learning rate."),
                        values={"value": now, "baseline": base, "ratio": math.exp(dl), "z": zf[LOSS],
                                "steps": float(w.loss_div)},
                        batch=obs.batch))
            else:
                w.loss_div = 0
                w.loss_div_fired = False

        # -- the learning rate: a jump beyond what the run has survived, then into the ring ----
        lr_jump = None
        if lr_ok:
            if w.lr_n >= self._lr_ready and w.lr_ref > 0.0 and lr >= self._lr_jump * w.lr_ref:
                lr_jump = (lr, w.lr_ref)
            K = self._lr_k
            if w.lr_n >= K:
                old = w.lr_ring[w.lr_pos]
                if old > w.lr_ref:
                    w.lr_ref = old
            w.lr_ring[w.lr_pos] = lr
            w.lr_pos = w.lr_pos + 1 if w.lr_pos + 1 < K else 0
            w.lr_n += 1

        # -- spikes and escalation -----------------------------------------------------------
        grad_elev = any_elev and bool(np.count_nonzero(elev & k.gradlike))
        since = w.since_warn + 1 if w.since_warn < _BIG else _BIG
        if grad_elev:
            # the run-level norm names the spike when it moved; a layer only when it alone did
            sel = elev & k.gradlike & k.fixed
            if not np.count_nonzero(sel):
                sel = elev & k.gradlike
            dev_g = np.where(sel, dev, -np.inf)
            peak = int(np.argmax(dev_g))
            if not w.episode:
                w.episode = True
                w.ep_start, w.ep_peak_step, w.ep_peak_chan = step, step, peak
                w.ep_peak_dev, w.ep_warned = float(dev_g[peak]), False
                w.ep_first_layer = self._first_layer(elev, dev, w.streak, le)
            elif dev_g[peak] > w.ep_peak_dev:
                w.ep_peak_step, w.ep_peak_chan, w.ep_peak_dev = step, peak, float(dev_g[peak])
        if since >= cfg.rearm_steps and not skipped:
            ev = self._warning(obs, w, elev, dev, z, x, y, cus, joint, prev4, k, pattern, lr_jump, m_now > 0.0,
                               self._rise_h if rising else self._drift_h if pattern & 32 else self._no_lr_h,
                               user_bad)
            if ev is not None:
                alerts.append(ev)
                since = 0
                w.ep_warned = True
                # a warning consumes its evidence: another needs the rise to go on
                cus = [0.0] * (N_FIXED + nu)
                joint = 0.0
        if w.episode and not grad_elev and not skipped and present[w.ep_peak_chan]:
            # (a step without the peak signal, e.g. a user signal not reported, ends nothing)
            if not w.ep_warned:
                alerts.append(self._spike_event(obs, w))
            w.episode = False
            w.ep_start = w.ep_peak_step = w.ep_peak_chan = w.ep_first_layer = -1
            w.ep_peak_dev, w.ep_warned = 0.0, False

        # -- commit -----------------------------------------------------------------------------
        w.cus, w.joint, w.since_warn = cus, joint, since
        w.hot = hot
        w.loss_scale, w.scale_pending = new_scale, scale_pending
        w.score_cap = grad_bad or loss_bad
        w.step = step
        np.copyto(w.dev, np.where(pw, dev, _NAN))
        w.has_dev = True
        w.dev_nan = not bool(pw.all())
        w.pattern = pattern
        if pattern & 16:  # layers reporting 0 are absent: the calm path expects the same ones
            np.copyto(w.lmask, present[N_FIXED:le])
        else:
            w.lmask[:] = True
        w.n_lay = int(_cnz(w.lmask))
        mature = cnt >= self._mature_n
        expected_mature = True
        for bit, c in _PAT_KEYS:
            if pattern & bit and not mature[c]:
                expected_mature = False
        for i in range(nu):
            if pattern & (_USER_BIT << i) and not mature[le + i]:
                expected_mature = False
        if pattern & 16 and not mature[N_FIXED:le][w.lmask].all():
            expected_mature = False
        w.fast = (expected_mature and not hot and not w.episode and not w.loss_div and not grad_bad
                  and not loss_bad and not overflow and not scale_pending)
        self._refresh(w)
        level = Level.NONE
        for a in alerts:
            if a.level > level:
                level = a.level
        w.level = int(level)
        return alerts

    def _shift_loss(self, w: _Work, loss: float) -> None:
        """A finite loss <= 0 (minus its offset): the loss channel moves to ``log(loss + c)`` with a
        larger offset ``c``, so that it keeps its baseline, its noise scale and its rules (a
        log of a loss <= 0 would be undefined and would switch protection off). Its baseline and
        scale are mapped to the new offset; its run-level evidence restarts."""
        old = w.loss_shift
        new = _loss_shift_for(loss, old)
        i = LOSS
        if w.cnt[i] > 0:
            m = math.exp(float(w.mu[i])) - old  # the baseline loss itself
            w.mu[i] = _log(m + new)
            # d log(l + c) = dl / (l + c): the same spread is a smaller relative one
            w.wd[i] = max(float(w.wd[i]) * (m + old) / (m + new), self._A * self.cfg.loss_min_scale)
        w.loss_shift = new
        w.cus[i] = 0.0
        w.streak[i] = w.grow[i] = w.prev[i] = 0.0
        w.loss_div, w.loss_div_fired = 0, False

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _first_layer(elev: np.ndarray, dev: np.ndarray, streak: np.ndarray, le: int) -> int:
        """Channel index of the layer that moved first: longest current streak, then highest."""
        lay = np.flatnonzero(elev[N_FIXED:le])
        if lay.size == 0:
            return -1
        order = np.lexsort((-dev[N_FIXED:le][lay], -streak[N_FIXED:le][lay]))
        return int(lay[order[0]]) + N_FIXED

    def _ordered_layers(self, w: _Work, elev, z) -> tuple[str, ...]:
        """Layers that moved, first mover first: elevated longest, then highest now. Without an
        elevated layer, the layers at least two scales above their baselines."""
        le = w.le
        lay_z = np.nan_to_num(z[N_FIXED:le], nan=-np.inf)
        streak = w.streak[N_FIXED:le]
        moved = np.flatnonzero(elev[N_FIXED:le])
        if moved.size == 0:
            moved = np.flatnonzero(lay_z >= 2.0)
        if moved.size == 0:
            return ()
        order = np.lexsort((-lay_z[moved], -streak[moved]))
        names = w.channels
        out = [names[int(moved[i]) + N_FIXED][len("grad_norm/"):] for i in order]
        return tuple(out[: self.cfg.max_layers_listed])

    def _warning(self, obs, w: _Work, elev, dev, z, x, y, cus, joint, prev4,
                 k: _Consts, pattern: int, lr_jump, rising_now: bool, drift_h: float,
                 user_bad: Sequence[int] = ()) -> Event | None:
        """A COLLAPSE_RISK event if a warning rule holds at this step, else None. ``x``, ``cus``
        and ``prev4`` hold the run-level channels: the four fixed ones, then the user signals."""
        cfg = self.cfg
        le = w.le
        hl = self._alone_h if pattern & 5 else self._loss_only_h
        h_of = {GRAD: self._alone_h, LOSS: hl, UPDATE: self._alone_u, PARAM: self._alone_u}
        alone = [c for c in (GRAD, UPDATE, LOSS, PARAM) if cus[c] >= h_of[c]]
        alone += [le + i for i in range(w.nu) if cus[N_FIXED + i] >= cfg.user_alone_h]
        if not (joint >= drift_h or alone or _cnz(elev) or lr_jump or user_bad):
            return None

        def run_index(c: int) -> int:  # position of a run-level channel in x / cus / prev4
            return c if c < N_FIXED else N_FIXED + c - le
        streak, grow = w.streak, w.grow
        fx = k.warns  # per-layer signals never warn on their own
        esc = fx & elev & (grow >= cfg.escalate_steps) & (dev >= k.lwarn)
        jump = fx & elev & k.gradlike & (dev >= self._log_jump)
        together = joint >= drift_h and rising_now  # not on the step the values came back
        n_hot_layers = 0
        multi = False
        if w.nl and cfg.layers_at_once:
            n_hot_layers = int(np.count_nonzero(elev[N_FIXED:le] & (dev[N_FIXED:le] >= k.lwarn[N_FIXED:le])))
            multi = n_hot_layers >= cfg.layers_at_once
        act = "save a checkpoint now and be ready to rewind; consider lowering the learning rate"
        if not (esc.any() or jump.any() or together or alone or multi):
            if user_bad:
                c = user_bad[0]
                v = float(x[run_index(c)])
                return Event(
                    step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, signal=w.channels[c],
                    layers=(),
                    message=(f"{w.channels[c]} is {_fmt(v)} at step {obs.step} (a signal you report); "
                             f"collapse risk, {act}."),
                    values={"value": v, "baseline": math.exp(float(w.mu[c])) if w.cnt[c] > 0 else _NAN,
                            "ratio": _NAN, "z": _NAN, "cusum": _NAN, "steps": 1.0, "layers_elevated": 0.0},
                    batch=obs.batch)
            if lr_jump is None:
                return None
            lr, ref = lr_jump
            return Event(
                step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, signal="lr", layers=(),
                message=(f"The learning rate jumped to {_times(lr / ref)} the highest it had run at "
                         f"({_fmt(ref)} -> {_fmt(lr)}); collapse risk, save a checkpoint now and be "
                         "ready to rewind; check the LR schedule."),
                values={"value": lr, "baseline": ref, "ratio": lr / ref, "z": _NAN, "cusum": _NAN,
                        "steps": 1.0, "layers_elevated": 0.0},
                batch=obs.batch)

        def pick(mask: np.ndarray) -> int:
            for c in (GRAD, UPDATE, LOSS, PARAM, *range(le, w.n)):
                if mask[c]:
                    return c
            return GRAD

        if esc.any():
            rule, chan = "escalating", pick(esc)
        elif jump.any():
            rule, chan = "jump", pick(jump)
        elif together:
            zg, zu = z[GRAD], z[UPDATE]
            rule, chan = "together", UPDATE if (cfg.update_warns and zu == zu and not zu <= zg) else GRAD
            if chan == GRAD and zg != zg:
                chan = UPDATE  # no gradient norm logged: the update norm stood in for it
        elif alone:
            rule, chan = "alone", alone[0]
        else:
            rule, chan = "layers", GRAD
        layers = self._ordered_layers(w, elev, z)
        signal = w.channels[chan]
        d = float(dev[chan])
        ratio = math.exp(d) if math.isfinite(d) else _NAN
        base = math.exp(float(y[chan]) - d) if math.isfinite(d) else _NAN
        if chan == LOSS:
            base -= w.loss_shift
        value = float(x[run_index(chan)]) if chan < N_FIXED or chan >= le else _NAN
        where = f", led by {layers[0]}" if layers else ""
        if rule == "escalating":
            prev_ratio = math.exp(prev4[run_index(chan)])
            msg = (f"{signal} is escalating: {_times(prev_ratio)} -> {_times(ratio)} its baseline "
                   f"({_fmt(base)} -> {_fmt(value)}), {int(grow[chan])} growing steps in a row{where}; "
                   f"collapse risk, {act}.")
        elif rule == "jump":
            msg = (f"{signal} jumped to {_times(ratio)} its baseline ({_fmt(base)} -> {_fmt(value)}) "
                   f"in one step{where}; collapse risk, {act}.")
        elif rule == "together":
            dl = float(dev[LOSS])
            lr = math.exp(dl) if math.isfinite(dl) else _NAN
            msg = (f"{signal} and the loss have been rising together for several steps (now "
                   f"{_times(ratio)} and {_times(lr)} their baselines){where}; collapse risk, {act}.")
        elif rule == "alone":
            msg = (f"{signal} has been rising for several steps, now {_times(ratio)} its baseline "
                   f"({_fmt(base)} -> {_fmt(value)}){where}; collapse risk, {act}.")
        else:
            msg = (f"{n_hot_layers} layers jumped together{where}; collapse risk, {act}.")
        zc = float(z[chan])
        return Event(
            step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message=msg,
            signal=signal, layers=layers,
            values={"value": value, "baseline": base, "ratio": ratio,
                    "z": zc if math.isfinite(zc) else _NAN,
                    "cusum": float(joint if rule == "together" else cus[run_index(chan)]),
                    "steps": float(max(streak[chan], grow[chan])),
                    "layers_elevated": float(int(np.count_nonzero(elev[N_FIXED:le])))},
            batch=obs.batch)

    def _spike_event(self, obs, w: _Work) -> Event:
        ep_peak_dev, chan, peak_step = w.ep_peak_dev, w.ep_peak_chan, w.ep_peak_step
        start, first = w.ep_start, w.ep_first_layer
        signal = w.channels[chan]
        ratio = math.exp(ep_peak_dev)
        base = math.exp(float(w.mu[chan]))
        layers: tuple[str, ...] = ()
        if first >= 0:
            layers = (w.channels[first][len("grad_norm/"):],)
        if N_FIXED <= chan < w.le and (not layers or w.channels[chan][len("grad_norm/"):] != layers[0]):
            layers = layers + (w.channels[chan][len("grad_norm/"):],)
        dur = int(obs.step) - start
        where = f" (first in {layers[0]})" if layers else ""
        return Event(
            step=int(obs.step), kind=Kind.GRAD_SPIKE, level=Level.INFO, signal=signal, layers=layers,
            message=(f"Isolated {signal} spike at step {peak_step}: {_times(ratio)} its baseline"
                     f"{where}, back to normal after {dur} step{'s' if dur != 1 else ''}; nothing to do "
                     "unless these become frequent."),
            values={"ratio": ratio, "value": ratio * base, "baseline": base,
                    "peak_step": float(peak_step), "steps": float(dur)},
            batch=obs.batch)

    @staticmethod
    def _nonfinite_layers(w: _Work, ln, lnf) -> tuple[str, ...]:
        names = w.channels[N_FIXED:w.le]
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
        return tuple(names[i][len("grad_norm/"):] for i in np.flatnonzero(bad))  # backward order

    def _nonfinite_event(self, obs, w: _Work, ln, lnf, count: int, scaler: bool) -> Event:
        layers = self._nonfinite_layers(w, ln, lnf)
        g = obs.grad_norm
        base = math.exp(w.mu[GRAD]) if w.cnt[GRAD] > 0 else _NAN
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

    def _overflow_event(self, obs, w: _Work, prev, loss_scale, count, ln, lnf) -> Event:
        layers = self._nonfinite_layers(w, ln, lnf)
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
        self._w = self.detector._load(self.detector.init(layer_names, self._baseline))
        self._step = self.detector._step
        self._A = self.detector._A

    def observe(self, obs: Observation) -> list[Event]:
        if self._lazy:
            if obs.layer_norms is not None:
                if self._w.step >= 0:
                    raise ValueError("layer norms appeared mid-run; pass layer_names to StreamingDetector")
                names = [f"layer{i}" for i in range(len(obs.layer_norms))]
                self._w = self.detector._load(self.detector.init(names, self._baseline))
                self._lazy = False
            if obs.extras:
                self._add_users(self.detector._new_users(self._w, obs.extras))
            alerts = self._step(self._w, obs)
            if self._w.step >= 0:
                self._lazy = False  # a run without layer norms stays without them
            return alerts
        ex = obs.extras
        if ex:
            us = self._w.uset
            for key in ex:
                if key.startswith(USER) and key not in us:
                    self._add_users(self.detector._new_users(self._w, ex))
                    break
        return self._step(self._w, obs)

    def _add_users(self, names: Sequence[str]) -> None:
        if names:
            d = self.detector
            self._w = d._load(with_user_signals(d._snapshot(self._w), names, d._scale0, d._A))

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
                if key.startswith(USER) and key not in self._w.uset:
                    kn = np.ones(stop - start, dtype=bool) if known is None else np.asarray(known[start:stop], dtype=bool)
                    if kn.any():
                        first.setdefault(start + int(np.argmax(kn)), []).append(key)
            r = min(first) if first else stop
            out.extend(self.detector._columns(self._w, cols, start, r))
            if r < stop:
                self._add_users(first[r])
            start = r
        return out

    @property
    def state(self) -> DetectorState:
        """A snapshot of the detector's state (a copy: changing it changes nothing)."""
        return self.detector._snapshot(self._w)

    @state.setter
    def state(self, value: DetectorState) -> None:
        self._w = self.detector._load(value)

    @property
    def score(self) -> float:
        """Latest instability score: the largest robust z of any signal above its baseline
        (0 when nothing is above it; ~0-3 in calm training; >= spike_z on a spike; 1000 for a
        non-finite step). Monotone in how alarming the step is."""
        w = self._w
        if w.score_cap:
            return SCORE_CAP
        if not w.has_dev or not w.n:
            return 0.0
        t = w.ztmp
        _divide(w.dev, w.wd, t)
        if w.dev_nan:
            m = float(np.fmax.reduce(t))  # NaN (absent) ignored
        else:
            m = float(t[t.argmax()])  # a calm step: no NaN, and argmax is the cheap reduction
        m *= self._A
        return m if m > 0.0 else 0.0

    @property
    def level(self) -> Level:
        """Worst level raised at the latest step."""
        return _LEVELS[self._w.level]

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(c[len("grad_norm/"):] for c in self._w.channels[N_FIXED:self._w.le])

    @property
    def user_names(self) -> tuple[str, ...]:
        """The user signals seen so far, as ``"user/<name>"``."""
        return self._w.channels[self._w.le:]

    def baselines(self) -> dict[str, float]:
        """Current typical value per signal (only signals that have data)."""
        w = self._w
        return {c: math.exp(w.mu[i]) - (w.loss_shift if i == LOSS else 0.0)
                for i, c in enumerate(w.channels) if w.cnt[i] > 0}

    def state_dict(self) -> dict[str, Any]:
        d = self.state.to_dict()
        d["config"] = self.cfg.to_dict()
        d["lazy"] = self._lazy
        return d

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if int(d.get("version", STATE_VERSION)) != STATE_VERSION:
            # a checkpoint from an older earlywarn: resuming the run matters more than the
            # detector's memory, which re-learns its baselines within warmup_steps
            import warnings

            warnings.warn(f"detector state version {d.get('version')} (an older earlywarn) cannot be "
                          f"loaded into version {STATE_VERSION}; the detector starts afresh", stacklevel=2)
            self._w = self.detector._load(self.detector.init(self.layer_names, self._baseline))
            return
        state = DetectorState.from_dict(d)
        if "config" in d and DetectorConfig.from_dict(d["config"]) != self.cfg:
            # a checkpoint from a differently configured detector: keep the state, say so
            import warnings

            warnings.warn("loading detector state saved under a different DetectorConfig", stacklevel=2)
        self._w = self.detector._load(state)
        self._lazy = bool(d.get("lazy", False))
