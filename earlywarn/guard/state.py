"""The watcher's state in the shapes ``torch.save`` / ``torch.load(weights_only=True)`` accept."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch


class WatcherCheckpointState:
    """What every snapshot and checkpoint carries of the watcher (``extra_state["earlywarn_watcher"]``):
    its counters, its training step and the run's clock. Only a resume loads it: a rewind keeps
    the live counters and clock (``keep_on_rewind``)."""

    def __init__(self, telemetry: Any):
        self._telemetry = telemetry

    def state_dict(self) -> dict[str, Any]:
        t = self._telemetry
        return {**t.clock.state_dict(), "counters": dict(t.counters)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The run's clock never goes back: trackers drop rows whose step is lower than one already logged.
        t = self._telemetry
        t.counters.update(state["counters"])
        t.clock.merge(state)
        t.counters["steps"] = t.clock.step


def weights_only_safe(tree: Any) -> Any:
    """numpy arrays -> tensors, numpy scalars -> Python numbers, tuples kept: what
    ``torch.load(weights_only=True)`` accepts (the detector is pure numpy)."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree).copy())
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, Mapping):
        return {k: weights_only_safe(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(weights_only_safe(v) for v in tree)
    return tree


def from_saved(tree: Any) -> Any:
    """Inverse of :func:`weights_only_safe` (tensors -> numpy arrays)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, Mapping):
        return {k: from_saved(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(from_saved(v) for v in tree)
    return tree
