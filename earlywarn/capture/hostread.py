"""Moving the per-step statistics vector to the host: once per step, or late.

``SyncReader`` blocks for the current step's vector (one batched transfer; on CPU it is free).
``LateReader`` never blocks the hot path on CUDA: each step's vector is copied with
``non_blocking=True`` into its own pinned buffer, an event is recorded on the stream that runs
the copy, and later steps hand back every vector whose event has completed (``event.query()``,
oldest first). The guard's skip decision does not depend on the host in that mode (the fused
optimizer reads ``found_inf`` on the device), only the detector sees values late: one step
when the host keeps pace with the device, more when it runs ahead.

Blocking waits (``event.synchronize()``, which ``torch.cuda.set_sync_debug_mode`` does not see)
happen only in ``drain()``, when ``max_depth`` vectors are in flight, and with ``fixed_lag``
(under torch.distributed every rank must judge a step at the same step); every one is timed in
:data:`HOST_WAITS`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np
import torch


class HostWaits:
    """Host time spent blocked on device events (what sync-debug mode cannot count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0

    def wait(self, event: Any) -> None:
        """Block until ``event`` has completed; a wait that was needed is counted and timed."""
        if event.query():
            return
        t0 = time.perf_counter()
        event.synchronize()
        dt = time.perf_counter() - t0
        with self._lock:
            self.count += 1
            self.seconds += dt

    def snapshot(self) -> tuple[int, float]:
        """(waits, seconds) so far."""
        with self._lock:
            return self.count, self.seconds


HOST_WAITS = HostWaits()
"""Process-wide: the late reader and the snapshot copies (``earlywarn.recover``) both count here."""


class _Done:
    """The event of a copy that finished before ``copy_`` returned (CPU tensors)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_DONE = _Done()


def record_event(device: torch.device) -> Any:
    """An event marking the work queued so far on ``device``'s current stream.

    ``torch.cuda.Event().record()`` would record on the *current device's* stream; a copy from
    a tensor on another device runs on that device's stream (Copy.cu sets its device guard to
    the CUDA side of the copy), so the event must be recorded there."""
    if device.type != "cuda":
        return _DONE
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class SyncReader:
    late = False

    def push(self, vec: "torch.Tensor | np.ndarray | list[float]", tag: Any) -> tuple["np.ndarray | list[float]", Any]:
        # This is the one host sync per step (nothing to wait for on CPU, where it is a view).
        if type(vec) is list or type(vec) is np.ndarray:
            return vec, tag  # made on the host (guard.statistics)
        if vec.is_cpu and not vec.requires_grad:
            return vec.numpy(), tag
        return vec.detach().to("cpu").numpy(), tag

    def drain(self) -> list[tuple[np.ndarray, Any]]:
        return []


class _Slot:
    __slots__ = ("buf", "tag", "event")

    def __init__(self, buf: torch.Tensor, tag: Any, event: Any):
        self.buf, self.tag, self.event = buf, tag, event


class LateReader:
    """A ring of pinned host buffers, one per step in flight (``depth`` allocated up front,
    grown up to ``max_depth`` while the host runs further ahead; past that the oldest is waited
    for, and the wait counted).

    ``event_factory(device)`` returns the completion marker of a copy just queued (default:
    :func:`record_event`); tests pass one whose events complete k steps late, so that the
    guard's handling of late vectors runs on CPU exactly as it does on CUDA.
    """

    late = True

    def __init__(self, *, depth: int = 3, max_depth: int = 64, fixed_lag: int | None = None,
                 event_factory: Callable[[torch.device], Any] | None = None) -> None:
        if depth < 3 or max_depth < depth:
            raise ValueError(f"LateReader(depth={depth}, max_depth={max_depth}): need 3 <= depth <= max_depth")
        if fixed_lag is not None and not 1 <= fixed_lag < max_depth:
            raise ValueError(f"LateReader(fixed_lag={fixed_lag}): need 1 <= fixed_lag < max_depth")
        self.depth = depth
        self.max_depth = max_depth
        # Exactly this many steps late, waiting when needed: under torch.distributed every rank
        # must judge a step at the same step (what follows may be a collective).
        self.fixed_lag = fixed_lag
        self._event = event_factory or record_event
        self._ring: deque[_Slot] = deque()  # in flight, oldest first
        self._free: list[torch.Tensor] = []
        self._layout: tuple | None = None

    @property
    def in_flight(self) -> int:
        return len(self._ring)

    def _buffer(self, vec: torch.Tensor) -> torch.Tensor:
        pin = vec.device.type == "cuda"  # pinned: the device-to-host copy can run asynchronously

        def alloc() -> torch.Tensor:
            return torch.empty(vec.shape, dtype=vec.dtype, pin_memory=pin)

        layout = (tuple(vec.shape), vec.dtype, pin)
        if layout != self._layout:  # first use (or a new layout): the ring's first buffers, once
            self._layout, self._free = layout, [alloc() for _ in range(self.depth)]
        return self._free.pop() if self._free else alloc()  # grown: the host ran further ahead

    def push(self, vec: torch.Tensor, tag: Any) -> list[tuple[np.ndarray, Any]]:
        """Start moving ``vec`` (this step's) to the host; return the earlier steps' vectors that
        have landed, oldest first (none, one, or several)."""
        if self.fixed_lag is not None:
            ready = self._collect(block=True, limit=max(0, len(self._ring) - self.fixed_lag + 1))
        else:
            ready = self._collect(block=False)
            if len(self._ring) >= self.max_depth:  # the host is max_depth steps ahead: backpressure
                ready += self._collect(block=True, limit=1)
        buf = self._buffer(vec)
        buf.copy_(vec.detach(), non_blocking=vec.device.type == "cuda")
        self._ring.append(_Slot(buf, tag, self._event(vec.device)))
        return ready

    def _collect(self, *, block: bool, limit: int | None = None) -> list[tuple[np.ndarray, Any]]:
        out: list[tuple[np.ndarray, Any]] = []
        while self._ring and (limit is None or len(out) < limit):
            slot = self._ring[0]
            if block:
                HOST_WAITS.wait(slot.event)
            elif not slot.event.query():
                break  # copies on one stream complete in order: nothing behind it is ready either
            self._ring.popleft()
            out.append((slot.buf.numpy().copy(), slot.tag))
            if self._layout is not None and (tuple(slot.buf.shape), slot.buf.dtype) == self._layout[:2]:
                self._free.append(slot.buf)
        return out

    def drain(self) -> list[tuple[np.ndarray, Any]]:
        """Every vector still in flight, oldest first (waits for them: flush / close only)."""
        return self._collect(block=True)
