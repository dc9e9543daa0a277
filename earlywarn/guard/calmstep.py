"""The calm step: a step inside the detector's bands is applied with a test of its vector and nothing else.

Most steps of a run are calm. The detector promises, at each fold, bands for its next ``window``
steps (:mod:`earlywarn.detect.bands`): values inside them cannot raise an alert, elevate a
run-level signal or take the detector off its calm path, whatever the steps before them in the
window were. A step whose statistics vector falls inside its bands -- one vectorized test of
the layers' squared norms, a few scalar ones of the gradient norm, the loss, the user signals,
the learning rate -- and on which nothing else is due (the watcher asks: no snapshot or
checkpoint, the policy watching nothing, recovery quiet, no incident noted since the last
metric row, no repair left unfinished) is decided at once: its update is applied, and the
policy's per-step bookkeeping (``Policy.calm(lr, loss)``, a few appends) is done then, so that
a policy the step leaves watching (an LR creeping up) has the next step judged. What the
detector and the trackers would have had is kept: the host vector, tag and learning rate.

The kept steps are folded in later, in order, through the same detector: at the next step that
is not inside its bands (then judged exactly as before, with the detector up to date), every
``window`` steps, and before anything that reads or changes what they feed -- an event or a
counter, a snapshot or checkpoint (the detector's and the policy's state go through
:class:`Current`), ``state_dict()``, ``flush()``, ``close()``. Folding a step gives the detector's
state and the step's metric row exactly as
observing it at once would: rows reach the trackers up to ``window`` steps late, each with the
step it describes. A kept step that alerts when folded would mean bands that were not
conservative: its alerts are still emitted (late), with a warning.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from earlywarn.detect import StepColumns, StreamingDetector
from earlywarn.detect.bands import Bands
from earlywarn.guard.statistics import StepStatistics, StepTag
from earlywarn.guard.telemetry import Telemetry
from earlywarn.policy import Policy

WINDOW = 16
"""Calm steps kept before they are folded in (the bands are drawn for this many)."""



class CalmSteps:
    """The calm steps of one watcher: ``take(host, tag, lr)`` keeps a calm step, :meth:`fold`
    brings the detector, the policy and the trackers up to date."""

    def __init__(self, detector: StreamingDetector, policy: Policy, telemetry: Telemetry,
                 statistics: StepStatistics, quiet: Callable[[int, int], int], *, scaler: bool,
                 window: int | None = None):
        self.detector = detector
        self.policy = policy
        self.telemetry = telemetry
        self.window = WINDOW if window is None else window  # 0: every step observed at once
        self.rows: list[tuple[list[float], StepTag, float | None]] = []  # (the host vector, its tag, its LR)
        self._statistics = statistics
        self._scaler = scaler
        self._n = statistics.num_layers
        self._bands: Bands | None = None
        self._users: tuple = ()  # the tag's users a step inside the bands has
        self._folding = False
        self.quiet = quiet
        """``quiet(step, k)``: how many of the ``k`` steps from ``step`` on are calm as far as the
        rest of the watcher goes (the watcher's)."""

    def take(self, host: "np.ndarray | list[float]", tag: StepTag, lr: float | None) -> bool:
        """Keep the step if it is inside its bands (True: it is calm, its update is applied
        without more). False: it is to be judged; the detector is then up to date."""
        vals = host if type(host) is list else host.tolist()
        # vals: the layers' squared norms..., loss, loss scale, user signals..., the state's flag
        n = self._n
        loss = vals[n] if tag.loss_reported else None
        b = self._bands
        drawn = False
        while True:
            # (one test, then the step kept, written out here: the common step makes no other call)
            if b is not None and tag.users == self._users and vals[-1] < math.inf and b.take(
                    vals if n else None, tag.sq_sum, loss, [vals[i] for _, i in tag.users] if tag.users else (),
                    lr, vals[n + 1] if self._scaler else None):  # (a poisoned optimizer state is repaired first)
                # kept for the fold; the policy's bookkeeping done now (a few appends), so that a
                # policy it leaves watching (an LR creeping up) has the next step judged, exactly
                # as the step-by-step path asks it then
                self.rows.append((vals, tag, lr))
                policy = self.policy
                policy.calm(math.nan if lr is None else lr, math.nan if loss is None else loss)
                if policy.watching:
                    self._bands = None  # the next step: folded in, no bands drawn (``quiet`` says 0), judged
                return True
            if drawn or (b is not None and b.taken == 0):
                return False  # outside bands drawn from the current state: judged
            self.fold()
            b = self._draw(tag.step)
            drawn = True

    def judged(self) -> None:
        """A step was judged (the detector's state moved): the next bands are drawn afresh."""
        self._bands = None

    def _draw(self, step: int) -> Bands | None:
        """Bands for the steps from ``step`` on that nothing else is due at (``quiet``)."""
        self._bands = None
        k = self.quiet(step, self.window) if self.window else 0
        b = self.detector.bands(k) if k else None
        if b is None:
            return None
        if b.users:
            names = self._statistics.user_names
            L = self._n
            self._users = tuple((u, L + 2 + names.index(u)) for u in names if u in b.users)
        else:
            self._users = ()
        self._bands = b
        return b

    def fold(self) -> None:
        """Feed the kept steps to the detector (one block through its calm path) and their rows
        to the trackers, in order (the policy had each at its step: :meth:`take`); the next
        bands are drawn afresh."""
        rows = self.rows
        if not rows or self._folding:
            return
        self.rows = []
        self._bands = None
        self._folding = True
        try:
            cols = self._columns(rows)
            scores: list[float] = []
            alerts = self.detector.observe_calm(cols, scores)
            if alerts:
                _not_calm(self.telemetry, alerts, cols)
            steps = cols.step.tolist()
            grad = cols.grad_norm.tolist()
            loss = [None] * len(rows) if cols.loss is None else cols.loss.tolist()
            users = [None] * len(rows)
            for key, (vals, _) in cols.extras.items():
                if key.startswith("user/"):
                    for i, v in enumerate(vals.tolist()):
                        users[i] = {**(users[i] or {}), key[5:]: v}
            self.telemetry.log_rows(list(zip(steps, grad, loss, cols.layer_norms, users, scores)))
        finally:
            self._folding = False

    def _columns(self, rows: list[tuple[list[float], StepTag, float | None]]) -> StepColumns:
        """The kept steps as the detector's columns, each row what the step's Observation holds."""
        block = np.array([vals for vals, _, _ in rows], dtype=np.float64)
        n = self._n
        tags = [tag for _, tag, _ in rows]
        t0 = tags[0]
        extras = {}
        if rows[0][2] is not None:
            extras["lr"] = (np.array([lr for _, _, lr in rows], dtype=np.float64), None)
        if self._scaler:
            extras["loss_scale"] = (block[:, n + 1].copy(), None)
        for key, j in t0.users:
            extras[key] = (block[:, j].copy(), None)
        return StepColumns(step=np.array([tag.run_step for tag in tags]),
                           grad_norm=np.sqrt(np.array([tag.sq_sum for tag in tags])),
                           loss=block[:, n].copy() if t0.loss_reported else None,
                           layer_norms=np.sqrt(block[:, :n]), extras=extras)


def _not_calm(telemetry: Telemetry, alerts: list, cols: StepColumns) -> None:
    """Kept steps that were not calm after all: bands that were not conservative (a bug)."""
    steps = sorted({int(cols.step[i]) for i, _ in alerts})
    warnings.warn(f"earlywarn: step(s) {steps} were applied as calm, but the detector alerts on them "
                  f"({', '.join(str(a.kind) for _, a in alerts)}): please "
                  "report this; their alerts are emitted now", RuntimeWarning, stacklevel=3)
    for _, alert in alerts:
        telemetry.emit(alert)


class Current:
    """The state of a part the calm steps feed (the detector, the policy), for snapshots and
    checkpoints: what they save is the part's state with the kept steps folded in, and what they
    restore is drawn new bands from."""

    def __init__(self, part: Any, calm: CalmSteps):
        self.part = part
        self._calm = calm

    def state_dict(self) -> dict[str, Any]:
        self._calm.fold()
        return self.part.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._calm.fold()
        self.part.load_state_dict(state)
        self._calm.judged()
