"""What a detector is fed at one optimizer step: plain numbers, live or replayed from a log."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class Observation:
    """One step's signals.

    The live guard builds one from the single host read of its device statistics; the offline
    analyser builds one per logged row. Anything a source does not have is ``None`` (not 0: a
    logger's ``0.000`` means "not computed", and the readers turn it into ``None``).

    ``grad_norm`` and ``layer_norms`` are L2 norms of the *unscaled* gradients; non-finite values
    are allowed and mean exactly that. ``layer_nonfinite`` counts non-finite gradient elements per
    layer when known (or 0/1 flags). ``skipped`` says the optimizer step was not applied (our
    guard, or an fp16 loss scaler); a detector must keep such steps out of its baselines.
    """

    step: int
    grad_norm: float | None = None
    layer_norms: np.ndarray | None = None
    loss: float | None = None
    layer_nonfinite: np.ndarray | None = None
    skipped: bool = False
    batch: int | None = None
    extras: Mapping[str, float] = field(default_factory=dict)
    """Optional signals when present: ``update_norm``, ``param_norm``, ``loss_scale``, ``lr``."""

    @property
    def grad_finite(self) -> bool:
        """False when any gradient value (global or per layer) is non-finite."""
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            return False
        if self.layer_nonfinite is not None and np.any(self.layer_nonfinite):
            return False
        if self.layer_norms is not None and not np.all(np.isfinite(self.layer_norms)):
            return False
        return True
