"""Run any sink on a background thread, so a tracker that is slow or down never stalls training.

The training thread only appends to a bounded in-memory buffer (about a microsecond; no wake-up
of the worker unless the sink wants every step at once). One worker thread per sink starts the
backend, delivers metrics in batches (every ``batch_interval`` seconds, or sooner when a batch is
full) and events at once, retries a failure with exponential backoff (the record stays at the
head of the line), warns once per outage, and past the bound drops the *oldest* metric records,
counting them. Events and checkpoint records have their own bound, so a flood of metrics never
pushes out an alert.

Every wait is bounded. ``watch()`` waits for a tracker that cannot be reached only as long as
that sink's ``start()`` takes to say so (then the sink keeps retrying in the background).
``flush`` gives a tracker that is down ``down_timeout`` to come back. ``finish`` drains a healthy
backlog for up to ``finish_timeout`` (30 s) but gives a tracker that is down only
``down_timeout`` (3 s), then says once what was not delivered and where it was kept
(``spool_path``) or that it was dropped. Every message goes through the sink's ``redact``.

Its parts: the buffer (:mod:`._buffer`), the lifecycle (:mod:`._lifecycle`), retry and deadlines
(:mod:`._retry`), the spool file (:mod:`._spool`), SIGTERM as a clean exit (:mod:`.sigterm`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from earlywarn.events import Event
from earlywarn.metrics import StepMetrics
from earlywarn.sinks._buffer import RecordBuffer, as_lists
from earlywarn.sinks._lifecycle import ENDED, Lifecycle, moved
from earlywarn.sinks._retry import PERMANENT_START_ERRORS, TRANSIENT_START_ERRORS, Retrier, redacted
from earlywarn.sinks._spool import Spool
from earlywarn.sinks.base import PermanentSinkError, Sink, SinkStarting, takes_metrics
from earlywarn.sinks.sigterm import install_sigterm_exit, signal_exit_code

__all__ = ["BackgroundOptions", "BackgroundSink", "install_sigterm_exit", "signal_exit_code"]

log = logging.getLogger("earlywarn.sinks")

COUNTERS = ("delivered_records", "delivered_events", "dropped_records", "dropped_values", "dropped_events",
            "spooled_records", "spooled_events", "rejected", "failures")


@dataclass(kw_only=True)
class BackgroundOptions:
    """How a :class:`BackgroundSink` buffers, batches, retries and waits (its keyword arguments)."""

    max_buffered_values: int = 500_000
    """Metric values held for a tracker that is slow or down; past it the oldest steps are dropped."""
    max_buffered_events: int = 10_000
    """Events and checkpoint records held (their own bound: metrics never push out an alert)."""
    max_batch_values: int = 1000
    """Metric values handed to ``inner.log_metrics_batch`` at a time."""
    batch_interval: float | None = None
    """Seconds metric steps may wait to be delivered together (``None``: ``inner.batch_interval``;
    0: each at once)."""
    backoff_initial: float = 0.5
    """Seconds before the first retry after a failure, doubling up to ``backoff_max``."""
    backoff_max: float = 30.0
    start_timeout: float = 15.0
    """How long ``start()`` waits for ``inner.start()`` (then it carries on in the background)."""
    finish_timeout: float = 30.0
    """How long ``finish()`` lets a healthy tracker drain its backlog."""
    close_timeout: float = 10.0
    """How long ``finish()`` then waits for ``inner.finish()`` (a second when the tracker is down)."""
    down_timeout: float | None = None
    """How long ``flush()`` / ``finish()`` keep retrying a tracker that is down (``None``:
    ``inner.down_timeout``, else 3 s)."""
    spool_path: str | os.PathLike | None = None
    """A JSONL file that receives what could not be delivered (``None``: ``inner.spool_path``;
    without one it is dropped and counted)."""
    exit_on_sigterm: bool = True
    """Turn SIGTERM into a clean exit so buffered records are delivered (:mod:`earlywarn.sinks.sigterm`)."""

    def __post_init__(self) -> None:
        for name in ("max_buffered_values", "max_buffered_events", "max_batch_values"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BackgroundSink.{name}={value!r}: use an int >= 1")
        for name in ("batch_interval", "backoff_initial", "backoff_max", "start_timeout", "finish_timeout",
                     "close_timeout", "down_timeout"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"BackgroundSink.{name}={value!r}: use a number of seconds >= 0")

    def for_sink(self, inner: Sink) -> "BackgroundOptions":
        """These options with what is left to ``inner`` (``None``) taken from it, checked again."""
        down = self.down_timeout if self.down_timeout is not None else getattr(inner, "down_timeout", None)
        spool = self.spool_path if self.spool_path is not None else getattr(inner, "spool_path", None)
        return dataclasses.replace(
            self,
            batch_interval=float(self.batch_interval if self.batch_interval is not None
                                 else getattr(inner, "batch_interval", 0.0) or 0.0),
            backoff_max=max(self.backoff_max, self.backoff_initial),
            down_timeout=3.0 if down is None else float(down),
            spool_path=os.fspath(spool) if spool is not None else None,
        )


class BackgroundSink(Sink):
    """Wraps ``inner`` so that every call from the training thread returns at once.

    Metrics are buffered as ``(step, metrics, time)`` records (the time is taken when logged, so a
    tracker that was down still gets the right timestamps) and handed to
    ``inner.log_metrics_batch`` up to ``max_batch_values`` values at a time, at most every
    ``batch_interval`` seconds. Any exception from ``inner`` is retried with backoff
    ``backoff_initial`` doubling up to ``backoff_max`` seconds;
    :class:`~earlywarn.sinks.base.PermanentSinkError` drops that record instead (counted as
    ``rejected``). ``flush()`` retries at once, skipping the rest of a backoff wait. What could
    not be delivered by the end goes to ``spool_path`` (else it is dropped and counted).

    ``options`` are the fields of :class:`BackgroundOptions`; ``on_status`` hears when the
    tracker goes down and comes back (``Kind.SINK`` events).
    """

    io_bound = False  # already off the training thread: never wrap twice

    def __init__(self, inner: Sink, *, on_status: Callable[[Event], None] | None = None, **options: Any):
        if isinstance(inner, BackgroundSink):
            raise ValueError("BackgroundSink(inner=...): inner is already a BackgroundSink; wrap the sink once")
        self.options = BackgroundOptions(**options).for_sink(inner)
        self.inner = inner
        self.name = inner.name
        self.main_process_only = inner.main_process_only
        self._redact: Callable[[str], str] = getattr(inner, "redact", None) or str
        # A sink that does nothing with metrics (a webhook) gets none buffered for it.
        self.takes_metrics = takes_metrics(inner)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

        opts = self.options
        # The lock guards everything below but RecordBuffer.append_metrics (the training thread's)
        self._cond = threading.Condition(threading.Lock())
        self._buffer = RecordBuffer(opts.max_buffered_values, opts.max_buffered_events, opts.max_batch_values)
        self._state = Lifecycle.NEW
        self._retry = Retrier(self.name, self._cond, backoff_initial=opts.backoff_initial,
                              backoff_max=opts.backoff_max, down_timeout=opts.down_timeout,
                              close_timeout=opts.close_timeout, max_buffered_values=opts.max_buffered_values,
                              redact=self._redact, on_status=on_status, counters=self.counters)
        self._spool = Spool(self.name, opts.spool_path, self._redact, self.counters, self._cond)
        self._thread: threading.Thread | None = None
        self._settled = threading.Event()  # start succeeded, failed, or was deferred (tracker unreachable)
        self._start_waiting = False
        self._start_error: BaseException | None = None
        self._worker_waiting = False
        self._flush_requested = 0
        self._flush_done = 0  # tickets answered (delivered, or given up on because the tracker is down)
        self._inflight = 0  # records taken by the worker and not yet delivered / dropped
        self._inflight_item: tuple[str, Any] | None = None
        self._abandoned = False  # finish() gave up on the call under way and reported what it held
        self._warned_drop = False
        self._warned_reject = False
        self._atexit_registered = False

    @property
    def batch_interval(self) -> float:  # type: ignore[override]
        return self.options.batch_interval

    @property
    def down_timeout(self) -> float:  # type: ignore[override]
        return self.options.down_timeout

    @property
    def last_error(self) -> str | None:
        """The last error from the tracker, redacted."""
        return self._retry.last_error

    def redact(self, text: str) -> str:
        return self._redact(text)

    def _move_locked(self, to: Lifecycle) -> None:
        """The one place the lifecycle moves (the lock held); everyone waiting looks again."""
        self._state = moved(self._state, to)
        self._cond.notify_all()

    # ------------------------------------------------------------------ training-thread side
    def start(self) -> None:
        """Start the worker, which starts ``inner``; wait up to ``start_timeout`` for that.

        Raises what ``inner.start()`` raised if it failed within ``start_timeout`` with an error
        that retrying cannot fix (the caller drops the sink). A tracker that cannot be reached
        yet (an ``OSError``: connection refused, timeout) or a start still running after the
        timeout carries on in the background: records are buffered meanwhile.
        """
        if self.begin_start():
            self.wait_started(self.options.start_timeout)

    def begin_start(self) -> bool:
        """Start the worker without waiting (``build_sinks`` starts several sinks at once, then
        waits on each with :meth:`wait_started`). False when already started or finished."""
        with self._cond:
            if self._state is not Lifecycle.NEW:
                return False
            self._move_locked(Lifecycle.STARTING)
            self._start_waiting = True
        if self.options.exit_on_sigterm:
            install_sigterm_exit()
        self._register_atexit()  # also covers a backend that never starts: buffered records are reported
        self._thread = threading.Thread(target=self._run, name=f"earlywarn-sink-{self.name}", daemon=True)
        self._thread.start()
        return True

    def wait_started(self, timeout: float | None) -> bool:
        """Wait for ``inner.start()``; True once it succeeded. Re-raises a permanent error, see
        ``start``; False when the backend is still starting or not reachable yet."""
        if self._state is Lifecycle.NEW:
            return False
        done = self._settled.wait(timeout)
        with self._cond:
            self._start_waiting = False
            if self._state is Lifecycle.FAILED and self._start_error is not None:
                raise redacted(self._start_error, self._redact) from None
            running = self._state in (Lifecycle.RUNNING, Lifecycle.CLOSING, Lifecycle.CLOSED)
        if not done:
            log.warning("earlywarn: sink %r is still starting after %.0f s; buffering its records meanwhile",
                        self.name, timeout or 0.0)
        return running

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # A plain dict is copied (the caller may reuse it); the watcher's StepMetrics is a snapshot
        # that the worker builds. The time is when it was logged.
        if self.takes_metrics:
            if isinstance(metrics, StepMetrics):
                self._put_metrics(step, metrics, time.time(), self._buffer.record_values)
            else:
                self._put_metrics(int(step), dict(metrics), time.time(), len(metrics))

    def _put_metrics(self, step: int, metrics: Mapping[str, float], t: float, n: int) -> None:
        if self._state in ENDED:
            return
        # The lock only to wake the worker (a full batch, or batch_interval 0) and to keep the bound.
        if self._buffer.append_metrics(step, metrics, t, n) or self.options.batch_interval <= 0:
            with self._cond:
                if self._buffer.values > self._buffer.max_values:
                    self._drop_oldest_locked()
                if self._worker_waiting:
                    self._cond.notify()

    def log_metrics_batch(self, records) -> None:
        """Buffer several ``(step, metrics, unix_time)`` records, keeping their times."""
        if self.takes_metrics:
            for step, metrics, t in records:
                self._put_metrics(int(step), dict(metrics), float(t), len(metrics))

    def alert(self, event: Event) -> None:
        self._put_event("alert", (event,))

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        self._put_event("checkpoint", (int(step), str(path), str(reason)))

    def _put_event(self, kind: str, args: tuple) -> None:
        with self._cond:
            if self._state in ENDED:
                return
            if self._buffer.append_event(kind, args):
                self.counters["dropped_events"] += 1
                self._note_drop_locked()
            if self._worker_waiting:
                self._cond.notify()

    def _drop_oldest_locked(self) -> None:
        records, values = self._buffer.drop_oldest()
        self.counters["dropped_records"] += records
        self.counters["dropped_values"] += values
        self._note_drop_locked()

    def _note_drop_locked(self) -> None:
        if not self._warned_drop:
            self._warned_drop = True
            # Logged from the worker's side would be late; this runs once per sink.
            log.warning("earlywarn: sink %r is behind; dropping its oldest buffered records (bound: %d values, "
                        "%d events). stats() counts what was dropped.", self.name,
                        self.options.max_buffered_values, self.options.max_buffered_events)

    def pending(self) -> int:
        """Records (metric steps + events) not yet delivered."""
        with self._cond:
            return len(self._buffer) + self._inflight

    def stats(self) -> dict[str, Any]:
        """Counters (delivered / dropped / spooled / rejected / failures), what is pending, state,
        whether the tracker is down now, the last error (redacted)."""
        with self._cond:
            return {
                **self.counters,
                "pending_records": len(self._buffer.metrics),
                "pending_values": self._buffer.values,
                "pending_events": len(self._buffer.events),
                "inflight": self._inflight,
                "state": self._state.value,
                "down": self._retry.clock.outage,
                "last_error": self.last_error,
            }

    def flush(self, timeout: float | None = None) -> bool:
        """Deliver everything buffered now (retrying at once), then ``inner.flush``.

        Returns True when nothing is left; False when ``timeout`` ran out first, or once the
        tracker has been down for ``down_timeout`` during this call (the records stay buffered)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._state in (Lifecycle.NEW, Lifecycle.CLOSED, Lifecycle.FAILED) or self._thread is None:
                return not len(self._buffer)
            self._flush_requested += 1
            ticket = self._flush_requested
            asked = time.monotonic()
            self._retry.kick()
            self._cond.notify_all()
            while self._flush_done < ticket:
                if self._state in (Lifecycle.CLOSED, Lifecycle.FAILED):
                    break
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                clock = self._retry.clock
                if clock.outage:
                    # down: wait down_timeout for it to come back, not the whole timeout
                    down_left = max(asked, clock.outage_since) + clock.down_timeout - now
                    left = down_left if left is None else min(left, down_left)
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return not (len(self._buffer) or self._inflight)

    def begin_finish(self, timeout: float | None = None) -> None:
        """Start finishing without waiting (the watcher finishes all its sinks at once, so two
        trackers that are down cost one ``down_timeout``, not two)."""
        timeout = self.options.finish_timeout if timeout is None else timeout
        with self._cond:
            if self._state in (Lifecycle.CLOSING, Lifecycle.CLOSED):
                return
            if self._state not in (Lifecycle.NEW, Lifecycle.FAILED):
                self._move_locked(Lifecycle.CLOSING)
                self._retry.clock.begin_finish(timeout)
                self._retry.kick()
                return
            undelivered = self._buffer.drain()
            self._move_locked(Lifecycle.CLOSED)
        self._spool.give_up(*undelivered, reason="it never started")

    def finish(self, timeout: float | None = None) -> None:
        """Deliver what is buffered, then ``inner.finish()`` (closing a run, W&B's teardown).

        A healthy tracker gets up to ``timeout`` (default ``finish_timeout``) to drain its
        backlog plus ``close_timeout`` to close; a tracker that is down gets ``down_timeout``
        in all (plus a second to close). Safe to call twice. What is left is spooled or
        dropped, counted, and reported in one warning."""
        self.begin_finish(timeout)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            with self._cond:
                while self._state is not Lifecycle.CLOSED and thread.is_alive():
                    left = self._retry.clock.close_deadline() - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.25))  # a hang notifies nobody: look again soon
                stuck = self._state is not Lifecycle.CLOSED and thread.is_alive()
            if stuck:
                # The worker is stuck in a call to the tracker; it is a daemon thread. What it
                # holds is reported with the rest (and not counted again if the call ever returns).
                with self._cond:
                    undelivered = self._buffer.drain()
                    if self._inflight_item is not None:
                        held = as_lists(*self._inflight_item)
                        undelivered = (held[0] + undelivered[0], held[1] + undelivered[1])
                        self._inflight_item = None
                        self._abandoned = True
                waited = self._retry.clock.close_deadline() - (self._retry.clock.finish_at or 0)
                self._spool.give_up(*undelivered, reason=f"the tracker did not answer within {waited:.0f} s")
        self._unregister_atexit()

    def _atexit_finish(self) -> None:
        self.finish(self.options.finish_timeout)

    def _register_atexit(self) -> None:
        # atexit runs last-in first-out: registered again once the backend started (its own
        # teardown was registered during start), so that queued records reach it while it is alive.
        atexit.register(self._atexit_finish)
        self._atexit_registered = True

    def _unregister_atexit(self) -> None:
        if self._atexit_registered:
            self._atexit_registered = False
            atexit.unregister(self._atexit_finish)

    def state_dict(self) -> dict[str, Any]:
        """The counters, so dropped / delivered totals survive a resume."""
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k, v in dict(state.get("counters", {})).items():
            if k in self.counters:
                self.counters[k] = int(v)

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang flush() / finish()
            log.exception("earlywarn: the worker of sink %r stopped; its records are dropped", self.name)
            with self._cond:
                self._retry.last_error = self._retry.error_text(exc)
                undelivered = self._buffer.drain()
                self._inflight = 0
                self._move_locked(Lifecycle.FAILED)
                self._settled.set()
            self._spool.give_up(*undelivered, reason=f"its worker stopped ({self.last_error})")

    def _work(self) -> None:
        if not self._start_inner():
            return
        while True:
            with self._cond:
                item = self._next_item_locked()
                if item is None:
                    closing = self._state is Lifecycle.CLOSING
                    flush_ticket = self._flush_requested
                else:
                    self._inflight = item[2]
            if item is None:
                self._inner_flush()
                with self._cond:
                    self._flush_done = max(self._flush_done, flush_ticket)
                    self._cond.notify_all()
                if closing:
                    break
                continue
            kind, payload, count = item
            with self._cond:
                self._inflight_item = (kind, payload)
            delivered = self._deliver_with_retries(kind, payload, count)
            with self._cond:
                self._inflight = 0
                self._inflight_item = None
                if self._abandoned:  # finish() gave up on this call and reported it
                    self._cond.notify_all()
                    continue
                give_up = not delivered and self._retry.clock.past_deadline()
                if give_up:
                    metrics, events = as_lists(kind, payload)
                    rest = self._buffer.drain()
                    metrics += rest[0]
                    events += rest[1]
                self._cond.notify_all()
            if give_up:
                down = self._retry.clock.outage
                why = f"the tracker is down ({self.last_error})" if down else "finish() ran out of time"
                self._spool.give_up(metrics, events, reason=why)
                break
        self._finish_inner()

    def _start_inner(self) -> bool:
        """Start ``inner``, retrying with backoff; False when the sink ends instead (the start
        failed for good, or ``finish()`` ran out of time first)."""
        delays = self._retry.delays()
        deferred = False
        while True:
            try:
                self.inner.start()
            except SinkStarting:
                # Still coming up (it waited on its own): training goes on, ask again.
                with self._cond:
                    closing = self._state is Lifecycle.CLOSING and self._retry.clock.past_deadline()
                if not closing:
                    self._settled.set()
                    continue
                self._close_unstarted(reason="it was still starting")
                return False
            except BaseException as exc:  # noqa: BLE001 - reported to the caller or retried
                if self._start_failed(exc):
                    return False
                self._retry.failed(exc, "start")
                if isinstance(exc, TRANSIENT_START_ERRORS) and not deferred:
                    deferred = True
                    self._settled.set()  # watch() goes on; this sink keeps trying in the background
                self._retry.sleep(next(delays))
                with self._cond:
                    give_up = self._state is Lifecycle.CLOSING and self._retry.clock.past_deadline()
                if give_up:  # finish() while the backend never came up
                    self._close_unstarted(reason=f"it never started ({self.last_error})")
                    return False
                continue
            with self._cond:
                if self._state is Lifecycle.STARTING:
                    self._move_locked(Lifecycle.RUNNING)
            self._retry.succeeded()
            self._settled.set()
            self._register_atexit()
            return True

    def _start_failed(self, exc: BaseException) -> bool:
        """Whether a start error ends the sink (then it is ended here): an error retrying cannot
        fix, ``finish()`` already called, or a caller waiting on anything but a tracker that is
        not reachable yet. False: retry."""
        permanent = isinstance(exc, PERMANENT_START_ERRORS)
        transient = isinstance(exc, TRANSIENT_START_ERRORS) and not permanent
        with self._cond:
            closing = self._state is Lifecycle.CLOSING
            if not (permanent or closing or (self._start_waiting and not transient)):
                return False
            # A waiting caller warns and drops the sink; otherwise it is dropped here
            # (a missing SDK or a bad option will not fix itself).
            waiting = self._start_waiting
            self._start_error = exc
            self._move_locked(Lifecycle.CLOSED if closing else Lifecycle.FAILED)
            undelivered = self._buffer.drain()
            self._settled.set()
        if not waiting and not closing:
            log.warning("earlywarn: sink %r failed to start (%s); continuing without it",
                        self.name, self._retry.error_text(exc))
        if closing or not waiting:
            self._spool.give_up(*undelivered, reason=f"it could not start ({self._retry.error_text(exc)})")
        return True

    def _close_unstarted(self, *, reason: str) -> None:
        """``finish()`` ran out of time before ``inner`` started: report what is buffered, close."""
        with self._cond:
            undelivered = self._buffer.drain()
        self._spool.give_up(*undelivered, reason=reason)
        with self._cond:
            self._move_locked(Lifecycle.CLOSED)

    def _next_item_locked(self) -> tuple[str, Any, int] | None:
        """What to do next: an event, a batch of metrics, or None (flush answered / closing)."""
        while True:
            if self._buffer.events:
                return self._buffer.take()
            if self._buffer.metrics:
                due = self._metrics_due_locked()
                if due <= 0:
                    return self._buffer.take()
                self._worker_waiting = True
                self._cond.wait(due)
                self._worker_waiting = False
                continue
            if self._state is Lifecycle.CLOSING or self._flush_done < self._flush_requested:
                return None
            self._worker_waiting = True
            # metrics arrive without waking the worker (unless batch_interval is 0): look again then
            interval = self.options.batch_interval
            self._cond.wait(interval if interval > 0 else None)
            self._worker_waiting = False

    def _metrics_due_locked(self) -> float:
        """Seconds until buffered metrics should be delivered (<= 0: now): ``batch_interval``
        after the oldest one was logged, at once when a batch is full, on flush and on finish."""
        interval = self.options.batch_interval
        if (interval <= 0 or self._state is Lifecycle.CLOSING or self._buffer.values >= self.options.max_batch_values
                or self._flush_done < self._flush_requested):
            return 0.0
        return self._buffer.oldest_time() + interval - time.time()

    def _deliver_with_retries(self, kind: str, payload: Any, count: int) -> bool:
        """Deliver one record (or batch), retrying with backoff. False: given up (closing, past
        the deadline); a record the tracker refuses counts as handled (rejected)."""
        try:
            delivered = self._retry.call(lambda: self._deliver(kind, payload), f"log {kind}")
        except PermanentSinkError as exc:
            self.counters["rejected"] += count
            self._retry.last_error = self._retry.error_text(exc)
            if not self._warned_reject:
                self._warned_reject = True
                log.warning("earlywarn: sink %r rejected %d %s record(s), dropped (%s); "
                            "further rejections are only counted in stats()", self.name, count, kind,
                            self.last_error)
            return True
        if delivered and not self._abandoned:  # else finish() already reported it as not delivered
            self.counters["delivered_records" if kind == "metrics" else "delivered_events"] += count
        return delivered

    def _deliver(self, kind: str, payload: Any) -> None:
        if kind == "metrics":
            self.inner.log_metrics_batch(payload)
            self._buffer.learn_record_values(payload)
        elif kind == "alert":
            self.inner.alert(*payload)
        elif kind == "checkpoint":
            self.inner.checkpoint(*payload)

    def _inner_flush(self) -> None:
        try:
            deadline = self._retry.clock.delivery_deadline()
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self.inner.flush(left)
        except Exception as exc:  # noqa: BLE001
            self._retry.failed(exc, "flush")

    def _finish_inner(self) -> None:
        try:
            self.inner.finish()
        except Exception as exc:  # noqa: BLE001
            log.warning("earlywarn: sink %r failed to finish: %s", self.name, self._retry.error_text(exc))
        with self._cond:
            self._move_locked(Lifecycle.CLOSED)
