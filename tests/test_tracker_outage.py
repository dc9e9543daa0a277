"""Trackers that are down, and secrets: ``watch()`` and ``close()`` stay within a few seconds
against an MLflow URI and a webhook on closed ports, say once what was not delivered, and never
print a password or a webhook token (warnings, log lines, the MLflow worker's stderr)."""

from __future__ import annotations

import json
import logging
import math
import socket
import time
import warnings

import pytest
import torch

import earlywarn
from earlywarn.events import Event, Kind, Level
from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import Redactor, Sink, redact_url, redact_urls
from earlywarn.sinks.webhook import WebhookSink
from fixtures_models import MLP

torch.set_num_threads(1)
PASSWORD = "hunter2-very-secret"
TOKEN = "T0AAA/B0BBB/xoxbTOKENsecret"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(ew, model, opt, steps=30):
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        if step == 10:
            model.hidden.weight.grad[0, 0] = math.inf
        opt.step()


@pytest.mark.parametrize("mlflow_process", [True, False], ids=["writer-process", "in-process"])
def test_watch_and_close_are_bounded_and_say_once_what_was_dropped(tmp_path, monkeypatch, caplog, capfd, mlflow_process):
    pytest.importorskip("mlflow")
    caplog.set_level(logging.DEBUG, logger="earlywarn")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    if not mlflow_process:  # in-process, the user's own MLflow settings apply: make them quick
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{closed_port()}"
    hook = f"http://127.0.0.1:{closed_port()}/services/{TOKEN}?key={PASSWORD}"
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        ew = earlywarn.watch(model, opt, sinks=["jsonl", "mlflow", "webhook"],
                             sink_options={"jsonl": {"path": str(tmp_path / "events.jsonl")},
                                           "mlflow": {"tracking_uri": uri, "process": mlflow_process},
                                           "webhook": {"url": hook}})
        watch_s = time.monotonic() - t0
        train(ew, model, opt)
        t0 = time.monotonic()
        ew.close()
        close_s = time.monotonic() - t0
    assert watch_s < 5.0, watch_s
    assert close_s < 5.0, close_s
    by_name = {s.name: s for s in ew.sinks}
    assert set(by_name) == {"jsonl", "mlflow", "webhook"}  # nobody was dropped at start: they kept trying
    messages = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
    out, err = capfd.readouterr()
    everything = "\n".join(messages) + out + err
    assert PASSWORD not in everything and "xoxbTOKEN" not in everything and "B0BBB" not in everything
    assert "***@127.0.0.1" in everything and "/***" in everything  # redacted, not silent
    for name, what in (("mlflow", "metric step"), ("webhook", "event")):
        final = [m for m in messages if m.startswith(f"earlywarn: sink {name!r}:") and "not delivered" in m]
        assert len(final) == 1, (name, messages)
        assert what in final[0] and final[0].endswith("dropped")
        st = by_name[name].stats()
        assert st["state"] == "closed" and st["pending_records"] == 0 and st["pending_events"] == 0
    assert by_name["mlflow"].stats()["dropped_records"] == 30
    assert by_name["webhook"].stats()["dropped_records"] == 0  # a webhook takes no metrics: none buffered
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "nonfinite_grad" in kinds  # the events are on disk anyway, in the JSONL log


