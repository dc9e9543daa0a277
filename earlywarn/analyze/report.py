"""The analysis report: alerts, incidents, lead time, compute a rewind would have saved.

JSON schema (``Report.to_dict()``, ``earlywarn analyze --json``), version 1::

    {
      "version": 1,
      "detector": {...DetectorConfig.to_dict()...},
      "baseline": {"grad_norm": 0.2, "loss": 2.3} | null,
      "runs": [{
        "source": str,            # what was passed (path or tracker address)
        "run": str,               # the run inside the source ("" when the source is one run)
        "format": str,            # csv, jsonl, earlywarn-jsonl, hf, megatron, llmc, npz, mlflow, wandb, wandb-offline, tensorboard
        "steps": int,             # rows (optimizer steps) replayed
        "first_step": int, "last_step": int,
        "max_level": "none" | "info" | "warning" | "critical",
        "alerts": [{"step": int, "level": "info"|"warning"|"critical", "signal": str,
                    "layer": str|null, "message": str, "kind": str, "values": {str: float|str}}],
        "incidents": [{
          "collapse_step": int,          # first step of the collapse (loss jump or non-finite loss)
          "kind": "loss_jump" | "loss_nonfinite",
          "first_warning_step": int|null,# first warning-or-worse alert of the episode that ends at the
                                         # collapse (alerts <= 10 log intervals apart chain into one episode)
          "lead_steps": int|null,        # collapse_step - first_warning_step
          "first_layer": str|null,       # layer that moved first (detector alert, else the data)
          "recovered_step": int|null,    # loss back to its pre-incident level
          "damage_end_step": int,        # recovery, the last step before the run was rolled back, or the end
          "saved_steps": int,            # damage_end_step - first_warning_step (0 without a warning)
          "after_resume": bool, "resume_step": int|null,
          "message": str}],
        "saved_steps": int,       # sum over incidents
        "resumes": [{"step": int, "previous_step": int, "overlap_steps": int}],
        "logged_events": [...],   # Event.to_dict() of events the run logged itself (earlywarn JSONL, W&B alerts)
        "hygiene": {"stale": int, "not_computed": int, "blank_as_nonfinite": int, "skipped": int,
                    "overflow": int, "resumes": int, "overlap_steps": int, "gaps": int, "stride": int,
                    "gap_ranges": [[int, int], ...] (first 50), "notes": [str]},
        "keys": {canonical: column}   # which column was read as loss, grad_norm, ...
      }],
      "summary": {"runs": int, "steps": int, "alerts": int, "warnings": int, "criticals": int,
                  "incidents": int, "incidents_warned": int, "saved_steps": int, "seconds": float}
    }
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from earlywarn.analyze.hygiene import CleanRun
from earlywarn.analyze.replay import Replay
from earlywarn.events import Event, Level

SCHEMA_VERSION = 1

COLLAPSE_RATIO = 1.5
"""A loss at least this multiple of its recent median (and ``COLLAPSE_MIN_RISE`` above it) is a collapse."""
COLLAPSE_MIN_RISE = 0.1
RECOVER_RATIO = 1.1
"""The incident is over when the loss is back within this multiple of the pre-incident median."""
LOSS_WINDOW = 50
"""Recent healthy losses that make the reference median."""
RESUME_NEAR = 100
WARNING_CHAIN_ROWS = 10
"""Warnings at most this many log intervals apart form one episode; the episode that reaches the
collapse gives its first warning (a warning long before, followed by calm, is not the lead)."""
"""A collapse within this many steps after a resume is reported as a collapse after the resume."""


@dataclass
class Incident:
    collapse_step: int
    collapse_row: int
    kind: str
    first_warning_step: int | None = None
    first_warning_row: int | None = None
    lead_steps: int | None = None
    first_layer: str | None = None
    recovered_step: int | None = None
    damage_end_step: int = 0
    saved_steps: int = 0
    after_resume: bool = False
    resume_step: int | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "collapse_step": self.collapse_step,
            "kind": self.kind,
            "first_warning_step": self.first_warning_step,
            "lead_steps": self.lead_steps,
            "first_layer": self.first_layer,
            "recovered_step": self.recovered_step,
            "damage_end_step": self.damage_end_step,
            "saved_steps": self.saved_steps,
            "after_resume": self.after_resume,
            "resume_step": self.resume_step,
            "message": self.message,
        }


def alert_dict(ev: Event) -> dict[str, Any]:
    d = ev.to_dict()
    return {
        "step": int(ev.step),
        "level": str(ev.level),
        "signal": ev.signal or str(ev.kind),
        "layer": ev.layer,
        "message": ev.message,
        "kind": str(ev.kind),
        "values": d["values"],
    }


@dataclass
class RunReport:
    source: str
    run: str
    format: str
    steps: int
    first_step: int | None
    last_step: int | None
    alerts: list[Event]
    incidents: list[Incident]
    resumes: list[dict[str, Any]]
    logged_events: list[Event]
    hygiene: dict[str, Any]
    keys: dict[str, str]
    clean: CleanRun | None = field(default=None, repr=False)
    replay: Replay | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.source}#{self.run}" if self.run else self.source

    @property
    def max_level(self) -> Level:
        return max((ev.level for ev in self.alerts), default=Level.NONE)

    @property
    def saved_steps(self) -> int:
        return int(sum(i.saved_steps for i in self.incidents))

    @property
    def first_warning(self) -> Event | None:
        return next((ev for ev in self.alerts if ev.level >= Level.WARNING), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "run": self.run,
            "format": self.format,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "max_level": str(self.max_level),
            "alerts": [alert_dict(ev) for ev in self.alerts],
            "incidents": [i.to_dict() for i in self.incidents],
            "saved_steps": self.saved_steps,
            "resumes": list(self.resumes),
            "logged_events": [_json_safe(ev.to_dict()) for ev in self.logged_events],
            "hygiene": self.hygiene,
            "keys": dict(self.keys),
        }


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


@dataclass
class Report:
    runs: list[RunReport]
    detector: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, float] | None = None
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        alerts = [ev for r in self.runs for ev in r.alerts]
        incidents = [i for r in self.runs for i in r.incidents]
        return {
            "runs": len(self.runs),
            "steps": int(sum(r.steps for r in self.runs)),
            "alerts": len(alerts),
            "warnings": sum(1 for ev in alerts if ev.level == Level.WARNING),
            "criticals": sum(1 for ev in alerts if ev.level == Level.CRITICAL),
            "incidents": len(incidents),
            "incidents_warned": sum(1 for i in incidents if i.first_warning_step is not None),
            "saved_steps": int(sum(i.saved_steps for i in incidents)),
            "seconds": round(self.seconds, 4),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "detector": _json_safe(self.detector),
            "baseline": self.baseline,
            "runs": [r.to_dict() for r in self.runs],
            "summary": self.summary(),
        }

    def run(self, contains: str) -> RunReport:
        """The one run whose label contains ``contains`` (KeyError if none or several)."""
        hits = [r for r in self.runs if contains in r.label]
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} runs match {contains!r}: " + ", ".join(r.label for r in self.runs))
        return hits[0]


# --------------------------------------------------------------------------------------------
# Incidents
# --------------------------------------------------------------------------------------------


def _refs(loss: np.ndarray, admit: np.ndarray, a: int, b: int, prior: float | None,
          floor: bool = False) -> np.ndarray:
    """Reference loss for rows [a, b): median of the last ``LOSS_WINDOW`` admitted losses before
    each row (``prior`` while fewer than 3 are known; NaN without a prior). ``floor=True`` takes
    the minimum of the same window instead: a lower bound of the median, so a row whose loss is
    not a jump over it is not a jump over the median, and the costlier medians are taken only for
    the chunks that have a candidate."""
    idx = np.flatnonzero(admit[:b])
    vals = loss[idx]
    ks = np.searchsorted(idx, np.arange(a, b))  # admitted rows before each row
    out = np.full(b - a, np.nan if prior is None else prior)
    if ks.size == 0 or ks[-1] < 3:
        return out
    k_lo, k_hi = int(ks[0]), int(ks[-1])
    ref = np.full(k_hi + 1, np.nan)
    short = range(max(3, k_lo), min(LOSS_WINDOW, k_hi + 1))  # fewer than LOSS_WINDOW values yet
    if short:
        if floor:
            ref[short.start:short.stop] = np.minimum.accumulate(vals[:short.stop - 1])[short.start - 1:]
        else:
            for k in short:
                ref[k] = np.median(vals[:k])
    lo = max(LOSS_WINDOW, k_lo)
    if k_hi >= lo:
        win = np.lib.stride_tricks.sliding_window_view(vals[lo - LOSS_WINDOW:k_hi], LOSS_WINDOW)
        ref[lo:k_hi + 1] = win.min(axis=1) if floor else np.median(win, axis=1)
    ok = ks >= 3
    out[ok] = ref[ks[ok]]
    return out


CHUNK = 4096


def find_incidents(run: CleanRun, rep: Replay, baseline: Mapping[str, float] | None = None) -> list[Incident]:
    """Collapses in the data (the loss jumps to ``COLLAPSE_RATIO`` x the median of its last
    ``LOSS_WINDOW`` healthy values, ``COLLAPSE_MIN_RISE`` above it, or becomes non-finite), each
    matched with the detector's first warning before it. An incident lasts until the loss is back
    within ``RECOVER_RATIO`` of that median, until the run is rolled back (a resume), or to the
    end. A non-finite gradient whose loss stays fine was not applied: an alert, not an incident."""
    n = len(run)
    steps = run.step
    loss = run.loss
    known = run.loss_known
    with np.errstate(invalid="ignore"):
        finite = known & np.isfinite(loss)
    nonfinite = known & ~finite
    admit = finite & ~run.skipped  # values that may enter the reference window
    prior = None
    if baseline and baseline.get("loss") is not None and float(baseline["loss"]) > 0:
        prior = float(baseline["loss"])
    starts = run.segment_starts
    seg_last_row = np.append(starts[1:], n) - 1
    seg_of_row = np.searchsorted(starts, np.arange(n), side="right") - 1
    resumes = {r.row: r for r in run.resumes}
    resume_rows = np.asarray(sorted(resumes), dtype=np.int64)

    incidents: list[Incident] = []
    a = 0
    while a < n:
        b = min(n, a + CHUNK)
        x = loss[a:b]
        floor = _refs(loss, admit, a, b, prior, floor=True)
        with np.errstate(invalid="ignore"):
            maybe = nonfinite[a:b] | (finite[a:b] & (x >= floor * COLLAPSE_RATIO) & (x - floor >= COLLAPSE_MIN_RISE))
        if not maybe.any():
            a = b
            continue
        ref = _refs(loss, admit, a, b, prior)
        with np.errstate(invalid="ignore"):
            jump = finite[a:b] & (x >= ref * COLLAPSE_RATIO) & (x - ref >= COLLAPSE_MIN_RISE)
        hits = np.flatnonzero(nonfinite[a:b] | jump)
        if hits.size == 0:
            a = b
            continue
        c = a + int(hits[0])
        r0 = float(ref[c - a])
        inc = Incident(collapse_step=int(steps[c]), collapse_row=c,
                       kind="loss_nonfinite" if nonfinite[c] else "loss_jump",
                       damage_end_step=int(steps[seg_last_row[seg_of_row[c]]]))
        before = resume_rows[resume_rows <= c]
        if before.size:
            last = resumes[int(before[-1])]
            if 0 <= inc.collapse_step - last.step <= max(RESUME_NEAR, 10 * run.stride):
                inc.after_resume, inc.resume_step = True, last.step
        thr = math.inf if math.isnan(r0) else max(r0 * RECOVER_RATIO, r0 + COLLAPSE_MIN_RISE / 2)
        rec = np.flatnonzero(finite[c + 1:] & (loss[c + 1:] <= thr))
        rec_row = c + 1 + int(rec[0]) if rec.size else None
        later = resume_rows[resume_rows > c]
        res_row = int(later[0]) if later.size else None
        if res_row is not None and (rec_row is None or res_row <= rec_row):
            # rolled back before it recovered: the damage ends with the abandoned segment
            inc.damage_end_step = int(steps[res_row - 1])
            inc.message = f"; rolled back at step {inc.damage_end_step} (resumed at {resumes[res_row].step})"
            admit[c:res_row] = False
            a = res_row
        elif rec_row is not None:
            inc.recovered_step = inc.damage_end_step = int(steps[rec_row])
            admit[c:rec_row] = False
            admit[rec_row] = True
            a = rec_row + 1
        else:
            admit[c:] = False
            a = n
        incidents.append(inc)
    floor = -1
    for inc in incidents:
        _attach_warning(run, rep, inc, floor)
        floor = inc.collapse_row
    return incidents


def _attach_warning(run: CleanRun, rep: Replay, inc: Incident, floor_row: int) -> None:
    gap = WARNING_CHAIN_ROWS * run.stride
    steps = run.step
    # warning-or-worse alerts up to the collapse, after the previous incident; walk back from the
    # collapse while they chain (no more than ``gap`` steps apart)
    cands = [(row, ev) for ev, row in zip(rep.alerts, rep.alert_rows)
             if ev.level >= Level.WARNING and floor_row < row <= inc.collapse_row
             and int(steps[row]) <= inc.collapse_step]
    first = None
    next_step = inc.collapse_step
    for row, ev in reversed(cands):
        if next_step - int(steps[row]) > gap:
            break
        first = (row, ev)
        next_step = int(steps[row])
    what = {"loss_jump": "loss jump", "loss_nonfinite": "non-finite loss"}[inc.kind]
    where = f" {inc.collapse_step - inc.resume_step} steps after the resume at step {inc.resume_step}" if inc.after_resume else ""
    if first is None:
        inc.saved_steps = 0
        inc.first_layer = _layer_from_data(run, None, inc.collapse_row)
        inc.message = f"collapse ({what}) at step {inc.collapse_step}{where}, no warning before it" + (
            f"; {inc.message.lstrip('; ')}" if inc.message else "")
        return
    row, ev = first
    inc.first_warning_step = int(steps[row])
    inc.first_warning_row = row
    inc.lead_steps = inc.collapse_step - inc.first_warning_step
    layer = None
    for (r2, e2) in [(r, e) for r, e in cands if r >= row]:
        if e2.layer:
            layer = e2.layer
            break
    inc.first_layer = layer or _layer_from_data(run, row, inc.collapse_row)
    inc.saved_steps = max(0, inc.damage_end_step - inc.first_warning_step)
    extra = inc.message
    inc.message = (
        f"collapse ({what}) at step {inc.collapse_step}{where}; first warning at step {inc.first_warning_step} "
        f"({inc.lead_steps} steps ahead" + (f", {inc.first_layer} moved first" if inc.first_layer else "") + "); "
        f"a rewind from the warning saves {inc.saved_steps} steps"
        + (f" (damage until step {inc.damage_end_step})" if inc.saved_steps else "")
        + extra
    )


def _layer_from_data(run: CleanRun, first_row: int | None, collapse_row: int) -> str | None:
    """The layer whose norm rose first (3x its own median before the episode) ahead of the collapse."""
    if run.layers is None or not run.layer_names:
        return None
    start = first_row if first_row is not None else max(0, collapse_row - 20)
    hist = np.flatnonzero(run.layers_known[:start] & ~run.skipped[:start])[-200:]
    if hist.size < 5:
        return None
    with np.errstate(all="ignore"):
        ref = np.nanmedian(np.where(np.isfinite(run.layers[hist]), run.layers[hist], np.nan), axis=0)
        for r in range(start, collapse_row + 1):
            if not run.layers_known[r]:
                continue
            row = run.layers[r]
            ratio = np.where(np.isfinite(row), row / np.maximum(ref, 1e-30), np.inf)
            moved = ratio >= 3.0
            if moved.any():
                j = int(np.argmax(np.where(moved, ratio, -np.inf)))
                return run.layer_names[j]
    return None


def build_run_report(run: CleanRun, rep: Replay, baseline: Mapping[str, float] | None = None) -> RunReport:
    raw = run.raw
    incidents = find_incidents(run, rep, baseline)
    hygiene = dict(run.counts)
    hygiene["stride"] = run.stride
    hygiene["gap_ranges"] = [[a, b] for a, b in run.gaps[:50]]
    hygiene["notes"] = list(run.notes)
    resumes = []
    restored = {r["step"]: r for r in rep.restored}
    for r in run.resumes:
        d = r.to_dict()
        if r.step in restored:
            d["detector_restored_from_step"] = restored[r.step]["restored_from_step"]
        resumes.append(d)
    return RunReport(
        source=raw.source, run=raw.name, format=raw.format, steps=len(run),
        first_step=int(run.step.min()) if len(run) else None,
        last_step=int(run.step[-1]) if len(run) else None,
        alerts=list(rep.alerts), incidents=incidents, resumes=resumes, logged_events=list(raw.events),
        hygiene=hygiene, keys=dict(run.keys), clean=run, replay=rep,
    )


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

TABLE_COLUMNS = ("run", "steps", "alerts", "first warning", "incidents", "lead", "saved", "notes")


def summary_rows(report: Report) -> list[tuple[str, ...]]:
    rows = []
    for r in report.runs:
        n_warn = sum(1 for ev in r.alerts if ev.level == Level.WARNING)
        n_crit = sum(1 for ev in r.alerts if ev.level == Level.CRITICAL)
        n_info = sum(1 for ev in r.alerts if ev.level == Level.INFO)
        fw = r.first_warning
        leads = [str(i.lead_steps) for i in r.incidents if i.lead_steps is not None]
        notes = []
        h = r.hygiene
        if h.get("resumes"):
            notes.append(f"{h['resumes']} resume(s)")
        if h.get("stale"):
            notes.append(f"{h['stale']} stale")
        if h.get("not_computed"):
            notes.append(f"{h['not_computed']} not computed")
        if h.get("skipped"):
            notes.append(f"{h['skipped']} skipped")
        if h.get("blank_as_nonfinite"):
            notes.append(f"{h['blank_as_nonfinite']} blank=non-finite")
        if h.get("gaps"):
            notes.append(f"{h['gaps']} gap(s)")
        if any(i.after_resume for i in r.incidents):
            notes.append("collapse after resume")
        rows.append((
            display_name(r),
            str(r.steps),
            f"{n_crit}C {n_warn}W {n_info}I" if r.alerts else "0",
            str(fw.step) if fw else "-",
            str(len(r.incidents)),
            (",".join(leads[:3]) + (",..." if len(leads) > 3 else "")) if leads else "-",
            str(r.saved_steps),
            ", ".join(notes) or "-",
        ))
    return rows


def display_name(r: RunReport) -> str:
    """Short name for tables: the run inside its source, else the source's file name."""
    if r.run:
        return r.run
    base = os.path.basename(r.source.rstrip("/\\"))
    return base or r.source


