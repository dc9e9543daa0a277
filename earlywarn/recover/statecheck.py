"""The optimizer's state checked at every step, before the update that would read it.

Some updates hide a poisoned moment. Lion steps by ``sign(interp(exp_avg, grad))`` and
``sign(NaN) = 0``: a NaN ``exp_avg`` freezes its coordinates, and no NaN ever reaches the weights,
the gradients or the loss, so nothing the guard reads would show it (timm's and lion-pytorch's
Lion, sign-based and clamped updates alike). Adam's NaN moment does reach the weights, at the next
update, and then costs a rewind. The periodic snapshot's finiteness pass finds either, but up to
``snapshot_every`` steps late. So every step, the state is read once on the device: a poisoned
moment is repaired before the update that would use it, and no step is lost.

How: one fused L2 norm per device and dtype over every floating state tensor, nested state
included (``torch._foreach_norm``: NaN and Inf propagate into a norm), summed into one number
that rides in the step's statistics vector -- no extra host read, no extra sync. A huge finite
value whose square overflows float32 (CPU) reads as non-finite: a false alarm that the exact scan
then settles (nothing is repaired). Cost: one read of the optimizer state per step, about twice
the guard's gradient-norm pass for Adam (measured in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from ._state import local


def _state_tensors(tree: object, out: list[torch.Tensor]) -> None:
    # flat dicts of tensors (torch.optim) cost one loop; containers (heavyball) recurse
    for v in tree.values() if isinstance(tree, dict) else tree:  # type: ignore[attr-defined]
        if type(v) is torch.Tensor or isinstance(v, torch.Tensor):
            if (v.is_floating_point() or v.is_complex()) and v.numel() > 0 and v.layout == torch.strided:
                out.append(local(v))
        elif isinstance(v, (dict, list, tuple)):
            _state_tensors(v, out)


def check_every(optimizer: torch.optim.Optimizer, every: int | None) -> int:
    """Steps between two checks (``RecoveryConfig.state_check_every``; ``None``: by the optimizer).
    torch.optim's own optimizers pass a NaN moment on to the weights at the next update, where the
    guard sees it; any other may hide one (a sign-based update), so it is checked every step."""
    if every is not None:
        return every
    return 10 if type(optimizer).__module__.startswith("torch.optim") else 1


class StateCheck:
    """The per-step finiteness flag of one optimizer's state (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, retry_after: int = 25) -> None:
        self.optimizer = optimizer
        self.retry_after = retry_after
        self._failed_at: int | None = None  # a repair that left the state non-finite: not retried every step

    def tensors(self) -> list[torch.Tensor]:
        """The floating state tensors as they are now (walked every step: optimizers may replace
        a state tensor rather than write it in place, and a kept list would then go stale)."""
        out: list[torch.Tensor] = []
        for st in self.optimizer.state.values():
            _state_tensors(st, out)
        return out

    def flag(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A 1-element tensor on ``device``: finite iff every state tensor is (0 before the
        optimizer's first step). Issued on the device; nothing is read on the host here."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
        for t in self.tensors():
            groups[(t.device, t.dtype)].append(t)
        if not groups:
            return torch.zeros(1, dtype=dtype, device=device)
        sums = []
        for (dev, dt), ts in groups.items():
            norms = torch._foreach_norm(ts, 2) if dt.is_complex else torch._foreach_norm(
                ts, 2, dtype=torch.float64 if (dev.type == "cuda" or dt == torch.float64) else torch.float32)
            total = torch.stack(norms).sum()
            sums.append(total if dev == device else total.to(device, non_blocking=device.type == "cuda"))
        return torch.stack([s.to(dtype) for s in sums]).sum().reshape(1)

    def repair_if_poisoned(self, value: float, recovery: Any, step: int) -> bool:
        """``value``: the flag as read on the host with the step's vector. When the state holds
        a NaN or Inf, repair it now, before this step's update (``recovery.repair``: scan,
        reset the poisoned coordinates, verify, one REPAIR event). True when something was
        repaired. A repair that could not make the state finite is retried ``retry_after``
        steps later, not at every step (what it left is then the rest of the guard's to meet)."""
        if math.isfinite(value):
            return False
        if self._failed_at is not None and step - self._failed_at < self.retry_after:
            return False
        report = recovery.repair(step)
        self._failed_at = None if report.ok else step
        return bool(report.repaired)
