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
``clean_window`` steps") are counted on that trajectory: after a rewind, from ``s``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from ..events import Event, Kind, Level
from ..sinks.defaults import output_dir
from ._state import call_state_dict, distributed_rank, fence_copies, to_host
from .budget import plan_snapshots
from .checkpoint import CheckpointInfo, CheckpointManager, _agree, load_checkpoint
from .config import SINCE_SNAPSHOT, RecoveryConfig
from .data import BatchFingerprints, BatchRef, DataPositionAdapter, ResumableAdapter, _Unrestorable, data_position_adapter
from .errors import CheckpointError, DataPositionError, Halt
from .records import (
    Blame,
    QuarantineRecord,
    RewindReport,
    _blame_dict,
    _capital,
    _name_batch,
    _ranges,
    _record_key,
    batch_key,
)
from .recurrence import Recurrence
from .repair import FiniteBaseline, RepairReport, StateScan, repair_optimizer_state, scan_state
from .snapshot import Snapshot, SnapshotRing, capture_state, restore_state

__all__ = ["Blame", "QuarantineRecord", "Recovery", "RecoveryConfig", "RewindReport", "SINCE_SNAPSHOT"]

def _on_every_rank(ok: bool) -> bool:
    """``ok`` and'ed over ranks (one small all-reduce under torch.distributed; rare path)."""
    return ok if distributed_rank() is None else _agree(ok)


@dataclass
class _Provisional:
    """A snapshot whose copy started before it was known to be usable: its step not yet judged
    clean (async mode), or its device finiteness flag not yet read."""

    snap: Snapshot
    to_ring: bool
    to_disk: bool
    prev_snapshot_step: int | None
    prev_checkpoint_step: int
    judged: bool = False


