"""How a batch is named: its position in the data (:class:`DataPosition`), a reference to it
(:class:`BatchRef`: position, sample indices, fingerprint) and, when no loader can name it, a
fingerprint of its tensors computed on the device (:class:`BatchFingerprints`)."""

from __future__ import annotations

import dataclasses
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .forms import local


@dataclass(frozen=True)
class DataPosition:
    """Where the *next* batch comes from: batch ``batch_index`` of epoch ``epoch`` (0-based)."""

    epoch: int
    batch_index: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    @classmethod
    def parse(cls, value: "DataPosition | Mapping[str, int] | Sequence[int]") -> "DataPosition":
        if isinstance(value, DataPosition):
            return value
        if isinstance(value, Mapping):
            return cls(int(value["epoch"]), int(value["batch_index"]))
        epoch, batch_index = value
        return cls(int(epoch), int(batch_index))

    def __str__(self) -> str:
        return f"epoch {self.epoch} batch {self.batch_index}"


@dataclass(frozen=True)
class BatchRef:
    """One batch, named by its position and (when known) the dataset indices it held.

    ``epoch`` / ``batch_index`` are ``None`` when the loader cannot tell; ``sample_indices`` is
    ``None`` for loaders that do not expose their sampler (torchdata). ``fingerprint``: a hash of
    the batch's tensors (:class:`BatchFingerprints`), when earlywarn saw them."""

    epoch: int | None
    batch_index: int | None
    sample_indices: tuple[int, ...] | None = None
    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """What is known, and nothing else (no keys holding ``None``)."""
        d: dict[str, Any] = {}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        if self.batch_index is not None:
            d["batch_index"] = self.batch_index
        if self.sample_indices is not None:
            d["sample_indices"] = list(self.sample_indices)
        if self.fingerprint is not None:
            d["fingerprint"] = self.fingerprint
        return d

    def describe(self) -> str:
        return str(self)

    def __str__(self) -> str:
        if self.batch_index is None:
            return f"the batch with fingerprint {self.fingerprint}" if self.fingerprint else "an unidentified batch"
        text = f"batch {self.batch_index}" + (f" of epoch {self.epoch}" if self.epoch is not None else "")
        if self.sample_indices is not None:
            ids = list(self.sample_indices)
            shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
            text += f" (samples {shown})"
        return text

    def with_fingerprint(self, fingerprint: str | None) -> "BatchRef":
        return self if fingerprint is None else dataclasses.replace(self, fingerprint=fingerprint)


# ============================================================================================
# Batch fingerprints: naming a batch no loader can name


_FP_CAP = 1 << 20  # elements hashed per tensor; a larger one is hashed on an even stride
_FP_MIX = 1_000_003
_FP_MASK = (1 << 64) - 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNPLANNED = object()  # a kind of batch tensor met for the first time (its plan may be None: not hashed)


def _tensors(x: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif depth < 4 and isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out, depth + 1)
    elif depth < 4 and isinstance(x, Mapping):
        for k in sorted(x, key=str):
            _tensors(x[k], out, depth + 1)


class _HashPlan:
    """How one kind of batch tensor is hashed: its stride (over 2**20 elements), the integer
    dtype its bits are read as, its slice of the fixed weights, and its shape-and-dtype tag."""

    __slots__ = ("stride", "as_int", "weight", "meta")

    def __init__(self, stride: int, as_int: "torch.dtype | None", weight: torch.Tensor, meta: bytes) -> None:
        self.stride, self.as_int, self.weight, self.meta = stride, as_int, weight, meta


