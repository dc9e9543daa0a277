"""W&B runs as analysis sources: a hosted run (``wandb:<entity>/<project>/<run_id>``, or every run of
``wandb:<entity>/<project>``) through ``wandb.Api``, and offline run directories / ``.wandb`` files.

Hosted runs are read with ``run.scan_history()`` (every row, full resolution; ``run.history()``
samples 500 rows). Offline runs are decoded by :mod:`wandb_offline_reader` (the W&B sink's
reader of the ``.wandb`` transaction log); the W&B alerts in the file become logged events, and
several offline directories of one run id (a resumed offline run) are read as one run, in order.
The SDK is imported only when a source needs it.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

from earlywarn.analyze.rawrun import AnalyzeError, RawRun, rows_to_runs
from earlywarn.events import Event, Kind, Level

# the step a row belongs to: earlywarn's own step metric first (W&B's _step counts log calls)
STEP_KEYS = ("earlywarn/step", "trainer/global_step", "train/global_step", "global_step", "step", "_step")
_ALERT_LEVELS = {"INFO": Level.INFO, "WARN": Level.WARNING, "WARNING": Level.WARNING, "ERROR": Level.CRITICAL}
_ALERT_STEP = re.compile(r"\bstep (\d+)\b")
_ALERT_KIND = re.compile(r"earlywarn \w+: (\w+)")

# tests replace this to run the hosted path without a server
api_factory: Callable[[], Any] | None = None


def _api() -> Any:
    if api_factory is not None:
        return api_factory()
    try:
        import wandb
    except ImportError:
        raise AnalyzeError("reading wandb: runs needs the 'wandb' package: pip install 'earlywarn[wandb]'") from None
    try:
        return wandb.Api(timeout=60)
    except Exception as e:  # no API key, no network
        raise AnalyzeError(f"wandb: cannot reach the W&B API ({type(e).__name__}: {_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _step_key(keys: Iterable[str], key_map: Mapping[str, str]) -> dict[str, str]:
    km = dict(key_map)
    if "step" not in km:
        present = set(keys)
        for k in STEP_KEYS:
            if k in present:
                km["step"] = k
                break
    return km


def _rows_to_run(source: str, fmt: str, rows: list[dict[str, Any]], key_map: Mapping[str, str],
                 name: str = "", notes: list[str] | None = None) -> RawRun:
    rows = [{k: v for k, v in r.items() if not k.startswith("_") or k == "_step"} for r in rows]
    keys: set[str] = set()
    for r in rows:
        keys.update(r)
    km = _step_key(keys, key_map)
    run = rows_to_runs(source, fmt, rows, km, notes, split_runs=False, where=lambda i: f"history row {i + 1}")[0]
    run.name = name
    return run


def alerts_to_events(alerts: Iterable[Mapping[str, Any]]) -> list[Event]:
    """W&B alert records (``title``, ``text``, ``level``) -> events. The step is read from the text
    (earlywarn's sink writes ``step N: ...``); alerts without one are left out."""
    events = []
    for a in alerts:
        text = str(a.get("text") or "")
        title = str(a.get("title") or "")
        m = _ALERT_STEP.search(text) or _ALERT_STEP.search(title)
        if not m:
            continue
        km = _ALERT_KIND.search(title)
        try:
            kind = Kind(km.group(1)) if km else Kind.COLLAPSE_RISK
        except ValueError:
            kind = Kind.COLLAPSE_RISK
        level = _ALERT_LEVELS.get(str(a.get("level") or "").upper(), Level.INFO)
        message = text.split(":", 1)[1].strip() if text.startswith("step ") and ":" in text else text
        events.append(Event(step=int(m.group(1)), kind=kind, level=level, message=message or title,
                            signal="wandb_alert", time=0.0))
    return events


# --------------------------------------------------------------------------------------------
# offline runs
# --------------------------------------------------------------------------------------------


def _reader():
    try:
        from . import wandb_offline_reader
    except ImportError as e:
        raise AnalyzeError(f"reading offline W&B runs needs earlywarn.integrations.wandb_offline_reader ({e})") from None
    return wandb_offline_reader


def _wandb_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        depth = dirpath[len(path):].count(os.sep)
        if depth >= 3:
            dirnames[:] = []
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".wandb"))
    return found


