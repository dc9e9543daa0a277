"""Events to the terminal (stderr), so a user sees what happened without any tracker.

One incident, one line. The events of one optimizer step arrive one by one -- the detector's
alerts (what happened) and then the actions taken on them (skip, repair, rewind, quarantine,
halt) -- and the step ends with ``log_metrics(step, ...)``. The sink holds a step's events until
then (or ``flush()`` / ``finish()``, or an event of another step) and prints them as one line:
what happened, where (layer, batch), what was done. The JSONL log and the trackers still get
every event on its own.
"""

from __future__ import annotations

import atexit
import re
import sys
import threading
import weakref
from typing import Mapping, Sequence, TextIO

from earlywarn.events import ALERT_KINDS, Event, Kind, Level
from earlywarn.sinks.base import Sink


_ANSWERS = frozenset({Kind.SKIP, Kind.CLIP, Kind.REPAIR, Kind.REWIND, Kind.NO_REWIND, Kind.LR_HOLD, Kind.HALT})
"""Actions that answer the step's alerts (their message says what was done about them)."""

_SAMPLES = re.compile(r"\(samples ([^)]*)\)")
_SAMPLES_SHOWN = 3  # the full list is in the event log and the quarantine file


def _fewer_samples(text: str) -> str:
    def cut(m: re.Match) -> str:
        ids = [s.strip() for s in m.group(1).split(",") if s.strip() and s.strip() != "..."]
        if len(ids) <= _SAMPLES_SHOWN:
            return m.group(0)
        return f"(samples {', '.join(ids[:_SAMPLES_SHOWN])}, ...)"

    return _SAMPLES.sub(cut, text)


def _ratio(e: Event) -> str:
    r = e.values.get("ratio")
    return f" {r:.3g}x its baseline" if isinstance(r, float) and r == r and abs(r) != float("inf") else ""


def alert_phrase(e: Event) -> str:
    """A few words for an alert, from its fields (the full sentence is ``e.message``)."""
    layer = e.layer
    if e.kind is Kind.NONFINITE_GRAD:
        return "non-finite gradient" + (f" (first in {layer})" if layer else "")
    if e.kind is Kind.LOSS_NONFINITE:
        value = e.values.get("value")
        return f"loss {value}" if value is not None else "non-finite loss"
    if e.kind is Kind.LOSS_DIVERGED:
        return "loss diverged" + (f" ({_ratio(e).strip()})" if _ratio(e) else "")
    if e.kind is Kind.GRAD_SPIKE:
        return f"{e.signal or 'grad_norm'} spike{_ratio(e)}" + (f" (first in {layer})" if layer else "")
    if e.kind is Kind.COLLAPSE_RISK:
        return f"collapse risk: {e.signal or 'grad_norm'}{_ratio(e)}" + (f" (led by {layer})" if layer else "")
    if e.kind is Kind.SCALER_OVERFLOW:
        return "loss-scale overflow"
    return e.message


def _action_text(e: Event, previous: Sequence[Event]) -> str:
    text = e.message
    if e.kind is Kind.REWIND and e.signal and text.startswith(f"{e.signal}: "):
        text = text[len(e.signal) + 2:]  # the reason is said by the alerts in front of it
    if e.kind is Kind.QUARANTINE and any(p.kind is Kind.REWIND for p in previous):
        _, arrow, path = text.rpartition(" -> ")  # the rewind already listed the batches
        if arrow:
            text = f"quarantine list: {path}"
    return text


def incident_line(step: int, events: Sequence[Event]) -> str:
    """One line for the events of one step: ``[earlywarn LEVEL] step N: what (where). Done: ...``
    (``[earlywarn LEVEL name]`` when the watcher has a name: a process with several)."""
    level = max(e.level for e in events)
    alerts = [e for e in events if e.kind in ALERT_KINDS]
    actions = [e for e in events if e.kind not in ALERT_KINDS]
    answered = any(a.kind in _ANSWERS for a in actions)
    skip = any(a.kind is Kind.SKIP for a in actions)
    if answered:
        # A skip's message names the non-finite layers and the batch; a rewind's the batch
        # responsible. What is left to say about the alerts is a few words each.
        what = ", ".join(dict.fromkeys(alert_phrase(a) for a in alerts if not (skip and a.kind is Kind.NONFINITE_GRAD)))
    else:
        what = " | ".join(dict.fromkeys(a.message.rstrip(".") for a in alerts))
    done = "; ".join(_action_text(a, actions[:i]) for i, a in enumerate(actions))
    body = f"{what}. Done: {done}" if (what and done) else (what or done)
    where = f"step {step}: " if step >= 0 else ""  # sink status events belong to no step
    source = next((e.source for e in events if e.source), None)  # which watcher, when a process has several
    who = f"{level.name} {source}" if source else level.name
    return f"[earlywarn {who}] {where}{_fewer_samples(body)}"


_live: "weakref.WeakSet[ConsoleSink]" = weakref.WeakSet()


@atexit.register
def _print_pending_at_exit() -> None:
    # A script that dies without close() must still show the incident it died of.
    for sink in list(_live):
        try:
            sink.flush()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass


class ConsoleSink(Sink):
    """Prints one line per incident (the events of one step merged) at or above ``min_level`` on
    ``stream`` (stderr by default). ``min_level`` is warning by default: info events (isolated
    spikes that recovered, the loss scaler's own overflow steps) go to the event log and the
    trackers, not the console. Subclass and override :meth:`write` to print elsewhere, e.g. above
    a progress bar."""

    name = "console"
    takes_metrics = False  # log_metrics only says the step is over: its values are never read

    def __init__(self, min_level: Level | str = Level.WARNING, stream: TextIO | None = None):
        self.min_level = Level.parse(min_level)
        self.stream = stream
        self._lock = threading.Lock()
        self._step: int | None = None
        self._pending: list[Event] = []
        _live.add(self)

    def write(self, line: str) -> None:
        """Print one finished line."""
        print(line, file=self.stream or sys.stderr, flush=True)

    # ------------------------------------------------------------------ sink API
    def alert(self, event: Event) -> None:
        with self._lock:
            if event.kind is Kind.SINK or event.step < 0:  # about a tracker, not a step
                lines = self._take() + self._line(event.step, [event])
            else:
                lines = self._take() if (self._step is not None and event.step != self._step) else []
                self._step = event.step
                self._pending.append(event)
        self._write_all(lines)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        with self._lock:
            # the guard reports a warning checkpoint twice: as an event and through this call
            if self._step == step and any(e.kind is Kind.CHECKPOINT for e in self._pending):
                return
            lines = self._take() if (self._step is not None and step != self._step) else []
            self._step = step
            self._pending.append(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                                       message=f"checkpoint ({reason}) -> {path}", signal=reason))
        self._write_all(lines)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # the step is over: its events are all in
        with self._lock:
            if self._step is None or step < self._step:
                return
            lines = self._take()
        self._write_all(lines)

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            lines = self._take()
        self._write_all(lines)
        return True

    def finish(self) -> None:
        self.flush()

    # ------------------------------------------------------------------ internals
    def _take(self) -> list[str]:
        step, events = self._step, self._pending
        self._step, self._pending = None, []
        return self._line(step, events) if events and step is not None else []

    def _line(self, step: int, events: list[Event]) -> list[str]:
        if max(e.level for e in events) < self.min_level:
            return []
        return [incident_line(step, events)]

    def _write_all(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)
