"""The background wrapper: never blocks the training thread, buffers and retries a tracker that is
down, warns once, drops the oldest past its bound (and counts), flushes and finishes on time."""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from earlywarn.events import Event, Kind, Level
from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import PermanentSinkError, Sink, register_sink, _REGISTRY
from earlywarn.sinks.defaults import build_sinks, default_sink_specs


class FakeTracker(Sink):
    """Records what it is given; ``down`` makes every call raise ConnectionError; ``delay`` makes
    every call slow."""

    name = "fake"
    io_bound = True

    def __init__(self, delay: float = 0.0, start_error: BaseException | None = None, start_delay: float = 0.0):
        self.delay = delay
        self.start_error = start_error
        self.start_delay = start_delay
        self.down = False
        self.calls = 0
        self.batches: list[list[int]] = []
        self.steps: list[int] = []
        self.events: list[Event] = []
        self.checkpoints: list[tuple] = []
        self.started = 0
        self.finished = 0
        self.flushed = 0

    def _io(self) -> None:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.down:
            raise ConnectionError("tracker unreachable")

    def start(self) -> None:
        if self.start_delay:
            time.sleep(self.start_delay)
        if self.start_error is not None:
            raise self.start_error
        self.started += 1

    def log_metrics_batch(self, records) -> None:
        self._io()
        self.batches.append([s for s, _, _ in records])
        self.steps.extend(s for s, _, _ in records)

    def alert(self, event: Event) -> None:
        self._io()
        self.events.append(event)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        self._io()
        self.checkpoints.append((step, path, reason))

    def flush(self, timeout=None) -> bool:
        self.flushed += 1
        return True

    def finish(self) -> None:
        self.finished += 1


def metrics(n: int = 10) -> dict[str, float]:
    return {f"earlywarn/m{i}": float(i) for i in range(n)}


def event(step: int, level: Level = Level.WARNING) -> Event:
    return Event(step=step, kind=Kind.GRAD_SPIKE, level=level, message="spike", layers=("l1",))


def fast_bg(inner: Sink, **kw) -> BackgroundSink:
    kw.setdefault("backoff_initial", 0.01)
    kw.setdefault("backoff_max", 0.05)
    kw.setdefault("exit_on_sigterm", False)
    return BackgroundSink(inner, **kw)


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_delivers_in_order_in_batches_then_finishes():
    inner = FakeTracker()
    sink = fast_bg(inner, max_batch_values=35)
    sink.start()
    sink.start()  # harmless
    for s in range(20):
        sink.log_metrics(s, metrics(10))
    sink.alert(event(7))
    sink.checkpoint(10, "/ckpt/10", "periodic")
    assert sink.flush(10)
    assert inner.steps == list(range(20))
    assert max(len(b) for b in inner.batches) <= 3  # 35 values / 10 per record
    assert len(inner.batches) < 20  # batched, not one call per step
    assert [e.step for e in inner.events] == [7]
    assert inner.checkpoints == [(10, "/ckpt/10", "periodic")]
    assert inner.flushed >= 1
    sink.finish()
    sink.finish()
    assert inner.started == 1 and inner.finished == 1
    sink.log_metrics(99, metrics())  # after finish: ignored, no error
    assert sink.stats()["state"] == "closed"
    assert sink.stats()["delivered_records"] == 20 and sink.stats()["delivered_events"] == 2


def test_slow_tracker_does_not_slow_the_training_thread():
    inner = FakeTracker(delay=0.05)  # 50 ms per call
    sink = fast_bg(inner, max_batch_values=4000)  # the backlog drains 20 steps per call
    sink.start()
    times = []
    for s in range(200):
        t0 = time.perf_counter()
        sink.log_metrics(s, metrics(200))
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.002, statistics.median(times)
    assert sum(times) < 1.0  # 200 direct calls would take 10 s
    assert sink.flush(30)
    assert inner.steps == list(range(200))
    sink.finish()


