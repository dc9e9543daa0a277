"""The one record every part of earlywarn speaks: an :class:`Event`.

Detectors emit alerts as events, the guard emits skips, recovery emits repairs, checkpoints and
rewinds, and every sink (console, JSONL, MLflow, W&B, webhook) consumes the same record. Pure
Python: no torch, no numpy.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping


class Level(enum.IntEnum):
    """Severity, ordered so that ``max(levels)`` is the worst."""

    NONE = 0
    INFO = 1
    """Worth knowing, nothing to do: an isolated spike that recovered, a loss-scale overflow."""
    WARNING = 2
    """Collapse risk (escalating or sustained growth), an outlier gradient, a loss far above its level."""
    CRITICAL = 3
    """Non-finite gradient or loss, poisoned state, a rewind or a halt: earlywarn acted on a broken run."""

    @classmethod
    def parse(cls, value: "Level | str | int") -> "Level":
        if isinstance(value, Level):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        names = ", ".join(l.name.lower() for l in cls)
        raise ValueError(f"unknown level {value!r}: use one of {names}")

    def __str__(self) -> str:  # "warning", as written in JSON and shown to people
        return self.name.lower()


class Kind(str, enum.Enum):
    """What happened. Alerts come from the detector; the rest are actions and their results."""

    # detector alerts
    NONFINITE_GRAD = "nonfinite_grad"
    GRAD_SPIKE = "grad_spike"
    GRAD_OUTLIER = "grad_outlier"
    COLLAPSE_RISK = "collapse_risk"
    LOSS_NONFINITE = "loss_nonfinite"
    LOSS_DIVERGED = "loss_diverged"
    SCALER_OVERFLOW = "scaler_overflow"
    # actions and their outcomes (one kind per thing: docs/trackers.md lists each kind's values)
    SKIP = "skip"
    CLIP = "clip"
    REPAIR = "repair"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FAILED = "checkpoint_failed"
    REWIND = "rewind"
    NO_REWIND = "no_rewind"
    LR_HOLD = "lr_hold"
    LR_RELEASE = "lr_release"
    QUARANTINE = "quarantine"
    HALT = "halt"
    RESUME = "resume"
    # sinks reporting on themselves (dropped metrics, a tracker that is down)
    SINK = "sink"

    def __str__(self) -> str:
        return self.value


ALERT_KINDS = frozenset({Kind.NONFINITE_GRAD, Kind.GRAD_SPIKE, Kind.GRAD_OUTLIER, Kind.COLLAPSE_RISK,
                         Kind.LOSS_NONFINITE, Kind.LOSS_DIVERGED, Kind.SCALER_OVERFLOW})
"""Kinds the detector emits (what happened); every other kind is an action or its outcome."""


DRY_RUN = "would have (dry run): "
"""How an event of ``watch(dry_run=True)`` opens: what earlywarn would have done and did not (its
``values["dry_run"]`` is 1.0)."""


def jsonable(x: Any) -> Any:
    """``x`` as JSON can hold it: a NaN / inf float becomes its string (nothing is silently lost)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclass(frozen=True)
class Event:
    """One thing that happened at one optimizer step.

    ``layers`` is ordered: the first entry is the layer that moved first (for a non-finite
    gradient, the first one in backward order). ``batch`` is the data position of the batch that
    produced the step when earlywarn knows it (a resumable loader), else the step's batch counter.
    ``path`` is where a CHECKPOINT event's state is (a file, or ``memory:<step>`` for an in-memory
    snapshot); ``source`` names the watcher that emitted it when a process has several (a GAN's
    generator and discriminator).
    """

    step: int
    kind: Kind
    level: Level
    message: str
    signal: str | None = None
    layers: tuple[str, ...] = ()
    values: Mapping[str, float] = field(default_factory=dict)
    batch: int | None = None
    time: float = field(default_factory=time.time)
    path: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        object.__setattr__(self, "level", Level.parse(self.level))
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def layer(self) -> str | None:
        """The layer that moved first, if any."""
        return self.layers[0] if self.layers else None

    @property
    def title(self) -> str:
        """A short title (< 64 characters, what W&B alerts want)."""
        where = f" in {self.layer}" if self.layer else ""
        text = f"earlywarn {self.level}: {self.kind}{where} @ step {self.step}"
        return text if len(text) < 64 else text[:60] + "..."

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": str(self.kind),
            "level": str(self.level),
            "message": self.message,
            "signal": self.signal,
            "layers": list(self.layers),
            "values": {k: jsonable(float(v)) for k, v in self.values.items()},
            "batch": self.batch,
            "time": self.time,
            "path": self.path,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Event":
        values = {k: float(v) for k, v in (d.get("values") or {}).items()}
        return cls(
            step=int(d["step"]),
            kind=Kind(d["kind"]),
            level=Level.parse(d["level"]),
            message=str(d["message"]),
            signal=d.get("signal"),
            layers=tuple(d.get("layers") or ()),
            values=values,
            batch=d.get("batch"),
            time=float(d.get("time", 0.0)),
            path=d.get("path"),
            source=d.get("source"),
        )

    def __str__(self) -> str:
        return f"[earlywarn {self.level.name}] step {self.step}: {self.message}"
