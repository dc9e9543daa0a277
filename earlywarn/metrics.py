"""The flat scalar metrics earlywarn sends to trackers, all under one prefix (``earlywarn/``).

Pure: numpy only, no torch, no tracker SDK. One call per step turns what the guard and the
detector know into a ``dict[str, float]`` that every sink can log as-is.

=====================================  =========================================================
key                                    meaning
=====================================  =========================================================
``earlywarn/grad_norm``                global L2 norm of the unscaled gradient (NaN/Inf kept)
``earlywarn/loss``                     training loss seen by the guard
``earlywarn/instability_score``        detector score (0 = calm; grows with the evidence)
``earlywarn/alert_level``              worst alert level this step: 0 none, 1 info, 2 warning,
                                       3 critical
``earlywarn/skipped_steps``            optimizer steps skipped so far (cumulative)
``earlywarn/repaired_steps``           steps whose gradient was repaired so far (cumulative)
``earlywarn/rewinds``                  rewinds to a snapshot so far (cumulative)
``earlywarn/checkpoints``              checkpoints written by earlywarn so far (cumulative)
``earlywarn/nonfinite_layers``         layers whose gradient norm is NaN/Inf this step
``earlywarn/layer_grad_norm/<layer>``  per-layer gradient norm, every ``layer_every`` steps (all
                                       layers, or the ``layer_top_k`` largest), on alert steps,
                                       and always for non-finite layers
``earlywarn/user/<name>``              a scalar of the user's own (``Watcher.report``), at the
                                       steps it was reported
=====================================  =========================================================
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np

COUNTERS = ("skipped_steps", "repaired_steps", "rewinds", "checkpoints")
"""Cumulative counters always logged (0 until something happens), so alert rules have a series."""

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
    if (v := _num(loss)) is not None:
        out[p + "loss"] = v
    if (v := _num(score)) is not None:
        out[p + "instability_score"] = v
    out[p + "alert_level"] = float(int(level))
    for name in COUNTERS:
        out[p + name] = float(counters.get(name, 0))
    for name, value in counters.items():
        if name not in COUNTERS:
            out[sanitize_key(p + name)] = float(value)
    for name, value in (user or {}).items():  # the user's own signals (Watcher.report)
        out[sanitize_key(f"{p}user/{name}")] = float(value)

    if layer_norms is not None:
        norms = np.asarray(layer_norms, dtype=np.float64).reshape(-1)
        names = tuple(layer_names) if layer_names is not None else tuple(str(i) for i in range(norms.size))
        if len(names) != norms.size:
            raise ValueError(
                f"build_metrics: {len(names)} layer_names for {norms.size} layer_norms; pass one name per layer"
            )
        out[p + "nonfinite_layers"] = float(np.count_nonzero(~np.isfinite(norms)))
        layer_step = (cfg.layer_every > 0 and step % cfg.layer_every == 0) or (
            cfg.layer_on_alert and int(level) >= 2
        )
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