def _short(label: str, width: int = 60) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]


def render_text(report: Report, *, max_alerts: int = 20) -> str:
    """Plain-text report (what the CLI prints without rich)."""
    lines = []
    for r in report.runs:
        lines.append(f"== {r.label}  [{r.format}, {r.steps} steps"
                     + (f", {r.first_step}..{r.last_step}" if r.first_step is not None else "") + "]")
        if not r.alerts:
            lines.append("   no alerts")
        shown = r.alerts if len(r.alerts) <= max_alerts else r.alerts[:max_alerts]
        for ev in shown:
            layer = f" [{ev.layer}]" if ev.layer else ""
            lines.append(f"   step {ev.step:>8}  {str(ev.level):<8} {ev.signal or ev.kind}{layer}: {ev.message}")
        if len(r.alerts) > len(shown):
            lines.append(f"   ... {len(r.alerts) - len(shown)} more alert(s) (--json for all)")
        for inc in r.incidents:
            lines.append(f"   INCIDENT {inc.message}")
        for res in r.resumes:
            lines.append(f"   resume at step {res['step']} after step {res['previous_step']}"
                         + (f" ({res['overlap_steps']} steps ran twice)" if res["overlap_steps"] else ""))
        for note in r.hygiene.get("notes", []):
            lines.append(f"   note: {note}")
    lines.append("")
    rows = [TABLE_COLUMNS] + [(_short(r[0]),) + r[1:] for r in summary_rows(report)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(TABLE_COLUMNS))]
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    s = report.summary()
    lines.append(f"{s['runs']} run(s), {s['steps']} steps, {s['alerts']} alert(s) "
                 f"({s['criticals']} critical, {s['warnings']} warning), {s['incidents']} incident(s) "
                 f"({s['incidents_warned']} warned ahead), {s['saved_steps']} steps a rewind would have saved; "
                 f"{s['seconds']:.2f} s")
    return "\n".join(lines)