def test_down_tracker_buffers_warns_once_and_delivers_when_back(caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    inner = FakeTracker()
    status: list[Event] = []
    sink = fast_bg(inner, on_status=status.append)
    sink.start()
    sink.log_metrics(0, metrics())
    assert sink.flush(5)
    inner.down = True
    times = []
    for s in range(1, 51):
        t0 = time.perf_counter()
        sink.log_metrics(s, metrics())
        times.append(time.perf_counter() - t0)
    sink.alert(event(30))
    assert wait_for(lambda: sink.stats()["failures"] >= 5)
    assert max(times) < 0.25  # never waits on the failing tracker (generous: shared CPUs)
    assert not sink.flush(0.2)  # still down: flush reports what is left instead of hanging
    down_warnings = [r for r in caplog.records if "failed to" in r.getMessage()]
    assert len(down_warnings) == 1, [r.getMessage() for r in caplog.records]
    inner.down = False
    assert sink.flush(10)
    assert inner.steps == list(range(51))  # in order, nothing lost, nothing twice
    assert [e.step for e in inner.events] == [30]
    assert any("is back" in r.getMessage() for r in caplog.records)
    assert [(e.kind, e.level, e.signal) for e in status] == [
        (Kind.SINK, Level.WARNING, "fake"), (Kind.SINK, Level.INFO, "fake")]  # down, back
    st = sink.stats()
    assert st["dropped_records"] == 0 and st["pending_records"] == 0 and st["failures"] >= 5
    sink.finish()


def test_drops_oldest_past_the_bound_and_counts_but_keeps_events(caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    inner = FakeTracker()
    inner.down = True
    sink = fast_bg(inner, max_buffered_values=100, max_batch_values=10)
    sink.start()
    for s in range(50):
        sink.log_metrics(s, metrics(10))
        if s % 10 == 0:
            sink.alert(event(s))
    assert wait_for(lambda: sink.stats()["failures"] >= 1)
    st = sink.stats()
    assert st["pending_values"] <= 100
    inner.down = False
    assert sink.flush(10)
    st = sink.stats()
    # newest kept; the record already in flight when the bound was hit is the only older one
    assert inner.steps[-10:] == list(range(40, 50))
    assert len(inner.steps) + st["dropped_records"] == 50
    assert st["dropped_records"] >= 39 and st["dropped_values"] == 10 * st["dropped_records"]
    assert [e.step for e in inner.events] == [0, 10, 20, 30, 40]  # metrics never push out events
    assert sum("dropping" in r.getMessage() for r in caplog.records) == 1
    sink.finish()


def test_event_bound_drops_oldest_events():
    inner = FakeTracker()
    inner.down = True
    sink = fast_bg(inner, max_buffered_events=3)
    sink.start()
    for s in range(10):
        sink.alert(event(s))
    inner.down = False
    assert sink.flush(10)
    steps = [e.step for e in inner.events]
    assert steps[-3:] == [7, 8, 9] and len(steps) + sink.stats()["dropped_events"] == 10


def test_permanent_error_is_dropped_not_retried():
    class Rejecting(FakeTracker):
        def alert(self, event):
            self.calls += 1
            raise PermanentSinkError("HTTP 400 bad value")

    inner = Rejecting()
    sink = fast_bg(inner)
    sink.start()
    sink.alert(event(1))
    sink.log_metrics(1, metrics())
    assert sink.flush(5)
    assert inner.calls == 2  # one alert attempt + one metrics batch
    assert sink.stats()["rejected"] == 1 and inner.steps == [1]
    sink.finish()


def test_start_failure_is_raised_within_timeout_and_build_sinks_drops_it(caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    sink = fast_bg(FakeTracker(start_error=ImportError("no module named tracker")))
    with pytest.raises(ImportError):
        sink.start()
    sink.finish()
    sink.finish()

    register_sink("fake-broken", lambda **kw: FakeTracker(start_error=RuntimeError("auth failed"), **kw), overwrite=True)
    register_sink("fake-ok", lambda **kw: FakeTracker(**kw), overwrite=True)
    try:
        sinks = build_sinks(["fake-broken", "fake-ok"], {"fake-ok": {"delay": 0.0}}, background_options={"exit_on_sigterm": False})
    finally:
        _REGISTRY.pop("fake-broken")
        _REGISTRY.pop("fake-ok")
    assert [type(s).__name__ for s in sinks] == ["BackgroundSink"]
    assert isinstance(sinks[0].inner, FakeTracker) and sinks[0].inner.started == 1
    assert any("failed to start" in r.getMessage() and "auth failed" in r.getMessage() for r in caplog.records)
    for s in sinks:
        s.finish()


def test_slow_start_buffers_and_delivers_after_start():
    inner = FakeTracker(start_delay=0.5)
    sink = fast_bg(inner, start_timeout=0.05)
    t0 = time.perf_counter()
    sink.start()
    assert time.perf_counter() - t0 < 0.4
    for s in range(5):
        sink.log_metrics(s, metrics())
    assert sink.flush(10)
    assert inner.started == 1 and inner.steps == list(range(5))
    sink.finish()


def test_late_start_failure_retries_if_transient_and_drops_if_permanent(caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    flaky = FakeTracker(start_delay=0.2, start_error=ConnectionError("server not up yet"))
    sink = fast_bg(flaky, start_timeout=0.01)
    sink.start()  # still starting when the wait ends: kept, buffering
    sink.log_metrics(0, metrics())
    assert wait_for(lambda: sink.stats()["failures"] >= 1)
    flaky.start_error = None  # the server came up
    assert sink.flush(10) and flaky.steps == [0]
    sink.finish()

    broken = FakeTracker(start_delay=0.2, start_error=ImportError("No module named 'wandb'"))
    sink = fast_bg(broken, start_timeout=0.01)
    sink.start()
    assert wait_for(lambda: sink.stats()["state"] == "failed")
    sink.log_metrics(1, metrics())  # ignored, no error, no growing buffer
    assert sink.stats()["pending_records"] == 0
    assert any("failed to start" in r.getMessage() and "wandb" in r.getMessage() for r in caplog.records)
    sink.finish()


def test_finish_with_tracker_down_returns_on_time_and_counts_losses(caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    inner = FakeTracker()
    sink = fast_bg(inner, backoff_initial=5.0, backoff_max=5.0)
    sink.start()
    inner.down = True
    for s in range(10):
        sink.log_metrics(s, metrics())
    sink.alert(event(3))
    t0 = time.perf_counter()
    sink.finish(timeout=0.5)
    assert time.perf_counter() - t0 < 2.0
    st = sink.stats()
    assert st["state"] == "closed" and inner.finished == 1
    assert st["dropped_records"] == 10 and st["dropped_events"] == 1
    assert any("not delivered" in r.getMessage() for r in caplog.records)


def test_state_dict_round_trip():
    sink = fast_bg(FakeTracker())
    sink.counters["dropped_values"] = 12
    other = fast_bg(FakeTracker())
    other.load_state_dict(sink.state_dict())
    assert other.counters["dropped_values"] == 12


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="max_buffered_values"):
        BackgroundSink(FakeTracker(), max_buffered_values=0)
    with pytest.raises(ValueError, match="already a BackgroundSink"):
        BackgroundSink(BackgroundSink(FakeTracker()))


def test_default_specs_and_env_override(monkeypatch):
    monkeypatch.delenv("EARLYWARN_SINKS", raising=False)
    assert default_sink_specs()[:2] == ["console", "jsonl"]
    monkeypatch.setenv("EARLYWARN_SINKS", " console, jsonl ,")
    assert default_sink_specs() == ["console", "jsonl"]
    monkeypatch.setenv("EARLYWARN_SINKS", "none")
    assert default_sink_specs() == []


def test_default_specs_without_mlflow_note_once(monkeypatch, caplog):
    import importlib.util

    import earlywarn.sinks.defaults as defaults

    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    monkeypatch.delenv("EARLYWARN_SINKS", raising=False)
    monkeypatch.setattr(defaults, "_noted", False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert defaults.default_sink_specs() == ["console", "jsonl"]
    assert defaults.default_sink_specs() == ["console", "jsonl"]
    assert sum("mlflow is not installed" in r.getMessage() for r in caplog.records) == 1


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from earlywarn.sinks.base import Sink
    from earlywarn.sinks.background import BackgroundSink

    class SlowFile(Sink):
        name = "slowfile"
        def __init__(self, path): self.path = path
        def start(self): self.fh = open(self.path, "w")
        def log_metrics(self, step, metrics):
            time.sleep(0.02)  # a slow tracker: records pile up in the buffer
            self.fh.write(json.dumps({"step": step}) + "\\n")
        def finish(self):
            self.fh.write(json.dumps({"finished": True}) + "\\n"); self.fh.close()

    sink = BackgroundSink(SlowFile(sys.argv[1]))
    sink.start()
    for step in range(100):
        sink.log_metrics(step, {"earlywarn/x": 1.0})
        if step == 49:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler does on pre-emption
    print("unreachable")
    """
)


def test_sigterm_flushes_the_buffer_before_exit(tmp_path):
    out = tmp_path / "out.jsonl"
    script = tmp_path / "job.py"
    script.write_text(SIGTERM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + 15, proc.stderr
    assert "unreachable" not in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[-1] == {"finished": True}
    assert [r["step"] for r in lines[:-1]] == list(range(50))  # all buffered steps arrived


CHAINED_SIGTERM_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    from earlywarn.sinks.base import Sink
    from earlywarn.sinks.background import BackgroundSink
    from earlywarn.sinks.sigterm import install_sigterm_exit, signal_exit_code

    mode, path = sys.argv[1], sys.argv[2]
    calls = []

    def launcher_handler(signum, frame):  # installed before earlywarn, e.g. by a launcher
        calls.append(signum)
        if mode == "raises":
            raise SystemExit(99)

    if mode == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, launcher_handler)

    class File(Sink):
        name = "file"
        def start(self): self.fh = open(path, "w")
        def log_metrics(self, step, metrics): self.fh.write(json.dumps({"step": step}) + "\\n")
        def finish(self):
            self.fh.write(json.dumps({"finished": True, "killed": signal_exit_code()}) + "\\n"); self.fh.close()

    sinks = [BackgroundSink(File()), BackgroundSink(File())]  # two sinks: one handler, installed once
    sinks[0].start()
    print("installed again:", install_sigterm_exit(), flush=True)
    for step in range(20):
        sinks[0].log_metrics(step, {"earlywarn/x": 1.0})
    os.kill(os.getpid(), signal.SIGTERM)
    print("went on; launcher handler calls:", len(calls), "; exit code seen:", signal_exit_code(), flush=True)
    sinks[0].finish()
    """
)


@pytest.mark.parametrize("mode", ["raises", "returns", "ignored"])
def test_sigterm_handler_chains_the_one_installed_before(tmp_path, mode):
    # A launcher's or framework's SIGTERM handler keeps its say: earlywarn's runs after it, once.
    # If it ends the process, buffered records are still delivered and the run is marked killed;
    # if it returns (it handles SIGTERM its own way), training goes on; an ignored SIGTERM stays ignored.
    out = tmp_path / "out.jsonl"
    script = tmp_path / "job.py"
    script.write_text(CHAINED_SIGTERM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mode, str(out)], capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in lines[:-1]] == list(range(20))
    if mode == "raises":
        assert proc.returncode == 99, proc.stderr
        assert "went on" not in proc.stdout
        assert lines[-1] == {"finished": True, "killed": 143}
    else:
        assert proc.returncode == 0, proc.stderr
        calls = 1 if mode == "returns" else 0
        assert f"went on; launcher handler calls: {calls} ; exit code seen: None" in proc.stdout
        assert lines[-1] == {"finished": True, "killed": None}
    assert f"installed again: {mode != 'ignored'}" in proc.stdout
