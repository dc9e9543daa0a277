"""What the loop's own gradient clipping did to the gradients earlywarn reads.

``clip_grad_norm_`` between backward and ``optimizer.step`` (nanoGPT, accelerate, the Hugging Face
Trainer) scales every gradient by one factor, ``min(1, max_norm / (total_norm + 1e-6))``. Read
inside the step, a spike would show capped at ``max_norm``; the precursor that large runs watch
(GLM-130B, BLOOM) is the norm *before* clipping, which is also what Megatron and the Trainer log.

``torch.nn.utils.clip_grad_norm_`` does its scaling through
``torch.nn.utils.clip_grad._clip_grads_with_norm_``, a module global looked up at call time, and the
public two-step API ``torch.nn.utils.clip_grads_with_norm_`` is the same function: one transparent
wrapper over both names sees every call, however the caller imported ``clip_grad_norm_``. For each
watcher whose parameters the call covered it records the factor (a device scalar: no host sync)
and which gradient tensor it scaled, with that tensor's version counter. The watcher divides its
statistics by the factor only while that gradient is still the one it reads, unwritten since (a new
backward, ``zero_grad``, an unscale replace or bump it): otherwise the record is stale and ignored.

``clip_grad_norm_(..., error_if_nonfinite=True)`` -- Lightning Fabric's ``fabric.clip_gradients``
default, litgpt's pretraining loop -- would raise on the very step earlywarn exists to skip. Its
norm comes from ``clip_grad._get_total_norm``, also a module global: wrapped the same way, a call
over gradients a watcher reads runs with ``error_if_nonfinite=False`` (which also spares the host
sync torch's check costs), so the non-finite step reaches ``optimizer.step`` and is skipped there,
counted and named like any other; a call over gradients no watcher reads raises as before.

Not seen: FSDP1's own ``FullyShardedDataParallel.clip_grad_norm_``, ``clip_grad_value_`` (not a
single factor), and a clip of DTensor gradients (FSDP2); there the statistics are the clipped ones.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any, Callable

import torch

_lock = threading.Lock()
_VERSION = operator.attrgetter("_version")
_observers: "weakref.WeakSet[ClipObserver]" = weakref.WeakSet()
_original: Callable[..., Any] | None = None
_original_norm: Callable[..., Any] | None = None


class _Record:
    """What the loop did to the gradients a watcher is about to read: their per-tensor norms as
    the clip's own norm pass took them (``ids``: the tensors', in the same order), and the clip's
    factor (``None`` when the norms were taken without a clip: ``get_total_norm`` alone). Valid
    while ``grad`` is still the gradient it was, at ``version``."""

    __slots__ = ("coef", "grad", "version", "ids", "norms", "versions", "total")

    def __init__(self, coef: torch.Tensor | None, grad: torch.Tensor, ids: "list[int] | None" = None,
                 norms: "list[torch.Tensor] | None" = None, versions: "list[int] | None" = None,
                 total: torch.Tensor | None = None) -> None:
        self.coef = coef
        self.grad = weakref.ref(grad)
        self.version = grad._version
        # the norms hold while every one of those tensors is unwritten since: their versions then
        self.ids, self.norms, self.versions, self.total = ids, norms, versions, total


class ClipObserver:
    """One watcher's view of the clipping calls: :meth:`take` gives what the loop's clip did to
    the gradients it is about to read (its factor, and the norms its norm pass took), or ``None``."""

    def __init__(self, params: "tuple[torch.nn.Parameter, ...]") -> None:
        self._params = params
        self._ids = frozenset(id(p) for p in params)
        self._record: _Record | None = None

    def _ref(self) -> torch.Tensor | None:
        return next((p.grad for p in self._params if p.grad is not None), None)

    def _normed(self, ids: list[int], norms: list[torch.Tensor], versions: list[int], total: torch.Tensor) -> None:
        """The clip's norm pass over gradients this watcher reads (before any clip by them)."""
        ref = self._ref()
        self._record = None if ref is None else _Record(None, ref, ids, norms, versions, total)

    def _clipped(self, ids: frozenset[int], max_norm: float, total_norm: torch.Tensor,
                 grads: "list[torch.Tensor]") -> None:
        if not self._ids <= ids:
            return  # a clip of some of the parameters only: its factor is not this watcher's
        ref = self._ref()
        if ref is None:
            return
        # torch's own factor, computed the same way (unclamped below 1: clipped; 1: untouched)
        coef = torch.clamp(max_norm / (total_norm.detach() + 1e-6), max=1.0)
        rec = self._record
        if rec is not None and rec.total is total_norm and rec.grad() is ref and rec.ids == list(map(id, grads)):
            # the norms are the clip's own, pre-clip; they hold while the gradients stay as it left them
            self._record = _Record(coef, ref, rec.ids, rec.norms, list(map(_VERSION, grads)))
        else:
            self._record = _Record(coef, ref)

    def take(self, device: torch.device, dtype: torch.dtype) -> "_Record | None":
        """What the loop did to the gradients as they are now (consumed): ``coef`` (the factor,
        on ``device``; ``None``: not clipped) and ``ids`` / ``norms`` (the per-tensor norms the
        clip's norm pass took before it scaled them; ``None``: not known)."""
        rec, self._record = self._record, None
        if rec is None:
            return None
        ref = self._ref()
        if ref is None or ref is not rec.grad() or ref._version != rec.version:
            return None  # written since the clip (a new backward, zero_grad, an unscale): stale
        if rec.coef is not None:
            rec.coef = rec.coef.to(device=device, dtype=dtype, non_blocking=device.type == "cuda")
        return rec

    def reads(self, ids: "set[int]") -> bool:
        """A gradient this watcher reads is among the tensors of ``ids``."""
        return any(p.grad is not None and id(p.grad) in ids for p in self._params)

    def close(self) -> None:
        with _lock:
            _observers.discard(self)
        self._record = None


