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
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping

from earlywarn.events import Event, Kind, Level, jsonable
from earlywarn.metrics import StepMetrics
from earlywarn.sinks.base import PermanentSinkError, Sink, SinkStarting, takes_metrics

log = logging.getLogger("earlywarn.sinks")

_sigterm_lock = threading.Lock()
_sigterm_installed = False


def install_sigterm_exit() -> bool:
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks and ``atexit`` flushes run.

    With the default SIGTERM action the process dies at once and buffered tracker data (the tail
    of a W&B offline file, queued MLflow values) is lost. Only done from the main thread and only
    when nobody installed a handler (a launcher's or framework's handler is left alone). Returns
    True when the handler is in place.
    """
    global _sigterm_installed
    with _sigterm_lock:
        if _sigterm_installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return False
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        except (ValueError, OSError, AttributeError):  # no signals here (embedded interpreter, Windows)
            return False
        _sigterm_installed = True
        return True


_signal_exit_code: int | None = None


def signal_exit_code() -> int | None:
    """143 once SIGTERM was turned into an exit by :func:`install_sigterm_exit`, else None.

    Sinks finishing at that point mark their run as killed instead of finished."""
    return _signal_exit_code


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    global _signal_exit_code
    _signal_exit_code = 128 + signum
    log.warning("earlywarn: SIGTERM received; flushing trackers and exiting")
    sys.exit(128 + signum)


# Start errors that retrying cannot fix: the sink is dropped instead of retried.
_PERMANENT_START_ERRORS = (PermanentSinkError, ImportError, TypeError, ValueError, AttributeError)
# Start errors that mean "not reachable yet": watch() stops waiting, the sink keeps trying.
_TRANSIENT_START_ERRORS = (OSError,)  # ConnectionError, TimeoutError, socket and URL errors

_ENDED = ("closing", "closed", "failed")


def _redacted(exc: BaseException, redact: Callable[[str], str]) -> BaseException:
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


class BackgroundSink(Sink):
    """Wraps ``inner`` so that every call from the training thread returns at once.

    Metrics are buffered as ``(step, metrics, time)`` records (the time is taken when logged, so a
    tracker that was down still gets the right timestamps) and handed to
    ``inner.log_metrics_batch`` up to ``max_batch_values`` values at a time, at most every
    ``batch_interval`` seconds (``None``: ``inner.batch_interval``). Any exception from ``inner``
    is retried with backoff ``backoff_initial`` doubling up to ``backoff_max`` seconds;
    :class:`~earlywarn.sinks.base.PermanentSinkError` drops that record instead (counted as
    ``rejected``). ``flush()`` retries at once, skipping the rest of a backoff wait.

    ``down_timeout`` (``None``: ``inner.down_timeout``, else 3 s) bounds how long ``finish``
    keeps retrying a tracker that is down; ``spool_path`` (``None``: ``inner.spool_path``)
    is a JSONL file that receives what could not be delivered (else it is dropped and counted).
    """

    io_bound = False  # already off the training thread: never wrap twice

    def __init__(
        self,
        inner: Sink,
        *,
        max_buffered_values: int = 500_000,
        max_buffered_events: int = 10_000,
        max_batch_values: int = 1000,
        batch_interval: float | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        start_timeout: float = 15.0,
        finish_timeout: float = 30.0,
        close_timeout: float = 10.0,
        down_timeout: float | None = None,
        spool_path: str | os.PathLike | None = None,
        exit_on_sigterm: bool = True,
        on_status: Callable[[Event], None] | None = None,
    ):
        if isinstance(inner, BackgroundSink):
            raise ValueError("BackgroundSink(inner=...): inner is already a BackgroundSink; wrap the sink once")
        for field_name, value, lo in (
            ("max_buffered_values", max_buffered_values, 1),
            ("max_buffered_events", max_buffered_events, 1),
            ("max_batch_values", max_batch_values, 1),
        ):
            if not isinstance(value, int) or value < lo:
                raise ValueError(f"BackgroundSink.{field_name}={value!r}: use an int >= {lo}")
        if batch_interval is None:
            batch_interval = float(getattr(inner, "batch_interval", 0.0) or 0.0)
        if down_timeout is None:
            down_timeout = getattr(inner, "down_timeout", None)
            down_timeout = 3.0 if down_timeout is None else float(down_timeout)
        for field_name, value in (
            ("batch_interval", batch_interval),
            ("backoff_initial", backoff_initial),
            ("backoff_max", backoff_max),
            ("start_timeout", start_timeout),
            ("finish_timeout", finish_timeout),
            ("close_timeout", close_timeout),
            ("down_timeout", down_timeout),
        ):
            if not value >= 0:
                raise ValueError(f"BackgroundSink.{field_name}={value!r}: use a number of seconds >= 0")
        self.inner = inner
        self.name = inner.name
        self.main_process_only = inner.main_process_only
        self.max_buffered_values = max_buffered_values
        self.max_buffered_events = max_buffered_events
        self.max_batch_values = max_batch_values
        self.batch_interval = float(batch_interval)
        self.backoff_initial = backoff_initial
        self.backoff_max = max(backoff_max, backoff_initial)
        self.start_timeout = start_timeout
        self.finish_timeout = finish_timeout
        self.close_timeout = close_timeout
        self.down_timeout = float(down_timeout)
        spool = spool_path if spool_path is not None else getattr(inner, "spool_path", None)
        self.spool_path = os.fspath(spool) if spool is not None else None
        self.exit_on_sigterm = exit_on_sigterm
        self.on_status = on_status
        self._redact: Callable[[str], str] = getattr(inner, "redact", None) or str
        # A sink that does nothing with metrics (a webhook) gets none buffered for it.
        self.takes_metrics = takes_metrics(inner)

        self._cond = threading.Condition(threading.Lock())
        # (step, metrics, unix time, values counted). The training thread appends without the lock
        # (deque.append is atomic) and counts into _values_in; the worker pops under the lock and
        # counts into _values_out; the lock is taken on the training thread only to wake the worker
        # (a full batch, or batch_interval 0) or to drop the oldest past the bound.
        self._metrics: collections.deque[tuple[int, Mapping[str, float], float, int]] = collections.deque()
        self._values_in = 0
        self._values_out = 0
        self._record_values = 32  # values per StepMetrics record, for accounting (learned by the worker)
        self._wake_values = min(max_batch_values, max_buffered_values)
        self._events: collections.deque[tuple[str, tuple]] = collections.deque()
        self._inflight = 0  # records taken by the worker and not yet delivered / dropped
        self._worker_waiting = False
        self._kick = False  # flush() / finish() asked for a retry now
        self._flush_requested = 0
        self._flush_done = 0  # tickets answered (delivered, or given up on because the tracker is down)
        self._state = "new"  # new -> starting -> running -> closing -> closed | failed
        self._start_waiting = False
        self._start_error: BaseException | None = None
        self._settled = threading.Event()  # start succeeded, failed, or was deferred (tracker unreachable)
        self._thread: threading.Thread | None = None
        self._finish_at: float | None = None
        self._finish_budget = finish_timeout
        self._outage = False
        self._outage_since = 0.0
        self._call_started: float | None = None  # when the delivery call under way began
        self._inflight_item: tuple[str, Any] | None = None
        self._abandoned = False
        self._warned_drop = False
        self._warned_reject = False
        self._reported = False
        self._atexit_registered = False
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "delivered_records",
                "delivered_events",
                "dropped_records",
                "dropped_values",
                "dropped_events",
                "spooled_records",
                "spooled_events",
                "rejected",
                "failures",
            ),
            0,
        )
        self.last_error: str | None = None

    def redact(self, text: str) -> str:
        return self._redact(text)

    # ------------------------------------------------------------------ training-thread side
    def start(self) -> None:
        """Start the worker, which starts ``inner``; wait up to ``start_timeout`` for that.

        Raises what ``inner.start()`` raised if it failed within ``start_timeout`` with an error
        that retrying cannot fix (the caller drops the sink). A tracker that cannot be reached
        yet (an ``OSError``: connection refused, timeout) or a start still running after the
        timeout carries on in the background: records are buffered meanwhile.
        """
        if self.begin_start():
            self.wait_started(self.start_timeout)

    def begin_start(self) -> bool:
        """Start the worker without waiting (``build_sinks`` starts several sinks at once, then
        waits on each with :meth:`wait_started`). False when already started or finished."""
        with self._cond:
            if self._state != "new":
                return False
            self._state = "starting"
            self._start_waiting = True
        if self.exit_on_sigterm:
            install_sigterm_exit()
        self._register_atexit()  # also covers a backend that never starts: buffered records are reported
        self._thread = threading.Thread(target=self._run, name=f"earlywarn-sink-{self.name}", daemon=True)
        self._thread.start()
        return True

    def wait_started(self, timeout: float | None) -> bool:
        """Wait for ``inner.start()``; True once it succeeded. Re-raises a permanent error, see
        ``start``; False when the backend is still starting or not reachable yet."""
        if self._state == "new":
            return False
        done = self._settled.wait(timeout)
        with self._cond:
            self._start_waiting = False
            if self._state == "failed" and self._start_error is not None:
                raise _redacted(self._start_error, self._redact) from None
            running = self._state in ("running", "closing", "closed")
        if not done:
            log.warning(
                "earlywarn: sink %r is still starting after %.0f s; buffering its records meanwhile",
                self.name,
                timeout or 0.0,
            )
        return running

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # A plain dict is copied (the caller may reuse it); the watcher's StepMetrics is a snapshot
        # that the worker builds. The time is when it was logged.
        if self.takes_metrics:
            if isinstance(metrics, StepMetrics):
                self._put_metrics(step, metrics, time.time(), self._record_values)
            else:
                self._put_metrics(int(step), dict(metrics), time.time(), len(metrics))

    @property
    def _values(self) -> int:
        """Values buffered now (approximate for StepMetrics records)."""
        return self._values_in - self._values_out

    def _put_metrics(self, step: int, metrics: Mapping[str, float], t: float, n: int) -> None:
        if self._state in _ENDED:
            return
        self._metrics.append((step, metrics, t, n))
        self._values_in += n
        if self.batch_interval <= 0 or self._values_in - self._values_out >= self._wake_values:
            with self._cond:
                if self._values > self.max_buffered_values:
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
            if self._state in _ENDED:
                return
            self._events.append((kind, args))
            if len(self._events) > self.max_buffered_events:
                self._events.popleft()
                self.counters["dropped_events"] += 1
                self._note_drop_locked()
            if self._worker_waiting:
                self._cond.notify()

    def _drop_oldest_locked(self) -> None:
        # Keep the newest record even if it alone is over the bound: a bound that drops
        # everything would turn one oversized step into silence.
        while self._values > self.max_buffered_values and len(self._metrics) > 1:
            _, _, _, n = self._metrics.popleft()
            self._values_out += n
            self.counters["dropped_records"] += 1
            self.counters["dropped_values"] += n
        self._note_drop_locked()

    def _drain_locked(self) -> tuple[list, list]:
        """Everything buffered, removed: ``(step, metrics, time)`` records and events."""
        metrics = []
        while self._metrics:
            step, m, t, n = self._metrics.popleft()
            self._values_out += n
            metrics.append((step, m, t))
        events = list(self._events)
        self._events.clear()
        return metrics, events

    def _note_drop_locked(self) -> None:
        if not self._warned_drop:
            self._warned_drop = True
            # Logged from the worker's side would be late; this runs once per sink.
            log.warning(
                "earlywarn: sink %r is behind; dropping its oldest buffered records "
                "(bound: %d values, %d events). stats() counts what was dropped.",
                self.name,
                self.max_buffered_values,
                self.max_buffered_events,
            )

    def pending(self) -> int:
        """Records (metric steps + events) not yet delivered."""
        with self._cond:
            return len(self._metrics) + len(self._events) + self._inflight

    def stats(self) -> dict[str, Any]:
        """Counters (delivered / dropped / spooled / rejected / failures), what is pending, state,
        whether the tracker is down now, the last error (redacted)."""
        with self._cond:
            return {
                **self.counters,
                "pending_records": len(self._metrics),
                "pending_values": self._values,
                "pending_events": len(self._events),
                "inflight": self._inflight,
                "state": self._state,
                "down": self._outage,
                "last_error": self.last_error,
            }

    def flush(self, timeout: float | None = None) -> bool:
        """Deliver everything buffered now (retrying at once), then ``inner.flush``.

        Returns True when nothing is left; False when ``timeout`` ran out first, or once the
        tracker has been down for ``down_timeout`` during this call (the records stay buffered)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._state in ("new", "closed", "failed") or self._thread is None:
                return not (self._metrics or self._events)
            self._flush_requested += 1
            ticket = self._flush_requested
            asked = time.monotonic()
            self._kick = True
            self._cond.notify_all()
            while self._flush_done < ticket:
                if self._state in ("closed", "failed"):
                    break
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if self._outage:
                    # down: wait down_timeout for it to come back, not the whole timeout
                    down_left = max(asked, self._outage_since) + self.down_timeout - now
                    left = down_left if left is None else min(left, down_left)
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return not (self._metrics or self._events or self._inflight)

    def begin_finish(self, timeout: float | None = None) -> None:
        """Start finishing without waiting (the watcher finishes all its sinks at once, so two
        trackers that are down cost one ``down_timeout``, not two)."""
        timeout = self.finish_timeout if timeout is None else timeout
        with self._cond:
            if self._state in ("closing", "closed"):
                return
            if self._state in ("new", "failed"):
                undelivered = self._drain_locked()
                self._state = "closed"
                self._cond.notify_all()
            else:
                self._state = "closing"
                self._finish_at = time.monotonic()
                self._finish_budget = timeout
                self._kick = True
                self._cond.notify_all()
                return
        self._give_up(*undelivered, reason="it never started")

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
                while self._state != "closed" and thread.is_alive():
                    left = self._close_deadline() - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.25))  # a hang notifies nobody: look again soon
                stuck = self._state != "closed" and thread.is_alive()
            if stuck:
                # The worker is stuck in a call to the tracker; it is a daemon thread. What it
                # holds is reported with the rest (and not counted again if the call ever returns).
                with self._cond:
                    undelivered = self._drain_locked()
                    if self._inflight_item is not None:
                        held = self._as_lists(*self._inflight_item)
                        undelivered = (held[0] + undelivered[0], held[1] + undelivered[1])
                        self._inflight_item = None
                        self._abandoned = True
                self._give_up(*undelivered, reason=f"the tracker did not answer within "
                                                   f"{self._close_deadline() - (self._finish_at or 0):.0f} s")
        self._unregister_atexit()

    def _delivery_deadline(self) -> float | None:
        """While closing: until when the worker keeps trying (shorter while the tracker is down)."""
        if self._finish_at is None:
            return None
        budget = min(self._finish_budget, self.down_timeout) if self._down() else self._finish_budget
        return self._finish_at + budget

    def _down(self) -> bool:
        """Down: the last attempt failed, or the call under way has hung for ``down_timeout``
        (a host that drops packets never refuses the connection)."""
        started = self._call_started
        return self._outage or (started is not None and time.monotonic() - started > self.down_timeout)

    def _close_deadline(self) -> float:
        end = self._delivery_deadline()
        assert end is not None
        return end + (min(self.close_timeout, 1.0) if self._down() else self.close_timeout)

    def _past_deadline(self) -> bool:
        end = self._delivery_deadline()
        return end is not None and time.monotonic() >= end

    def _atexit_finish(self) -> None:
        self.finish(self.finish_timeout)

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
    def _status(self, level: Level, message: str) -> None:
        if self.on_status is not None:
            try:
                self.on_status(Event(step=-1, kind=Kind.SINK, level=level, message=self._redact(message),
                                     signal=self.name))
            except Exception:  # a status callback must not take the worker down
                log.exception("earlywarn: on_status callback of sink %r failed", self.name)

    def _sleep(self, seconds: float) -> None:
        """Backoff wait that ends early on flush() / finish()."""
        end = time.monotonic() + seconds
        with self._cond:
            while not self._kick:
                left = end - time.monotonic()
                deadline = self._delivery_deadline()
                if deadline is not None:
                    left = min(left, deadline - time.monotonic())
                if left <= 0:
                    break
                self._cond.wait(left)
            self._kick = False

    def _error_text(self, exc: BaseException) -> str:
        return self._redact(f"{type(exc).__name__}: {exc}")[:500]

    def _start_inner(self) -> bool:
        delay = self.backoff_initial
        deferred = False
        while True:
            try:
                self.inner.start()
            except SinkStarting:
                # Still coming up (it waited on its own): training goes on, ask again.
                with self._cond:
                    closing = self._state == "closing" and self._past_deadline()
                if not closing:
                    self._settled.set()
                    continue
                with self._cond:
                    undelivered = self._drain_locked()
                self._give_up(*undelivered, reason="it was still starting")
                with self._cond:
                    self._state = "closed"
                    self._cond.notify_all()
                return False
            except BaseException as exc:  # noqa: BLE001 - reported to the caller or retried
                permanent = isinstance(exc, _PERMANENT_START_ERRORS)
                transient = isinstance(exc, _TRANSIENT_START_ERRORS) and not permanent
                with self._cond:
                    closing = self._state == "closing"
                    fail = permanent or closing or (self._start_waiting and not transient)
                    if fail:
                        # A waiting caller warns and drops the sink; otherwise it is dropped here
                        # (a missing SDK or a bad option will not fix itself).
                        waiting = self._start_waiting
                        self._state = "closed" if closing else "failed"
                        self._start_error = exc
                        undelivered = self._drain_locked()
                        self._cond.notify_all()
                        self._settled.set()
                if fail:
                    if not waiting and not closing:
                        log.warning("earlywarn: sink %r failed to start (%s); continuing without it",
                                    self.name, self._error_text(exc))
                    if closing or not waiting:
                        self._give_up(*undelivered, reason=f"it could not start ({self._error_text(exc)})")
                    return False
                self._on_failure(exc, "start")
                if transient and not deferred:
                    deferred = True
                    self._settled.set()  # watch() goes on; this sink keeps trying in the background
                self._sleep(delay)
                delay = min(delay * 2, self.backoff_max)
                with self._cond:
                    if self._state == "closing" and self._past_deadline():
                        undelivered = self._drain_locked()
                        give_up = True
                    else:
                        give_up = False
                if give_up:  # finish() while the backend never came up
                    self._give_up(*undelivered, reason=f"it never started ({self.last_error})")
                    with self._cond:
                        self._state = "closed"
                        self._cond.notify_all()
                    return False
                continue
            with self._cond:
                if self._state == "starting":
                    self._state = "running"
            self._on_success()
            self._settled.set()
            self._register_atexit()
            return True

    def _on_failure(self, exc: BaseException, what: str) -> None:
        self.counters["failures"] += 1
        self.last_error = self._error_text(exc)
        with self._cond:
            was_down, self._outage = self._outage, True
            if not was_down:
                self._outage_since = time.monotonic()
            self._cond.notify_all()  # a finish() waiting on a healthy budget recomputes its deadline
        if not was_down:
            log.warning(
                "earlywarn: sink %r failed to %s (%s); buffering (up to %d values) and retrying with backoff",
                self.name,
                what,
                self.last_error,
                self.max_buffered_values,
            )
            self._status(Level.WARNING, f"tracker {self.name} is down: {self.last_error}")

    def _on_success(self) -> None:
        if self._outage:
            with self._cond:
                self._outage = False
                self._cond.notify_all()
            log.warning("earlywarn: sink %r is back; delivering buffered records", self.name)
            self._status(Level.INFO, f"tracker {self.name} is back")

    def _metrics_due_locked(self) -> float:
        """Seconds until buffered metrics should be delivered (<= 0: now): ``batch_interval``
        after the oldest one was logged, at once when a batch is full, on flush and on finish."""
        if (self.batch_interval <= 0 or self._state == "closing" or self._values >= self.max_batch_values
                or self._flush_done < self._flush_requested):
            return 0.0
        return self._metrics[0][2] + self.batch_interval - time.time()

    def _take_locked(self) -> tuple[str, Any, int]:
        if self._events:
            kind, args = self._events.popleft()
            return kind, args, 1
        step, m, t, n = self._metrics.popleft()
        batch, total = [(step, m, t)], n
        while self._metrics and total + self._metrics[0][3] <= self.max_batch_values:
            step, m, t, n = self._metrics.popleft()
            batch.append((step, m, t))
            total += n
        self._values_out += total
        return "metrics", batch, len(batch)

    def _deliver(self, kind: str, payload: Any) -> None:
        if kind == "metrics":
            self.inner.log_metrics_batch(payload)
            # what a step record really holds (now built), for the accounting of the next ones
            sizes = [len(m) for _, m, _ in payload if isinstance(m, StepMetrics)]
            if sizes:
                self._record_values = max(1, (4 * self._record_values + sum(sizes) // len(sizes)) // 5)
        elif kind == "alert":
            self.inner.alert(*payload)
        elif kind == "checkpoint":
            self.inner.checkpoint(*payload)

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang flush() / finish()
            log.exception("earlywarn: the worker of sink %r stopped; its records are dropped", self.name)
            with self._cond:
                self.last_error = self._error_text(exc)
                undelivered = self._drain_locked()
                self._inflight = 0
                self._state = "failed"
                self._settled.set()
                self._cond.notify_all()
            self._give_up(*undelivered, reason=f"its worker stopped ({self.last_error})")

    def _next_item_locked(self) -> tuple[str, Any, int] | None:
        """What to do next: an event, a batch of metrics, or None (flush answered / closing)."""
        while True:
            if self._events:
                return self._take_locked()
            if self._metrics:
                due = self._metrics_due_locked()
                if due <= 0:
                    return self._take_locked()
                self._worker_waiting = True
                self._cond.wait(due)
                self._worker_waiting = False
                continue
            if self._state == "closing" or self._flush_done < self._flush_requested:
                return None
            self._worker_waiting = True
            # metrics arrive without waking the worker (unless batch_interval is 0): look again then
            self._cond.wait(self.batch_interval if self.batch_interval > 0 else None)
            self._worker_waiting = False

    def _work(self) -> None:
        if not self._start_inner():
            return
        while True:
            with self._cond:
                item = self._next_item_locked()
                if item is None:
                    closing = self._state == "closing"
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
                give_up = not delivered and self._past_deadline()
                if give_up:
                    metrics, events = self._as_lists(kind, payload)
                    rest = self._drain_locked()
                    metrics += rest[0]
                    events += rest[1]
                self._cond.notify_all()
            if give_up:
                why = f"the tracker is down ({self.last_error})" if self._outage else "finish() ran out of time"
                self._give_up(metrics, events, reason=why)
                break
        self._finish_inner()

    def _deliver_with_retries(self, kind: str, payload: Any, count: int) -> bool:
        """Deliver one record (or batch), retrying with backoff. False: given up (closing, past
        the deadline); a record the tracker refuses counts as handled (rejected)."""
        delay = self.backoff_initial
        while True:
            self._call_started = time.monotonic()
            try:
                self._deliver(kind, payload)
            except PermanentSinkError as exc:
                self._call_started = None
                self.counters["rejected"] += count
                self.last_error = self._error_text(exc)
                if not self._warned_reject:
                    self._warned_reject = True
                    log.warning("earlywarn: sink %r rejected %d %s record(s), dropped (%s); "
                                "further rejections are only counted in stats()", self.name, count, kind,
                                self.last_error)
                return True
            except Exception as exc:  # noqa: BLE001 - a tracker error must never reach training
                self._call_started = None
                self._on_failure(exc, f"log {kind}")
                if self._past_deadline():
                    return False
                self._sleep(delay)
                delay = min(delay * 2, self.backoff_max)
                if self._past_deadline():
                    return False
                continue
            self._call_started = None
            self._on_success()
            if not self._abandoned:  # else finish() already reported it as not delivered
                self.counters["delivered_records" if kind == "metrics" else "delivered_events"] += count
            return True

    @staticmethod
    def _as_lists(kind: str, payload: Any) -> tuple[list, list]:
        return (list(payload), []) if kind == "metrics" else ([], [(kind, payload)])

    def _give_up(self, metrics: list, events: list, *, reason: str) -> None:
        """Spool (or drop) records that will not be delivered; warn once with the totals."""
        if not (metrics or events):
            return
        n_values = sum(len(m) for _, m, _ in metrics)
        where = None
        if self.spool_path is not None:
            try:
                self._spool(metrics, events, reason)
                where = self.spool_path
            except OSError as exc:
                reason += f"; writing {self.spool_path} failed: {exc}"
        with self._cond:
            if where is not None:
                self.counters["spooled_records"] += len(metrics)
                self.counters["spooled_events"] += len(events)
            else:
                self.counters["dropped_records"] += len(metrics)
                self.counters["dropped_values"] += n_values
                self.counters["dropped_events"] += len(events)
            first = not self._reported
            self._reported = True
        kept = f"kept in {where}" if where is not None else "dropped"
        what = [f"{len(metrics)} metric step(s) ({n_values} values)"] if metrics else []
        what += [f"{len(events)} event(s)"] if events else []
        msg = f"earlywarn: sink {self.name!r}: {' and '.join(what)} not delivered because {reason}: {kept}"
        if first:
            log.warning("%s", self._redact(msg))
        else:
            log.debug("%s", self._redact(msg))

    def _spool(self, metrics: list, events: list, reason: str) -> None:
        assert self.spool_path is not None
        parent = os.path.dirname(os.path.abspath(self.spool_path))
        os.makedirs(parent, exist_ok=True)
        with open(self.spool_path, "a", encoding="utf-8") as fh:
            head = {"type": "undelivered", "sink": self.name, "reason": self._redact(reason), "time": time.time()}
            fh.write(json.dumps(head) + "\n")
            for step, values, t in metrics:
                rec = {"type": "metrics", "step": step, "time": t, **{k: jsonable(v) for k, v in values.items()}}
                fh.write(json.dumps(rec, allow_nan=False) + "\n")
            for kind, args in events:
                if kind == "alert":
                    rec = {"type": "event", **args[0].to_dict()}
                else:
                    rec = {"type": kind, "step": args[0], "path": args[1], "reason": args[2]}
                fh.write(json.dumps(rec, allow_nan=False, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _inner_flush(self) -> None:
        try:
            deadline = self._delivery_deadline()
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self.inner.flush(left)
        except Exception as exc:  # noqa: BLE001
            self._on_failure(exc, "flush")

    def _finish_inner(self) -> None:
        try:
            self.inner.finish()
        except Exception as exc:  # noqa: BLE001
            log.warning("earlywarn: sink %r failed to finish: %s", self.name, self._error_text(exc))
        with self._cond:
            self._state = "closed"
            self._cond.notify_all()
