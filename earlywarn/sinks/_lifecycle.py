"""The life of a background sink: one state at a time, moved only along the edges below."""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    NEW = "new"
    """Built; no worker yet."""
    STARTING = "starting"
    """The worker runs ``inner.start()`` (retrying while the tracker cannot be reached)."""
    RUNNING = "running"
    """Started; delivering."""
    CLOSING = "closing"
    """``finish()`` was called: what is buffered is delivered within its deadline, then ``inner.finish()``."""
    CLOSED = "closed"
    """Finished, or finished before it started. New records are ignored."""
    FAILED = "failed"
    """The start failed for good, or the worker stopped on a bug. New records are ignored."""


_NEXT: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.NEW: frozenset({Lifecycle.STARTING, Lifecycle.CLOSED}),
    Lifecycle.STARTING: frozenset({Lifecycle.RUNNING, Lifecycle.CLOSING, Lifecycle.FAILED}),
    Lifecycle.RUNNING: frozenset({Lifecycle.CLOSING, Lifecycle.FAILED}),
    Lifecycle.CLOSING: frozenset({Lifecycle.CLOSED, Lifecycle.FAILED}),
    # a worker that stops on a bug ends FAILED, whatever it was doing
    Lifecycle.CLOSED: frozenset({Lifecycle.FAILED}),
    Lifecycle.FAILED: frozenset({Lifecycle.CLOSED, Lifecycle.FAILED}),
}

ENDED = (Lifecycle.CLOSING, Lifecycle.CLOSED, Lifecycle.FAILED)
"""States that take no new records."""


def moved(state: Lifecycle, to: Lifecycle) -> Lifecycle:
    """``to``, when ``state`` may move there; a ``RuntimeError`` (a bug) otherwise."""
    if to not in _NEXT[state]:
        raise RuntimeError(f"background sink: no transition from {state.value!r} to {to.value!r}")
    return to