class Recovery:
    """The recovery layer for one model / optimizer pair (see the module docstring).

    ``loader``: an :class:`~earlywarn.ResumableLoader`, a torchdata ``StatefulDataLoader``, or
    anything else (a plain ``DataLoader`` / ``None``: rewinds then skip the batches since the
    snapshot without knowing which samples they held -- they are named by step and fingerprint
    -- and anything that needs to *move* the data refuses with the fix named). ``extra_state``:
    more objects with ``state_dict`` / ``load_state_dict`` (the detector, the loop's own
    counters) saved and restored with the rest. ``keep_on_rewind``: names in ``extra_state``
    that a rewind must not roll back (counters that have to remember the rewind itself, e.g.
    the policy's rate limits); they are still saved and resumed. ``late_state``: names in
    ``extra_state`` whose state follows the *judgement* of a step, not its update (the watcher's
    detector and counters, which see a step late in async mode): a periodic snapshot copies them
    when its step is judged, everything else when it is taken. ``emit``: receives every event
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
        # fixed for the run (checked per step below: settle at the same step on every rank)
        rank = self._rank = distributed_rank()
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
        # the model's own non-finite values (a -inf causal mask buffer), as of now: not poison
        self.baseline = FiniteBaseline.capture(model)
        self.fingerprints = BatchFingerprints(cfg.history)
        self._history: OrderedDict[int, BatchRef | None] = OrderedDict()
        self._last_step_seen: int | None = None  # last after_step(step): the state's step
        self._drawn_mark = self.data.drawn()  # batches drawn as of that step (None: unknown)
        self._last_snapshot_step: int | None = None
        self._last_checkpoint_step = 0  # disk checkpoints at checkpoint_every, 2x, ... (or after a resume)
        # the step of the last repair, or the target of the last rewind: the steps after it are
        # unclean for clean_window (a rewind's restored step, since the steps after it come again)
        self._incident_step: int | None = None
        self.recurrence = Recurrence(optimizer, factor=cfg.recurrence_lr_factor, lr_steps=cfg.recurrence_lr_steps,
                                     history=cfg.history)
        self.rewinds = 0
        self.repairs = 0
        self.quarantine: list[QuarantineRecord] = []
        self._quarantined_steps: set[int] = set()  # steps of this trajectory whose batch is quarantined already
        self._provisional: _Provisional | None = None  # the snapshot being copied / confirmed
        self._spare: Any = None  # host buffers of the last evicted snapshot, for the next copy
        self._measured = False
        self._note: Callable[[str], None] | None = None  # the console's, for the plan and its revisions
        self.snapshot_plan = None
        if self.ring is not None:
            self.snapshot_plan = plan_snapshots(cfg, model, optimizer)
            if self.snapshot_plan.clean:
                self.ring.set_capacity(self.snapshot_plan.clean, self.snapshot_plan.unclean)
            else:
                self.ring = None

    # -- the memory plan -----------------------------------------------------------------------
    @property
    def plan(self) -> str:
        """The snapshot plan in one sentence (cadence, ring, host RAM): what ``watch()`` reports."""
        if self.snapshot_plan is None:
            where = f"disk checkpoints in {self.config.checkpoint_dir}" if self.config.checkpoint_dir else "nothing"
            return f"in-memory snapshots are off (snapshot_every=0): rewinds use {where}"
        return self.snapshot_plan.message

    def report_plan(self, step: int = 0, *, write: Callable[[str], None] | None = None) -> None:
        """Say the snapshot plan once (the watcher does, when its sinks exist): a note on the
        console (``write``, the console sink's; nothing without one) and, when it is short of
        memory, a Python warning too. Not an event: it is no checkpoint, and no incident."""
        self._note = write
        self._say(self.plan, self.snapshot_plan is not None and self.snapshot_plan.level >= Level.WARNING)

    def _say(self, text: str, warn: bool) -> None:
        if self._note is not None:
            self._note(f"[earlywarn] {text}")
        if warn:
            warnings.warn(f"earlywarn: {text}", RuntimeWarning, stacklevel=3)

    def _check_budget(self, snap: Snapshot) -> None:
        """The first snapshot measures what the estimate guessed; shrink the ring if it must."""
        if self._measured or self.ring is None or self.snapshot_plan is None:
            return
        self._measured = True
        note = self.snapshot_plan.refit(snap.nbytes)
        if note is not None:
            self.ring.set_capacity(self.snapshot_plan.clean, self.snapshot_plan.unclean)
            self._say(note, True)

    # -- per step ------------------------------------------------------------------------------
    def _clean(self, step: int, clean: bool) -> bool:
        if not clean:
            return False
        li = self._incident_step
        return li is None or step - li > self.config.clean_window

    @property
    def lr_factor(self) -> float:
        """The factor applied to the learning rate now (1.0 unless ``on_recurrence="lower_lr"`` acts)."""
        return self.recurrence.lr_factor

    def record_step(self, step: int, *, maybe_clean: bool = True, building: bool = False) -> None:
        """The update of ``step`` has just been applied (or skipped), and it may not be judged yet:
        in async mode the watcher calls this when the update is queued and :meth:`after_step`
        once the step's statistics have been read. Records the batch drawn for the step and,
        when a snapshot or checkpoint is due (every ``config.every`` steps, ``every_building``
        while an episode builds) and ``maybe_clean`` (nothing known so far makes the step
        unclean), starts a host copy of the state *as of this step*. It stays provisional until
        ``after_step(step, clean=True)`` confirms it and its device finiteness flag has been read
        (one step late: no host sync); one is in flight at a time."""
        self.data.observe()
        self._history[step] = self.data.last_batch()
        self._history.move_to_end(step)
        self._last_step_seen = step
        self._drawn_mark = self.data.drawn()
        while len(self._history) > self.config.history:
            self._history.popitem(last=False)
        # Under torch.distributed every rank settles here, at the same step (waiting if the copy
        # is still in flight): what may follow is a collective (scan, repair).
        self._settle(block=self._rank is not None)
        if self._provisional is not None:
            return
        cfg = self.config
        last = self._last_snapshot_step
        every = cfg.every_building if building else cfg.every
        snap_due = self.ring is not None and (last is None or step - last >= every or step < last)
        ckpt_due = self.checkpoints is not None and step - self._last_checkpoint_step >= cfg.checkpoint_every
        if not (snap_due or ckpt_due) or not self._clean(step, maybe_clean):
            return
        # A snapshot is only clean if what the optimizer writes is finite: the flag is computed on
        # the device beside the copy and read once it has landed. Poisoned state that no alert
        # caught is repaired then.
        host = capture_state(step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                             scaler=self.scaler, data=self._data_state(), reuse=self._spare, check_finite=True,
                             extra={k: v for k, v in self.extra_state.items() if k not in self.late_state})
        self._spare = None
        snap = Snapshot(step=step, clean=True, reason="building" if building else "periodic", host=host,
                        building=building)
        self._provisional = _Provisional(snap, snap_due, ckpt_due, self._last_snapshot_step,
                                         self._last_checkpoint_step)
        if snap_due:  # not due again while this one is in flight
            self._last_snapshot_step = step
        if ckpt_due:
            self._last_checkpoint_step = step

    def after_step(self, step: int, *, clean: bool, building: bool = False) -> None:
        """Call after every optimizer step (applied or skipped). ``clean``: no incident within
        ``config.clean_window`` steps. ``building``: an episode may be building (recent alerts,
        elevated gradients): snapshots come at ``every_building``. Takes the periodic snapshot /
        checkpoint when due and clean (a due one waits for the first clean step). A step already
        given to :meth:`record_step` is only judged here."""
        cfg = self.config
        if self._last_step_seen is None or step > self._last_step_seen:
            self.record_step(step, maybe_clean=clean, building=building)
        clean = self._clean(step, clean)
        if self.recurrence.after_step(step, clean=clean, window=cfg.clean_window):
            self.emit(Event(step=step, kind=Kind.REWIND, level=Level.INFO, signal="lr_factor",
                            message=f"the lowered learning rate ended after {cfg.recurrence_lr_steps} steps: "
                                    "the optimizer steps at the loop's learning rate again",
                            values={"lr_factor": 1.0}))
        p = self._provisional
        if p is not None and not p.judged and p.snap.step <= step:
            if p.snap.step < step or not clean:
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
        elif self._rank is None:
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
        if host.finite() or _on_every_rank(host.owned_finite()):
            self._keep(p)
            return
        self._drop(p)
        scan = self.scan()  # rare path: what is poisoned now
        if not scan.clean:
            if self.config.repair:
                self.repair(self._last_step_seen if self._last_step_seen is not None else p.snap.step, scan=scan)
            else:
                self._incident_step = self._last_step_seen

    def _keep(self, p: "_Provisional") -> None:
        snap = p.snap
        if p.to_ring:
            assert self.ring is not None
            before = self.ring.entries
            self.ring.add(snap)
            kept = {id(s) for s in self.ring.entries}
            # the evicted snapshot's buffers take the next copy (no fresh host memory per snapshot)
            self._spare = next((s.host.tree for s in before if id(s) not in kept and s.clean and s.pinned == 0), None)
            self.baseline.refresh(self.model)  # the last known-good buffers (new or resized ones)
            self._check_budget(snap)
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
                            signal=reason, values={"clean": float(clean)}, path=str(path)))
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
        when that is later: the label is always the step of the state it holds). Returns the disk
        path, or ``"memory:<step>"`` without a checkpoint directory, or ``None`` when snapshots
        and checkpoints are off."""
        if self.ring is None and self.checkpoints is None:
            return None
        seen = self._last_step_seen
        # the state's own step: step - 1 before this step's update, step after it, or later
        # (async mode reads a warning after more updates were applied)
        label = step - 1 if seen is None else max(seen, step - 1)
        snap = self._capture(label, clean=False, reason=reason, to_ring=self.ring is not None, pending=self._pending())
        if self.checkpoints is not None:
            return self._save_disk(snap, label, clean=False, reason=reason)
        self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                        message=f"in-memory snapshot ({reason}) of the state after step {label}", signal=reason,
                        values={"clean": 0.0}, path=f"memory:{label}"))
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
        fp = self.fingerprints.read([step]).get(step)
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
        self._settle(block=True)  # a snapshot still in flight is the newest copy source
        fence_copies()  # and none may still be reading what the repair writes
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
                self._incident_step = step
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

    def _keys(self, steps: list[int]) -> list[str | None]:
        """What identifies the batches of ``steps`` (a position, else a fingerprint; one host read)."""
        fps = self.fingerprints.read(steps)
        out: list[str | None] = []
        newest = max(self._history) if self._history else None
        for s in steps:
            ref = self._history.get(s)
            if ref is None and (newest is None or s > newest):
                ref = self.data.last_batch()  # the step in progress drew the loader's latest batch
            out.append(batch_key(ref.epoch, ref.batch_index, fps.get(s)) if ref is not None else fps.get(s))
        return out

    def lr_trend(self, step: int) -> str:
        """The learning rate's trend over the open episode (see :class:`~earlywarn.recover.recurrence.Recurrence`)."""
        return self.recurrence.lr_trend(step)

    def _diagnose(self, step: int, reason: str) -> str:
        ep = self.recurrence.episode
        assert ep is not None
        keys = self._keys(list(range(ep.last_target + 1, step + 1)))
        fresh = not self.data.restorable and not self.config.rewind_restore_rng
        return self.recurrence.diagnose(step, reason, keys, fresh_draws=fresh)

    def recurrence_of(self, step: int, reason: str) -> str | None:
        """The diagnosis of an incident at ``step`` if it is a recurrence (a rewind's episode is
        still open: it has not held yet), else ``None``."""
        return None if self.recurrence.episode is None else self._diagnose(step, reason)

    def describe_rewinds(self) -> str:
        """The recent rewinds, for a halt message: 'at step 152 (loss_diverged) to step 125, ...'."""
        return self.recurrence.describe_rewinds()

    def rewind(
        self,
        step: int,
        reason: str,
        *,
        blame: Mapping[str, Any] | Blame | None = None,
        onset: int | None = None,
        scan: StateScan | None = None,
        known_finite: bool = False,
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
        training at ``report.resume_step`` (the optimizer and scheduler are at that step).
        ``scan``: a :meth:`scan` taken during this step already (else one is taken here, unless
        ``known_finite``: the incident's loss and gradients were finite -- a divergence -- so the
        weights that produced them are too, and no NaN/Inf needs looking for)."""
        cfg = self.config
        blame_d = _blame_dict(blame)
        if not cfg.rewind:
            raise self._halt(step, f"{reason} at step {step}; rewinding is disabled (RecoveryConfig.rewind=False): "
                                   "halting. Enable it, or resume from a checkpoint after fixing the cause.", "rewind_disabled")
        ep = self.recurrence.episode
        diagnosis = None
        if ep is not None:
            diagnosis = self._diagnose(step, reason)
            if cfg.on_recurrence == "halt":
                raise self._halt(step, f"{diagnosis} Halting (RecoveryConfig.on_recurrence='halt'): resume from the last "
                                       "clean checkpoint with a lower learning rate, or set on_recurrence='lower_lr' to "
                                       f"rewind and go on at {cfg.recurrence_lr_factor:g}x the learning rate for "
                                       f"{cfg.recurrence_lr_steps} steps.", "recurrence")
            if ep.rewinds >= cfg.max_rewinds_per_episode:
                raise self._halt(step, f"{diagnosis} Halting: {ep.rewinds} rewinds in this episode (max_rewinds_per_episode="
                                       f"{cfg.max_rewinds_per_episode}), the last at {ep.lr_factor:g}x the learning rate, did not hold. "
                                       "Resume from the last clean checkpoint with a lower learning rate.",
                                 "rewinds_exhausted")
        self._settle(block=True)  # a confirmed snapshot still in flight is a candidate too
        if self._provisional is not None:  # never judged: taken at or after the incident step
            self._drop(self._provisional)
        # Async mode: updates applied after the incident step, before the watcher read it. Their
        # batches are not the incident's: trained again where the loader can seek, else quarantined.
        in_flight = [s for s in self._history if s > step]
        last = max([step, *in_flight])
        if scan is not None:
            pre = scan
        elif known_finite:
            pre = StateScan([], 0)
        else:
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
        if skip is None and in_flight and isinstance(self.data, ResumableAdapter):
            since = self.data.since(state.get("data")) or []
            through = self._skip_through(step, since)
            if through is not None:  # the data goes on right after the incident's batch, as in sync mode
                skip = through
        if skip is not None and not self.data.restorable:
            raise self._halt(step, f"{reason} at step {step}; cannot rewind with rewind_skip_batches={skip}: "
                                   f"{self.data.why_not}", "data_position")
        if blame_d is not None and not blame_d.get("layer") and pre.first_layer:
            blame_d["layer"] = pre.first_layer
            blame_d["message"] = f"{blame_d.get('message', '')}; first non-finite layer: {pre.first_layer}".lstrip("; ")
        # move the data first: a refusal must leave the model untouched
        try:
            refs = self.data.rewind(state.get("data"), skip)
        except DataPositionError as e:
            raise self._halt(step, f"{reason} at step {step}; cannot rewind the data exactly: {e}", "data_position") from e
        live_lr = self.recurrence.live_lr()  # the incident's: the restore puts the snapshot's back
        rng = cfg.rewind_restore_rng if cfg.rewind_restore_rng is not None else self.data.restorable
        restore_state(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                      scaler=self.scaler, rng=rng,
                      extra={k: v for k, v in self.extra_state.items() if k not in self.keep_on_rewind})
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

        records = self._quarantine_records(refs, t_step, step, reason, last=last)
        self.rewinds += 1
        ep = self.recurrence.rewound(step, t_step, reason, [k for k in map(_record_key, records) if k is not None],
                                     live_lr=live_lr)
        self._incident_step = t_step
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
        msg = (f"{reason}: rewound to the {kind_txt} state of step {t_step} ({source}), "
               f"{lost} step{'s' if lost != 1 else ''} lost" + (f" ({why})" if why else "")
               + f"; {len(records)} batch{'es' if len(records) != 1 else ''} never trained again: {_ranges(records)}"
               + f"; {rng_txt}; training goes on at step {t_step + 1}")
        if diagnosis is not None:
            msg += (f". {diagnosis} Going on at {ep.lr_factor:g}x the learning rate for {cfg.recurrence_lr_steps} "
                    f"steps (on_recurrence='lower_lr'), rewind {ep.rewinds}/{cfg.max_rewinds_per_episode} of this episode")
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

    def _skip_through(self, step: int, since: list[BatchRef]) -> int | None:
        """Of the batches ``since`` a snapshot, how many up to the one of ``step`` (None: unknown)."""
        ref = self._history.get(step)
        if ref is None:
            return None
        hits = [i for i, b in enumerate(since) if (b.epoch, b.batch_index) == (ref.epoch, ref.batch_index)]
        return hits[-1] + 1 if hits else None

    def _quarantine_records(self, refs: list[BatchRef] | None, t_step: int, step: int, reason: str,
                            last: int | None = None) -> list[QuarantineRecord]:
        # a batch skipped (and quarantined) on its own already is not listed twice; ``last``:
        # async mode, the newest step applied before the incident was read (in flight)
        done = self._quarantined_steps
        end = step if last is None else last
        fps = self.fingerprints.read([s for s in range(t_step + 1, end + 1) if s not in done])
        if refs is None:  # positions unknown: one record per step drawn since the snapshot
            return [QuarantineRecord(step, reason, None, None, None, s, fps.get(s))
                    for s in range(t_step + 1, end + 1) if s not in done]
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

    def wrap_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the learning rate a recurrence lowered applied around it (see
        :meth:`~earlywarn.recover.recurrence.Recurrence.wrap_step`)."""
        return self.recurrence.wrap_step(step_fn)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rewinds": self.rewinds,
            "repairs": self.repairs,
            **self.recurrence.state_dict(),
            "quarantine": [q.to_dict() for q in self.quarantine],
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.rewinds = int(d.get("rewinds", 0))
        self.repairs = int(d.get("repairs", 0))
        self.recurrence.load_state_dict(d)
        self.quarantine = [QuarantineRecord.from_dict(q) for q in d.get("quarantine", [])]

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
        self.fingerprints.clear()
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
                payload = self.checkpoints.load(info)
            except CheckpointError as e:
                errors.append(f"{info.path.name}: {e}")
                continue
            if errors:
                msg = (f"resuming from {info.path} instead: the newer checkpoint(s) could not be read: "
                       + "; ".join(errors))
                warnings.warn(f"earlywarn: {msg}", RuntimeWarning, stacklevel=3)
                self.emit(Event(step=info.step, kind=Kind.RESUME, level=Level.WARNING, message=msg, signal="resume"))
            return info.path, payload
        raise CheckpointError(f"no readable clean checkpoint in {self.checkpoints.directory}: " + "; ".join(errors))

    def close(self) -> None:
        """Finish the snapshot in flight; wait for a background checkpoint write (raises its error)."""
        self._settle(block=True)
        if self.checkpoints is not None:
            self.checkpoints.close()