def unclip(layer_sq: "torch.Tensor | list[float]", coef: torch.Tensor) -> "torch.Tensor | list[float]":
    """Per-layer squared norms (a tensor, or the CPU's list of floats) as they were before a clip
    by ``coef``. A factor of 0 (the total norm was inf: finite gradients became 0, the inf became
    NaN) is left as clipped, so that the layer that was non-finite stays the only one that is."""
    if isinstance(layer_sq, list):
        c = coef.numpy().item()  # (a CPU factor, read as the vector is: the same float64 division as torch's)
        return [x / (c * c) for x in layer_sq] if c > 0 else layer_sq
    return torch.where(coef > 0, layer_sq / (coef * coef), layer_sq)


def _wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                              foreach: bool | None = None) -> None:
        if _compiling() or not _observers:  # traced by torch.compile: torch's function, nothing else
            return original(parameters, max_norm, total_norm, foreach)
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        elif not isinstance(parameters, (list, tuple)):
            parameters = list(parameters)  # a generator is read once: by us, then handed on as a list
        out = original(parameters, max_norm, total_norm, foreach)
        if type(total_norm) is torch.Tensor:  # a DTensor norm (FSDP2): not followed
            ids = frozenset(id(p) for p in parameters)
            grads = [p.grad for p in parameters if p.grad is not None]  # what the clip scaled
            with _lock:
                observers = list(_observers)
            for obs in observers:
                obs._clipped(ids, float(max_norm), total_norm, grads)
        return out

    clip_grads_with_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    clip_grads_with_norm_.__doc__ = original.__doc__
    clip_grads_with_norm_._earlywarn = True  # type: ignore[attr-defined]
    return clip_grads_with_norm_


def _norm_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        if _compiling() or not _observers:
            return original(tensors, norm_type, error_if_nonfinite, foreach)
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        with _lock:
            observers = list(_observers)
        ids = {id(t) for t in tensors}
        readers = [obs for obs in observers if obs.reads(ids)]
        if not readers:
            return original(tensors, norm_type, error_if_nonfinite, foreach)
        # earlywarn skips a non-finite step: no exception out of the loop (error_if_nonfinite off)
        taken = _norms_as_torch_takes_them(tensors, float(norm_type), foreach)
        if taken is None:
            return original(tensors, norm_type, False, foreach)
        total, norms = taken
        order, versions = list(map(id, tensors)), list(map(_VERSION, tensors))
        for obs in readers:
            obs._normed(order, norms, versions, total)  # one norm pass serves the clip and the watcher
        return total

    _get_total_norm.__wrapped__ = original  # type: ignore[attr-defined]
    _get_total_norm.__doc__ = original.__doc__
    _get_total_norm._earlywarn = True  # type: ignore[attr-defined]
    return _get_total_norm


def _norms_as_torch_takes_them(tensors: list[torch.Tensor], norm_type: float,
                               foreach: bool | None) -> "tuple[torch.Tensor, list[torch.Tensor]] | None":
    """``clip_grad._get_total_norm``'s own computation (torch 2.6+), keeping the per-tensor norms
    it takes on the way, in ``tensors``' order: the total is bit for bit torch's (a test holds
    them to it). ``None`` where it would take another path (a 1-norm or inf-norm, DTensors, a
    device without foreach support): torch's own function then runs instead."""
    from torch.utils._foreach_utils import (_device_has_foreach_support, _group_tensors_by_device_and_dtype,
                                            _has_foreach_support)

    if norm_type != 2.0 or not tensors or any(type(t) is not torch.Tensor for t in tensors):
        return None
    first_device = tensors[0].device
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)  # (the same groups)
    norms: list[torch.Tensor] = []
    where: list[int] = []
    with torch.no_grad():
        for (device, _), ([device_tensors], indices) in grouped.items():
            if not ((foreach is None and _has_foreach_support(device_tensors, device))
                    or (foreach and _device_has_foreach_support(device))):
                return None
            norms.extend(torch._foreach_norm(device_tensors, norm_type))
            where.extend(indices)
        total = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)
    in_order: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for i, n in zip(where, norms):
        in_order[i] = n
    return total, in_order


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def observe_clipping(params: "tuple[torch.nn.Parameter, ...]") -> ClipObserver:
    """A :class:`ClipObserver` for ``params``, the wrapper installed (once per process)."""
    global _original, _original_norm
    from torch.nn.utils import clip_grad

    with _lock:
        current = getattr(clip_grad, "_clip_grads_with_norm_", None)
        if current is not None and not getattr(current, "_earlywarn", False):
            _original = current
            wrapped = _wrapper(current)
            clip_grad._clip_grads_with_norm_ = wrapped
            if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is current:
                torch.nn.utils.clip_grads_with_norm_ = wrapped
        norm = getattr(clip_grad, "_get_total_norm", None)
        if norm is not None and not getattr(norm, "_earlywarn", False):
            _original_norm = norm
            wrapped = _norm_wrapper(norm)
            clip_grad._get_total_norm = wrapped
            if getattr(torch.nn.utils, "get_total_norm", None) is norm:
                torch.nn.utils.get_total_norm = wrapped
        obs = ClipObserver(params)
        if _original is not None:
            _observers.add(obs)
        return obs
