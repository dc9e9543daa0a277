"""State plumbing shared by snapshots and checkpoints: host copies, RNG, safe serialisation,
in-place restores. Internal: the public surface is SnapshotRing / CheckpointManager / Recovery."""

from __future__ import annotations

import collections
import copy
import operator
import random
from itertools import chain
from typing import Any, Callable

import numpy as np
import torch

from earlywarn.capture.hostread import HOST_WAITS, record_event
from earlywarn.capture.norms import SMALL, NormSum

from ._tree import at, leaves, same_structure
from .errors import CheckpointError
from .holders import state_of

try:  # torch builds without distributed support have no DTensor (and no sharded state)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

# --------------------------------------------------------------------------------------------
# Sharded tensors (FSDP2 / tensor parallel DTensors)
#
# Every copy and restore below works on a DTensor's *local shard* only: a DTensor op (clone,
# copy_, ``.to``) goes through DTensor dispatch, which may redistribute -- a collective per
# tensor, or a full-tensor gather -- and a host copy must never do that. A host copy of a
# DTensor is a DTensor with the same layout (mesh, placements, global shape) whose local tensor
# is on the host: ``torch.distributed.checkpoint`` still writes it shard by shard, and restoring
# copies the local shard back in place.


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def distributed_rank() -> int | None:
    """This process's rank when torch.distributed runs with more than one process, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (no collective, no autograd wrapper); ``t`` otherwise."""
    return t._local_tensor if is_dtensor(t) else t


