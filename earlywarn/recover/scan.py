"""Find poisoned (non-finite) values in parameters, buffers and optimizer state: what
:mod:`earlywarn.recover.repair` then repairs. Optimizer state is walked to any depth.

What "poisoned" means depends on who writes the tensor (:func:`scan_state`):

* parameters the optimizer updates, and every optimizer state tensor: any NaN/Inf is poison;
* parameters the optimizer never writes (frozen: ``requires_grad=False`` or in no param group):
  their values belong to the model, never poison;
* buffers (written by the forward pass, e.g. BatchNorm statistics, or constant, e.g. a float
  causal mask with ``-inf`` above the diagonal, ``-inf`` padding biases): a NaN/Inf is poison only
  where the last known-good copy of that buffer was finite (:class:`FiniteBaseline`: taken at
  ``watch()``, refreshed at every clean snapshot). A buffer the baseline has not seen yet (created
  later, or re-created with another shape) is taken as it is until the next refresh.
  Integer and bool buffers are never scanned.

Under torch.distributed (world size > 1) scans and repairs read and write each rank's *local
shards* of sharded state (FSDP2 / tensor parallel DTensors; plain tensors as they are), and the
numbers a decision depends on are agreed over all ranks in a few small all-reduces (never one per
tensor, never a full-tensor gather): the scan's per-tensor counts (one SUM), the repair's per-tensor
counts and snapshot checks (one SUM) and its "largest finite value"s (one MAX, only when a second
moment needs one). So every rank gets the same :class:`StateScan` and :class:`RepairReport`, and
writes the same values into its shards. Every rank must therefore call these functions together,
in the same order, on the same model and optimizer structure -- the watcher does: its decisions
are identical on every rank. A replicated tensor (DDP, a ``Replicate`` placement) is counted once
per element (the sum is divided by the ranks holding a copy, a disagreement rounded up); where only
one replica is poisoned, only that rank's copy is reset.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from earlywarn.capture.gradstats import _copy_weight
from earlywarn.capture.grouping import _wrapper_prefix, user_name

from .forms import is_dtensor, local, state_leaves, values
from ._tree import path_name
from .holders import _checkable, agreed_state

@dataclass(frozen=True)
class Flag:
    """One tensor holding non-finite values. ``key`` is ``None`` for the parameter itself,
    ``"buffer"`` for a module buffer, else the optimizer state key."""

    name: str
    key: str | None
    nonfinite: int
    numel: int

    @property
    def where(self) -> str:
        return self.name if self.key is None else f"{self.name}[{self.key}]"


@dataclass
class StateScan:
    """Result of :func:`scan_state`: the tensors with non-finite values, in model order."""

    flags: list[Flag]
    tensors_checked: int
    _refs: dict[tuple[str, str | None], tuple[Any, torch.Tensor, str]] = field(default_factory=dict, repr=False)
    """(name, key) -> (parameter, tensor, the name in the model's state_dict, wrappers included)."""
    _param_numel: int = field(default=0, repr=False)
    owned: list[Flag] = field(default_factory=list)
    """Tensors holding non-finite values that belong to the model (not poison): a ``-inf`` mask
    buffer, a frozen parameter. Counted only with a baseline (see :func:`scan_state`)."""
    _legit: dict[tuple[str, str | None], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def clean(self) -> bool:
        return not self.flags

    @property
    def params(self) -> list[Flag]:
        return [f for f in self.flags if f.key is None]

    @property
    def buffers(self) -> list[Flag]:
        return [f for f in self.flags if f.key == "buffer"]

    @property
    def state(self) -> list[Flag]:
        return [f for f in self.flags if f.key not in (None, "buffer")]

    @property
    def params_poisoned(self) -> bool:
        """A parameter or buffer holds a non-finite value (repair needs a snapshot, or rewind)."""
        return bool(self.params or self.buffers)

    @property
    def weights_poisoned(self) -> bool:
        """A parameter the optimizer updates holds a non-finite value (buffers aside)."""
        return bool(self.params)

    @property
    def state_poisoned(self) -> bool:
        """Optimizer state holds a non-finite value (repairable in place)."""
        return bool(self.state)

    @property
    def first_layer(self) -> str | None:
        """The first parameter (model order) with a non-finite value in itself or its state."""
        return self.flags[0].name if self.flags else None

    def summary(self) -> str:
        if self.clean:
            own = f" (the model's own non-finite values are not poison: {_list(self.owned)})" if self.owned else ""
            return f"all {self.tensors_checked} tensors finite{own}"
        return "non-finite values in " + _list(self.flags)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensors_checked": self.tensors_checked,
            "flags": [{"name": f.name, "key": f.key, "nonfinite": f.nonfinite, "numel": f.numel} for f in self.flags],
        }


def _list(flags: list[Flag]) -> str:
    parts = [f"{f.where}: {f.nonfinite}/{f.numel}" for f in flags[:6]]
    return ", ".join(parts) + (f" (+{len(flags) - 6} more)" if len(flags) > 6 else "")


def _written_by(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module | None) -> set[int]:
    """ids of the parameters the optimizer updates (in a param group and requiring grad;
    without an optimizer: every parameter that requires grad)."""
    if optimizer is None:
        return {id(p) for p in model.parameters() if p.requires_grad} if model is not None else set()
    return {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}


class FiniteBaseline:
    """The non-finite values that belong to the model: per buffer, where it was non-finite when
    last known good (at ``watch()``, at every clean snapshot). Only buffers that hold a NaN/Inf
    keep a mask (on their device; a causal mask's is the size of the mask); finite ones keep
    their shape. ``copies``: host copies of the floating buffers at capture time, to repair a
    buffer poisoned before the first snapshot exists."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, ...], torch.dtype, torch.Tensor | None]] = {}
        self.copies: dict[str, torch.Tensor] = {}

    @classmethod
    def capture(cls, model: torch.nn.Module | None, *, copies: bool = True) -> "FiniteBaseline":
        base = cls()
        base.refresh(model, copies=copies)
        return base

    def refresh(self, model: torch.nn.Module | None, *, copies: bool = False) -> None:
        """Record every floating buffer that is new or changed shape (one host read for all of
        them; nothing when nothing changed). A buffer already known keeps its mask: its
        non-finite coordinates do not move unless something poisoned it."""
        if model is None:
            return
        todo: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for name, b in model.named_buffers(remove_duplicate=True):
                if not _checkable(b):
                    continue
                lb = local(b)
                known = self._known.get(name)
                if known is None or known[0] != tuple(lb.shape) or known[1] != lb.dtype:
                    todo.append((name, lb, torch.isfinite(lb).logical_not_()))
                if copies:
                    self.copies[name] = lb.detach().to("cpu", copy=True)
            if not todo:
                return
            bad = torch.stack([m.sum().to(todo[0][2].device) for _, _, m in todo]).tolist()  # the one host read
        for (name, lb, mask), n in zip(todo, bad):
            self._known[name] = (tuple(lb.shape), lb.dtype, mask if n else None)

    def legit(self, name: str, t: torch.Tensor) -> torch.Tensor | None | bool:
        """The buffer's own non-finite coordinates: a mask, ``None`` (it was all finite) or
        ``True`` (not seen yet with this shape: all of its values are taken as the model's)."""
        known = self._known.get(name)
        lt = local(t)
        if known is None or known[0] != tuple(lt.shape) or known[1] != lt.dtype:
            return True
        return known[2]


def _param_names(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    names: dict[int, str] = {}
    if model is not None:
        for n, p in model.named_parameters(remove_duplicate=True):
            names.setdefault(id(p), n)
    if optimizer is not None:
        for gi, g in enumerate(optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                names.setdefault(id(p), f"param_groups[{gi}].params[{pi}]")
    return names


def _same_shape(v: torch.Tensor, p: torch.Tensor) -> bool:
    """``v`` covers the same coordinates as ``p``, shard for shard (so masks can be shared)."""
    return v.shape == p.shape and local(v).shape == local(p).shape and is_dtensor(v) == is_dtensor(p)


class _Agree:
    """Numbers every rank must agree on (rare path). In one process: the local values. Under
    torch.distributed with world size > 1: one all-reduce per call, on the state's device (the
    backend's device: NCCL needs CUDA tensors). A call with no values issues nothing; callers
    only make such calls from numbers that are already agreed, so every rank skips it alike."""

    def __init__(self) -> None:
        d = torch.distributed
        self.world = d.get_world_size() if d.is_available() and d.is_initialized() else 1

    def holders(self, t: torch.Tensor) -> int:
        """Ranks holding a copy of each element of ``t`` (1 for a shard, the world for DDP state)."""
        return 1 if self.world == 1 else round(1.0 / _copy_weight(t, self.world))

    def sum(self, values: list[torch.Tensor | int], device: torch.device) -> list[int]:
        if not values:
            return []
        vec = torch.stack([torch.as_tensor(v).to(device, torch.int64) for v in values])
        if self.world > 1:
            torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM)
        return [int(v) for v in vec.tolist()]  # one host read

    def max(self, values: list[torch.Tensor], device: torch.device) -> list[float]:
        if not values:
            return []
        dtype = torch.float32 if device.type == "mps" else torch.float64
        vec = torch.stack([v.to(device, dtype) for v in values])
        if self.world > 1:
            torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.MAX)
        return [float(v) for v in vec.tolist()]


def _finite_abs_max(t: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """Largest ``|t|`` over the finite elements (and ``where``), as a device scalar; ``-inf``
    when there is none (an empty local shard included)."""
    a = t.abs()
    none = torch.full((), -math.inf, dtype=a.dtype, device=a.device)
    if t.numel() == 0:
        return none
    ok = torch.isfinite(t) if where is None else torch.isfinite(t) & where
    return torch.where(ok, a, none).amax()


def scan_state(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    baseline: FiniteBaseline | None = None,
) -> StateScan:
    """Which parameters, floating buffers and optimizer state tensors hold poisoned (NaN/Inf)
    values, and how many.

    With a ``baseline`` the per-tensor rules of the module docstring apply: non-finite values in
    frozen parameters and the baseline's own non-finite buffer coordinates belong to the model
    (``StateScan.owned``), not to ``flags``. Without one every NaN/Inf counts.

    One host read per device: per-tensor counts are computed and stacked on the device, then read
    with a single ``tolist()``. Meant for the rare path (after an alert), not every step.

    Sharded tensors (DTensors) are counted on this rank's local shards. Under torch.distributed
    (world size > 1) the counts go through one SUM all-reduce, so every rank returns the same scan
    with global counts (``Flag.numel`` is the global size): every rank must call it together (see
    the module docstring).
    """
    # one layout on every rank (ZeRO-1: stand-ins for the state other ranks hold; recover/holders.py)
    state, once = agreed_state(optimizer) if optimizer is not None else ({}, {})
    names = _param_names(model, optimizer)
    # reported as the user's model names them (a compiled model's `_orig_mod.`, Fabric's
    # `_forward_module.` left out); the state_dict's own name is kept for snapshot lookups
    prefix = _wrapper_prefix(model) if model is not None else ()
    label = {raw: user_name(raw, prefix) or raw for raw in set(names.values())}
    written = _written_by(optimizer, model) if baseline is not None else None
    entries: list[tuple[str, str | None, Any, torch.Tensor]] = []
    legit: dict[int, torch.Tensor | bool] = {}  # entry index -> the model's own non-finite values
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    if model is not None:
        for n, p in model.named_parameters(remove_duplicate=True):
            params.append(p)
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    param_numel = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = names[id(p)]
        if _checkable(p):
            if written is not None and id(p) not in written:
                legit[len(entries)] = True  # the optimizer never writes it: the model's own values
            entries.append((name, None, p, p))
            param_numel += p.numel()
        if optimizer is not None:
            for path, v in state_leaves(state.get(p, {})):  # nested state too (heavyball), subclasses (forms.py)
                if _checkable(v) or id(v) in once:
                    entries.append((name, path_name(path), p, v))
    if model is not None:
        for n, b in model.named_buffers(remove_duplicate=True):
            if _checkable(b):
                if baseline is not None:
                    own = baseline.legit(n, b)
                    if own is not None:
                        legit[len(entries)] = own
                entries.append((n, "buffer", b, b))
    # Two passes, both on the device. First one fused L2 norm per tensor (torch._foreach_norm,
    # the cheapest read there is): NaN and Inf propagate into it, so a finite norm means a finite
    # tensor. Only tensors whose norm is not finite (poisoned, or huge finite values whose square
    # overflowed) get the exact element count; so do the buffers with values of their own, always.
    agree = _Agree()
    with torch.no_grad():
        plain = [i for i in range(len(entries)) if i not in legit]
        exact = [i for i in range(len(entries)) if i in legit]
        vals = [values(e[3]) for e in entries]  # plain tensors: a local shard, a subclass dequantized
        first = _norms_bad([vals[i] for i in plain]) + [_counts(vals[i], legit[i]) for i in exact]
        got = _read(agree, first, entries)
        suspect = [i for i, bad in zip(plain, got[: len(plain)]) if bad]
        counts: dict[int, tuple[int, int]] = {}
        for k, i in enumerate(exact):
            counts[i] = got[len(plain) + k]
        if suspect:  # rare: the exact counts, in one more read (every rank took this branch alike)
            for i, c in zip(suspect, _read(agree, [_counts(vals[i], None) for i in suspect], entries)):
                counts[i] = c
    for i, (_, _, _, t) in enumerate(entries):
        if agree.world > 1 and i in counts and id(t) not in once:  # a replicated element was counted by each of its holders
            h = agree.holders(t)
            counts[i] = (-(-counts[i][0] // h), -(-counts[i][1] // h))
    flags, owned, refs, legit_masks = [], [], {}, {}
    for i, (raw, key, p, t) in enumerate(entries):
        name = label.get(raw) or user_name(raw, prefix) or raw
        refs[(name, key)] = (p, t, raw)
        bad, own = counts.get(i, (0, 0))
        numel = once.get(id(t), t.numel())
        if bad:
            flags.append(Flag(name, key, bad, numel))
        if own:
            owned.append(Flag(name, key, own, numel))
        if isinstance(legit.get(i), torch.Tensor):
            legit_masks[(name, key)] = legit[i]
    return StateScan(flags, len(entries), refs, param_numel, owned, legit_masks)


def _norms_bad(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tensor, 1 when its L2 norm is not finite (fused per device and dtype), else 0."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for k, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(k)
    for (_, dtype), idx in groups.items():
        group = [tensors[k] for k in idx]
        if dtype.is_complex:
            norms = [torch.linalg.vector_norm(t) for t in group]
        else:
            norms = torch._foreach_norm(group)
        for k, n in zip(idx, norms):
            out[k] = torch.isfinite(n).logical_not_().to(torch.int64)
    return out  # type: ignore[return-value]


def _counts(t: torch.Tensor, own: torch.Tensor | bool | None) -> torch.Tensor:
    """[poisoned, the model's own] non-finite elements of ``t``, as a device vector of 2."""
    bad = torch.isfinite(t).logical_not_()
    if own is None:
        return torch.stack([bad.sum(), torch.zeros((), dtype=torch.int64, device=t.device)])
    if own is True:  # all of it is the model's: poison nowhere, owned everywhere
        return torch.stack([torch.zeros((), dtype=torch.int64, device=t.device), bad.sum()])
    return torch.stack([(bad & ~own).sum(), (bad & own).sum()])


def _read(agree: "_Agree", values: list[torch.Tensor], entries: list[Any]) -> list[Any]:
    """Move ``values`` (device scalars, or vectors of 2) to the host in one read per device --
    under torch.distributed one SUM all-reduce of them all instead. Scalars come back as ints,
    vectors as (int, int)."""
    if not values:
        return []
    flat = [v.reshape(-1) for v in values]
    sizes = [f.numel() for f in flat]
    if agree.world > 1:  # one SUM all-reduce on the state's device (NCCL needs CUDA tensors)
        device = local(entries[0][3]).device
        vec = torch.cat([f.to(device, torch.int64) for f in flat])
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM)
        host = vec.tolist()
    else:
        host = [0] * sum(sizes)
        offsets = [sum(sizes[:k]) for k in range(len(flat))]
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for k, f in enumerate(flat):
            by_device[f.device].append(k)
        for idx in by_device.values():
            got = torch.cat([flat[k] for k in idx]).tolist()  # the one host read per device
            at = 0
            for k in idx:
                host[offsets[k]:offsets[k] + sizes[k]] = got[at:at + sizes[k]]
                at += sizes[k]
    out, at = [], 0
    for n in sizes:
        chunk = [int(x) for x in host[at:at + n]]
        out.append(chunk[0] if n == 1 else tuple(chunk))
        at += n
    return out
