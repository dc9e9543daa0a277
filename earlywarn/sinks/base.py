"""The sink contract (accelerate's ``GeneralTracker`` plus ``alert``), the sink registry, and
redaction of credentials in everything a sink prints.

A sink receives flat scalar metrics, events and checkpoint records. Tracker SDKs are imported
lazily inside ``start()``, so importing earlywarn never imports wandb or mlflow.

Order of calls from the watcher, per optimizer step: ``alert(event)`` for each event of the step
as it happens (``checkpoint(...)`` right after a checkpoint's event), then ``log_metrics(step,
metrics)`` once, at the end of the step. A halted step gets its ``log_metrics`` from the flush
that ``Halt`` runs.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any, Callable, Iterable, Mapping, Sequence

from earlywarn.events import Event, Level
from earlywarn.metrics import INCIDENT_KINDS as _RANKED

METRIC_PREFIX = "earlywarn/"


class PermanentSinkError(Exception):
    """Raised by a sink when retrying the same record cannot succeed (a rejected value, a 4xx).

    The background wrapper drops that record (and counts it) instead of retrying it; any other
    exception is treated as transient (tracker down or slow) and retried with backoff.
    """


class SinkStarting(TimeoutError):
    """Raised by ``start()`` when the backend is still coming up after the sink's own wait (a
    child process importing its SDK, a slow server): not a failure. The background wrapper lets
    training go on and calls ``start()`` again."""


class Sink:
    """Base class for everything that receives earlywarn's output.

    Subclasses override what they support. ``start`` and ``finish`` must be idempotent: calling
    either twice is harmless. ``main_process_only`` sinks are started on rank 0 alone under
    ``torch.distributed``.
    """

    name: str = "sink"
    main_process_only: bool = True
    io_bound: bool = False
    """True for sinks that talk to a tracker or the network: ``build_sinks`` runs them on a
    background thread (:class:`earlywarn.sinks.background.BackgroundSink`) so the training thread
    never waits on them."""
    takes_metrics: bool | None = None
    """Whether this sink does anything with ``log_metrics``; ``None``: it does when it overrides
    ``log_metrics`` or ``log_metrics_batch``. When no sink takes metrics the watcher builds none."""
    batch_interval: float = 0.0
    """Background sinks: seconds the worker may collect metric steps before one delivery (0:
    deliver as soon as a step arrives). Events never wait."""
    down_timeout: float | None = None
    """Background sinks: how long ``flush``/``finish`` keep retrying a tracker that is down
    before giving up (``None``: the wrapper's default, 3 s)."""

    def redact(self, text: str) -> str:
        """``text`` with this sink's credentials (URI user info, webhook paths) masked. Everything
        earlywarn prints about a sink goes through here."""
        return redact_urls(text)

    def start(self) -> None:
        """Open files / runs / connections. Safe to call twice."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record flat scalar metrics (keys already carry the ``earlywarn/`` prefix), once at the
        end of every optimizer step. ``metrics`` is read-only and may build its values on first
        read (:class:`earlywarn.metrics.StepMetrics`); ``dict(metrics)`` copies it. A sink that
        keeps this no-op costs nothing: when no sink overrides it, the watcher builds nothing."""

    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        """Record several steps at once: ``(step, metrics, unix_time)`` tuples, oldest first.

        The background wrapper calls this with what piled up while the tracker was busy; backends
        with a batch API (MLflow ``log_batch``) override it, and keep the recorded time.
        """
        for step, metrics, _ in records:
            self.log_metrics(step, metrics)

    def alert(self, event: Event) -> None:
        """Record (and, where the backend can, notify about) one event."""

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        """Record that a checkpoint was written (``reason``: "periodic", "warning", ...)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Push out anything buffered; True when nothing is left."""
        return True

    def finish(self) -> None:
        """Flush and close. Safe to call twice."""


_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<info>[^/\s@'\"]+)@")


_USERINFO_ANY = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s'\"]*@")


def strip_userinfo(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it removed (safe to print)."""
    return _USERINFO_ANY.sub(lambda m: m.group("scheme"), str(text))


def takes_metrics(sink: "Sink") -> bool:
    """Whether ``sink`` does anything with metrics: its ``takes_metrics`` when set, else whether
    it overrides ``log_metrics`` or ``log_metrics_batch``."""
    takes = getattr(sink, "takes_metrics", None)
    if takes is not None:
        return bool(takes)
    return not (type(sink).log_metrics is Sink.log_metrics and type(sink).log_metrics_batch is Sink.log_metrics_batch)


def redact_urls(text: str) -> str:
    """Mask the ``user:password@`` part of every URL in ``text``."""
    return _USERINFO.sub(lambda m: m.group("scheme") + "***@", str(text))


def redact_url(url: str, *, keep_path: bool = True) -> str:
    """``url`` without user info (``***@``) and query; with ``keep_path=False`` (webhooks, whose
    path is the token) also without its path: ``https://hooks.slack.com/***``."""
    try:
        parts = urllib.parse.urlsplit(str(url))
    except ValueError:
        return "***"
    if not parts.scheme or not parts.netloc:
        return redact_urls(str(url)) if keep_path else "***"
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = ("***@" if ("@" in parts.netloc) else "") + host + (f":{port}" if port is not None else "")
    path = parts.path if keep_path else ("/***" if parts.path not in ("", "/") or parts.query else "")
    query = "?***" if (parts.query and keep_path) else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, "", "")) + query


class Redactor:
    """Replaces known secret strings (a URL, its path, query, password) with their masked forms."""

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()):
        # longest first, so a full URL is replaced before its path alone
        self.pairs = sorted(((s, r) for s, r in pairs if s and len(s) >= 4 and s != r), key=lambda p: -len(p[0]))

    @classmethod
    def for_url(cls, url: str | None, *, keep_path: bool = True) -> "Redactor":
        if not url:
            return cls()
        url = str(url)
        masked = redact_url(url, keep_path=keep_path)
        pairs = [(url, masked)]
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            return cls(pairs)
        if parts.password:
            pairs.append((parts.password, "***"))
            pairs.append((urllib.parse.unquote(parts.password), "***"))
        if parts.username and parts.password:
            pairs.append((f"{parts.username}:{parts.password}", "***"))
        if not keep_path:
            tail = parts.path + (f"?{parts.query}" if parts.query else "")
            for secret in (tail, parts.path, parts.path.lstrip("/"), parts.query):
                if secret and secret != "/":
                    pairs.append((secret, "/***"))
        elif parts.query:
            pairs.append((parts.query, "***"))
        return cls(pairs)

    def __call__(self, text: Any) -> str:
        text = str(text)
        for secret, masked in self.pairs:
            if secret in text:
                text = text.replace(secret, masked)
        return redact_urls(text)


