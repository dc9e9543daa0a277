"""Moving the per-step statistics vector to the host: once per step, or one step late.

``SyncReader`` blocks for the current step's vector (one batched transfer; on CPU it is free).
``LateReader`` never blocks the hot path on CUDA: it starts a non-blocking copy into pinned
memory, records an event, and hands back the *previous* step's vector, whose copy has long
finished. The guard's skip decision does not depend on the host in that mode (the fused
optimizer reads ``found_inf`` on the device), only the detector sees values a step late.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class SyncReader:
    late = False

    def push(self, vec: torch.Tensor, tag: Any) -> tuple[np.ndarray, Any]:
        # This is the one host sync per step (nothing to wait for on CPU).
        return vec.detach().to("cpu").numpy(), tag

    def drain(self) -> list[tuple[np.ndarray, Any]]:
        return []


class LateReader:
    late = True

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, Any, Any] | None = None
        self._buffers: list[torch.Tensor] = []
        self._flip = 0

    def _buffer(self, vec: torch.Tensor) -> torch.Tensor:
        pin = vec.device.type == "cuda"
        if len(self._buffers) != 2 or self._buffers[0].shape != vec.shape or self._buffers[0].dtype != vec.dtype:
            self._buffers = [torch.empty(vec.shape, dtype=vec.dtype, pin_memory=pin) for _ in range(2)]
        self._flip ^= 1
        return self._buffers[self._flip]

    def push(self, vec: torch.Tensor, tag: Any) -> tuple[np.ndarray, Any] | None:
        ready = self._collect()
        buf = self._buffer(vec)
        buf.copy_(vec.detach(), non_blocking=vec.device.type == "cuda")
        event = None
        if vec.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._pending = (buf, tag, event)
        return ready

    def _collect(self) -> tuple[np.ndarray, Any] | None:
        if self._pending is None:
            return None
        buf, tag, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # recorded a whole step ago: already complete in practice
        return buf.numpy().copy(), tag

    def drain(self) -> list[tuple[np.ndarray, Any]]:
        ready = self._collect()
        return [ready] if ready is not None else []
