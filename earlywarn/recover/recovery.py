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
The steps its messages name are on the run's clock (``run_step``: the watcher's
:class:`~earlywarn.guard.telemetry.RunClock`, which never goes back); its events carry training
steps, which the watcher puts on that clock.

The parts, each in its module: the copies and their cadence (:mod:`.snapshots`), the batch
history and blame (:mod:`.history`), the quarantine (:mod:`.quarantine`), the clean window
(:mod:`.window`), the rewind target (:mod:`.target`), the rewind (:mod:`.rewind`), recurrences
(:mod:`.recurrence`). This class holds them together and is what the watcher drives.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from ..capture.updates import learning_rate
from ..events import DRY_RUN, Event, Kind, Level
from . import rewind as _rewind
from .forms import distributed_rank, refusal
from .holders import state_of, state_view
from .hostcopy import fence_copies
from .checkpoint import CheckpointManager, load_checkpoint
from .config import SINCE_SNAPSHOT, RecoveryConfig
from .data import BatchFingerprints, BatchRef, DataPositionAdapter, _Unrestorable, data_position_adapter
from .errors import CheckpointError, DataPositionError
from .history import BatchHistory
from .quarantine import Quarantine, quarantine_path
from .records import Blame, QuarantineRecord, RewindReport, _blame_dict, _name_batch
from .lrceiling import LrCeiling
from .recurrence import Recurrence
from .repair import FiniteBaseline, RepairReport, StateScan, repair_optimizer_state, scan_state
from .snapshot import SnapshotRing
from .snapshots import LiveState, SnapshotKeeper, checkpoint_dir
from .window import CleanWindow

