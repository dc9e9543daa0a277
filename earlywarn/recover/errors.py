"""Exceptions raised by the recovery layer. Each message names what went wrong and the fix."""

from __future__ import annotations


class Halt(RuntimeError):
    """Training cannot continue safely: rewinds exhausted, nothing clean to rewind to, or the
    state is poisoned beyond repair. The message says why and what to do next.

    ``step`` is the optimizer step at which the run halted; ``reason`` a short machine-readable
    tag (``"rewinds_exhausted"``, ``"no_clean_snapshot"``, ``"data_position"``, ...).
    """

    def __init__(self, message: str, *, step: int | None = None, reason: str = "halt") -> None:
        super().__init__(message)
        self.step = step
        self.reason = reason


class DataPositionError(RuntimeError):
    """The data loader's position cannot be saved, restored or moved exactly."""


class FingerprintMismatch(DataPositionError):
    """A saved data position belongs to a different dataset (length or sampled content differ)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read."""


class UnreadableState(RuntimeError):
    """A state tensor no copy can read (a tensor subclass without ``__tensor_flatten__``;
    ``recover/forms.py``): the copy that met it is given up."""
