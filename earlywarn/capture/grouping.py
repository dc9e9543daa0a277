"""Which parameters make a "layer": the unit earlywarn reports norms and blame for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

GroupBy = Union[str, int, Callable[[str], str]]
ROOT = "<root>"


# Path components that wrappers insert and users never write: torch.compile's OptimizedModule
# (`_orig_mod`), FSDP1, activation checkpointing, torchrec. Counted, they would shift `depth:N`.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_dmp_wrapped_module"})


def _wrapper_prefix(model: torch.nn.Module) -> tuple[str, ...]:
    """The leading path components of the wrappers around the user's model: `module` for DDP /
    DataParallel (only there: a submodule the user named `module` is a real name), `_orig_mod`
    for a compiled one, in any nesting."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    prefix: list[str] = []
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            prefix.append("module")
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(getattr(model, "_orig_mod"), torch.nn.Module):
            prefix.append("_orig_mod")
            model = model._orig_mod
        else:
            return tuple(prefix)


def user_name(param_name: str, prefix: tuple[str, ...] = ()) -> str:
    """``param_name`` as the user's own model names it (wrapper components removed)."""
    parts = param_name.split(".")
    if prefix and tuple(parts[: len(prefix)]) == prefix:
        parts = parts[len(prefix):]
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS)


def _group_name(param_name: str, group_by: GroupBy, prefix: tuple[str, ...] = ()) -> str:
    if callable(group_by):
        name = group_by(param_name)
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"group_by returned {name!r} for parameter {param_name!r}: it must return a non-empty layer name"
            )
        return name
    if group_by == "module":
        return param_name.rpartition(".")[0] or ROOT  # named as the parameters are, wrappers included
    # depth counts the user's own modules: a wrapper's components would shift it
    module_path = user_name(param_name, prefix).rpartition(".")[0]
    depth = group_by if isinstance(group_by, int) else int(str(group_by).partition(":")[2])
    parts = module_path.split(".") if module_path else []
    return ".".join(parts[:depth]) or ROOT


def _check_group_by(group_by: GroupBy) -> None:
    if callable(group_by) or group_by == "module":
        return
    if isinstance(group_by, int) and not isinstance(group_by, bool) and group_by >= 1:
        return
    if isinstance(group_by, str) and group_by.startswith("depth:"):
        tail = group_by.partition(":")[2]
        if tail.isdigit() and int(tail) >= 1:
            return
    raise ValueError(
        f"group_by={group_by!r} is not understood: use 'module' (each parameter's owning module), "
        "'depth:N' or an int N (module path cut to N components, e.g. 2 -> 'blocks.3'), "
        "or a function mapping a parameter name to a layer name"
    )


@dataclass(frozen=True)
class LayerMap:
    """The optimizer's parameters, their names, and the layer each belongs to."""

    params: tuple[torch.nn.Parameter, ...]
    param_names: tuple[str, ...]
    layer_names: tuple[str, ...]
    layer_of: tuple[int, ...]  # layer index for each entry of params

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def reordered(self, layer_order: Sequence[int]) -> "LayerMap":
        """The same map with layers renumbered so that ``layer_order[i]`` becomes layer ``i``."""
        new_index = {old: new for new, old in enumerate(layer_order)}
        return LayerMap(
            params=self.params,
            param_names=self.param_names,
            layer_names=tuple(self.layer_names[old] for old in layer_order),
            layer_of=tuple(new_index[i] for i in self.layer_of),
        )


def build_layer_map(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group_by: GroupBy = "module") -> LayerMap:
    """Name every parameter the optimizer steps and group them into layers.

    Layers start in reverse registration order (a good first guess at backward order); the
    watcher refines it to the real backward order after the first backward pass. ``depth:N``
    counts the user's own modules: the components wrappers add (DDP's ``module.``,
    ``torch.compile``'s ``_orig_mod.``) are not counted, nor part of the layer's name.
    """
    _check_group_by(group_by)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"earlywarn.watch needs a torch.nn.Module as model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"earlywarn.watch needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    names = {id(p): n for n, p in model.named_parameters()}
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (every requires_grad is False): nothing to watch")

    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            params.append(p)
    missing = [p for p in params if id(p) not in names]
    if missing:
        shapes = ", ".join(str(tuple(p.shape)) for p in missing[:3])
        raise ValueError(
            f"{len(missing)} of the optimizer's {len(params)} parameters are not in the model "
            f"(shapes {shapes}{', ...' if len(missing) > 3 else ''}): pass the model whose parameters "
            "this optimizer updates (for a wrapped model, the wrapper that owns them)"
        )
    if not params:
        raise ValueError("the optimizer has no parameters: nothing to watch")

    # Registration order of the model's parameters, so layers follow the architecture.
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    params.sort(key=lambda p: order[id(p)])
    param_names = [names[id(p)] for p in params]
    prefix = _wrapper_prefix(model)
    groups = [_group_name(n, group_by, prefix) for n in param_names]
    layer_names: list[str] = []
    index: dict[str, int] = {}
    for g in groups:
        if g not in index:
            index[g] = len(layer_names)
            layer_names.append(g)
    layer_of = [index[g] for g in groups]
    fwd = LayerMap(tuple(params), tuple(param_names), tuple(layer_names), tuple(layer_of))
    return fwd.reordered(list(range(len(layer_names)))[::-1])
