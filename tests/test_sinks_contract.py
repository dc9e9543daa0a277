"""Composer-style contract: every registered sink can be built by name, started and finished twice,
and takes every kind of record; user sinks register by name; importing sinks pulls in no SDK."""

from __future__ import annotations

import csv
import http.server
import io
import json
import subprocess
import sys
import threading

import pytest

from earlywarn.events import Event, Kind, Level
from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import _REGISTRY, Sink, make_sink, register_sink, registered_sinks
from earlywarn.sinks.defaults import build_sinks


pytestmark = pytest.mark.filterwarnings("ignore:.*noload.*:DeprecationWarning")  # inside mlflow's store


@pytest.fixture
def webhook_url():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


@pytest.fixture
def sink_options(request, tmp_path, webhook_url):
    """Options that make each built-in sink run hermetically. A new sink added to the registry
    needs an entry here (or must be constructible without options)."""
    opts = {
        "console": {"stream": io.StringIO()},
        "jsonl": {"path": str(tmp_path / "events.jsonl"), "metrics": True},
        "webhook": {"url": webhook_url},
    }
    name = request.node.callspec.params["name"]
    if name == "mlflow":
        pytest.importorskip("mlflow")
        opts["mlflow"] = {"tracking_uri": request.getfixturevalue("mlflow_sqlite_uri"), "experiment": "contract",
                          "start_timeout": 60}  # the writer process may take seconds to start on a busy host
    if name == "wandb":
        pytest.importorskip("wandb")
        request.getfixturevalue("wandb_env")
        opts["wandb"] = {"project": "contract"}
    return opts.get(name, {})


def exercise(sink: Sink) -> None:
    sink.start()
    sink.start()
    sink.log_metrics(0, {"earlywarn/grad_norm": 1.0, "earlywarn/alert_level": 0.0})
    sink.log_metrics_batch([(1, {"earlywarn/grad_norm": float("nan")}, 1.7e9), (2, {"earlywarn/grad_norm": 2.0}, 1.7e9)])
    sink.alert(Event(step=2, kind=Kind.GRAD_SPIKE, level=Level.WARNING, message="spike", layers=("l0",)))
    sink.checkpoint(2, "/nonexistent/ckpt.pt", "warning")
    assert sink.flush(30)
    sink.finish()
    sink.finish()
    sink.start()  # after finish: harmless
    sink.finish()


@pytest.mark.parametrize("name", registered_sinks())
def test_every_registered_sink_runs_start_finish_twice(name, sink_options):
    sink = make_sink(name, sink_options)
    assert isinstance(sink, Sink) and sink.name == name
    exercise(sink)


@pytest.mark.parametrize("name", registered_sinks())
def test_every_registered_sink_runs_on_the_background_thread(name, sink_options):
    sink = BackgroundSink(make_sink(name, sink_options), exit_on_sigterm=False)
    exercise(sink)
    st = sink.stats()
    # a sink that does nothing with metrics (it overrides neither log_metrics method) gets none
    assert st["delivered_records"] == (3 if sink.takes_metrics else 0)
    assert st["delivered_events"] == 2 and st["rejected"] == 0


class CsvSink(Sink):
    """A user's own sink (accelerate's CSV tracker test, with alerts)."""

    name = "csv"

    def __init__(self, path: str):
        self.path = path
        self.rows: list[dict] = []

    def log_metrics(self, step, metrics):
        self.rows.append({"step": step, **metrics})

    def alert(self, event):
        self.rows.append({"step": event.step, "alert": str(event.kind)})

    def finish(self):
        with open(self.path, "w", newline="") as fh:
            keys = sorted({k for r in self.rows for k in r})
            w = csv.DictWriter(fh, keys)
            w.writeheader()
            w.writerows(self.rows)


def test_user_sink_registers_by_name_with_options(tmp_path):
    register_sink("csv", CsvSink)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_sink("csv", CsvSink)
        (sink,) = build_sinks(["csv"], {"csv": {"path": str(tmp_path / "m.csv")}})
        assert isinstance(sink, CsvSink)  # not io_bound: runs inline, no thread
        sink.log_metrics(1, {"earlywarn/grad_norm": 0.5})
        sink.alert(Event(step=1, kind=Kind.SKIP, level=Level.INFO, message="skipped"))
        sink.finish()
        rows = list(csv.DictReader(open(tmp_path / "m.csv")))
        assert rows[0]["earlywarn/grad_norm"] == "0.5" and rows[1]["alert"] == "skip"
    finally:
        _REGISTRY.pop("csv", None)


