"""State plumbing shared by snapshots and checkpoints: host copies, RNG, safe serialisation,
in-place restores. Internal: the public surface is SnapshotRing / CheckpointManager / Recovery."""

from __future__ import annotations

import collections
import copy
import random
from typing import Any, Callable

import numpy as np
import torch

from .errors import CheckpointError

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


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (no collective, no autograd wrapper); ``t`` otherwise."""
    return t._local_tensor if is_dtensor(t) else t


def like_sharded(host_local: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``host_local`` wrapped with ``t``'s DTensor layout, without moving it to the mesh's device
    (``DTensor.from_local`` would copy it back to the accelerator)."""
    return DTensor(host_local, t._spec, requires_grad=False)  # type: ignore[misc]

# --------------------------------------------------------------------------------------------
# Host copies


class HostCopy:
    """A host (CPU) copy of a nested state tree. ``wait()`` before reading: device tensors are
    copied with ``non_blocking`` into pinned memory, so the copy may still be in flight."""

    def __init__(self, tree: Any, event: Any = None) -> None:
        self.tree = tree
        self._event = event

    def wait(self) -> Any:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tree


def _host_tensor(t: torch.Tensor, reuse: Any) -> tuple[torch.Tensor, bool]:
    if is_dtensor(t):
        # local shard only; the copy keeps the layout (see the note on sharded tensors above)
        same = is_dtensor(reuse) and reuse._spec == t._spec
        out, nb = _host_tensor(local(t), local(reuse) if same else None)
        return like_sharded(out, t), nb
    t = t.detach()
    if (
        isinstance(reuse, torch.Tensor)
        and reuse.shape == t.shape
        and reuse.dtype == t.dtype
        and reuse.device.type == "cpu"
        and reuse.layout == t.layout == torch.strided
    ):
        dst = reuse
    elif t.device.type == "cuda" and t.layout == torch.strided:
        # pinned memory lets the device-to-host copy run asynchronously with the next step
        dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    else:
        return t.to("cpu", copy=True), False
    non_blocking = t.device.type == "cuda" and dst.is_pinned()
    dst.copy_(t, non_blocking=non_blocking)
    return dst, non_blocking


def to_host(tree: Any, reuse: Any = None) -> HostCopy:
    """Copy every tensor in ``tree`` to host memory (never aliasing the live tensors); other leaves
    are deep-copied. ``reuse`` is an older copy of the same structure whose buffers are recycled
    (no fresh host allocation every snapshot for a model of fixed shape)."""
    pending = [False]

    def rec(x: Any, r: Any) -> Any:
        if isinstance(x, torch.Tensor):
            out, nb = _host_tensor(x, r)
            pending[0] |= nb
            return out
        if isinstance(x, dict):
            rr = r if isinstance(r, dict) else {}
            out = collections.OrderedDict() if isinstance(x, collections.OrderedDict) else {}
            for k, v in x.items():
                out[k] = rec(v, rr.get(k))
            if hasattr(x, "_metadata"):  # nn.Module.state_dict carries version metadata
                out = collections.OrderedDict(out)
                out._metadata = copy.deepcopy(x._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(x, (list, tuple)):
            rr = r if isinstance(r, (list, tuple)) and len(r) == len(x) else [None] * len(x)
            items = [rec(v, rv) for v, rv in zip(x, rr)]
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
                return type(x)(*items)
            return type(x)(items)
        return copy.deepcopy(x)

    out = rec(tree, reuse)
    event = None
    if pending[0]:
        event = torch.cuda.Event()
        event.record()
    return HostCopy(out, event)


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
    if isinstance(tree, torch.Tensor):
        t = local(tree)
        return t.numel() * t.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(v) for v in tree)
    return 0


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

    When the saved state has the same structure as the live one, tensors are copied in place:
    no second copy of the optimizer state is allocated on the device (a full-size allocation
    at the worst moment) and references others hold to the state tensors stay valid. Otherwise
    ``load_state_dict`` on a clone.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = sd.get("param_groups", [])
    saved_state = sd.get("state", {})
    same = len(saved_groups) == len(optimizer.param_groups) and all(
        len(sg["params"]) == len(g["params"]) for sg, g in zip(saved_groups, optimizer.param_groups)
    )
    if same:
        for i, p in enumerate(params):
            live = optimizer.state.get(p, {})
            saved = saved_state.get(i, {})
            if set(live) != set(saved):
                same = False
                break
            for k, v in saved.items():
                lv = live[k]
                if isinstance(v, torch.Tensor) != isinstance(lv, torch.Tensor):
                    same = False
                elif isinstance(v, torch.Tensor) and not _same_layout(v, lv):
                    same = False
            if not same:
                break
    if not same:
        optimizer.load_state_dict(clone_tree(sd))
        return
    with torch.no_grad():
        for i, p in enumerate(params):
            live = optimizer.state[p]
            for k, v in saved_state.get(i, {}).items():
                if isinstance(v, torch.Tensor):
                    local(live[k]).copy_(local(v))  # sharded state: this rank's shard, in place
                else:
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
    live = model.state_dict(keep_vars=True)
    if any(is_dtensor(v) for v in live.values()) and set(live) == set(sd) and all(
        isinstance(v, torch.Tensor) and isinstance(sd[k], torch.Tensor) and _same_layout(sd[k], v)
        for k, v in live.items()
    ):
        with torch.no_grad():
            for k, v in live.items():
                local(v).copy_(local(sd[k]))
        return
    # load_state_dict copies into the existing parameters (no aliasing of the snapshot)
    model.load_state_dict(sd, strict=True)


def call_state_dict(obj: Any, what: str) -> Any:
    fn: Callable[[], Any] | None = getattr(obj, "state_dict", None)
    if fn is None:
        raise TypeError(f"{what} has no state_dict(): pass objects with state_dict/load_state_dict")
    return fn()
