"""A state tensor in any form, as snapshots, checks, scans, repairs and restores read and write it.

Optimizer state is not always a plain tensor:

* **Sharded** (FSDP2 / tensor parallel): a ``DTensor``. Every copy and restore works on its
  *local shard* only (a DTensor op goes through DTensor dispatch, which may redistribute -- a
  collective per tensor, or a full-tensor gather -- and a host copy must never do that). A host
  copy of a DTensor is a DTensor with the same layout (mesh, placements, global shape) whose
  local tensor is on the host: ``torch.distributed.checkpoint`` still writes it shard by shard,
  and restoring copies the local shard back in place.
* **A tensor subclass** with a ``__torch_dispatch__`` of its own (torchao's 8-bit / 4-bit / fp8
  moments: uint8 codes and a float scale per block behind a float32 appearance). Such a subclass
  implements the few ops its optimizer needs, rarely ``_foreach_norm``, ``isfinite`` or a copy
  to another device. It is read through what torch's traceable-subclass protocol guarantees:
  ``__tensor_flatten__`` names its inner tensors (:func:`parts`), ``__tensor_unflatten__``
  rebuilds it from copies of them (snapshots, restores). Its values are a function of its parts,
  so a NaN / Inf value needs a non-finite part (a quantized block's scale): the per-step
  finiteness flag reads the parts, not a dequantized copy. Scans and repairs read its values:
  ``dequantize()`` where it has one (written back with its own ``copy_``, which re-quantizes),
  else its floating parts, each as state of its own (:func:`state_leaves`).
* A subclass with neither is **unreadable**: no copy, check or scan can see its values. It is
  left out of checks and scans, and ``watch()`` refuses it while snapshots or checkpoints would
  have to copy it (:func:`refusal`).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ._tree import Path, leaves, path_name

try:  # torch builds without distributed support have no DTensor (and no sharded state)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_PLAIN_DEQUANTIZE = torch.Tensor.dequantize


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
    if type(t) is torch.Tensor:
        return t  # (a plain tensor, the usual case: no DTensor test)
    return t._local_tensor if is_dtensor(t) else t


def like_sharded(host_local: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``host_local`` wrapped with ``t``'s DTensor layout, without moving it to the mesh's device
    (``DTensor.from_local`` would copy it back to the accelerator)."""
    return DTensor(host_local, t._spec, requires_grad=False)  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Tensor subclasses


def is_wrapped(t: Any) -> bool:
    """``t`` is a tensor subclass with a ``__torch_dispatch__`` of its own (not a DTensor): its
    ops are its own, not torch's. (A subclass that only overrides ``__torch_function__``, such as
    ``nn.Parameter``, holds its own storage and reads as a plain tensor.)"""
    return (type(t) is not torch.Tensor and isinstance(t, torch.Tensor) and not is_dtensor(t)
            and getattr(type(t), "__torch_dispatch__", _PLAIN_DISPATCH) is not _PLAIN_DISPATCH)


def flattens(t: Any) -> bool:
    """A wrapped subclass that names its inner tensors and is rebuilt from them (torch's
    traceable-subclass protocol, what ``torch.compile`` and FSDP2 need too)."""
    return hasattr(type(t), "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__")


def inner(t: torch.Tensor) -> tuple[dict[str, torch.Tensor], Any]:
    """A flattening subclass's inner tensors by attribute name, and its context."""
    names, ctx = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}, ctx


def rebuild(t: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor of ``t``'s subclass and context over ``tensors`` (copies of its inner ones)."""
    _, ctx = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__(tensors, ctx, t.size(), t.stride())


def parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors holding ``t``'s values on this rank: ``[t]``, a DTensor's local shard,
    a wrapped subclass's inner tensors (recursively); ``None`` when it is unreadable."""
    if type(t) is torch.Tensor:
        return [t]
    if is_dtensor(t):
        return parts(t._local_tensor)
    if not is_wrapped(t):
        return [t]
    if not flattens(t):
        return None
    out: list[torch.Tensor] = []
    for x in inner(t)[0].values():
        got = parts(x)
        if got is None:
            return None
        out += got
    return out


def dequantizes(t: Any) -> bool:
    """A wrapped subclass with a ``dequantize()`` of its own (every tensor has torch's, for
    torch's quantized dtypes: that one goes through dispatch, which the subclass may refuse)."""
    return is_wrapped(t) and getattr(type(t), "dequantize", _PLAIN_DEQUANTIZE) is not _PLAIN_DEQUANTIZE


def values(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s values on this rank, for scans and repairs (rare path): ``t``,
    a DTensor's local shard, or a wrapped subclass's ``dequantize()`` -- a copy: a repair writes
    it back with :func:`write_back`."""
    t = local(t)
    return t.dequantize() if dequantizes(t) else t


def write_back(t: torch.Tensor, repaired: torch.Tensor) -> None:
    """Put repaired values into ``t`` when :func:`values` gave a copy of them (the subclass's
    own ``copy_`` from a plain tensor: torchao re-quantizes)."""
    t = local(t)
    if dequantizes(t):
        t.copy_(repaired)


def state_leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor of a state tree as scans and repairs see it: plain ones, DTensors and
    subclasses that dequantize as they are; any other flattening subclass as its floating inner
    tensors (``path + (attribute,)``); unreadable ones left out."""
    if isinstance(tree, torch.Tensor):
        t = local(tree)
        if not is_wrapped(t) or dequantizes(t):
            yield path, tree
        elif flattens(t):
            for name, x in inner(t)[0].items():
                if x.is_floating_point() or x.is_complex() or is_wrapped(x):
                    yield from state_leaves(x, path + (name,))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from state_leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from state_leaves(v, path + (i,))


def same_form(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` can be copied into ``a`` part for part: the same subclass, and parts of the same
    shapes and dtypes (plain tensors: the same shape and dtype)."""
    if type(local(a)) is not type(local(b)):
        return False
    pa, pb = parts(a), parts(b)
    return (pa is not None and pb is not None and len(pa) == len(pb)
            and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(pa, pb)))


def copy_parts(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` in place, part by part (:func:`same_form` holds)."""
    for d, s in zip(parts(dst), parts(src)):  # type: ignore[arg-type]
        d.copy_(s)


def unreadable(optimizer: Any, state: Any) -> list[str]:
    """The tensors of ``state`` (``param -> per-parameter state``: ``holders.state_of``) that no
    check, copy or scan can read, as ``"param <index> '<key>': <type>"``."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    out = []
    for p, st in state.items():
        for path, v in leaves(st):
            if parts(v) is None:
                out.append(f"param {index.get(id(p), '?')} {path_name(path)!r}: {type(v).__module__}.{type(v).__qualname__}")
    return out


def refusal(optimizer: Any, state: Any, *, copies: bool) -> str | None:
    """Why ``watch()`` must refuse this optimizer now (``None``: it need not): its ``state`` holds
    tensors earlywarn cannot read while ``copies`` (snapshots or checkpoints) would copy them."""
    bad = unreadable(optimizer, state)
    if not bad or not copies:
        return None
    more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
    return (f"earlywarn cannot read the optimizer state {'; '.join(bad[:3])}{more}: a tensor subclass with its "
            "own __torch_dispatch__ and no __tensor_flatten__ / __tensor_unflatten__ (torch's traceable-subclass "
            "protocol), so no snapshot or checkpoint can copy it. Give the subclass that protocol, or watch "
            "without copies: RecoveryConfig(snapshot_every=0, rewind=False) (the state check and repairs "
            "leave those tensors out)")
