"""earlywarn: keep large PyTorch training runs alive.

    import earlywarn
    ew = earlywarn.watch(model, optimizer)   # your loop stays: loss.backward(); optimizer.step()

The pure parts (``earlywarn.events``, ``earlywarn.detect``, ``earlywarn.policy``,
``earlywarn.analyze``) import without torch; everything that touches tensors is loaded on first
use, so ``import earlywarn`` is cheap and torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

from earlywarn.events import Event, Kind, Level

__version__ = "0.1.0"

# name -> module that defines it (imported lazily: these need torch)
_LAZY = {
    "watch": "earlywarn.guard",
    "Watcher": "earlywarn.guard",
    "WatchConfig": "earlywarn.guard",
    "ResumableLoader": "earlywarn.recover.data",
    "RecoveryConfig": "earlywarn.recover",
    "Halt": "earlywarn.recover",
    "LoopState": "earlywarn.recover.loopstate",
    "DetectorConfig": "earlywarn.detect",
    "PolicyConfig": "earlywarn.policy",
    "MetricsConfig": "earlywarn.metrics",
}

__all__ = ["Event", "Kind", "Level", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'earlywarn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
