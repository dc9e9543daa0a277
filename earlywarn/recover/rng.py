"""The global random generators a snapshot keeps: Python, numpy, torch CPU and every CUDA device's."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when CUDA is initialised) every CUDA device's generator."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
    }


def restore_rng(state: dict[str, Any]) -> None:
    if state.get("python") is not None:
        random.setstate(_as_python_random_state(state["python"]))
    if state.get("numpy") is not None:
        np.random.set_state(tuple(state["numpy"]))
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"].clone())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.clone() for s in cuda])


def _as_python_random_state(s: Any) -> tuple:
    # pickling keeps the tuple shape, but a state coming through JSON-like paths may be lists
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
