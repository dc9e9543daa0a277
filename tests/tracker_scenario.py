"""A run with every kind of incident, the documented tracker alert rules as code, and readers that
turn what a tracker stored back into rows. Shared by the end-to-end tracker tests.

The run (a small MLP, Adam, ``report_loss``, snapshots every 10 steps): an inf gradient at step
20 (skip), growing gradients from step 40 (warning + checkpoint), poisoned Adam state with two
non-finite gradient steps from 60 (the state repaired before the update, skips), NaN weights after
the update of step 80 (non-finite loss, a rewind). What earlywarn *did* is read from the watcher's own events and from a recording
sink that sees exactly what every tracker sink was handed, so the tests hold when detector or
policy details change.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

import earlywarn
from earlywarn.events import Event, Kind, Level
from earlywarn.metrics import INCIDENT_KINDS
from earlywarn.sinks.base import Sink
from fixtures_models import MLP

P = "earlywarn/"
STEPS = 100
SKIP_AT, WARN_FROM, REPAIR_FROM, POISON_AT = 20, 40, 60, 80


class Recorder(Sink):
    """What every sink was handed: ``rows`` (step, metrics) in order, events, checkpoints."""

    name = "recorder"

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.events: list[Event] = []
        self.checkpoints: list[tuple[int, str, str]] = []

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append((int(step), dict(metrics)))

    def alert(self, event: Event) -> None:
        self.events.append(event)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        self.checkpoints.append((step, path, reason))


@dataclass
class Scenario:
    watcher: Any
    recorder: Recorder
    user_rows: list[int] = field(default_factory=list)  # steps after which the user logged a row

    @property
    def events(self) -> list[Event]:
        return self.watcher.events

    def steps_with(self, pred: Callable[[Event], bool]) -> list[int]:
        return sorted({e.step for e in self.events if pred(e)})


def run_scenario(sinks: Sequence[Any], sink_options: Mapping[str, Mapping[str, Any]] | None = None, *,
                 user_log: Callable[[int], None] | None = None, user_every: int | None = None,
                 flush_before_user: bool = True, steps: int = STEPS, **watch_options: Any) -> Scenario:
    """Train with the real watcher and the faults above; ``user_log(step)`` is the user's own
    logging, called after the optimizer step every ``user_every`` steps (``None``: never)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(40)]
    recorder = Recorder()
    watch_options.setdefault("recovery", earlywarn.RecoveryConfig(snapshot_every=10))
    ew = earlywarn.watch(model, opt, sinks=[recorder, *sinks], sink_options=dict(sink_options or {}), **watch_options)
    scn = Scenario(ew, recorder)
    try:
        for step in range(steps):
            x, y = data[step % len(data)]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            ew.report_loss(loss)
            loss.backward()
            if step == SKIP_AT:
                model.hidden.weight.grad[3, 5] = math.inf  # a bad batch
            if WARN_FROM <= step < WARN_FROM + 6:
                for p in model.parameters():  # gradients growing step after step
                    p.grad.mul_(3.0 ** (step - WARN_FROM + 1))
            if step == REPAIR_FROM:
                opt.state[model.out.weight]["exp_avg_sq"][0, 0] = math.nan  # state poisoned, params still finite
            if REPAIR_FROM <= step < REPAIR_FROM + 2:  # two, not three: a streak of three rewinds
                model.inp.weight.grad[0, 0] = math.inf
            opt.step()
            if step == POISON_AT:  # a bad update wrote NaN into the weights: the next loss is NaN
                with torch.no_grad():
                    model.hidden.weight.fill_(math.nan)
            if user_log is not None and user_every is not None and step % user_every == user_every - 1:
                if flush_before_user:
                    ew.flush()  # deterministic: earlywarn's values for this step are in before the user's row
                user_log(step)
                scn.user_rows.append(step)
    except BaseException:
        ew.close()
        raise
    return scn


def check_scenario_has_every_incident(scn: Scenario) -> None:
    kinds = {e.kind for e in scn.events}
    assert {Kind.SKIP, Kind.REPAIR, Kind.REWIND, Kind.COLLAPSE_RISK, Kind.NONFINITE_GRAD} <= kinds, kinds
    assert SKIP_AT in scn.steps_with(lambda e: e.kind is Kind.SKIP)
    c = scn.watcher.counters
    assert c["skipped_steps"] >= 1 and c["repaired_steps"] == 1 and c["rewinds"] == 1 and c["checkpoints"] >= 1


def truth_levels(scn: Scenario) -> dict[int, int]:
    """Worst incident level per step, from the watcher's own events."""
    out: dict[int, int] = {}
    for e in scn.events:
        if str(e.kind) in INCIDENT_KINDS:
            out[e.step] = max(out.get(e.step, 0), int(e.level))
    return out


