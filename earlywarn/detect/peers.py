"""The detection rules other systems use, re-implemented from their published code for comparison.

Each rule is a small class with the shape of :class:`earlywarn.detect.StreamingDetector`:
``observe(obs) -> list[Event]`` (an event whenever the rule fires), ``reset()``, and
``state_dict()`` / ``load_state_dict()``. The rules are reproduced *as published*, holes included
(a NaN poisons ZClip's EMA; NaNs and spikes enter OLMo-core's window), because the point is to
measure them. Pure Python + numpy.

- :class:`NanLossCheck`: the universal ``if not isfinite(loss)`` check.
- :class:`NonfiniteGradCheck`: the fp16 loss scaler's check (any NaN/Inf in the gradient), which a
  bf16 run without a scaler no longer has.
- :class:`OlmoSkipStep`: OLMo-core ``SkipStepOptimizer.get_step_factor`` (window 128, 6 sigma,
  on both the loss and the total grad norm; inactive for the first ``max(20, 128 // 2)`` steps).
- :class:`ZClipRule`: ZClip (``zclip`` package, ``mode="zscore"``, ``clip_option="adaptive_scaling"``):
  EMA mean/variance (alpha 0.97) initialised from 25 warm-up norms; z > 2.5 is a spike; the EMA is
  then updated with the clipped norm.
- :class:`KillLossSpike`: LLM Foundry ``KillLossSpike`` (loss >= 2x the mean of a full window of
  100 (or 5% of the run) for more than 4 consecutive steps; or half the window above a loss cap).
- :class:`LightningSpikeDetection`: Lightning Fabric ``SpikeDetection`` (``lightning.fabric.utilities.spike``,
  defaults ``window=10, warmup=1, rtol=2.0, atol=None, finite_only=True``): a non-finite loss, or a
  loss that did not improve on the previous one and is at least ``rtol`` times the running mean of
  the last ``window`` non-spike losses away from it (``>= 3x`` the mean for a positive loss).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

import numpy as np

from earlywarn.detect.observation import Observation
from earlywarn.events import Event, Kind, Level

__all__ = ["NanLossCheck", "NonfiniteGradCheck", "OlmoSkipStep", "ZClipRule", "KillLossSpike",
           "LightningSpikeDetection", "PEERS"]


class _Rule:
    name = "rule"

    def observe(self, obs: Observation) -> list[Event]:  # pragma: no cover - interface
        raise NotImplementedError

    def reset(self) -> None:
        self.load_state_dict(type(self)(**self._kwargs).state_dict())

    def _event(self, obs: Observation, kind: Kind, signal: str, value: float, baseline: float,
               message: str) -> Event:
        ratio = value / baseline if baseline and math.isfinite(baseline) and baseline != 0 else math.nan
        return Event(step=int(obs.step), kind=kind, level=Level.WARNING, signal=signal,
                     message=f"[{self.name}] {message}",
                     values={"value": float(value), "baseline": float(baseline), "ratio": float(ratio)},
                     batch=obs.batch)


class NanLossCheck(_Rule):
    """Fires when the loss is NaN or infinite (what most training loops check, if anything)."""

    name = "nan-loss"

    def __init__(self) -> None:
        self._kwargs: dict[str, Any] = {}

    def observe(self, obs: Observation) -> list[Event]:
        if obs.loss is not None and not math.isfinite(obs.loss):
            return [self._event(obs, Kind.LOSS_NONFINITE, "loss", obs.loss, math.nan,
                                f"loss is {obs.loss}")]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        pass


class NonfiniteGradCheck(_Rule):
    """Fires when any gradient value is NaN or infinite (the global norm, a layer's norm or a
    layer's non-finite flag), as ``GradScaler``'s ``found_inf`` does."""

    name = "non-finite grad"

    def __init__(self) -> None:
        self._kwargs: dict[str, Any] = {}

    def observe(self, obs: Observation) -> list[Event]:
        if not obs.grad_finite:
            g = math.nan if obs.grad_norm is None else float(obs.grad_norm)
            return [self._event(obs, Kind.NONFINITE_GRAD, "grad_norm", g, math.nan, "non-finite gradient")]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        pass


class OlmoSkipStep(_Rule):
    """OLMo-core's skip-step rule.

    Keeps the last ``window + 1`` losses and grad norms (every value, NaN and spikes included);
    once it holds ``max(20, window // 2)`` losses, the step is skipped when
    ``|x - mean| / std > sigma`` for the loss or the grad norm, ``mean``/``std`` (unbiased) over
    the window excluding the current value. A NaN makes the comparison fail, which skips too.
    """

    name = "OLMo-core SkipStep"

    def __init__(self, window: int = 128, sigma: float = 6.0) -> None:
        self._kwargs = {"window": window, "sigma": sigma}
        self.window, self.sigma = int(window), float(sigma)
        self.losses: deque[float] = deque(maxlen=self.window + 1)
        self.norms: deque[float] = deque(maxlen=self.window + 1)

    @staticmethod
    def _ok(values: deque, sigma: float) -> bool:
        hist = np.fromiter(values, dtype=np.float64, count=len(values))
        cur, hist = hist[-1], hist[:-1]
        if hist.size < 2:
            return True
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            z = abs(cur - hist.mean()) / hist.std(ddof=1)
        return bool(z <= sigma)  # NaN -> False: skip, as torch's comparison does

    def observe(self, obs: Observation) -> list[Event]:
        if obs.loss is None:
            return []
        self.losses.append(float(obs.loss))
        if obs.grad_norm is not None:
            self.norms.append(float(obs.grad_norm))
        if len(self.losses) < max(20, self.window // 2):
            return []
        if not self._ok(self.losses, self.sigma):
            base = float(np.mean(list(self.losses)[:-1]))
            return [self._event(obs, Kind.LOSS_DIVERGED, "loss", obs.loss, base,
                                f"loss {obs.loss:.4g} beyond {self.sigma:g} sigma of the last {self.window}: skip step")]
        if obs.grad_norm is not None and len(self.norms) >= 2 and not self._ok(self.norms, self.sigma):
            base = float(np.mean(list(self.norms)[:-1]))
            return [self._event(obs, Kind.GRAD_SPIKE, "grad_norm", obs.grad_norm, base,
                                f"grad norm {obs.grad_norm:.4g} beyond {self.sigma:g} sigma of the last {self.window}: skip step")]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.losses = deque((float(v) for v in d["losses"]), maxlen=self.window + 1)
        self.norms = deque((float(v) for v in d["norms"]), maxlen=self.window + 1)


class ZClipRule(_Rule):
    """ZClip's spike rule on the total grad norm (``zclip`` 1.0.0 defaults)."""

    name = "ZClip"

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25,
                 eps: float = 1e-6) -> None:
        self._kwargs = {"alpha": alpha, "z_thresh": z_thresh, "warmup_steps": warmup_steps, "eps": eps}
        self.alpha, self.z_thresh, self.warmup_steps, self.eps = alpha, z_thresh, warmup_steps, eps
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None

    def observe(self, obs: Observation) -> list[Event]:
        g = obs.grad_norm
        if g is None:
            return []
        g = float(g)
        if self.mean is None:
            self.buffer.append(g)
            if len(self.buffer) >= self.warmup_steps:
                m = sum(self.buffer) / len(self.buffer)
                self.mean, self.var = m, sum((v - m) ** 2 for v in self.buffer) / len(self.buffer)
                self.buffer = []
            return []
        std = self.var ** 0.5 if self.var >= 0 else math.nan
        z = (g - self.mean) / (std + self.eps)
        out: list[Event] = []
        clip_val = None
        if z > self.z_thresh:  # NaN compares False: a NaN norm is not even a spike
            eta = z / self.z_thresh
            clip_val = self.mean + (self.z_thresh * std) / eta
            out.append(self._event(obs, Kind.GRAD_SPIKE, "grad_norm", g, self.mean,
                                   f"grad norm z={z:.2f} > {self.z_thresh:g}: clip to {clip_val:.4g}"))
        eff = clip_val if clip_val is not None else g
        # as published: the mean is updated first, then the variance uses the new mean
        self.mean = self.alpha * self.mean + (1 - self.alpha) * eff
        self.var = self.alpha * self.var + (1 - self.alpha) * (eff - self.mean) ** 2
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": list(self.buffer), "mean": self.mean, "var": self.var}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.buffer = [float(v) for v in d["buffer"]]
        self.mean = None if d["mean"] is None else float(d["mean"])
        self.var = None if d["var"] is None else float(d["var"])


class KillLossSpike(_Rule):
    """LLM Foundry's KillLossSpike (``log_only`` mode: it reports, we count the reports).

    The window holds every loss; a loss is an outlier when ``>= outlier_multiplier * mean``;
    more than ``patience`` consecutive outliers fire. Otherwise, from step ``2 * window``, it fires
    when at least half the window is above ``loss_cap``. ``window = max(100, 5% of max_steps)``
    when the run length is known.
    """

    name = "KillLossSpike"

    def __init__(self, patience: int = 4, outlier_multiplier: float = 2.0, window: int = 100,
                 loss_cap: float = 10.0, max_steps: int | None = None) -> None:
        self._kwargs = {"patience": patience, "outlier_multiplier": outlier_multiplier,
                        "window": window, "loss_cap": loss_cap, "max_steps": max_steps}
        if max_steps:
            window = max(window, round(0.05 * max_steps))
        self.patience, self.mult, self.window, self.loss_cap = patience, outlier_multiplier, window, loss_cap
        self.losses: deque[float] = deque(maxlen=self.window)
        self.outliers = 0
        self.seen = 0

    def observe(self, obs: Observation) -> list[Event]:
        if obs.loss is None:
            return []
        loss = float(obs.loss)
        out: list[Event] = []
        if len(self.losses) == self.window:
            avg = float(np.mean(self.losses))
            fired = False
            if loss >= avg * self.mult:
                self.outliers += 1
                if self.outliers > self.patience:
                    fired = True
                    out.append(self._event(obs, Kind.LOSS_DIVERGED, "loss", loss, avg,
                                           f"loss >= {self.mult:g}x the window mean for {self.outliers} steps"))
            elif self.outliers > 0:
                self.outliers = 0
            if (not fired and self.seen >= 2 * self.window
                    and sum(v > self.loss_cap for v in self.losses) >= self.window / 2):
                out.append(self._event(obs, Kind.LOSS_DIVERGED, "loss", loss, avg,
                                       f"half the window above the loss cap {self.loss_cap:g}"))
        self.losses.append(loss)
        self.seen += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "outliers": self.outliers, "seen": self.seen}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.losses = deque((float(v) for v in d["losses"]), maxlen=self.window)
        self.outliers = int(d["outliers"])
        self.seen = int(d["seen"])