class BatchFingerprints:
    """A fingerprint per step of the batch the step trained on, computed on the device.

    Without a restorable loader nothing else identifies a batch (nanoGPT draws them with
    ``torch.randint``). :meth:`observe` notes the batch's tensors; the hash -- their raw bits
    times a fixed random vector, summed (int64, wrapping), with no host sync -- is taken later,
    for up to ``hold_steps`` steps and ``hold_bytes`` of held batches at a time (one warm loop
    instead of a few cold calls every step: a step's first calls after the backward pass cost
    10x their own). Micro-batches of one step are folded together. :meth:`bind` attaches what was
    observed to the step that consumes it; :meth:`read` moves the requested fingerprints to the
    host in one transfer (the rare path: a skip, a quarantine). Shapes and dtypes are folded in
    on the host. A tensor of more than 2**20 elements is hashed on an even stride of 2**20 of
    them. A batch written in place after it was observed (a reused input buffer) is not what the
    step saw: its fingerprint is unknown, and from then on batches are hashed as they come.
    """

    def __init__(self, history: int = 4096, *, hold_steps: int = 32, hold_bytes: int = 32 << 20) -> None:
        self.history = history
        self.hold_steps = hold_steps
        self.hold_bytes = hold_bytes
        self.explicit = False
        """``report_batch`` was called: the automatic hook on the model's inputs stands down."""
        self._pending: list[tuple[torch.Tensor, int, _HashPlan]] = []  # this step's tensors, as observed
        # ... their data_ptr -> version and storage bytes, for the held ones' (taken as observed, once)
        self._pending_ptrs: dict[int, int] = {}
        self._pending_bytes = 0
        self._meta = 0
        # step -> (the hash, or the held tensors not hashed yet, and the shape-and-dtype tag)
        self._steps: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._held: list[int] = []  # steps whose tensors are held, oldest first
        self._held_bytes = 0
        self._held_ptrs: dict[int, int] = {}  # data_ptr -> version of the held tensors
        self._weights: dict[Any, torch.Tensor] = {}
        self._plans: dict[tuple, _HashPlan | None] = {}  # (shape, dtype, device, layout) -> how it is hashed

    def _weight(self, device: torch.device, n: int) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None or w.numel() < n:
            size = 1 << max(10, (n - 1).bit_length())
            g = torch.Generator().manual_seed(0x5EED)
            w = (torch.randint(-(1 << 62), 1 << 62, (size,), generator=g, dtype=torch.int64) | 1).to(device)
            self._weights[device] = w
        return w[:n]

    def _plan(self, t: torch.Tensor) -> "_HashPlan | None":
        """How a tensor of ``t``'s shape, dtype and device is hashed (made once per kind of batch)."""
        key = (t.shape, t.dtype, t.device, t.layout)
        plan = self._plans.get(key)
        if plan is None and key not in self._plans:
            lt = local(t)  # a DTensor: this rank's shard
            if t.layout == torch.strided and lt.numel() > 0 and t.device.type != "meta":
                n = lt.numel()
                stride = -(-n // _FP_CAP) if n > _FP_CAP else 1
                m = -(-n // stride)
                complex_ = lt.is_complex()
                as_int = (torch.uint8 if lt.dtype == torch.bool else
                          _INT_OF_SIZE[lt.element_size() // (2 if complex_ else 1)] if lt.is_floating_point()
                          or complex_ else None)
                weight = self._weight(lt.device, m * (2 if complex_ else 1))
                plan = _HashPlan(stride, as_int, weight, f"{tuple(t.shape)}:{t.dtype}".encode())
            self._plans[key] = plan
        return plan

    def _hash(self, t: torch.Tensor, plan: "_HashPlan") -> torch.Tensor:
        if t.requires_grad:
            t = t.detach()  # no graph, without a no_grad context
        flat = local(t).reshape(-1)
        if plan.stride > 1:
            flat = flat[:: plan.stride]
        if flat.is_complex():
            flat = torch.view_as_real(flat.resolve_conj()).reshape(-1)  # a conjugate view: its values
        if plan.as_int is torch.uint8:
            flat = flat.to(torch.uint8)
        elif plan.as_int is not None:
            flat = flat.contiguous().view(plan.as_int)
        if flat.dtype is not torch.int64:
            flat = flat.to(torch.int64)
        if flat.is_cpu:
            return torch.dot(flat, plan.weight)  # the same wrapping int64 sum, one call on the CPU
        return (flat * plan.weight).sum()

    def observe(self, batch: Any) -> None:
        """Fold ``batch`` (a tensor, or lists / tuples / dicts of them) into this step's fingerprint."""
        if isinstance(batch, torch.Tensor):
            found = (batch,)  # (the forward hook's: one tensor)
        else:
            found = []
            _tensors(batch, found)
        plans = self._plans
        for t in found:
            plan = plans.get((t.shape, t.dtype, t.device, t.layout), _UNPLANNED)
            if plan is _UNPLANNED:
                plan = self._plan(t)
            if plan is None:
                continue
            if t.requires_grad:
                t = t.detach()  # held without its graph (the version counter is shared)
            version = t._version
            if self.hold_steps:
                lt = t if type(t) is torch.Tensor else local(t)  # a DTensor: this rank's shard is what is held
                ptr = lt.data_ptr()
                if self._held_ptrs.get(ptr, version) != version:
                    # a held batch was overwritten in place: hash as batches come from now on
                    self.hold_steps = 0
                    self._hash_held()
                self._pending_ptrs[ptr] = version
                self._pending_bytes += lt.untyped_storage().nbytes()
            self._meta = zlib.crc32(plan.meta, self._meta)
            self._pending.append((t, version, plan))

    def use_explicit(self) -> None:
        """From now on only what ``observe`` is given explicitly counts (``report_batch``):
        what the automatic hook folded in for the step in progress is dropped."""
        self.explicit = True
        self._pending, self._meta = [], 0
        self._pending_ptrs, self._pending_bytes = {}, 0

    def bind(self, step: int) -> None:
        """What was observed since the last bind is the batch of ``step``."""
        if not self._pending:
            return
        step = int(step)
        if step in self._steps:
            self._forget(step)
        self._steps[step] = (self._pending, self._meta)
        self._held.append(step)
        self._held_ptrs.update(self._pending_ptrs)
        self._held_bytes += self._pending_bytes
        self._pending, self._meta = [], 0
        self._pending_ptrs, self._pending_bytes = {}, 0
        if len(self._held) >= self.hold_steps or self._held_bytes > self.hold_bytes:
            self._hash_held()
        while len(self._steps) > self.history:
            self._forget(next(iter(self._steps)))

    def _hash_held(self) -> None:
        """Hash the held batches (their tensors are let go); one written since it was observed is
        dropped: its fingerprint is unknown."""
        for step in self._held:
            held, meta = self._steps[step]
            if any(t._version != version for t, version, _ in held):
                del self._steps[step]
                continue
            h = None
            for t, _, plan in held:  # micro-batches folded in order
                v = self._hash(t, plan)
                h = v if h is None else h.to(v.device) * _FP_MIX + v
            self._steps[step] = (h, meta)
        self._held.clear()
        self._held_ptrs.clear()
        self._held_bytes = 0

    def _forget(self, step: int) -> None:
        if step in self._held:  # rare: a step bound again, a history shorter than the hold
            self._hash_held()
        self._steps.pop(step, None)

    def has(self, step: int) -> bool:
        self._hash_held()
        return int(step) in self._steps

    def read(self, steps: Sequence[int]) -> dict[int, str]:
        """Fingerprints of ``steps`` (those known), as 16 hex digits; one host read."""
        self._hash_held()
        known = [int(s) for s in steps if int(s) in self._steps]
        if not known:
            return {}
        vals = [self._steps[s][0] for s in known]
        dev = vals[0].device
        host = torch.stack([v.to(dev) for v in vals]).tolist()
        return {s: f"{(int(v) ^ (self._steps[s][1] * 0x9E3779B97F4A7C15)) & _FP_MASK:016x}"
                for s, v in zip(known, host)}

    def drop_after(self, step: int) -> None:
        """Forget the steps after ``step`` (a rewind abandoned them)."""
        self._hash_held()
        for s in [s for s in self._steps if s > step]:
            del self._steps[s]

    def clear(self) -> None:
        self._steps.clear()
        self._held.clear()
        self._held_ptrs.clear()
        self._held_bytes = 0
        self._pending, self._meta = [], 0
        self._pending_ptrs, self._pending_bytes = {}, 0
