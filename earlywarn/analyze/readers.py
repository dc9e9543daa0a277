"""Readers: turn a logged run (a file, a directory, a tracker address) into columns of numbers.

Every reader returns :class:`RawRun` objects: the run's steps *in the order they were logged*
(a resume shows up as a step that goes back) and one float column per logged key, with a mask of
the rows where the key was absent, ``null`` or an empty cell. Deciding what those gaps mean
(not logged, non-finite, stale, "not computed") is :mod:`earlywarn.analyze.hygiene`'s job.

This module is pure numpy. Tracker and TensorBoard sources live in ``earlywarn.integrations``
(``mlflow_source``, ``wandb_source``, ``tensorboard_source``) and are imported only when a
source needs them.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from earlywarn.events import Event, Kind


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
# Value parsing shared by the readers
# --------------------------------------------------------------------------------------------

_NULL_TOKENS = frozenset({"", "null", "none", "nil", "na", "n/a", "<na>", "nat"})
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
        if low in _NULL_TOKENS:
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


def _finish(run: RawRun) -> RawRun:
    run.step, run.columns, run.missing, merged = merge_adjacent_same_step(run.step, run.columns, run.missing)
    if merged:
        run.notes.append(f"{merged} row(s) merged into a row of the same step")
    return run


# --------------------------------------------------------------------------------------------
# Tabular files: CSV, JSONL, JSON rows, npz
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


def _step_key(keys: Iterable[str], key_map: Mapping[str, str], where: str) -> str:
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


def _run_key(keys: Iterable[str], key_map: Mapping[str, str], where: str) -> str | None:
    wanted = key_map.get("run")
    keys = list(keys)
    if wanted:
        if wanted not in keys:
            raise AnalyzeError(f"{where}: run column {wanted!r} (from the key map) not found; columns: {_show(keys)}")
        return wanted
    return _pick(keys, RUN_KEYS)


def _split_by_run(source: str, fmt: str, step: np.ndarray, cols: dict, miss: dict, run_labels: np.ndarray | None,
                  notes: list[str]) -> list[RawRun]:
    if run_labels is None:
        return [_finish(RawRun(source, "", fmt, step, cols, miss, notes=list(notes)))]
    runs = []
    order: dict[str, None] = dict.fromkeys(run_labels.tolist())
    for label in order:
        sel = run_labels == label
        runs.append(_finish(RawRun(
            source, str(label), fmt, step[sel],
            {k: v[sel] for k, v in cols.items()}, {k: v[sel] for k, v in miss.items()}, notes=list(notes),
        )))
    return runs


# the spellings of "not logged" the careful reader accepts (it strips and lower-cases a cell),
# written out for pyarrow, which matches null values exactly
_ARROW_NULLS = sorted({v for t in _NULL_TOKENS for v in (t, t.upper(), t.capitalize(), t.title())})


def numeric_csv_columns(path: str, delim: str, arrow: bool = True) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The body of a CSV whose every cell is a number (``nan``, ``inf``, ``Infinity`` included)
    or, with pyarrow, blank / a null token: ``(values, missing)`` with ``values`` a
    ``(columns, rows)`` float64 array, one contiguous row per column, and ``missing`` a bool array
    of the same shape (None: nothing missing). None when some cell is neither (a text cell, a
    ragged row, a padded cell: the careful path decides what those mean).

    With pyarrow installed (it comes with mlflow) its multi-threaded reader parses the file (~3x
    faster than numpy on a 150k x 53 log, and ~30x faster than the careful path when a column has
    blanks); otherwise, or if it refuses the file, numpy's C parser does (numbers only). They
    give the same numbers and the same missing cells as the careful path (tested)."""
    if arrow:
        try:
            import pyarrow as pa
            import pyarrow.csv as pacsv
        except ImportError:
            pass
        else:
            try:
                table = pacsv.read_csv(
                    path,
                    read_options=pacsv.ReadOptions(skip_rows=1, autogenerate_column_names=True),
                    parse_options=pacsv.ParseOptions(delimiter=delim, quote_char='"'),
                    convert_options=pacsv.ConvertOptions(null_values=_ARROW_NULLS, strings_can_be_null=False,
                                                         quoted_strings_can_be_null=False))
            except (pa.ArrowException, OSError, ValueError):
                table = None  # numpy decides (an empty body, a ragged row, ...)
            # a column it did not read as numbers (" 2" with a blank, text, ...): numpy decides
            if (table is not None and table.num_rows
                    and all(pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_null(t)
                            for t in table.schema.types)):
                out = np.empty((table.num_columns, table.num_rows))
                missing = None
                for j, column in enumerate(table.columns):
                    if column.null_count:
                        if missing is None:
                            missing = np.zeros(out.shape, dtype=bool)
                        missing[j] = column.is_null().to_numpy(zero_copy_only=False)
                    # ints past 2**53 round as a float parse of their digits does; nulls -> NaN
                    out[j] = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
                if missing is not None:
                    keep = ~missing.all(axis=0)  # a line of blanks only is no row (as the careful path)
                    if not keep.all():
                        out, missing = np.ascontiguousarray(out[:, keep]), np.ascontiguousarray(missing[:, keep])
                return out, missing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = np.loadtxt(path, delimiter=delim, skiprows=1, dtype=np.float64, ndmin=2,
                              quotechar='"', comments=None, encoding="utf-8-sig")
    except ValueError:  # a blank or text cell, a ragged row, undecodable bytes: the careful path
        return None
    return np.ascontiguousarray(data.T), None


