"""What a background sink could not deliver: kept in the spool file, or dropped; counted; said.

The spool file holds JSON lines as the JSONL sink writes them (``metrics``, ``event``,
``checkpoint``), each batch after a line ``{"type": "undelivered", "sink", "reason", "time"}``
saying whose records they are and why they were not delivered.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable

from earlywarn.events import jsonable

log = logging.getLogger("earlywarn.sinks")


class Spool:
    """Where a background sink's undelivered records go: appended to ``path`` when there is one
    (else dropped), counted in ``counters`` (``spooled_*`` or ``dropped_*``, under ``lock``),
    the first time said in a warning (later ones at debug level)."""

    def __init__(self, name: str, path: str | None, redact: Callable[[str], str], counters: dict[str, int],
                 lock: threading.Condition) -> None:
        self.name = name
        self.path = path
        self._redact = redact
        self._counters = counters
        self._lock = lock
        self._reported = False

    def give_up(self, metrics: list, events: list, *, reason: str) -> None:
        """Spool (or drop) ``metrics`` (``(step, values, unix_time)`` records) and ``events``
        (``("alert", (event,))`` or ``("checkpoint", (step, path, reason))``)."""
        if not (metrics or events):
            return
        n_values = sum(len(m) for _, m, _ in metrics)
        where = self.path
        if where is not None:
            try:
                self._append(where, metrics, events, self._redact(reason))
            except OSError as exc:
                reason += f"; writing {where} failed: {exc}"
                where = None
        with self._lock:
            if where is not None:
                self._counters["spooled_records"] += len(metrics)
                self._counters["spooled_events"] += len(events)
            else:
                self._counters["dropped_records"] += len(metrics)
                self._counters["dropped_values"] += n_values
                self._counters["dropped_events"] += len(events)
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

    def _append(self, path: str, metrics: list, events: list, reason: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            head = {"type": "undelivered", "sink": self.name, "reason": reason, "time": time.time()}
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
