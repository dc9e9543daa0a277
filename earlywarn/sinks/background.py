"""Run any sink on a background thread, so a tracker that is slow or down never stalls training.

The training thread only appends to a bounded in-memory buffer (a few microseconds). One worker
thread per sink starts the backend, delivers metrics in batches and events one by one, retries a
failure with exponential backoff (the record stays at the head of the line), warns once per
outage, and past the bound drops the *oldest* metric records, counting them. Events and
checkpoint records have their own, separate bound, so a flood of metrics never pushes out an
alert. ``flush(timeout)`` and ``finish(timeout)`` never block longer than asked.
"""

from __future__ import annotations

import atexit
import collections
import logging
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping

from earlywarn.events import Event, Kind, Level
from earlywarn.sinks.base import PermanentSinkError, Sink

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


class BackgroundSink(Sink):
    """Wraps ``inner`` so that every call from the training thread returns at once.

    Metrics are buffered as ``(step, metrics, time)`` records (the time is taken when logged, so a
    tracker that was down still gets the right timestamps) and handed to
    ``inner.log_metrics_batch`` up to ``max_batch_values`` values at a time. Any exception from
    ``inner`` is retried with backoff ``backoff_initial`` doubling up to ``backoff_max`` seconds;
    :class:`~earlywarn.sinks.base.PermanentSinkError` drops that record instead (counted as
    ``rejected``). ``flush()`` retries at once, skipping the rest of a backoff wait.
    """

    io_bound = False  # already off the training thread: never wrap twice

    def __init__(
        self,
        inner: Sink,
        *,
        max_buffered_values: int = 500_000,
        max_buffered_events: int = 10_000,
        max_batch_values: int = 1000,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        start_timeout: float = 15.0,
        finish_timeout: float = 30.0,
        close_timeout: float = 10.0,
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
        for field_name, value in (
            ("backoff_initial", backoff_initial),
            ("backoff_max", backoff_max),
            ("start_timeout", start_timeout),
            ("finish_timeout", finish_timeout),
            ("close_timeout", close_timeout),
        ):
            if not value >= 0:
                raise ValueError(f"BackgroundSink.{field_name}={value!r}: use a number of seconds >= 0")
        self.inner = inner
        self.name = inner.name
        self.main_process_only = inner.main_process_only
        self.max_buffered_values = max_buffered_values
        self.max_buffered_events = max_buffered_events
        self.max_batch_values = max_batch_values
        self.backoff_initial = backoff_initial
        self.backoff_max = max(backoff_max, backoff_initial)
        self.start_timeout = start_timeout
        self.finish_timeout = finish_timeout
        self.close_timeout = close_timeout
        self.exit_on_sigterm = exit_on_sigterm
        self.on_status = on_status

        self._cond = threading.Condition(threading.Lock())
        self._metrics: collections.deque[tuple[int, dict[str, float], float]] = collections.deque()
        self._values = 0  # values in self._metrics
        self._events: collections.deque[tuple[str, tuple]] = collections.deque()
        self._inflight = 0  # records taken by the worker and not yet delivered / dropped
        self._worker_waiting = False
        self._kick = False  # flush() asked for a retry now
        self._flush_requested = 0
        self._flush_done = 0
        self._state = "new"  # new -> starting -> running -> closing -> closed | failed
        self._start_waiting = False
        self._start_error: BaseException | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None
        self._outage = False
        self._warned_drop = False
        self._warned_reject = False
        self._atexit_registered = False
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "delivered_records",
                "delivered_events",
                "dropped_records",
                "dropped_values",
                "dropped_events",
                "rejected",
                "failures",
            ),
            0,
        )
        self.last_error: str | None = None

    # ------------------------------------------------------------------ training-thread side
    def start(self) -> None:
        """Start the worker, which starts ``inner``; wait up to ``start_timeout`` for that.

        Raises what ``inner.start()`` raised if it failed within ``start_timeout`` (the caller
        drops the sink). A start still running after the timeout carries on in the background:
        records are buffered meanwhile, and a later failure is retried with backoff.
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
        self._thread = threading.Thread(target=self._run, name=f"earlywarn-sink-{self.name}", daemon=True)
        self._thread.start()
        return True

    def wait_started(self, timeout: float | None) -> bool:
        """Wait for ``inner.start()``; True once it succeeded. Re-raises its error, see ``start``."""
        if self._state == "new":
            return False
        done = self._started.wait(timeout)
        with self._cond:
            self._start_waiting = False
            if self._state == "failed" and self._start_error is not None:
                raise self._start_error
        if not done:
            log.warning(
                "earlywarn: sink %r is still starting after %.0f s; buffering its records meanwhile",
                self.name,
                timeout or 0.0,
            )
        return done

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        # Copied here: the caller may reuse its dict; the time is when it was logged.
        self._put_metrics(int(step), dict(metrics), time.time())

    def _put_metrics(self, step: int, metrics: dict[str, float], t: float) -> None:
        n = len(metrics)
        with self._cond:
            if self._state in ("closing", "closed", "failed"):
                return
            self._metrics.append((step, metrics, t))
            self._values += n
            if self._values > self.max_buffered_values:
                self._drop_oldest_locked()
            if self._worker_waiting:
                self._cond.notify()

    def log_metrics_batch(self, records) -> None:
        """Buffer several ``(step, metrics, unix_time)`` records, keeping their times."""
        for step, metrics, t in records:
            self._put_metrics(int(step), dict(metrics), float(t))

    def alert(self, event: Event) -> None:
        self._put_event("alert", (event,))

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        self._put_event("checkpoint", (int(step), str(path), str(reason)))

    def _put_event(self, kind: str, args: tuple) -> None:
        with self._cond:
            if self._state in ("closing", "closed", "failed"):
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
            _, old, _ = self._metrics.popleft()
            self._values -= len(old)
            self.counters["dropped_records"] += 1
            self.counters["dropped_values"] += len(old)
        self._note_drop_locked()

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
        """Counters (delivered / dropped / rejected / failures), what is pending, state, last error."""
        with self._cond:
            return {
                **self.counters,
                "pending_records": len(self._metrics),
                "pending_values": self._values,
                "pending_events": len(self._events),
                "inflight": self._inflight,
                "state": self._state,
                "last_error": self.last_error,
            }

    def flush(self, timeout: float | None = None) -> bool:
        """Deliver everything buffered now (retrying at once), then ``inner.flush``.

        Returns True when nothing is left, False when ``timeout`` ran out first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._state in ("new", "closed", "failed") or self._thread is None:
                return not (self._metrics or self._events)
            self._flush_requested += 1
            ticket = self._flush_requested
            self._kick = True
            self._cond.notify_all()
            while self._flush_done < ticket:
                if self._state in ("closed", "failed"):
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return not (self._metrics or self._events or self._inflight)

    def finish(self, timeout: float | None = None) -> None:
        """Deliver what is buffered (up to ``timeout``, default ``finish_timeout``), then
        ``inner.finish()`` (closing a run, W&B's teardown), which gets up to ``close_timeout``
        more. Safe to call twice; records still undelivered at the deadline are counted as
        dropped and reported in one warning."""
        timeout = self.finish_timeout if timeout is None else timeout
        with self._cond:
            if self._state in ("closing", "closed"):
                thread = self._thread
            elif self._state in ("new", "failed"):
                dropped = len(self._metrics) + len(self._events)
                self._state = "closed"
                self._metrics.clear()
                self._events.clear()
                self._values = 0
                if dropped:
                    log.warning("earlywarn: sink %r finished before it started; %d records not delivered", self.name, dropped)
                return
            else:
                self._state = "closing"
                self._deadline = time.monotonic() + timeout
                self._kick = True
                self._cond.notify_all()
                thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout + self.close_timeout)
            if thread.is_alive():
                log.warning(
                    "earlywarn: sink %r did not finish within %.0f s (%d records pending); continuing without it",
                    self.name,
                    timeout + self.close_timeout,
                    self.pending(),
                )
        self._unregister_atexit()

    def _atexit_finish(self) -> None:
        self.finish(self.finish_timeout)

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
                self.on_status(Event(step=-1, kind=Kind.SINK, level=level, message=message, signal=self.name))
            except Exception:  # a status callback must not take the worker down
                log.exception("earlywarn: on_status callback of sink %r failed", self.name)

    def _sleep(self, seconds: float) -> None:
        """Backoff wait that ends early on flush() / finish()."""
        end = time.monotonic() + seconds
        with self._cond:
            while not self._kick:
                left = end - time.monotonic()
                if self._deadline is not None:
                    left = min(left, self._deadline - time.monotonic())
                if left <= 0:
                    break
                self._cond.wait(left)
            self._kick = False

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _start_inner(self) -> bool:
        delay = self.backoff_initial
        while True:
            try:
                self.inner.start()
            except BaseException as exc:  # noqa: BLE001 - reported to the caller or retried
                permanent = isinstance(exc, _PERMANENT_START_ERRORS)
                with self._cond:
                    if self._start_waiting or permanent or self._state == "closing":
                        # Fail fast: a waiting caller warns and drops the sink; otherwise it is
                        # dropped here (a missing SDK or bad option will not fix itself).
                        waiting = self._start_waiting
                        self._state = "failed"
                        self._start_error = exc
                        self._metrics.clear()
                        self._events.clear()
                        self._values = 0
                        self._cond.notify_all()
                        self._started.set()
                    else:
                        waiting = None
                if waiting is False:
                    log.warning("earlywarn: sink %r failed to start (%s: %s); continuing without it",
                                self.name, type(exc).__name__, exc)
                if waiting is not None:
                    return False
                self._on_failure(exc, "start")
                self._sleep(delay)
                delay = min(delay * 2, self.backoff_max)
                with self._cond:
                    if self._state == "closing":  # finish() while the backend never came up
                        self._drop_all_locked()
                        self._state = "closed"
                        self._cond.notify_all()
                        self._started.set()
                        return False
                continue
            with self._cond:
                if self._state == "starting":
                    self._state = "running"
            self._on_success()
            self._started.set()
            # Registered after the backend started, so this runs before the backend's own atexit
            # teardown (atexit is last-in first-out): queued records reach it while it is alive.
            atexit.register(self._atexit_finish)
            self._atexit_registered = True
            return True

    def _on_failure(self, exc: BaseException, what: str) -> None:
        self.counters["failures"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:500]
        if not self._outage:
            self._outage = True
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
            self._outage = False
            log.warning("earlywarn: sink %r is back; delivering buffered records", self.name)
            self._status(Level.INFO, f"tracker {self.name} is back")

    def _take_locked(self) -> tuple[str, Any, int]:
        if self._events:
            kind, args = self._events.popleft()
            return kind, args, 1
        batch = [self._metrics.popleft()]
        n = len(batch[0][1])
        while self._metrics and n + len(self._metrics[0][1]) <= self.max_batch_values:
            rec = self._metrics.popleft()
            n += len(rec[1])
            batch.append(rec)
        self._values -= n
        return "metrics", batch, len(batch)

    def _deliver(self, kind: str, payload: Any) -> None:
        if kind == "metrics":
            self.inner.log_metrics_batch(payload)
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
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                self._drop_all_locked()
                self._inflight = 0
                self._state = "failed"
                self._started.set()
                self._cond.notify_all()

    def _work(self) -> None:
        if not self._start_inner():
            return
        while True:
            with self._cond:
                while not (self._metrics or self._events):
                    if self._state == "closing" or self._flush_done < self._flush_requested:
                        break
                    self._worker_waiting = True
                    self._cond.wait()
                    self._worker_waiting = False
                if not (self._metrics or self._events):
                    closing = self._state == "closing"
                    flush_ticket = self._flush_requested
                    item = None
                else:
                    item = self._take_locked()
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
            delay = self.backoff_initial
            while True:
                try:
                    self._deliver(kind, payload)
                except PermanentSinkError as exc:
                    self.counters["rejected"] += count
                    self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                    if not self._warned_reject:
                        self._warned_reject = True
                        log.warning("earlywarn: sink %r rejected %d %s record(s), dropped (%s); "
                                    "further rejections are only counted in stats()", self.name, count, kind, exc)
                    break
                except Exception as exc:  # noqa: BLE001 - a tracker error must never reach training
                    self._on_failure(exc, f"log {kind}")
                    if self._past_deadline():
                        self._count_dropped(kind, payload)
                        break
                    self._sleep(delay)
                    delay = min(delay * 2, self.backoff_max)
                    if self._past_deadline():
                        self._count_dropped(kind, payload)
                        break
                    continue
                self._on_success()
                self.counters["delivered_records" if kind == "metrics" else "delivered_events"] += count
                break
            with self._cond:
                self._inflight = 0
                if self._past_deadline():
                    self._drop_all_locked()
                self._cond.notify_all()
        self._finish_inner()

    def _count_dropped(self, kind: str, payload: Any) -> None:
        if kind == "metrics":
            self.counters["dropped_records"] += len(payload)
            self.counters["dropped_values"] += sum(len(m) for _, m, _ in payload)
        else:
            self.counters["dropped_events"] += 1

    def _drop_all_locked(self) -> None:
        n = len(self._metrics) + len(self._events)
        if n:
            self.counters["dropped_records"] += len(self._metrics)
            self.counters["dropped_values"] += self._values
            self.counters["dropped_events"] += len(self._events)
            log.warning("earlywarn: sink %r: %d buffered records not delivered (dropped)", self.name, n)
        self._metrics.clear()
        self._events.clear()
        self._values = 0

    def _inner_flush(self) -> None:
        try:
            left = None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)
            self.inner.flush(left)
        except Exception as exc:  # noqa: BLE001
            self._on_failure(exc, "flush")

    def _finish_inner(self) -> None:
        try:
            self.inner.finish()
        except Exception as exc:  # noqa: BLE001
            log.warning("earlywarn: sink %r failed to finish: %s", self.name, exc)
        with self._cond:
            self._state = "closed"
            self._cond.notify_all()