def read_wandb_offline(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """One run per run id found under ``path`` (a ``.wandb`` file, a run directory, or ``wandb/``)."""
    mod = _reader()
    try:
        import wandb.proto.wandb_internal_pb2  # noqa: F401  (the record definitions ship with wandb)
    except ImportError:
        raise AnalyzeError("reading offline W&B runs needs the 'wandb' package: pip install 'earlywarn[wandb]'") from None
    files = _wandb_files(path)
    if not files:
        raise AnalyzeError(f"{path}: no .wandb run file found")
    by_id: dict[str, list[Any]] = defaultdict(list)
    for f in files:
        try:
            run = mod.read_offline_run(f)
        except getattr(mod, "WandbFileError", ValueError) as e:
            raise AnalyzeError(f"{f}: unparsable W&B run file ({_one_line(e)})") from None
        except OSError as e:
            raise AnalyzeError(f"{f}: cannot read ({e.strerror})") from None
        by_id[run.run_id or f].append(run)
    out = []
    for run_id, parts in by_id.items():
        # a resumed offline run writes a new directory (offline-run-<time>-<id>): time order
        parts.sort(key=lambda r: os.path.basename(os.path.dirname(r.path)) or r.path)
        rows: list[dict[str, Any]] = []
        alerts: list[Mapping[str, Any]] = []
        notes: list[str] = []
        resume_rows: list[int] = []
        for p in parts:
            if rows and p.history:
                resume_rows.append(len(rows))
            rows.extend(p.history)
            alerts.extend(p.alerts)
            if p.truncated:
                notes.append(f"{os.path.basename(p.path)} has no exit record: the run was cut short and "
                             "its last records (alerts included) may be missing")
        if not rows:
            raise AnalyzeError(f"{parts[0].path}: the W&B run holds no history rows (empty run)")
        source = path
        name = run_id if len(by_id) > 1 else ""
        raw = _rows_to_run(source, "wandb-offline", rows, key_map or {}, name=name, notes=notes)
        raw.events = alerts_to_events(alerts)
        if resume_rows and len(raw) == len(rows):
            raw.resume_rows = resume_rows
        out.append(raw)
    return out


# --------------------------------------------------------------------------------------------
# hosted runs
# --------------------------------------------------------------------------------------------


def read_wandb_api(spec: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """``wandb:<entity>/<project>/<run_id>`` (one run) or ``wandb:<entity>/<project>`` (all runs)."""
    path = spec[len("wandb:"):].strip().strip("/")
    parts = path.split("/")
    if len(parts) == 4 and parts[2] == "runs":  # the URL form entity/project/runs/id
        parts = [parts[0], parts[1], parts[3]]
    if len(parts) not in (2, 3) or not all(parts):
        raise AnalyzeError(f"{spec}: use wandb:<entity>/<project>/<run_id> or wandb:<entity>/<project>")
    api = _api()
    try:
        runs = [api.run("/".join(parts))] if len(parts) == 3 else list(api.runs("/".join(parts)))
    except AnalyzeError:
        raise
    except Exception as e:
        raise AnalyzeError(f"{spec}: cannot open the W&B run ({type(e).__name__}: {_one_line(e)})") from None
    if not runs:
        raise AnalyzeError(f"{spec}: the project holds no runs")
    out = []
    for run in runs:
        try:
            rows = [dict(r) for r in run.scan_history(page_size=1000)]
        except Exception as e:
            raise AnalyzeError(f"{spec}: cannot read the history of {getattr(run, 'id', '?')} "
                               f"({type(e).__name__}: {_one_line(e)})") from None
        if not rows:
            if len(runs) == 1:
                raise AnalyzeError(f"{spec}: the W&B run holds no history rows (empty run)")
            continue
        name = "" if len(parts) == 3 else f"{getattr(run, 'name', '') or ''}/{getattr(run, 'id', '')}".strip("/")
        out.append(_rows_to_run(spec, "wandb", rows, key_map or {}, name=name))
    if not out:
        raise AnalyzeError(f"{spec}: no run of the project holds history rows (empty runs)")
    return out
