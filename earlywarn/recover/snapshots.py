"""The copies a rewind can go back to: in-memory snapshots (the ring) and disk checkpoints.

Periodic copies are taken when due -- every ``RecoveryConfig.every`` steps, ``every_building``
while an episode builds, ``checkpoint_every`` for disk -- and clean. A copy starts as soon as its
update is applied and stays *provisional* until its step is judged clean and its device
finiteness flag has been read (one step late: no host sync); one is in flight at a time. Warning
copies are taken on demand and kept as unclean. The memory plan sizes the ring once, from an
estimate, and again from the first copy measured. Steps are the training trajectory's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..events import Event, Kind, Level
from .forms import distributed_rank
from .hostcopy import to_host
from .restore import call_state_dict
from .budget import plan_snapshots
from .checkpoint import CheckpointManager, _agree
from .config import RecoveryConfig
from .data import DataPositionAdapter
from .errors import UnreadableState
from .history import BatchHistory
from .repair import FiniteBaseline
from .snapshot import Snapshot, SnapshotRing, capture_state, restore_state
from .target import Candidate


@dataclass(frozen=True)
class LiveState:
    """What a snapshot copies and a rewind or resume restores. ``keep_on_rewind``: names in
    ``extra_state`` a rewind does not roll back; ``late_state``: names whose state follows the
    judgement of a step, copied when a periodic snapshot's step is judged (see :class:`Recovery`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    extra_state: Mapping[str, Any]
    keep_on_rewind: frozenset[str]
    late_state: frozenset[str]

    def capture(self, step: int, data: dict[str, Any] | None, *, late: bool = True, **kw: Any) -> Any:
        """A host copy of the state as of now (``late=False``: without ``late_state``)."""
        extra = self.extra_state if late else {k: v for k, v in self.extra_state.items() if k not in self.late_state}
        return capture_state(step, **self.parts(data), extra=extra, **kw)

    def parts(self, data: dict[str, Any] | None = None) -> dict[str, Any]:
        return dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                    data=data)

    def late(self) -> dict[str, Any]:
        """The ``late_state`` objects' state now."""
        return {k: call_state_dict(v, f"extra_state[{k!r}]") for k, v in self.extra_state.items()
                if k in self.late_state}

    def restore(self, state: Mapping[str, Any], *, rng: bool = True, rewind: bool = False) -> None:
        """Put ``state`` back in place (a rewind leaves ``keep_on_rewind`` as it is)."""
        extra = {k: v for k, v in self.extra_state.items() if not (rewind and k in self.keep_on_rewind)}
        restore_state(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                      scaler=self.scaler, rng=rng, extra=extra)


def checkpoint_dir(cfg: RecoveryConfig, rank: int | None) -> Path | None:
    """``cfg.checkpoint_dir``; per-rank writers under torch.distributed get ``rank<r>`` in it
    (one writer per directory)."""
    if cfg.checkpoint_dir is None:
        return None
    path = Path(cfg.checkpoint_dir)
    return path / f"rank{rank}" if rank is not None and not cfg.collective else path


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


