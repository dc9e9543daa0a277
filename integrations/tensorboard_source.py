"""TensorBoard event files as analysis sources (needs the ``tensorboard`` package).

A path is an event file (``events.out.tfevents.*``) or a directory; every directory that holds
event files is one run (TensorBoard's own notion of a run), its files read in the order of
their first event's wall time (a restarted job's new file comes after the old one).

Records are read raw (TFRecord framing + ``event_pb2``), not through ``EventAccumulator``:
the accumulator keeps only 10,000 scalars per tag by default (reservoir sampling) and purges
"orphaned" steps after a restart, which would hide exactly the resumes the analyser reports.
Scalars written as ``simple_value`` (torch ``SummaryWriter``, tensorboardX) and as scalar tensors
(TF2 ``tf.summary.scalar``) are both read.
"""

from __future__ import annotations

import os
import struct
from collections import defaultdict
from typing import Any, Mapping

from earlywarn.analyze.rawrun import AnalyzeError, RawRun, columns_from_rows, merge_adjacent_same_step


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _modules():
    try:
        from tensorboard.compat.proto import event_pb2
    except ImportError:
        raise AnalyzeError(
            "reading TensorBoard event files needs the 'tensorboard' package: pip install 'earlywarn[tensorboard]'"
        ) from None
    return _records, event_pb2


def _records(path: str):
    """TFRecord framing: u64 length, u32 crc(length), payload, u32 crc(payload).

    TensorBoard's pure-Python reader checks CRC32C byte by byte (~70 us per scalar); here a record
    whose length runs past the end of the file (a torn tail of a killed job) ends the file.
    """
    with open(path, "rb") as fh:
        data = fh.read()
    off, n = 0, len(data)
    unpack = struct.unpack_from
    while off + 12 <= n:
        (length,) = unpack("<Q", data, off)
        end = off + 12 + length + 4
        if end > n:
            return
        yield data[off + 12: off + 12 + length]
        off = end


def _scalar(v: Any) -> float | None:
    kind = v.WhichOneof("value")
    if kind == "simple_value":
        return float(v.simple_value)
    if kind == "tensor":
        t = v.tensor
        if t.tensor_shape.dim and any(d.size != 1 for d in t.tensor_shape.dim):
            return None  # not a scalar (histograms, images)
        for field in ("float_val", "double_val", "int_val", "int64_val", "half_val"):
            vals = getattr(t, field)
            if len(vals):
                return float(vals[0])
        if t.tensor_content:
            from tensorboard.util import tensor_util

            arr = tensor_util.make_ndarray(t)
            if arr.size == 1 and arr.dtype.kind in "fiu":
                return float(arr.reshape(-1)[0])
    return None


def _read_file(f: str, loader_cls: Any, event_pb2: Any) -> tuple[float, str, list[dict[str, float]], int]:
    """(first wall time, path, rows, corrupt records) of one event file."""
    rows: list[dict[str, float]] = []
    current: dict[str, float] | None = None
    cur_step = None
    bad = 0
    first_time = float("inf")
    records = 0
    try:
        for rec in loader_cls(f):
            records += 1
            try:
                ev = event_pb2.Event.FromString(rec)
            except Exception:
                bad += 1
                continue
            if first_time == float("inf"):
                first_time = ev.wall_time
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                x = _scalar(v)
                if x is None:
                    continue
                # one row per step; a tag seen again at the same step starts a new row (the step
                # ran twice: a resume)
                if current is None or ev.step != cur_step or v.tag in current:
                    current = {"step": ev.step}
                    cur_step = ev.step
                    rows.append(current)
                current[v.tag] = x
    except Exception as e:
        raise AnalyzeError(f"{f}: unparsable TensorBoard event file ({type(e).__name__}: {_one_line(e)})") from None
    if os.path.getsize(f) and (records == 0 or bad == records):
        raise AnalyzeError(f"{f}: unparsable TensorBoard event file (no valid record)")
    return first_time, f, rows, bad


def _run_dirs(path: str) -> dict[str, list[str]]:
    if os.path.isfile(path):
        return {os.path.dirname(path) or ".": [path]}
    runs: dict[str, list[str]] = defaultdict(list)
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for f in sorted(filenames):
            if "tfevents" in f:
                runs[dirpath].append(os.path.join(dirpath, f))
    return dict(runs)


def read_tensorboard(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    loader_cls, event_pb2 = _modules()
    dirs = _run_dirs(path)
    if not dirs:
        raise AnalyzeError(f"{path}: no TensorBoard event files found")
    out = []
    root = path if os.path.isdir(path) else os.path.dirname(path)
    for run_dir, files in dirs.items():
        # a restarted job writes a new file: order the files by their first event's wall time
        per_file = [_read_file(f, loader_cls, event_pb2) for f in files]
        per_file.sort(key=lambda t: (t[0], t[1]))
        rows: list[dict[str, float]] = []
        bad = 0
        for _, _, file_rows, file_bad in per_file:
            rows.extend(file_rows)
            bad += file_bad
        if not rows:
            if len(dirs) == 1:
                raise AnalyzeError(f"{path}: the event files hold no scalars (empty run)")
            continue
        steps, cols, miss, notes = columns_from_rows(rows, "step", source=run_dir, where=lambda i: f"scalar row {i + 1}")
        if bad:
            notes.append(f"{bad} corrupt record(s) were left out")
        steps, cols, miss, _ = merge_adjacent_same_step(steps, cols, miss)
        rel = os.path.relpath(run_dir, root)
        name = "" if len(dirs) == 1 else ("." if rel == "." else rel)
        out.append(RawRun(path, name, "tensorboard", steps, cols, miss, notes=notes))
    if not out:
        raise AnalyzeError(f"{path}: the event files hold no scalars (empty run)")
    return out
