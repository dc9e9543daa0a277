"""The optimizer's state checked at every step, before the update that would read it.

Some updates hide a poisoned moment. Lion steps by ``sign(interp(exp_avg, grad))`` and
``sign(NaN) = 0``: a NaN ``exp_avg`` freezes its coordinates, and no NaN ever reaches the weights,
the gradients or the loss, so nothing the guard reads would show it (timm's and lion-pytorch's
Lion, sign-based and clamped updates alike). Adam's NaN moment does reach the weights, at the next
update, and then costs a rewind. The periodic snapshot's finiteness pass finds either, but up to
``snapshot_every`` steps late. So every step, the state is read once on the device: a poisoned
moment is repaired before the update that would use it, and no step is lost.

How: one planned L2 norm pass per device and dtype over every floating state tensor, nested
state included (``capture.norms``: NaN and Inf propagate into a norm), summed into one number
that rides in the step's statistics vector -- no extra host read, no extra sync. A huge finite
value whose square overflows float32 (CPU) reads as non-finite: a false alarm that the exact scan
then settles (nothing is repaired). Cost: one read of the optimizer state per step, about twice
the guard's gradient-norm pass for Adam (measured in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
import operator
from itertools import chain
from typing import Any

import torch

from earlywarn.capture.norms import NormSum

from .forms import is_wrapped, local, parts
from .holders import state_holders, stepper


def _checked(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and t.layout == torch.strided


def _state_tensors(tree: object, out: list[torch.Tensor]) -> None:
    # flat dicts of tensors (torch.optim) cost one loop; containers (heavyball) recurse
    for v in tree.values() if isinstance(tree, dict) else tree:  # type: ignore[attr-defined]
        if type(v) is torch.Tensor or isinstance(v, torch.Tensor):
            t = local(v)
            if is_wrapped(t):  # a subclass (torchao's quantized moments): its floating parts (forms.py)
                out += [x for x in parts(t) or () if _checked(x)]
            elif _checked(v):
                out.append(t)
        elif isinstance(v, (dict, list, tuple)):
            _state_tensors(v, out)


def _flat_values(states: list[Any]) -> list[Any] | None:
    """Every per-parameter state's values in one list, in C (``None`` when a per-parameter
    state is not a dict); ``states``: the ``state`` of each holder."""
    try:
        return list(chain.from_iterable(map(dict.values, chain.from_iterable(s.values() for s in states))))
    except TypeError:
        return None


def check_every(optimizer: torch.optim.Optimizer, every: int | None) -> int:
    """Steps between two checks (``RecoveryConfig.state_check_every``; ``None``: by the optimizer).
    torch.optim's own optimizers pass a NaN moment on to the weights at the next update, where the
    guard sees it; any other may hide one (a sign-based update), so it is checked every step."""
    if every is not None:
        return every
    return 10 if type(stepper(optimizer)).__module__.startswith("torch.optim") else 1  # ZeRO-1: its local one


class StateCheck:
    """The per-step finiteness flag of one optimizer's state (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, retry_after: int = 25) -> None:
        # where the state lives: the optimizer, any it wraps (timm's Lookahead), ZeRO-1's share (recover/holders.py)
        self._holders = state_holders(optimizer)
        self.retry_after = retry_after
        self._failed_at: int | None = None  # a repair that left the state non-finite: not retried every step
        # The walk, planned: ids of the state's values when last walked, which of them are checked,
        # and how their norms are taken (stacked by shape on the CPU: capture/norms.py)
        self._ids: list[int] | None = None
        self._pick: Any = None
        self._local = False
        self._sum: NormSum | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The floating state tensors as they are now. Walked again whenever a state value is
        not the object it was (optimizers may replace a state tensor rather than write it in
        place, and a kept list would then go stale): for flat per-parameter dicts -- every
        torch.optim optimizer -- that test is one pass in C over the values' ids; nested state
        (containers inside) is walked every time."""
        states = [h.state for h in self._holders]
        values = _flat_values(states)
        if values is not None and self._ids is not None and list(map(id, values)) == self._ids:
            return self._picked(values)
        out: list[torch.Tensor] = []
        for state in states:
            for st in state.values():
                _state_tensors(st, out)
        self._plan(values, out)
        return out

    def _picked(self, values: list[Any]) -> list[torch.Tensor]:
        ts = list(self._pick(values))
        return [local(t) for t in ts] if self._local else ts

    def _plan(self, values: list[Any] | None, walked: list[torch.Tensor]) -> None:
        """Plan the next calls from this walk, when the state is flat (no containers inside)."""
        self._ids, self._sum = None, None
        if values is None or any(isinstance(v, (dict, list, tuple)) or is_wrapped(local(v)) for v in values):
            return  # nested state, or a subclass read through its parts: walked every time
        picked = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and _checked(v)]
        if len(picked) != len(walked):
            return  # not what the walk found (cannot happen for flat state): no plan
        self._ids = list(map(id, values))
        self._pick = (lambda xs: ()) if not picked else (lambda xs, i=picked[0]: (xs[i],)) if len(picked) == 1 \
            else operator.itemgetter(*picked)
        self._local = any(v is not local(v) for v in values if isinstance(v, torch.Tensor))

    def flag(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A 1-element tensor on ``device``: finite iff every state tensor is (0 before the
        optimizer's first step). Issued on the device; nothing is read on the host here."""
        ts = self.tensors()
        if not ts:
            return torch.zeros(1, dtype=dtype, device=device)
        if self._sum is None or self._ids is None:
            self._sum = NormSum(ts)  # the list changed (or is walked every time): planned anew
        return self._sum.total(ts, device, dtype)

    def repair_if_poisoned(self, value: float, recovery: Any, step: int) -> bool:
        """``value``: the flag as read on the host with the step's vector. When the state holds
        a NaN or Inf, repair it now, before this step's update (``recovery.repair``: scan,
        reset the poisoned coordinates, verify, one REPAIR event). True when something was
        repaired. State a repair could not make finite is the judge's to meet
        (``recovery.unrepaired``: rewound before any update reads it), not repaired again here;
        one that left nothing for it (a dry run's, or poisoned buffers only) is retried
        ``retry_after`` steps later, not at every step."""
        if math.isfinite(value) or recovery.unrepaired is not None:
            return False
        if self._failed_at is not None and 0 <= step - self._failed_at < self.retry_after:
            return False
        report = recovery.repair(step)
        self._failed_at = None if report.ok or recovery.unrepaired is not None else step
        return bool(report.repaired)
