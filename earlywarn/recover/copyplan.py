"""Copy plans: how a flat part of a state tree (a ``state_dict()``, the optimizer's per-parameter
state) was copied into a host copy's buffers, replayed by the next copy into the same buffers
instead of walking the part tensor by tensor; and the optimizer's tensors as a snapshot saw them
(their addresses, devices and finiteness plan)."""

from __future__ import annotations

import collections
import operator
from itertools import chain
from typing import Any, Callable

import torch

from earlywarn.capture.norms import SMALL, NormSum

_STRIDED = torch.strided


def tensor_key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    return (t.device, t.data_ptr()) if t.numel() > 0 and t.layout == torch.strided else None


def flat_part(x: Any) -> tuple[list[torch.Tensor], tuple] | None:
    """The tensors of a flat part -- a mapping of tensors, or a mapping of mappings of tensors
    (the optimizer's per-parameter state) -- in order, with its structure; ``None`` otherwise."""
    if type(x) not in (dict, collections.OrderedDict) or not x:
        return None
    inner = list(x.values())
    kinds = set(map(type, inner))
    if kinds == {torch.Tensor}:
        return inner, (tuple(x),)
    if kinds == {dict}:
        vals = list(chain.from_iterable(map(dict.values, inner)))
        if vals and set(map(type, vals)) == {torch.Tensor}:
            return vals, (tuple(x), tuple(chain.from_iterable(map(dict.keys, inner))), tuple(map(len, inner)))
    return None


def _picker(positions: list[int]) -> Callable[[list[Any]], Any]:
    return operator.itemgetter(*positions) if len(positions) > 1 else (lambda xs, i=positions[0]: (xs[i],))


class PartPlan:
    """How a flat part of a state tree was copied into a host copy's buffers: which tensors went
    to which buffer by which route (a host copy, a side-stream or a compute-stream device copy) and
    which were kept by reference. The next copy into the same buffers replays it -- one check of
    the part's structure and of its tensors' addresses and shapes in C, then the copies in groups
    -- instead of walking the part tensor by tensor. Any difference (a key, a reallocated or
    reshaped tensor, a weight frozen or unfrozen since) means a walk and a new plan.

    Small host tensors of one shape and dtype (``capture.norms.SMALL`` elements at most) get rows
    of one stacked buffer: ``torch.stack(..., out=)`` copies them in one call, where
    ``_foreach_copy_`` pays a dispatch per tensor on the CPU (hundreds of biases and norms)."""

    __slots__ = ("sig", "out", "host", "stacks", "side", "main", "owned", "kept")

    def __init__(self, sig: tuple, out: Any) -> None:
        self.sig, self.out = sig, out
        self.host: list[tuple[torch.dtype, list[torch.Tensor], Any]] = []
        self.stacks: list[tuple[torch.Tensor, Any]] = []  # (stacked buffer, its rows' sources)
        self.side: list[tuple[torch.device, list[torch.Tensor], Any]] = []
        self.main: list[tuple[torch.device, list[torch.Tensor], Any]] = []
        self.owned: list[torch.Tensor] = []
        self.kept: set[int] = set()

    @staticmethod
    def make(sig: tuple, out: Any, srcs: list[torch.Tensor], owned_ids: set[int]) -> "PartPlan | None":
        flat = flat_part(out)
        if flat is None or len(flat[0]) != len(srcs):
            return None
        plan = PartPlan(sig, out)
        routes: dict[tuple, tuple[list[torch.Tensor], list[int]]] = collections.defaultdict(lambda: ([], []))
        for i, (src, dst) in enumerate(zip(srcs, flat[0])):
            if dst is src:
                plan.kept.add(id(dst))
                continue
            if not dst.is_cpu or dst.layout is not _STRIDED or dst.data_ptr() == src.data_ptr():
                return None
            if src.is_cpu:
                small = src.is_contiguous() and 0 < src.numel() <= SMALL
                route: tuple = ("stack", (src.dtype, src.shape)) if small else ("host", src.dtype)
            elif src.is_cuda and dst.is_pinned():
                route = ("side" if id(dst) in owned_ids else "main", src.device)
            else:
                return None
            dsts, pos = routes[route]
            dsts.append(dst)
            pos.append(i)
        slots = _slots(out)
        for (kind, where), (dsts, pos) in routes.items():
            if kind == "stack" and len(pos) > 1:
                big = torch.empty((len(pos), *where[1]), dtype=where[0])
                rows = big.unbind(0)
                for i, dst, row in zip(pos, dsts, rows):
                    _put(out, slots[i], row)
                    if id(dst) in owned_ids:
                        owned_ids.add(id(row))
                plan.stacks.append((big, _picker(pos)))
                dsts[:] = rows
            else:
                getattr(plan, "host" if kind == "stack" else kind).append(
                    (where[0] if kind == "stack" else where, dsts, _picker(pos)))
        plan.owned = [t for t in flat_part(out)[0] if id(t) in owned_ids]  # type: ignore[index]
        return plan


def _slots(part: Any) -> list[tuple]:
    """Where each tensor of a flat part sits (its key, or outer and inner key), in order."""
    first = next(iter(part.values()))
    if isinstance(first, dict):
        return [(o, k) for o, inner in part.items() for k in inner]
    return [(k,) for k in part]


def _put(part: Any, slot: tuple, value: torch.Tensor) -> None:
    if len(slot) == 1:
        part[slot[0]] = value
    else:
        part[slot[0]][slot[1]] = value


class SidePlan:
    """The optimizer's tensors as one snapshot saw them (see :meth:`_HostCopier.side_plan`)."""

    __slots__ = ("ids", "ptrs", "keys", "cpu_ptrs", "devices")

    def __init__(self, side: list[torch.Tensor], ids: tuple, ptrs: tuple) -> None:
        self.ids, self.ptrs = ids, ptrs
        self.keys = {k for k in (tensor_key(t) for t in side) if k is not None}
        self.cpu_ptrs = {ptr for dev, ptr in self.keys if dev.type == "cpu"}
        by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
        for i, t in enumerate(side):
            by_device[t.device].append(i)
        # per device: which of them, and their finiteness flag's plan (capture.norms)
        self.devices = [(dev, _picker(pos), NormSum([side[i] for i in pos])) for dev, pos in by_device.items()]
