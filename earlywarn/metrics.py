"""The flat scalar metrics earlywarn sends to trackers, all under one prefix (``earlywarn/``).

Pure: numpy only, no torch, no tracker SDK. One call per step turns what the guard and the
detector know into a ``dict[str, float]`` that every sink can log as-is.

=====================================  =========================================================
key                                    meaning
=====================================  =========================================================
``earlywarn/grad_norm``                global L2 norm of the unscaled gradient (NaN/Inf kept;
                                       see docs/trackers.md for what each tracker stores)
``earlywarn/grad_norm_finite``         1 when the gradient norm is finite, 0 when NaN/Inf
``earlywarn/loss``                     training loss seen by the guard
``earlywarn/loss_finite``              1 when the loss is finite, 0 when NaN/Inf
``earlywarn/instability_score``        detector score (0 = calm; grows with the evidence)
``earlywarn/alert_level``              worst level of the step's alerts and incidents (detector
                                       alerts, skip, repair, rewind, quarantine, halt): 0 none,
                                       1 info, 2 warning, 3 critical
``earlywarn/skipped_steps``            optimizer steps skipped so far (cumulative)
``earlywarn/repaired_steps``           repairs of poisoned optimizer state so far (cumulative)
``earlywarn/rewinds``                  rewinds to a snapshot so far (cumulative)
``earlywarn/checkpoints``              checkpoints written by earlywarn so far, periodic ones
                                       included (cumulative)
``earlywarn/nonfinite_layers``         layers whose gradient norm is NaN/Inf this step
``earlywarn/layer_grad_norm/<layer>``  per-layer gradient norm, every ``layer_every`` steps (all
                                       layers, or the ``layer_top_k`` largest), on alert steps,
                                       and always for non-finite layers
``earlywarn/user/<name>``              a scalar of the user's own (``Watcher.report``), at the
                                       steps it was reported
=====================================  =========================================================

Any other counter the guard keeps (``nonfinite_steps``, ``alerts_<level>``) is logged under its
own name.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from earlywarn.events import ALERT_KINDS, Kind

COUNTERS = ("skipped_steps", "repaired_steps", "rewinds", "checkpoints")
"""Cumulative counters always logged (0 until something happens), so alert rules have a series."""

_NOT_LOGGED = frozenset({"steps"})  # the step itself is the x-axis of every series

INCIDENT_KINDS = frozenset(str(k) for k in ALERT_KINDS | {Kind.SKIP, Kind.CLIP, Kind.REPAIR, Kind.REWIND,
                                                         Kind.NO_REWIND, Kind.LR_HOLD, Kind.QUARANTINE, Kind.HALT})
"""Event kinds that count toward ``alert_level``: detector alerts and the actions they caused.
Checkpoint, resume, learning-rate release and sink-status records do not (they are bookkeeping,
not alerts)."""


class StepLevels:
    """The worst level of the incidents since the last logged row: ``alert_level`` of that row.

    The watcher notes every event as it is emitted and takes the level when it logs a step's
    row, so the level is the step's own (a rewind that restores the detector cannot reset it).
    An incident emitted after its step's row was logged (the end-of-step scan of recovery) is
    carried into the next row rather than lost. ``halted`` marks a step whose row was never
    logged because a ``Halt`` ended it; ``flush`` logs that row.
    """

    __slots__ = ("level", "step", "halted")

    def __init__(self) -> None:
        self.level = 0
        self.step: int | None = None
        self.halted = False

    def note(self, kind: Any, level: int, step: int) -> None:
        if str(kind) not in INCIDENT_KINDS:
            return
        if int(level) > self.level:
            self.level = int(level)
        self.step = step if self.step is None else max(self.step, step)
        if str(kind) == "halt":
            self.halted = True

    def take(self) -> int:
        """The level for the row being logged now; resets for the next row."""
        level, self.level, self.step, self.halted = self.level, 0, None, False
        return level

# MLflow accepts alphanumerics, "_", "-", ".", " ", ":" and "/" in metric names (and W&B accepts
# the same). Everything else becomes "_"; "." path components and "//" are refused by MLflow too.
_BAD_CHARS = re.compile(r"[^/\w.\- :]")
_MAX_KEY_LEN = 250  # MLflow's limit on a metric name


def sanitize_key(key: str) -> str:
    """Make ``key`` a metric name MLflow accepts (and W&B shows the same way).

    Disallowed characters become ``_``; empty, ``.`` and ``..`` path components are removed so the
    name does not normalise to another one; names longer than 250 characters are shortened.
    """
    key = _BAD_CHARS.sub("_", str(key))
    parts = [p for p in key.split("/") if p not in ("", ".", "..")]
    key = "/".join(parts) or "_"
    if len(key) > _MAX_KEY_LEN:
        key = key[: _MAX_KEY_LEN - 9] + "_" + format(zlib.crc32(key.encode()), "08x")  # stable across runs
    return key


@dataclass
class MetricsConfig:
    """What :func:`build_metrics` emits and how often."""

    layer_every: int = 10
    """Log per-layer norms every ``layer_every`` steps (1: every step; 0: only on alert steps and
    for non-finite layers). A tracker server sustains ~5-7k values/s, so 200 layers every step
    is too much for MLflow at fast step rates."""
    layer_top_k: int | None = None
    """With many layers, log only the ``k`` largest per-layer norms on a layer step (non-finite
    layers always come first). ``None``: all layers."""
    layer_on_alert: bool = True
    """Also log per-layer norms at any step whose alert level is warning or worse."""
    prefix: str = "earlywarn/"
    """Prefix of every key; must be a valid metric name ending in ``/``."""

    def __post_init__(self) -> None:
        if isinstance(self.layer_every, bool) or not isinstance(self.layer_every, int) or self.layer_every < 0:
            raise ValueError(
                f"MetricsConfig.layer_every={self.layer_every!r}: use an int >= 0 "
                "(1 logs per-layer norms every step, 0 only on alerts)"
            )
        if self.layer_top_k is not None and (
            isinstance(self.layer_top_k, bool) or not isinstance(self.layer_top_k, int) or self.layer_top_k < 1
        ):
            raise ValueError(
                f"MetricsConfig.layer_top_k={self.layer_top_k!r}: use None (all layers) or an int >= 1"
            )
        if not isinstance(self.prefix, str) or not self.prefix.endswith("/") or (
            sanitize_key(self.prefix) + "/" != self.prefix
        ):
            raise ValueError(
                f"MetricsConfig.prefix={self.prefix!r}: use a metric-name-safe prefix ending in '/', "
                f"e.g. 'earlywarn/' or '{sanitize_key(str(self.prefix))}/'"
            )


@lru_cache(maxsize=64)
def _layer_keys(prefix: str, layer_names: tuple[str, ...]) -> tuple[str, ...]:
    # Cached: the same layer list comes every step, and sanitising 200 names is not free.
    keys: list[str] = []
    seen: set[str] = set()
    for name in layer_names:
        key = sanitize_key(f"{prefix}layer_grad_norm/{name}")
        base, n = key, 1
        while key in seen:  # two names that sanitise alike must not overwrite each other
            n += 1
            key = f"{base}_{n}"
        seen.add(key)
        keys.append(key)
    return tuple(keys)


def _select_layers(norms: np.ndarray, layer_step: bool, top_k: int | None) -> np.ndarray:
    """Indices of the layers to log this step: non-finite first, then the largest norms."""
    nonfinite = np.flatnonzero(~np.isfinite(norms))
    if not layer_step:
        return nonfinite
    n = norms.shape[0]
    if top_k is None or top_k >= n:
        return np.arange(n)
    finite_norms = np.where(np.isfinite(norms), norms, -np.inf)
    k = max(top_k - nonfinite.size, 0)
    top = np.argpartition(finite_norms, n - k)[n - k :] if k else np.empty(0, dtype=np.intp)
    top = top[np.isfinite(norms[top])]
    return np.concatenate([nonfinite, top[np.argsort(-norms[top], kind="stable")]])


def _num(x: float | None) -> float | None:
    return None if x is None else float(x)


@lru_cache(maxsize=256)
def _counter_key(prefix: str, name: str) -> str:
    return sanitize_key(prefix + name)


def build_metrics(
    step: int,
    *,
    grad_norm: float | None,
    loss: float | None,
    layer_names: Sequence[str] | None,
    layer_norms: np.ndarray | None,
    score: float | None,
    level: int,
    counters: Mapping[str, int],
    config: MetricsConfig | None = None,
    user: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """One step's flat metrics (see the module docstring for the keys).

    ``None`` inputs are left out (not logged as 0: a missing value is not a calm value).
    ``counters`` holds cumulative counts; the four in :data:`COUNTERS` are always present (0 when
    absent) and any other counter is logged under its own (sanitised) name.
    """
    cfg = config or _DEFAULT_CONFIG
    p = cfg.prefix
    out: dict[str, float] = {}
    if (v := _num(grad_norm)) is not None:
        out[p + "grad_norm"] = v
        out[p + "grad_norm_finite"] = 1.0 if math.isfinite(v) else 0.0
    if (v := _num(loss)) is not None:
        out[p + "loss"] = v
        out[p + "loss_finite"] = 1.0 if math.isfinite(v) else 0.0
    if (v := _num(score)) is not None:
        out[p + "instability_score"] = v
    out[p + "alert_level"] = float(int(level))
    for name in COUNTERS:
        out[p + name] = float(counters.get(name, 0))
    for name, value in counters.items():
        if name not in COUNTERS and name not in _NOT_LOGGED:
            out[_counter_key(p, name)] = float(value)
    for name, value in (user or {}).items():  # the user's own signals (Watcher.report)
        out[_counter_key(p, f"user/{name}")] = float(value)

    if layer_norms is not None:
        norms = np.asarray(layer_norms, dtype=np.float64).reshape(-1)
        names = tuple(layer_names) if layer_names is not None else tuple(str(i) for i in range(norms.size))
        if len(names) != norms.size:
            raise ValueError(
                f"build_metrics: {len(names)} layer_names for {norms.size} layer_norms; pass one name per layer"
            )
        # One sum tells a finite step (the common case) without per-element work.
        all_finite = math.isfinite(float(norms.sum()))
        out[p + "nonfinite_layers"] = 0.0 if all_finite else float(np.count_nonzero(~np.isfinite(norms)))
        layer_step = (cfg.layer_every > 0 and step % cfg.layer_every == 0) or (
            cfg.layer_on_alert and int(level) >= 2
        )
        if not layer_step and all_finite:
            return out
        idx = _select_layers(norms, layer_step, cfg.layer_top_k)
        if idx.size:
            keys = _layer_keys(p, names)
            values = norms.tolist()
            if idx.size == norms.size:
                out.update(zip(keys, values))
            else:
                for i in idx.tolist():
                    out[keys[i]] = values[i]
    return out


_DEFAULT_CONFIG = MetricsConfig()


class StepMetrics(Mapping[str, float]):
    """One step's metrics, built on first use: what the watcher hands to every sink.

    The training thread only keeps the step's inputs (the counters copied, the per-layer norms by
    reference: a fresh array every step); :func:`build_metrics` runs when a sink first reads a
    key, which for tracker sinks is on their background thread. A sink that ignores metrics
    costs nothing. Reads like the ``dict`` :func:`build_metrics` returns (``dict(m)`` copies it).
    """

    __slots__ = ("step", "_args", "_built")

    def __init__(self, step: int, *, grad_norm: float | None, loss: float | None, layer_names: Sequence[str] | None,
                 layer_norms: np.ndarray | None, score: float | None, level: int, counters: Mapping[str, int],
                 config: MetricsConfig | None = None, user: Mapping[str, float] | None = None):
        self.step = int(step)
        self._args = (grad_norm, loss, layer_names, layer_norms, score, int(level), dict(counters),
                      config or _DEFAULT_CONFIG, dict(user) if user else None)
        self._built: dict[str, float] | None = None

    def _dict(self) -> dict[str, float]:
        built = self._built
        if built is None:
            grad_norm, loss, names, norms, score, level, counters, cfg, user = self._args
            built = self._built = build_metrics(self.step, grad_norm=grad_norm, loss=loss, layer_names=names,
                                                layer_norms=norms, score=score, level=level, counters=counters,
                                                config=cfg, user=user)
        return built

    def __getitem__(self, key: str) -> float:
        return self._dict()[key]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __repr__(self) -> str:
        return f"StepMetrics(step={self.step}, {self._dict()!r})"
