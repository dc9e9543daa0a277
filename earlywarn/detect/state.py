"""What the detector remembers: the channel layout, and :class:`DetectorState`, declared once.

``STATE_FIELDS`` is the one list of the state's fields. It makes the ``DetectorState``
NamedTuple, its ``to_dict`` / ``from_dict`` and the working state's attributes
(:mod:`earlywarn.detect.work` loads a state into its arrays and snapshots it back from this table):
a field added here is saved, loaded and carried by every path.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from earlywarn.attention import SIGNAL as ATTENTION_SIGNAL

# fixed channels, then one per layer, then one per user signal
GRAD, LOSS, UPDATE, PARAM = 0, 1, 2, 3
N_FIXED = 4
FIXED_NAMES = ("grad_norm", "loss", "update_norm", "param_norm")
LAYER = "grad_norm/"  # a layer's channel is "grad_norm/<layer>"
USER = "user/"  # a user's own run-level signal (``Watcher.report``; a log column ``earlywarn/user/<name>``)
# user signals with a rule of their own and no channel: the attention logits (earlywarn.attention)
# grow by design through a warm-up, and a relative rule on them warned on healthy runs
OWN_RULE = (USER + ATTENTION_SIGNAL,)


def tracked_user(key: str) -> bool:
    """``key`` is a user signal the detector gives a channel (not one of :data:`OWN_RULE`'s)."""
    return key.startswith(USER) and not key.startswith(OWN_RULE)


# rows of DetectorState.stats
MU, SCALE, COUNT, STREAK, GROW, PREV, CUSUM, WIDTH = range(8)
N_ROWS = 8
# which signals a step gave (DetectorState.pattern): bits of the fixed channels, the layers, the
# LR, then one bit per user signal from USER_BIT up (the next ones: 128, 256, ...)
PATTERN_BITS = ((1, GRAD), (2, LOSS), (4, UPDATE), (8, PARAM))
LAYERS_BIT, LR_BIT, USER_BIT = 16, 32, 64
EXTRAS = ("update_norm", "param_norm", "loss_scale", "lr")  # the Observation.extras the detector reads by name
SCORE_CAP = 1000.0  # score of a non-finite step (metrics backends dislike inf)
STATE_VERSION = 3
BIG = 1 << 30  # "never" for step counters
NAN = float("nan")


class StateField(NamedTuple):
    """One field of the detector's state.

    ``kind`` says how it is stored and carried: ``int`` / ``float`` / ``bool`` are scalars (the
    working state holds them as attributes of the same name); ``names`` is the channel tuple;
    ``stats`` the ``(N_ROWS, channels)`` float array of per-channel statistics; ``dev`` a
    ``(channels,)`` float array or None; ``ring`` a tuple of ``lr_ref_steps`` floats; ``positions``
    a tuple of layer positions."""

    name: str
    kind: str
    default: Any
    doc: str


_REQUIRED = object()

STATE_FIELDS: tuple[StateField, ...] = (
    StateField("step", "int", _REQUIRED, "the latest step seen (-1: none yet)"),
    StateField("channels", "names", _REQUIRED, "the fixed channels (FIXED_NAMES), the layers, the user signals"),
    StateField("stats", "stats", _REQUIRED, "per-channel rows MU, SCALE, COUNT, STREAK, GROW, PREV, CUSUM, WIDTH"),
    StateField("dev", "dev", None, "the latest log-deviation per channel (NaN or 0 where absent)"),
    StateField("joint", "float", 0.0, "the together evidence of the gradient and the loss"),
    StateField("pattern", "int", -1, "which signals the latest step gave (PATTERN_BITS, LAYERS_BIT, ...)"),
    StateField("fast", "bool", False, "the next step may take the calm path"),
    StateField("episode", "bool", False, "some gradient signal is (or just was) elevated"),
    StateField("ep_start", "int", -1, "the episode's first step"),
    StateField("ep_peak_step", "int", -1, "the episode's highest step"),
    StateField("ep_peak_chan", "int", -1, "the channel that peaked"),
    StateField("ep_peak_dev", "float", 0.0, "its log-deviation at the peak"),
    StateField("ep_first_layer", "int", -1, "the channel of the layer that moved first"),
    StateField("ep_warned", "bool", False, "the episode raised a warning (no spike info at its end)"),
    StateField("since_warn", "int", BIG, "steps since the last warning"),
    StateField("loss_div", "int", 0, "consecutive steps at or above the divergence threshold"),
    StateField("loss_div_fired", "bool", False, "this divergence was reported"),
    StateField("loss_shift", "float", 0.0, "the loss channel tracks log(loss + loss_shift); > 0 after a loss <= 0"),
    StateField("lr_ring", "ring", (), "the last lr_ref_steps learning rates (a ring)"),
    StateField("lr_pos", "int", 0, "the ring's oldest slot (the next one written)"),
    StateField("lr_n", "int", 0, "learning rates seen"),
    StateField("lr_ref", "float", 0.0, "the highest LR of the steps at least lr_ref_steps back"),
    StateField("outliers", "int", 0, "consecutive outlier gradients (GRAD_OUTLIER)"),
    StateField("loss_first", "float", NAN, "the first finite loss (the prior of the first steps)"),
    StateField("init_high", "int", 0, "consecutive early steps far above the first loss"),
    StateField("init_warned", "bool", False, "the early rule has warned"),
    StateField("nonfinite", "int", 0, "consecutive non-finite-gradient steps"),
    StateField("overflow", "int", 0, "consecutive loss-scaler overflows"),
    StateField("loss_scale", "float", NAN, "the latest loss-scale reading"),
    StateField("scale_pending", "bool", False, "an overflow was seen before the scale reading dropped"),
    StateField("score_cap", "bool", False, "the latest step was non-finite"),
    StateField("level", "int", 0, "the worst level raised at the latest step"),
    StateField("hot", "bool", False, "some STREAK / GROW / PREV entry is non-zero"),
    StateField("absent", "positions", (), "layers (by position) reporting 0 under the pattern"),
    StateField("absent_since", "positions", (), "the step each of them went absent (aligned with absent)"),
)
SCALARS = tuple(f.name for f in STATE_FIELDS if f.kind in ("int", "float", "bool"))
"""The scalar fields: attributes of the working state under the same names."""

_FROM = {  # a saved value -> the field's type
    "int": int, "float": float, "bool": bool,
    "names": lambda v: tuple(str(c) for c in v),
    "stats": lambda v: np.array(v, dtype=np.float64),
    "dev": lambda v: None if v is None else np.array(v, dtype=np.float64),
    "ring": lambda v: tuple(float(x) for x in v),
    "positions": lambda v: tuple(int(i) for i in v),
}
_TO = {  # the field -> a saved value (arrays copied: a saved state never aliases a live one)
    "names": list,
    "stats": np.copy,
    "dev": lambda v: None if v is None else v.copy(),
}

_StateTuple = namedtuple("DetectorState", [f.name for f in STATE_FIELDS],  # type: ignore[misc]
                         defaults=[f.default for f in STATE_FIELDS if f.default is not _REQUIRED])


class DetectorState(_StateTuple):
    """Everything the detector remembers (a snapshot: ``update`` returns a new one); its fields
    are :data:`STATE_FIELDS`.

    ``stats`` is an ``(8, channels)`` float array with rows ``MU`` (baseline, log), ``SCALE``
    (robust scale, log units, floored), ``COUNT`` (values admitted; counting stops at maturity),
    ``STREAK`` (consecutive elevated steps), ``GROW`` (consecutive elevated steps, each above the
    last by the growth factor), ``PREV`` (last elevated log-deviation), ``CUSUM`` (one-sided
    cumulative sum of ``z - drift_k``, run-level channels only; 0 for layers) and ``WIDTH``
    (``admit_z * scale``, the form the detector keeps the scale in; ``SCALE`` is derived from
    it).
    """

    __slots__ = ()

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(c[len(LAYER):] for c in self.channels[N_FIXED:] if not c.startswith(USER))

    @property
    def user_names(self) -> tuple[str, ...]:
        """The user signals, as ``"user/<name>"`` (the channels after the layers)."""
        return tuple(c for c in self.channels[N_FIXED:] if c.startswith(USER))

    @property
    def score(self) -> float:
        """Largest robust z above baseline at the latest step (see StreamingDetector.score)."""
        if self.score_cap:
            return SCORE_CAP
        dev = self.dev
        if dev is None or dev.size == 0:
            return 0.0
        m = float(np.fmax.reduce(dev / self.stats[SCALE]))  # NaN (absent) ignored
        return m if m > 0.0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: _TO.get(f.kind, _same)(getattr(self, f.name)) for f in STATE_FIELDS}
        d["version"] = STATE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DetectorState":
        if int(d.get("version", STATE_VERSION)) != STATE_VERSION:
            raise ValueError(f"detector state version {d.get('version')} is not {STATE_VERSION} "
                             "(saved by an older earlywarn; start the detector afresh)")
        missing = [f.name for f in STATE_FIELDS if f.default is _REQUIRED and f.name not in d]
        if missing:
            raise ValueError(f"detector state: no {', '.join(missing)}; pass a dict from DetectorState.to_dict()")
        kw = {f.name: _FROM[f.kind](d[f.name]) for f in STATE_FIELDS if f.name in d}
        n = len(kw["channels"])
        if kw["stats"].shape != (N_ROWS, n):
            raise ValueError(f"detector state: stats shape {kw['stats'].shape} does not match {n} channels")
        if kw.get("dev") is not None and kw["dev"].shape != (n,):
            raise ValueError(f"detector state: dev shape {kw['dev'].shape} does not match {n} channels")
        return cls(**kw)


def _same(v: Any) -> Any:
    return v


def user_channel(name: str) -> str:
    """The channel (and ``Observation.extras`` key) of a user signal: ``"user/<name>"``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a user signal needs a non-empty name, got {name!r}")
    name = name.strip()
    return name if name.startswith(USER) and len(name) > len(USER) else USER + name


def with_user_signals(state: DetectorState, names: Sequence[str], scale0: float, admit_z: float) -> DetectorState:
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
    dev = None if state.dev is None else np.concatenate([state.dev, np.full(k, NAN)])
    return state._replace(channels=state.channels + names, stats=stats, dev=dev)


def loss_shift_for(loss: float, shift: float) -> float:
    """The offset that makes ``loss + offset`` comfortably positive: a power of two at least
    ``1 + 2 |loss|`` and at least twice the old one (so it changes rarely, and never back)."""
    need = 1.0 + 2.0 * abs(loss)
    return max(2.0 * shift, 2.0 ** math.ceil(math.log2(need)))
