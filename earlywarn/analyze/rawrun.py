"""The record every reader returns (:class:`RawRun`), and what the readers share to build it.

A reader turns a logged run into its steps *in the order they were logged* (a resume shows up as a
step that goes back) and one float column per logged key, with a mask of the rows where the key was
absent, ``null`` or an empty cell. Here: parsing one logged value, the step checks (a step is a
whole number within int64), dict rows -> columns, merging the rows a logger split, finding the step
and run columns and splitting a table into runs. Pure numpy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from earlywarn.events import Event


class AnalyzeError(ValueError):
    """A user-facing problem with a source or an option; the message is one line."""


# --------------------------------------------------------------------------------------------
# The record every reader produces
# --------------------------------------------------------------------------------------------


@dataclass
class RawRun:
    """One run as logged: rows in logging order, one float column per key."""

    source: str
    """What the user passed (path or tracker address)."""
    name: str
    """The run's name within the source (a run id, a file inside a grep'd log, ...)."""
    format: str
    """Reader that produced it: csv, jsonl, earlywarn-jsonl, hf, megatron, llmc, npz, mlflow, wandb,
    wandb-offline, tensorboard."""
    step: np.ndarray
    """int64, one per row, in logging order (not sorted: a resume goes back)."""
    columns: dict[str, np.ndarray]
    """key -> float64 per row; NaN where missing *or* logged non-finite (see ``missing``)."""
    missing: dict[str, np.ndarray]
    """key -> bool per row: True where the key was absent, ``null`` or an empty cell."""
    events: list[Event] = field(default_factory=list)
    """Events the run logged itself (earlywarn JSONL events, W&B alerts)."""
    resume_rows: list[int] = field(default_factory=list)
    """Rows the log itself marks as the first row after a resume (besides steps going back)."""
    checkpoints: list[int] = field(default_factory=list)
    """Steps at which the run says it wrote a checkpoint, when known."""
    notes: list[str] = field(default_factory=list)
    tabular: bool = True
    """True for free-form tables (csv/jsonl/hf/tracker) where a blank in a dense column can mean
    "non-finite, dropped by the logger"; False for text logs whose format defines blanks."""

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @property
    def label(self) -> str:
        return f"{self.source}#{self.name}" if self.name else self.source


# --------------------------------------------------------------------------------------------
# Values and steps
# --------------------------------------------------------------------------------------------

NULL_TOKENS = frozenset({"", "null", "none", "nil", "na", "n/a", "<na>", "nat"})
_FLOAT_TOKENS = {
    "nan": math.nan, "+nan": math.nan, "-nan": math.nan, "nan(ind)": math.nan, "-nan(ind)": math.nan,
    "inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
    "-inf": -math.inf, "-infinity": -math.inf,
}


def parse_number(value: Any) -> float | None:
    """A logged value as a float (NaN/Inf kept), ``None`` for null/blank, ``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        low = text.lower()
        if low in NULL_TOKENS:
            return None
        if low in _FLOAT_TOKENS:
            return _FLOAT_TOKENS[low]
        return float(text)
    if isinstance(value, Mapping):
        # W&B/TB style wrapped scalars: {"value": x}
        if "value" in value:
            return parse_number(value["value"])
    raise ValueError(f"not a number: {value!r}")


INT64_MAX = 2**63 - 1

CELL_FIX = "write the number (nan and inf are fine) or leave the cell empty if nothing was logged"
VALUE_FIX = "write the number (NaN and Infinity are fine) or null if nothing was logged"


def step_problem(x: float) -> str | None:
    """Why ``x`` cannot be a step number (an int64), or None."""
    if not abs(x) < 2.0**63:  # float(2**63 - 1) rounds up to 2**63
        return f"is beyond the largest step number ({INT64_MAX})"
    if x != math.floor(x):
        return "is not a whole number"
    return None


def bad_steps(x: np.ndarray) -> np.ndarray:
    """Where the float array ``x`` cannot hold step numbers: :func:`step_problem`, element-wise."""
    return ~(np.abs(x) < 2.0**63) | (x != np.floor(x))


