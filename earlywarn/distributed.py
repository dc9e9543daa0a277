"""Checkpoints of sharded training state through ``torch.distributed.checkpoint`` (torch only).

``save_fn, load_fn = dcp_checkpoint_fns(model, optimizer)`` gives the pair that
``RecoveryConfig(save_fn=..., load_fn=...)`` / ``CheckpointManager`` take, so earlywarn's disk
checkpoints of an FSDP2 (DTensor) model are written shard by shard, each rank its own part,
and read back resharded into the live model -- no rank ever gathers the full model.

Layout of one checkpoint directory:

* the tensors, in ``torch.distributed.checkpoint`` format (``.metadata`` + ``*.distcp``):
  DTensors sharded; plain tensors (DDP's replicated state) once, deduplicated across ranks;
  RNG states per rank;
* ``earlywarn.rank<r>.pt``: everything else of that rank's payload (step, detector state, data
  position...), written with ``torch.save`` and read with ``weights_only=True`` -- DCP would
  pickle non-tensor values and unpickle them on load, which earlywarn never does.

Both functions are collectives when ``torch.distributed`` is initialised: every rank calls them
with the same ``path``. The pair from :func:`dcp_checkpoint_fns` says so (``save_fn.collective``
is ``True``), so ``CheckpointManager`` / ``RecoveryConfig(checkpoint_dir=..., save_fn=...,
load_fn=...)`` write one shared checkpoint per step: every rank its part into one temp
directory, rank 0 alone renames it into place (``earlywarn.recover.checkpoint``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

_MARK = "__earlywarn_dcp__"
_SKELETON = "earlywarn.rank{}.pt"


def _dist() -> bool:
    d = torch.distributed
    return d.is_available() and d.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist() else 0


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _key(path: tuple[Any, ...]) -> str:
    # Types are kept in the key: optimizer state is keyed by int, modules by str.
    return "/".join(f"{type(p).__name__[0]}:{p}" for p in path)


def _split(tree: Any, path: tuple[Any, ...], rank: int, tensors: dict[str, torch.Tensor]) -> Any:
    """Tensors -> ``tensors[key]``; the rest stays as a skeleton with a marker per tensor."""
    if isinstance(tree, torch.Tensor):
        key = _key(path)
        if len(path) >= 2 and path[:2] == ("state", "rng"):
            key = f"rank{rank}/{key}"  # RNG streams are per rank, never deduplicated
        tensors[key] = tree
        return {_MARK: key, "dtensor": _is_dtensor(tree), "path": list(path)}
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) is not dict else {}
        for k, v in tree.items():
            out[k] = _split(v, path + (k,), rank, tensors)
        return out
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_split(v, path + (i,), rank, tensors) for i, v in enumerate(tree))
    return tree


def _markers(tree: Any, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(tree, dict):
        if _MARK in tree:
            out.append(tree)
        else:
            for v in tree.values():
                _markers(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _markers(v, out)
    return out


def _join(tree: Any, loaded: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if _MARK in tree:
            return loaded[tree[_MARK]]
        out = type(tree)() if type(tree) is not dict else {}
        for k, v in tree.items():
            out[k] = _join(v, loaded)
        return out
    if isinstance(tree, (list, tuple)):
        return type(tree)(_join(v, loaded) for v in tree)
    return tree


def dcp_save(payload: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``payload`` (a nested dict of tensors, DTensors and plain values) to directory ``path``."""
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(payload, (), rank, tensors)
    dcp.save(tensors, checkpoint_id=str(root), no_dist=not _dist())
    tmp = root / (_SKELETON.format(rank) + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(skeleton, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / _SKELETON.format(rank))


def dcp_load(path: str | os.PathLike[str], templates: Callable[[list[Any]], torch.Tensor | None]) -> dict[str, Any]:
    """Read a directory written by :func:`dcp_save`.

    ``templates(path)`` returns a live DTensor laid out like the saved tensor at ``path``
    (the loaded values are resharded into a copy of it), or ``None`` for a plain tensor.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank = _rank()
    root = Path(path)
    name = root / _SKELETON.format(rank)
    if not name.exists():
        raise FileNotFoundError(
            f"{name} is missing: this checkpoint was written by fewer ranks than are reading it "
            "(resuming on another world size is not supported)"
        )
    skeleton = torch.load(name, map_location="cpu", weights_only=True)
    meta = FileSystemReader(str(root)).read_metadata().state_dict_metadata
    wanted: dict[str, torch.Tensor] = {}
    for m in _markers(skeleton, []):
        key = m[_MARK]
        info = meta.get(key)
        if not isinstance(info, TensorStorageMetadata):
            raise KeyError(f"{root}: tensor {key!r} is not in the checkpoint's metadata")
        like = templates(m["path"]) if m["dtensor"] else None
        if m["dtensor"]:
            if like is None or not _is_dtensor(like) or tuple(like.shape) != tuple(info.size):
                raise ValueError(
                    f"{root}: {key!r} was saved sharded (global shape {tuple(info.size)}) but the live "
                    "model/optimizer has no DTensor of that shape at that place: load into the same "
                    "fully_shard layout it was saved from"
                )
            wanted[key] = torch.empty_like(like)
        else:
            wanted[key] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
    dcp.load(wanted, checkpoint_id=str(root), no_dist=not _dist())
    return _join(skeleton, wanted)


def dcp_checkpoint_fns(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Callable[[dict[str, Any], str], None], Callable[[str], dict[str, Any]]]:
    """``(save_fn, load_fn)`` for :class:`earlywarn.RecoveryConfig` / ``CheckpointManager``,
    marked collective (``fn.collective = True``): every rank calls them with the same path.

    Sharded tensors found under ``state/model`` are laid out like ``model.state_dict()``;
    under ``state/optimizer/state/<i>`` like the optimizer's live state, or like its ``i``-th
    parameter when that state does not exist yet (a fresh process resuming).
    """

    def templates_for_live_state() -> Callable[[list[Any]], torch.Tensor | None]:
        model_sd = model.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def templates(path: list[Any]) -> torch.Tensor | None:
            if len(path) >= 3 and path[:2] == ["state", "model"]:
                return model_sd.get(path[2])
            if len(path) >= 5 and path[:3] == ["state", "optimizer", "state"]:
                index, name = path[3], path[4]
                if not isinstance(index, int) or index >= len(params):
                    return None
                live = optimizer.state.get(params[index], {}).get(name)
                return live if isinstance(live, torch.Tensor) else params[index].detach()
            return None

        return templates

    def save_fn(payload: dict[str, Any], path: str) -> None:
        dcp_save(payload, path)

    def load_fn(path: str) -> dict[str, Any]:
        return dcp_load(path, templates_for_live_state())

    save_fn.collective = True  # type: ignore[attr-defined]
    load_fn.collective = True  # type: ignore[attr-defined]
    return save_fn, load_fn
