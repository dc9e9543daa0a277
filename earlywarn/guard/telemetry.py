"""What a watcher tells the world: events, counters and per-step metrics, on one clock.

Two clocks exist and only one is ever shown. The *training step* (``ew.step``) is where the model
is: a rewind sets it back to the restored snapshot's. The *run's clock* never goes back: trackers
drop or overlay rows whose step is not new, and people read one timeline. Every event and metric
row, and every step a message names, is on the run's clock; :class:`RunClock` converts.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from earlywarn.detect import Observation
from earlywarn.events import ALERT_KINDS, Event, Kind
from earlywarn.metrics import MetricsConfig, StepLevels, StepMetrics
from earlywarn.sinks import Sink
from earlywarn.sinks.base import takes_metrics

COUNTERS = ("steps", "skipped_steps", "repaired_steps", "rewinds", "checkpoints", "nonfinite_steps",
            "alerts_info", "alerts_warning", "alerts_critical")

_NO_METRICS: Mapping[str, float] = types.MappingProxyType({})  # a step's end, for sinks that take no metrics


@dataclass
class RunClock:
    """The training step and the run's clock: ``run(s) = s + offset``, where ``offset`` is the
    number of steps rewinds had undone when training step ``s`` was (last) trained.

    Each rewind starts a segment of the trajectory: ``(first training step, offset)``. A rewind
    that goes back past a segment's start drops that segment (its steps are trained again, under
    the new offset), so the segments always describe the current trajectory."""

    step: int = 0
    """The step the next ``optimizer.step()`` is (on the training trajectory)."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """``(first training step, offset)`` per rewind still on the current trajectory, in order;
    before the first segment the offset is 0."""

    @property
    def offset(self) -> int:
        """The offset in force now (steps that rewinds took back so far)."""
        return self.segments[-1][1] if self.segments else 0

    def run(self, step: int) -> int:
        """Training step ``step`` (of the current trajectory) on the run's clock."""
        segs = self.segments
        if not segs or step >= segs[-1][0]:
            return step + self.offset  # the current segment: the usual case
        i = bisect.bisect_right(segs, (step, math.inf)) - 1
        return step + (segs[i][1] if i >= 0 else 0)

    def rewound(self, incident: int, resume: int) -> None:
        """A rewind at training step ``incident`` resumes at ``resume``: the run's clock goes on
        from the incident's."""
        offset = self.run(incident) + 1 - resume
        while self.segments and self.segments[-1][0] >= resume:
            self.segments.pop()  # trained again from ``resume`` on: under the new offset
        self.segments.append((resume, offset))
        self.step = resume

    def merge(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's clock loaded into a live watcher (a resume): neither the training
        step nor the run's clock goes back."""
        saved = RunClock()
        saved.load_state_dict(state)
        self.step = max(self.step, saved.step)
        if saved.offset > self.offset:
            self.segments = saved.segments

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "log_offset": self.offset, "segments": [list(s) for s in self.segments]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        segments = state.get("segments")
        if segments is None:  # saved before segments existed: one offset for every step
            offset = int(state.get("log_offset", 0))
            segments = [(0, offset)] if offset else []
        self.segments = [(int(first), int(offset)) for first, offset in segments]


class Telemetry:
    """Events, counters and metric rows of one watcher, sent to its sinks. ``source``: the
    watcher's name when a process has several (``None``: the only one)."""

    def __init__(self, clock: RunClock, layer_names: Sequence[str], metrics: MetricsConfig, source: str | None):
        self.clock = clock
        self.layer_names = tuple(layer_names)
        self.metrics_config = metrics
        self.source = source
        self.events: list[Event] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.levels = StepLevels()  # alert_level of the row being built (see emit, log_metrics)
        self.sinks: list[Sink] = []
        # the rows of calm steps still held (guard.calmstep) go out before any event or count changes
        self.before_event: Callable[[], None] | None = None

    def count(self, name: str, n: int = 1) -> None:
        if self.before_event is not None:
            self.before_event()
        self.counters[name] = self.counters.get(name, 0) + n

    def emit(self, event: Event) -> None:
        """Record and send one event; its ``step`` is on the run's clock."""
        if self.before_event is not None:
            self.before_event()
        if self.source is not None and event.source is None:
            event = dataclasses.replace(event, source=self.source)
        self.events.append(event)
        if event.kind in ALERT_KINDS:
            self.count(f"alerts_{event.level}")
        written = event.kind is Kind.CHECKPOINT
        if written:  # periodic and on-warning alike: every checkpoint written counts
            self.count("checkpoints")
        if event.kind is Kind.REPAIR and event.values.get("repaired", 0.0) > 0:
            self.count("repaired_steps")  # whichever path found the poison (a step's check, a snapshot's flag, a bad batch)
        if event.values.get("dry_run"):
            self.count(f"would_{event.kind}")  # watch(dry_run=True): what it would have done, once each
        # The step's alert_level is the worst of its events, whatever a rewind restores later.
        self.levels.note(event.kind, event.level, event.step)
        for sink in self.sinks:
            safe_call(sink, "alert", event)
        if written:
            path = event.path or f"memory:{event.step}"
            for sink in self.sinks:
                safe_call(sink, "checkpoint", event.step, path, event.signal or "checkpoint")

    def emit_trained(self, event: Event) -> None:
        """An event whose ``step`` is a training step (recovery's): sent on the run's clock."""
        if event.step >= 0 and self.clock.segments:
            event = dataclasses.replace(event, step=self.clock.run(event.step))
        self.emit(event)

    def log_metrics(self, run_step: int, obs: Observation | None, score: float | None) -> None:
        """The row of one step (``run_step``: the run's clock); ``obs`` None: a step with no statistics."""
        if obs is None:
            self.log_rows([(run_step, None, None, None, None, None)])
            return
        user = {k[5:]: v for k, v in obs.extras.items() if k.startswith("user/")} if obs.extras else None
        self.log_rows([(run_step, obs.grad_norm, obs.loss, obs.layer_norms, user, score)])

    def log_rows(self, rows: Sequence[tuple]) -> None:
        """The rows of steps in order, each ``(run_step, grad_norm, loss, layer_norms, user
        signals, score)`` (``None``: not known), as one :meth:`log_metrics` each: the calm
        steps' come several at once."""
        sinks = self.sinks
        if not any(map(takes_metrics, sinks)):
            # no sink does anything with metrics (console only, say): build nothing; every sink
            # still hears that the step is over (the console prints the step's incident then)
            for row in rows:
                self.levels.take()
                for sink in sinks:
                    safe_call(sink, "log_metrics", row[0], _NO_METRICS)
            return
        names, cfg, counters = self.layer_names, self.metrics_config, self.counters
        calls = [(sink, sink.log_metrics) for sink in sinks]
        for run_step, grad_norm, loss, norms, user, score in rows:
            # Built on first read, so tracker sinks build it on their own thread, not this one.
            metrics = StepMetrics(run_step, grad_norm=grad_norm, loss=loss, layer_names=names, layer_norms=norms,
                                  score=score, level=self.levels.take(), counters=counters, config=cfg, user=user)
            for sink, log in calls:
                try:
                    log(run_step, metrics)
                except Exception as exc:  # a tracker must never kill training (as safe_call)
                    warnings.warn(f"earlywarn: sink {sink.name!r}.log_metrics failed: {redact(sink, exc)}")

    def log_halted_row(self) -> None:
        """A step a ``Halt`` ended never had its row logged: log it (level, counters) now."""
        if self.levels.halted and self.levels.step is not None:
            self.log_metrics(self.levels.step, None, None)

    def flush(self, deadline: float) -> None:
        import time

        for sink in self.sinks:
            safe_call(sink, "flush", max(deadline - time.monotonic(), 0.0))

    def finish(self) -> None:
        for sink in self.sinks:  # all at once: two trackers that are down cost one wait, not two
            if hasattr(sink, "begin_finish"):
                safe_call(sink, "begin_finish")
        for sink in self.sinks:
            try:
                sink.finish()
            except Exception as exc:  # a tracker must never kill training
                warnings.warn(f"earlywarn: sink {sink.name!r} failed to finish: {redact(sink, exc)}")


def safe_call(sink: Sink, method: str, *args: Any) -> None:
    try:
        getattr(sink, method)(*args)
    except Exception as exc:  # a tracker must never kill training
        warnings.warn(f"earlywarn: sink {sink.name!r}.{method} failed: {redact(sink, exc)}")


def redact(sink: Sink, exc: BaseException) -> str:
    """The error's text with the sink's credentials masked (URI user info, webhook tokens)."""
    return getattr(sink, "redact", str)(str(exc))