def like_sharded(host_local: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``host_local`` wrapped with ``t``'s DTensor layout, without moving it to the mesh's device
    (``DTensor.from_local`` would copy it back to the accelerator)."""
    return DTensor(host_local, t._spec, requires_grad=False)  # type: ignore[misc]

# --------------------------------------------------------------------------------------------
# Host copies
#
# A device tensor goes to pinned host memory with ``non_blocking=True``. The tensors only the
# optimizer's step writes -- its parameters and state, ``side`` below -- are copied on a side
# stream per device that first waits for the compute stream: the next forward and backward run
# while they copy, and :func:`fence_copies` (called before the next optimizer write, and by
# every restore) makes the compute stream wait for them. Everything else (buffers, which the next
# forward writes; frozen parameters; tensors in scheduler or scaler state) is copied on the
# compute stream, in order with whatever writes it next. Assumed: between two optimizer steps
# nothing but the optimizer writes its parameters (a loop that edits them in place right after
# ``step()`` would race with the copy).

_SIDE_STREAMS: dict[torch.device, Any] = {}
_FENCES: list[tuple[torch.device, Any]] = []  # (device, event): side-stream copies not yet fenced


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def fence_copies() -> None:
    """Make each device's current stream wait (on the device, no host sync) for the snapshot
    copies still reading the optimizer's tensors. Call before anything writes them."""
    while _FENCES:
        device, event = _FENCES.pop()
        torch.cuda.current_stream(device).wait_event(event)


def _key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    return (t.device, t.data_ptr()) if t.numel() > 0 and t.layout == torch.strided else None


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors only ``optimizer.step`` writes: its parameters and their state (local shards;
    the state of an optimizer it wraps too). Flat per-parameter state (torch.optim's) is read in
    one pass; nested state is walked."""
    out: list[torch.Tensor] = []
    state = state_of(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            out.append(local(p))
            st = state.get(p)
            if not isinstance(st, dict):
                out += [local(v) for _, v in leaves(st)]
                continue
            for v in st.values():
                if type(v) is torch.Tensor:
                    out.append(v)
                elif isinstance(v, (torch.Tensor, dict, list, tuple)):  # a DTensor, nested state
                    out += [local(t) for _, t in leaves(v)]
    return out


def nonfinite_flag(tensors: list[torch.Tensor], plan: NormSum | None = None) -> torch.Tensor | None:
    """One number, on the tensors' device, that is finite iff every element is: the sum of
    their L2 norms (one planned pass per dtype, ``capture.norms``; ``plan``: made for these
    tensors before). Accumulated in float64 on CUDA (free there, and no finite value can overflow
    it); float32 on CPU, where a huge finite value can overflow it -- a false alarm that
    :meth:`HostCopy.owned_finite` settles exactly."""
    total = plan if plan is not None else NormSum(tensors)
    if not total:
        return None
    device = tensors[0].device
    with torch.no_grad():  # the parameters themselves are among them: no graph
        return total.total(tensors, device, torch.float64 if device.type == "cuda" else torch.float32)


class HostCopy:
    """A host (CPU) copy of a nested state tree. ``wait()`` before reading: device tensors are
    copied with ``non_blocking`` into pinned memory, so the copy may still be in flight.

    With ``check_finite``, :meth:`finite` says whether the optimizer's tensors were all finite
    when copied, from a flag computed on the device beside the copy (read once it has landed)."""

    def __init__(self, tree: Any, events: Any = (), *, flags: Any = (), owned: Any = ()) -> None:
        self.tree = tree
        self._events = list(events)
        self._flags: list[torch.Tensor] = list(flags)
        self._owned: list[torch.Tensor] = list(owned)
        self.checked = False  # to_host(check_finite=True) sets it: finite() then means something
        self.kept: set[int] = set()  # ids of the tensors in ``tree`` that are live ones, not copies
        # how the next copy into these buffers goes (to_host(reuse=this copy)): see _PartPlan
        self.plans: dict[Any, Any] = {}

    def ready(self) -> bool:
        """Every copy has landed (never blocks)."""
        return all(e.query() for e in self._events)

    def wait(self) -> Any:
        for e in self._events:
            HOST_WAITS.wait(e)  # timed: a wait here stalls the host
        self._events = []
        return self.tree

    def finite(self) -> bool:
        """The device flag: every tensor of the optimizer finite (waits for the copy)."""
        self.wait()
        return all(bool(torch.isfinite(f).all()) for f in self._flags)

    def owned_finite(self) -> bool:
        """The exact answer from the host copy itself (rare path: after a flag that fired)."""
        self.wait()
        return all(bool(torch.isfinite(t).all()) for t in self._owned if t.is_floating_point() or t.is_complex())


def _host_buffer(t: torch.Tensor, reuse: Any) -> torch.Tensor | None:
    """Where ``t`` (a plain, detached tensor) is copied to: the recycled buffer, a fresh pinned
    one for a CUDA tensor, or None (then ``t.to("cpu", copy=True)``)."""
    if (
        isinstance(reuse, torch.Tensor)
        and reuse.shape == t.shape
        and reuse.dtype == t.dtype
        and reuse.device.type == "cpu"
        and reuse.layout == t.layout == torch.strided
    ):
        return reuse
    if t.device.type == "cuda" and t.layout == torch.strided:
        # pinned memory lets the device-to-host copy run asynchronously with the next step
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return None


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})  # immutable leaves: shared, not copied
_STRIDED = torch.strided
_NO_REUSE: dict = {}


def _copy_metadata(metadata: Any) -> Any:
    """``state_dict()._metadata`` (one small dict of plain values per module) copied: a deep copy
    costs ~3 us per module, this a tenth of it."""
    if isinstance(metadata, dict) and all(type(v) is dict and all(type(x) in _SCALARS for x in v.values())
                                          for v in metadata.values()):
        return collections.OrderedDict((k, dict(v)) for k, v in metadata.items())
    return copy.deepcopy(metadata)


def to_host(tree: Any, reuse: Any = None, *, side: "list[torch.Tensor] | None" = None,
            check_finite: bool = False, agree: bool = False, shared: "set[int] | None" = None,
            planned: "tuple[tuple[str, ...], ...]" = ()) -> HostCopy:
    """Copy every tensor in ``tree`` to host memory (never aliasing the live tensors); other leaves
    are deep-copied. ``reuse`` is an older copy of the same structure (a :class:`HostCopy`, or
    its tree) whose buffers are recycled (no fresh host allocation every snapshot for a model of
    fixed shape). ``side``: the optimizer's tensors (see the note above); ``check_finite``: flag
    whether they are finite; ``agree``: under torch.distributed, the flag is summed over ranks (a
    collective: every rank calls this together). ``shared``: ids of tensors that are kept as they
    are, not copied (frozen weights: see :class:`FrozenRefs`). ``planned``: paths of the flat
    parts of ``tree`` (a ``state_dict()``, the optimizer's per-parameter state) whose copy is
    planned (see :class:`_PartPlan`): copying them again into ``reuse``'s buffers then costs no
    walk."""
    plans = reuse.plans if isinstance(reuse, HostCopy) else {}
    copier = _HostCopier(side or [], shared or set(), plans)
    out = copier.walk(tree, reuse.tree if isinstance(reuse, HostCopy) else reuse, (), planned)
    copier.copy_host()
    events = [record_event(d) for d in copier.main_devices]  # recorded on each device's compute stream
    events, flags = copier.side_stream_copies(events, check_finite, agree)
    host = HostCopy(out, events, flags=flags, owned=copier.owned_host)
    host.checked = check_finite
    host.kept, host.plans = copier.kept, copier.plans
    return host


_PTR, _SIZE = torch.Tensor.data_ptr, torch.Tensor.size
_CPU = torch.device("cpu")


def _flat_part(x: Any) -> tuple[list[torch.Tensor], tuple] | None:
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


class _PartPlan:
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
    def make(sig: tuple, out: Any, srcs: list[torch.Tensor], owned_ids: set[int]) -> "_PartPlan | None":
        flat = _flat_part(out)
        if flat is None or len(flat[0]) != len(srcs):
            return None
        plan = _PartPlan(sig, out)
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
        plan.owned = [t for t in _flat_part(out)[0] if id(t) in owned_ids]  # type: ignore[index]
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


class _SidePlan:
    """The optimizer's tensors as one snapshot saw them (see :meth:`_HostCopier.side_plan`)."""

    __slots__ = ("ids", "ptrs", "keys", "cpu_ptrs", "devices")

    def __init__(self, side: list[torch.Tensor], ids: tuple, ptrs: tuple) -> None:
        self.ids, self.ptrs = ids, ptrs
        self.keys = {k for k in (_key(t) for t in side) if k is not None}
        self.cpu_ptrs = {ptr for dev, ptr in self.keys if dev.type == "cpu"}
        by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
        for i, t in enumerate(side):
            by_device[t.device].append(i)
        # per device: which of them, and their finiteness flag's plan (capture.norms)
        self.devices = [(dev, _picker(pos), NormSum([side[i] for i in pos])) for dev, pos in by_device.items()]


class _HostCopier:
    """One :func:`to_host` call: walks the tree, places each tensor's copy, then issues the copies
    (host ones in one multi-tensor call per dtype; device ones on the compute or the side stream).
    ``plans``: those of the copy whose buffers are recycled; :attr:`plans`: this copy's."""

    def __init__(self, side: list[torch.Tensor], shared: set[int], plans: dict[Any, Any]) -> None:
        self.side = side
        self.shared = shared
        self.reused_plans = plans
        self.plans: dict[Any, Any] = {}
        self.kept: set[int] = set()
        self._keys: set | None = None
        self._cpu_ptrs: set[int] = set()
        self.side_copies: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = collections.defaultdict(list)
        self.host_copies: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = collections.defaultdict(
            lambda: ([], []))
        self.stack_copies: list[tuple[torch.Tensor, Any]] = []  # (stacked buffer, its rows' sources)
        self.main_devices: set[torch.device] = set()
        self.owned_host: list[torch.Tensor] = []

    @property
    def side_keys(self) -> set:
        """(device, address) of the optimizer's tensors."""
        if self._keys is None:
            self._keys, self._cpu_ptrs = self.side_plan().keys, self.side_plan().cpu_ptrs
        return self._keys

    def side_plan(self) -> "_SidePlan":
        """What the optimizer's tensors are (their keys, their devices, how their finiteness
        flag is taken): the recycled copy's when they are the same tensors at the same
        addresses, else made now."""
        plan = self.plans.get("side")
        if plan is None:
            ids, ptrs = tuple(map(id, self.side)), tuple(map(_PTR, self.side))
            plan = self.reused_plans.get("side")
            if plan is None or plan.ids != ids or plan.ptrs != ptrs:
                plan = _SidePlan(self.side, ids, ptrs)
            self.plans["side"] = plan
        return plan

    def walk(self, x: Any, r: Any, path: tuple, planned: "tuple[tuple[str, ...], ...]") -> Any:
        """:meth:`rec`, except for the parts at ``planned`` paths (see :class:`_PartPlan`)."""
        if path in planned:
            return self.part(x, r, path)
        if isinstance(x, dict) and any(p[:len(path)] == path and len(p) > len(path) for p in planned):
            rr = r if isinstance(r, dict) else _NO_REUSE
            return {k: self.walk(v, rr.get(k), path + (k,), planned) for k, v in x.items()}
        return self.rec(x, r)

    def part(self, x: Any, r: Any, path: tuple) -> Any:
        flat = _flat_part(x)
        if flat is None:
            return self.rec(x, r)
        srcs, structure = flat
        kept = tuple(i for i, v in enumerate(srcs) if id(v) in self.shared) if self.shared else ()
        sig = (structure, tuple(map(_PTR, srcs)), tuple(map(_SIZE, srcs)), kept)
        plan = self.reused_plans.get(path)
        if plan is not None and plan.sig == sig and plan.out is r:
            self.replay(plan, srcs)
        else:  # walked, and planned for the next copy into these buffers
            owned = len(self.owned_host)
            marks = {k: len(v[0]) for k, v in self.host_copies.items()}
            out = self.rec(x, r)
            plan = _PartPlan.make(sig, out, srcs, set(map(id, self.owned_host[owned:])))
            if plan is None:
                return out
            # the walk's host copies give way to the plan's (small tensors: rows of stacked buffers);
            # its device copies are issued already
            for k, (d, s_) in self.host_copies.items():
                del d[marks.get(k, 0):], s_[marks.get(k, 0):]
            del self.owned_host[owned:]
            self.replay(plan, srcs, host_only=True)
        self.plans[path] = plan
        return plan.out

    def replay(self, plan: _PartPlan, srcs: list[torch.Tensor], *, host_only: bool = False) -> None:
        for dtype, dsts, pick in plan.host:
            d, s_ = self.host_copies[(_CPU, dtype)]
            d += dsts
            s_ += pick(srcs)
        self.stack_copies += [(big, pick(srcs)) for big, pick in plan.stacks]
        self.owned_host += plan.owned
        self.kept |= plan.kept
        if host_only:
            return
        for device, dsts, pick in plan.side:
            self.side_copies[device] += zip(dsts, pick(srcs))
        for device, dsts, pick in plan.main:
            for dst, src in zip(dsts, pick(srcs)):
                dst.copy_(src, non_blocking=True)
            self.main_devices.add(device)

    def copy_leaf(self, x: torch.Tensor, r: Any) -> torch.Tensor:
        if id(x) in self.shared:
            self.kept.add(id(x))
            return x  # never written while it is frozen: the model's own tensor serves every snapshot
        if type(x) is torch.Tensor and type(r) is torch.Tensor and x.is_cpu and r.is_cpu:
            ptr = x.data_ptr()
            if (ptr != r.data_ptr() and x.dtype is r.dtype and x.layout is _STRIDED and r.layout is _STRIDED
                    and x.shape == r.shape):  # never a live tensor an older snapshot referenced
                # the common case of a periodic snapshot on the host: into the recycled buffer
                d, s_ = self.host_copies[(_CPU, x.dtype)]
                d.append(r)
                s_.append(x)
                if self.side_keys and ptr in self._cpu_ptrs and x.numel() > 0:
                    self.owned_host.append(r)
                return r
        if is_dtensor(x):
            # local shard only; the copy keeps the layout (see the note on sharded tensors above)
            same = is_dtensor(r) and r._spec == x._spec
            return like_sharded(self.copy_leaf(local(x), local(r) if same else None), x)
        x = x.detach()
        dst = _host_buffer(x, r)
        if dst is not None and dst.data_ptr() == x.data_ptr():
            dst = None
        owned = _key(x) in self.side_keys
        if dst is None:
            dst = x.to("cpu", copy=True)
        elif x.device.type == "cuda" and dst.is_pinned():
            if owned:
                self.side_copies[x.device].append((dst, x))  # queued on the side stream
            else:
                dst.copy_(x, non_blocking=True)
                self.main_devices.add(x.device)
        else:
            d, s_ = self.host_copies[(x.device, x.dtype)]  # copied together: one multi-tensor call
            d.append(dst)
            s_.append(x)
        if owned:
            self.owned_host.append(dst)
        return dst

    def rec(self, x: Any, r: Any) -> Any:
        kind = type(x)
        if kind in _SCALARS:
            return x  # immutable: nothing to copy
        if kind is torch.Tensor or isinstance(x, torch.Tensor):
            return self.copy_leaf(x, r)
        if isinstance(x, dict):
            rr = r if isinstance(r, dict) else _NO_REUSE
            out = collections.OrderedDict() if isinstance(x, collections.OrderedDict) else {}
            leaf, rec = self.copy_leaf, self.rec
            for k, v in x.items():  # (flat dicts of tensors -- state dicts -- take the direct call)
                out[k] = leaf(v, rr.get(k)) if type(v) is torch.Tensor else rec(v, rr.get(k))
            if hasattr(x, "_metadata"):  # nn.Module.state_dict carries version metadata
                out = collections.OrderedDict(out)
                out._metadata = _copy_metadata(x._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(x, (list, tuple)):
            if _SCALARS.issuperset(map(type, x)):
                # numbers only (Python's RNG state is a tuple of 625 ints): no walk, no deepcopy
                return x if isinstance(x, tuple) else list(x)
            rr = r if isinstance(r, (list, tuple)) and len(r) == len(x) else [None] * len(x)
            items = [self.rec(v, rv) for v, rv in zip(x, rr)]
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
                return type(x)(*items)
            return type(x)(items)
        return copy.deepcopy(x)

    def copy_host(self) -> None:
        with torch.no_grad():  # sources may be parameters: a copy is not part of any graph
            for d, s_ in self.host_copies.values():
                if d:
                    torch._foreach_copy_(d, s_)
            for big, s_ in self.stack_copies:
                torch.stack(s_, out=big)

    def side_stream_copies(self, events: list[Any], check_finite: bool, agree: bool) -> tuple[list[Any], list[torch.Tensor]]:
        """The optimizer's tensors: copied on each device's side stream, with the finiteness flag
        computed beside the copy; returns the events to wait for and the flags to read."""
        by_device = {dev: (list(pick(self.side)), norms) for dev, pick, norms in self.side_plan().devices} \
            if self.side and (check_finite or self.side_copies) else {}
        device_flags: list[tuple[torch.device, torch.Tensor]] = []  # computed beside the copies
        for device in set(self.side_copies) | ({d for d in by_device if d.type == "cuda"} if check_finite else set()):
            stream = _side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the copies read the state as of now
            with torch.cuda.stream(stream):
                for dst, src in self.side_copies.get(device, ()):
                    dst.copy_(src, non_blocking=True)  # src: live parameters / state, never freed meanwhile
                flag = nonfinite_flag(*by_device[device]) if check_finite and device in by_device else None
                if flag is not None:
                    device_flags.append((device, flag))
                event = record_event(device)  # on the side stream (current inside this block)
            events.append(event)
            _FENCES.append((device, event))
        if not check_finite:
            return events, []
        for device, (ts, norms) in by_device.items():
            if device.type != "cuda":
                flag = nonfinite_flag(ts, norms)  # computed right here: the host has its value already
                if flag is not None:
                    device_flags.append((device, flag))
        if agree:
            flags, flag_events = _agreed_flag(device_flags)
            return events + flag_events, flags
        flags = []
        for device, flag in device_flags:
            if device.type != "cuda":
                flags.append(flag)
                continue
            stream = _side_stream(device)
            flags.append(_host_flag(flag, stream))
            with torch.cuda.stream(stream):
                # finite() reads the flag once the events have completed: this one follows its copy
                events.append(record_event(device))
        return events, flags


def _host_flag(flag: torch.Tensor, stream: Any) -> torch.Tensor:
    if flag.device.type != "cuda":
        return flag
    with torch.cuda.stream(stream):  # after the flag's kernels; the caller records the copy's event
        host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
    return host


def _agreed_flag(device_flags: list[tuple[torch.device, torch.Tensor]]) -> tuple[list[torch.Tensor], list[Any]]:
    """One flag summed over every rank (a single all-reduce, on the device for NCCL): every rank
    then keeps or drops the snapshot alike (an FSDP shard, or one rank's corrupted replica, is
    poisoned on that rank only)."""
    cuda = [d for d, _ in device_flags if d.type == "cuda"]
    device = cuda[0] if cuda else torch.device("cpu")
    if device.type != "cuda":
        total = torch.zeros(1, dtype=torch.float32)
        for _, f in device_flags:
            total += f.to(total.dtype)
        torch.distributed.all_reduce(total)
        return [total], []
    stream = _side_stream(device)
    for d, _ in device_flags:
        if d.type == "cuda" and d != device:
            stream.wait_stream(_side_stream(d))
    with torch.cuda.stream(stream):
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for d, f in device_flags:
            if d.type != "cuda":
                total += float(f)  # a host value already: an argument of the add kernel
            elif d == device:
                total += f.double()
            else:
                f.record_stream(stream)  # made on that device's side stream, read here
                total += f.to(device, torch.float64, non_blocking=True)
        torch.distributed.all_reduce(total)  # NCCL waits on this stream, this stream on NCCL
        host = torch.empty(1, dtype=torch.float64, pin_memory=True)
        host.copy_(total, non_blocking=True)
        event = record_event(device)
    return [host], [event]


def clone_tree(tree: Any) -> Any:
    """Deep copy with tensors cloned: what ``load_state_dict`` calls receive, because
    ``Optimizer.load_state_dict`` keeps the given CPU tensors (it would alias our snapshot)."""
    if is_dtensor(tree):
        return like_sharded(local(tree).clone(), tree)
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        out = type(tree)() if isinstance(tree, collections.OrderedDict) else {}
        for k, v in tree.items():
            out[k] = clone_tree(v)
        if hasattr(tree, "_metadata"):
            out = collections.OrderedDict(out)
            out._metadata = copy.deepcopy(tree._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(tree, (list, tuple)):
        items = [clone_tree(v) for v in tree]
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return type(tree)(*items)
        return type(tree)(items)
    return copy.deepcopy(tree)


def state_bytes(tree: Any) -> int:
    """Bytes held by the tensors of a state tree (for reports; this rank's shards only)."""
    return sum(local(t).numel() * local(t).element_size() for _, t in leaves(tree))


# --------------------------------------------------------------------------------------------
# RNG


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


# --------------------------------------------------------------------------------------------
# Serialisation that `torch.load(weights_only=True)` accepts

_ND = "__earlywarn_ndarray__"
_NP = "__earlywarn_npscalar__"
_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


def encode_safe(tree: Any, path: str = "state") -> Any:
    """Turn numpy arrays / scalars into tagged plain records and check that every other leaf is
    something ``torch.load(weights_only=True)`` accepts. Fails at save time, naming the path,
    instead of producing a checkpoint that cannot be loaded."""
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, np.ndarray):
        if tree.dtype.hasobject:
            raise CheckpointError(f"{path}: numpy array of dtype object cannot be saved safely; "
                                  "store numbers or strings in the state_dict instead")
        return {_ND: np.ascontiguousarray(tree).tobytes(), "dtype": tree.dtype.str, "shape": tuple(tree.shape)}
    if isinstance(tree, np.generic):
        return {_NP: tree.item(), "dtype": tree.dtype.str}
    if type(tree) in (dict, collections.OrderedDict):
        out = collections.OrderedDict() if isinstance(tree, collections.OrderedDict) else {}
        for k, v in tree.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise CheckpointError(f"{path}: key {k!r} of type {type(k).__name__} cannot be saved "
                                      "with weights_only loading; use str or int keys")
            out[k] = encode_safe(v, f"{path}.{k}")
        return out
    if type(tree) in (list, tuple, set, frozenset):
        items = [encode_safe(v, f"{path}[{i}]") for i, v in enumerate(tree)]
        return type(tree)(items) if not isinstance(tree, frozenset) else set(items)
    if isinstance(tree, _SAFE_LEAVES):
        return tree
    raise CheckpointError(
        f"{path}: a {type(tree).__module__}.{type(tree).__qualname__} cannot be loaded with "
        "torch.load(weights_only=True); make that state_dict() return plain numbers, strings, "
        "lists, dicts, tensors or numpy arrays"
    )


def decode_safe(tree: Any) -> Any:
    if isinstance(tree, dict):
        if _ND in tree and set(tree) == {_ND, "dtype", "shape"}:
            return np.frombuffer(tree[_ND], dtype=np.dtype(tree["dtype"])).reshape(tree["shape"]).copy()
        if _NP in tree and set(tree) == {_NP, "dtype"}:
            return np.dtype(tree["dtype"]).type(tree[_NP])
        out = type(tree)() if isinstance(tree, collections.OrderedDict) else {}
        for k, v in tree.items():
            out[k] = decode_safe(v)
        return out
    if isinstance(tree, (list, tuple, set)):
        return type(tree)(decode_safe(v) for v in tree)
    return tree


# --------------------------------------------------------------------------------------------
# Restores


def restore_optimizer(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Put ``sd`` (an ``optimizer.state_dict()`` copy) back into ``optimizer``.

    When the saved state has the same structure as the live one (nested state included), tensors
    are copied in place: no second copy of the optimizer state is allocated on the device (a
    full-size allocation at the worst moment) and references others hold to the state tensors
    stay valid. Otherwise ``load_state_dict`` on a clone.
    """
    fence_copies()  # a snapshot copy still reading these tensors must finish first
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = sd.get("param_groups", [])
    saved_state = sd.get("state", {})
    same = len(saved_groups) == len(optimizer.param_groups) and all(
        len(sg["params"]) == len(g["params"]) for sg, g in zip(saved_groups, optimizer.param_groups)
    ) and all(_fits(optimizer.state.get(p, {}), saved_state.get(i, {})) for i, p in enumerate(params))
    if not same:
        optimizer.load_state_dict(clone_tree(sd))
        return
    with torch.no_grad():
        for i, p in enumerate(params):
            saved = saved_state.get(i)
            if not saved:  # nothing saved, nothing live (_fits): no entry made (ZeRO: another rank's)
                continue
            live = optimizer.state[p]
            for path, v in leaves(saved):
                local(at(live, path)).copy_(local(v))  # sharded state: this rank's shard, in place
            for k, v in saved.items():  # top-level values that are not tensors (counters, flags)
                if not isinstance(v, (torch.Tensor, dict, list, tuple)):
                    live[k] = copy.deepcopy(v)
    for g, sg in zip(optimizer.param_groups, saved_groups):
        for k, v in sg.items():
            if k == "params":
                continue
            cur = g.get(k)
            if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                cur.copy_(v)  # tensor lr: keep the object (compiled / capturable steps hold it)
            else:
                g[k] = copy.deepcopy(v)


def _fits(live: Any, saved: Any) -> bool:
    """``saved`` can be copied into ``live`` in place: the same nesting, each tensor of the same
    layout, and nested non-tensor values equal (only top-level ones are set back)."""
    if not same_structure(live, saved):
        return False
    for path, v in leaves(saved):
        if not _same_layout(v, at(live, path)):
            return False
    return all(_plain_equal(live[k], v) for k, v in saved.items() if isinstance(v, (dict, list, tuple)))


def _plain_equal(a: Any, b: Any) -> bool:
    """The non-tensor leaves of two trees of the same structure are equal."""
    if isinstance(a, torch.Tensor):
        return True
    if isinstance(a, dict):
        return all(_plain_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return all(_plain_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality: not restorable in place
        return False


def _same_layout(saved: torch.Tensor, live: torch.Tensor) -> bool:
    """``saved`` can be copied into ``live`` shard for shard: same global shape, dtype and local
    shard shape (a saved DTensor or this rank's plain local shard into a live DTensor)."""
    if saved.dtype != live.dtype or local(saved).shape != local(live).shape:
        return False
    return saved.shape == live.shape or not is_dtensor(saved)


def restore_model(model: torch.nn.Module, sd: dict[str, Any]) -> None:
    """Copy ``sd`` (a ``model.state_dict()`` copy) into the model's tensors, in place.

    A sharded model (DTensor parameters, FSDP2) is restored shard by shard: each rank copies its
    local shards back, with no collective and no full-tensor gather. Otherwise, and whenever the
    saved state does not match the live layout, ``load_state_dict`` (strict) does it."""
    fence_copies()  # a snapshot copy still reading these tensors must finish first
    live = model.state_dict(keep_vars=True)
    if any(is_dtensor(v) for v in live.values()) and set(live) == set(sd) and all(
        isinstance(v, torch.Tensor) and isinstance(sd[k], torch.Tensor) and _same_layout(sd[k], v)
        for k, v in live.items()
    ):
        with torch.no_grad():
            for k, v in live.items():
                local(v).copy_(local(sd[k]))
        return
    # frozen weights a snapshot kept by reference (FrozenRefs) are the live tensors themselves
    alias = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and k in live and _aliases(v, live[k])]
    if alias and set(live) == set(sd):
        rest = collections.OrderedDict((k, v) for k, v in sd.items() if k not in alias)
        if hasattr(sd, "_metadata"):
            rest._metadata = sd._metadata  # type: ignore[attr-defined]
        model.load_state_dict(rest, strict=False)
        return
    # load_state_dict copies into the existing parameters (no aliasing of the snapshot)
    model.load_state_dict(sd, strict=True)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = local(a), local(b)
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.numel() > 0


def call_state_dict(obj: Any, what: str) -> Any:
    fn: Callable[[], Any] | None = getattr(obj, "state_dict", None)
    if fn is None:
        raise TypeError(f"{what} has no state_dict(): pass objects with state_dict/load_state_dict")
    return fn()
