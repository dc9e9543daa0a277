"""Recovery: clean snapshots / checkpoints, repair of poisoned state, PaLM-style rewind-and-skip
with an exact data position (or none, and then no replay), quarantine, blame, and the diagnosis
of instabilities that come back after a rewind.

The watcher drives it:

* ``after_step(step, clean=..., building=...)`` after every optimizer step (applied or skipped):
  the in-memory snapshot when due -- every ``max_lost_steps // 2`` steps, every
  ``max_lost_steps // 10`` while an episode builds -- and the disk checkpoint (only with
  ``checkpoint_dir``); a few integer reads on the other steps.
* ``checkpoint(step, reason)`` on a warning: a copy *now*, while parameters are still finite.
* ``repair(step)`` when state may be poisoned: scan, reset the poisoned coordinates, verify.
* ``quarantine_batch(step, reason)`` when a bad batch was skipped: it is never trained.
* ``rewind(step, reason, blame=..., onset=...)`` on a collapse a skip cannot fix: restore the
  newest clean snapshot taken before the incident began, in place; the batches that led into it
  are never trained again (quarantined); an incident that returns before a rewind held is a
  *recurrence*: diagnosed (learning rate trend) and escalated, never rewound further back.
* ``resume()`` at start-up: the latest clean disk checkpoint, data position included.

Steps are the training trajectory's: after a rewind to the snapshot of step ``s`` the next
step is ``s + 1`` again (the watcher's ``step`` goes back with it). Durations ("within
``clean_window`` steps") are counted in calls to ``after_step``, which never go back.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import torch

from ..events import Event, Kind, Level
from ._state import local, state_bytes
from .checkpoint import CheckpointInfo, CheckpointManager, is_collective, load_checkpoint
from .data import BatchFingerprints, BatchRef, DataPositionAdapter, _Unrestorable, data_position_adapter
from .errors import CheckpointError, DataPositionError, Halt
from .repair import FiniteBaseline, RepairReport, StateScan, repair_optimizer_state, scan_state
from .snapshot import Snapshot, SnapshotRing, capture_state, restore_state

SINCE_SNAPSHOT = "since_snapshot"
_RECURRENCE = ("halt", "lower_lr")


@dataclass
class RecoveryConfig:
    """How earlywarn recovers. The defaults protect a run that passes nothing: in-memory
    snapshots often enough that a rewind loses at most ``max_lost_steps`` steps, repair of
    poisoned optimizer state, a skip (no rewind) for a bad batch, a rewind on a collapse that
    never trains the batches that led into it again, and a halt with a diagnosis when the
    instability comes back after a rewind."""

    max_lost_steps: int = 50
    """A rewind should lose at most about this many steps. Sets the snapshot cadence:
    ``snapshot_every`` defaults to half of it (an incident takes some steps to show), and while
    an episode builds (alerts, elevated gradients) snapshots come five times as often."""
    snapshot_every: int | None = None
    """Steps between in-memory snapshots (host RAM; the first is taken at the first step).
    ``None``: ``max_lost_steps // 2``. 0 disables them; rewinds then need disk checkpoints."""
    snapshot_every_building: int | None = None
    """Steps between snapshots while an episode builds (an alert within ``clean_window`` steps,
    or a gradient signal elevated now). ``None``: ``snapshot_every // 5`` (at least 1)."""
    snapshot_keep: int = 3
    """Clean in-memory snapshots kept at most (one more slot holds the last warning's unclean
    copy); ``snapshot_memory`` may allow fewer."""
    snapshot_memory: int | float | str | None = None
    """Host RAM the in-memory snapshots may use, per process: bytes (int), a size (``"8GB"``,
    ``"512MiB"``, ``"20%"``) or a fraction of the memory available at ``watch()`` (float in
    (0, 1]). ``None``: 25% of the memory available at ``watch()``, shared by the processes of
    this node (``LOCAL_WORLD_SIZE``). The ring keeps as many snapshots as fit, up to
    ``snapshot_keep``; ``watch()`` reports the plan once."""
    checkpoint_dir: str | None = None
    """Directory for disk checkpoints; ``None``: no disk checkpoints. Under torch.distributed
    (world size > 1) the writer decides the layout (see ``collective_save``): per-rank writers
    (the default ``torch.save``) give each rank its own ``<checkpoint_dir>/rank<r>`` (its RNG and
    data shard differ; one writer per directory); a collective writer writes one checkpoint per
    step into ``<checkpoint_dir>`` itself, every rank its part."""
    checkpoint_every: int = 1000
    """Steps between periodic disk checkpoints (when ``checkpoint_dir`` is set)."""
    checkpoint_keep: int = 3
    """Clean disk checkpoints kept (plus the last unclean one, taken on a warning)."""
    checkpoint_async: bool = False
    """Copy state to host memory and write on a background thread."""
    save_fn: Callable[[dict[str, Any], str], None] | None = None
    """Replace ``torch.save`` (e.g. a ``torch.distributed.checkpoint`` writer): ``save_fn(payload, path)``."""
    load_fn: Callable[[str], dict[str, Any]] | None = None
    """Replace ``torch.load(weights_only=True)``: ``load_fn(path) -> payload`` as given to ``save_fn``."""
    collective_save: bool | None = None
    """Whether ``save_fn`` / ``load_fn`` are collectives that every rank calls together with the
    same path (``torch.distributed.checkpoint``: each rank writes its shards into one shared
    checkpoint; rank 0 alone commits it, see ``CheckpointManager``). ``None``: the ``collective``
    attribute of ``save_fn`` decides -- ``earlywarn.distributed.dcp_checkpoint_fns`` sets it, and
    the default ``torch.save`` writer is never collective. Needs ``checkpoint_async=False``."""
    clean_window: int = 20
    """A snapshot is clean when no warning-or-worse alert (an incident) came within this many
    steps before it; info spikes that recovered and bad batches that were skipped do not count.
    The steps after a repair or a rewind are unclean for this long too, and a rewind has *held*
    once the run trained this many steps past its incident."""
    repair: bool = True
    """Repair poisoned optimizer state (non-finite moments) in place."""
    repair_reset_state: bool = True
    """Poisoned optimizer state coordinates get the per-key reset (Adam m -> 0, v -> largest
    finite v); ``False``: copy them from the last clean snapshot when it has them."""
    repair_max_param_fraction: float = 0.01
    """Non-finite *parameter* coordinates are copied back from the last clean snapshot only
    while they are at most this share of all parameter elements; beyond, rewind."""
    rewind: bool = True
    """Rewind to the last clean snapshot on a collapse (else ``rewind()`` halts)."""
    rewind_skip_batches: int | Literal["since_snapshot"] = SINCE_SNAPSHOT
    """Batches skipped after the restored snapshot. ``"since_snapshot"``: every batch drawn
    since the snapshot (nothing that led into the incident is trained again; the data simply
    continues). An int K: the next batch after the rewind is the one K after the snapshot's
    (PaLM skipped ~200-500); K smaller than the batches since the snapshot replays some, which
    needs ``earlywarn.ResumableLoader``."""
    rewind_restore_rng: bool | None = None
    """Whether a rewind puts the global RNGs (python, numpy, torch, CUDA) back to the snapshot's.
    ``None``: only with a restorable loader (it, not the RNG, picks the batches). Without one the
    RNGs may be what draws the batches (nanoGPT: ``torch.randint``): restoring them would draw
    the same batches again, so they go on from where they are. The rewind event says which."""
    on_recurrence: str = "halt"
    """What to do when an incident comes back before the rewind for it held -- on new batches,
    so not a bad batch (likely the learning rate or another hyperparameter): ``"halt"`` with that
    diagnosis, or ``"lower_lr"``: rewind again (never further back than the episode's first
    rewind) and multiply the learning rate by ``recurrence_lr_factor`` for
    ``recurrence_lr_steps`` steps, at most ``max_rewinds`` rewinds per episode."""
    recurrence_lr_factor: float = 0.5
    """``on_recurrence="lower_lr"``: the factor (0 < f < 1); it compounds on every recurrence."""
    recurrence_lr_steps: int = 200
    """``on_recurrence="lower_lr"``: optimizer steps the lower learning rate lasts. It is
    applied around each optimizer step, so it holds whoever sets the learning rate (a
    scheduler, the loop) and the loop's own values come back afterwards."""
    max_rewinds: int = 3
    """Rewinds per episode (the first and the recurrences) before halting."""
    quarantine_path: str | None = None
    """JSONL file listing every batch that will never be trained (skipped or rewound over);
    default ``<checkpoint_dir>/quarantine.jsonl``, or ``./earlywarn_quarantine.jsonl`` without
    a checkpoint directory. Written only when a batch is quarantined."""
    fingerprint_inputs: bool = True
    """Without a restorable loader, hash the model's inputs (a forward pre-hook, on the device,
    no host sync) so that skipped and quarantined batches are named by a fingerprint;
    ``Watcher.report_batch(x)`` replaces it."""
    history: int = 4096
    """Steps for which the batch drawn is remembered (for blame and quarantine)."""

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"RecoveryConfig.{name}={getattr(self, name)!r}: {fix}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("checkpoint_every", "clean_window", "max_rewinds", "recurrence_lr_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "must be an int >= 0")
        for name in ("snapshot_keep", "checkpoint_keep", "history", "max_lost_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be an int >= 1")
        for name in ("snapshot_every", "snapshot_every_building"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < (0 if name == "snapshot_every" else 1)):
                raise bad(name, "must be None (derived from max_lost_steps) or an int >= "
                                f"{0 if name == 'snapshot_every' else 1}")
        if self.checkpoint_dir is not None and self.checkpoint_every < 1:
            raise bad("checkpoint_every", "must be >= 1 when checkpoint_dir is set")
        rsb = self.rewind_skip_batches
        if not (rsb == SINCE_SNAPSHOT or (is_int(rsb) and rsb >= 0)):
            raise bad("rewind_skip_batches", f"use {SINCE_SNAPSHOT!r} or an int >= 0")
        if isinstance(self.repair_max_param_fraction, bool) or not isinstance(self.repair_max_param_fraction, (int, float)) \
                or not 0.0 <= float(self.repair_max_param_fraction) <= 1.0:
            raise bad("repair_max_param_fraction", "must be a number between 0 and 1")
        for name in ("checkpoint_async", "repair", "repair_reset_state", "rewind", "fingerprint_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")
        for name in ("rewind_restore_rng", "collective_save"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise bad(name, "use True, False or None (None: decided for you, see the docstring)")
        if self.on_recurrence not in _RECURRENCE:
            raise bad("on_recurrence", f"use one of {', '.join(map(repr, _RECURRENCE))}")
        f = self.recurrence_lr_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < float(f) < 1.0:
            raise bad("recurrence_lr_factor", "must be a number between 0 and 1 (exclusive), e.g. 0.5")
        if self.snapshot_memory is not None:
            try:
                parse_memory(self.snapshot_memory, available=1 << 40)
            except ValueError as e:
                raise bad("snapshot_memory", str(e)) from None
        for name in ("save_fn", "load_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise bad(name, "must be callable")
        if (self.save_fn is None) != (self.load_fn is None):
            raise bad("save_fn", "give save_fn and load_fn together (a custom format needs its reader)")
        if self.collective_save and self.save_fn is None:
            raise bad("collective_save", "needs a collective save_fn/load_fn pair, e.g. "
                      "earlywarn.distributed.dcp_checkpoint_fns(model, optimizer); torch.save writes per rank")
        if self.collective and self.checkpoint_async:
            raise bad("checkpoint_async", "cannot be True with a collective save_fn: every rank must run the "
                      "collective write on its training thread; set checkpoint_async=False")
        if self.snapshot_every == 0 and self.checkpoint_dir is None and self.rewind:
            raise bad("snapshot_every", "is 0 and there is no checkpoint_dir: nothing to rewind to; "
                      "keep snapshots on, set checkpoint_dir, or set rewind=False")
        for name in ("checkpoint_dir", "quarantine_path"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, (str, os.PathLike)) or os.fspath(v) == "":
                    raise bad(name, "must be a non-empty path (str or os.PathLike), or None")
                setattr(self, name, os.fspath(v))

    @property
    def collective(self) -> bool:
        """The checkpoint writer is a collective (``collective_save``, else ``save_fn.collective``)."""
        return is_collective(self.save_fn) if self.collective_save is None else self.collective_save

    @property
    def every(self) -> int:
        """Steps between in-memory snapshots (0: none)."""
        return max(1, self.max_lost_steps // 2) if self.snapshot_every is None else self.snapshot_every

    @property
    def every_building(self) -> int:
        """Steps between in-memory snapshots while an episode builds."""
        if self.snapshot_every_building is not None:
            return min(self.snapshot_every_building, self.every) if self.every else 0
        return max(1, self.every // 5) if self.every else 0


# --------------------------------------------------------------------------------------------
# Host memory

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
    model_bytes = state_bytes(model.state_dict()) + torch.get_rng_state().numel()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        model_bytes += sum(s.numel() for s in torch.cuda.get_rng_state_all())
    if optimizer.state:
        return model_bytes + state_bytes(optimizer.state_dict()["state"])
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


# --------------------------------------------------------------------------------------------
# Records


def _name_batch(batch: BatchRef | None, step: int) -> tuple[str, bool]:
    """How to name the batch drawn for ``step``: its position when a loader knows it, else the
    step (and the fingerprint when earlywarn saw the tensors). The bool: the name says the step."""
    if batch is not None and batch.batch_index is not None:
        return str(batch), False
    fp = f" (fingerprint {batch.fingerprint})" if batch is not None and batch.fingerprint else ""
    return f"the batch drawn for step {step}{fp}", True


@dataclass(frozen=True)
class Blame:
    """Who is responsible for an incident.

    ``step`` / ``batch``: the step whose batch caused it (e.g. the last update applied before
    the loss went NaN). ``symptom_step`` / ``symptom_batch``: where it showed. ``layer``: the
    first layer with non-finite or most-escalated gradients (from the watcher's capture).
    ``role``: how ``step`` relates to the incident (``"the batch responsible"``; ``"the episode
    began with"`` for a divergence, whose cause may be a hyperparameter rather than a batch)."""

    step: int
    batch: BatchRef | None = None
    layer: str | None = None
    symptom: str | None = None
    symptom_step: int | None = None
    symptom_batch: BatchRef | None = None
    role: str = "the batch responsible"

    @property
    def message(self) -> str:
        """"the loss turned NaN at step 12 on batch 11 of epoch 0 (samples ...); the batch
        responsible was batch 10 of epoch 0 (samples ...) at step 11; first layer: fc1.weight".
        Without a loader: "...; the batch responsible was the batch drawn for step 11
        (fingerprint 0f3a...)"."""
        who, says_step = _name_batch(self.batch, self.step)
        at = "" if says_step else f" at step {self.step}"
        if self.symptom and self.symptom_step == self.step:
            if says_step:
                text = f"{self.symptom} at step {self.step}; {self.role}: {who}"
            else:
                text = f"{self.symptom} at step {self.step} on {who}, {self.role}"
        elif self.symptom and self.symptom_step is not None:
            on = ""
            if self.symptom_batch is not None and self.symptom_batch.batch_index is not None:
                on = f" on {self.symptom_batch}"
            verb = " was" if self.role.endswith("responsible") else ""
            text = f"{self.symptom} at step {self.symptom_step}{on}; {self.role}{verb} {who}{at}"
        else:
            text = f"{self.role}: {who}{at}"
        if self.layer:
            text += f"; first layer: {self.layer}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch": None if self.batch is None else self.batch.to_dict(),
            "layer": self.layer,
            "symptom": self.symptom,
            "symptom_step": self.symptom_step,
            "symptom_batch": None if self.symptom_batch is None else self.symptom_batch.to_dict(),
            "message": self.message,
        }


@dataclass(frozen=True)
class QuarantineRecord:
    """A batch that will never be trained: it was drawn after the restored snapshot (its update
    was undone), skipped over, or skipped as a bad batch. ``step`` is the step that drew it;
    the position (``epoch``, ``batch_index``, ``sample_indices``) when a loader knows it, the
    ``fingerprint`` when earlywarn saw the batch's tensors. Unknown fields are left out of the
    JSON record, never written as nulls."""

    incident_step: int
    reason: str
    epoch: int | None
    batch_index: int | None
    sample_indices: tuple[int, ...] | None
    step: int | None
    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"incident_step": self.incident_step, "reason": self.reason}
        for k in ("step", "epoch", "batch_index"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.sample_indices is not None:
            d["sample_indices"] = list(self.sample_indices)
        if self.fingerprint is not None:
            d["fingerprint"] = self.fingerprint
        return d

    @classmethod
    def from_dict(cls, q: Mapping[str, Any]) -> "QuarantineRecord":
        si = q.get("sample_indices")
        return cls(int(q["incident_step"]), str(q["reason"]), q.get("epoch"), q.get("batch_index"),
                   None if si is None else tuple(si), q.get("step"), q.get("fingerprint"))


@dataclass
class RewindReport:
    incident_step: int
    restored_step: int
    source: str
    """``"memory:<step>"`` or the checkpoint path."""
    reason: str
    attempt: int
    """1 for the episode's first rewind, 2 for the first recurrence, ... up to ``max_rewinds``."""
    quarantined: list[QuarantineRecord]
    blame: dict[str, Any] | None = None
    message: str = ""
    nonfinite: list[str] = field(default_factory=list)
    """Tensors that held NaN/Inf when the rewind began (``"name"`` or ``"name[state key]"``)."""
    rng_restored: bool = False
    """The global RNGs were put back to the snapshot's (see ``RecoveryConfig.rewind_restore_rng``)."""
    recurrence: str | None = None
    """The diagnosis, when this rewind answered an incident that came back (``on_recurrence``)."""
    lr_factor: float = 1.0
    """The learning-rate factor applied from now on (``on_recurrence="lower_lr"``)."""

    @property
    def lost_steps(self) -> int:
        """Optimizer steps of training this rewind threw away."""
        return self.incident_step - self.restored_step

    @property
    def resume_step(self) -> int:
        """The step the next ``optimizer.step()`` is (what the watcher's ``step`` is now)."""
        return self.restored_step + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "incident_step": self.incident_step,
            "nonfinite": list(self.nonfinite),
            "restored_step": self.restored_step,
            "lost_steps": self.lost_steps,
            "source": self.source,
            "reason": self.reason,
            "attempt": self.attempt,
            "rng_restored": self.rng_restored,
            "recurrence": self.recurrence,
            "lr_factor": self.lr_factor,
            "quarantined": [q.to_dict() for q in self.quarantined],
            "blame": self.blame,
            "message": self.message,
        }


def _ranges(refs: list[QuarantineRecord]) -> str:
    """'epoch 0 batches 12-14, epoch 1 batch 0', or by step when no loader knows the batches:
    '3 batches, drawn for steps 101-103 (fingerprints in the quarantine file)'."""
    if not refs:
        return "no batches"
    if refs[0].batch_index is None:
        steps = sorted(r.step for r in refs if r.step is not None)
        n = len(refs)
        what = f"{n} batch{'es' if n != 1 else ''}"
        if steps:
            span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            what += f", drawn for {span}"
        fps = sum(r.fingerprint is not None for r in refs)
        if fps:
            what += " (fingerprint" + (f" {refs[0].fingerprint}" if n == 1 else "s in the quarantine file") + ")"
        return what
    out, start, prev = [], refs[0], refs[0]
    for r in refs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r.epoch == prev.epoch and r.batch_index == (prev.batch_index or 0) + 1:
            prev = r
            continue
        span = f"{start.batch_index}" if start is prev else f"{start.batch_index}-{prev.batch_index}"
        out.append(f"epoch {start.epoch} batch{'es' if start is not prev else ''} {span}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def _distributed_rank() -> int | None:
    """This process's rank when torch.distributed runs with more than one process, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


def _plain(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)


def _blame_dict(blame: Mapping[str, Any] | Blame | None) -> dict[str, Any] | None:
    """A JSON-ready blame record with a ``message``. Accepts a :class:`Blame` or a dict with
    any of ``step``, ``batch``, ``layer``, ``first_alert_step``, ``first_alert_batch``,
    ``symptom``, ``symptom_step``, ``symptom_batch`` (BatchRef values allowed)."""
    if blame is None:
        return None
    if isinstance(blame, Blame):
        return blame.to_dict()
    d = dict(blame)
    if "message" not in d and "step" in d:
        if d.get("first_alert_step") is not None and d["first_alert_step"] != d["step"]:
            b = Blame(step=int(d["first_alert_step"]), batch=_as_ref(d.get("first_alert_batch")),
                      layer=d.get("layer"), symptom=d.get("symptom") or "the incident",
                      symptom_step=int(d["step"]), symptom_batch=_as_ref(d.get("batch")))
        else:
            b = Blame(step=int(d["step"]), batch=_as_ref(d.get("batch")), layer=d.get("layer"),
                      symptom=d.get("symptom"), symptom_step=d.get("symptom_step"),
                      symptom_batch=_as_ref(d.get("symptom_batch")))
        d["message"] = b.message
    return _plain(d)


def _as_ref(x: Any) -> BatchRef | None:
    if x is None or isinstance(x, BatchRef):
        return x
    if isinstance(x, Mapping) and ("batch_index" in x or "fingerprint" in x):
        si = x.get("sample_indices")
        return BatchRef(x.get("epoch"), x.get("batch_index"), None if si is None else tuple(si), x.get("fingerprint"))
    if isinstance(x, int):
        return BatchRef(None, x, None)
    return None


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _fmt_lr(lr: float | None) -> str:
    return "?" if lr is None else f"{lr:.3g}"


@dataclass
class _Episode:
    """Rewinds for one instability, from the first until one holds (the run trains
    ``clean_window`` steps past the latest incident without another)."""

    first_incident: int
    first_target: int
    first_reason: str
    rewinds: int = 1
    last_incident: int = 0
    last_target: int = 0
    lr_factor: float = 1.0
    quarantined: list[str] = field(default_factory=list)
    """Keys of the batches quarantined by this episode's rewinds (fingerprints / positions)."""
    lr_path: dict[int, float] = field(default_factory=dict)
    """The learning rate per step on the first way up to the first incident."""

    def to_dict(self) -> dict[str, Any]:
        return {"first_incident": self.first_incident, "first_target": self.first_target,
                "first_reason": self.first_reason, "rewinds": self.rewinds,
                "last_incident": self.last_incident, "last_target": self.last_target,
                "lr_factor": self.lr_factor, "quarantined": list(self.quarantined),
                "lr_path": {str(k): v for k, v in self.lr_path.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "_Episode":
        return cls(int(d["first_incident"]), int(d["first_target"]), str(d["first_reason"]), int(d["rewinds"]),
                   int(d["last_incident"]), int(d["last_target"]), float(d["lr_factor"]),
                   list(d.get("quarantined", [])), {int(k): float(v) for k, v in d.get("lr_path", {}).items()})


def _record_key(q: QuarantineRecord) -> str | None:
    if q.batch_index is not None:
        return f"{q.epoch}:{q.batch_index}"
    return q.fingerprint


class Recovery:
    """The recovery layer for one model / optimizer pair (see the module docstring).

    ``loader``: an :class:`~earlywarn.ResumableLoader`, a torchdata ``StatefulDataLoader``, or
    anything else (a plain ``DataLoader`` / ``None``: rewinds then skip the batches since the
    snapshot without knowing which samples they held -- they are named by step and fingerprint
    -- and anything that needs to *move* the data refuses with the fix named). ``extra_state``:
    more objects with ``state_dict`` / ``load_state_dict`` (the detector, the loop's own
    counters) saved and restored with the rest. ``keep_on_rewind``: names in ``extra_state``
    that a rewind must not roll back (counters that have to remember the rewind itself, e.g.
    the policy's rate limits); they are still saved and resumed. ``emit``: receives every event
    (repair, checkpoint, rewind, quarantine, resume).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: RecoveryConfig | None = None,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        extra_state: Mapping[str, Any] | None = None,
        keep_on_rewind: Iterable[str] = (),
        emit: Callable[[Event], None] = lambda e: None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config if config is not None else RecoveryConfig()
        self.scheduler = scheduler
        self.scaler = scaler
        self.extra_state = dict(extra_state or {})
        for k, v in self.extra_state.items():
            if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict")):
                raise TypeError(f"extra_state[{k!r}] ({type(v).__name__}) needs state_dict() and load_state_dict()")
        self.keep_on_rewind = frozenset(keep_on_rewind)
        unknown = sorted(self.keep_on_rewind - set(self.extra_state))
        if unknown:
            raise ValueError(f"keep_on_rewind names {unknown}, which are not in extra_state ({sorted(self.extra_state)})")
        self.emit = emit
        adapter = data_position_adapter(loader)
        self.data: DataPositionAdapter = adapter if adapter is not None else _Unrestorable(
            "no data loader was given (earlywarn.watch(..., loader=...)): pass an earlywarn.ResumableLoader "
            "or a torchdata StatefulDataLoader so that positions can be restored"
        )
        cfg = self.config
        rank = _distributed_rank()
        ckpt_dir = None
        if cfg.checkpoint_dir is not None:
            ckpt_dir = Path(cfg.checkpoint_dir)
            if rank is not None and not cfg.collective:
                ckpt_dir = ckpt_dir / f"rank{rank}"  # per-rank writer: one writer per directory
        self.ring = SnapshotRing(cfg.snapshot_keep, keep_unclean=1) if cfg.every > 0 else None
        self.checkpoints = (
            CheckpointManager(ckpt_dir, keep=cfg.checkpoint_keep, keep_unclean=1,
                              async_write=cfg.checkpoint_async, save_fn=cfg.save_fn, load_fn=cfg.load_fn,
                              collective=cfg.collective)
            if ckpt_dir is not None else None
        )
        if cfg.quarantine_path is not None:
            self.quarantine_path: Path = Path(cfg.quarantine_path)
        elif ckpt_dir is not None:
            self.quarantine_path = ckpt_dir / (f"quarantine.rank{rank}.jsonl" if cfg.collective and rank is not None
                                               else "quarantine.jsonl")
        else:
            self.quarantine_path = Path.cwd() / ("earlywarn_quarantine.jsonl" if rank is None
                                                 else f"earlywarn_quarantine.rank{rank}.jsonl")
        # the model's own non-finite values (a -inf causal mask buffer), as of now: not poison
        self.baseline = FiniteBaseline.capture(model)
        self.fingerprints = BatchFingerprints(cfg.history)
        self._history: OrderedDict[int, BatchRef | None] = OrderedDict()
        self._last_step_seen: int | None = None  # last after_step(step): the state's step
        self._drawn_mark = self.data.drawn()  # batches drawn as of that step (None: unknown)
        self._last_snapshot_step: int | None = None
        self._last_checkpoint_step = 0  # disk checkpoints at checkpoint_every, 2x, ... (or after a resume)
        self._tick = 0  # after_step calls: a clock that never goes back
        self._incident_tick: int | None = None  # the last repair or rewind, on that clock
        self._episode: _Episode | None = None
        self._lr: deque[tuple[int, float | None]] = deque(maxlen=cfg.history)  # (step, lr of group 0)
        self._lr_cut: list[float] | None = None  # [factor, steps left]
        self._log: deque[tuple[int, int, str]] = deque(maxlen=8)  # (incident, restored, reason) of recent rewinds
        self.rewinds = 0
        self.repairs = 0
        self.quarantine: list[QuarantineRecord] = []
        self._quarantined_steps: set[int] = set()  # steps of this trajectory whose batch is quarantined already
        self.snapshot_bytes = 0
        self.snapshot_budget: int | None = None
        self._measured = False
        self.plan, self._plan_level = self._plan()

    # -- the memory plan -----------------------------------------------------------------------
    def _plan(self) -> tuple[str, Level]:
        """Fit the ring into the host-RAM budget; the sentence ``watch()`` reports once."""
        cfg = self.config
        if self.ring is None:
            where = f"disk checkpoints in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else "nothing (rewind=False)"
            return f"in-memory snapshots are off (snapshot_every=0): rewinds use {where}", Level.INFO
        self.snapshot_bytes = size = estimate_snapshot_bytes(self.model, self.optimizer)
        avail = available_memory()
        if cfg.snapshot_memory is None:
            procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
            budget = None if avail is None else avail // 4 // procs
            how = ("no budget: the available memory is unknown" if avail is None else
                   f"25% of the {fmt_bytes(avail)} available" + (f", shared by {procs} processes" if procs > 1 else ""))
        else:
            budget = parse_memory(cfg.snapshot_memory, available=avail)
            how = f"snapshot_memory={cfg.snapshot_memory!r}"
        self.snapshot_budget = budget
        slots = cfg.snapshot_keep + 1
        if budget is not None and size > 0:
            slots = min(slots, budget // size)
        keep_msg = ""
        level = Level.INFO
        if slots < 1:
            self.ring = None
            alt = (f"rewinds use disk checkpoints in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else
                   "a collapse cannot be rewound (it halts): raise snapshot_memory or set checkpoint_dir")
            return (f"in-memory snapshots are OFF: one takes ~{fmt_bytes(size)} and the host-RAM budget is "
                    f"{fmt_bytes(budget or 0)} ({how}); {alt}"), Level.WARNING
        clean, unclean = (slots - 1, 1) if slots >= 2 else (1, 0)
        self.ring.set_capacity(clean, unclean)
        if clean < cfg.snapshot_keep:
            keep_msg = f"; the budget holds {clean} of snapshot_keep={cfg.snapshot_keep}"
            if clean < 2:
                keep_msg += " (a rewind may lose up to twice as much): raise snapshot_memory"
                level = Level.WARNING
        total = (clean + unclean) * size
        budget_txt = f"budget {fmt_bytes(budget)}: {how}" if budget is not None else how
        lost = cfg.max_lost_steps if cfg.snapshot_every is None else 2 * cfg.every
        return (f"in-memory snapshots every {cfg.every} steps ({cfg.every_building} while an episode builds), so a "
                f"rewind loses about {lost} steps at most: {clean} clean"
                f"{' + 1 warning copy' if unclean else ''} of ~{fmt_bytes(size)} each, up to {fmt_bytes(total)} of "
                f"host RAM ({budget_txt}){keep_msg}"), level

    def report_plan(self, step: int = 0) -> None:
        """Emit the snapshot plan (the watcher does, once, when its sinks exist)."""
        self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=self._plan_level, message=self.plan,
                        signal="snapshot_plan",
                        values={"snapshot_bytes": float(self.snapshot_bytes),
                                "budget_bytes": math.nan if self.snapshot_budget is None else float(self.snapshot_budget),
                                "snapshots": 0.0 if self.ring is None else float(self.ring.keep + self.ring.keep_unclean)}))

    def _check_budget(self, snap: Snapshot, step: int) -> None:
        """The first snapshot measures what the estimate guessed; shrink the ring if it must."""
        if self._measured or self.ring is None:
            return
        self._measured = True
        size = snap.nbytes
        self.snapshot_bytes = size
        budget = self.snapshot_budget
        slots = self.ring.keep + self.ring.keep_unclean
        if budget is None or size * slots <= budget:
            return
        fit = max(1, budget // max(1, size))
        clean, unclean = (fit - 1, 1) if fit >= 2 else (1, 0)
        self.ring.set_capacity(clean, unclean)
        self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.WARNING, signal="snapshot_plan",
                        message=(f"a snapshot takes {fmt_bytes(size)} (more than estimated): the host-RAM budget "
                                 f"{fmt_bytes(budget)} holds {clean} clean{' + 1 warning copy' if unclean else ''}"
                                 + (" -- over budget: raise snapshot_memory" if fit < 1 or size > budget else "")),
                        values={"snapshot_bytes": float(size), "budget_bytes": float(budget)}))

    # -- per step ------------------------------------------------------------------------------
    def _clean(self, clean: bool) -> bool:
        if not clean:
            return False
        return self._incident_tick is None or self._tick - self._incident_tick > self.config.clean_window

    @property
    def lr_factor(self) -> float:
        """The factor applied to the learning rate now (1.0 unless ``on_recurrence="lower_lr"`` acts)."""
        return 1.0 if self._lr_cut is None else float(self._lr_cut[0])

    def after_step(self, step: int, *, clean: bool, building: bool = False) -> None:
        """Call after every optimizer step (applied or skipped). ``clean``: no incident within
        ``config.clean_window`` steps. ``building``: an episode may be building (recent alerts,
        elevated gradients): snapshots come at ``every_building``. Takes the periodic snapshot /
        checkpoint when due and clean (a due one waits for the first clean step)."""
        cfg = self.config
        self._tick += 1
        self.data.observe()
        self._history[step] = self.data.last_batch()
        self._history.move_to_end(step)
        self._last_step_seen = step
        self._drawn_mark = self.data.drawn()
        while len(self._history) > cfg.history:
            self._history.popitem(last=False)
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        self._lr.append((step, float(lr) if isinstance(lr, (int, float)) else None))
        if self._lr_cut is not None:
            self._lr_cut[1] -= 1
            if self._lr_cut[1] <= 0:
                self._lr_cut = None
                self.emit(Event(step=step, kind=Kind.REWIND, level=Level.INFO, signal="lr_factor",
                                message=f"the lowered learning rate ended after {cfg.recurrence_lr_steps} steps: "
                                        "the optimizer steps at the loop's learning rate again",
                                values={"lr_factor": 1.0}))
        clean = self._clean(clean)
        ep = self._episode
        if ep is not None and clean and step >= ep.last_incident + cfg.clean_window:
            self._episode = None  # trained past the incident: the rewind held
        last = self._last_snapshot_step
        every = cfg.every_building if building else cfg.every
        snap_due = self.ring is not None and (last is None or step - last >= every or step < last)
        ckpt_due = self.checkpoints is not None and step - self._last_checkpoint_step >= cfg.checkpoint_every
        if not (snap_due or ckpt_due) or not clean:
            return
        # a snapshot is only clean if nothing in it is poisoned: one scan (one host read) per snapshot.
        # Poisoned state that no alert caught is repaired and the snapshot waits.
        scan = scan_state(self.model, self.optimizer, self.baseline)
        if not scan.clean:
            if cfg.repair:
                self.repair(step, scan=scan)
            else:
                self._incident_tick = self._tick
            return
        snap = self._capture(step, clean=True, reason="building" if building else "periodic", to_ring=snap_due,
                             building=building)
        if snap_due:
            self._last_snapshot_step = step
            self.baseline.refresh(self.model)  # the last known-good buffers (new or resized ones)
            self._check_budget(snap, step)
        if ckpt_due:
            self._save_disk(snap, step, clean=True, reason="periodic")
            self._last_checkpoint_step = step

    def _data_state(self, pending: int = 0) -> dict[str, Any] | None:
        return self.data.state_dict(pending) if self.data.restorable else None

    def _pending(self) -> int:
        """Batches drawn since the last after_step: their update is not in the live state."""
        now = self.data.drawn()
        if now is None or self._drawn_mark is None:
            return 0
        return max(0, now - self._drawn_mark)

    def _capture(self, step: int, *, clean: bool, reason: str, to_ring: bool, pending: int = 0,
                 building: bool = False) -> Snapshot:
        kw = dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                  scaler=self.scaler, data=self._data_state(pending), extra=self.extra_state)
        if to_ring and self.ring is not None:
            return self.ring.capture(step, clean=clean, reason=reason, building=building, **kw)
        return Snapshot(step=step, clean=clean, reason=reason, host=capture_state(step, **kw), building=building)

    def _save_disk(self, snap: Snapshot, step: int, *, clean: bool, reason: str) -> str:
        assert self.checkpoints is not None
        snap.host.tree["recovery"] = self.state_dict()
        snap.pinned += 1

        def done() -> None:
            snap.pinned -= 1

        path = self.checkpoints.save(snap.host, step, clean=clean, reason=reason, on_done=done)
        self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                        message=f"checkpoint ({reason}{', clean' if clean else ''}) -> {path}",
                        signal=reason, values={"clean": float(clean)}))
        return path

    def checkpoint(self, step: int, reason: str) -> str | None:
        """Save now, e.g. on a warning while parameters are still finite. Kept as *unclean*
        (an alert came): used as a rewind target only when no clean one exists.

        Call it either before step ``step``'s update (the watcher does: the batch drawn for it
        is then recorded as not yet trained, and the snapshot is labelled ``step - 1``) or after
        ``after_step(step)`` (labelled ``step``). Returns the disk path, or ``"memory:<step>"``
        without a checkpoint directory, or ``None`` when snapshots and checkpoints are off."""
        if self.ring is None and self.checkpoints is None:
            return None
        if self._last_step_seen == step:
            label, pending = step, 0
        else:
            label, pending = step - 1, self._pending()
        snap = self._capture(label, clean=False, reason=reason, to_ring=self.ring is not None, pending=pending)
        if self.checkpoints is not None:
            return self._save_disk(snap, label, clean=False, reason=reason)
        self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                        message=f"in-memory snapshot ({reason}) of the state after step {label}", signal=reason,
                        values={"clean": 0.0}))
        return f"memory:{label}"

    # -- blame -----------------------------------------------------------------------------
    def batch_at(self, step: int) -> BatchRef | None:
        """The batch drawn for ``step`` (for the step in progress: the batch just drawn), with
        its fingerprint when known (one host read)."""
        ref: BatchRef | None
        if step in self._history:
            ref = self._history[step]
        else:
            last = max(self._history) if self._history else None
            if last is None or step > last:
                self.data.observe()
                ref = self.data.last_batch()
            else:
                ref = None
        fp = self.fingerprints.read([step]).get(step) if self.fingerprints.has(step) else None
        if ref is None:
            return BatchRef(None, None, None, fp) if fp else None
        return ref.with_fingerprint(fp)

    def blame(
        self,
        step: int,
        *,
        layer: str | None = None,
        symptom: str | None = None,
        symptom_step: int | None = None,
        role: str = "the batch responsible",
    ) -> Blame:
        """Name the batch of ``step`` as responsible, e.g. ``blame(t, layer="h.3.attn",
        symptom="the loss turned NaN", symptom_step=t + 1)``."""
        return Blame(
            step=step,
            batch=self.batch_at(step),
            layer=layer,
            symptom=symptom,
            symptom_step=symptom_step,
            symptom_batch=None if symptom_step is None or symptom_step == step else self.batch_at(symptom_step),
            role=role,
        )

    def last_batch(self) -> BatchRef | None:
        """The batch most recently drawn from the loader (``None`` when unknown)."""
        self.data.observe()
        return self.data.last_batch()

    def quarantine_batch(self, step: int, reason: str, *, note: str = "") -> QuarantineRecord:
        """A bad batch was skipped at ``step``: record it (JSONL + event) as never trained.
        ``note``: what the event adds (why it is the batch's fault, what was done)."""
        ref = self.batch_at(step)
        rec = QuarantineRecord(step, reason, None if ref is None else ref.epoch, None if ref is None else ref.batch_index,
                               None if ref is None else ref.sample_indices, step,
                               None if ref is None else ref.fingerprint)
        self._write_quarantine([rec])
        self.quarantine.append(rec)
        self._quarantined_steps.add(step)
        self.emit(Event(step=step, kind=Kind.QUARANTINE, level=Level.WARNING, signal=reason,
                        message=f"quarantined {_name_batch(ref, step)[0]}: {reason}{note}; it is never trained -> "
                                f"{self.quarantine_path}",
                        values={"batches": 1.0}, batch=rec.batch_index))
        return rec

    # -- repair ----------------------------------------------------------------------------
    def scan(self) -> StateScan:
        """Poisoned values in parameters, buffers and optimizer state (one host read); the
        model's own non-finite values (see :class:`~earlywarn.recover.FiniteBaseline`) are not."""
        return scan_state(self.model, self.optimizer, self.baseline)

    def repair(self, step: int, *, scan: StateScan | None = None, incident: bool = True) -> RepairReport:
        """Scan parameters, buffers and optimizer state (or use ``scan``, taken just before);
        reset poisoned optimizer coordinates (see :mod:`earlywarn.recover.repair`), copy poisoned
        parameter and buffer coordinates back from the last clean snapshot (buffers: from the
        copy taken at ``watch()`` before the first snapshot exists), verify.
        ``report.needs_rewind``: parameters could not be fixed. ``incident``: the steps after it
        are unclean for ``clean_window`` (a bad batch's poisoned buffers are not an incident)."""
        scan = scan if scan is not None else self.scan()
        if scan.clean:
            return RepairReport(scan, [], [], scan, step)
        if not self.config.repair:
            report = RepairReport(scan, [], [], scan, step)
        else:
            snap: Any = self.ring.latest(clean_only=True) if self.ring is not None else None
            if snap is None and self.baseline.copies:
                snap = {"model": self.baseline.copies}
            report = repair_optimizer_state(
                self.optimizer, scan, snapshot=snap, reset_state=self.config.repair_reset_state,
                max_param_fraction=self.config.repair_max_param_fraction, model=self.model, step=step,
                baseline=self.baseline,
            )
            self.repairs += 1
            if incident:
                self._incident_tick = self._tick
        values = {"tensors": float(len(scan.flags)), "elements": float(sum(f.nonfinite for f in scan.flags)),
                  "ok": float(report.ok)}
        self.emit(Event(step=step, kind=Kind.REPAIR, level=Level.WARNING if report.ok else Level.CRITICAL,
                        message=report.summary() if self.config.repair else "repair disabled: " + scan.summary(),
                        signal="optimizer_state", layers=tuple(dict.fromkeys(f.name for f in scan.flags)),
                        values=values))
        return report

    # -- rewind ----------------------------------------------------------------------------
    def _candidates(self, before: int) -> list[tuple[int, bool, Any]]:
        """(step, clean, source) newest first; memory before disk at equal steps."""
        out: list[tuple[int, bool, int, Any]] = []
        if self.ring is not None:
            out += [(s.step, s.clean, 1, s) for s in self.ring.entries if s.step < before]
        if self.checkpoints is not None:
            self.checkpoints.wait()
            out += [(c.step, c.clean, 0, c) for c in self.checkpoints.list() if c.step < before]
        out.sort(key=lambda x: (x[0], x[2]), reverse=True)
        return [(s, c, src) for s, c, _, src in out]

    def _pick_target(self, step: int, onset: int | None, floor: int | None,
                     poisoned: bool = False) -> tuple[int, bool, Any, str] | None:
        """The newest clean snapshot taken before the incident began. Step ``onset`` was the
        first abnormal one, so the state it computed its gradient on (``onset - 1``) is suspect
        too when the incident is a divergence of finite values: then at most ``onset - 2``.
        When it left NaN/Inf behind (``poisoned``), the scan every snapshot passed proves the
        state of ``onset - 1`` finite: that one will do. ``floor``: the episode's first rewind
        target, never gone past without saying why. The str: why another one, if so."""
        cands = self._candidates(step)
        if not cands:
            return None
        limit = step if onset is None else min(step, onset if poisoned else onset - 1)
        pre = [c for c in cands if c[0] < limit]

        def pick(pool: list[tuple[int, bool, Any]]) -> tuple[int, bool, Any] | None:
            return next((c for c in pool if c[1]), None) or (pool[0] if pool else None)

        if floor is not None:
            c = pick([c for c in pre if c[0] >= floor])
            if c is not None:
                return (*c, "")
            later = [c for c in cands if c[0] >= floor]
            if later:
                c = next((x for x in reversed(later) if x[1]), later[-1])  # the one closest to the floor
                return (*c, f"the instability came back {max(0, (onset or step) - c[0])} steps after step {c[0]}, "
                            f"before any newer snapshot; restoring step {c[0]} again (a rewind never goes further "
                            f"back than the episode's first, step {floor})")
            c = pick(cands)
            assert c is not None
            return (*c, f"the snapshot of step {floor} (the episode's first rewind) is gone; going further back, "
                        f"to step {c[0]}")
        c = pick([c for c in pre if c[1]])
        if c is not None:
            return (*c, "")
        c = pick(pre)
        if c is not None:
            return (*c, f"no clean snapshot before the incident began (step {onset}); the copy taken at the warning")
        c = pick(cands)
        assert c is not None
        began = f"the incident began at step {onset}" if onset is not None else "the incident"
        return (*c, f"no snapshot from before {began}; step {c[0]} is the newest one")

    def _halt(self, step: int, message: str, reason: str) -> Halt:
        # no HALT event here: whoever catches the Halt reports it once (the watcher does)
        return Halt(message, step=step, reason=reason)

    def _live_lr(self) -> float | None:
        if not self.optimizer.param_groups:
            return None
        lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            return float(lr.detach().reshape(-1)[0])  # rare path: a host read is fine here
        return float(lr) if isinstance(lr, (int, float)) else None

    def _keys(self, steps: list[int]) -> list[str | None]:
        """What identifies the batches of ``steps`` (a position, else a fingerprint; one host read)."""
        fps = self.fingerprints.read(steps)
        out: list[str | None] = []
        newest = max(self._history) if self._history else None
        for s in steps:
            ref = self._history.get(s)
            if ref is None and (newest is None or s > newest):
                ref = self.data.last_batch()  # the step in progress drew the loader's latest batch
            if ref is not None and ref.batch_index is not None:
                out.append(f"{ref.epoch}:{ref.batch_index}")
            else:
                out.append(fps.get(s))
        return out

    def lr_trend(self, step: int) -> str:
        """'learning rate (param group 0): 0.001 at step 125 (restored) -> 0.0024 at step 152
        (first incident) -> 0.0025 at step 160 (now), rising' for the open episode."""
        ep = self._episode
        now = self._live_lr()
        if ep is None:
            return f"learning rate (param group 0): {_fmt_lr(now)} at step {step}"
        at_target = ep.lr_path.get(ep.first_target)
        at_first = ep.lr_path.get(ep.first_incident)
        text = (f"learning rate (param group 0): {_fmt_lr(at_target)} at step {ep.first_target} (restored) -> "
                f"{_fmt_lr(at_first)} at step {ep.first_incident} (first incident) -> {_fmt_lr(now)} at step {step} (now)")
        if self._lr_cut is not None:
            text += f" (earlywarn applies {self.lr_factor:g}x of it)"
        ref = at_target if at_target else at_first
        if now is not None and ref:
            trend = "rising" if now > 1.05 * ref else "falling" if now < 0.95 * ref else "flat"
            text += f", {trend}"
            before = ep.lr_path.get(step)
            if before and now > 1.05 * before:
                text += (f"; the loop's learning rate did not go back with the rewind ({_fmt_lr(now)} at step {step} "
                         f"now, {_fmt_lr(before)} there before): recompute it from ew.step, ew.on_rewind(...) or an "
                         "earlywarn.LoopState in extra_state")
            elif trend == "flat":
                text += (": not the schedule -- look at the learning rate itself or another hyperparameter (warmup, "
                         "weight decay, batch size, clipping, the loss scale)")
        return text

    def _diagnose(self, step: int, reason: str) -> str:
        ep = self._episode
        assert ep is not None
        since = max(0, step - ep.last_target)
        window = list(range(ep.last_target + 1, step + 1))
        keys = self._keys(window)
        known = [k for k in keys if k is not None]
        quarantined = set(ep.quarantined)
        replayed = sum(k in quarantined for k in known)
        if replayed:
            data = (f"{replayed} of the batches since the rewind were ones it had quarantined (they were replayed): "
                    "the data may be at fault")
        else:
            how = (f"none of the {len(quarantined)} quarantined batches came back" if known and quarantined else
                   "the global RNGs were not restored, so they were fresh draws" if not self.data.restorable else
                   "the loader moved past the quarantined ones")
            data = (f"on new batches ({how}), so it is not a bad batch: likely the learning rate or another "
                    "hyperparameter")
        return (f"recurrence: {reason} at step {step}, {since} steps after the rewind to step {ep.last_target} "
                f"(the first incident: {ep.first_reason} at step {ep.first_incident}), {data}. {self.lr_trend(step)}.")

    def recurrence(self, step: int, reason: str) -> str | None:
        """The diagnosis of an incident at ``step`` if it is a recurrence (a rewind's episode is
        still open: it has not held yet), else ``None``."""
        return None if self._episode is None else self._diagnose(step, reason)

    def describe_rewinds(self) -> str:
        """The recent rewinds, for a halt message: 'at step 152 (loss_diverged) to step 125, ...'."""
        if not self._log:
            return "no rewinds yet"
        return ", ".join(f"at step {i} ({r}) to step {t}" for i, t, r in self._log)

    def rewind(
        self,
        step: int,
        reason: str,
        *,
        blame: Mapping[str, Any] | Blame | None = None,
        onset: int | None = None,
    ) -> RewindReport:
        """Restore the newest clean snapshot taken before the incident began (``onset``: its
        first abnormal step; default ``step``) -- memory first, then disk -- in place: model,
        optimizer, scheduler, scaler, ``extra_state``, and the global RNGs only when a
        restorable loader picks the batches (``rewind_restore_rng``). Then move the data past
        the skipped batches, quarantine them (event + JSONL), and set gradients to ``None``
        (the current step's gradients belong to the abandoned trajectory: do not apply them).

        An incident before the previous rewind held is a recurrence: diagnosed and escalated
        per ``on_recurrence`` (halt, or rewind again no further back than the episode's first
        target and lower the learning rate). Raises :class:`Halt` then, when nothing to rewind
        to exists, or when the data cannot be moved as configured. The caller continues
        training at ``report.resume_step`` (the optimizer and scheduler are at that step)."""
        cfg = self.config
        blame_d = _blame_dict(blame)
        if not cfg.rewind:
            raise self._halt(step, f"{reason} at step {step}; rewinding is disabled (RecoveryConfig.rewind=False): "
                                   "halting. Enable it, or resume from a checkpoint after fixing the cause.", "rewind_disabled")
        ep = self._episode
        diagnosis = None
        if ep is not None:
            diagnosis = self._diagnose(step, reason)
            if cfg.on_recurrence == "halt":
                raise self._halt(step, f"{diagnosis} Halting (RecoveryConfig.on_recurrence='halt'): resume from the last "
                                       "clean checkpoint with a lower learning rate, or set on_recurrence='lower_lr' to "
                                       f"rewind and go on at {cfg.recurrence_lr_factor:g}x the learning rate for "
                                       f"{cfg.recurrence_lr_steps} steps.", "recurrence")
            if ep.rewinds >= cfg.max_rewinds:
                raise self._halt(step, f"{diagnosis} Halting: {ep.rewinds} rewinds in this episode (max_rewinds="
                                       f"{cfg.max_rewinds}), the last at {ep.lr_factor:g}x the learning rate, did not hold. "
                                       "Resume from the last clean checkpoint with a lower learning rate.",
                                 "rewinds_exhausted")
        pre = self.scan()  # what the incident left (rare path: one read)
        target = self._pick_target(step, onset, ep.first_target if ep is not None else None, poisoned=not pre.clean)
        if target is None:
            raise self._halt(step, f"{reason} at step {step}; no snapshot or checkpoint to rewind to (the first "
                                   "snapshot is taken at the first after_step): halting.", "no_clean_snapshot")
        t_step, t_clean, src, why = target
        if isinstance(src, Snapshot):
            state, source = src.state, f"memory:{src.step}"
        else:
            assert self.checkpoints is not None and isinstance(src, CheckpointInfo)
            state, source = self.checkpoints.load(src)["state"], str(src.path)
        skip = None if cfg.rewind_skip_batches == SINCE_SNAPSHOT else int(cfg.rewind_skip_batches)
        if skip is not None and not self.data.restorable:
            raise self._halt(step, f"{reason} at step {step}; cannot rewind with rewind_skip_batches={skip}: "
                                   f"{self.data.why_not}", "data_position")
        if blame_d is not None and not blame_d.get("layer") and pre.first_layer:
            blame_d["layer"] = pre.first_layer
            blame_d["message"] = f"{blame_d.get('message', '')}; first non-finite layer: {pre.first_layer}".lstrip("; ")
        if ep is None:  # the learning rate on the way up, for a recurrence's diagnosis
            lr_path = {s: lr for s, lr in self._lr if t_step <= s <= step and lr is not None}
            live = self._live_lr()
            if live is not None:
                lr_path[step] = live
        # move the data first: a refusal must leave the model untouched
        try:
            refs = self.data.rewind(state.get("data"), skip)
        except DataPositionError as e:
            raise self._halt(step, f"{reason} at step {step}; cannot rewind the data exactly: {e}", "data_position") from e
        rng = cfg.rewind_restore_rng if cfg.rewind_restore_rng is not None else self.data.restorable
        restore_state(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                      scaler=self.scaler, rng=rng,
                      extra={k: v for k, v in self.extra_state.items() if k not in self.keep_on_rewind})
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

        records = self._quarantine_records(refs, t_step, step, reason)
        self.rewinds += 1
        self._log.append((step, t_step, reason))
        if ep is None:
            ep = self._episode = _Episode(step, t_step, reason, 1, step, t_step, 1.0, [], lr_path)
        else:
            ep.rewinds += 1
            ep.last_incident = max(ep.last_incident, step)
            ep.last_target = t_step
            ep.lr_factor *= cfg.recurrence_lr_factor
            self._lr_cut = [ep.lr_factor, float(cfg.recurrence_lr_steps)]
        ep.quarantined += [k for k in map(_record_key, records) if k is not None]
        self._incident_tick = self._tick
        self._last_snapshot_step = t_step
        self._last_checkpoint_step = min(self._last_checkpoint_step, t_step)
        if self.ring is not None:
            self.ring.drop_after(t_step)
        if self.checkpoints is not None:
            self.checkpoints.discard_after(t_step)
        for s in [s for s in self._history if s > t_step]:
            del self._history[s]
        self.fingerprints.drop_after(t_step)
        self._quarantined_steps = {s for s in self._quarantined_steps if s <= t_step}
        self._last_step_seen = None
        self._drawn_mark = self.data.drawn()
        self._write_quarantine(records)
        self.quarantine.extend(records)

        kind_txt = "clean" if t_clean else "unclean"
        lost = step - t_step
        if rng:
            rng_txt = f"the global RNGs were restored to step {t_step} (the loader, not the RNG, picks the batches)"
        elif self.data.restorable:
            rng_txt = "the global RNGs were not restored (rewind_restore_rng=False)"
        else:
            rng_txt = ("the global RNGs were not restored: without a restorable loader they may be what draws the "
                       "batches, so they go on from where they are and the batches that follow are new ones")
        msg = (f"{reason} at step {step}: rewound to the {kind_txt} state of step {t_step} ({source}), "
               f"{lost} step{'s' if lost != 1 else ''} lost" + (f" ({why})" if why else "")
               + f"; {len(records)} batch{'es' if len(records) != 1 else ''} never trained again: {_ranges(records)}"
               + f"; {rng_txt}")
        if diagnosis is not None:
            msg += (f". {diagnosis} Going on at {ep.lr_factor:g}x the learning rate for {cfg.recurrence_lr_steps} "
                    f"steps (on_recurrence='lower_lr'), rewind {ep.rewinds}/{cfg.max_rewinds} of this episode")
        if blame_d and blame_d.get("message"):
            msg += f". {_capital(blame_d['message'])}"
        if pre.flags:
            msg += f". State at the incident: {pre.summary()}"
        report = RewindReport(step, t_step, source, reason, ep.rewinds, records, blame_d, msg,
                              [f.where for f in pre.flags], rng_restored=bool(rng), recurrence=diagnosis,
                              lr_factor=self.lr_factor)
        first = next((r.batch_index for r in records if r.batch_index is not None), None)
        layers = (blame_d["layer"],) if blame_d and blame_d.get("layer") else ()
        self.emit(Event(step=step, kind=Kind.REWIND, level=Level.CRITICAL, message=msg, signal=reason,
                        layers=layers, values={"restored_step": float(t_step), "skipped": float(len(records)),
                                               "attempt": float(ep.rewinds), "lost_steps": float(lost),
                                               "rng_restored": float(bool(rng)), "lr_factor": self.lr_factor},
                        batch=first))
        if records:
            self.emit(Event(step=step, kind=Kind.QUARANTINE, level=Level.WARNING,
                            message=f"quarantined {_ranges(records)} -> {self.quarantine_path}",
                            signal=reason, values={"batches": float(len(records))}, batch=first))
        return report

    def _quarantine_records(self, refs: list[BatchRef] | None, t_step: int, step: int, reason: str) -> list[QuarantineRecord]:
        # a batch skipped (and quarantined) on its own already is not listed twice
        done = self._quarantined_steps
        fps = self.fingerprints.read([s for s in range(t_step + 1, step + 1) if s not in done])
        if refs is None:  # positions unknown: one record per step drawn since the snapshot
            return [QuarantineRecord(step, reason, None, None, None, s, fps.get(s))
                    for s in range(t_step + 1, step + 1) if s not in done]
        drew = {(b.epoch, b.batch_index): s for s, b in self._history.items() if b is not None and s > t_step}
        cur = self.data.last_batch()
        if cur is not None and (cur.epoch, cur.batch_index) not in drew and step not in self._history:
            drew[(cur.epoch, cur.batch_index)] = step
        out = []
        for r in refs:
            s = drew.get((r.epoch, r.batch_index))
            if s is not None and s in done:
                continue
            out.append(QuarantineRecord(step, reason, r.epoch, r.batch_index, r.sample_indices, s,
                                        None if s is None else fps.get(s)))
        return out

    def _write_quarantine(self, records: list[QuarantineRecord]) -> None:
        if not records:
            return
        self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.quarantine_path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.to_dict()) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # -- the learning rate of a recurrence (on_recurrence="lower_lr") --------------------------
    def wrap_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` (the optimizer's own ``step``) with the lowered learning rate applied
        around it while one is in force: every param group's ``lr`` times the factor for the
        call, put back right after, so a scheduler or the loop that sets ``lr`` keeps its
        values. Nothing but one check when none is in force."""
        def step(*args: Any, **kwargs: Any) -> Any:
            cut = self._lr_cut
            if cut is None:
                return step_fn(*args, **kwargs)
            return self._step_at(float(cut[0]), step_fn, args, kwargs)
        return step

    def _step_at(self, factor: float, step_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        groups = self.optimizer.param_groups
        saved = []
        for g in groups:
            lr = g["lr"]
            if isinstance(lr, torch.Tensor):  # a tensor lr is held by compiled / capturable steps: in place
                saved.append(lr.clone())
                lr.mul_(factor)
            else:
                saved.append(lr)
                g["lr"] = lr * factor
        try:
            return step_fn(*args, **kwargs)
        finally:
            for g, lr in zip(groups, saved):
                if isinstance(lr, torch.Tensor):
                    g["lr"].copy_(lr)
                else:
                    g["lr"] = lr

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rewinds": self.rewinds,
            "repairs": self.repairs,
            "episode": None if self._episode is None else self._episode.to_dict(),
            "lr_cut": None if self._lr_cut is None else list(self._lr_cut),
            "quarantine": [q.to_dict() for q in self.quarantine],
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.rewinds = int(d.get("rewinds", 0))
        self.repairs = int(d.get("repairs", 0))
        ep = d.get("episode")
        self._episode = None if ep is None else _Episode.from_dict(ep)
        cut = d.get("lr_cut")
        self._lr_cut = None if cut is None else [float(cut[0]), float(cut[1])]
        self.quarantine = [QuarantineRecord.from_dict(q) for q in d.get("quarantine", [])]

    def resume(self, path: str | os.PathLike[str] | None = None, *, restore_data: bool = True) -> int:
        """Load the latest clean disk checkpoint (or ``path``) with ``weights_only=True`` and
        restore everything, data position included; returns its step (continue at step + 1).
        ``restore_data=False`` resumes a loader that cannot be restored (the data then starts
        wherever that loader starts: batches may repeat or be missed)."""
        if path is None:
            if self.checkpoints is None:
                raise CheckpointError("resume() without a path needs RecoveryConfig.checkpoint_dir")
            info = self.checkpoints.latest(clean_only=True)
            if info is None:
                raise CheckpointError(f"no clean checkpoint in {self.checkpoints.directory}")
            path = info.path
        payload = load_checkpoint(path, load_fn=self.config.load_fn)
        state = payload["state"]
        if restore_data:
            data = state.get("data")
            if data is None:
                raise DataPositionError(
                    f"{path} holds no data position (it was saved with a loader that cannot be restored); "
                    "resume(restore_data=False) accepts that batches may repeat or be missed")
            if not self.data.restorable:
                raise DataPositionError(f"cannot restore the data position: {self.data.why_not}")
            self.data.load_state_dict(data)
        restore_state(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                      scaler=self.scaler, extra=self.extra_state)
        if state.get("recovery") is not None:
            self.load_state_dict(state["recovery"])
        step = int(payload["step"])
        self._history.clear()
        self.fingerprints.clear()
        self._last_step_seen = step
        self._drawn_mark = self.data.drawn()
        self._last_snapshot_step = None  # snapshot at the next step: rewinds work right away
        self._last_checkpoint_step = step
        if self.ring is not None:
            self.ring.clear()
        self.emit(Event(step=step, kind=Kind.RESUME, level=Level.INFO,
                        message=f"resumed from {path} at step {step}", signal="resume"))
        return step

    def close(self) -> None:
        """Wait for a background checkpoint write (raises its error)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
