"""CSV / TSV logs: a header row naming the columns, a step column, one row per logged step.

A file of numbers only (``nan``, ``inf`` and, with pyarrow, blanks included) is parsed by a fast C
reader (:func:`numeric_csv_columns`); anything else (text cells, a ragged or half-written line,
a ``run`` column) by the careful path, which says which line and cell it could not read.
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import numpy as np

from earlywarn.analyze.rawrun import (
    CELL_FIX, NULL_TOKENS, AnalyzeError, RawRun, bad_steps, parse_number, pick_run_key, pick_step_key, split_by_run,
    step_problem,
)


# the spellings of "not logged" the careful reader accepts (it strips and lower-cases a cell),
# written out for pyarrow, which matches null values exactly
_ARROW_NULLS = sorted({v for t in NULL_TOKENS for v in (t, t.upper(), t.capitalize(), t.title())})


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


@dataclass
class _Header:
    names: list[str]
    delim: str
    step_key: str
    run_key: str | None


@dataclass
class _Table:
    """The file's columns before the step column is taken out of them."""

    cols: dict[str, np.ndarray]
    miss: dict[str, np.ndarray]
    run_labels: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)


def read_csv(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """CSV/TSV with a header row. One run, or one per value of a ``run`` column."""
    header = _read_header(path, key_map or {})
    table = _numeric_table(path, header) if header.run_key is None else None
    if table is None:
        table = _careful_table(path, header)
    steps = _take_steps(path, header, table)
    return split_by_run(path, "csv", steps, table.cols, table.miss, table.run_labels, table.notes)


def _read_header(path: str, key_map: Mapping[str, str]) -> _Header:
    """The column names, the delimiter and the step / run columns; refuses a file without rows."""
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
    names = [h.strip() for h in next(csv.reader([first], delimiter=delim))]
    if len(names) < 2 or len(set(names)) != len(names) or any(not h for h in names):
        raise AnalyzeError(f"{path}: unparsable CSV header {first[:80]!r} (need unique column names, one of them a step)")
    step_key = pick_step_key(names, key_map, path)
    run_key = pick_run_key(names, key_map, path)
    if not rest_starts.strip():
        raise AnalyzeError(f"{path}: no rows after the header (empty run)")
    return _Header(names, delim, step_key, run_key)


def _numeric_table(path: str, header: _Header) -> _Table | None:
    """The fast path (:func:`numeric_csv_columns`); None when the file needs the careful one."""
    parsed = numeric_csv_columns(path, header.delim)
    if parsed is None:
        return None
    data, missing_cells = parsed
    if data.shape[1] == 0:
        raise AnalyzeError(f"{path}: no rows after the header (empty run)")
    if data.shape[0] != len(header.names):
        raise AnalyzeError(f"{path}: rows have {data.shape[0]} cells but the header names {len(header.names)} columns")
    no_missing = np.zeros(data.shape[1], dtype=bool)
    table = _Table({}, {})
    for j, name in enumerate(header.names):
        table.cols[name] = data[j]
        table.miss[name] = no_missing if missing_cells is None else missing_cells[j]
    return table


def _careful_table(path: str, header: _Header) -> _Table:
    """Cell by cell: text columns are left out, an unreadable cell in a metric column is refused
    (read as NaN it would be a collapse that never happened), a half-written last line dropped."""
    rows, notes = _complete_rows(path, header)
    table = _Table({}, {}, notes=notes)
    columns_t = list(zip(*rows))
    for j, name in enumerate(header.names):
        raw = np.asarray(columns_t[j], dtype=object)
        if name == header.run_key:
            table.run_labels = np.asarray([str(x).strip() for x in raw])
            continue
        values, missing, unreadable = _strings_to_floats(raw)
        if values is None:
            continue  # a text column (a snippet id, a path): not a metric
        if unreadable is not None and name != header.step_key:  # rows without a step: left out, with a note
            line, _ = _csv_line_of(path, header.delim, j, _unreadable_cell)
            raise AnalyzeError(f"{path}: line {line}, column {name!r}: cannot read {unreadable!r} as a number; "
                               f"{CELL_FIX}")
        table.cols[name] = values
        table.miss[name] = missing
    return table


def _complete_rows(path: str, header: _Header) -> tuple[list[list[str]], list[str]]:
    """The data rows (blank lines skipped) and a note when a cut last line was left out."""
    try:
        with open(path, "r", encoding="utf-8-sig", newline="") as fh:
            text = fh.read()
    except UnicodeDecodeError:
        raise AnalyzeError(f"{path}: not a text file (cannot decode it as UTF-8)") from None
    notes: list[str] = []
    rows = list(csv.reader(io.StringIO(text), delimiter=header.delim))[1:]
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if not rows:
        raise AnalyzeError(f"{path}: no rows after the header (empty run)")
    width = len(header.names)
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
    return rows, notes


def _take_steps(path: str, header: _Header, table: _Table) -> np.ndarray:
    """The step column (int64), taken out of ``table``: rows without a usable step are left out
    of every column (noted); a step that is not a whole number within int64 is refused."""
    step_key = header.step_key
    if step_key not in table.cols:
        raise AnalyzeError(f"{path}: step column {step_key!r} is not numeric")
    steps_f = table.cols.pop(step_key)
    steps_m = table.miss.pop(step_key)
    ok = ~steps_m & np.isfinite(steps_f)
    if not ok.all():
        table.notes.append(f"{int((~ok).sum())} row(s) without a usable {step_key!r} value were left out")
        steps_f = steps_f[ok]
        table.cols = {k: v[ok] for k, v in table.cols.items()}
        table.miss = {k: v[ok] for k, v in table.miss.items()}
        if table.run_labels is not None:
            table.run_labels = table.run_labels[ok]
    if steps_f.size == 0:
        raise AnalyzeError(f"{path}: no rows with a step value (empty run)")
    bad = bad_steps(steps_f)
    if bad.any():
        x = float(steps_f[np.flatnonzero(bad)[0]])
        j = header.names.index(step_key)
        line, cell = _csv_line_of(path, header.delim, j, lambda c: _cell_step_problem(c) is not None)
        raise AnalyzeError(f"{path}: line {line}, column {step_key!r}: {cell!r} {step_problem(x)}; fix that row "
                           "or name the step column with --key step=<column>")
    return steps_f.astype(np.int64)




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
    missing = np.isin(low, list(NULL_TOKENS))
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
