"""Putting saved state back in place: the model's and the optimizer's tensors copied into the live
ones (no second device copy at the worst moment), ``load_state_dict`` where the layout differs."""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable

import torch

from ._tree import at, leaves, same_structure
from .forms import copy_parts, is_dtensor, is_wrapped, local, same_form
from .hostcopy import clone_tree, fence_copies

def restore_optimizer(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Put ``sd`` (an ``optimizer.state_dict()`` copy) back into ``optimizer``.

    Tensors are copied in place when the live state can be found in ``sd``'s layout -- the live
    ``state`` itself, or the optimizer's own ``state_dict()`` when that reshapes it (bitsandbytes
    nests its quantization state under a key of its own) and holds the live tensors: no second
    copy of the optimizer state is allocated on the device (a full-size allocation at the worst
    moment) and references others hold to the state tensors stay valid. A tensor subclass is
    copied part by part (``forms.copy_parts``). Otherwise ``load_state_dict`` on a clone.
    """
    fence_copies()  # a snapshot copy still reading these tensors must finish first
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = sd.get("param_groups", [])
    saved_state = sd.get("state", {})
    same = len(saved_groups) == len(optimizer.param_groups) and all(
        len(sg["params"]) == len(g["params"]) for sg, g in zip(saved_groups, optimizer.param_groups))
    targets = _targets(optimizer, params, saved_state) if same else None
    if targets is None:
        optimizer.load_state_dict(clone_tree(sd))
        return
    with torch.no_grad():
        for i, p in enumerate(params):
            saved = saved_state.get(i)
            if not saved:  # nothing saved, nothing live (_fits): no entry made (ZeRO: another rank's)
                continue
            target = targets[i]
            for path, v in leaves(saved):
                copy_parts(at(target, path), v)  # sharded state: this rank's shard, in place
            live = optimizer.state[p]
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


def _targets(optimizer: torch.optim.Optimizer, params: list[Any], saved: dict[int, Any]) -> list[Any] | None:
    """Per parameter, the live state laid out as ``saved`` is, holding the live tensors: the
    live ``state`` itself, else the optimizer's own ``state_dict()`` (checked to hold the live
    tensors, and to keep the top-level values a restore sets back where the live state has
    them); ``None`` when neither fits."""
    live = [optimizer.state.get(p, {}) for p in params]
    if all(_fits(st, saved.get(i, {})) for i, st in enumerate(live)):
        return live
    own = optimizer.state_dict().get("state", {})
    held = {id(t) for st in live for _, t in leaves(st)}
    for i, st in enumerate(live):
        mine, theirs = own.get(i, {}), saved.get(i, {})
        if not _fits(mine, theirs) or any(id(t) not in held for _, t in leaves(mine)):
            return None
        if any(k not in st for k, v in theirs.items() if not isinstance(v, (torch.Tensor, dict, list, tuple))):
            return None
    return [own.get(i, {}) for i in range(len(params))]


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
    if is_wrapped(local(saved)) or is_wrapped(local(live)):  # a subclass: part for part (forms.py)
        return same_form(live, saved) and (saved.shape == live.shape or not is_dtensor(saved))
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
