"""Replay logged values through the same detector (and policy) the live hook uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

import numpy as np

from earlywarn.detect.config import DetectorConfig
from earlywarn.detect.detector import StreamingDetector
from earlywarn.detect.observation import Observation, StepColumns
from earlywarn.events import Event, Level

if TYPE_CHECKING:  # policy is pure too, but detect must not need it to import
    from earlywarn.policy import Action, Policy


@dataclass
class ReplayResult:
    """What a replay produced: every alert, the policy's actions per step, and (when asked for)
    the score trace."""

    alerts: list[Event] = field(default_factory=list)
    actions: list[tuple[int, list["Action"]]] = field(default_factory=list)
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def first(self, level: Level | str = Level.WARNING) -> Event | None:
        """The first alert at ``level`` or worse, if any."""
        lv = Level.parse(level)
        return next((a for a in self.alerts if a.level >= lv), None)

    def at_least(self, level: Level | str) -> list[Event]:
        lv = Level.parse(level)
        return [a for a in self.alerts if a.level >= lv]


def observations_from_arrays(
    steps: Sequence[int] | np.ndarray,
    grad_norm: Sequence[float] | np.ndarray | None = None,
    loss: Sequence[float] | np.ndarray | None = None,
    layer_norms: np.ndarray | None = None,
    layer_nonfinite: np.ndarray | None = None,
    skipped: Sequence[bool] | np.ndarray | None = None,
    extras: Mapping[str, Sequence[float] | np.ndarray] | None = None,
) -> Iterator[Observation]:
    """One :class:`Observation` per row of logged columns.

    Values are passed through as they are: a NaN in ``grad_norm`` or ``loss`` is a non-finite
    value, not a missing one (a reader that knows a value was not logged should drop the row or
    build the Observation with ``None``). A NaN in an ``extras`` column means "not logged"."""
    ex = {}
    for k, col in (extras or {}).items():
        col = np.asarray(col, dtype=np.float64)
        ex[k] = (col, col == col)  # NaN in an extras column means "not logged"
    cols = StepColumns(
        step=np.asarray(steps), grad_norm=None if grad_norm is None else np.asarray(grad_norm, dtype=np.float64),
        loss=None if loss is None else np.asarray(loss, dtype=np.float64), layer_norms=layer_norms,
        layer_nonfinite=layer_nonfinite, skipped=None if skipped is None else np.asarray(skipped, dtype=bool),
        extras=ex)
    for i in range(len(cols)):
        yield cols.observation(i)


def replay(
    observations: Iterable[Observation],
    detector: StreamingDetector | None = None,
    policy: "Policy | None" = None,
    *,
    cfg: DetectorConfig | None = None,
    layer_names: Sequence[str] = (),
    baseline: Mapping[str, float] | None = None,
    scores: bool = False,
) -> ReplayResult:
    """Feed ``observations`` in order to ``detector`` (a new one from ``cfg`` / ``layer_names`` /
    ``baseline`` if not given) and, when given, ``policy``; exactly the calls the live hook makes.
    ``scores=True`` also records the score of every step (``ReplayResult.scores``)."""
    sd = detector if detector is not None else StreamingDetector(cfg, layer_names, baseline)
    out = ReplayResult()
    steps: list[int] = []
    trace: list[float] = []
    for obs in observations:
        alerts = sd.observe(obs)
        if alerts:
            out.alerts.extend(alerts)
        if policy is not None:
            acts = policy.decide(obs.step, alerts)
            if acts:
                out.actions.append((obs.step, acts))
        steps.append(obs.step)
        if scores:
            trace.append(sd.score)
    out.steps = np.asarray(steps, dtype=np.int64)
    out.scores = np.asarray(trace)
    return out