def render_rich(report: Report, console: Any, *, max_alerts: int = 20) -> None:
    """The same report with a rich table (``rich`` is optional; the CLI falls back to text)."""
    from rich.table import Table

    styles = {Level.CRITICAL: "bold red", Level.WARNING: "yellow", Level.INFO: "cyan"}
    for r in report.runs:
        console.print(f"[bold]{r.label}[/bold]  [dim]{r.format}, {r.steps} steps[/dim]", highlight=False)
        shown = r.alerts[:max_alerts]
        for ev in shown:
            layer = f" [{ev.layer}]" if ev.layer else ""
            console.print(f"  step {ev.step:>8}  [{styles.get(ev.level, '')}]{str(ev.level):<8}[/] "
                          f"{ev.signal or ev.kind}{layer}: {ev.message}", markup=True, highlight=False)
        if len(r.alerts) > len(shown):
            console.print(f"  ... {len(r.alerts) - len(shown)} more alert(s) (--json for all)")
        for inc in r.incidents:
            console.print(f"  [bold red]INCIDENT[/] {inc.message}", highlight=False)
    table = Table(title="earlywarn analyze")
    for c in TABLE_COLUMNS:
        if c == "run":
            table.add_column(c, overflow="ellipsis", no_wrap=True, max_width=32)
        else:
            table.add_column(c, overflow="fold")
    for row in summary_rows(report):
        table.add_row(*row)
    console.print(table)
    s = report.summary()
    console.print(f"{s['runs']} run(s), {s['steps']} steps, {s['incidents']} incident(s), "
                  f"{s['saved_steps']} steps a rewind would have saved; {s['seconds']:.2f} s", highlight=False)


