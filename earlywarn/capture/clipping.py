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

import threading
import weakref
from typing import Any, Callable

import torch

_lock = threading.Lock()
_observers: "weakref.WeakSet[ClipObserver]" = weakref.WeakSet()
_original: Callable[..., Any] | None = None
_original_norm: Callable[..., Any] | None = None


class _Record:
    __slots__ = ("coef", "grad", "version")

    def __init__(self, coef: torch.Tensor, grad: torch.Tensor) -> None:
        self.coef = coef
        self.grad = weakref.ref(grad)
        self.version = grad._version


class ClipObserver:
    """One watcher's view of the clipping calls: :meth:`take` gives the factor that scaled the
    gradients it is about to read, or ``None``."""

    def __init__(self, params: "tuple[torch.nn.Parameter, ...]") -> None:
        self._params = params
        self._ids = frozenset(id(p) for p in params)
        self._record: _Record | None = None

    def _clipped(self, ids: frozenset[int], max_norm: float, total_norm: torch.Tensor) -> None:
        if not self._ids <= ids:
            return  # a clip of some of the parameters only: its factor is not this watcher's
        ref = next((p.grad for p in self._params if p.grad is not None), None)
        if ref is None:
            return
        # torch's own factor, computed the same way (unclamped below 1: clipped; 1: untouched)
        coef = torch.clamp(max_norm / (total_norm.detach() + 1e-6), max=1.0)
        self._record = _Record(coef, ref)

    def take(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The clip factor of the gradients as they are now (consumed), on ``device``."""
        rec, self._record = self._record, None
        if rec is None:
            return None
        ref = next((p.grad for p in self._params if p.grad is not None), None)
        if ref is None or ref is not rec.grad() or ref._version != rec.version:
            return None  # written since the clip (a new backward, zero_grad, an unscale): stale
        return rec.coef.to(device=device, dtype=dtype, non_blocking=device.type == "cuda")

    def reads(self, tensors: Any) -> bool:
        """One of ``tensors`` is a gradient this watcher reads."""
        ids = {id(t) for t in tensors}
        return any(p.grad is not None and id(p.grad) in ids for p in self._params)

    def close(self) -> None:
        with _lock:
            _observers.discard(self)
        self._record = None


def unclip(layer_sq: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Per-layer squared norms as they were before a clip by ``coef``. A factor of 0 (the total
    norm was inf: finite gradients became 0, the inf became NaN) is left as clipped, so that the
    layer that was non-finite stays the only one that is."""
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
            with _lock:
                observers = list(_observers)
            for obs in observers:
                obs._clipped(ids, float(max_norm), total_norm)
        return out

    clip_grads_with_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    clip_grads_with_norm_.__doc__ = original.__doc__
    clip_grads_with_norm_._earlywarn = True  # type: ignore[attr-defined]
    return clip_grads_with_norm_


def _norm_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        if error_if_nonfinite and not _compiling() and _observers:
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            with _lock:
                observers = list(_observers)
            if any(obs.reads(tensors) for obs in observers):
                error_if_nonfinite = False  # earlywarn skips that step: no exception out of the loop
        return original(tensors, norm_type, error_if_nonfinite, foreach)

    _get_total_norm.__wrapped__ = original  # type: ignore[attr-defined]
    _get_total_norm.__doc__ = original.__doc__
    _get_total_norm._earlywarn = True  # type: ignore[attr-defined]
    return _get_total_norm


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
