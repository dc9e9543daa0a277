"""One walk over the state trees optimizers and models keep: dicts, lists and tuples of tensors,
nested to any depth.

``torch.optim`` keeps a flat dict per parameter (``state[p]["exp_avg"]``); other libraries nest it
(heavyball: ``state[p][0]["update_by_adam_exp_avg_0"]``, lists of preconditioner factors, tuples
of ``(shape, tensor)``). Scans, repairs, snapshots and restores all walk it with :func:`leaves`,
so none of them sees only the top level. A leaf is addressed by its *path* (the keys and indices
from the root); :func:`path_name` spells it as state keys are spelled (``"exp_avg_sq"`` for a flat
key, ``"0.update_by_adam_exp_avg_0"`` nested).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

Path = tuple


def leaves(tree: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor in ``tree`` with its path, in a stable order (dict order, then index)."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, path + (i,))


def at(tree: Any, path: Path) -> Any:
    """The value at ``path`` in ``tree``, or None where the path does not exist. A tensor
    subclass's inner tensor is at its attribute name (``recover/forms.py``: ``state_leaves``)."""
    for k in path:
        if isinstance(tree, torch.Tensor) and isinstance(k, str) and hasattr(type(tree), "__tensor_flatten__"):
            tree = getattr(tree, "_local_tensor", tree)  # a DTensor: its local shard's
            if k not in tree.__tensor_flatten__()[0]:
                return None
            tree = getattr(tree, k)
        elif isinstance(tree, dict):
            if k not in tree:
                return None
            tree = tree[k]
        elif isinstance(tree, (list, tuple)) and isinstance(k, int) and -len(tree) <= k < len(tree):
            tree = tree[k]
        else:
            return None
    return tree


def path_name(path: Path) -> str:
    """``("exp_avg",)`` -> ``"exp_avg"``; ``(0, "update_by_adam_exp_avg_0")`` -> ``"0.update_by_adam_exp_avg_0"``."""
    return ".".join(str(k) for k in path)


def leaf_name(path: Path) -> str:
    """The innermost named key of ``path`` (what says which kind of state a tensor is)."""
    return next((k for k in reversed(path) if isinstance(k, str)), path_name(path))


def same_structure(a: Any, b: Any) -> bool:
    """``a`` and ``b`` nest the same containers with the same keys and lengths (leaves aside)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(same_structure(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_structure(x, y) for x, y in zip(a, b)))
    return isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor)
