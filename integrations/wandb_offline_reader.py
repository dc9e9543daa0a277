"""Read a W&B run file (``run-<id>.wandb``) without a server: history rows, summary, alerts.

W&B no longer ships a public Python reader for its transaction log. The file is a leveldb-style
log: a 7-byte file header (``":W&B"``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks,
each with a 7-byte header (CRC32 seeded with the chunk type, length, type FULL/FIRST/MIDDLE/LAST);
a block tail shorter than a header is zero padding. Each assembled record is a
``wandb.proto.wandb_internal_pb2.Record`` (protobuf definitions that ship inside ``wandb``).

A run that is still being written (or was killed) ends in a partial block: reading stops at the
first incomplete or corrupt chunk and returns what came before (``OfflineRun.truncated``).
Used by the W&B sink's tests and by the offline analyser.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

_IDENT = b":W&B"
_MAGIC = 0xBEE1
_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (_FULL, _FIRST, _MIDDLE, _LAST)}


class WandbFileError(ValueError):
    """Not a W&B run file (wrong header)."""


def find_run_file(path: str | os.PathLike) -> str:
    """``path`` itself if it is a file, else the newest ``*.wandb`` under the run folder ``path``."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    files = glob.glob(os.path.join(path, "*.wandb")) or glob.glob(os.path.join(path, "**", "*.wandb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no .wandb run file under {path!r}")
    return max(files, key=os.path.getmtime)


def iter_raw_records(data: bytes) -> Iterator[bytes]:
    """Assembled record payloads from the bytes of a run file; stops at a torn or corrupt tail."""
    if len(data) < _HEADER:
        raise WandbFileError("file too short for a W&B header")
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    if ident != _IDENT or magic != _MAGIC or version != 0:
        raise WandbFileError(f"not a W&B run file (header {data[:_HEADER]!r})")
    off = _HEADER
    pending: bytearray | None = None
    n = len(data)
    while off + _HEADER <= n:
        room = _BLOCK - off % _BLOCK
        if room < _HEADER:  # zero padding at the end of a block
            off += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[off : off + _HEADER])
        if kind not in _TYPE_CRC or length > room - _HEADER or off + _HEADER + length > n:
            return  # torn tail (or zeros of a block not yet written)
        chunk = data[off + _HEADER : off + _HEADER + length]
        if zlib.crc32(chunk, _TYPE_CRC[kind]) & 0xFFFFFFFF != crc:
            return
        off += _HEADER + length
        if kind == _FULL:
            pending = None
            yield bytes(chunk)
        elif kind == _FIRST:
            pending = bytearray(chunk)
        elif pending is not None:
            pending += chunk
            if kind == _LAST:
                yield bytes(pending)
                pending = None


def iter_records(path: str | os.PathLike) -> Iterator[Any]:
    """``wandb_internal_pb2.Record`` objects of one run file, in write order."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(find_run_file(path), "rb") as fh:
        data = fh.read()
    for raw in iter_raw_records(data):
        rec = pb.Record()
        rec.ParseFromString(raw)
        yield rec


def _json(value_json: str) -> Any:
    try:
        return json.loads(value_json)  # W&B writes NaN / Infinity, which json accepts
    except ValueError:
        return value_json


def _item_key(item: Any) -> str:
    return ".".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    """What a run file holds: enough to check a run or to analyse it offline."""

    path: str
    run_id: str | None = None
    project: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per committed row (``_step``, ``_timestamp``, ``_runtime`` and the logged keys)."""
    summary: dict[str, Any] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """``{"title", "text", "level", "wait_duration_s"}`` per ``run.alert``."""
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    """``{"name", "type", "aliases", "metadata"}`` per logged artifact."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """``define_metric`` records: ``{"name" | "glob_name", "step_metric", "summary"}``."""
    exit_code: int | None = None
    """Set when the run finished (an exit record was written); ``None`` for a run cut short."""
    truncated: bool = False
    """True when no exit record was found: the file may lack its last records."""

    def series(self, key: str, step_key: str = "_step") -> tuple[list[float], list[Any]]:
        """``(steps, values)`` of one history key, over the rows that hold it."""
        steps, values = [], []
        for row in self.history:
            if key in row:
                steps.append(row.get(step_key))
                values.append(row[key])
        return steps, values


def read_offline_run(path: str | os.PathLike) -> OfflineRun:
    """Decode a run file (or the newest one under a run folder) into an :class:`OfflineRun`."""
    file = find_run_file(path)
    run = OfflineRun(path=file)
    for rec in iter_records(file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_item_key(i): _json(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                run.summary[_item_key(item)] = _json(item.value_json)
            for item in rec.summary.remove:
                run.summary.pop(_item_key(item), None)
        elif kind == "alert":
            a = rec.alert
            run.alerts.append(
                {"title": a.title, "text": a.text, "level": a.level, "wait_duration_s": a.wait_duration / 1000.0}
            )
        elif kind == "run":
            r = rec.run
            run.run_id = r.run_id or run.run_id
            run.project = r.project or run.project
            run.tags = list(r.tags) or run.tags
            for item in r.config.update:
                run.config[_item_key(item)] = _json(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run.config[_item_key(item)] = _json(item.value_json)
        elif kind == "artifact":
            a = rec.artifact
            run.artifacts.append(
                {"name": a.name, "type": a.type, "aliases": list(a.aliases), "metadata": _json(a.metadata or "{}")}
            )
        elif kind == "metric":
            m = rec.metric
            run.metrics.append(
                {
                    "name": m.name or None,
                    "glob_name": m.glob_name or None,
                    "step_metric": m.step_metric or None,
                    "summary": [f.name for f, v in m.summary.ListFields() if v],
                }
            )
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    run.truncated = run.exit_code is None
    return run
