"""The bounded buffer between the training thread and a background sink's worker."""

from __future__ import annotations

import collections
from typing import Any, Mapping

from earlywarn.metrics import StepMetrics


class RecordBuffer:
    """Metric steps and events waiting for the worker, each kind with its own bound.

    Metric steps are ``(step, metrics, unix time, values)`` records, bounded by their number of
    values: past it the *oldest* are dropped. Events (``(kind, args)``: alerts, checkpoint
    records) are bounded by count, so a flood of metrics never pushes out an alert. The training
    thread appends metric steps without the owner's lock (``deque.append`` is atomic and only it
    writes ``values_in``); everything else runs under the owner's lock.
    """

    def __init__(self, max_values: int, max_events: int, max_batch_values: int) -> None:
        self.max_values = max_values
        self.max_events = max_events
        self.max_batch_values = max_batch_values
        self.metrics: collections.deque[tuple[int, Mapping[str, float], float, int]] = collections.deque()
        self.events: collections.deque[tuple[str, tuple]] = collections.deque()
        self.values_in = 0
        self.values_out = 0
        self.record_values = 32
        """Values per StepMetrics record, for the accounting (learned from what was delivered)."""
        self.wake_values = min(max_batch_values, max_values)

    def __len__(self) -> int:
        """Records buffered (metric steps + events)."""
        return len(self.metrics) + len(self.events)

    @property
    def values(self) -> int:
        """Metric values buffered now (approximate for StepMetrics records)."""
        return self.values_in - self.values_out

    def append_metrics(self, step: int, metrics: Mapping[str, float], t: float, n: int) -> bool:
        """Buffer one metric step of ``n`` values (no lock); True once a batch is full: time to
        wake the worker and check the bound."""
        self.metrics.append((step, metrics, t, n))
        self.values_in += n
        return self.values_in - self.values_out >= self.wake_values

    def drop_oldest(self) -> tuple[int, int]:
        """Drop the oldest metric steps until within the bound; ``(records, values)`` dropped.
        The newest is kept even if it alone is over: a bound that drops everything would turn
        one oversized step into silence."""
        records = values = 0
        while self.values > self.max_values and len(self.metrics) > 1:
            _, _, _, n = self.metrics.popleft()
            self.values_out += n
            records += 1
            values += n
        return records, values

    def append_event(self, kind: str, args: tuple) -> bool:
        """Buffer one event; True when the oldest event was dropped to stay within the bound."""
        self.events.append((kind, args))
        if len(self.events) > self.max_events:
            self.events.popleft()
            return True
        return False

    def oldest_time(self) -> float:
        """When the oldest buffered metric step was logged (unix time)."""
        return self.metrics[0][2]

    def take(self) -> tuple[str, Any, int]:
        """What to deliver next, removed: the oldest event, else the oldest metric steps up to
        ``max_batch_values`` values (at least one): ``(kind, payload, records)``."""
        if self.events:
            kind, args = self.events.popleft()
            return kind, args, 1
        step, m, t, n = self.metrics.popleft()
        batch, total = [(step, m, t)], n
        while self.metrics and total + self.metrics[0][3] <= self.max_batch_values:
            step, m, t, n = self.metrics.popleft()
            batch.append((step, m, t))
            total += n
        self.values_out += total
        return "metrics", batch, len(batch)

    def drain(self) -> tuple[list, list]:
        """Everything buffered, removed: ``(step, metrics, time)`` records and events."""
        metrics = []
        while self.metrics:
            step, m, t, n = self.metrics.popleft()
            self.values_out += n
            metrics.append((step, m, t))
        events = list(self.events)
        self.events.clear()
        return metrics, events

    def learn_record_values(self, batch: list) -> None:
        """What the delivered StepMetrics records really held (built on the worker), for the
        accounting of the next ones."""
        sizes = [len(m) for _, m, _ in batch if isinstance(m, StepMetrics)]
        if sizes:
            self.record_values = max(1, (4 * self.record_values + sum(sizes) // len(sizes)) // 5)


def as_lists(kind: str, payload: Any) -> tuple[list, list]:
    """A taken item (see :meth:`RecordBuffer.take`) as ``(metric records, events)``, as drained."""
    return (list(payload), []) if kind == "metrics" else ([], [(kind, payload)])
