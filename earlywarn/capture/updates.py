"""The update side of a step: the learning rate the optimizer is about to step with.

Issue 14 measured each candidate leading signal on the detection corpus before anything entered
the defaults (``benchmarks/detection.py``, per-signal table). At 0.5 false alarms / 1k healthy
steps, the LR of the step alone caught 40% of the collapses (median lead 4) and is the only
signal that sees an LR pulse *before* the update it scales; the update norm as the live guard can
know it (one step late: a parameter delta or Adam's m / sqrt(v) of the step before) caught 8%,
Adam's g^2 / v decoupling 4%. So the LR is captured and the update norm and g^2 / v are not
(they would cost extra passes over the parameters and the optimizer state, for no detection).

The LR costs no device work: ``param_groups[i]["lr"]`` is a host number in nearly every setup
(schedulers write floats). A tensor LR on the CPU is read as it is; a tensor LR on an accelerator
(``capturable=True`` with ``lr=torch.tensor(...)``) is left unread, because reading it would be
a host sync per step, and the LR rule simply does not apply to such a run.
"""

from __future__ import annotations

import math

import torch


def learning_rate(optimizer: torch.optim.Optimizer, *, read_device: bool = False) -> float | None:
    """The largest learning rate over the optimizer's parameter groups (the most aggressive one
    decides the hazard; a frozen group's 0 never hides the one that trains), or ``None`` when no
    group has a readable, finite one. The one rule for every learning rate earlywarn reports: the
    detector's, the recurrence's diagnosis. ``read_device``: read a tensor LR on an accelerator
    too (a host sync: rare paths only)."""
    best = None
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1 or (lr.device.type != "cpu" and not read_device):
                continue  # reading it would sync the device
            lr = float(lr.detach().reshape(-1)[0])
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            continue
        lr = float(lr)
        if math.isfinite(lr) and lr >= 0.0 and (best is None or lr > best):
            best = lr
    return best


def scale_free(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step hardly depends on the gradient's scale: Adam and its kin divide
    by a running second moment, Lion and Rprop take signs, Adafactor and Muon normalize -- a gradient
    clipped by a steady factor trains as fast. Plain SGD and ASGD step by the gradient itself (so
    do SGD variants of other libraries, told by name): a clipped gradient is a smaller step."""
    opt = getattr(optimizer, "optimizer", optimizer)  # a wrapper (accelerate's, Lightning's) holds the real one
    return not (isinstance(opt, (torch.optim.SGD, torch.optim.ASGD)) or "sgd" in type(opt).__name__.lower())
