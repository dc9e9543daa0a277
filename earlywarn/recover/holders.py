"""Where an optimizer's state lives: in itself, in an optimizer it wraps, or sharded over ranks.

Two kinds of optimizer keep their state outside their own ``state``:

* **Wrappers** that step another optimizer and share its parameter groups (the same list
  object): timm's ``Lookahead`` keeps AdamW's moments, and its own slow weights, in the wrapped
  optimizer's ``state``, its own stays empty. :func:`state_holders` lists the optimizer and every
  optimizer it wraps so; the checks, scans and repairs read all of them (a moment poisoned in the
  wrapped optimizer is repaired, not first met as NaN weights). Snapshots keep the wrapper's own
  ``state_dict()`` (what its checkpoints are), so a wrapper that keeps state of its own loses none.
* **ZeRO-1** (``torch.distributed.optim.ZeroRedundancyOptimizer``) keeps each parameter's state on
  one rank only, in a local optimizer (``.optim``) over that rank's share of the parameters; the
  wrapper's own ``state`` is empty, and its ``state_dict()`` refuses until every rank's state has
  been gathered on one rank (a collective that moves the whole state). A snapshot needs none of
  that: every rank copies and restores its own share, as FSDP2's ranks do their shards.
  :class:`ZeroState` is the optimizer as snapshots, restores, checks, scans and repairs see it
  (:func:`state_view`): the wrapper's parameter groups (the same on every rank), the local
  optimizer's state, and a ``state_dict()`` of this rank's share under the wrapper's (global)
  parameter indices.

Scans and repairs agree their numbers over ranks entry by entry, so every rank must list the same
entries: :func:`agreed_state` gives one layout on every rank (for ZeRO-1 it gathers the layout of
the state -- paths and dtypes, not values -- once per call on that rare path, and stands in empty
tensors for the state another rank holds).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from .forms import state_leaves

_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"
# one view per optimizer (hooks and copy plans keyed by it stay put), kept beside it, not in it:
# the user's optimizer pickles and deep-copies as it did
_VIEWS: "weakref.WeakKeyDictionary[Any, ZeroState]" = weakref.WeakKeyDictionary()


def state_view(optimizer: Any) -> Any:
    """``optimizer`` as its state is read and written: itself, or for a ZeroRedundancyOptimizer
    its :class:`ZeroState` (idempotent)."""
    zero = sys.modules.get(_ZERO_MODULE)  # not imported: no optimizer can be one
    if zero is None or not isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer
    view = _VIEWS.get(optimizer)
    if view is None:
        view = _VIEWS[optimizer] = ZeroState(optimizer)
    return view


def stepper(optimizer: Any) -> Any:
    """The optimizer that steps this rank's parameters: ZeRO-1's local one over its share, else
    ``optimizer`` itself (its kind says what state a step makes, and which values it checks)."""
    view = state_view(optimizer)
    return view.local if isinstance(view, ZeroState) else optimizer


def state_holders(optimizer: Any) -> list[Any]:
    """``state_view(optimizer)`` and every optimizer it wraps that shares its parameter groups
    (a wrapper's wrapped ones too) and keeps a ``state`` of its own, each once: where the
    per-parameter state may live. (accelerate's ``AcceleratedOptimizer`` hands out the wrapped
    one's ``state`` as its own: one holder.)"""
    found = [state_view(optimizer)]
    if isinstance(found[0], ZeroState):
        return found
    walked = list(found)
    for o in walked:  # grows while it is walked: wrappers of wrappers
        for v in getattr(o, "__dict__", {}).values():
            if (isinstance(v, torch.optim.Optimizer) and v.param_groups is o.param_groups
                    and all(v is not w for w in walked)):
                walked.append(v)
                if all(v.state is not h.state for h in found):
                    found.append(v)
    return found


def state_of(optimizer: Any) -> Any:
    """``param -> state`` over every holder of ``optimizer``'s state: one holder's own mapping
    (the usual case, nothing copied), else per parameter the holders' entries side by side."""
    holders = state_holders(optimizer)
    if len(holders) == 1:
        return holders[0].state
    merged: dict[Any, dict[Any, Any]] = {}
    for h in reversed(holders):  # a key both hold: the outer one's
        for p, st in h.state.items():
            if st:
                merged.setdefault(p, {}).update(st)
    return merged


def has_state(optimizer: Any) -> bool:
    """Any per-parameter state yet, the same answer on every rank (ZeRO-1: its wrapper's own,
    which its ``load_state_dict`` fills alike everywhere; a rank's share may be empty)."""
    view = state_view(optimizer)
    if isinstance(view, ZeroState):
        return bool(view.zero.state)
    return any(h.state for h in state_holders(view))


def agreed_state(optimizer: Any) -> tuple[Any, dict[int, int]]:
    """``(param -> state, held_once)``: per-parameter state with one layout on every rank, and
    the state tensors only one rank holds (``id -> its number of elements``: counted once in a
    sum over ranks, not once per replica; an empty stand-in where another rank holds it). A
    collective for a :class:`ZeroState` (call it on every rank together); for any other
    optimizer :func:`state_of` and nothing held once."""
    view = state_view(optimizer)
    if isinstance(view, ZeroState):
        return view.agreed_state()
    return state_of(view), {}


def _checkable(t: Any) -> bool:
    # what a scan lists (scan.py, repair.py): ZeRO-1's stand-ins must list the same entries
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0


class ZeroState:
    """A ZeroRedundancyOptimizer as its state is read and written (see the module docstring).
    Anything else (``zero_grad``, hooks, ``defaults``) is the wrapper's."""

    def __init__(self, zero: torch.optim.Optimizer) -> None:
        self._zero = weakref.ref(zero)  # the view lives beside the optimizer, never keeps it alive

    @property
    def zero(self) -> Any:
        """The ZeroRedundancyOptimizer itself."""
        return self._zero()

    @property
    def local(self) -> torch.optim.Optimizer:
        """The optimizer of this rank's share of the parameters (what really steps)."""
        return self.zero.optim  # type: ignore[attr-defined]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # the wrapper's: every parameter, the same on every rank; ZeRO copies their
        # hyperparameters (lr, ...) into the local optimizer's groups at every step
        return self.zero.param_groups

    @property
    def state(self) -> Any:
        return self.local.state  # keyed by parameter: this rank's share only

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_zero":  # copy / pickle probes, before __init__ ran
            raise AttributeError(name)
        return getattr(self.zero, name)

    def _index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.zero.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any]:
        """This rank's share of the state under the wrapper's parameter indices, with the
        wrapper's groups (every parameter listed)."""
        own = self.local.state_dict()
        mine = [p for g in self.local.param_groups for p in g["params"]]
        index = self._index()
        state = {index[id(mine[i])]: s for i, s in own["state"].items()}
        groups, at = [], 0
        for g, lg in zip(self.zero.param_groups, own["param_groups"]):
            groups.append({**{k: v for k, v in lg.items() if k != "params"},
                           "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load ``sd`` (this layout) into the local optimizer: this rank's share of its state,
        every group's hyperparameters into the wrapper's too. (ZeRO's own load would also keep a
        second copy of the share in the wrapper's ``state``.)"""
        index = self._index()
        state, groups, at = {}, [], 0
        for lg, sg in zip(self.local.param_groups, sd["param_groups"]):
            for i, p in enumerate(lg["params"], start=at):
                if index[id(p)] in sd["state"]:
                    state[i] = sd["state"][index[id(p)]]
            groups.append({**{k: v for k, v in sg.items() if k != "params"},
                           "params": list(range(at, at + len(lg["params"])))})
            at += len(lg["params"])
        self.local.load_state_dict({"state": state, "param_groups": groups})
        for g, sg in zip(self.zero.param_groups, sd["param_groups"]):  # ZeRO copies them down at every step
            g.update((k, v) for k, v in sg.items() if k != "params")

    def agreed_state(self) -> tuple[dict[Any, Any], dict[int, int]]:
        params = [p for g in self.zero.param_groups for p in g["params"]]
        own = self.local.state
        layout = {i: [(path, v.dtype, v.numel()) for path, v in state_leaves(own[p]) if _checkable(v)]
                  for i, p in enumerate(params) if p in own}
        world = torch.distributed.get_world_size()
        every: list[Any] = [None] * world
        torch.distributed.all_gather_object(every, layout)  # paths and dtypes: a few bytes a tensor
        held: dict[int, list[tuple[tuple, torch.dtype, int]]] = {}
        for rank_layout in every:
            for i, entries in rank_layout.items():
                held.setdefault(i, entries)
        state: dict[Any, Any] = {}
        once: dict[int, int] = {}
        for i, p in enumerate(params):
            if p in own:
                state[p] = own[p]
                once.update((id(v), v.numel()) for _, v in state_leaves(own[p]) if _checkable(v))
            elif i in held:
                stand_in: dict[Any, Any] = {}
                for path, dtype, numel in held[i]:
                    node = stand_in
                    for k in path[:-1]:
                        node = node.setdefault(k, {})
                    node[path[-1]] = v = torch.empty(0, dtype=dtype, device=p.device)
                    once[id(v)] = numel
                state[p] = stand_in
        return state, once
