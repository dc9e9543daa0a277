"""The rewind (:meth:`Recovery.rewind`), in the order it happens:

1. ``escalate``: an incident before the previous rewind held is a recurrence -- diagnosed, and
   halted or let through per ``on_recurrence`` / ``max_rewinds_per_episode``;
2. ``choose_target``: the copies there are, what the incident left (a state scan), and the
   newest clean copy from before it began (:func:`~earlywarn.recover.target.pick_target`);
3. ``move_data``: the loader past the batches to skip -- first, so that a refusal leaves the
   model untouched;
4. ``restore``: the state, in place, and no gradients;
5. ``forget_after``: what came after the target (its copies, batches, the clean window) and the
   quarantine of its batches;
6. ``announce``: the message, the report and the events.

Steps are the training trajectory's; the steps a message names are on the run's clock
(``Recovery.run_step``), converted before the watcher's clock takes the rewind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from ..events import Event, Kind, Level
from .config import SINCE_SNAPSHOT, RecoveryConfig
from .data import DataPositionAdapter, ResumableAdapter
from .errors import DataPositionError, Halt
from .history import BatchHistory
from .quarantine import Quarantine
from .records import QuarantineRecord, RewindReport, _capital, _ranges, _record_key
from .recurrence import Recurrence
from .repair import StateScan
from .snapshots import LiveState, SnapshotKeeper
from .target import Target, pick_target
from .window import CleanWindow


class Rewinding(Protocol):
    """What a rewind reads and writes of the recovery layer (:class:`~earlywarn.recover.Recovery`
    is one): its parts, and the few answers it gives."""

    config: RecoveryConfig
    live: LiveState
    data: DataPositionAdapter
    history: BatchHistory
    window: CleanWindow
    snapshots: SnapshotKeeper
    quarantine_log: Quarantine
    recurrence: Recurrence
    rewinds: int
    emit: Callable[[Event], None]
    run_step: Callable[[int], int]

    @property
    def quarantine_path(self) -> Path: ...

    @property
    def lr_factor(self) -> float: ...

    def scan(self) -> StateScan: ...

    def recurrence_of(self, step: int, reason: str) -> str | None: ...


def rewind(rec: Rewinding, step: int, reason: str, *, blame: dict[str, Any] | None, onset: int | None,
           scan: StateScan | None, known_finite: bool) -> RewindReport:
    """See :meth:`Recovery.rewind` (``blame``: its record, messages on the run's clock already)."""
    if not rec.config.rewind:
        raise halt(step, f"{reason} at step {rec.run_step(step)}; rewinding is disabled (RecoveryConfig.rewind="
                   "False): halting. Enable it, or resume from a checkpoint after fixing the cause.",
                   "rewind_disabled")
    diagnosis = escalate(rec, step, reason)
    rec.snapshots.settle(block=True)  # a confirmed snapshot still in flight is a candidate too
    rec.snapshots.drop_unjudged()
    # Async mode: updates applied after the incident step, before the watcher read it. Their
    # batches are not the incident's: trained again where the loader can seek, else quarantined.
    in_flight = rec.history.steps_after(step)
    if scan is None:
        scan = StateScan([], 0) if known_finite else rec.scan()  # what the incident left (rare path: one read)
    target = choose_target(rec, step, reason, onset, poisoned=not scan.clean)
    state, source = rec.snapshots.load(target.source)
    if blame is not None and not blame.get("layer") and scan.first_layer:
        blame["layer"] = scan.first_layer
        blame["message"] = f"{blame.get('message', '')}; first non-finite layer: {scan.first_layer}".lstrip("; ")
    refs = move_data(rec, step, reason, state, in_flight=bool(in_flight))
    live_lr = rec.recurrence.live_lr()  # the incident's: the restore puts the snapshot's back
    rng = restore(rec, state)
    records = forget_after(rec, target.step, step, reason, refs, last=max([step, *in_flight]), live_lr=live_lr)
    return announce(rec, step, reason, target, source, records, rng=rng, diagnosis=diagnosis, blame=blame,
                    scan=scan)


def halt(step: int, message: str, reason: str) -> Halt:
    # no HALT event here: whoever catches the Halt reports it once (the watcher does)
    return Halt(message, step=step, reason=reason)


def escalate(rec: Rewinding, step: int, reason: str) -> str | None:
    """The diagnosis when the incident at ``step`` is a recurrence (``None`` when it is not);
    raises :class:`Halt` when it may not be rewound again."""
    cfg = rec.config
    diagnosis = rec.recurrence_of(step, reason)
    ep = rec.recurrence.episode
    if diagnosis is None or ep is None:
        return None
    if cfg.on_recurrence == "halt":
        raise halt(step, f"{diagnosis} Halting (RecoveryConfig.on_recurrence='halt'): resume from the last "
                   "clean checkpoint with a lower learning rate, or set on_recurrence='lower_lr' to "
                   f"rewind and go on at {cfg.recurrence_lr_factor:g}x the learning rate for "
                   f"{cfg.recurrence_lr_steps} steps.", "recurrence")
    if ep.rewinds >= cfg.max_rewinds_per_episode:
        raise halt(step, f"{diagnosis} Halting: {ep.rewinds} rewinds in this episode (max_rewinds_per_episode="
                   f"{cfg.max_rewinds_per_episode}), the last at {ep.lr_factor:g}x the learning rate, did "
                   "not hold. Resume from the last clean checkpoint with a lower learning rate.",
                   "rewinds_exhausted")
    return diagnosis


def choose_target(rec: Rewinding, step: int, reason: str, onset: int | None, *, poisoned: bool) -> Target:
    """The copy to restore (raises :class:`Halt` when there is none)."""
    ep = rec.recurrence.episode
    target = pick_target(rec.snapshots.candidates(step), step, onset, ep.first_target if ep is not None else None,
                         poisoned=poisoned, run=rec.run_step)
    if target is None:
        raise halt(step, f"{reason} at step {rec.run_step(step)}; no snapshot or checkpoint to rewind to (the "
                   "first snapshot is taken at the first after_step): halting.", "no_clean_snapshot")
    return target


def move_data(rec: Rewinding, step: int, reason: str, state: Mapping[str, Any], *,
              in_flight: bool) -> list[Any] | None:
    """Move the loader to where training goes on; returns the batches it skipped (``None``:
    positions unknown). Raises :class:`Halt` when the data cannot be moved as configured."""
    skip = None if rec.config.rewind_skip_batches == SINCE_SNAPSHOT else int(rec.config.rewind_skip_batches)
    if skip is None and in_flight and isinstance(rec.data, ResumableAdapter):
        since = rec.data.since(state.get("data")) or []
        through = rec.history.skip_through(step, since)
        if through is not None:  # the data goes on right after the incident's batch, as in sync mode
            skip = through
    at = f"{reason} at step {rec.run_step(step)}"
    if skip is not None and not rec.data.restorable:
        raise halt(step, f"{at}; cannot rewind with rewind_skip_batches={skip}: {rec.data.why_not}",
                   "data_position")
    try:
        return rec.data.rewind(state.get("data"), skip)
    except DataPositionError as e:
        raise halt(step, f"{at}; cannot rewind the data exactly: {e}", "data_position") from e


def restore(rec: Rewinding, state: Mapping[str, Any]) -> bool:
    """Put the state back in place with no gradients (the current step's belong to the abandoned
    trajectory: they must not be applied). Returns whether the global RNGs were restored."""
    cfg = rec.config
    rng = cfg.rewind_restore_rng if cfg.rewind_restore_rng is not None else rec.data.restorable
    rec.live.restore(state, rng=rng, rewind=True)
    rec.live.optimizer.zero_grad(set_to_none=True)
    rec.live.model.zero_grad(set_to_none=True)
    return bool(rng)


def forget_after(rec: Rewinding, target: int, step: int, reason: str, refs: list[Any] | None, *, last: int,
                 live_lr: float | None) -> list[QuarantineRecord]:
    """The steps after ``target`` never happened: their copies, batches and clean-window marks go,
    their batches are quarantined (returned), the episode counts the rewind."""
    records = rec.quarantine_log.rewound_over(refs, rec.history, target, step, reason, last=last)
    rec.rewinds += 1
    rec.recurrence.rewound(step, target, reason, [k for k in map(_record_key, records) if k is not None],
                           live_lr=live_lr)
    rec.window.incident(target)
    rec.snapshots.forget_after(target)
    rec.history.forget_after(target)
    rec.quarantine_log.forget_after(target)
    rec.quarantine_log.add(records)
    return records


def announce(rec: Rewinding, step: int, reason: str, target: Target, source: str, records: list[QuarantineRecord],
             *, rng: bool, diagnosis: str | None, blame: dict[str, Any] | None, scan: StateScan) -> RewindReport:
    """The rewind's message (its steps on the run's clock), report and events."""
    cfg, run = rec.config, rec.run_step
    ep = rec.recurrence.episode
    assert ep is not None
    lost = step - target.step
    if rng:
        rng_txt = (f"the global RNGs were restored to step {run(target.step)} (the loader, not the RNG, picks the "
                   "batches)")
    elif rec.data.restorable:
        rng_txt = "the global RNGs were not restored (rewind_restore_rng=False)"
    else:
        rng_txt = ("the global RNGs were not restored: without a restorable loader they may be what draws the "
                   "batches, so they go on from where they are and the batches that follow are new ones")
    n = len(records)
    msg = (f"{reason}: rewound to the {'clean' if target.clean else 'unclean'} state of step {run(target.step)} "
           f"({source}), {lost} step{'s' if lost != 1 else ''} lost" + (f" ({target.why})" if target.why else "")
           + f"; {n} batch{'es' if n != 1 else ''} never trained again: {_ranges(records, run)}"
           + f"; {rng_txt}; training goes on from it (ew.step = {target.step + 1})")
    if diagnosis is not None:
        msg += (f". {diagnosis} Going on at {ep.lr_factor:g}x the learning rate for {cfg.recurrence_lr_steps} steps "
                f"(on_recurrence='lower_lr'), rewind {ep.rewinds}/{cfg.max_rewinds_per_episode} of this episode")
    if blame and blame.get("message"):
        msg += f". {_capital(blame['message'])}"
    if scan.flags:
        msg += f". State at the incident: {scan.summary()}"
    report = RewindReport(step, target.step, source, reason, ep.rewinds, records, blame, msg,
                          [f.where for f in scan.flags], rng_restored=rng, recurrence=diagnosis,
                          lr_factor=rec.lr_factor)
    first = next((r.batch_index for r in records if r.batch_index is not None), None)
    layers = (blame["layer"],) if blame and blame.get("layer") else ()
    rec.emit(Event(step=step, kind=Kind.REWIND, level=Level.CRITICAL, message=msg, signal=reason,
                   layers=layers, values={"restored_step": float(target.step), "skipped": float(n),
                                          "attempt": float(ep.rewinds), "lost_steps": float(lost),
                                          "rng_restored": float(rng), "lr_factor": rec.lr_factor},
                   batch=first))
    if records:
        rec.emit(Event(step=step, kind=Kind.QUARANTINE, level=Level.WARNING,
                       message=f"quarantined {_ranges(records, run)} -> {rec.quarantine_path}",
                       signal=reason, values={"batches": float(n)}, batch=first))
    return report
