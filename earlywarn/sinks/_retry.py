"""Retrying a tracker that is down: which start errors are worth retrying, the backoff, how long a
background sink keeps trying (:class:`RetryClock`) and the calls themselves (:class:`Retrier`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

from earlywarn.events import Event, Kind, Level
from earlywarn.sinks.base import PermanentSinkError

log = logging.getLogger("earlywarn.sinks")

PERMANENT_START_ERRORS = (PermanentSinkError, ImportError, TypeError, ValueError, AttributeError)
"""Start errors that retrying cannot fix: the sink is dropped instead of retried."""
TRANSIENT_START_ERRORS = (OSError,)  # ConnectionError, TimeoutError, socket and URL errors
"""Start errors that mean "not reachable yet": ``watch()`` stops waiting, the sink keeps trying."""


def backoff(initial: float, maximum: float) -> Iterator[float]:
    """Retry delays: ``initial``, doubling up to ``maximum``."""
    delay = initial
    while True:
        yield delay
        delay = min(delay * 2, maximum)


class RetryClock:
    """Whether the tracker is down, and until when a background sink keeps trying.

    Down: the last attempt failed (an outage), or the call under way has hung for
    ``down_timeout`` (a host that drops packets never refuses the connection). Once finishing,
    delivery goes on until ``finish_budget`` after ``finish()`` was called, or ``down_timeout``
    while the tracker is down; closing ``inner`` gets ``close_timeout`` more (a second when
    down). The owner reads and writes it under its lock, except ``call_started`` (the worker's).
    """

    def __init__(self, down_timeout: float, close_timeout: float) -> None:
        self.down_timeout = down_timeout
        self.close_timeout = close_timeout
        self.outage = False
        """The last attempt failed."""
        self.outage_since = 0.0
        self.call_started: float | None = None
        """When the call under way began (monotonic)."""
        self.finish_at: float | None = None
        """When ``finish()`` was called (monotonic); None before."""
        self.finish_budget = 0.0

    def down(self) -> bool:
        started = self.call_started
        return self.outage or (started is not None and time.monotonic() - started > self.down_timeout)

    def begin_finish(self, budget: float) -> None:
        self.finish_at = time.monotonic()
        self.finish_budget = budget

    def delivery_deadline(self) -> float | None:
        """While finishing: until when delivery goes on (shorter while the tracker is down)."""
        if self.finish_at is None:
            return None
        budget = min(self.finish_budget, self.down_timeout) if self.down() else self.finish_budget
        return self.finish_at + budget

    def close_deadline(self) -> float:
        """While finishing: until when ``finish()`` waits for the worker, closing included."""
        end = self.delivery_deadline()
        assert end is not None
        return end + (min(self.close_timeout, 1.0) if self.down() else self.close_timeout)

    def past_deadline(self) -> bool:
        end = self.delivery_deadline()
        return end is not None and time.monotonic() >= end


class Retrier:
    """Calls into a background sink's tracker: retries with backoff, waits that a :meth:`kick`
    (``flush()``, ``finish()``) ends at once, and outages said once each (a warning, and a
    ``Kind.SINK`` event to ``on_status`` when it goes down and when it is back).

    Shares the sink's lock (``cond``) and ``counters`` (it counts ``failures``); the timings and
    the buffer's bound are the sink's ``BackgroundOptions``, passed as numbers (this module knows
    nothing of the sink that uses it)."""

    def __init__(self, name: str, cond: threading.Condition, *, backoff_initial: float, backoff_max: float,
                 down_timeout: float, close_timeout: float, max_buffered_values: int,
                 redact: Callable[[str], str], on_status: Callable[[Event], None] | None,
                 counters: dict[str, int]) -> None:
        self.name = name
        self.clock = RetryClock(down_timeout, close_timeout)
        self.last_error: str | None = None
        """The last error from the tracker, redacted."""
        self._cond = cond
        self._backoff = (backoff_initial, backoff_max)
        self._max_values = max_buffered_values
        self._redact = redact
        self._on_status = on_status
        self._counters = counters
        self._kicked = False

    def delays(self) -> Iterator[float]:
        return backoff(*self._backoff)

    def kick(self) -> None:
        """End the backoff wait under way (or the next one) at once; the caller holds the lock."""
        self._kicked = True

    def sleep(self, seconds: float) -> None:
        """A backoff wait: ``seconds``, or less when kicked or the deadline comes first."""
        end = time.monotonic() + seconds
        with self._cond:
            while not self._kicked:
                left = end - time.monotonic()
                deadline = self.clock.delivery_deadline()
                if deadline is not None:
                    left = min(left, deadline - time.monotonic())
                if left <= 0:
                    break
                self._cond.wait(left)
            self._kicked = False

    def call(self, fn: Callable[[], None], what: str) -> bool:
        """``fn()`` until it returns (True) or, while finishing, the deadline passes (False). A
        :class:`PermanentSinkError` (the tracker refuses this record) is not retried: it is raised."""
        delays = self.delays()
        while True:
            self.clock.call_started = time.monotonic()
            try:
                fn()
            except PermanentSinkError:
                self.clock.call_started = None
                raise
            except Exception as exc:  # noqa: BLE001 - a tracker error must never reach training
                self.clock.call_started = None
                self.failed(exc, what)
                if self.clock.past_deadline():
                    return False
                self.sleep(next(delays))
                if self.clock.past_deadline():
                    return False
                continue
            self.clock.call_started = None
            self.succeeded()
            return True

    def failed(self, exc: BaseException, what: str) -> None:
        """Count a failure; the first of an outage is said (warning, status event)."""
        self._counters["failures"] += 1
        self.last_error = self.error_text(exc)
        with self._cond:
            began = not self.clock.outage
            if began:
                self.clock.outage, self.clock.outage_since = True, time.monotonic()
            self._cond.notify_all()  # a finish() waiting on a healthy budget recomputes its deadline
        if began:
            log.warning("earlywarn: sink %r failed to %s (%s); buffering (up to %d values) and retrying with backoff",
                        self.name, what, self.last_error, self._max_values)
            self._status(Level.WARNING, f"tracker {self.name} is down: {self.last_error}")

    def succeeded(self) -> None:
        """A call went through; the end of an outage is said."""
        if self.clock.outage:
            with self._cond:
                self.clock.outage = False
                self._cond.notify_all()
            log.warning("earlywarn: sink %r is back; delivering buffered records", self.name)
            self._status(Level.INFO, f"tracker {self.name} is back")

    def error_text(self, exc: BaseException) -> str:
        return self._redact(f"{type(exc).__name__}: {exc}")[:500]

    def _status(self, level: Level, message: str) -> None:
        if self._on_status is not None:
            try:
                self._on_status(Event(step=-1, kind=Kind.SINK, level=level, message=self._redact(message),
                                      signal=self.name))
            except Exception:  # a status callback must not take the worker down
                log.exception("earlywarn: on_status callback of sink %r failed", self.name)


def redacted(exc: BaseException, redact: Callable[[str], str]) -> BaseException:
    """``exc`` itself, or the same kind of exception with its credentials masked."""
    text = str(exc)
    clean = redact(text)
    if clean == text:
        return exc
    try:
        new = type(exc)(clean)
    except Exception:  # noqa: BLE001 - an exception type with another signature
        new = RuntimeError(f"{type(exc).__name__}: {clean}")
    return new
