"""Recovery: periodic clean snapshots / checkpoints, repair of poisoned state, PaLM-style
rewind-and-skip with an exact data position, quarantine and blame.

The watcher drives it:

* ``after_step(step, clean=...)`` after every optimizer step (applied or skipped): periodic
  in-memory snapshot (default every 100 steps, 2 kept) and disk checkpoint (only with
  ``checkpoint_dir``); cheap on the other steps (a few integer reads).
* ``checkpoint(step, reason)`` on a warning: a copy *now*, while parameters are still finite.
* ``repair(step)`` when state may be poisoned: scan, reset the poisoned coordinates, verify.
* ``rewind(step, reason, blame=...)`` on a collapse a skip cannot fix: restore the last clean
  snapshot in place, skip the batches that led into the incident, quarantine them.
* ``resume()`` at start-up: the latest clean disk checkpoint, data position included.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import torch

from ..events import Event, Kind, Level
from ..sinks.defaults import output_dir
from .checkpoint import CheckpointInfo, CheckpointManager, is_collective, load_checkpoint
from .data import BatchRef, DataPositionAdapter, ResumableAdapter, _Unrestorable, data_position_adapter
from .errors import CheckpointError, DataPositionError, Halt
from .repair import RepairReport, StateScan, _Agree, repair_optimizer_state, scan_state
from ._state import call_state_dict, fence_copies, local, to_host
from .snapshot import Snapshot, SnapshotRing, capture_state, restore_state

SINCE_SNAPSHOT = "since_snapshot"


@dataclass
class RecoveryConfig:
    """How earlywarn recovers. The defaults protect a run that passes nothing: an in-memory
    snapshot every 100 steps (2 kept), repair of poisoned optimizer state, rewind on collapse
    skipping the batches that led into it, halt after 3 rewinds in a row that did not hold."""

    snapshot_every: int = 100
    """Steps between in-memory snapshots (host RAM; the first is taken at the first step).
    0 disables them; rewinds then need disk checkpoints."""
    snapshot_keep: int = 2
    """Clean in-memory snapshots kept (one more, unclean, is kept from the last warning)."""
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
    """A snapshot is clean when no alert came within this many steps before it. The watcher
    passes ``clean`` to ``after_step``; recovery also treats the steps after its own repairs
    and rewinds as unclean for this long."""
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
    max_rewinds: int = 3
    """Rewinds in a row before halting. A rewind has held once a clean snapshot is taken past
    the data position of its incident; until then the next rewind counts as a retry and goes
    one snapshot further back."""
    quarantine_path: str | None = None
    """JSONL file listing every skipped batch; default ``<checkpoint_dir>/quarantine.jsonl``,
    or ``quarantine.jsonl`` in earlywarn's output folder (``./earlywarn_output/``, see
    ``earlywarn.sinks.defaults.output_dir``) without a checkpoint directory. Written only when a
    batch is quarantined."""
    history: int = 4096
    """Steps for which the batch drawn is remembered (for blame and quarantine)."""

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"RecoveryConfig.{name}={getattr(self, name)!r}: {fix}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("snapshot_every", "checkpoint_every", "clean_window", "max_rewinds"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "must be an int >= 0")
        for name in ("snapshot_keep", "checkpoint_keep", "history"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be an int >= 1")
        if self.checkpoint_dir is not None and self.checkpoint_every < 1:
            raise bad("checkpoint_every", "must be >= 1 when checkpoint_dir is set")
        rsb = self.rewind_skip_batches
        if not (rsb == SINCE_SNAPSHOT or (is_int(rsb) and rsb >= 0)):
            raise bad("rewind_skip_batches", f"use {SINCE_SNAPSHOT!r} or an int >= 0")
        for name in ("checkpoint_async", "repair", "repair_reset_state", "rewind"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False (a string such as 'false' would count as true)")
        frac = self.repair_max_param_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
            raise bad("repair_max_param_fraction", "must be a number between 0 and 1 (a share of all parameter elements)")
        for name in ("checkpoint_dir", "quarantine_path"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise bad(name, "must be a path (str or os.PathLike), or None")
            if v is not None and os.fspath(v) == "":
                raise bad(name, "is empty: give a directory (e.g. 'checkpoints'), or None for none"
                          if name == "checkpoint_dir" else "is empty: give a file path, or None for the default")
        for name in ("save_fn", "load_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise bad(name, "must be callable")
        if (self.save_fn is None) != (self.load_fn is None):
            raise bad("save_fn", "give save_fn and load_fn together (a custom format needs its reader)")
        if self.collective_save is not None and not isinstance(self.collective_save, bool):
            raise bad("collective_save", "use True, False or None (None: ask save_fn.collective)")
        if self.collective_save and self.save_fn is None:
            raise bad("collective_save", "needs a collective save_fn/load_fn pair, e.g. "
                      "earlywarn.distributed.dcp_checkpoint_fns(model, optimizer); torch.save writes per rank")
        if self.collective and self.checkpoint_async:
            raise bad("checkpoint_async", "cannot be True with a collective save_fn: every rank must run the "
                      "collective write on its training thread; set checkpoint_async=False")
        if self.snapshot_every == 0 and self.checkpoint_dir is None and self.rewind:
            raise bad("snapshot_every", "is 0 and there is no checkpoint_dir: nothing to rewind to; "
                      "keep snapshots on, set checkpoint_dir, or set rewind=False")
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = os.fspath(self.checkpoint_dir)
        if self.quarantine_path is not None:
            self.quarantine_path = os.fspath(self.quarantine_path)

    @property
    def collective(self) -> bool:
        """The checkpoint writer is a collective (``collective_save``, else ``save_fn.collective``)."""
        return is_collective(self.save_fn) if self.collective_save is None else self.collective_save


@dataclass(frozen=True)
class Blame:
    """Who is responsible for an incident.

    ``step`` / ``batch``: the step whose batch caused it (e.g. the last update applied before
    the loss went NaN). ``symptom_step`` / ``symptom_batch``: where it showed. ``layer``: the
    first layer with non-finite or most-escalated gradients (from the watcher's capture)."""

    step: int
    batch: BatchRef | None = None
    layer: str | None = None
    symptom: str | None = None
    symptom_step: int | None = None
    symptom_batch: BatchRef | None = None

    @property
    def message(self) -> str:
        """"the loss turned NaN at step 12 on batch 11 of epoch 0 (samples ...); the batch
        responsible was batch 10 of epoch 0 (samples ...) at step 11; first layer: fc1.weight"."""
        who = str(self.batch) if self.batch is not None else "the batch"
        if self.symptom and self.symptom_step == self.step:
            text = f"{self.symptom} at step {self.step} on {who}, the batch responsible"
        elif self.symptom and self.symptom_step is not None:
            on = f" on {self.symptom_batch}" if self.symptom_batch is not None else ""
            text = f"{self.symptom} at step {self.symptom_step}{on}; the batch responsible was {who} at step {self.step}"
        else:
            text = f"the batch responsible is {who} at step {self.step}"
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


@dataclass
class _Provisional:
    """A snapshot whose copy started before it was known to be usable: its step not yet judged
    clean (async mode), or its device finiteness flag not yet read."""

    snap: Snapshot
    to_ring: bool
    to_disk: bool
    drawn: int | None
    prev_snapshot_step: int | None
    prev_checkpoint_step: int
    judged: bool = False


@dataclass(frozen=True)
class QuarantineRecord:
    """A batch that will never be trained: it was drawn after the restored snapshot (its update
    was undone) or skipped over. ``step`` is the step that drew it when known."""

    incident_step: int
    reason: str
    epoch: int | None
    batch_index: int | None
    sample_indices: tuple[int, ...] | None
    step: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "incident_step": self.incident_step,
            "reason": self.reason,
            "step": self.step,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "sample_indices": None if self.sample_indices is None else list(self.sample_indices),
        }


