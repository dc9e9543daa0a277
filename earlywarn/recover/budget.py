"""Host RAM for in-memory snapshots: what one takes, what the budget allows, the plan ``watch()``
reports once ("snapshots every 25 steps ..., 3 clean + 1 warning copy of ~130 MB, budget ...")."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..events import Level
from .forms import local
from .hostcopy import state_bytes
from .frozen import frozen_bytes, frozen_refs
from .holders import has_state, state_view, stepper

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: int | float | str, *, available: int | None) -> int:
    """Bytes from ``snapshot_memory``: an int, ``"8GB"`` / ``"512MiB"`` / ``"20%"``, or a
    fraction of ``available`` (a float in (0, 1])."""
    if isinstance(value, bool):
        raise ValueError("use bytes (int), a size like '8GB', or a fraction of the available memory (0 < f <= 1)")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a byte count must be >= 0")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError("a float is a fraction of the available memory: 0 < f <= 1 (or pass bytes as an int)")
        if available is None:
            raise ValueError("the available memory is unknown on this machine: give bytes or a size like '8GB'")
        return int(value * available)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z%]*)\s*", value)
        if m:
            num, unit = float(m.group(1)), m.group(2).lower()
            if unit == "%":
                if not 0.0 < num <= 100.0:
                    raise ValueError("a percentage must be in (0, 100]")
                return parse_memory(num / 100.0, available=available)
            if unit in _UNITS:
                return int(num * _UNITS[unit])
        raise ValueError("not a size: use e.g. '8GB', '512MiB', '20%' or bytes as an int")
    raise ValueError(f"a {type(value).__name__}: use bytes (int), a size like '8GB', or a fraction (float)")


def available_memory() -> int | None:
    """Host memory available now (Linux: MemAvailable), else the machine's total; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


# optimizer state per parameter element, as a multiple of the parameter's bytes (estimated at
# watch(), before the first step creates it; measured at the first snapshot)
_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
                    "ASGD": 2, "Adagrad": 1, "RMSprop": 1, "SparseAdam": 2, "Adafactor": 1}


def estimate_snapshot_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of one snapshot: the model's state_dict plus the optimizer's state (measured when
    it exists; estimated from the optimizer's kind before its first step) plus the RNG states."""
    # frozen parameters are referenced, not copied (frozen.py): a LoRA base costs nothing here
    model_bytes = state_bytes(model.state_dict()) - frozen_bytes(model) + torch.get_rng_state().numel()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        model_bytes += sum(s.numel() for s in torch.cuda.get_rng_state_all())
    if has_state(optimizer):
        return model_bytes + state_bytes(state_view(optimizer).state_dict().get("state", {}))  # ZeRO-1: this rank's share
    optimizer = stepper(optimizer)  # ZeRO-1: the local optimizer, over this rank's share of the parameters
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pbytes = sum(local(p).numel() * p.element_size() for p in params)
    name = type(optimizer).__name__
    mult = _STATE_PER_PARAM.get(name, 2)
    g0 = optimizer.param_groups[0] if optimizer.param_groups else {}
    if name == "SGD":
        mult = 1 if g0.get("momentum", 0) else 0
    elif name in ("Adam", "AdamW") and g0.get("amsgrad"):
        mult = 3
    elif name == "RMSprop":
        mult = 1 + bool(g0.get("momentum", 0)) + bool(g0.get("centered"))
    return model_bytes + mult * pbytes


@dataclass
class SnapshotPlan:
    """How many snapshots the ring keeps (``clean`` + ``unclean``, 0 + 0: none fit) and why."""

    size: int
    budget: int | None
    clean: int
    unclean: int
    message: str
    level: Level

    def refit(self, measured: int) -> str | None:
        """The first snapshot measured ``measured`` bytes: shrink the plan when the budget holds
        fewer than planned; the sentence that says so, or None when nothing changes."""
        self.size = measured
        budget = self.budget
        if budget is None or measured * (self.clean + self.unclean) <= budget:
            return None
        fit = max(1, budget // max(1, measured))
        self.clean, self.unclean = (fit - 1, 1) if fit >= 2 else (1, 0)
        over = " -- over budget: raise snapshot_memory" if measured > budget else ""
        return (f"a snapshot takes {fmt_bytes(measured)} (more than estimated): the host-RAM budget "
                f"{fmt_bytes(budget)} holds {self.clean} clean{' + 1 warning copy' if self.unclean else ''}{over}")


def plan_snapshots(cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> SnapshotPlan:
    """Fit ``cfg.snapshot_keep`` clean snapshots (+ one warning copy) into the host-RAM budget
    (``cfg.snapshot_memory``; default a quarter of the memory available, shared by this node's
    processes) and say so in one sentence."""
    frozen_refs(model, optimizer)  # which frozen weights stay unwritten is counted from now (frozen.py)
    size = estimate_snapshot_bytes(model, optimizer)
    avail = available_memory()
    if cfg.snapshot_memory is None:
        procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        budget = None if avail is None else avail // 4 // procs
        how = ("no budget: the available memory is unknown" if avail is None else
               f"25% of the {fmt_bytes(avail)} available" + (f", shared by {procs} processes" if procs > 1 else ""))
    else:
        budget = parse_memory(cfg.snapshot_memory, available=avail)
        how = f"snapshot_memory={cfg.snapshot_memory!r}"
    slots = cfg.snapshot_keep + 1
    if budget is not None and size > 0:
        slots = min(slots, budget // size)
    if slots < 1:
        alt = (f"rewinds use disk checkpoints in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else
               "a collapse cannot be rewound (it halts): raise snapshot_memory or set checkpoint_dir")
        return SnapshotPlan(size, budget, 0, 0, (f"in-memory snapshots are OFF: one takes ~{fmt_bytes(size)} and the "
                                                  f"host-RAM budget is {fmt_bytes(budget or 0)} ({how}); {alt}"),
                            Level.WARNING)
    clean, unclean = (slots - 1, 1) if slots >= 2 else (1, 0)
    level, keep_msg = Level.INFO, ""
    if clean < cfg.snapshot_keep:
        keep_msg = f"; the budget holds {clean} of snapshot_keep={cfg.snapshot_keep}"
        if clean < 2:
            keep_msg += " (a rewind may lose up to twice as much): raise snapshot_memory"
            level = Level.WARNING
    lost = cfg.max_lost_steps if cfg.snapshot_every is None else 2 * cfg.every
    budget_txt = f"budget {fmt_bytes(budget)}: {how}" if budget is not None else how
    frozen = frozen_bytes(model)
    frozen_txt = f"; frozen weights ({fmt_bytes(frozen)}) are not copied" if frozen else ""
    message = (f"in-memory snapshots every {cfg.every} steps ({cfg.every_building} while an episode builds), so a "
               f"rewind loses about {lost} steps at most: {clean} clean{' + 1 warning copy' if unclean else ''} of "
               f"~{fmt_bytes(size)} each, up to {fmt_bytes((clean + unclean) * size)} of host RAM ({budget_txt})"
               f"{frozen_txt}{keep_msg}")
    return SnapshotPlan(size, budget, clean, unclean, message, level)
