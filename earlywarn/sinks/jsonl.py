"""Events (and optionally metrics) as JSON lines: the run's own log, readable by ``earlywarn analyze``."""

from __future__ import annotations

import json
import os
from typing import IO, Mapping

from earlywarn.events import Event
from earlywarn.sinks.base import Sink


class JsonlSink(Sink):
    """Appends one JSON object per line to ``path``.

    Records: ``{"type": "event", ...Event.to_dict()}``, ``{"type": "metrics", "step": s, ...}``
    (when ``metrics=True``) and ``{"type": "checkpoint", "step", "path", "reason"}``. Each line is
    flushed as written, so a crash loses at most the line being written.
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike = "earlywarn_events.jsonl", metrics: bool = False):
        self.path = os.fspath(path)
        self.metrics = metrics
        self._fh: IO[str] | None = None

    @property
    def takes_metrics(self) -> bool:  # with metrics=False (the default) the watcher builds none for it
        return self.metrics

    def start(self) -> None:
        if self._fh is None:
            parent = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(parent, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")

    def _write(self, record: Mapping) -> None:
        if self._fh is None:
            self.start()
        assert self._fh is not None
        self._fh.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        self._fh.flush()

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.metrics:
            clean = {k: (v if v == v and abs(v) != float("inf") else str(v)) for k, v in metrics.items()}
            self._write({"type": "metrics", "step": step, **clean})

    def alert(self, event: Event) -> None:
        self._write({"type": "event", **event.to_dict()})

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        self._write({"type": "checkpoint", "step": step, "path": path, "reason": reason})

    def flush(self, timeout: float | None = None) -> bool:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        return True

    def finish(self) -> None:
        if self._fh is not None:
            self.flush()
            self._fh.close()
            self._fh = None