class LightningSpikeDetection(_Rule):
    """Lightning Fabric's ``SpikeDetection`` callback (it raises ``TrainingSpikeException``; here each
    firing is reported and training goes on, the spike kept out of the running mean as published)."""

    name = "Lightning SpikeDetection"

    def __init__(self, window: int = 10, warmup: int = 1, rtol: float | None = 2.0,
                 atol: float | None = None, finite_only: bool = True) -> None:
        self._kwargs = {"window": window, "warmup": warmup, "rtol": rtol, "atol": atol, "finite_only": finite_only}
        self.window, self.warmup, self.rtol, self.atol = int(window), int(warmup), rtol, atol
        self.finite_only = finite_only
        self.values: deque[float] = deque(maxlen=self.window)
        self.last_val = 0.0
        self.batch_idx = 0

    def _is_spike(self, loss: float) -> bool:
        running = sum(self.values) / len(self.values) if self.values else math.nan
        if self.finite_only and not math.isfinite(loss):
            return True
        if loss - self.last_val <= 0.0:  # mode "min": an improvement is never a spike
            return False
        ok_atol = self.atol is None or abs(loss - running) >= abs(self.atol)
        ok_rtol = self.rtol is None or abs(loss - running) >= abs(self.rtol * running)
        return bool(ok_atol and ok_rtol)

    def observe(self, obs: Observation) -> list[Event]:
        if obs.loss is None:
            return []
        loss = float(obs.loss)
        idx, self.batch_idx = self.batch_idx, self.batch_idx + 1
        if idx >= self.warmup and self._is_spike(loss):
            base = sum(self.values) / len(self.values) if self.values else math.nan
            return [self._event(obs, Kind.LOSS_DIVERGED, "loss", loss, base,
                                f"loss {loss:.4g} is a spike against the running mean of {len(self.values)}")]
        if self.finite_only or math.isfinite(loss):
            self.values.append(loss)
            self.last_val = loss
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "last_val": self.last_val, "batch_idx": self.batch_idx}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.values = deque((float(v) for v in d["values"]), maxlen=self.window)
        self.last_val = float(d["last_val"])
        self.batch_idx = int(d["batch_idx"])


PEERS = {
    "nan-loss": NanLossCheck,
    "nonfinite-grad": NonfiniteGradCheck,
    "olmo-skipstep": OlmoSkipStep,
    "zclip": ZClipRule,
    "killlossspike": KillLossSpike,
    "lightning-spike": LightningSpikeDetection,
}
"""Name -> class, for benchmarks and tests that run every peer side by side."""
