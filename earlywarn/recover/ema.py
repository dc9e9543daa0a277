"""Averaged copies of the model (EMA, SWA) that a rewind would leave poisoned, found at ``watch()``.

An EMA of the weights (diffusers' ``EMAModel``, timm's ``ModelEmaV3``,
``torch.optim.swa_utils.AveragedModel``, ``ema_pytorch.EMA``) averages every applied update into a
*copy* of the weights: after a NaN reached the weights once, the copy is NaN too, and a rewind that
restores the model leaves it so -- and the copy is what gets saved and shipped. Passed in
``extra_state={"ema": ema}`` it is snapshotted and restored with the rest (registered as a
submodule of the watched model, it is part of the model and restored with it already).

It holds copies, not references, so nothing on the model leads to it. What is looked at instead:
the objects in scope where ``watch()`` is called -- the locals and globals of the calling frames
and one level of attributes of the objects there (a trainer's or a LightningModule's ``self.ema``)
-- for an object whose class names an average (``EMA``, ``Ema``, ``Averag``, ``SWA``, ``Polyak``
anywhere in its class hierarchy), with ``state_dict``/``load_state_dict``, whose tensors include
a tensor of every shape the model trains, in storage of its own (a copy, not the model). Cheap
(no scan of the heap) and silent on the frozen reference models of DPO-style trainers (their
class names no average). One not in scope is not seen: the README says how to pass it.
"""

from __future__ import annotations

import collections
import functools
import re
import sys
from typing import Any, Iterable, Iterator, Mapping

import torch

# an EMA as class names spell it (EMAModel, ModelEmaV3, ema_*), never the "ema" inside "Schema"
_AVERAGE = re.compile(r"EMA|Ema|^ema|_ema|(?i:averag|swa|polyak)")
_FRAMES = 12


@functools.lru_cache(maxsize=4096)
def _averaging_class(cls: type) -> bool:
    return any(_AVERAGE.search(c.__name__) for c in cls.__mro__[:-1])


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    out: list[torch.Tensor] = []
    for v in vars(obj).values() if hasattr(obj, "__dict__") else ():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
        out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


def _in_scope(depth: int) -> Iterator[Any]:
    frame = sys._getframe(depth)
    seen: set[int] = set()
    for _ in range(_FRAMES):
        if frame is None:
            return
        for scope in (frame.f_locals, frame.f_globals):
            for v in list(scope.values()):
                for obj in (v, *_attributes(v)):
                    if id(obj) not in seen:
                        seen.add(id(obj))
                        yield obj
        frame = frame.f_back


def _attributes(obj: Any) -> list[Any]:
    if isinstance(obj, (type, type(sys))) or not hasattr(obj, "__dict__"):
        return []  # classes and modules: their attributes are no training state
    out = [v for v in vars(obj).values() if hasattr(v, "__dict__")]
    if isinstance(obj, torch.nn.Module):
        out += list(obj.children())
    return out


def averaged_copies(model: torch.nn.Module, registered: Iterable[Any] = (), *, depth: int = 2) -> list[Any]:
    """The averaged copies of ``model``'s trainable weights in scope of the caller ``depth``
    frames up that ``registered`` (the objects in ``extra_state``) does not hold and ``model``
    does not contain."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if not trained:
        return []
    want = collections.Counter(tuple(p.shape) for p in trained)
    mine = {p.data_ptr() for p in model.parameters()}
    skip = {id(m) for m in model.modules()}
    for obj in registered:
        skip.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            skip |= {id(m) for m in obj.modules()}
    found = []
    for obj in _in_scope(depth + 1):
        if id(obj) in skip or not _averaging_class(type(obj)):
            continue
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            continue
        ts = [t for t in _tensors(obj) if t.data_ptr() not in mine]
        have = collections.Counter(tuple(t.shape) for t in ts)
        if all(have[s] >= n for s, n in want.items()):
            found.append(obj)
            if isinstance(obj, torch.nn.Module):
                skip |= {id(m) for m in obj.modules()}
    return found


def averaged_copies_warning(model: torch.nn.Module, extra_state: Mapping[str, Any] | None, *, depth: int = 2) -> str | None:
    """What ``watch()`` says when averaged copies of the model are in scope but not in
    ``extra_state`` (None when there are none)."""
    try:
        found = averaged_copies(model, (extra_state or {}).values(), depth=depth + 1)
    except Exception:  # noqa: BLE001 - a look around the caller's scope must never stop watch()
        return None
    if not found:
        return None
    names = ", ".join(sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in found}))
    return (f"earlywarn: an averaged copy of this model's weights ({names}) is not in extra_state: a rewind restores "
            "the model but not it, so a NaN it averaged in stays (and it is what gets saved). Pass it: "
            "earlywarn.watch(model, optimizer, extra_state={'ema': ema})")