def test_unknown_sink_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown sink 'wandbb'.*register_sink"):
        build_sinks(["wandbb"])


def test_trackers_are_registered_lazily_and_io_bound():
    for name in ("wandb", "mlflow", "webhook"):
        assert isinstance(_REGISTRY[name], str) and ":" in _REGISTRY[name]
    assert make_sink("webhook", {"url": "http://127.0.0.1:1/x"}).io_bound


def test_importing_sinks_and_integrations_pulls_in_no_sdk():
    code = (
        "import sys, json\n"
        "import earlywarn.sinks.base, earlywarn.sinks.background, earlywarn.sinks.defaults, earlywarn.sinks.webhook\n"
        "import earlywarn.metrics, earlywarn.integrations\n"
        "import earlywarn.integrations.mlflow_sink, earlywarn.integrations.wandb_sink\n"
        "import earlywarn.integrations.wandb_offline_reader\n"
        "from earlywarn.sinks.defaults import default_sink_specs; default_sink_specs()\n"
        "from earlywarn.sinks.base import make_sink; make_sink('mlflow'); make_sink('wandb')\n"
        "print(json.dumps(sorted(m for m in ('torch', 'wandb', 'mlflow') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == []


def test_tag_text_is_cut_at_a_word_and_the_tally_keeps_the_worst():
    from earlywarn.sinks.base import EventTally, alert_line, shorten

    assert shorten("one two three four", 12) == "one two..."
    assert shorten("abcdefghijklmnop", 8) == "abcde..."  # one word longer than the limit: cut, marked
    long = Event(step=7, kind=Kind.GRAD_SPIKE, level=Level.INFO, message="word " * 200, layers=("l0",))
    line = alert_line(long, 100)
    assert len(line) <= 100 and line.endswith("word...") and line.startswith("earlywarn info: grad_spike in l0 @ step 7:")
    t = EventTally()
    t.update(Event(step=20, kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL, message="x"))
    t.update(Event(step=30, kind=Kind.CHECKPOINT, level=Level.INFO, message="x"))
    changed = t.update(Event(step=40, kind=Kind.GRAD_SPIKE, level=Level.INFO, message="x"))
    assert changed == {"kinds": "checkpoint,grad_spike,nonfinite_grad", "count.grad_spike": 1}  # the worst stays
    assert t.as_dict()["status"] == "critical" and t.first_critical == t.last_critical == ("nonfinite_grad", 20)
    resumed = EventTally()
    resumed.restore_tags({"earlywarn.status": "warning", "earlywarn.count.skip": "3",
                          "earlywarn.first_critical_kind": "skip", "earlywarn.first_critical_step": "5"}, "earlywarn.")
    assert resumed.worst == Level.WARNING and resumed.counts == {"skip": 3} and resumed.first_critical == ("skip", 5)


def test_no_metrics_are_built_when_no_sink_takes_them(monkeypatch):
    torch = pytest.importorskip("torch")
    import earlywarn
    import earlywarn.guard.telemetry as guard
    from fixtures_models import MLP

    built = []
    real = guard.StepMetrics
    monkeypatch.setattr(guard, "StepMetrics", lambda *a, **k: built.append(a[0]) or real(*a, **k))

    class EventsOnly(Sink):
        name = "events-only"

        def __init__(self):
            self.events = []

        def alert(self, event):
            self.events.append(event)

    class Rows(EventsOnly):
        name = "rows"

        def __init__(self):
            super().__init__()
            self.rows = []

        def log_metrics(self, step, metrics):
            self.rows.append((step, dict(metrics)))

    for sinks, expect_rows in (([EventsOnly()], False), ([EventsOnly(), Rows()], True)):
        built.clear()
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ew = earlywarn.watch(model, opt, sinks=sinks)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        ew.close()
        assert (built == [0, 1, 2]) is expect_rows
        if expect_rows:
            assert [s for s, _ in sinks[1].rows] == [0, 1, 2] and "earlywarn/grad_norm" in sinks[1].rows[0][1]
