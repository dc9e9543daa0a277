"""Where a rewind goes: a pure choice among the snapshots and checkpoints there are."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Candidate(NamedTuple):
    """A state a rewind could restore: its training step, whether it is clean, where it is (a
    :class:`~earlywarn.recover.Snapshot` or a :class:`~earlywarn.recover.CheckpointInfo`)."""

    step: int
    clean: bool
    source: Any


class Target(NamedTuple):
    step: int
    clean: bool
    source: Any
    why: str
    """Why this one and not the newest clean snapshot before the incident ("" when it is that)."""


def pick_target(candidates: list[Candidate], step: int, onset: int | None, floor: int | None,
                poisoned: bool = False, run: Callable[[int], int] = int) -> Target | None:
    """The newest clean candidate taken before the incident began (``candidates``: newest first,
    all before ``step``). Step ``onset`` was the first abnormal one, so the state it computed its
    gradient on (``onset - 1``) is suspect too when the incident is a divergence of finite values:
    then at most ``onset - 2``. When it left NaN/Inf behind (``poisoned``), the scan every
    snapshot passed proves the state of ``onset - 1`` finite: that one will do. ``floor``: the
    episode's first rewind target, never gone past without saying why. ``run``: how ``why``
    names a training step (on the run's clock). ``None`` when there is no candidate."""
    if not candidates:
        return None
    limit = step if onset is None else min(step, onset if poisoned else onset - 1)
    pre = [c for c in candidates if c.step < limit]
    if floor is not None:
        return _above_floor(candidates, pre, onset, step, floor, run)
    c = _pick([c for c in pre if c.clean])
    if c is not None:
        return Target(*c, "")
    c = _pick(pre)
    if c is not None:
        began = "" if onset is None else f" (step {run(onset)})"
        return Target(*c, f"no clean snapshot before the incident began{began}; the copy taken at the warning")
    c = _pick(candidates)
    assert c is not None
    began = f"the incident began at step {run(onset)}" if onset is not None else "the incident"
    return Target(*c, f"no snapshot from before {began}; step {run(c.step)} is the newest one")


def _above_floor(candidates: list[Candidate], pre: list[Candidate], onset: int | None, step: int, floor: int,
                 run: Callable[[int], int]) -> Target:
    """A recurrence: no further back than the episode's first target, unless it is gone."""
    c = _pick([c for c in pre if c.step >= floor])
    if c is not None:
        return Target(*c, "")
    later = [c for c in candidates if c.step >= floor]
    if later:
        c = next((x for x in reversed(later) if x.clean), later[-1])  # the one closest to the floor
        return Target(*c, f"the instability came back {max(0, (onset or step) - c.step)} steps after step "
                          f"{run(c.step)}, before any newer snapshot; restoring step {run(c.step)} again (a rewind "
                          f"never goes further back than the episode's first, step {run(floor)})")
    c = _pick(candidates)
    assert c is not None
    return Target(*c, f"the snapshot of step {run(floor)} (the episode's first rewind) is gone; going further "
                      f"back, to step {run(c.step)}")


def _pick(pool: list[Candidate]) -> Candidate | None:
    """The newest clean one, else the newest."""
    return next((c for c in pool if c.clean), None) or (pool[0] if pool else None)
