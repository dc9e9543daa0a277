"""The episode: what recent alerts say about the steps around them. Pure and immutable.

The guard needs three answers about a step, all of them "within ``window`` steps of something":
is a snapshot of it *clean* (no warning-or-worse alert shortly before), is an episode *building*
(snapshots come faster), and is an *incident* in progress (then finite state is not proof of one
bad batch, and a rewind goes back to the incident's *onset*, its first abnormal step). One owner
(:class:`Episode`) answers all three, so "within the window" is written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from earlywarn.events import Event, Kind, Level
from earlywarn.recover.window import within as _within

# non-finite steps are skipped before anything is written: on their own they are no incident
_SKIPPED_KINDS = frozenset({Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE, Kind.SCALER_OVERFLOW})


@dataclass(frozen=True)
class Episode:
    """Steps (on the training trajectory) of the latest alerts; ``window``: ``RecoveryConfig.clean_window``."""

    window: int
    alert: int | None = None
    """The latest alert that may announce more (any level but an isolated spike, reported once it
    is over); after a rewind, through the steps that come again: theirs is below it."""
    unclean: int | None = None
    """The latest warning-or-worse alert: no snapshot is clean for ``window`` steps after it."""
    incident: int | None = None
    """The latest incident: a warning-or-worse alert that is not a non-finite step skipped before
    anything was written (a bad batch)."""
    onset: int | None = None
    """The first abnormal step of the incident in progress."""
    elevated: bool = False
    """One of the run's own signals (gradient norm, update, loss) was elevated at the latest step
    judged: a spike, maybe the start of one."""

    def after(self, step: int, alerts: Sequence[Event], *, elevated: bool) -> "Episode":
        """The episode once ``step`` was judged with ``alerts``."""
        ep = self
        if alerts:
            # an isolated spike is reported on the step it ended: nothing builds, the cadence stays
            if any(a.kind is not Kind.GRAD_SPIKE for a in alerts):
                ep = replace(ep, alert=step)
            if any(a.level >= Level.WARNING for a in alerts):
                ep = replace(ep, unclean=step)
            serious = [a for a in alerts if a.level >= Level.WARNING and a.kind not in _SKIPPED_KINDS]
            if serious:
                first = onset(step, serious)
                ep = replace(ep, incident=step, onset=first if ep.onset is None else min(ep.onset, first))
        if ep.onset is not None and not _within(ep.incident, step, self.window):
            ep = replace(ep, onset=None)
        return replace(ep, elevated=elevated) if ep.elevated != elevated else ep

    def rewound(self) -> "Episode":
        """After a rewind: the restored state is clean and what comes next is judged afresh (a
        recurrence is recovery's to diagnose); snapshots stay at the faster cadence for a while."""
        return Episode(self.window, alert=self.alert, elevated=self.elevated)

    def clean(self, step: int) -> bool:
        """A snapshot of ``step`` is clean: no warning-or-worse alert within the window before it."""
        return not _within(self.unclean, step, self.window)

    def building(self, step: int) -> bool:
        """An episode may be building at ``step``: an alert within the window (but an isolated
        spike's, which is over), or a run signal elevated at the latest step judged (async mode: a
        step or two back)."""
        return _within(self.alert, step, self.window) or self.elevated


def onset(step: int, alerts: Sequence[Event]) -> int:
    """The first abnormal step the alerts speak of: an alert that counts consecutive steps
    (an escalation, a divergence, a non-finite streak: ``values["steps"]``) began that many back."""
    first = step
    for a in alerts:
        n = a.values.get("steps", 1.0)
        n = int(n) if isinstance(n, (int, float)) and math.isfinite(n) and n >= 1 else 1
        first = min(first, step - n + 1)
    return first
