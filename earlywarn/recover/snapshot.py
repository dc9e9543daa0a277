"""In-memory snapshots: host copies of everything a rewind restores, kept in a small ring.

A snapshot's ``state`` is a plain dict (the same layout a disk checkpoint stores)::

    {"step": int, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
     "scheduler": ... | None, "scaler": ... | None, "rng": {...}, "data": loader state | None,
     "extra": {name: obj.state_dict()}}

Every tensor is a host copy (device tensors go to pinned memory, asynchronously; ``wait()``
before reading), except frozen parameters (``requires_grad=False``): those are the model's own
tensors, referenced while they stay frozen (``frozen.py``: a LoRA base costs no snapshot memory). The optimizer's parameters and state are copied on a side stream while the
next step runs (see ``_state``: the guard fences the copy before the next optimizer write). When
the ring is full, the evicted snapshot's buffers are reused for the new one, so periodic
snapshots of a fixed-shape model do not allocate host memory again.

Which snapshot a full ring recycles decides how far back a rewind must go, so it is chosen to
keep the recent past covered: never the newest, and among the others the one whose removal
leaves the smallest gap between the snapshots that stay (the oldest on ties, so a steady cadence
behaves as a plain ring). When snapshots come faster (an episode is building), the older, sparser
ones survive and the newest few are thinned: a rewind can go back to just before the episode
began, or to the steady snapshots before that.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .forms import distributed_rank
from .hostcopy import HostCopy, clone_tree, optimizer_tensors, to_host
from .restore import call_state_dict, restore_model, restore_optimizer
from .rng import capture_rng, restore_rng
from ._tree import at, leaves, same_structure
from .frozen import frozen_refs, owned_bytes
from .holders import state_view


def capture_state(
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    scaler: Any = None,
    data: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    reuse: "HostCopy | Mapping[str, Any] | None" = None,
    check_finite: bool = False,
) -> HostCopy:
    """Host copy of the full training state. ``data`` is the loader's position state (already a
    plain dict); ``extra`` maps names to objects with ``state_dict()``. ``check_finite``: also
    flag, on the device, whether the optimizer's parameters and state are finite
    (``HostCopy.finite()``, read once the copy has landed: no host sync now). Under
    torch.distributed the flag is agreed over ranks in one all-reduce: call it on every rank."""
    optimizer = state_view(optimizer)  # ZeRO-1: this rank's share of the state (recover/holders.py)
    model_sd = model.state_dict()
    live = {
        "step": int(step),
        "model": model_sd,
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else call_state_dict(scheduler, "scheduler"),
        "scaler": None if scaler is None else call_state_dict(scaler, "scaler"),
        "rng": capture_rng(),
        "data": data,
        "extra": {k: call_state_dict(v, f"extra_state[{k!r}]") for k, v in (extra or {}).items()},
    }
    agree = check_finite and distributed_rank() is not None
    refs = frozen_refs(model, optimizer)
    shared = refs.shared(model, model_sd)  # frozen weights: referenced, not copied (recover/frozen.py)
    host = to_host(live, reuse, side=optimizer_tensors(optimizer), check_finite=check_finite, agree=agree,
                   shared=shared, planned=_PLANNED)
    refs.hold(host, host.kept)
    return host


# the parts of a snapshot that are flat mappings of tensors: copied by plan (see _state._PartPlan)
_PLANNED = (("model",), ("optimizer", "state"))


def restore_state(
    state: Mapping[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> None:
    """Put a captured state back, in place. The data position is restored by the caller (it
    may need to move a live iterator)."""
    restore_model(model, state["model"])
    restore_optimizer(state_view(optimizer), state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))
    if scaler is not None and state.get("scaler"):  # {} = saved from a disabled scaler
        scaler.load_state_dict(copy.deepcopy(state["scaler"]))
    for name, obj in (extra or {}).items():
        saved = (state.get("extra") or {}).get(name)
        if saved is not None:
            restore_object(obj, saved)
    if rng and state.get("rng") is not None:
        restore_rng(state["rng"])


def restore_object(obj: Any, saved: Any) -> None:
    """``obj.load_state_dict`` with ``saved`` (a host copy of its ``state_dict()``), its tensors
    kept where they live: a module copies into its own; for anything else, when its live
    ``state_dict()`` returns its tensors (the PyTorch convention) in the same structure, they are
    copied into in place and handed back -- diffusers' ``EMAModel.load_state_dict`` keeps (a deep
    copy of) the tensors it is given: given host copies, its shadow weights would move to the host."""
    if isinstance(obj, torch.nn.Module):
        obj.load_state_dict(saved)
        return
    live = obj.state_dict()
    pairs = [(at(live, path), v) for path, v in leaves(saved)]
    if not pairs or not same_structure(live, saved) or not all(
            isinstance(t, torch.Tensor) and t.shape == v.shape and t.dtype == v.dtype for t, v in pairs):
        obj.load_state_dict(clone_tree(saved))
        return
    with torch.no_grad():
        for t, v in pairs:
            t.copy_(v)
    obj.load_state_dict(_plain_from(saved, live))


def _plain_from(saved: Any, live: Any) -> Any:
    """``saved``'s structure and plain values, with ``live``'s tensors."""
    if isinstance(saved, torch.Tensor):
        return live
    if isinstance(saved, dict):
        return type(saved)((k, _plain_from(v, live[k])) for k, v in saved.items())
    if isinstance(saved, (list, tuple)):
        items = [_plain_from(v, lv) for v, lv in zip(saved, live)]
        return type(saved)(*items) if hasattr(saved, "_fields") else type(saved)(items)
    return copy.deepcopy(saved)


@dataclass
class Snapshot:
    """One captured state. ``clean``: no alert within the clean window before ``step``."""

    step: int
    clean: bool
    reason: str
    host: HostCopy = field(repr=False)
    time: float = field(default_factory=time.time)
    building: bool = False
    """Taken while an episode was building (the faster cadence)."""
    pinned: int = field(default=0, repr=False)
    """Writers still reading the buffers (an async disk write): the ring will not recycle them."""

    @property
    def state(self) -> dict[str, Any]:
        return self.host.wait()

    def wait(self) -> dict[str, Any]:
        return self.host.wait()

    @property
    def nbytes(self) -> int:
        """Host bytes of its own (the frozen weights it references are the model's)."""
        return owned_bytes(self.host)


class SnapshotRing:
    """The last ``keep`` clean snapshots and the last ``keep_unclean`` others (taken on a
    warning), in host memory. Restoring one is a memory copy: a rewind without disk."""

    def __init__(self, keep: int = 2, *, keep_unclean: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        if keep_unclean < 0:
            raise ValueError(f"keep_unclean={keep_unclean}: must be >= 0")
        self.keep = keep
        self.keep_unclean = keep_unclean
        self._entries: list[Snapshot] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Snapshot]:
        """Oldest first."""
        return list(self._entries)

    def _victim(self, clean: bool, step: int) -> Snapshot | None:
        """The snapshot a new one (at ``step``) replaces, or ``None`` while there is room."""
        same = [s for s in self._entries if s.clean == clean]
        cap = self.keep if clean else self.keep_unclean
        if len(same) < cap or not same:
            return None
        if len(same) == 1:
            return same[0]
        steps = [s.step for s in same] + [int(step)]
        best, best_gap = same[0], steps[1] - steps[0]  # dropping the oldest shortens the reach by this
        for i in range(1, len(same)):
            gap = steps[i + 1] - steps[i - 1]  # dropping an inner one merges its two gaps
            if gap < best_gap:
                best, best_gap = same[i], gap
        return best

    def set_capacity(self, keep: int, keep_unclean: int | None = None) -> None:
        """Change how many snapshots are kept (a memory budget); extra ones go, oldest first."""
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self.keep = keep
        if keep_unclean is not None:
            self.keep_unclean = keep_unclean
        self.add(None)

    def capture(
        self,
        step: int,
        *,
        clean: bool = True,
        reason: str = "periodic",
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        data: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        building: bool = False,
    ) -> Snapshot:
        """Capture and add a snapshot, recycling the buffers of the one it evicts."""
        victim = self._victim(clean, step)
        reuse = None
        if victim is not None:
            self._entries.remove(victim)
            # a writer still reading it (an async disk write) keeps its buffers; else recycle them
            reuse = victim.host if victim.pinned == 0 else None
        host = capture_state(
            step, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            data=data, extra=extra, reuse=reuse,
        )
        snap = Snapshot(step=int(step), clean=clean, reason=reason, host=host, building=building)
        self.add(snap)
        return snap

    def add(self, snap: Snapshot | None) -> None:
        """Add a snapshot copied elsewhere (the recovery's provisional one); when the ring is
        full, the one :meth:`_victim` picks makes room (the caller may recycle its buffers)."""
        if snap is not None and (snap.clean or self.keep_unclean > 0):
            victim = self._victim(snap.clean, snap.step)
            if victim is not None:
                self._entries.remove(victim)
            self._entries.append(snap)
        self._entries.sort(key=lambda s: s.step)
        for clean, cap in ((True, self.keep), (False, self.keep_unclean)):
            same = [s for s in self._entries if s.clean == clean]
            for s in same[: max(0, len(same) - cap)]:
                self._entries.remove(s)

    def latest(self, *, clean_only: bool = True, before: int | None = None) -> Snapshot | None:
        """Newest snapshot (clean only by default) with ``step < before``."""
        for s in reversed(self._entries):
            if clean_only and not s.clean:
                continue
            if before is not None and s.step >= before:
                continue
            return s
        return None

    def drop_after(self, step: int) -> list[Snapshot]:
        """Forget snapshots newer than ``step`` (taken on a trajectory a rewind abandoned)."""
        gone = [s for s in self._entries if s.step > step]
        self._entries = [s for s in self._entries if s.step <= step]
        return gone

    def clear(self) -> None:
        self._entries.clear()