__all__ = ["Blame", "QuarantineRecord", "Recovery", "RecoveryConfig", "RewindReport", "SINCE_SNAPSHOT"]


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
    (repair, checkpoint, rewind, quarantine, resume). ``run_step``: a training step on the run's
    clock, for the steps messages name (the watcher's ``RunClock.run``; default: unchanged).
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
        run_step: Callable[[int], int] = int,
    ) -> None:
        self.config = cfg = config if config is not None else RecoveryConfig()
        # state no copy can read (a tensor subclass outside torch's traceable protocol): refused here
        # while snapshots or checkpoints would copy it, never met as an error inside a step
        why = refusal(optimizer, state_of(state_view(optimizer)), copies=bool(cfg.every or cfg.checkpoint_dir))
        if why is not None:
            raise ValueError(why)
        self.live = _live_state(model, optimizer, scheduler, scaler, extra_state, keep_on_rewind, late_state)
        self.emit = emit
        self.run_step = run_step
        adapter = data_position_adapter(loader)
        self.data: DataPositionAdapter = adapter if adapter is not None else _Unrestorable(
            "no data loader was given (earlywarn.watch(..., loader=...)): pass an earlywarn.ResumableLoader "
            "or a torchdata StatefulDataLoader so that positions can be restored"
        )
        self._rank = distributed_rank()  # fixed for the run (checked per step: settle at the same step on every rank)
        # the model's own non-finite values (a -inf causal mask buffer), as of now: not poison
        self.baseline = FiniteBaseline.capture(model)
        self.fingerprints = BatchFingerprints(cfg.history)
        self.history = BatchHistory(self.data, self.fingerprints, cfg.history)
        self.window = CleanWindow(cfg.clean_window)
        self.snapshots = SnapshotKeeper(cfg, self.live, self.data, self.history, self.baseline, rank=self._rank,
                                        emit=emit, run_step=run_step, recovery_state=self.state_dict,
                                        on_poisoned=self._poisoned)
        self.quarantine_log = Quarantine(quarantine_path(cfg, checkpoint_dir(cfg, self._rank), self._rank))
        self.recurrence = Recurrence(optimizer, factor=cfg.recurrence_lr_factor, lr_steps=cfg.recurrence_lr_steps,
                                     history=cfg.history, window=self.window, run_step=run_step)
        self.lr_ceiling = LrCeiling(optimizer)
        self.rewinds = 0
        self.repairs = 0
        self.unrepaired: RepairReport | None = None
        """The last repair left the optimizer state (or parameters) non-finite: no update may read
        it, the watcher rewinds first. A rewind or a repair that made everything finite clears it."""
        self.dry_run = False
        """Watch without acting (``watch(dry_run=True)``): :meth:`repair` scans and says what it
        would have done; nothing is written."""

    # -- the parts, as the watcher, tests and tools know them ------------------------------------
    @property
    def ring(self) -> SnapshotRing | None:
        """The in-memory snapshots (``None`` when off)."""
        return self.snapshots.ring

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The disk checkpoints (``None`` without ``checkpoint_dir``)."""
        return self.snapshots.checkpoints

    @property
    def quarantine(self) -> list[QuarantineRecord]:
        """Every batch quarantined so far."""
        return self.quarantine_log.records

    @property
    def quarantine_path(self) -> Path:
        return self.quarantine_log.path

    @property
    def model(self) -> torch.nn.Module:
        return self.live.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.live.optimizer

    @property
    def plan(self) -> str:
        """The snapshot plan in one sentence (cadence, ring, host RAM): what ``watch()`` reports."""
        return self.snapshots.plan

    def report_plan(self, step: int = 0, *, write: Callable[[str], None] | None = None) -> None:
        """Say the snapshot plan once (the watcher does, when its sinks exist): a note on the
        console (``write``, the console sink's; nothing without one) and, when it is short of
        memory, a Python warning too. Not an event: it is no checkpoint, and no incident."""
        self.snapshots.report_plan(write)

    @property
    def lr_factor(self) -> float:
        """The factor applied to the learning rate now (1.0 unless ``on_recurrence="lower_lr"`` acts)."""
        return self.recurrence.lr_factor

    # -- per step ------------------------------------------------------------------------------
    def record_step(self, step: int, *, maybe_clean: bool = True, building: bool = False) -> None:
        """The update of ``step`` has just been applied (or skipped), and it may not be judged yet:
        in async mode the watcher calls this when the update is queued and :meth:`after_step`
        once the step's statistics have been read. Records the batch drawn for the step and,
        when a snapshot or checkpoint is due (every ``config.every`` steps, ``every_building``
        while an episode builds) and ``maybe_clean`` (nothing known so far makes the step
        unclean), starts a host copy of the state *as of this step*. It stays provisional until
        ``after_step(step, clean=True)`` confirms it and its device finiteness flag has been read
        (one step late: no host sync); one is in flight at a time."""
        self.history.record(step)
        # Under torch.distributed every rank settles here, at the same step (waiting if the copy
        # is still in flight): what may follow is a collective (scan, repair).
        self.snapshots.settle(block=self._rank is not None)
        self.snapshots.start_due(step, building=building, clean=maybe_clean and self.window.clean(step))

    def after_step(self, step: int, *, clean: bool, building: bool = False) -> None:
        """Call after every optimizer step (applied or skipped). ``clean``: no incident within
        ``config.clean_window`` steps. ``building``: an episode may be building (recent alerts,
        the run's signals elevated): snapshots come at ``every_building``. Takes the periodic snapshot /
        checkpoint when due and clean (a due one waits for the first clean step). A step already
        given to :meth:`record_step` is only judged here."""
        seen = self.history.last_step
        if seen is None or step > seen:
            self.record_step(step, maybe_clean=clean, building=building)
        clean = clean and self.window.clean(step)
        lr = learning_rate(self.optimizer)
        taken = self.effective_lr(lr)  # what this step stepped with (before a warming ceiling rises)
        if self.lr_ceiling.after_step(lr, calm=clean and not building):
            self.emit(Event(step=step, kind=Kind.LR_RELEASE, level=Level.INFO, signal="lr_ceiling",
                            message=f"the loop's learning rate has stayed within {self.lr_ceiling.release:g}x earlywarn's "
                                    f"ceiling for {self.lr_ceiling.settle} steps: earlywarn no longer holds it down",
                            values={"lr_ceiling": math.nan}))
        if self.recurrence.after_step(step, taken, clean=clean):
            self.emit(Event(step=step, kind=Kind.LR_RELEASE, level=Level.INFO, signal="lr_factor",
                            message=f"the lowered learning rate ended after {self.config.recurrence_lr_steps} "
                                    "steps: the optimizer steps at the loop's learning rate again",
                            values={"lr_factor": 1.0}))
        self.snapshots.judged(step, clean)

    def quiet_steps(self, step: int, k: int, *, clean: Callable[[int], bool], building: Callable[[int], bool]) -> int:
        """How many of the ``k`` steps from ``step`` on have nothing for :meth:`after_step` to do
        but record the step (the guard's calm steps): no snapshot or checkpoint due or in flight,
        no learning-rate ceiling or lowered learning rate in force, no episode open, no repair
        left unfinished (:attr:`unrepaired`). ``clean`` /
        ``building``: what :meth:`after_step` would be told of each step, windows after a step
        (:func:`~earlywarn.recover.window.within`): clean and not building at a step, so at every
        later one."""
        if self.lr_ceiling.ceiling is not None or not self.recurrence.quiet or self.copying \
                or self.unrepaired is not None:  # (a repair left state non-finite: the next update is the judge's)
            return 0
        seen = self.history.last_step
        due, window = self.snapshots.due, self.window
        if (seen is None or step > seen) and clean(step) and window.clean(step) and not building(step):
            # the usual case: so for every step after it too, and the first one due decides
            # (the loop below, without its ~10 calls a step)
            first = self.snapshots.next_due(step)
            return k if first is None else min(k, first - step)
        for j in range(k):
            s = step + j
            # (a step recorded already, when its update was queued in async mode, starts nothing)
            if (seen is None or s > seen) and clean(s) and window.clean(s) and due(s, building(s)):
                return j
        return k

    @property
    def copying(self) -> bool:
        """A snapshot or checkpoint copy is in flight (not yet confirmed and kept)."""
        return self.snapshots.copying

    def calm_step(self, step: int, lr: float | None) -> None:
        """:meth:`after_step` of a step :meth:`quiet` said has nothing else due: the batch it drew
        recorded, and ``lr``, the learning rate it was taken with (no ceiling or factor applies)."""
        seen = self.history.last_step
        if seen is None or step > seen:
            self.history.record(step)
        self.recurrence.record_lr(step, lr)

    def settle(self) -> None:
        """Finish the snapshot in flight, if any (waits for its copy): the ring is then current."""
        self.snapshots.settle(block=True)

    def _poisoned(self, snap_step: int) -> None:
        """A copy's finiteness check failed: what is poisoned now is repaired (rare path)."""
        scan = self.scan()
        if scan.clean:
            return
        seen = self.history.last_step
        self.repair(seen if seen is not None else snap_step, scan=scan)  # (repair disabled: said, and rewound)

    def checkpoint(self, step: int, reason: str, *, clean: bool = False) -> str | None:
        """Save now, e.g. on a warning while parameters are still finite. Kept as *unclean*
        (an alert came): used as a rewind target only when no clean one exists -- unless the
        caller knows the state is clean (``clean``: a copy taken before the update of an LR jump,
        with no incident before it).

        Call it either before step ``step``'s update (the watcher does: the batch drawn for it
        is then recorded as not yet trained, and the snapshot is labelled ``step - 1``) or after
        ``after_step(step)`` / ``record_step(step)`` (labelled ``step``, or the last recorded step
        when that is later: the label is always the step of the state it holds). Returns the disk
        path, or ``"memory:<step>"`` without a checkpoint directory (that step on the run's
        clock), or ``None`` when snapshots and checkpoints are off."""
        return self.snapshots.checkpoint(step, reason, clean=clean)

    # -- blame and quarantine ------------------------------------------------------------------
    def batch_at(self, step: int) -> BatchRef | None:
        """The batch drawn for ``step`` (for the step in progress: the batch just drawn), with
        its fingerprint when known (one host read)."""
        return self.history.batch_at(step)

    def blame(self, step: int, *, layer: str | None = None, symptom: str | None = None,
              symptom_step: int | None = None, role: str = "the batch responsible") -> Blame:
        """Name the batch of ``step`` as responsible, e.g. ``blame(t, layer="h.3.attn",
        symptom="the loss turned NaN", symptom_step=t + 1)``."""
        return self.history.blame(step, layer=layer, symptom=symptom, symptom_step=symptom_step, role=role)

    def last_batch(self) -> BatchRef | None:
        """The batch most recently drawn from the loader (``None`` when unknown)."""
        return self.history.last_batch()

    def quarantine_batch(self, step: int, reason: str, *, note: str = "") -> QuarantineRecord:
        """A bad batch was skipped at ``step``: record it (JSONL + event) as never trained.
        ``note``: what the event adds (why it is the batch's fault, what was done)."""
        ref = self.batch_at(step)
        rec = self.quarantine_log.skipped(step, reason, ref)
        self.emit(Event(step=step, kind=Kind.QUARANTINE, level=Level.WARNING, signal=reason,
                        message=f"quarantined {_name_batch(ref, self.run_step(step))[0]}: {reason}{note}; it is "
                                f"never trained -> {self.quarantine_path}",
                        values={"batches": 1.0}, batch=rec.batch_index))
        return rec

    # -- repair --------------------------------------------------------------------------------
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
        self.settle()  # a snapshot still in flight is the newest copy source
        fence_copies()  # and none may still be reading what the repair writes
        scan = scan if scan is not None else self.scan()
        if scan.clean:
            self.unrepaired = None
            return RepairReport(scan, [], [], scan, step)
        cfg = self.config
        if self.dry_run:
            self.emit(Event(step=step, kind=Kind.REPAIR, level=Level.CRITICAL, signal="optimizer_state",
                            message=f"{DRY_RUN}repaired {scan.summary()}" if cfg.repair else
                                    f"{DRY_RUN}found {scan.summary()} (repair disabled)",
                            layers=tuple(dict.fromkeys(f.name for f in scan.flags)),
                            values={"tensors": float(len(scan.flags)),
                                    "elements": float(sum(f.nonfinite for f in scan.flags)), "ok": 0.0,
                                    "repaired": 0.0, "dry_run": 1.0}))
            return RepairReport(scan, [], [], scan, step)
        if not cfg.repair:
            report = RepairReport(scan, [], [], scan, step)
        else:
            snap: Any = self.ring.latest(clean_only=True) if self.ring is not None else None
            if snap is None and self.baseline.copies:
                snap = {"model": self.baseline.copies}
            report = repair_optimizer_state(
                self.optimizer, scan, snapshot=snap, reset_state=cfg.repair_reset_state,
                max_param_fraction=cfg.repair_max_param_fraction, model=self.model, step=step,
                baseline=self.baseline,
            )
            self.repairs += 1
        if incident:
            self.window.incident(step)
        left = report.after if report.after is not None else scan
        self.unrepaired = report if left.state or left.params else None
        values = {"tensors": float(len(scan.flags)), "elements": float(sum(f.nonfinite for f in scan.flags)),
                  "ok": float(report.ok), "repaired": float(len(report.repaired))}
        self.emit(Event(step=step, kind=Kind.REPAIR, level=Level.WARNING if report.ok else Level.CRITICAL,
                        message=report.summary() if cfg.repair else "repair disabled: " + scan.summary(),
                        signal="optimizer_state", layers=tuple(dict.fromkeys(f.name for f in scan.flags)),
                        values=values))
        return report

    # -- rewind --------------------------------------------------------------------------------
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
        weights that produced them are too, and no NaN/Inf needs looking for). The phases are
        in :mod:`earlywarn.recover.rewind`."""
        report = _rewind.rewind(self, step, reason, blame=_blame_dict(blame, self.run_step), onset=onset, scan=scan,
                                known_finite=known_finite)
        self.unrepaired = None  # the restored state was finite when copied
        return report

    def recurrence_of(self, step: int, reason: str) -> str | None:
        """The diagnosis of an incident at ``step`` if it is a recurrence (a rewind's episode is
        still open: it has not held yet), else ``None``."""
        ep = self.recurrence.episode
        if ep is None:
            return None
        keys = self.history.keys(list(range(ep.last_target + 1, step + 1)))
        fresh = not self.data.restorable and not self.config.rewind_restore_rng
        return self.recurrence.diagnose(step, reason, keys, fresh_draws=fresh)

    def lr_trend(self, step: int) -> str:
        """The learning rate's trend over the open episode (see :class:`~earlywarn.recover.recurrence.Recurrence`)."""
        return self.recurrence.lr_trend(step)

    def describe_rewinds(self) -> str:
        """The recent rewinds, for a halt message: 'at step 152 (loss_diverged) to step 125, ...'."""
        return self.recurrence.describe_rewinds()

    def wrap_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the learning rate a recurrence lowered, and the ceiling an LR-caused
        instability set, applied around it (see :class:`~earlywarn.recover.recurrence.Recurrence`
        and :class:`~earlywarn.recover.lrceiling.LrCeiling`)."""
        return self.lr_ceiling.wrap_step(self.recurrence.wrap_step(step_fn))

    def lr_at(self, step: int) -> float | None:
        """The learning rate training step ``step`` took (the largest over param groups, with
        earlywarn's ceiling and lowered factor applied)."""
        return self.recurrence.lr_at(step)

    def hold_lr(self, ceiling: float, *, rewarm: bool = False) -> None:
        """Step at no more than ``ceiling`` while the loop's learning rate stays above it
        (``rewarm``: the ceiling warms back up on calm steps, see :mod:`.lrceiling`)."""
        self.lr_ceiling.hold(ceiling, rewarm=rewarm)

    def effective_lr(self, lr: float | None) -> float | None:
        """The learning rate the optimizer really steps with when the loop's is ``lr``."""
        if lr is None:
            return None
        if self.lr_ceiling.ceiling is None:  # (most steps: the factor would be 1.0, and lr * 1.0 is lr)
            return lr * self.recurrence.lr_factor
        return lr * self.lr_ceiling.factor(lr) * self.recurrence.lr_factor

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "rewinds": self.rewinds,
            "repairs": self.repairs,
            **self.recurrence.state_dict(),
            **self.lr_ceiling.state_dict(),
            "quarantine": [q.to_dict() for q in self.quarantine],
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.rewinds = int(d.get("rewinds", 0))
        self.repairs = int(d.get("repairs", 0))
        self.recurrence.load_state_dict(d)
        self.lr_ceiling.load_state_dict(d)
        self.quarantine_log.records = [QuarantineRecord.from_dict(q) for q in d.get("quarantine", [])]

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
            self.live.restore(state)
            if state.get("recovery") is not None:
                self.load_state_dict(state["recovery"])
            step = int(payload["step"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
            raise CheckpointError(
                f"{path} does not fit this run ({type(e).__name__}: {e}); the model, optimizer or "
                "objects restored may be partly overwritten: rebuild them and resume from a checkpoint "
                "of this model") from e
        self.history.reset(step)
        self.snapshots.resumed(step)
        self.unrepaired = None
        self.emit(Event(step=step, kind=Kind.RESUME, level=Level.INFO,
                        message=f"resumed from {path} at step {self.run_step(step)}", signal="resume"))
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
                self.emit(Event(step=info.step, kind=Kind.CHECKPOINT_FAILED, level=Level.WARNING, message=msg,
                                signal="checkpoint_read", values={"failures": float(len(errors))}))
            return info.path, payload
        raise CheckpointError(f"no readable clean checkpoint in {self.checkpoints.directory}: " + "; ".join(errors))

    def close(self) -> None:
        """Finish the snapshot in flight; wait for a background checkpoint write (raises its error)."""
        self.snapshots.close()


def _live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                extra_state: Mapping[str, Any] | None, keep_on_rewind: Iterable[str],
                late_state: Iterable[str]) -> LiveState:
    extra = dict(extra_state or {})
    for k, v in extra.items():
        if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict")):
            raise TypeError(f"extra_state[{k!r}] ({type(v).__name__}) needs state_dict() and load_state_dict()")
    keep = frozenset(keep_on_rewind)
    unknown = sorted(keep - set(extra))
    if unknown:
        raise ValueError(f"keep_on_rewind names {unknown}, which are not in extra_state ({sorted(extra)})")
    return LiveState(model, optimizer, scheduler, scaler, extra, keep, frozenset(late_state))
