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
    layer_rank: np.ndarray | None = None
    """Where each layer comes in the backward pass (0: first), when the live guard knows it: the
    order alerts list non-finite layers in, so that they name the same first layer as the skip."""

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


@dataclass
class StepColumns:
    """Many steps' signals as columns (a logged run); row ``i`` is :meth:`observation` ``(i)``.

    Each signal is a float array with one value per row, plus an optional ``*_known`` bool mask
    (``None``: known on every row). Where a value is known it is taken as it is: NaN and inf mean
    a non-finite value, as in :class:`Observation`; where it is not known the signal is absent
    from that row (``None`` in the Observation). ``extras`` maps a name (``update_norm``,
    ``param_norm``, ``loss_scale``, ...) to ``(values, known)``.
    """

    step: np.ndarray
    grad_norm: np.ndarray | None = None
    grad_known: np.ndarray | None = None
    loss: np.ndarray | None = None
    loss_known: np.ndarray | None = None
    layer_norms: np.ndarray | None = None
    """(rows, layers)."""
    layers_known: np.ndarray | None = None
    layer_nonfinite: np.ndarray | None = None
    """(rows, layers) counts or flags, or None."""
    skipped: np.ndarray | None = None
    extras: Mapping[str, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.step)

    @staticmethod
    def _known(mask: np.ndarray | None, i: int) -> bool:
        return True if mask is None else bool(mask[i])

    def observation(self, i: int) -> Observation:
        """Row ``i`` as an :class:`Observation`."""
        kn = self._known
        ex = {name: float(vals[i]) for name, (vals, known) in self.extras.items() if kn(known, i)}
        return Observation(
            step=int(self.step[i]),
            grad_norm=float(self.grad_norm[i]) if self.grad_norm is not None and kn(self.grad_known, i) else None,
            loss=float(self.loss[i]) if self.loss is not None and kn(self.loss_known, i) else None,
            layer_norms=(self.layer_norms[i] if self.layer_norms is not None and kn(self.layers_known, i)
                         else None),
            layer_nonfinite=None if self.layer_nonfinite is None else self.layer_nonfinite[i],
            skipped=bool(self.skipped[i]) if self.skipped is not None else False,
            extras=ex,
        )