@dataclass
class RewindReport:
    incident_step: int
    restored_step: int
    source: str
    """``"memory:<step>"`` or the checkpoint path."""
    reason: str
    attempt: int
    """1 for the first rewind in a row, up to ``max_rewinds``."""
    quarantined: list[QuarantineRecord]
    blame: dict[str, Any] | None = None
    message: str = ""
    nonfinite: list[str] = field(default_factory=list)
    """Tensors that held NaN/Inf when the rewind began (``"name"`` or ``"name[state key]"``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "incident_step": self.incident_step,
            "nonfinite": list(self.nonfinite),
            "restored_step": self.restored_step,
            "source": self.source,
            "reason": self.reason,
            "attempt": self.attempt,
            "quarantined": [q.to_dict() for q in self.quarantined],
            "blame": self.blame,
            "message": self.message,
        }


def _ranges(refs: list[QuarantineRecord]) -> str:
    """'epoch 0 batches 12-14, epoch 1 batch 0' (or steps when batches are unknown)."""
    if not refs:
        return "no batches"
    if refs[0].batch_index is None:
        steps = [r.step for r in refs if r.step is not None]
        return f"{len(refs)} unidentified batches (steps {min(steps)}-{max(steps)})" if steps else f"{len(refs)} batches"
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


def _on_every_rank(ok: bool, optimizer: torch.optim.Optimizer) -> bool:
    """``ok`` and'ed over ranks (one small all-reduce under torch.distributed; rare path)."""
    if _distributed_rank() is None:
        return ok
    device = local(next(p for g in optimizer.param_groups for p in g["params"])).device
    return _Agree().sum([int(not ok)], device)[0] == 0


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
    if isinstance(x, Mapping) and "batch_index" in x:
        si = x.get("sample_indices")
        return BatchRef(x.get("epoch"), x.get("batch_index"), None if si is None else tuple(si))
    if isinstance(x, int):
        return BatchRef(None, x, None)
    return None


