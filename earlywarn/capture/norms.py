"""Per-tensor L2 norms of many tensors on one device and of one dtype, planned once.

``torch._foreach_norm`` is one fused kernel per chunk of tensors on CUDA. On the CPU it loops
over the tensors in C++ and pays a full dispatch per tensor (~1-2 us): for the hundreds of small
tensors of a real model (biases, norm weights, adapters) that costs more than the arithmetic.
There, tensors of up to :data:`SMALL` elements that share a shape (at least :data:`STACK_MIN` of
them) are stacked (one copy of a few KB each) and reduced row by row in one call -- the same
values, bit for bit -- and only the others go through ``_foreach_norm``. The plan (which tensor
goes where) depends on the shapes only, so it is made once per set of tensors and reused every step.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

SMALL = 4096
"""Elements up to which a CPU tensor is stacked with others of its shape (measured: stacking
costs less than a per-tensor dispatch up to ~16k float32 elements; 4096 keeps a margin)."""

STACK_MIN = 8
"""Tensors of one shape that make a stack worth its three calls. Measured with the caches cold,
as a backward pass leaves them (a call then costs ~10x its warm time): a stack of 2-4 tensors
(LoRA's adapters) costs more than their turns in ``_foreach_norm``'s loop; 8 and more save (a
12-layer GPT's groups of 12: 385 us against 439 us with no stack of fewer than 16)."""


def _picker(members: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    if len(members) == 1:
        i = members[0]
        return lambda xs: (xs[i],)
    return operator.itemgetter(*members)  # a tuple, in C


class NormPlan:
    """How the norms of a list of tensors (one device, one dtype, fixed shapes) are computed.

    :meth:`norms` returns them as one 1-D tensor in :attr:`order` (positions in the list given
    to the plan), which is not the list's own order when tensors were stacked."""

    __slots__ = ("order", "_stacks", "_rest")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        first = tensors[0]
        stackable = first.device.type == "cpu" and first.is_floating_point() and first.layout == torch.strided
        self._plan([t.shape for t in tensors] if stackable else None, len(tensors))

    @classmethod
    def of_shapes(cls, shapes: Sequence[torch.Size], *, stackable: bool) -> "NormPlan":
        """The plan of tensors of these shapes (``stackable``: strided floating-point CPU tensors),
        made without the tensors at hand."""
        plan = cls.__new__(cls)
        plan._plan(shapes if stackable else None, len(shapes))
        return plan

    def _plan(self, shapes: Sequence[torch.Size] | None, n: int) -> None:
        by_shape: dict[torch.Size, list[int]] = defaultdict(list)
        rest: list[int] = []
        for i in range(n):
            if shapes is not None and 0 < shapes[i].numel() <= SMALL:
                by_shape[shapes[i]].append(i)
            else:
                rest.append(i)
        stacks = []
        for members in by_shape.values():
            if len(members) >= STACK_MIN:
                stacks.append(members)
            else:
                rest.extend(members)  # a few tensors of their shape: the loop costs less than a stack
        rest.sort()
        self._stacks = [(_picker(m), len(m)) for m in stacks]
        self._rest = _picker(rest) if rest else None
        self.order: list[int] = [i for m in stacks for i in m] + rest

    def norms(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The L2 norm of each tensor (``tensors``: the planned list, this step's values),
        accumulated in ``dtype`` (``None``: the tensors' own; complex tensors give real norms)."""
        parts = self.parts(tensors, dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def parts(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """:meth:`norms` as the 1-D pieces it joins, in order (each stack's, then the others'):
        a host that reads the values reads each piece, one torch call fewer."""
        parts = [torch.linalg.vector_norm(torch.stack(pick(tensors)).view(k, -1), dim=1, dtype=dtype)
                 for pick, k in self._stacks]
        if self._rest is not None:
            rest = self._rest(tensors)
            norms = torch._foreach_norm(rest, 2) if dtype is None else torch._foreach_norm(rest, 2, dtype=dtype)
            parts.append(torch.stack(norms))
        return parts


class NormSum:
    """One number that is finite iff every tensor of a list is: the sum of their L2 norms, one
    planned pass per (device, dtype) group (NaN and Inf propagate into a norm). ``None`` when
    no tensor is floating. Replan with a new object when the list changes."""

    __slots__ = ("_groups",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            if (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and t.layout == torch.strided:
                groups[(t.device, t.dtype)].append(i)
        self._groups = [(dev, dt, _picker(m), NormPlan([tensors[i] for i in m])) for (dev, dt), m in groups.items()]

    def __bool__(self) -> bool:
        return bool(self._groups)

    def total(self, tensors: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The sum, as a 1-element ``dtype`` tensor on ``device`` (issued there, never read on the
        host). Accumulated in float64 on CUDA (free there: no finite value overflows it), in
        float32 on the CPU, where a huge finite value may overflow it: a false alarm that the
        callers settle exactly."""
        sums = []
        for dev, dt, pick, plan in self._groups:
            acc = None if dt.is_complex else torch.float64 if (dev.type == "cuda" or dt == torch.float64) else torch.float32
            s = plan.norms(pick(tensors), acc).sum()
            sums.append(s if dev == device else s.to(device, non_blocking=device.type == "cuda"))
        if not sums:
            return torch.zeros(1, dtype=dtype, device=device)
        total = sums[0] if len(sums) == 1 else torch.stack([s.to(dtype) for s in sums]).sum()
        return total.to(dtype).reshape(1)
