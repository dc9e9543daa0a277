"""The clean window: how long after an incident recovery's snapshots are unclean, and when a
rewind has held. The one owner of "within ``RecoveryConfig.clean_window`` steps" in recovery.

Steps are the training trajectory's: after a rewind to the snapshot of step ``s`` the steps
after ``s`` come again, and the window counts from ``s``.
"""

from __future__ import annotations


def within(since: int | None, step: int, window: int) -> bool:
    """``step`` is at most ``window`` steps past ``since`` (on the trajectory: a step before
    ``since``, come again after a rewind, is within it too)."""
    return since is not None and step - since <= window


class CleanWindow:
    """``window``: ``RecoveryConfig.clean_window``. ``since``: the step of recovery's latest
    incident -- a repair, the target of a rewind (the steps after it come again), or poisoned
    state a snapshot's check found without a repair -- or ``None``."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.since: int | None = None

    def incident(self, step: int | None) -> None:
        """The steps after ``step`` are unclean for ``window`` steps."""
        self.since = step

    def clean(self, step: int) -> bool:
        """A snapshot of ``step`` is clean: more than ``window`` steps past the latest incident."""
        return not within(self.since, step, self.window)

    def held(self, incident: int, step: int) -> bool:
        """A rewind for the incident at ``incident`` has held at ``step``: the run trained
        ``window`` steps past it."""
        return step - incident >= self.window
