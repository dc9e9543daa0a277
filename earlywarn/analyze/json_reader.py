"""JSON logs: JSON lines (a metrics row per line, or earlywarn's own JSONL log of metrics, events
and checkpoints), a JSON list of rows, and Hugging Face's ``trainer_state.json``."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from earlywarn.analyze.rawrun import AnalyzeError, RawRun, rows_to_runs
from earlywarn.events import Event, Kind


_BARE_TOKEN = re.compile(r'(?<=[:\[,\s])(-?)(nan|inf|infinity)(?=\s*[,\}\]])', re.IGNORECASE)


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        # some loggers write bare nan / inf (not JSON); read them as the non-finite values they are
        fixed = _BARE_TOKEN.sub(lambda m: ("-Infinity" if m.group(1) else "Infinity") if m.group(2).lower() != "nan" else "NaN", line)
        if fixed == line:
            raise
        return json.loads(fixed)


def _read_json_lines(path: str) -> tuple[list[dict], list[str], list[int]]:
    """(rows, notes, the line number of each row)."""
    notes: list[str] = []
    rows: list[dict] = []
    linenos: list[int] = []
    try:
        with open(path, "r", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except UnicodeDecodeError:
        raise AnalyzeError(f"{path}: not a text file (cannot decode it as UTF-8)") from None
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    for k, (lineno, line) in enumerate(numbered):
        try:
            obj = _json_line(line)
        except json.JSONDecodeError as e:
            if k == len(numbered) - 1 and rows:
                notes.append(f"the last line ({lineno}) is incomplete (the file was cut mid-write) and was left out")
                break
            raise AnalyzeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise AnalyzeError(f"{path}:{lineno}: expected one JSON object per line, got {type(obj).__name__}")
        rows.append(obj)
        linenos.append(lineno)
    if not rows:
        raise AnalyzeError(f"{path}: no records (empty run)")
    return rows, notes, linenos


_EW_TYPES = {"event", "metrics", "checkpoint"}


def is_earlywarn_jsonl(rows: Sequence[Mapping]) -> bool:
    head = rows[:50]
    return bool(head) and all(isinstance(r.get("type"), str) and r.get("type") in _EW_TYPES for r in head)


def read_jsonl(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """JSON lines: a metrics row per line, or earlywarn's own event/metric log."""
    rows, notes, linenos = _read_json_lines(path)
    if is_earlywarn_jsonl(rows):
        return [read_earlywarn_rows(path, rows, notes, key_map or {}, linenos=linenos)]
    return rows_to_runs(path, "jsonl", rows, key_map or {}, notes, where=lambda i: f"line {linenos[i]}")


EW_PREFIX = "earlywarn/"


def read_earlywarn_rows(source: str, rows: Sequence[Mapping[str, Any]], notes: list[str],
                        key_map: Mapping[str, str], *, linenos: Sequence[int] | None = None) -> RawRun:
    """earlywarn's JSONL sink output: metrics rows, events, checkpoint records."""
    metric_rows = []
    metric_lines: list[int] = []
    events: list[Event] = []
    checkpoints: list[int] = []
    resume_steps: list[int] = []
    bad_events = 0
    for j, r in enumerate(rows):
        t = r.get("type")
        if t == "metrics":
            metric_lines.append(linenos[j] if linenos is not None else j + 1)
            # keys are written with the earlywarn/ prefix; the analyser speaks the bare names
            metric_rows.append({(k[len(EW_PREFIX):] if k.startswith(EW_PREFIX) else k): v
                                for k, v in r.items() if k != "type"})
        elif t == "event":
            try:
                ev = Event.from_dict(r)
            except (KeyError, ValueError, TypeError):
                bad_events += 1
                continue
            events.append(ev)
            if ev.kind == Kind.RESUME:
                resume_steps.append(ev.step)
        elif t == "checkpoint":
            s = r.get("step")
            if isinstance(s, (int, float)) and not isinstance(s, bool):
                checkpoints.append(int(s))
    if bad_events:
        notes = notes + [f"{bad_events} event record(s) could not be read and were left out"]
    if not metric_rows:
        raise AnalyzeError(
            f"{source}: earlywarn log holds no metrics records ({len(events)} event(s)); "
            "write it with JsonlSink(metrics=True) to analyse it"
        )
    run = rows_to_runs(source, "earlywarn-jsonl", metric_rows, key_map, notes,
                       where=lambda i: f"line {metric_lines[i]}")[0]
    run.events = events
    run.checkpoints = sorted(set(checkpoints))
    run.tabular = True
    if resume_steps:
        # the first metrics row at each resume step (in logging order) starts a new segment
        wanted = list(resume_steps)
        steps = run.step.tolist()
        rows_found = []
        for s in wanted:
            idx = [i for i, x in enumerate(steps) if x >= s]
            cands = [i for i in idx if i > 0 and steps[i] <= steps[i - 1]] or idx[:1]
            if cands:
                rows_found.append(cands[0])
        run.resume_rows = sorted(set(rows_found))
    return run


def read_json(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """A .json file: HF ``trainer_state.json`` or a JSON list of row objects."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            obj = json.load(fh)
    except UnicodeDecodeError:
        raise AnalyzeError(f"{path}: not a text file (cannot decode it as UTF-8)") from None
    except json.JSONDecodeError as e:
        raise AnalyzeError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if isinstance(obj, dict) and "log_history" in obj:
        return [read_hf_state(path, obj, key_map or {})]
    if isinstance(obj, list) and obj and all(isinstance(r, dict) for r in obj):
        return rows_to_runs(path, "json", obj, key_map or {}, where=lambda i: f"entry {i + 1} of the list")
    raise AnalyzeError(
        f"{path}: unknown JSON layout: expected a Hugging Face trainer_state.json (with log_history) "
        "or a list of row objects"
    )


def read_hf_state(path: str, obj: Mapping[str, Any], key_map: Mapping[str, str]) -> RawRun:
    """Hugging Face ``trainer_state.json``: ``log_history`` entries merged per step."""
    history = obj.get("log_history")
    if not isinstance(history, list) or not history:
        raise AnalyzeError(f"{path}: trainer_state.json has an empty log_history (empty run)")
    # the end-of-training summary (train_runtime, train_loss, ...) is not a training step
    index = [i for i, r in enumerate(history) if isinstance(r, dict) and "train_runtime" not in r]
    rows = [history[i] for i in index]
    if not rows:
        raise AnalyzeError(f"{path}: log_history holds no training entries (empty run)")
    km = dict(key_map)
    km.setdefault("step", "step")
    return rows_to_runs(path, "hf", rows, km, split_runs=False, where=lambda i: f"log_history[{index[i]}]")[0]