def test_undelivered_records_are_spooled_when_asked(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")

    class Down(Sink):
        name = "down"
        io_bound = True

        def log_metrics_batch(self, records):
            raise ConnectionError("refused")

        def alert(self, event):
            raise ConnectionError("refused")

    spool = tmp_path / "undelivered.jsonl"
    sink = BackgroundSink(Down(), spool_path=spool, down_timeout=0.3, backoff_initial=0.05, exit_on_sigterm=False)
    sink.start()
    for s in range(5):
        sink.log_metrics(s, {"earlywarn/grad_norm": float(s) if s != 3 else math.inf})
    sink.alert(Event(step=3, kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL, message="inf"))
    t0 = time.monotonic()
    assert not sink.flush(10)  # down: gives up after down_timeout, not after 10 s
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    sink.finish()
    assert time.monotonic() - t0 < 2.0
    lines = [json.loads(line) for line in spool.read_text().splitlines()]
    assert lines[0]["type"] == "undelivered" and lines[0]["sink"] == "down"
    assert [r["step"] for r in lines if r["type"] == "metrics"] == [0, 1, 2, 3, 4]
    assert [r["earlywarn/grad_norm"] for r in lines if r["type"] == "metrics"][3] == "inf"
    assert [r["kind"] for r in lines if r["type"] == "event"] == ["nonfinite_grad"]
    st = sink.stats()
    assert st["spooled_records"] == 5 and st["spooled_events"] == 1 and st["dropped_records"] == 0
    (msg,) = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert f"kept in {spool}" in msg


def test_unreachable_tracker_at_start_keeps_buffering_and_delivers_when_back():
    class Flaky(Sink):
        name = "flaky"
        io_bound = True

        def __init__(self):
            self.up = False
            self.steps = []

        def start(self):
            if not self.up:
                raise ConnectionRefusedError("not up yet")

        def log_metrics_batch(self, records):
            self.steps += [s for s, _, _ in records]

    inner = Flaky()
    sink = BackgroundSink(inner, backoff_initial=0.05, backoff_max=0.1, exit_on_sigterm=False)
    t0 = time.monotonic()
    sink.start()  # returns at once: unreachable is not a reason to wait, nor to give up
    assert time.monotonic() - t0 < 1.0 and sink.stats()["state"] == "starting"
    for s in range(3):
        sink.log_metrics(s, {"earlywarn/x": 1.0})
    inner.up = True
    assert sink.flush(10) and inner.steps == [0, 1, 2]
    sink.finish()


def test_redaction_of_uris_and_webhook_urls():
    assert redact_url(f"https://bob:{PASSWORD}@mlflow.example.org:5000/path?token=abc") == \
        "https://***@mlflow.example.org:5000/path?***"
    assert redact_url(f"https://hooks.slack.com/services/{TOKEN}", keep_path=False) == "https://hooks.slack.com/***"
    assert redact_urls(f"postgresql://u:{PASSWORD}@db/mlflow and http://x@h/") == "postgresql://***@db/mlflow and http://***@h/"
    r = Redactor.for_url(f"https://hooks.slack.com/services/{TOKEN}?a=1", keep_path=False)
    text = f"HTTPSConnectionPool(host='hooks.slack.com', port=443): Max retries exceeded with url: /services/{TOKEN}?a=1"
    assert TOKEN not in r(text) and "hooks.slack.com" in r(text)
    with pytest.raises(ValueError) as exc:
        WebhookSink(f"ftp://hooks.example.org/services/{TOKEN}")
    assert TOKEN not in str(exc.value)
    assert TOKEN not in repr(WebhookSink(f"https://hooks.slack.com/services/{TOKEN}"))


def test_start_error_raised_to_build_sinks_is_redacted(caplog):
    from earlywarn.sinks.defaults import build_sinks
    from earlywarn.sinks.base import _REGISTRY, register_sink

    class Refusing(Sink):
        name = "refusing"
        io_bound = True
        url = f"https://user:{PASSWORD}@tracker.example.org"

        def redact(self, text):
            return Redactor.for_url(self.url)(text)

        def start(self):
            raise RuntimeError(f"auth failed for {self.url}")

    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    register_sink("refusing", Refusing, overwrite=True)
    try:
        assert build_sinks(["refusing"], background_options={"exit_on_sigterm": False}) == []
    finally:
        _REGISTRY.pop("refusing")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "auth failed" in text and PASSWORD not in text and "***@tracker.example.org" in text


def test_a_webhook_that_never_answers_does_not_hold_close(caplog):
    """A host that accepts the connection and never answers (no refusal to notice): close() gives
    up after down_timeout, not after the POST's own 10 s timeout, and says so once."""
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes the handshake; nobody ever reads or answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/services/{TOKEN}"
        sink = BackgroundSink(WebhookSink(url), exit_on_sigterm=False)
        sink.start()
        sink.alert(Event(step=1, kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL, message="inf"))
        time.sleep(0.2)  # the POST is under way
        t0 = time.monotonic()
        sink.finish()
        assert time.monotonic() - t0 < 5.0
    finally:
        listener.close()
    (final,) = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert "1 event(s) not delivered" in final and "did not answer" in final and "xoxbTOKEN" not in final
