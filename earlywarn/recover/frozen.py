"""Frozen parameters in snapshots: kept by reference, never copied, while they stay frozen.

A LoRA run trains a few million parameters beside a frozen base of billions; copying the base
into every snapshot costs its size in host RAM per snapshot and its copy time at every snapshot
step, for values that never change. So a parameter with ``requires_grad=False`` that has not been
written since ``watch()`` (its version counter has not moved) is not copied: a snapshot holds the
model's own tensor, and restoring it is a no-op (``_state.restore_model`` skips it). Host RAM and
snapshot time then follow what trains. ``requires_grad=False`` alone is no proof: an EMA copy
registered inside the model is frozen and written every step, so it moves its version counter
before the first snapshot and is copied like anything else.

A frozen parameter may be unfrozen later (a late unfreeze in fine-tuning): a step pre-hook on the
optimizer looks, before every update, for a referenced parameter that the optimizer holds and that
now requires grad (or whose version counter moved), and copies its still-unchanged values to the
host into every snapshot that referenced it, before the optimizer writes it. Only those: a LoRA
optimizer holds the adapters alone, so its steps look at nothing; the parameters no optimizer
holds (which no step can write) are looked at once per snapshot. Assumed: a frozen parameter is written only after
it is unfrozen (an in-place write while frozen -- through ``.data``, which bypasses the version
counter, or by a loop that edits it between steps -- cannot be undone by a rewind; a version
change is warned about).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Mapping

import torch

from .forms import local
from .hostcopy import HostCopy, state_bytes
from ._tree import leaves

_MOVING = -1
_REGISTRY: "weakref.WeakKeyDictionary[torch.nn.Module, FrozenRefs]" = weakref.WeakKeyDictionary()


def frozen_refs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> "FrozenRefs":
    """The one :class:`FrozenRefs` of ``model`` (created, with its optimizer hook, on first use:
    at ``watch()``, by the snapshot plan, so that versions are known from the start)."""
    refs = _REGISTRY.get(model)
    if refs is None:
        refs = _REGISTRY[model] = FrozenRefs(optimizer, model)
    refs.hook(optimizer)  # the model watched again with another optimizer: that one is hooked too
    return refs


def frozen_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a snapshot keeps by reference (``requires_grad=False``)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += local(p).numel() * p.element_size()
    return total


def _storage(t: torch.Tensor) -> tuple:
    lt = local(t)
    return (lt.device, lt.data_ptr(), tuple(lt.shape), lt.dtype)


class FrozenRefs:
    """The frozen parameters snapshots reference, and the snapshots that do."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self._refs: dict[int, tuple[torch.nn.Parameter, int]] = {}  # id(param) -> (param, version)
        self._holders: "weakref.WeakSet[HostCopy]" = weakref.WeakSet()
        # version when first seen frozen; _MOVING once written (never referenced again)
        self._seen: dict[int, int] = {id(p): p._version for p in model.parameters() if not p.requires_grad}
        self._hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._hooks: list[Any] = []
        # The per-step check looks only at referenced parameters a hooked optimizer holds (it can
        # write them once they are unfrozen): the others are looked at once per snapshot.
        self._held: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
        self._held_ids: set[int] = set()
        self._stepped: dict[int, tuple[torch.nn.Parameter, int]] = {}  # the refs the per-step check sees
        # every name a parameter has (tied weights have several), walked once: a snapshot then
        # looks at the frozen ones by name instead of walking the model
        self._named = list(model.named_parameters(remove_duplicate=False))
        self.hook(optimizer)

    def hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Check before every step of ``optimizer`` (once per optimizer)."""
        if optimizer not in self._hooked:
            self._hooked.add(optimizer)
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _static(self, p: torch.nn.Parameter) -> bool:
        v0 = self._seen.setdefault(id(p), p._version)
        if v0 != p._version:
            self._seen[id(p)] = _MOVING
        return v0 == p._version

    def shared(self, model: torch.nn.Module, sd: Mapping[str, Any]) -> set[int]:
        """ids of the ``sd`` values (a ``model.state_dict()``) that are frozen parameters never
        written since first seen: what :func:`~earlywarn.recover.hostcopy.to_host` keeps as it is."""
        self._check(self._refs)  # the references no optimizer step looks at, too
        ids: set[int] = set()
        scan: dict[tuple, torch.nn.Parameter] = {}  # frozen ones not found under their names
        for name, p in self._named:  # (parameters added after watch() are copied: never wrong)
            if p.requires_grad or local(p).numel() == 0 or not self._static(p):
                continue
            v = sd.get(name)
            key = _storage(p)
            if isinstance(v, torch.Tensor) and _storage(v) == key:
                self._reference(p, v, ids)
            else:
                scan[key] = p
        if scan:  # a state_dict that names them otherwise: found by storage
            for v in sd.values():
                p = scan.get(_storage(v)) if isinstance(v, torch.Tensor) else None
                if p is not None:
                    self._reference(p, v, ids)
        return ids

    def _reference(self, p: torch.nn.Parameter, v: torch.Tensor, ids: set[int]) -> None:
        ids.add(id(v))
        if id(p) not in self._refs:
            self._refs[id(p)] = (p, p._version)
            if id(p) in self._held_ids:
                self._stepped[id(p)] = self._refs[id(p)]

    def hold(self, host: HostCopy, shared: set[int]) -> None:
        """``host`` references the frozen parameters ``shared`` names (its own bytes exclude them)."""
        host.shared = shared  # type: ignore[attr-defined]
        if shared:
            self._holders.add(host)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._refs:  # nothing referenced (no frozen parameter, or no snapshot yet): nothing to check
            if optimizer not in self._held:
                self._held[optimizer] = ()  # who holds what: worked out at its first step with references
            return
        groups = optimizer.param_groups
        layout = tuple(len(g["params"]) for g in groups)
        if self._held.get(optimizer) != layout:  # first step, or add_param_group: who holds what, again
            self._held[optimizer] = layout
            self._held_ids = {id(p) for opt in self._held for g in opt.param_groups for p in g["params"]}
            self._stepped = {pid: ref for pid, ref in self._refs.items() if pid in self._held_ids}
        if self._stepped:
            self._check(self._stepped)

    def _check(self, refs: dict[int, tuple[torch.nn.Parameter, int]]) -> None:
        """Release the references in ``refs`` that were unfrozen or written since they were taken."""
        for pid, (p, version) in list(refs.items()):
            if p.requires_grad or p._version != version:
                self._release(p, changed=p._version != version)
                del self._refs[pid]
                self._stepped.pop(pid, None)
                self._seen[pid] = _MOVING

    def _release(self, p: torch.nn.Parameter, *, changed: bool) -> None:
        """``p`` is about to be written: every snapshot referencing it gets a host copy now."""
        key = _storage(p)
        copy: torch.Tensor | None = None
        for host in list(self._holders):
            tree = host.tree.get("model") if isinstance(host.tree, dict) else None
            for name, v in list((tree or {}).items()):
                if isinstance(v, torch.Tensor) and id(v) in host.shared and _storage(v) == key:  # type: ignore[attr-defined]
                    if copy is None:
                        copy = v.detach().to("cpu", copy=True)
                    tree[name] = copy
                    host.shared = host.shared - {id(v)}  # type: ignore[attr-defined]
        if changed and copy is not None:
            warnings.warn("earlywarn: a frozen parameter was written in place outside the optimizer after a snapshot "
                          "kept it by reference; a rewind restores its current values, not the snapshot's",
                          RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def owned_bytes(host: HostCopy) -> int:
    """Bytes a snapshot holds of its own (what it references of the model is not counted)."""
    shared = getattr(host, "shared", set())
    return state_bytes(host.tree) - sum(local(t).numel() * t.element_size()
                                        for _, t in leaves(host.tree.get("model", {})) if id(t) in shared)