def _show_value(v: Any) -> str:
    try:
        text = json.dumps(v, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _row_name(i: int) -> str:
    return f"row {i + 1}"


def columns_from_rows(rows: Sequence[Mapping[str, Any]], step_key: str, *, source: str = "",
                      where: Callable[[int], str] = _row_name) -> tuple[np.ndarray, dict, dict, list[str]]:
    """Dict rows -> (steps, columns, missing, notes).

    A key whose values are mostly not numbers (text, media) is not a metric and is dropped. A
    metric with a value that is not a number (``"abc"``, ``[1, 2]``) is refused with an
    :class:`AnalyzeError` naming ``source``, the row (``where(i)``), the key and the fix: reading
    it as NaN would report a collapse that never happened. So is a step that is not a whole
    number within int64. Rows without a step value are left out, with a note."""
    n = len(rows)
    steps = np.empty(n, dtype=np.int64)
    keep = np.ones(n, dtype=bool)
    keys: dict[str, None] = {}
    for row in rows:
        for k in row:
            if k not in keys:
                keys[k] = None
    keys.pop(step_key, None)
    values = {k: np.full(n, np.nan) for k in keys}
    missing = {k: np.ones(n, dtype=bool) for k in keys}
    numeric = dict.fromkeys(keys, 0)
    unreadable: dict[str, list] = {}  # key -> [count, first row, first value]
    bad_steps = 0
    prefix = f"{source}: " if source else ""
    for i, row in enumerate(rows):
        try:
            s = parse_number(row.get(step_key))
        except (ValueError, TypeError, OverflowError):
            s = None
        if s is None or not math.isfinite(s):
            keep[i] = False
            bad_steps += 1
            continue
        why = step_problem(s)
        if why:
            raise AnalyzeError(f"{prefix}{where(i)}, key {step_key!r}: {_show_value(row.get(step_key))} {why}; fix that "
                               f"row or name the step column with --key step=<key>")
        steps[i] = int(s)
        for k, v in row.items():
            if k == step_key:
                continue
            try:
                x = parse_number(v)
            except (ValueError, TypeError, OverflowError):
                u = unreadable.setdefault(k, [0, i, v])
                u[0] += 1
                continue
            if x is None:
                continue
            values[k][i] = x
            missing[k][i] = False
            numeric[k] += 1
    for k, (count, i, v) in unreadable.items():
        if numeric[k] >= count:  # a metric with a bad value in it (more bad than good: a text key)
            raise AnalyzeError(f"{prefix}{where(i)}, key {k!r}: cannot read {_show_value(v)} as a number; {VALUE_FIX}")
    notes = []
    if bad_steps:
        notes.append(f"{bad_steps} row(s) without a usable {step_key!r} value were left out")
    cols = {k: values[k][keep] for k in keys if numeric[k]}
    miss = {k: missing[k][keep] for k in keys if numeric[k]}
    return steps[keep], cols, miss, notes


def merge_adjacent_same_step(step: np.ndarray, columns: dict, missing: dict) -> tuple[np.ndarray, dict, dict, int]:
    """Fold a row into the previous one when both carry the same step and no key disagrees.

    Loggers write one row per call (HF writes the train and eval entries of a step separately,
    TensorBoard one event per tag); rows of one step that *disagree* stay apart: that is the same
    step run twice (a resume).
    """
    if len(step) < 2:
        return step, columns, missing, 0
    dup = np.flatnonzero(step[1:] == step[:-1]) + 1
    if dup.size == 0:
        return step, columns, missing, 0
    drop = np.zeros(len(step), dtype=bool)
    target = np.arange(len(step))
    for i in dup.tolist():
        j = target[i - 1]
        conflict = False
        for k, col in columns.items():
            mk = missing[k]
            if not mk[i] and not mk[j]:
                a, b = col[i], col[j]
                if not (a == b or (a != a and b != b)):
                    conflict = True
                    break
        if conflict:
            continue
        for k, col in columns.items():
            mk = missing[k]
            if not mk[i] and mk[j]:
                col[j] = col[i]
                mk[j] = False
        drop[i] = True
        target[i] = j
    if not drop.any():
        return step, columns, missing, 0
    keep = ~drop
    return (
        step[keep],
        {k: v[keep] for k, v in columns.items()},
        {k: v[keep] for k, v in missing.items()},
        int(drop.sum()),
    )


def finish_run(run: RawRun) -> RawRun:
    """``run`` with the adjacent rows of one step merged (:func:`merge_adjacent_same_step`), noted."""
    run.step, run.columns, run.missing, merged = merge_adjacent_same_step(run.step, run.columns, run.missing)
    if merged:
        run.notes.append(f"{merged} row(s) merged into a row of the same step")
    return run


# --------------------------------------------------------------------------------------------
# Step and run columns; a table split into runs
# --------------------------------------------------------------------------------------------

STEP_KEYS = ("step", "_step", "global_step", "iteration", "iter", "trainer/global_step", "train/global_step", "steps")
RUN_KEYS = ("run", "run_id", "run_name", "source")


def _pick(keys: Iterable[str], candidates: Sequence[str]) -> str | None:
    present = set(keys)
    for c in candidates:
        if c in present:
            return c
    lower = {k.lower(): k for k in present}
    for c in candidates:
        if c.lower() in lower:
            return lower[c.lower()]
    return None


def pick_step_key(keys: Iterable[str], key_map: Mapping[str, str], where: str) -> str:
    """The step column: the key map's ``step``, else the first of :data:`STEP_KEYS` present."""
    keys = list(keys)
    wanted = key_map.get("step")
    if wanted:
        if wanted not in keys:
            raise AnalyzeError(f"{where}: step column {wanted!r} (from the key map) not found; columns: {_show(keys)}")
        return wanted
    found = _pick(keys, STEP_KEYS)
    if found is None:
        raise AnalyzeError(
            f"{where}: no step column (looked for {', '.join(STEP_KEYS[:4])}, ...); columns: {_show(keys)}; "
            "name it with --key step=<column>"
        )
    return found


def _show(keys: Sequence[str], limit: int = 12) -> str:
    keys = list(keys)
    text = ", ".join(keys[:limit]) if keys else "(none)"
    return text + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def pick_run_key(keys: Iterable[str], key_map: Mapping[str, str], where: str) -> str | None:
    """The column naming each row's run (the key map's ``run``, else one of :data:`RUN_KEYS`), or None."""
    wanted = key_map.get("run")
    keys = list(keys)
    if wanted:
        if wanted not in keys:
            raise AnalyzeError(f"{where}: run column {wanted!r} (from the key map) not found; columns: {_show(keys)}")
        return wanted
    return _pick(keys, RUN_KEYS)


def split_by_run(source: str, fmt: str, step: np.ndarray, cols: dict, miss: dict, run_labels: np.ndarray | None,
                 notes: list[str]) -> list[RawRun]:
    """One run per run label (in order of first appearance), or one run when there are none."""
    if run_labels is None:
        return [finish_run(RawRun(source, "", fmt, step, cols, miss, notes=list(notes)))]
    runs = []
    order: dict[str, None] = dict.fromkeys(run_labels.tolist())
    for label in order:
        sel = run_labels == label
        runs.append(finish_run(RawRun(
            source, str(label), fmt, step[sel],
            {k: v[sel] for k, v in cols.items()}, {k: v[sel] for k, v in miss.items()}, notes=list(notes),
        )))
    return runs


def rows_to_runs(source: str, fmt: str, rows: Sequence[Mapping[str, Any]], key_map: Mapping[str, str],
                 notes: list[str] | None = None, *, split_runs: bool = True,
                 where: Callable[[int], str] = _row_name) -> list[RawRun]:
    """Dict rows -> runs (one per value of a ``run`` column when ``split_runs``); ``where(i)``
    names row ``i`` in error messages (see :func:`columns_from_rows`)."""
    keys: dict[str, None] = {}
    for r in rows[:1000]:
        keys.update(dict.fromkeys(r))
    if len(rows) > 1000:
        for r in rows[1000:]:
            if len(r) != len(keys) or any(k not in keys for k in r):
                keys.update(dict.fromkeys(r))
    step_key = pick_step_key(keys, key_map, source)
    run_key = pick_run_key(keys, key_map, source) if split_runs else None
    steps, cols, miss, more = columns_from_rows(rows, step_key, source=source, where=where)
    notes = list(notes or []) + more
    if steps.size == 0:
        raise AnalyzeError(f"{source}: no rows with a step value (empty run)")
    labels = None
    if run_key is not None:
        labels_all = [str(r.get(run_key, "")) for r in rows
                      if _usable_step(r.get(step_key))]
        labels = np.asarray(labels_all)
        cols.pop(run_key, None)
        miss.pop(run_key, None)
    return split_by_run(source, fmt, steps, cols, miss, labels, notes)


def _usable_step(v: Any) -> bool:
    try:
        x = parse_number(v)
    except (ValueError, TypeError):
        return False
    return x is not None and math.isfinite(x)