SinkFactory = Callable[..., Sink]
_REGISTRY: dict[str, str | SinkFactory] = {
    # name -> "module:attribute" (imported on first use) or a factory
    "console": "earlywarn.sinks.console:ConsoleSink",
    "jsonl": "earlywarn.sinks.jsonl:JsonlSink",
    "webhook": "earlywarn.sinks.webhook:WebhookSink",
    "mlflow": "earlywarn.integrations.mlflow_sink:MlflowSink",
    "wandb": "earlywarn.integrations.wandb_sink:WandbSink",
}


def register_sink(name: str, factory: str | SinkFactory, *, overwrite: bool = False) -> None:
    """Make ``sinks=[name]`` build ``factory(**options)``.

    ``factory`` is a callable or a lazy ``"package.module:Class"`` path.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"sink name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"a sink named {name!r} is already registered: pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def registered_sinks() -> list[str]:
    return sorted(_REGISTRY)


def make_sink(spec: "str | Sink", options: Mapping[str, Any] | None = None) -> Sink:
    """Build a sink from a registered name (with ``options``) or pass a Sink instance through."""
    if isinstance(spec, Sink):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a sink is a registered name or an earlywarn.sinks.Sink instance, got {type(spec).__name__}"
        )
    try:
        factory = _REGISTRY[spec]
    except KeyError:
        raise ValueError(
            f"unknown sink {spec!r}: registered sinks are {', '.join(registered_sinks())}; "
            "add your own with earlywarn.sinks.register_sink(name, factory)"
        ) from None
    if isinstance(factory, str):
        import importlib

        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(**dict(options or {}))


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, ending in ``...`` when cut
    (never mid-word, unless one word alone is longer than the limit)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    room = max(limit - 3, 1)
    cut = text[:room + 1]
    space = cut.rfind(" ")
    cut = cut[:space] if space > 0 else text[:room]
    return cut.rstrip(" ,;:.-") + "..."


def alert_line(event: Event, limit: int = 500) -> str:
    """``earlywarn <level>: <kind> in <layer> @ step <n>: <message>``, cut at a word boundary
    (never mid-word, unlike a title cut to a fixed width)."""
    where = f" in {event.layer}" if event.layer else ""
    return shorten(f"earlywarn {event.level}: {event.kind}{where} @ step {event.step}: {event.message}", limit)


def status_name(level: Level) -> str:
    """``ok`` / ``info`` / ``warning`` / ``critical``: the worst level as trackers show it."""
    return "ok" if level == Level.NONE else str(level)


class EventTally:
    """What a tracker's run-level tags and summary say about the events so far: the worst level,
    the first and last critical event (kind, step), a count per kind and the kinds seen.

    Alert rules and searches read these instead of a "last alert" that the next info spike
    overwrites. ``changes(event)`` folds one event in and returns the entries that changed.
    """

    def __init__(self) -> None:
        self.worst = Level.NONE
        self.counts: dict[str, int] = {}
        self.first_critical: tuple[str, int] | None = None
        self.last_critical: tuple[str, int] | None = None

    def copy(self) -> "EventTally":
        other = EventTally()
        other.worst, other.counts = self.worst, dict(self.counts)
        other.first_critical, other.last_critical = self.first_critical, self.last_critical
        return other

    def update(self, event: Event) -> dict[str, Any]:
        """Fold ``event`` in; returns ``{name: value}`` of what changed (names as in
        :meth:`as_dict`)."""
        before = self.as_dict()
        kind = str(event.kind)
        # a dry run's "would have" is not the thing itself: its own count (docs/trackers.md)
        counted = f"would_{kind}" if event.values.get("dry_run") else kind
        self.counts[counted] = self.counts.get(counted, 0) + 1
        if event.level > self.worst and kind in _RANKED:
            self.worst = event.level
        if event.level >= Level.CRITICAL and kind in _RANKED:
            if self.first_critical is None:
                self.first_critical = (kind, int(event.step))
            self.last_critical = (kind, int(event.step))
        after = self.as_dict()
        return {k: v for k, v in after.items() if before.get(k) != v}

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": status_name(self.worst), "worst_level": int(self.worst),
                             "kinds": ",".join(sorted(self.counts))}
        if self.first_critical is not None:
            d["first_critical_kind"], d["first_critical_step"] = self.first_critical
        if self.last_critical is not None:
            d["last_critical_kind"], d["last_critical_step"] = self.last_critical
        for kind, n in self.counts.items():
            d[f"count.{kind}"] = n
        return d

    def restore_tags(self, tags: Mapping[str, str], prefix: str) -> None:
        """Continue from what a resumed run's tags (or summary) say, so counts and the worst
        level carry on instead of starting over."""
        status = tags.get(prefix + "status")
        for lvl in Level:
            if status_name(lvl) == status and lvl > self.worst:
                self.worst = lvl
        for key, value in tags.items():
            if key.startswith(prefix + "count."):
                try:
                    self.counts[key[len(prefix + "count."):]] = int(value)
                except (TypeError, ValueError):
                    pass
        for which in ("first", "last"):
            kind, step = tags.get(f"{prefix}{which}_critical_kind"), tags.get(f"{prefix}{which}_critical_step")
            if kind and step is not None:
                try:
                    setattr(self, f"{which}_critical", (str(kind), int(step)))
                except (TypeError, ValueError):
                    pass

