"""Serialisation that ``torch.load(weights_only=True)`` accepts: numpy values as tagged plain
records, and every other leaf checked at save time (a checkpoint that cannot be loaded fails
when it is written, naming the path)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError

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