def read_csv(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """CSV/TSV with a header row. One run, or one per value of a ``run`` column."""
    key_map = key_map or {}
    try:
        with open(path, "r", encoding="utf-8-sig", newline="") as fh:
            first = fh.readline()
            rest_starts = fh.read(4096)
    except UnicodeDecodeError:
        raise AnalyzeError(f"{path}: not a text file (cannot decode it as UTF-8)") from None
    if not (first.strip() or rest_starts.strip()):
        raise AnalyzeError(f"{path}: empty file")
    first = first.rstrip("\r\n")
    delim = "\t" if (path.lower().endswith(".tsv") or ("\t" in first and "," not in first)) else ","
    header = next(csv.reader([first], delimiter=delim))
    header = [h.strip() for h in header]
    if len(header) < 2 or len(set(header)) != len(header) or any(not h for h in header):
        raise AnalyzeError(f"{path}: unparsable CSV header {first[:80]!r} (need unique column names, one of them a step)")
    step_key = _step_key(header, key_map, path)
    run_key = _run_key(header, key_map, path)
    if not rest_starts.strip():
        raise AnalyzeError(f"{path}: no rows after the header (empty run)")

    data = None
    if run_key is None:
        parsed = numeric_csv_columns(path, delim)
        if parsed is not None:
            data, missing_cells = parsed
            if data.shape[1] == 0:
                raise AnalyzeError(f"{path}: no rows after the header (empty run)")
    text = None
    if data is None:
        try:
            with open(path, "r", encoding="utf-8-sig", newline="") as fh:
                text = fh.read()
        except UnicodeDecodeError:
            raise AnalyzeError(f"{path}: not a text file (cannot decode it as UTF-8)") from None
    cols: dict[str, np.ndarray] = {}
    miss: dict[str, np.ndarray] = {}
    run_labels = None
    notes: list[str] = []
    if data is not None:
        if data.shape[0] != len(header):
            raise AnalyzeError(f"{path}: rows have {data.shape[0]} cells but the header names {len(header)} columns")
        no_missing = np.zeros(data.shape[1], dtype=bool)
        for j, name in enumerate(header):
            cols[name] = data[j]
            miss[name] = no_missing if missing_cells is None else missing_cells[j]
    else:
        rows = list(csv.reader(io.StringIO(text), delimiter=delim))[1:]
        rows = [r for r in rows if r and any(c.strip() for c in r)]
        if not rows:
            raise AnalyzeError(f"{path}: no rows after the header (empty run)")
        width = len(header)
        short = [i for i, r in enumerate(rows) if len(r) != width]
        if short:
            # a partly written last line (the run was killed mid-write) is dropped; others are errors
            if short == [len(rows) - 1]:
                rows = rows[:-1]
                notes.append("the last line is incomplete (the file was cut mid-write) and was left out")
            else:
                i = short[0]
                raise AnalyzeError(
                    f"{path}: line {i + 2} has {len(rows[i])} cells but the header names {width} columns"
                )
        if not rows:
            raise AnalyzeError(f"{path}: no complete rows after the header (empty run)")
        columns_t = list(zip(*rows))
        for j, name in enumerate(header):
            raw = np.asarray(columns_t[j], dtype=object)
            if name == run_key:
                run_labels = np.asarray([str(x).strip() for x in raw])
                continue
            values, missing, unreadable = _strings_to_floats(raw)
            if values is None:
                continue  # a text column (a snippet id, a path): not a metric
            if unreadable is not None and name != step_key:  # (rows without a step are left out, said in a note)  # read as NaN it would be a collapse that never happened
                line, _ = _csv_line_of(path, delim, j, _unreadable_cell)
                raise AnalyzeError(f"{path}: line {line}, column {name!r}: cannot read {unreadable!r} as a number; "
                                   f"{CELL_FIX}")
            cols[name] = values
            miss[name] = missing
    if step_key not in cols:
        raise AnalyzeError(f"{path}: step column {step_key!r} is not numeric")
    steps_f = cols.pop(step_key)
    steps_m = miss.pop(step_key)
    ok = ~steps_m & np.isfinite(steps_f)
    if not ok.all():
        notes.append(f"{int((~ok).sum())} row(s) without a usable {step_key!r} value were left out")
        steps_f = steps_f[ok]
        cols = {k: v[ok] for k, v in cols.items()}
        miss = {k: v[ok] for k, v in miss.items()}
        if run_labels is not None:
            run_labels = run_labels[ok]
    if steps_f.size == 0:
        raise AnalyzeError(f"{path}: no rows with a step value (empty run)")
    bad = bad_steps(steps_f)
    if bad.any():
        x = float(steps_f[np.flatnonzero(bad)[0]])
        j = header.index(step_key)
        line, cell = _csv_line_of(path, delim, j, lambda c: _cell_step_problem(c) is not None)
        raise AnalyzeError(f"{path}: line {line}, column {step_key!r}: {cell!r} {step_problem(x)}; fix that row "
                           "or name the step column with --key step=<column>")
    return _split_by_run(path, "csv", steps_f.astype(np.int64), cols, miss, run_labels, notes)


def _unreadable_cell(cell: str) -> bool:
    try:
        parse_number(cell)
    except ValueError:
        return True
    return False


def _cell_step_problem(cell: str) -> str | None:
    try:
        x = parse_number(cell)
    except ValueError:
        return None
    return step_problem(x) if x is not None and math.isfinite(x) else None


def _csv_rows(path: str, delim: str) -> Iterable[tuple[int, list[str]]]:
    """(line number, cells) of every data row, as the csv module reads them (error messages only)."""
    with open(path, "r", encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, delimiter=delim)
        next(reader, None)
        for cells in reader:
            yield reader.line_num, cells


def _csv_line_of(path: str, delim: str, col: int, pred: Callable[[str], bool]) -> tuple[int | str, str]:
    """The line of the first row whose cell ``col`` satisfies ``pred``, and that cell (to name
    both in an error); ``("?", "?")`` when no row does."""
    for line, cells in _csv_rows(path, delim):
        if col < len(cells) and pred(cells[col]):
            return line, cells[col].strip()
    return "?", "?"


def _strings_to_floats(raw: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, str | None]:
    """Object array of cell strings -> (floats, missing, first unreadable cell or None), or
    (None, _, _) for a text column (more cells unreadable than numbers)."""
    stripped = np.char.strip(raw.astype(str))
    low = np.char.lower(stripped)
    missing = np.isin(low, list(_NULL_TOKENS))
    values = np.full(raw.shape[0], np.nan)
    present = ~missing
    if not present.any():
        return values, missing, None
    try:
        values[present] = stripped[present].astype(np.float64)
        return values, missing, None
    except ValueError:
        pass
    bad = 0
    first = None
    out = values
    for i in np.flatnonzero(present).tolist():
        try:
            out[i] = parse_number(str(stripped[i]))
        except ValueError:
            bad += 1
            missing[i] = True
            first = str(stripped[i]) if first is None else first
    if bad > 0.5 * present.sum():
        return None, missing, None
    return out, missing, first


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
    step_key = _step_key(keys, key_map, source)
    run_key = _run_key(keys, key_map, source) if split_runs else None
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
    return _split_by_run(source, fmt, steps, cols, miss, labels, notes)


def _usable_step(v: Any) -> bool:
    try:
        x = parse_number(v)
    except (ValueError, TypeError):
        return False
    return x is not None and math.isfinite(x)


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


def read_npz(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """``.npz`` with one array per key (``step``, ``loss``, ``grad_norm``, ``grad_norm/<layer>``), or
    ``layer_norms`` (steps x layers) with ``layer_names``."""
    key_map = key_map or {}
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # zipfile/pickle errors vary by numpy version
        raise AnalyzeError(f"{path}: not a readable .npz file ({type(e).__name__})") from None
    def array(k: str) -> np.ndarray:
        try:
            return np.asarray(z[k])
        except ValueError as e:  # numpy refuses object arrays without allow_pickle
            if "allow_pickle" not in str(e):
                raise AnalyzeError(f"{path}: array {k!r} cannot be read ({' '.join(str(e).split())[:200]})") from None
            raise AnalyzeError(f"{path}: array {k!r} holds Python objects (dtype=object), which earlywarn does "
                               "not unpickle (loading a pickle can run code); save it as numbers, e.g. "
                               f"np.savez(..., {k}=np.asarray(values, dtype=np.{'int64' if k == step_key else 'float64'}))"
                               ) from None

    with z:
        keys = list(z.files)
        step_key = _step_key(keys, key_map, path)
        steps = array(step_key)
        if steps.ndim != 1 or steps.size == 0:
            raise AnalyzeError(f"{path}: {step_key!r} must be a non-empty 1-D array (empty run?)")
        if steps.dtype.kind not in "fiu":
            raise AnalyzeError(f"{path}: {step_key!r} holds {steps.dtype} values, not numbers; save the steps as "
                               f"integers, e.g. np.savez(..., {step_key}=np.arange(n))")
        n = steps.shape[0]
        cols: dict[str, np.ndarray] = {}
        prefix = key_map.get("layer_prefix", "grad_norm/")
        for k in keys:
            if k in (step_key, "layer_norms", "layer_names"):
                continue
            a = array(k)
            if a.ndim == 1 and a.shape[0] == n and a.dtype.kind in "fiub":
                cols[k] = a.astype(np.float64)
        if "layer_norms" in keys:
            ln = array("layer_norms")
            if ln.dtype.kind not in "fiub":
                raise AnalyzeError(f"{path}: 'layer_norms' holds {ln.dtype} values, not numbers")
            ln = ln.astype(np.float64)
            names = [str(x) for x in array("layer_names")] if "layer_names" in keys else [f"layer{i}" for i in range(ln.shape[1])]
            if ln.ndim != 2 or ln.shape[0] != n or ln.shape[1] != len(names):
                raise AnalyzeError(f"{path}: layer_norms must be (steps x layers) matching step and layer_names")
            for j, name in enumerate(names):
                cols[prefix + name] = ln[:, j]
    if not np.all(np.isfinite(steps)):
        raise AnalyzeError(f"{path}: {step_key!r} holds non-finite values")
    if steps.dtype.kind == "f" or (steps.dtype.kind == "u" and steps.dtype.itemsize == 8):
        bad = bad_steps(steps.astype(np.float64))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise AnalyzeError(f"{path}: {step_key}[{i}] = {steps[i].item()!r} {step_problem(float(steps[i]))}; "
                               "save the steps as int64")
    miss = {k: np.zeros(n, dtype=bool) for k in cols}  # NaN in an array is a logged NaN
    return _split_by_run(path, "npz", steps.astype(np.int64), cols, miss, None, [])


# --------------------------------------------------------------------------------------------
# Text logs: Megatron-LM / Megatron-DeepSpeed, llm.c
# --------------------------------------------------------------------------------------------

_MEGATRON = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
# grep -n / grep over several files prefixes lines with "path:" or "path:lineno:"
_GREP_PREFIX = re.compile(r"^(?P<path>[^\s:\[\]|]*/[^\s:\[\]|]+|[^\s:\[\]|/]+\.[A-Za-z0-9]+):(?:\d+:)?")
_MEGATRON_KEYS = {
    "lmloss": "loss",
    "loss": "loss",
    "gradnorm": "grad_norm",
    "lossscale": "loss_scale",
    "learningrate": "lr",
    "numberofskippediterations": "skipped",
    "numberofnaniterations": "nan_iters",
    "paramsnorm": "param_norm",
    "numzeros": "num_zeros",
}

_LLMC_STDOUT = re.compile(
    r"^\s*step\s+(\d+)\s*/\s*(\d+)\s*[|:]\s*(?:train\s+)?loss\s+(\S+?)(?:\s*\([^)]*\))?\s*(?:\||$)"
)
_LLMC_NORM = re.compile(r"\|\s*norm\s+(\S+?)(?:\s*\([^)]*\))?\s*(?:\||$)")
_LLMC_LR = re.compile(r"\|\s*lr\s+(\S+?)\s*(?:\||$)")
_LLMC_FILE = re.compile(r"^\s*s:(\d+)\s+(trl|tel|eval):(\S+)(.*)$")
_LLMC_SKIP = re.compile(r"skipping update due to (loss|grad) z-score")


def sniff_text(path: str, max_bytes: int = 4 << 20) -> str | None:
    """'megatron', 'llmc' or None, from the first few MB of a text file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(max_bytes)
    except OSError as e:
        raise AnalyzeError(f"{path}: cannot read ({e.strerror})") from None
    if b"\x00" in head[:8192]:
        return None
    text = head.decode("utf-8", errors="replace")
    mega = llmc = 0
    for line in text.splitlines():
        if "iteration" in line and _MEGATRON.search(line) and "loss" in line:
            mega += 1
        elif _LLMC_STDOUT.match(line) or _LLMC_FILE.match(line):
            llmc += 1
        if mega + llmc >= 50:
            break
    if mega == 0 and llmc == 0:
        return None
    return "megatron" if mega >= llmc else "llmc"


def _num_or_nan(text: str) -> float | None:
    try:
        return parse_number(text)
    except ValueError:
        return None


def read_megatron(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | key: value | ...`` lines.

    Lines prefixed by grep (``file:`` or ``file:line:``) are split into one run per file. An
    iteration line without ``lm loss`` is Megatron's way of saying every iteration of the interval
    was skipped (it prints the loss only when some iteration advanced), so such rows are marked
    skipped rather than non-finite.
    """
    rows_by_run: dict[str, list[dict]] = {}
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = _MEGATRON.search(line)
            if not m or "|" not in line:
                continue
            pm = _GREP_PREFIX.match(line)
            run = pm.group("path") if pm else ""
            row: dict[str, Any] = {"step": int(m.group(1))}
            for part in line[m.end():].split("|"):
                if ":" not in part:
                    continue
                key, _, value = part.rpartition(":")
                canon = re.sub(r"\s+", "", key).lower()
                canon = re.sub(r"\(.*?\)", "", canon)
                name = _MEGATRON_KEYS.get(canon, key.strip())
                x = _num_or_nan(value)
                if x is not None:
                    row[name] = x
            if "loss" not in row:
                row["_no_loss"] = 1.0
            rows_by_run.setdefault(run, []).append(row)
    if not rows_by_run:
        raise AnalyzeError(f"{path}: no Megatron 'iteration N/ M | ...' lines found")
    runs = []
    for name, rows in rows_by_run.items():
        steps, cols, miss, notes = columns_from_rows(rows, "step")
        no_loss = cols.pop("_no_loss", None)
        miss.pop("_no_loss", None)
        if no_loss is not None:
            flagged = np.nan_to_num(no_loss) > 0
            sk = cols.setdefault("skipped", np.zeros(len(steps)))
            sm = miss.setdefault("skipped", np.ones(len(steps), dtype=bool))
            # all iterations of the interval skipped: at least one skip
            sk[flagged] = np.maximum(np.nan_to_num(sk[flagged]), 1.0)
            sm[flagged] = False
            notes.append(f"{int(flagged.sum())} iteration line(s) print no lm loss (every iteration skipped)")
        for col in ("loss", "grad_norm"):
            if col not in cols:
                cols[col] = np.full(len(steps), np.nan)
                miss[col] = np.ones(len(steps), dtype=bool)
        run = RawRun(path, name, "megatron", steps, cols, miss, notes=notes, tabular=False)
        runs.append(_finish(run))
    return runs


def read_llmc(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """llm.c logs: stdout ``step N/M | (train )loss X | norm Y | lr Z | ...`` (steps as printed)
    or the ``main.log`` it writes with ``-o`` (``s:N trl:X lr:Z norm:Y``, ``s:N tel:V``)."""
    rows: list[dict] = []
    pending_skip = False
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = _LLMC_STDOUT.match(line)
            if m:
                row: dict[str, Any] = {"step": int(m.group(1)), "loss": _num_or_nan(m.group(3))}
                nm = _LLMC_NORM.search(line)
                if nm:
                    row["grad_norm"] = _num_or_nan(nm.group(1))
                lm = _LLMC_LR.search(line)
                if lm:
                    row["lr"] = _num_or_nan(lm.group(1))
                if pending_skip:
                    row["skipped"] = 1.0
                    pending_skip = False
                rows.append(row)
                continue
            f = _LLMC_FILE.match(line)
            if f:
                s, kind, val = int(f.group(1)), f.group(2), f.group(3)
                if kind == "trl":
                    row = {"step": s, "loss": _num_or_nan(val)}
                    for part in f.group(4).split():
                        k, _, v = part.partition(":")
                        if k == "norm":
                            row["grad_norm"] = _num_or_nan(v)
                        elif k == "lr":
                            row["lr"] = _num_or_nan(v)
                    rows.append(row)
                elif kind == "tel":
                    rows.append({"step": s, "val_loss": _num_or_nan(val)})
                continue
            if _LLMC_SKIP.search(line):
                pending_skip = True
    if not rows:
        raise AnalyzeError(f"{path}: no llm.c 'step N/M | train loss ... | norm ...' lines found")
    steps, cols, miss, notes = columns_from_rows(rows, "step")
    return [_finish(RawRun(path, "", "llmc", steps, cols, miss, notes=notes, tabular=False))]


# --------------------------------------------------------------------------------------------
# Source recognition
# --------------------------------------------------------------------------------------------

SOURCE_FORMS = """\
  mlflow:<tracking_uri>#<run_id>           one MLflow run (e.g. mlflow:sqlite:///mlflow.db#3f2a...)
  mlflow:<tracking_uri>#experiment=<name>  every run of an MLflow experiment
  wandb:<entity>/<project>/<run_id>        a hosted W&B run (full history via scan_history)
  wandb:<entity>/<project>                 every run of a hosted W&B project
  <dir with a .wandb file>, <file>.wandb   an offline W&B run (wandb/offline-run-*/)
  <tfevents file or dir>                   TensorBoard event files (one run per directory)
  trainer_state.json, <checkpoint dir>     Hugging Face Trainer log_history
  *.csv, *.tsv                             a step column and metric columns
  *.jsonl, *.ndjson                        one JSON object per line, or earlywarn's own JSONL log
  *.npz                                    one array per key
  other text logs                          Megatron 'iteration N/ M | ... lm loss: ...' lines or
                                           llm.c 'step N/M | train loss ... | norm ...' lines"""


def _integration(module: str, what: str, extra: str):
    import importlib

    try:
        return importlib.import_module(f"earlywarn.integrations.{module}")
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing and not missing.startswith("earlywarn"):
            raise AnalyzeError(f"reading {what} needs the {missing!r} package: pip install 'earlywarn[{extra}]'") from None
        try:  # running from a source tree where integrations/ is not installed as earlywarn.integrations
            return importlib.import_module(f"integrations.{module}")
        except ImportError as e2:
            missing2 = getattr(e2, "name", None) or ""
            if missing2 and not missing2.startswith("integrations"):
                raise AnalyzeError(f"reading {what} needs the {missing2!r} package: pip install 'earlywarn[{extra}]'") from None
            raise AnalyzeError(f"reading {what} needs earlywarn.integrations.{module}, which is not installed") from None


def _find_files(root: str, pred: Callable[[str], bool], max_depth: int = 4) -> list[str]:
    found = []
    base_depth = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath.count(os.sep) - base_depth >= max_depth:
            dirnames[:] = []
        dirnames.sort()
        for f in sorted(filenames):
            if pred(f):
                found.append(os.path.join(dirpath, f))
    return found


def _hf_state_in(directory: str) -> str | None:
    direct = os.path.join(directory, "trainer_state.json")
    if os.path.isfile(direct):
        return direct
    best, best_step = None, -1
    for f in _find_files(directory, lambda n: n == "trainer_state.json", max_depth=2):
        m = re.search(r"checkpoint-(\d+)", f)
        s = int(m.group(1)) if m else 0
        if s > best_step:
            best, best_step = f, s
    return best


def read_source(spec: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """Recognise ``spec`` by its form and read it. Raises :class:`AnalyzeError` with one line."""
    key_map = dict(key_map or {})
    if not isinstance(spec, str) or not spec.strip():
        raise AnalyzeError(f"empty source {spec!r}")
    if spec.startswith("mlflow:"):
        return _integration("mlflow_source", "MLflow runs", "mlflow").read_mlflow(spec, key_map=key_map)
    if spec.startswith("wandb:"):
        return _integration("wandb_source", "W&B runs", "wandb").read_wandb_api(spec, key_map=key_map)
    path = spec
    if not os.path.exists(path):
        raise AnalyzeError(f"{path}: no such file or directory (sources: a file, a directory, mlflow:..., wandb:...)")
    if os.path.isdir(path):
        wandb_files = _find_files(path, lambda n: n.endswith(".wandb"), max_depth=3)
        if wandb_files:
            return _integration("wandb_source", "offline W&B runs", "wandb").read_wandb_offline(path, key_map=key_map)
        tf = _find_files(path, lambda n: "tfevents" in n, max_depth=4)
        if tf:
            return _integration("tensorboard_source", "TensorBoard event files", "tensorboard").read_tensorboard(
                path, key_map=key_map
            )
        hf = _hf_state_in(path)
        if hf:
            return read_json(hf, key_map)
        raise AnalyzeError(
            f"{path}: unknown format: a directory without a .wandb file, TensorBoard event files or trainer_state.json"
        )
    name = os.path.basename(path).lower()
    if "tfevents" in name:
        return _integration("tensorboard_source", "TensorBoard event files", "tensorboard").read_tensorboard(
            path, key_map=key_map
        )
    if name.endswith(".wandb"):
        return _integration("wandb_source", "offline W&B runs", "wandb").read_wandb_offline(path, key_map=key_map)
    if os.path.getsize(path) == 0:
        raise AnalyzeError(f"{path}: empty file")
    if name.endswith((".csv", ".tsv")):
        return read_csv(path, key_map)
    if name.endswith((".jsonl", ".ndjson")):
        return read_jsonl(path, key_map)
    if name.endswith(".json"):
        return read_json(path, key_map)
    if name.endswith(".npz"):
        return read_npz(path, key_map)
    kind = sniff_text(path)
    if kind == "megatron":
        return read_megatron(path, key_map)
    if kind == "llmc":
        return read_llmc(path, key_map)
    raise AnalyzeError(
        f"{path}: unknown format: not .csv/.jsonl/.json/.npz/tfevents/.wandb, and no Megatron "
        "'iteration N/ M | ...' or llm.c 'step N/M | ...' lines found"
    )