def plot(report: Report, path: str) -> list[list[str]]:
    """PNG: per run, grad norm (log axis) and loss, with alerts, collapses and resumes marked.
    Returns each run's legend entries.

    A run with gaps or resumes is drawn against its log rows (ticks labelled with steps), so a
    few quoted lines 20,000 steps apart, or a segment that re-runs steps, stay readable. Each
    legend lists what that run's picture shows, and nothing else.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs = report.runs
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False)
    colors = {Level.INFO: "tab:cyan", Level.WARNING: "tab:orange", Level.CRITICAL: "tab:red"}
    names = {Level.INFO: "info alert", Level.WARNING: "warning", Level.CRITICAL: "critical"}
    legends: list[list[str]] = []
    for ax, r in zip(axes[:, 0], runs):
        c, rep = r.clean, r.replay
        ax.set_title(_short(r.label, 90), fontsize=9)
        handles: list[Any] = []
        legends.append([])
        if c is None or rep is None:
            continue
        by_rows = bool(c.gaps or c.resumes)
        x = np.arange(len(c)) if by_rows else c.step
        ax.set_xlabel("log row (step on the ticks)" if by_rows else "step")
        g_ok = c.grad_known & np.isfinite(c.grad_norm) & (c.grad_norm > 0)
        if g_ok.any():
            ax.semilogy(x[g_ok], c.grad_norm[g_ok], ".-" if g_ok.sum() < 200 else "-", lw=0.7, ms=3,
                        color="tab:blue", label="grad norm")
            handles.append(plt.Line2D([], [], color="tab:blue", label="grad norm"))
        ax.set_ylabel("grad norm (log)")
        l_ok = c.loss_known & np.isfinite(c.loss)
        if l_ok.any():
            ax2 = ax.twinx()
            ax2.plot(x[l_ok], c.loss[l_ok], ".-" if l_ok.sum() < 200 else "-", lw=0.7, ms=3,
                     color="tab:green", label="loss")
            ax2.set_ylabel("loss")
            handles.append(plt.Line2D([], [], color="tab:green", label="loss"))
        if by_rows:
            ticks = np.unique(np.linspace(0, len(c) - 1, min(len(c), 8)).astype(int))
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(int(c.step[t])) for t in ticks], fontsize=7)
            for a_, b_ in c.gaps:
                i = int(np.flatnonzero(c.step == b_)[0])
                ax.axvline(i - 0.5, color="lightgray", lw=3, alpha=0.6)
            if c.gaps:
                handles.append(plt.Line2D([], [], color="lightgray", lw=3, label="gap"))
        levels = set()
        for ev, row in zip(r.alerts, rep.alert_rows):
            faint = ev.level <= Level.INFO
            ax.axvline(x[row], color=colors.get(ev.level, "gray"), lw=0.5 if faint else 1.0, alpha=0.3 if faint else 0.8)
            levels.add(ev.level)
        for lvl in sorted(levels):
            handles.append(plt.Line2D([], [], color=colors.get(lvl, "gray"), alpha=0.5 if lvl <= Level.INFO else 1.0,
                                      label=names.get(lvl, str(lvl))))
        lead = False
        for inc in r.incidents:
            ax.axvline(x[inc.collapse_row], color="black", lw=1.5, ls="--")
            if inc.first_warning_row is not None:
                ax.axvspan(x[inc.first_warning_row], x[inc.collapse_row], color="tab:orange", alpha=0.15)
                lead = True
        if r.incidents:
            handles.append(plt.Line2D([], [], color="black", ls="--", label="collapse"))
        if lead:
            handles.append(Patch(color="tab:orange", alpha=0.15, label="first warning to collapse"))
        for res in c.resumes:
            ax.axvline(x[res.row], color="purple", lw=1.0, ls=":")
        if c.resumes:
            handles.append(plt.Line2D([], [], color="purple", ls=":", label="resume"))
        if handles:
            ax.legend(handles=handles, fontsize=7, loc="upper left", ncol=4, framealpha=0.6)
        legends[-1] = [h.get_label() for h in handles]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return legends
