"""Replay a cleaned run through the live detector (the same code path as ``watch()``).

Rows are fed in logging order. At a resume the detector is put back to the state it had when the
run was last at the resume step (a snapshot of ``state_dict()``), as the live detector would be
after loading the checkpoint, so the steps of the abandoned segment do not count twice.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from earlywarn.analyze.hygiene import CleanRun
from earlywarn.events import Event, Level

SNAPSHOT_EVERY = 64
"""Rows between detector snapshots (only for runs with resumes)."""


@dataclass
class Replay:
    alerts: list[Event]
    alert_rows: list[int]
    """Row index of each alert (same order as ``alerts``)."""
    score: np.ndarray
    """``StreamingDetector.score`` after each row (NaN where the detector has none)."""
    level: np.ndarray
    """``StreamingDetector.level`` after each row (int)."""
    restored: list[dict[str, Any]] = field(default_factory=list)
    """One record per resume: ``{"step", "restored_from_step"}`` (``None``: a fresh detector)."""


def _make_detector(cfg: Any, layer_names: tuple[str, ...], baseline: Mapping[str, float] | None):
    from earlywarn.analyze.readers import AnalyzeError
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


def replay(run: CleanRun, cfg: Any = None, baseline: Mapping[str, float] | None = None) -> Replay:
    """Feed every row of ``run`` to a fresh ``StreamingDetector``; collect its alerts and score."""
    from earlywarn.detect import Observation

    n = len(run)
    sd = _make_detector(cfg, run.layer_names, baseline)
    steps = run.step.tolist()
    loss = run.loss.tolist()
    loss_known = run.loss_known.tolist()
    grad = run.grad_norm.tolist()
    grad_known = run.grad_known.tolist()
    skipped = run.skipped.tolist()
    layers = run.layers
    layers_known = run.layers_known.tolist()
    extras_cols = [(name, vals.tolist(), known.tolist()) for name, (vals, known) in run.extras.items()]
    resume_rows = {r.row: r for r in run.resumes}
    score = np.full(n, np.nan)
    level = np.zeros(n, dtype=np.int8)
    alerts: list[Event] = []
    alert_rows: list[int] = []
    restored: list[dict[str, Any]] = []

    snapshots: list[tuple[int, int, Any]] = []  # (row, last step observed, state)
    take_snapshots = bool(resume_rows)
    since = SNAPSHOT_EVERY
    last_step = None

    def observe(i: int) -> list[Event]:
        extras = {name: vals[i] for name, vals, known in extras_cols if known[i]}
        obs = Observation(
            step=steps[i],
            grad_norm=grad[i] if grad_known[i] else None,
            layer_norms=layers[i] if (layers is not None and layers_known[i]) else None,
            loss=loss[i] if loss_known[i] else None,
            skipped=skipped[i],
            extras=extras,
        )
        return sd.observe(obs)

    for i in range(n):
        if i in resume_rows:
            target = resume_rows[i].step
            # the newest snapshot taken before the run first passed the resume step
            pick = None
            for k in range(len(snapshots) - 1, -1, -1):
                if snapshots[k][1] < target:
                    pick = k
                    break
            if pick is None:
                sd = _make_detector(cfg, run.layer_names, baseline)
                restored.append({"step": target, "restored_from_step": None})
                last_step = None
            else:
                row0, step0, state = snapshots[pick]
                sd.load_state_dict(copy.deepcopy(state))
                last_step = step0
                # catch up on the rows logged after that snapshot and before the resume step
                for j in range(row0 + 1, i):
                    if last_step < steps[j] < target:
                        observe(j)  # alerts for these rows were already reported the first time
                        last_step = steps[j]
                restored.append({"step": target, "restored_from_step": last_step})
                del snapshots[pick + 1:]
            since = SNAPSHOT_EVERY
        new = observe(i)
        last_step = steps[i]
        for ev in new:
            alerts.append(ev)
            alert_rows.append(i)
        s = getattr(sd, "score", None)
        if s is not None:
            score[i] = float(s)
        level[i] = int(getattr(sd, "level", Level.NONE))
        if take_snapshots:
            since += 1
            if since >= SNAPSHOT_EVERY or (i + 1) in resume_rows:
                snapshots.append((i, steps[i], copy.deepcopy(sd.state_dict())))
                since = 0
    return Replay(alerts=alerts, alert_rows=alert_rows, score=score, level=level, restored=restored)
