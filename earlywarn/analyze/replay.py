"""Replay a cleaned run through the live detector (the same code path as ``watch()``).

Rows are fed in logging order. At a resume the detector is put back to the state it had when the
run was last at the resume step (a snapshot of ``state_dict()``), as the live detector would be
after loading the checkpoint, so the steps of the abandoned segment do not count twice.
"""

from __future__ import annotations

import bisect
import copy
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from earlywarn.analyze.hygiene import CleanRun
from earlywarn.detect.observation import StepColumns
from earlywarn.events import Event

SNAPSHOT_EVERY = 64
"""Rows between detector snapshots (only for runs with resumes)."""


@dataclass
class Replay:
    alerts: list[Event]
    alert_rows: list[int]
    """Row index of each alert (same order as ``alerts``)."""
    restored: list[dict[str, Any]] = field(default_factory=list)
    """One record per resume: ``{"step", "restored_from_step"}`` (``None``: a fresh detector)."""


def _make_detector(cfg: Any, layer_names: tuple[str, ...], baseline: Mapping[str, float] | None):
    from earlywarn.analyze.rawrun import AnalyzeError
    from earlywarn.detect import StreamingDetector

    base = None
    if baseline:
        # a per-layer prior applies to the runs that have that layer
        layers = {f"grad_norm/{n}" for n in layer_names}
        base = {k: v for k, v in baseline.items() if not k.startswith("grad_norm/") or k in layers}
    try:
        return StreamingDetector(cfg, layer_names=layer_names, baseline=base or None)
    except ValueError as e:
        raise AnalyzeError(f"detector: {' '.join(str(e).split())}") from None


def step_columns(run: CleanRun) -> StepColumns:
    """The run's rows as the detector's input columns (row ``i`` is one Observation)."""
    return StepColumns(
        step=run.step, grad_norm=run.grad_norm, grad_known=run.grad_known, loss=run.loss,
        loss_known=run.loss_known, layer_norms=run.layers, layers_known=run.layers_known,
        skipped=run.skipped, extras=dict(run.extras))


def replay(run: CleanRun, cfg: Any = None, baseline: Mapping[str, float] | None = None) -> Replay:
    """Feed every row of ``run`` to a fresh ``StreamingDetector``, as the live hook would have;
    collect its alerts."""
    n = len(run)
    sd = _make_detector(cfg, run.layer_names, baseline)
    cols = step_columns(run)
    steps = run.step.tolist()
    resume_rows = sorted(r.row for r in run.resumes)
    resume_at = {r.row: r for r in run.resumes}
    alerts: list[Event] = []
    alert_rows: list[int] = []
    restored: list[dict[str, Any]] = []

    def feed(a: int, b: int) -> None:
        for row, ev in sd.observe_columns(cols, a, b):
            alerts.append(ev)
            alert_rows.append(row)

    if not resume_rows:
        feed(0, n)
        return Replay(alerts=alerts, alert_rows=alert_rows)

    # with resumes: snapshots of the detector every SNAPSHOT_EVERY rows (and just before each
    # resume), so that a resume can go back to the state the run had at the resume step
    # (row, last step observed, state); the first is the fresh detector, before row 0
    snapshots: list[tuple[int, float, Any]] = [(-1, -math.inf, copy.deepcopy(sd.state_dict()))]
    i = 0
    while i < n:
        if i in resume_at:
            target = resume_at[i].step
            # the newest snapshot taken before the run first passed the resume step
            pick = next(k for k in range(len(snapshots) - 1, -1, -1) if snapshots[k][1] < target)
            row0, step0, state = snapshots[pick]
            sd = _make_detector(cfg, run.layer_names, baseline)
            sd.load_state_dict(copy.deepcopy(state))
            last_step = step0
            # catch up on the rows logged after that snapshot and before the resume step
            for j in range(row0 + 1, i):
                if last_step < steps[j] < target:
                    sd.observe(cols.observation(j))  # its alerts were reported the first time
                    last_step = steps[j]
            restored.append({"step": target,
                             "restored_from_step": None if last_step == -math.inf else last_step})
            del snapshots[pick + 1:]
        k = bisect.bisect_right(resume_rows, i)
        nxt = resume_rows[k] if k < len(resume_rows) else n
        end = min(nxt, i + SNAPSHOT_EVERY)
        feed(i, end)
        snapshots.append((end - 1, steps[end - 1], copy.deepcopy(sd.state_dict())))
        i = end
    return Replay(alerts=alerts, alert_rows=alert_rows, restored=restored)