class SnapshotKeeper:
    """The ring (``ring``, ``None`` when in-memory snapshots are off) and the disk checkpoints
    (``checkpoints``, ``None`` without ``checkpoint_dir``), and when each copy is due.

    ``emit``: events (checkpoints written or failed); ``run_step``: a training step on the run's
    clock (for messages); ``recovery_state``: what a disk checkpoint saves of the recovery layer;
    ``on_poisoned(step)``: a copy's finiteness check failed (the live state may be poisoned)."""

    def __init__(self, cfg: RecoveryConfig, live: LiveState, data: DataPositionAdapter, history: BatchHistory,
                 baseline: FiniteBaseline, *, rank: int | None, emit: Callable[[Event], None],
                 run_step: Callable[[int], int], recovery_state: Callable[[], dict[str, Any]],
                 on_poisoned: Callable[[int], None]) -> None:
        self.config = cfg
        self.live = live
        self.data = data
        self.history = history
        self.baseline = baseline
        self.rank = rank  # fixed for the run: every rank settles at the same step
        self.emit = emit
        self.run_step = run_step
        self.recovery_state = recovery_state
        self.on_poisoned = on_poisoned
        self.ring = SnapshotRing(cfg.snapshot_keep, keep_unclean=1) if cfg.every > 0 else None
        ckpt_dir = checkpoint_dir(cfg, rank)
        self.checkpoints = (
            CheckpointManager(ckpt_dir, keep=cfg.checkpoint_keep, keep_unclean=1,
                              async_write=cfg.checkpoint_async, save_fn=cfg.save_fn, load_fn=cfg.load_fn,
                              collective=cfg.collective)
            if ckpt_dir is not None else None
        )
        if self.checkpoints is not None:
            self.checkpoints.on_failure = self._checkpoint_failed
        self.last_snapshot: int | None = None  # the step of the last periodic snapshot (None: due now)
        self.last_checkpoint = 0  # disk checkpoints at checkpoint_every, 2x, ... (or after a resume)
        self._provisional: _Provisional | None = None  # the snapshot being copied / confirmed
        self._spare: Any = None  # host buffers of the last evicted snapshot, for the next copy
        self._measured = False
        self._note: Callable[[str], None] | None = None  # the console's, for the plan and its revisions
        self.snapshot_plan = None
        if self.ring is not None:
            self.snapshot_plan = plan_snapshots(cfg, live.model, live.optimizer)
            if self.snapshot_plan.clean:
                self.ring.set_capacity(self.snapshot_plan.clean, self.snapshot_plan.unclean)
            else:
                self.ring = None

    # -- the memory plan -----------------------------------------------------------------------
    @property
    def plan(self) -> str:
        """The snapshot plan in one sentence (cadence, ring, host RAM)."""
        if self.snapshot_plan is None:
            where = f"disk checkpoints in {self.config.checkpoint_dir}" if self.config.checkpoint_dir else "nothing"
            return f"in-memory snapshots are off (snapshot_every=0): rewinds use {where}"
        return self.snapshot_plan.message

    def report_plan(self, write: Callable[[str], None] | None) -> None:
        """Say the plan once: a note through ``write`` and, when short of memory, a warning."""
        self._note = write
        self._say(self.plan, self.snapshot_plan is not None and self.snapshot_plan.level >= Level.WARNING)

    def _say(self, text: str, warn: bool) -> None:
        if self._note is not None:
            self._note(f"[earlywarn] {text}")
        if warn:
            warnings.warn(f"earlywarn: {text}", RuntimeWarning, stacklevel=4)

    def _check_budget(self, snap: Snapshot) -> None:
        """The first snapshot measures what the estimate guessed; shrink the ring if it must."""
        if self._measured or self.ring is None or self.snapshot_plan is None:
            return
        self._measured = True
        note = self.snapshot_plan.refit(snap.nbytes)
        if note is not None:
            self.ring.set_capacity(self.snapshot_plan.clean, self.snapshot_plan.unclean)
            self._say(note, True)

    # -- periodic copies -----------------------------------------------------------------------
    def start_due(self, step: int, *, building: bool, clean: bool) -> None:
        """Start the host copy of the state as of ``step`` when a snapshot or checkpoint is due
        and ``clean`` (nothing known so far makes the step unclean); none while one is in flight."""
        if self._provisional is not None:
            return
        snap_due, ckpt_due = self._due(step, building)
        if not (snap_due or ckpt_due) or not clean:
            return
        # A snapshot is only clean if what the optimizer writes is finite: the flag is computed on
        # the device beside the copy and read once it has landed. Poisoned state that no alert
        # caught is repaired then.
        try:
            host = self.live.capture(step, self._data_state(), late=False, reuse=self._spare, check_finite=True)
        except UnreadableState as e:
            self._copies_off(step, e)
            return
        self._spare = None
        snap = Snapshot(step=step, clean=True, reason="building" if building else "periodic", host=host,
                        building=building)
        self._provisional = _Provisional(snap, snap_due, ckpt_due, self.last_snapshot, self.last_checkpoint)
        if snap_due:  # not due again while this one is in flight
            self.last_snapshot = step
        if ckpt_due:
            self.last_checkpoint = step

    def _due(self, step: int, building: bool) -> tuple[bool, bool]:
        """Whether a snapshot, and a checkpoint, are due at ``step``."""
        cfg = self.config
        last = self.last_snapshot
        every = cfg.every_building if building else cfg.every
        snap_due = self.ring is not None and (last is None or step - last >= every or step < last)
        ckpt_due = self.checkpoints is not None and step - self.last_checkpoint >= cfg.checkpoint_every
        return snap_due, ckpt_due

    def due(self, step: int, building: bool) -> bool:
        """A snapshot or checkpoint is due at ``step``: :meth:`start_due` starts one there if clean."""
        return any(self._due(step, building))

    def next_due(self, step: int) -> int | None:
        """The first step from ``step`` on at which :meth:`due` is true while nothing builds
        (``None``: none), as long as nothing is started before it."""
        cfg = self.config
        first = None
        if self.ring is not None:
            last = self.last_snapshot
            first = step if last is None or step < last else max(step, last + cfg.every)
        if self.checkpoints is not None:
            c = max(step, self.last_checkpoint + cfg.checkpoint_every)
            first = c if first is None else min(first, c)
        return first

    @property
    def copying(self) -> bool:
        """A copy is in flight (started, not yet confirmed and kept)."""
        return self._provisional is not None

    def judged(self, step: int, clean: bool) -> None:
        """``step`` was judged (``clean``: no incident within the clean window): confirm or drop
        the copy in flight, and settle it once it has landed."""
        p = self._provisional
        if p is not None and not p.judged and p.snap.step <= step:
            if p.snap.step < step or not clean:
                self._drop(p)  # its step was not clean (or never judged: a repair or rewind path)
            else:
                p.judged = True
                # The watcher's own bookkeeping (detector, policy, counters) as of this step: in
                # async mode it has only now seen the step whose state the copy holds.
                p.snap.host.tree["extra"].update(to_host(self.live.late()).tree)
        p = self._provisional
        if p is not None and p.judged and p.to_disk:
            self.settle(block=True)  # a disk write needs the copy anyway: now, at its step
        elif self.rank is None:
            self.settle(block=False)

    def settle(self, *, block: bool) -> None:
        """Keep the confirmed copy once it has landed (``block``: wait for it) and proved finite."""
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
        self.on_poisoned(p.snap.step)

    def drop_unjudged(self) -> None:
        """A copy never judged (taken at or after an incident's step) is no candidate."""
        if self._provisional is not None:
            self._drop(self._provisional)

    def _keep(self, p: _Provisional) -> None:
        snap = p.snap
        if p.to_ring:
            assert self.ring is not None
            before = self.ring.entries
            self.ring.add(snap)
            kept = {id(s) for s in self.ring.entries}
            # the evicted snapshot's buffers take the next copy (no fresh host memory per snapshot)
            self._spare = next((s.host for s in before if id(s) not in kept and s.clean and s.pinned == 0), None)
            self.baseline.refresh(self.live.model)  # the last known-good buffers (new or resized ones)
            self._check_budget(snap)
        if p.to_disk:
            self._save_disk(snap, snap.step, clean=True, reason="periodic")

    def _drop(self, p: _Provisional) -> None:
        if self._provisional is p:
            self._provisional = None
        if p.to_ring:
            self.last_snapshot = p.prev_snapshot_step  # due again
        if p.to_disk:
            self.last_checkpoint = p.prev_checkpoint_step
        if p.snap.host.ready():  # buffers no copy writes any more: the next snapshot reuses them
            self._spare = p.snap.host

    def _data_state(self, pending: int = 0) -> dict[str, Any] | None:
        return self.data.state_dict(pending) if self.data.restorable else None

    # -- copies on demand ----------------------------------------------------------------------
    def checkpoint(self, step: int, reason: str, *, clean: bool = False) -> str | None:
        """A copy now, kept as unclean unless ``clean`` (see :meth:`Recovery.checkpoint`)."""
        if self.ring is None and self.checkpoints is None:
            return None
        seen = self.history.last_step
        # the state's own step: step - 1 before this step's update, step after it, or later
        # (async mode reads a warning after more updates were applied)
        label = step - 1 if seen is None else max(seen, step - 1)
        data = self._data_state(self.history.pending())
        try:
            if self.ring is not None:
                snap = self.ring.capture(label, clean=clean, reason=reason, **self.live.parts(data),
                                         extra=self.live.extra_state)
            else:
                snap = Snapshot(step=label, clean=clean, reason=reason, host=self.live.capture(label, data))
        except UnreadableState as e:
            self._copies_off(step, e)
            return None
        if self.checkpoints is not None:
            return self._save_disk(snap, label, clean=clean, reason=reason)
        name = self.memory_name(label)
        self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                        message=f"in-memory snapshot ({reason}) of the state after step {self.run_step(label)}",
                        signal=reason, values={"clean": float(clean)}, path=name))
        return name

    def memory_name(self, step: int) -> str:
        """How events and messages name the in-memory snapshot of training step ``step``:
        ``memory:<that step on the run's clock>``."""
        return f"memory:{self.run_step(step)}"

    def _save_disk(self, snap: Snapshot, step: int, *, clean: bool, reason: str) -> str:
        assert self.checkpoints is not None
        snap.host.tree["recovery"] = self.recovery_state()
        snap.pinned += 1

        def done() -> None:
            snap.pinned -= 1

        path = self.checkpoints.save(snap.host, step, clean=clean, reason=reason, on_done=done)
        if path is not None:
            self.emit(Event(step=step, kind=Kind.CHECKPOINT, level=Level.INFO,
                            message=f"checkpoint ({reason}{', clean' if clean else ''}) -> {path}",
                            signal=reason, values={"clean": float(clean)}, path=str(path)))
        return path

    def _copies_off(self, step: int, error: UnreadableState) -> None:
        """The state holds a tensor no copy can read (it appeared after ``watch()``, which refuses
        one it sees): snapshots and checkpoints are off from now, said once."""
        self.ring = self.checkpoints = self.snapshot_plan = None
        msg = (f"in-memory snapshots and disk checkpoints are off from step {self.run_step(step)}: the optimizer "
               f"state now holds a tensor no copy can read ({error}: not torch's traceable-subclass protocol). "
               "Nothing is left to rewind to: a collapse halts. Give the subclass __tensor_flatten__ / "
               "__tensor_unflatten__, or watch with RecoveryConfig(snapshot_every=0, rewind=False)")
        warnings.warn(f"earlywarn: {msg}", RuntimeWarning, stacklevel=2)
        self.emit(Event(step=step, kind=Kind.CHECKPOINT_FAILED, level=Level.WARNING, message=msg,
                        signal="unreadable_state", values={"failures": 1.0}))

    def _checkpoint_failed(self, path: Path, error: BaseException) -> None:
        errno = getattr(error, "errno", None)
        failures = self.checkpoints.failures if self.checkpoints else 0
        self.emit(Event(step=self.history.last_step or 0, kind=Kind.CHECKPOINT_FAILED, level=Level.WARNING,
                        message=f"checkpoint write failed: {path} ({type(error).__name__}"
                                f"{f' errno {errno}' if errno is not None else ''}: {error}); training goes on, "
                                f"{failures} failed so far",
                        signal="checkpoint_write", values={"failures": float(failures)}))

    # -- what a rewind sees and leaves ---------------------------------------------------------
    def candidates(self, before: int) -> list[Candidate]:
        """Copies taken before step ``before``, newest first; memory before disk at equal steps."""
        out: list[tuple[int, bool, int, Any]] = []
        if self.ring is not None:
            out += [(s.step, s.clean, 1, s) for s in self.ring.entries if s.step < before]
        if self.checkpoints is not None:
            self.checkpoints.wait()
            out += [(c.step, c.clean, 0, c) for c in self.checkpoints.list() if c.step < before]
        out.sort(key=lambda x: (x[0], x[2]), reverse=True)
        return [Candidate(s, c, src) for s, c, _, src in out]

    def load(self, source: Any) -> tuple[Mapping[str, Any], str]:
        """A candidate's state and how a message names where it came from."""
        if isinstance(source, Snapshot):
            return source.state, self.memory_name(source.step)
        assert self.checkpoints is not None
        return self.checkpoints.load(source)["state"], str(source.path)

    def forget_after(self, step: int) -> None:
        """A rewind to the state of ``step``: the copies after it are of an undone trajectory, and
        the cadence counts from ``step``."""
        self.last_snapshot = step
        self.last_checkpoint = min(self.last_checkpoint, step)
        if self.ring is not None:
            self.ring.drop_after(step)
        if self.checkpoints is not None:
            self.checkpoints.discard_after(step)

    def resumed(self, step: int) -> None:
        """A resume at ``step``: snapshot at the next step (rewinds work right away)."""
        self.last_snapshot = None
        self.last_checkpoint = step
        if self.ring is not None:
            self.ring.clear()
        self._provisional = self._spare = None

    def close(self) -> None:
        """Finish the copy in flight; wait for a background checkpoint write (raises its error)."""
        self.settle(block=True)
        if self.checkpoints is not None:
            self.checkpoints.close()
