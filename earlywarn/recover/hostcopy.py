"""Host copies of state trees (snapshots, checkpoints): pinned buffers recycled from the last
copy, the optimizer's tensors on a side stream with their finiteness flag, copy plans replayed.
Internal: the public surface is SnapshotRing / CheckpointManager / Recovery."""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

from earlywarn.capture.hostread import HOST_WAITS, record_event
from earlywarn.capture.norms import NormSum

from ._tree import leaves
from .copyplan import PartPlan, SidePlan, flat_part, tensor_key
from .errors import UnreadableState
from .forms import flattens, inner, is_dtensor, is_wrapped, like_sharded, local, parts, rebuild
from .holders import state_of

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



def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors only ``optimizer.step`` writes: its parameters and their state (local shards;
    the state of an optimizer it wraps too). Flat per-parameter state (torch.optim's) is read in
    one pass; nested state is walked. A tensor subclass is its inner tensors (``forms.parts``;
    an unreadable one is left out)."""
    out: list[torch.Tensor] = []
    state = state_of(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            out += _plain(p)
            st = state.get(p)
            if not isinstance(st, dict):
                out += [x for _, v in leaves(st) for x in _plain(v)]
                continue
            for v in st.values():
                if type(v) is torch.Tensor:
                    out.append(v)
                elif isinstance(v, (torch.Tensor, dict, list, tuple)):  # a DTensor, a subclass, nested state
                    out += [x for _, t in leaves(v) for x in _plain(t)]
    return out


def _plain(t: torch.Tensor) -> "list[torch.Tensor] | tuple[torch.Tensor, ...]":
    t = local(t)
    return (t,) if not is_wrapped(t) else parts(t) or ()


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
        # how the next copy into these buffers goes (to_host(reuse=this copy)): see PartPlan
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
    planned (see :class:`PartPlan`): copying them again into ``reuse``'s buffers then costs no
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

    def side_plan(self) -> "SidePlan":
        """What the optimizer's tensors are (their keys, their devices, how their finiteness
        flag is taken): the recycled copy's when they are the same tensors at the same
        addresses, else made now."""
        plan = self.plans.get("side")
        if plan is None:
            ids, ptrs = tuple(map(id, self.side)), tuple(map(_PTR, self.side))
            plan = self.reused_plans.get("side")
            if plan is None or plan.ids != ids or plan.ptrs != ptrs:
                plan = SidePlan(self.side, ids, ptrs)
            self.plans["side"] = plan
        return plan

    def walk(self, x: Any, r: Any, path: tuple, planned: "tuple[tuple[str, ...], ...]") -> Any:
        """:meth:`rec`, except for the parts at ``planned`` paths (see :class:`PartPlan`)."""
        if path in planned:
            return self.part(x, r, path)
        if isinstance(x, dict) and any(p[:len(path)] == path and len(p) > len(path) for p in planned):
            rr = r if isinstance(r, dict) else _NO_REUSE
            return {k: self.walk(v, rr.get(k), path + (k,), planned) for k, v in x.items()}
        return self.rec(x, r)

    def part(self, x: Any, r: Any, path: tuple) -> Any:
        flat = flat_part(x)
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
            plan = PartPlan.make(sig, out, srcs, set(map(id, self.owned_host[owned:])))
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

    def replay(self, plan: PartPlan, srcs: list[torch.Tensor], *, host_only: bool = False) -> None:
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
        if is_wrapped(x):
            # a subclass's own ops may alias or refuse (torchao's `.to(copy=True)` keeps its codes):
            # its inner tensors are copied as any others and it is rebuilt around the copies
            if not flattens(x):
                raise UnreadableState(f"a {type(x).__module__}.{type(x).__qualname__} has no __tensor_flatten__")
            rin = inner(r)[0] if type(r) is type(x) else {}
            return rebuild(x, {n: self.copy_leaf(t, rin.get(n)) for n, t in inner(x)[0].items()})
        x = x.detach()
        dst = _host_buffer(x, r)
        if dst is not None and dst.data_ptr() == x.data_ptr():
            dst = None
        owned = tensor_key(x) in self.side_keys
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
        return like_sharded(clone_tree(local(tree)), tree)
    if is_wrapped(tree) and flattens(tree):
        return rebuild(tree, {n: clone_tree(t) for n, t in inner(tree)[0].items()})
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
    return sum(x.numel() * x.element_size() for _, t in leaves(tree) for x in parts(t) or ())