class Recovery:
    """The recovery layer for one model / optimizer pair (see the module docstring).

    ``loader``: an :class:`~earlywarn.ResumableLoader`, a torchdata ``StatefulDataLoader``, or
    anything else (a plain ``DataLoader`` / ``None``: rewinds then skip the batches since the
    snapshot without knowing which samples they held, and anything that needs to *move* the data
    refuses with the fix named). ``extra_state``: more objects with ``state_dict`` /
    ``load_state_dict`` (the detector) saved and restored with the rest. ``keep_on_rewind``:
    names in ``extra_state`` that a rewind must not roll back (counters that have to remember
    the rewind itself, e.g. the policy's rate limits); they are still saved and resumed.
    ``late_state``: names in ``extra_state`` whose state follows the *judgement* of a step, not
    its update (the watcher's detector and counters, which see a step late in async mode): a
    periodic snapshot copies them when its step is judged, everything else when it is taken.
    ``emit``: receives every event (repair, checkpoint, rewind, quarantine, resume).
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
        late_state: Iterable[str] = (),
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
        self.late_state = frozenset(late_state)
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
        self.ring = SnapshotRing(cfg.snapshot_keep, keep_unclean=1) if cfg.snapshot_every > 0 else None
        self.checkpoints = (
            CheckpointManager(ckpt_dir, keep=cfg.checkpoint_keep, keep_unclean=1,
                              async_write=cfg.checkpoint_async, save_fn=cfg.save_fn, load_fn=cfg.load_fn,
                              collective=cfg.collective)
            if ckpt_dir is not None else None
        )
        if self.checkpoints is not None:
            self.checkpoints.on_failure = self._checkpoint_failed
        if cfg.quarantine_path is not None:
            self.quarantine_path: Path = Path(cfg.quarantine_path)
        elif ckpt_dir is not None:
            self.quarantine_path = ckpt_dir / (f"quarantine.rank{rank}.jsonl" if cfg.collective and rank is not None
                                               else "quarantine.jsonl")
        else:
            self.quarantine_path = output_dir() / ("quarantine.jsonl" if rank is None
                                                   else f"quarantine.rank{rank}.jsonl")
        self._history: OrderedDict[int, BatchRef | None] = OrderedDict()
        self._last_step_seen: int | None = None  # last after_step(step): the state's step
        self._drawn_mark = self.data.drawn()  # batches drawn as of that step (None: unknown)
        self._last_snapshot_step: int | None = None
        self._last_checkpoint_step = 0  # disk checkpoints at checkpoint_every, 2x, ... (or after a resume)
        self._last_incident_step: int | None = None
        self._streak = 0
        self._last_target_step: int | None = None
        self._incident_drawn: int | None = None  # data position of the last rewind's incident
        self.rewinds = 0
        self.repairs = 0
        self.quarantine: list[QuarantineRecord] = []
        self._provisional: _Provisional | None = None  # the snapshot being copied / confirmed
        self._spare: Any = None  # host buffers of the last evicted snapshot, for the next copy

    # -- per step ------------------------------------------------------------------------------
    def _clean(self, step: int, clean: bool) -> bool:
        if not clean:
            return False
        li = self._last_incident_step
        return li is None or step - li > self.config.clean_window

    def record_step(self, step: int, *, maybe_clean: bool = True) -> None:
        """The update of ``step`` has just been applied (or skipped), and it may not be judged yet:
        in async mode the watcher calls this when the update is queued and :meth:`after_step`
        once the step's statistics have been read. Records the batch drawn for the step and,
        when a snapshot or checkpoint is due and ``maybe_clean`` (nothing known so far makes the
        step unclean), starts a host copy of the state *as of this step*. It stays provisional
        until ``after_step(step, clean=True)`` confirms it and its device finiteness flag has
        been read (one step late: no host sync); one is in flight at a time."""
        self.data.observe()
        self._history[step] = self.data.last_batch()
        self._history.move_to_end(step)
        self._last_step_seen = step
        self._drawn_mark = self.data.drawn()
        while len(self._history) > self.config.history:
            self._history.popitem(last=False)
        # Under torch.distributed every rank settles here, at the same step (waiting if the copy
        # is still in flight): what may follow is a collective (scan, repair).
        self._settle(block=_distributed_rank() is not None)
        if self._provisional is not None:
            return
        cfg = self.config
        snap_due = self.ring is not None and (
            self._last_snapshot_step is None or step - self._last_snapshot_step >= cfg.snapshot_every
        )
        ckpt_due = self.checkpoints is not None and step - self._last_checkpoint_step >= cfg.checkpoint_every
        if not (snap_due or ckpt_due) or not self._clean(step, maybe_clean):
            return
        # A snapshot is only clean if it is finite: the flag is computed on the device beside the
        # copy and read once it has landed. Poisoned state that no alert caught is repaired then.
        host = capture_state(step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                             scaler=self.scaler, data=self._data_state(), reuse=self._spare, check_finite=True,
                             extra={k: v for k, v in self.extra_state.items() if k not in self.late_state})
        self._spare = None
        self._provisional = _Provisional(Snapshot(step=step, clean=True, reason="periodic", host=host),
                                         snap_due, ckpt_due, self.data.drawn(),
                                         self._last_snapshot_step, self._last_checkpoint_step)
        if snap_due:  # not due again while this one is in flight
            self._last_snapshot_step = step
        if ckpt_due:
            self._last_checkpoint_step = step

    def after_step(self, step: int, *, clean: bool) -> None:
        """Call after every optimizer step (applied or skipped). ``clean``: no alert within
        ``config.clean_window`` steps. Takes the periodic snapshot / checkpoint when due and
        clean (a due one waits for the first clean step). A step already given to
        :meth:`record_step` is only judged here."""
        if self._last_step_seen is None or step > self._last_step_seen:
            self.record_step(step, maybe_clean=clean)
        p = self._provisional
        if p is not None and not p.judged and p.snap.step <= step:
            if p.snap.step < step or not self._clean(step, clean):
                self._drop(p)  # its step was not clean (or never judged: a repair or rewind path)
            else:
                p.judged = True
                # The watcher's own bookkeeping (detector, policy, counters) as of this step: in
                # async mode it has only now seen the step whose state the copy holds.
                late = {k: call_state_dict(v, f"extra_state[{k!r}]") for k, v in self.extra_state.items()
                        if k in self.late_state}
                p.snap.host.tree["extra"].update(to_host(late).tree)
        p = self._provisional
        if p is not None and p.judged and p.to_disk:
            self._settle(block=True)  # a disk write needs the copy anyway: now, at its step
        elif _distributed_rank() is None:
            self._settle(block=False)

    def settle(self) -> None:
        """Finish the snapshot in flight, if any (waits for its copy): the ring is then current."""
        self._settle(block=True)

    def _settle(self, *, block: bool) -> None:
        p = self._provisional
        if p is None or not p.judged or (not block and not p.snap.host.ready()):
            return
        self._provisional = None
        host = p.snap.host
        # The device flag (agreed over ranks); if it fired, the exact host check (agreed too).
        if host.finite() or _on_every_rank(host.owned_finite(), self.optimizer):
            self._keep(p)
            return
        self._drop(p)
        scan = scan_state(self.model, self.optimizer)  # rare path: what is poisoned now
        if not scan.clean:
            if self.config.repair:
                self.repair(self._last_step_seen if self._last_step_seen is not None else p.snap.step, scan=scan)
            else:
                self._last_incident_step = self._last_step_seen

    def _keep(self, p: "_Provisional") -> None:
        snap = p.snap
        if p.to_ring:
            assert self.ring is not None
            before = self.ring.entries
            self.ring.add(snap)
            kept = {id(s) for s in self.ring.entries}
            # the evicted snapshot's buffers take the next copy (no fresh host memory per snapshot)
            self._spare = next((s.host.tree for s in before if id(s) not in kept and s.clean and s.pinned == 0), None)
            if self._incident_drawn is None or p.drawn is None or p.drawn > self._incident_drawn:
                # clean and past the data that caused the last rewind: that rewind held
                self._streak = 0
        if p.to_disk:
            self._save_disk(snap, snap.step, clean=True, reason="periodic")

    def _drop(self, p: "_Provisional") -> None:
        if self._provisional is p:
            self._provisional = None
        if p.to_ring:
            self._last_snapshot_step = p.prev_snapshot_step  # due again
        if p.to_disk:
            self._last_checkpoint_step = p.prev_checkpoint_step
        if p.snap.host.ready():  # buffers no copy writes any more: the next snapshot reuses them
            self._spare = p.snap.host.tree

    def _data_state(self, pending: int = 0) -> dict[str, Any] | None:
        return self.data.state_dict(pending) if self.data.restorable else None

    def _pending(self) -> int:
        """Batches drawn since the last after_step: their update is not in the live state."""
        now = self.data.drawn()
        if now is None or self._drawn_mark is None:
            return 0
        return max(0, now - self._drawn_mark)

    def _capture(self, step: int, *, clean: bool, reason: str, to_ring: bool, pending: int = 0) -> Snapshot:
        kw = dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                  scaler=self.scaler, data=self._data_state(pending), extra=self.extra_state)
        if to_ring and self.ring is not None:
            return self.ring.capture(step, clean=clean, reason=reason, **kw)
        return Snapshot(step=step, clean=clean, reason=reason, host=capture_state(step, **kw))

    def _save_disk(self, snap: Snapshot, step: int, *, clean: bool, reason: str) -> str:
        assert self.checkpoints is not None
        snap.host.tree["recovery"] = self.state_dict()
        snap.pinned += 1

        def done() -> None:
            snap.pinned -= 1

        path = self.checkpoints.save(snap.host, step, clean=clean, reason=reason, on_done=done)
        if path is not None:
            self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                            message=f"checkpoint ({reason}{', clean' if clean else ''}) -> {path}",
                            signal=reason, values={"clean": float(clean)}))
        return path

    def _checkpoint_failed(self, path: Path, error: BaseException) -> None:
        errno = getattr(error, "errno", None)
        self.emit(Event(step=self._last_step_seen or 0, kind=Kind.CHECKPOINT, level=Level.WARNING,
                        message=f"checkpoint write failed: {path} ({type(error).__name__}"
                                f"{f' errno {errno}' if errno is not None else ''}: {error}); training goes on, "
                                f"{self.checkpoints.failures if self.checkpoints else 0} failed so far",
                        signal="checkpoint_failed", values={"failures": float(self.checkpoints.failures if self.checkpoints else 0)}))

    def checkpoint(self, step: int, reason: str) -> str | None:
        """Save now, e.g. on a warning while parameters are still finite. Kept as *unclean*
        (an alert came): used as a rewind target only when no clean one exists.

        Call it either before step ``step``'s update (the watcher does: the batch drawn for it
        is then recorded as not yet trained, and the snapshot is labelled ``step - 1``) or after
        ``after_step(step)`` / ``record_step(step)`` (labelled ``step``, or the last recorded step
        when that is later: the label is always the step of the state it holds). Returns the disk path, or ``"memory:<step>"``
        without a checkpoint directory, or ``None`` when snapshots and checkpoints are off."""
        if self.ring is None and self.checkpoints is None:
            return None
        seen = self._last_step_seen
        if seen is not None and seen >= step - 1:
            # the state's own step: step - 1 before this step's update, step after it, or later
            # (async mode reads a warning after more updates were applied)
            label, pending = seen, self._pending()
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
        """The batch drawn for ``step`` (for the step in progress: the batch just drawn)."""
        if step in self._history:
            return self._history[step]
        last = max(self._history) if self._history else None
        if last is None or step > last:
            self.data.observe()
            return self.data.last_batch()
        return None

    def blame(
        self,
        step: int,
        *,
        layer: str | None = None,
        symptom: str | None = None,
        symptom_step: int | None = None,
    ) -> Blame:
        """Name the batch of ``step`` as responsible, e.g. ``blame(t, layer="h.3.attn",
        symptom="the loss turned NaN", symptom_step=t + 1)``."""
        return Blame(
            step=step,
            batch=self.batch_at(step),
            layer=layer,
            symptom=symptom,
            symptom_step=symptom_step,
            symptom_batch=None if symptom_step is None else self.batch_at(symptom_step),
        )

    def last_batch(self) -> BatchRef | None:
        """The batch most recently drawn from the loader (``None`` when unknown)."""
        self.data.observe()
        return self.data.last_batch()

    # -- repair ----------------------------------------------------------------------------
    def scan(self) -> StateScan:
        """Non-finite values in parameters, buffers and optimizer state (one host read)."""
        return scan_state(self.model, self.optimizer)

    def repair(self, step: int, *, scan: StateScan | None = None) -> RepairReport:
        """Scan parameters, buffers and optimizer state (or use ``scan``, taken just before);
        reset poisoned optimizer coordinates (see :mod:`earlywarn.recover.repair`), copy poisoned
        parameter coordinates back from the last clean snapshot, verify.
        ``report.needs_rewind``: parameters could not be fixed."""
        self._settle(block=True)  # a snapshot still in flight is the newest copy source
        fence_copies()  # and none may still be reading what the repair writes
        scan = scan if scan is not None else scan_state(self.model, self.optimizer)
        if scan.clean:
            return RepairReport(scan, [], [], scan, step)
        if not self.config.repair:
            report = RepairReport(scan, [], [], scan, step)
        else:
            snap = self.ring.latest(clean_only=True) if self.ring is not None else None
            report = repair_optimizer_state(
                self.optimizer, scan, snapshot=snap, reset_state=self.config.repair_reset_state,
                max_param_fraction=self.config.repair_max_param_fraction, model=self.model, step=step,
            )
            self.repairs += 1
            self._last_incident_step = step
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

    def _pick_target(self, step: int) -> tuple[int, bool, Any] | None:
        cands = self._candidates(step)
        clean = [c for c in cands if c[1]]
        pool = clean or cands
        if not pool:
            return None
        if self._streak > 0 and self._last_target_step is not None:
            older = [c for c in pool if c[0] < self._last_target_step]
            if older:
                return older[0]
            same = [c for c in pool if c[0] == self._last_target_step]
            if same:
                return same[0]
        return pool[0]

    def _halt(self, step: int, message: str, reason: str) -> Halt:
        # no HALT event here: whoever catches the Halt reports it once (the watcher does)
        return Halt(message, step=step, reason=reason)

    def rewind(self, step: int, reason: str, *, blame: Mapping[str, Any] | Blame | None = None) -> RewindReport:
        """Restore the last clean snapshot (memory first, then disk) in place — model,
        optimizer, scheduler, scaler, RNG, ``extra_state`` — move the data past the skipped
        batches, quarantine them (event + JSONL), and set gradients to ``None`` (the current
        step's gradients belong to the abandoned trajectory: do not apply them).

        Repeated rewinds before one has held (see ``max_rewinds``) go further back each time.
        Raises :class:`Halt` when ``max_rewinds`` in a row are used up, when nothing to rewind to
        exists, or when the data cannot be moved as configured. The caller continues training
        at ``report.restored_step + 1`` (the optimizer and scheduler are at that step)."""
        cfg = self.config
        blame_d = _blame_dict(blame)
        if not cfg.rewind:
            raise self._halt(step, f"{reason} at step {step}; rewinding is disabled (RecoveryConfig.rewind=False): "
                                   "halting. Enable it, or resume from a checkpoint after fixing the cause.", "rewind_disabled")
        if self._streak >= cfg.max_rewinds:
            raise self._halt(step, f"{reason} at step {step}; {self._streak} rewinds in a row did not hold "
                                   f"(max_rewinds={cfg.max_rewinds}): halting. The instability is not in a few "
                                   f"batches: lower the learning rate or inspect the quarantined batches in "
                                   f"{self.quarantine_path}, then resume from the last clean checkpoint.",
                             "rewinds_exhausted")
        self._settle(block=True)  # a confirmed snapshot still in flight is a candidate too
        if self._provisional is not None:  # never judged: taken at or after the incident step
            self._drop(self._provisional)
        # Async mode: updates applied after the incident step, before the watcher read it. Their
        # batches are not the incident's: trained again where the loader can seek, else quarantined.
        in_flight = [s for s in self._history if s > step]
        last = max([step, *in_flight])
        target = self._pick_target(step)
        if target is None:
            raise self._halt(step, f"{reason} at step {step}; no snapshot or checkpoint to rewind to (the first "
                                   "snapshot is taken at the first after_step): halting.", "no_clean_snapshot")
        t_step, t_clean, src = target
        if isinstance(src, Snapshot):
            state, source = src.state, f"memory:{src.step}"
        else:
            assert self.checkpoints is not None and isinstance(src, CheckpointInfo)
            state, source = self.checkpoints.load(src)["state"], str(src.path)
        skip = None if cfg.rewind_skip_batches == SINCE_SNAPSHOT else int(cfg.rewind_skip_batches)
        incident_drawn = self.data.drawn()
        if skip is None and in_flight and isinstance(self.data, ResumableAdapter):
            since = self.data.since(state.get("data")) or []
            through = self._skip_through(step, since)
            if through is not None:  # the data goes on right after the incident's batch, as in sync mode
                skip, incident_drawn = through, incident_drawn - (len(since) - through)
        if skip is not None and not self.data.restorable:
            raise self._halt(step, f"{reason} at step {step}; cannot rewind with rewind_skip_batches={skip}: "
                                   f"{self.data.why_not}", "data_position")
        pre = scan_state(self.model, self.optimizer)  # what the incident left (rare path: one read)
        if blame_d is not None and not blame_d.get("layer") and pre.first_layer:
            blame_d["layer"] = pre.first_layer
            blame_d["message"] = f"{blame_d.get('message', '')}; first non-finite layer: {pre.first_layer}".lstrip("; ")
        # move the data first: a refusal must leave the model untouched
        try:
            refs = self.data.rewind(state.get("data"), skip)
        except DataPositionError as e:
            raise self._halt(step, f"{reason} at step {step}; cannot rewind the data exactly: {e}", "data_position") from e
        restore_state(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                      scaler=self.scaler,
                      extra={k: v for k, v in self.extra_state.items() if k not in self.keep_on_rewind})
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

        records = self._quarantine_records(refs, t_step, step, reason, last=last)
        self._streak += 1
        self.rewinds += 1
        self._last_target_step = t_step
        self._incident_drawn = incident_drawn
        self._last_incident_step = step  # the watcher's step counter may stay monotonic
        self._last_snapshot_step = t_step
        self._last_checkpoint_step = min(self._last_checkpoint_step, t_step)
        if self.ring is not None:
            self.ring.drop_after(t_step)
        if self.checkpoints is not None:
            self.checkpoints.discard_after(t_step)
        for s in [s for s in self._history if s > t_step]:
            del self._history[s]
        self._last_step_seen = None
        self._drawn_mark = self.data.drawn()
        self._write_quarantine(records)
        self.quarantine.extend(records)

        kind_txt = "clean " if t_clean else "unclean (no clean one left) "
        msg = (f"{reason}: rewound to {kind_txt}state of step {t_step} ({source}), "
               f"attempt {self._streak}/{cfg.max_rewinds}; skipped {len(records)} batches: {_ranges(records)}")
        if blame_d and blame_d.get("message"):
            msg += f". {blame_d['message']}"
        if pre.flags:
            msg += f". State at the incident: {pre.summary()}"
        report = RewindReport(step, t_step, source, reason, self._streak, records, blame_d, msg,
                              [f.where for f in pre.flags])
        first = next((r.batch_index for r in records if r.batch_index is not None), None)
        layers = (blame_d["layer"],) if blame_d and blame_d.get("layer") else ()
        self.emit(Event(step=step, kind=Kind.REWIND, level=Level.CRITICAL, message=msg, signal=reason,
                        layers=layers, values={"restored_step": float(t_step), "skipped": float(len(records)),
                                               "attempt": float(self._streak)}, batch=first))
        self.emit(Event(step=step, kind=Kind.QUARANTINE, level=Level.WARNING,
                        message=f"quarantined {_ranges(records)} -> {self.quarantine_path}",
                        signal=reason, values={"batches": float(len(records))}, batch=first))
        return report

    def _skip_through(self, step: int, since: list[BatchRef]) -> int | None:
        """Of the batches ``since`` a snapshot, how many up to the one of ``step`` (None: unknown)."""
        ref = self._history.get(step)
        if ref is None:
            return None
        hits = [i for i, b in enumerate(since) if (b.epoch, b.batch_index) == (ref.epoch, ref.batch_index)]
        return hits[-1] + 1 if hits else None

    def _quarantine_records(self, refs: list[BatchRef] | None, t_step: int, step: int, reason: str,
                            last: int | None = None) -> list[QuarantineRecord]:
        if refs is None:  # identities unknown: one record per step drawn since the snapshot
            end = step if last is None else last
            return [QuarantineRecord(step, reason, None, None, None, s) for s in range(t_step + 1, end + 1)]
        drew = {(b.epoch, b.batch_index): s for s, b in self._history.items() if b is not None and s > t_step}
        cur = self.data.last_batch()
        if cur is not None and (cur.epoch, cur.batch_index) not in drew and step not in self._history:
            drew[(cur.epoch, cur.batch_index)] = step
        return [QuarantineRecord(step, reason, r.epoch, r.batch_index, r.sample_indices,
                                 drew.get((r.epoch, r.batch_index))) for r in refs]

    def _write_quarantine(self, records: list[QuarantineRecord]) -> None:
        if not records:
            return
        self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.quarantine_path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.to_dict()) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rewinds": self.rewinds,
            "repairs": self.repairs,
            "streak": self._streak,
            "last_target_step": self._last_target_step,
            "last_incident_step": self._last_incident_step,
            "incident_drawn": self._incident_drawn,
            "quarantine": [q.to_dict() for q in self.quarantine],
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.rewinds = int(d.get("rewinds", 0))
        self.repairs = int(d.get("repairs", 0))
        self._streak = int(d.get("streak", 0))
        self._last_target_step = d.get("last_target_step")
        self._last_incident_step = d.get("last_incident_step")
        self._incident_drawn = d.get("incident_drawn")
        self.quarantine = [
            QuarantineRecord(q["incident_step"], q["reason"], q["epoch"], q["batch_index"],
                             None if q["sample_indices"] is None else tuple(q["sample_indices"]), q["step"])
            for q in d.get("quarantine", [])
        ]

    def resume(self, path: str | os.PathLike[str] | None = None, *, restore_data: bool = True) -> int:
        """Load the latest clean disk checkpoint (or ``path``) with ``weights_only=True`` and
        restore everything, data position included; returns its step (continue at step + 1).
        ``restore_data=False`` resumes a loader that cannot be restored (the data then starts
        wherever that loader starts: batches may repeat or be missed)."""
        if path is None:
            if self.checkpoints is None:
                raise CheckpointError("resume() without a path needs RecoveryConfig.checkpoint_dir")
            path, payload = self._newest_readable()
        else:
            payload = load_checkpoint(path, load_fn=self.config.load_fn)
        state = payload["state"]
        if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping):
            raise CheckpointError(f"{path} holds no model state (its 'state' is {type(state).__name__}): "
                                  "not a checkpoint earlywarn wrote, or written for another model")
        if restore_data:
            data = state.get("data")
            if data is None:
                raise DataPositionError(
                    f"{path} holds no data position (it was saved with a loader that cannot be restored); "
                    "resume(restore_data=False) accepts that batches may repeat or be missed")
            if not self.data.restorable:
                raise DataPositionError(f"cannot restore the data position: {self.data.why_not}")
            self.data.load_state_dict(data)
        try:
            restore_state(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                          scaler=self.scaler, extra=self.extra_state)
            if state.get("recovery") is not None:
                self.load_state_dict(state["recovery"])
            step = int(payload["step"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
            raise CheckpointError(
                f"{path} does not fit this run ({type(e).__name__}: {e}); the model, optimizer or "
                "objects restored may be partly overwritten: rebuild them and resume from a checkpoint "
                "of this model") from e
        self._history.clear()
        self._last_step_seen = step
        self._drawn_mark = self.data.drawn()
        self._last_snapshot_step = None  # snapshot at the next step: rewinds work right away
        self._last_checkpoint_step = step
        if self.ring is not None:
            self.ring.clear()
        self._provisional = self._spare = None
        self.emit(Event(step=step, kind=Kind.RESUME, level=Level.INFO,
                        message=f"resumed from {path} at step {step}", signal="resume"))
        return step

    def _newest_readable(self) -> tuple[Path, dict[str, Any]]:
        """The newest clean checkpoint that reads back; a torn or unreadable newer one is
        skipped with a warning event (a crash mid-copy, a truncated file on a full disk)."""
        assert self.checkpoints is not None
        cands = [c for c in reversed(self.checkpoints.list()) if c.clean]
        if not cands:
            raise CheckpointError(f"no clean checkpoint in {self.checkpoints.directory}")
        errors = []
        for info in cands:
            try:
                payload = load_checkpoint(info.path, load_fn=self.config.load_fn)
            except CheckpointError as e:
                errors.append(f"{info.path.name}: {e}")
                continue
            if errors:
                msg = (f"resuming from {info.path} instead: the newer checkpoint(s) could not be read: "
                       + "; ".join(errors))
                import warnings

                warnings.warn(f"earlywarn: {msg}", RuntimeWarning, stacklevel=3)
                self.emit(Event(step=info.step, kind=Kind.RESUME, level=Level.WARNING, message=msg, signal="resume"))
            return info.path, payload
        raise CheckpointError(f"no readable clean checkpoint in {self.checkpoints.directory}: " + "; ".join(errors))

    def close(self) -> None:
        """Finish the snapshot in flight; wait for a background checkpoint write (raises its error)."""
        self._settle(block=True)
        if self.checkpoints is not None:
            self.checkpoints.close()
