"""The webhook sink against a real local HTTP server on 127.0.0.1 (Slack-compatible JSON POST)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from earlywarn.events import Event, Kind, Level
from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import PermanentSinkError
from earlywarn.sinks.defaults import build_sinks
from earlywarn.sinks.webhook import WebhookSink


class Hook:
    """A local webhook endpoint: records each POST; answers the codes in ``codes`` in turn
    (then 200)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.codes: list[int] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                code = hook.codes.pop(0) if hook.codes else 200
                hook.requests.append(
                    {"path": self.path, "type": self.headers["Content-Type"], "body": json.loads(body), "code": code}
                )
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"ok" if code == 200 else b"error")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/B000/XXX"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["code"] == 200]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def ev(step, level=Level.WARNING, kind=Kind.GRAD_SPIKE, layers=("blocks.3.attn",), t=None):
    return Event(
        step=step, kind=kind, level=level, message=f"grad norm 9x its baseline at step {step}", layers=layers,
        values={"ratio": 9.0}, time=1000.0 + step if t is None else t,
    )


def test_slack_compatible_payload(hook):
    sink = WebhookSink(hook.url, run_name="gpt-small", channel="#alerts")
    sink.start()
    sink.alert(ev(5))
    sink.finish()
    (req,) = hook.requests
    assert req["type"] == "application/json" and req["path"] == "/services/T000/B000/XXX"
    body = req["body"]
    assert body["text"].startswith(":warning: *earlywarn warning: grad_spike in blocks.3.attn @ step 5* (gpt-small)")
    assert "grad norm 9x" in body["text"] and "layers: blocks.3.attn" in body["text"]
    assert body["channel"] == "#alerts" and body["username"] == "earlywarn"
    assert body["earlywarn"]["kind"] == "grad_spike" and body["earlywarn"]["step"] == 5
    assert body["earlywarn"]["run"] == "gpt-small"


def test_min_level_dedup_and_escalation(hook):
    sink = WebhookSink(hook.url, min_level="warning", dedup_seconds=60, include_event=False)
    sink.alert(ev(1, Level.INFO))  # below min_level
    sink.alert(ev(2))  # sent
    sink.alert(ev(3))  # same kind + layer within 60 s: held back
    sink.alert(ev(4))  # held back
    sink.alert(ev(5, layers=("blocks.4.mlp",)))  # other layer: sent
    sink.alert(ev(6, Level.CRITICAL))  # level rises: sent, says 2 were held back
    sink.alert(ev(200))  # 60 s later at the original level: sent
    bodies = hook.delivered()
    assert [b["text"].split("@ step ")[1].split("*")[0] for b in bodies] == ["2", "5", "6", "200"]
    assert "(+2 similar held back" in bodies[2]["text"]
    assert all("earlywarn" not in b for b in bodies)
    assert sink.sent == 4 and sink.suppressed == 2


def test_checkpoint_messages_are_opt_in(hook):
    WebhookSink(hook.url).checkpoint(10, "/ck/10.pt", "warning")
    assert hook.requests == []
    WebhookSink(hook.url, checkpoints=True).checkpoint(10, "/ck/10.pt", "warning")
    (req,) = hook.requests
    assert "checkpoint at step 10" in req["body"]["text"] and req["body"]["earlywarn"]["path"] == "/ck/10.pt"


def test_server_error_is_retried_in_background_and_arrives_once(hook):
    hook.codes = [500, 503]
    (sink,) = build_sinks(["webhook"], {"webhook": {"url": hook.url}},
                          background_options={"backoff_initial": 0.01, "exit_on_sigterm": False})
    assert isinstance(sink, BackgroundSink)
    t0 = time.perf_counter()
    sink.alert(ev(7))
    assert time.perf_counter() - t0 < 0.1  # the training thread never waits for the POST (and its retries)
    assert sink.flush(10)
    assert [r["code"] for r in hook.requests] == [500, 503, 200]
    assert len(hook.delivered()) == 1  # the retry was not de-duplicated against itself, nor sent twice
    assert sink.stats()["failures"] == 2
    sink.finish()


def test_client_error_is_permanent(hook):
    hook.codes = [400]
    with pytest.raises(PermanentSinkError, match="400"):
        WebhookSink(hook.url).alert(ev(1))
    hook.codes = [404]
    sink = BackgroundSink(WebhookSink(hook.url), backoff_initial=0.01, exit_on_sigterm=False)
    sink.start()
    sink.alert(ev(2))
    assert sink.flush(10)
    assert len(hook.requests) == 2 and sink.stats()["rejected"] == 1  # not retried
    sink.finish()


def test_unreachable_endpoint_raises_for_retry():
    sink = WebhookSink("http://127.0.0.1:9/hook", timeout=1)  # discard port: connection refused
    with pytest.raises(OSError):
        sink.alert(ev(1))


def test_url_is_required_and_checked(monkeypatch):
    monkeypatch.delenv("EARLYWARN_WEBHOOK_URL", raising=False)
    with pytest.raises(ValueError, match="EARLYWARN_WEBHOOK_URL"):
        WebhookSink()
    with pytest.raises(ValueError, match="http"):
        WebhookSink("ftp://example.org/hook")
    monkeypatch.setenv("EARLYWARN_WEBHOOK_URL", "https://hooks.example.org/x")
    assert WebhookSink().url == "https://hooks.example.org/x"