# ------------------------------------------------------------------ the documented rules, as code
def _threshold(key: str, op: Callable[[float, float], bool], x: float):
    def rule(rows: list[tuple[int, dict]]) -> list[int]:
        return [s for s, r in rows if key in r and op(r[key], x)]
    return rule


def _increases(key: str):
    def rule(rows: list[tuple[int, dict]]) -> list[int]:
        out, prev = [], None
        for s, r in rows:
            if key not in r:
                continue
            if prev is not None and r[key] - prev >= 1:
                out.append(s)
            prev = r[key]
        return out
    return rule


def _average_of_last(key: str, n: int, x: float):
    def rule(rows: list[tuple[int, dict]]) -> list[int]:
        out, window = [], []
        for s, r in rows:
            if key not in r:
                continue
            window = (window + [r[key]])[-n:]
            if len(window) == n and statistics.fmean(window) > x:
                out.append(s)
        return out
    return rule


def _zscore(key: str, window: int, x: float):
    def rule(rows: list[tuple[int, dict]]) -> list[int]:
        out, hist = [], []
        for s, r in rows:
            v = r.get(key)
            if v is None or not math.isfinite(v):
                continue
            if len(hist) >= window:
                ref = hist[-window:]
                sd = statistics.pstdev(ref)
                if sd > 0 and (v - statistics.fmean(ref)) / sd > x:
                    out.append(s)
            hist.append(v)
        return out
    return rule


GE, GT, LT = (lambda a, b: a >= b), (lambda a, b: a > b), (lambda a, b: a < b)
RULES: dict[str, Callable[[list[tuple[int, dict]]], list[int]]] = {
    # docs/trackers.md "Alert rules in the tracker UI" (W&B Automations; MLflow users chart these)
    "warning_or_worse": _threshold(P + "alert_level", GE, 2),
    "critical": _threshold(P + "alert_level", GE, 3),
    "nonfinite_gradient": _threshold(P + "nonfinite_layers", GT, 0),
    "gradient_not_finite": _threshold(P + "grad_norm_finite", LT, 1),
    "loss_not_finite": _threshold(P + "loss_finite", LT, 1),
    "sustained_instability": _average_of_last(P + "instability_score", 5, 3),
    "grad_norm_zscore": _zscore(P + "grad_norm", 50, 4),
    "steps_skipped": _increases(P + "skipped_steps"),
    "state_repaired": _increases(P + "repaired_steps"),
    "rewound": _increases(P + "rewinds"),
    "checkpoint_written": _increases(P + "checkpoints"),
}


def fire_all(rows: list[tuple[int, dict]]) -> dict[str, list[int]]:
    return {name: rule(rows) for name, rule in RULES.items()}


def carried_rows(rows: list[tuple[int, dict]], row_ends: Sequence[int]) -> list[tuple[int, dict]]:
    """What rows of a user's run hold when earlywarn's steps ride on them: each row carries the
    steps up to and including its end step (see ``wandb_sink.carry``)."""
    from earlywarn.integrations.wandb_sink import carry

    out, row, ends, i = [], {}, list(row_ends), 0
    for step, metrics in rows:
        carry(row, metrics)
        row[P + "step"] = step
        while i < len(ends) and step >= ends[i]:
            if row:
                out.append((step, row))
            row, i = {}, i + 1
    return out


# ------------------------------------------------------------------ readers
def mlflow_rows(client: Any, run_id: str) -> list[tuple[int, dict]]:
    """Every earlywarn metric of a run, as rows by step (the step is monotonic: one point each)."""
    run = client.get_run(run_id)
    keys = [k for k in run.data.metrics if k.startswith(P) and k != P + "incident_level"]
    by_step: dict[int, dict] = {}
    for key in keys:
        for m in client.get_metric_history(run_id, key):
            assert key not in by_step.setdefault(m.step, {}), f"{key} logged twice at step {m.step}"
            by_step[m.step][key] = m.value
    return sorted(by_step.items())


def wandb_rows(offline_run: Any) -> list[tuple[int, dict]]:
    """History rows that hold earlywarn's values, keyed by ``earlywarn/step``."""
    return [(int(r[P + "step"]), r) for r in offline_run.history if P + "step" in r]


def wandb_rows_with_wandbs_own_tool(run_file: str) -> list[tuple[int, dict]]:
    """The same rows, read by W&B's own CLI (``wandb leet inspect --json``) instead of our reader."""
    import json
    import os
    import subprocess
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run([exe, "leet", "inspect", "--json", run_file], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        rec = json.loads(line)
        if rec.get("type") != "history":
            continue
        item = {k: (float(v) if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity") else v)
                for k, v in rec["history"]["item"].items()}
        if P + "step" in item:
            rows.append((int(item[P + "step"]), item))
    return rows
