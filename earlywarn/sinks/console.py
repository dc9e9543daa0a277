"""Events to the terminal (stderr), so a user sees what happened without any tracker."""

from __future__ import annotations

import sys
from typing import TextIO

from earlywarn.events import Event, Level
from earlywarn.sinks.base import Sink


class ConsoleSink(Sink):
    """Prints each event at or above ``min_level`` as one line on ``stream`` (stderr by default)."""

    name = "console"

    def __init__(self, min_level: Level | str = Level.INFO, stream: TextIO | None = None):
        self.min_level = Level.parse(min_level)
        self.stream = stream

    def alert(self, event: Event) -> None:
        if event.level >= self.min_level:
            print(str(event), file=self.stream or sys.stderr, flush=True)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        if self.min_level <= Level.INFO:
            print(f"[earlywarn] step {step}: checkpoint ({reason}) -> {path}", file=self.stream or sys.stderr)
