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
# Packages whose modules wrap a model under one attribute (DDP's `module`, Fabric's `_forward_module`,
# peft's `base_model.model`, DeepSpeed's engine, accelerate's wrappers...).
_WRAPPING_PACKAGES = frozenset({"torch", "lightning", "lightning_fabric", "pytorch_lightning", "accelerate",
                                "deepspeed", "peft", "fairscale", "torchtune", "composer", "apex", "megatron"})
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def _wrapper_prefix(model: torch.nn.Module) -> tuple[str, ...]:
    """The leading path components of the wrappers around the user's model, in any nesting. A
    wrapper holds no parameter or buffer of its own and nests everything under one attribute, and
    is a framework's (its class comes from a package that wraps models: torch's compile, DDP,
    DataParallel; Lightning Fabric; peft; DeepSpeed; ...) or nests under a private attribute
    (``_forward_module``). A submodule the user named ``module`` inside their own model is a real name."""
    prefix: list[str] = []
    params = [n.split(".") for n, _ in model.named_parameters()]
    buffers = [n.split(".") for n, _ in model.named_buffers()]
    while params:
        heads = {p[0] for p in params + buffers if len(p) > 1}
        if len(heads) != 1 or any(len(p) == 1 for p in params + buffers) or isinstance(model, _CONTAINERS):
            break
        head = heads.pop()
        child = getattr(model, head, None)
        where = type(model).__module__
        # torch.nn's own layers (a bare nn.TransformerEncoder holds only `layers`) are no wrappers
        framework = where.partition(".")[0] in _WRAPPING_PACKAGES and not where.startswith("torch.nn.modules")
        if not isinstance(child, torch.nn.Module) or not (framework or head.startswith("_")):
            break
        prefix.append(head)
        model, params, buffers = child, [p[1:] for p in params], [b[1:] for b in buffers]
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
    # named as the user's own model names it: a wrapper's components (a compiled model's
    # `_orig_mod.`, Fabric's `_forward_module.`, DDP's `module.`) are no part of a layer's name
    module_path = user_name(param_name, prefix).rpartition(".")[0]
    if group_by == "module":
        return module_path or ROOT
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


_IN_BACKWARD = (
    "earlywarn cannot guard an optimizer stepped inside backward (torchtune's optimizer_in_bwd=True, torch's "
    "_apply_optimizer_in_backward): each parameter is updated by its own optimizer as soon as its gradient "
    "exists, so a NaN gradient is applied before the step's gradients can be checked together, and there is no "
    "single optimizer.step() to skip. Train with the optimizer stepped after backward (torchtune: "
    "optimizer_in_bwd=False) to use earlywarn")


def _refuse_optimizer_in_backward(model: torch.nn.Module, optimizer: object) -> None:
    """Optimizer-in-backward (its per-parameter optimizers, or a wrapper holding them) is refused
    with the reason and the fix, not with a type error."""
    held = getattr(optimizer, "optim_map", optimizer)  # torchtune's OptimizerInBackwardWrapper
    values = list(held.values()) if isinstance(held, dict) else held if isinstance(held, (list, tuple)) else []
    several = len(values) > 1 and all(isinstance(o, torch.optim.Optimizer) for o in values)
    in_hooks = any(getattr(p, "_in_backward_optimizers", None) for p in model.parameters())
    if several or in_hooks:
        raise ValueError(_IN_BACKWARD)


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
    _refuse_optimizer_in_backward(model, optimizer)
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
            "this optimizer updates (for a wrapped model, the wrapper that owns them). One optimizer over "
            "two models (a GAN's generator and discriminator, an encoder and a head built apart): watch one "
            "module that holds both, earlywarn.watch(torch.nn.ModuleDict({'generator': G, 'discriminator': "
            "D}), optimizer) -- nn.ModuleDict registers them without changing either"
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
