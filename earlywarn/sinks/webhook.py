"""Alerts as a Slack-compatible JSON POST (Slack, Mattermost, Rocket.Chat, Teams/Discord bridges).

MLflow has no alerting on metrics (its 3.x webhooks cover model-registry events only), so this is
how MLflow (and plain-JSONL) users get notified. Standard library only (``urllib``). It blocks on
the network, so ``build_sinks`` runs it on the background thread; a 4xx answer other than
408/429 is permanent (that record is dropped, never retried), anything else is retried with
backoff by the wrapper. The URL's path and query are its token: every message earlywarn prints
shows ``https://hooks.slack.com/***`` instead.

Payload (``Content-Type: application/json``)::

    {"text": ":rotating_light: *earlywarn critical: nonfinite_grad in blocks.3.attn @ step 20* (run)\n<message>\nlayers: ...",
     "username": "earlywarn",            # unless username=None
     "channel": "#alerts",               # only with channel=
     "earlywarn": {"step": 20, "kind": "nonfinite_grad", "level": "critical", "message": ..., "signal": ...,
                   "layers": [...], "values": {...}, "batch": ..., "time": ..., "run": ..., "held_back": 0}}

``include_event=False`` leaves out ``"earlywarn"`` (for endpoints that reject unknown fields);
``checkpoints=True`` also posts ``{"text": ":floppy_disk: ...", "earlywarn": {"type": "checkpoint",
"step", "path", "reason", "run"}}``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Mapping

from earlywarn.events import Event, Level
from earlywarn.sinks.base import PermanentSinkError, Redactor, Sink, redact_url

_EMOJI = {Level.NONE: "", Level.INFO: ":information_source:", Level.WARNING: ":warning:", Level.CRITICAL: ":rotating_light:"}


class WebhookSink(Sink):
    """POSTs ``{"text": ..., "earlywarn": event}`` for each event at or above ``min_level``.

    ``url`` defaults to ``$EARLYWARN_WEBHOOK_URL``. The same kind of event in the same layer is
    sent at most once per ``dedup_seconds`` unless its level rises; the next message that goes out
    says how many were held back. Set ``include_event=False`` for endpoints that reject unknown
    fields.
    """

    name = "webhook"
    io_bound = True

    def __init__(
        self,
        url: str | None = None,
        *,
        min_level: Level | str = Level.WARNING,
        timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
        run_name: str | None = None,
        checkpoints: bool = False,
        dedup_seconds: float = 300.0,
        include_event: bool = True,
        username: str | None = "earlywarn",
        channel: str | None = None,
        down_timeout: float = 3.0,
        spool_path: str | os.PathLike | None = None,
    ):
        url = url or os.environ.get("EARLYWARN_WEBHOOK_URL")
        if not url:
            raise ValueError("WebhookSink.url is missing: pass url=... or set EARLYWARN_WEBHOOK_URL")
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"WebhookSink.url={redact_url(url, keep_path=False)!r}: use an http:// or https:// URL")
        if not timeout > 0:
            raise ValueError(f"WebhookSink.timeout={timeout!r}: use a number of seconds > 0")
        if not down_timeout >= 0:
            raise ValueError(f"WebhookSink.down_timeout={down_timeout!r}: use seconds >= 0")
        if not dedup_seconds >= 0:
            raise ValueError(f"WebhookSink.dedup_seconds={dedup_seconds!r}: use seconds >= 0 (0 sends every event)")
        self.url = url
        self.down_timeout = float(down_timeout)
        self.spool_path = spool_path
        self._redactor = Redactor.for_url(url, keep_path=False)
        self.min_level = Level.parse(min_level)
        self.timeout = float(timeout)
        self.headers = dict(headers or {})
        self.run_name = run_name
        self.checkpoints = checkpoints
        self.dedup_seconds = float(dedup_seconds)
        self.include_event = include_event
        self.username = username
        self.channel = channel
        self.sent = 0
        self.suppressed = 0
        self._last: dict[tuple, tuple[float, Level]] = {}  # (kind, layer) -> (time, level) last sent
        self._held: dict[tuple, int] = {}  # (kind, layer) -> events held back since

    def redact(self, text: str) -> str:
        return self._redactor(text)

    def __repr__(self) -> str:
        return f"WebhookSink(url={redact_url(self.url, keep_path=False)!r})"

    def _post(self, payload: Mapping[str, Any]) -> None:
        body = json.dumps(payload, allow_nan=False, default=str).encode("utf-8")
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "earlywarn", **self.headers},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code not in (408, 429):
                raise PermanentSinkError(f"webhook answered HTTP {exc.code} {exc.reason}") from None
            raise OSError(f"webhook answered HTTP {exc.code} {exc.reason}") from None
        except OSError as exc:  # URLError, timeouts: never with the URL in the message
            raise OSError(self.redact(f"webhook {redact_url(self.url, keep_path=False)} unreachable: "
                                      f"{getattr(exc, 'reason', exc)}")) from None
        self.sent += 1

    def _payload(self, text: str, record: Mapping[str, Any] | None) -> dict[str, Any]:
        payload: dict[str, Any] = {"text": text}
        if self.username:
            payload["username"] = self.username
        if self.channel:
            payload["channel"] = self.channel
        if self.include_event and record is not None:
            payload["earlywarn"] = dict(record)
        return payload

    def alert(self, event: Event) -> None:
        if event.level < self.min_level:
            return
        key = (str(event.kind), event.layer)
        last = self._last.get(key)
        if last is not None and event.time - last[0] < self.dedup_seconds and event.level <= last[1]:
            self._held[key] = self._held.get(key, 0) + 1
            self.suppressed += 1
            return
        where = f" ({self.run_name})" if self.run_name else ""
        lines = [f"{_EMOJI[event.level]} *{event.title}*{where}".strip(), event.message]
        if event.layers:
            lines.append("layers: " + ", ".join(event.layers[:8]) + (" ..." if len(event.layers) > 8 else ""))
        held = self._held.get(key, 0)
        if held:
            lines.append(f"(+{held} similar held back since the last message)")
        record = {**event.to_dict(), "run": self.run_name, "held_back": held}
        self._post(self._payload("\n".join(lines), record))
        # Only after a successful POST: a retried event must not be deduplicated against itself.
        self._last[key] = (event.time, event.level)
        self._held.pop(key, None)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        if not self.checkpoints:
            return
        where = f" ({self.run_name})" if self.run_name else ""
        text = f":floppy_disk: earlywarn checkpoint at step {step}{where}: {reason} -> {path}"
        self._post(self._payload(text, {"type": "checkpoint", "step": step, "path": path, "reason": reason, "run": self.run_name}))
