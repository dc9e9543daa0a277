"""Disk checkpoints that a crash cannot corrupt, loaded with ``weights_only=True`` only.

Write protocol: serialise to a hidden temp file in the same directory, ``flush`` + ``fsync``,
``os.replace`` onto the final name, ``fsync`` the directory. A crash at any point leaves either
the previous set of checkpoints or the previous set plus the complete new one; a torn temp file
is never under a checkpoint name and is removed when a manager next opens the directory.

Names: ``step-<step:010d>.<tag>.pt`` with tag ``clean`` for checkpoints taken with no alert in
the clean window, else the reason (``warning``...). Retention keeps the newest ``keep`` clean
ones and the newest ``keep_unclean`` others. A rewind renames checkpoints newer than its target
to ``*.abandoned`` (kept for forensics, never loaded by ``latest``).

One writer per directory (rank 0); other ranks read.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ._state import HostCopy, decode_safe, encode_safe, to_host
from .errors import CheckpointError

FORMAT = "earlywarn.checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{10})\.([A-Za-z0-9_-]+)\.pt$")


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    tag: str
    path: Path

    @property
    def clean(self) -> bool:
        return self.tag == "clean"


def _fsync_path(path: Path) -> None:
    """fsync a file, or every file in a directory tree and the directories themselves."""
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for f in files:
                _fsync_path(Path(root) / f)
        _fsync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the rename is then best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _tag(clean: bool, reason: str) -> str:
    if clean:
        return "clean"
    tag = re.sub(r"[^A-Za-z0-9_-]+", "_", reason).strip("_") or "unclean"
    return "unclean" if tag == "clean" else tag[:40]


class CheckpointManager:
    """Atomic, retained, optionally asynchronous checkpoints in one directory.

    Args:
        directory: where checkpoints live (created).
        keep: clean checkpoints to keep (newest).
        keep_unclean: other checkpoints (taken on a warning) to keep.
        async_write: ``save`` copies the state to host memory and returns; serialisation and
            the atomic rename happen on a background thread. One write at a time: a new save
            waits for the previous one; an error in the background is raised by the next
            ``save``/``wait``/``close``.
        save_fn: ``save_fn(payload, path)`` instead of ``torch.save`` (e.g. a
            ``torch.distributed.checkpoint`` writer; ``path`` may become a directory). It
            writes to a temp path that is fsynced and renamed like the built-in writer.
        load_fn: ``load_fn(path) -> payload`` instead of ``torch.load(..., weights_only=True)``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        keep_unclean: int = 1,
        async_write: bool = False,
        save_fn: Callable[[dict[str, Any], str], None] | None = None,
        load_fn: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1 (the last clean checkpoint is what a rewind or resume needs)")
        if keep_unclean < 0:
            raise ValueError(f"keep_unclean={keep_unclean}: must be >= 0")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.keep_unclean = keep_unclean
        self.async_write = async_write
        self.save_fn = save_fn
        self.load_fn = load_fn
        self._counter = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # torn temp files from a crash of an earlier writer
        for p in self.directory.iterdir():
            if p.name.startswith(".tmp."):
                _remove(p)

    # -- listing -----------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first."""
        out = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append(CheckpointInfo(int(m.group(1)), m.group(2), p))
        out.sort(key=lambda c: (c.step, c.clean))
        return out

    def latest(self, *, clean_only: bool = True, before: int | None = None) -> CheckpointInfo | None:
        for c in reversed(self.list()):
            if clean_only and not c.clean:
                continue
            if before is not None and c.step >= before:
                continue
            return c
        return None

    # -- writing -----------------------------------------------------------------------------
    def save(
        self,
        state: Mapping[str, Any] | HostCopy,
        step: int,
        *,
        clean: bool = True,
        reason: str = "periodic",
        on_done: Callable[[], None] | None = None,
    ) -> str:
        """Write a checkpoint; returns its final path (in async mode, the path it will have).

        ``state`` is a state tree (see :mod:`earlywarn.recover.snapshot`) or a :class:`HostCopy`
        of one. In async mode a live tree is first copied to host memory (the training thread
        then keeps going while the copy is written)."""
        self.wait()
        final = self.directory / f"step-{int(step):010d}.{_tag(clean, reason)}.pt"
        if self.async_write and not isinstance(state, HostCopy):
            state = to_host(state)
        tree = state.tree if isinstance(state, HostCopy) else state
        # encoding walks the tree only (no tensor copies): an unsafe value fails here, in the
        # training thread, rather than in a checkpoint nobody can load
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "step": int(step),
            "clean": bool(clean),
            "reason": reason,
            "time": time.time(),
            "state": encode_safe(tree),
        }
        host = state if isinstance(state, HostCopy) else None
        if self.async_write:
            def work() -> None:
                try:
                    if host is not None:
                        host.wait()
                    self._write(payload, final)
                except BaseException as e:  # surfaced by the next save/wait/close
                    self._error = e
                finally:
                    if on_done is not None:
                        on_done()

            self._thread = threading.Thread(target=work, name="earlywarn-checkpoint", daemon=True)
            self._thread.start()
        else:
            try:
                if host is not None:
                    host.wait()
                self._write(payload, final)
            finally:
                if on_done is not None:
                    on_done()
        return str(final)

    def _write(self, payload: dict[str, Any], final: Path) -> None:
        with self._lock:
            self._counter += 1
            tmp = self.directory / f".tmp.{final.name}.{os.getpid()}.{self._counter}"
        try:
            if self.save_fn is not None:
                self.save_fn(payload, str(tmp))
                if not tmp.exists():
                    raise CheckpointError(f"save_fn wrote nothing at {tmp}: it must write to the path it is given")
                _fsync_path(tmp)
            else:
                with open(tmp, "wb") as f:
                    torch.save(payload, f)
                    f.flush()
                    os.fsync(f.fileno())
            if final.is_dir():  # os.replace cannot replace a non-empty directory
                _remove(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            _remove(tmp)
            raise
        self._retain()

    def _retain(self) -> None:
        items = self.list()
        for clean, cap in ((True, self.keep), (False, self.keep_unclean)):
            same = [c for c in items if c.clean == clean]
            for c in same[: max(0, len(same) - cap)]:
                _remove(c.path)
        abandoned = sorted(p for p in self.directory.iterdir() if p.name.endswith(".abandoned"))
        for p in abandoned[: max(0, len(abandoned) - self.keep)]:
            _remove(p)

    def wait(self) -> None:
        """Block until a background write has finished; raise its error if it failed."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"background checkpoint write failed: {err!r}") from err

    def close(self) -> None:
        self.wait()

    def discard_after(self, step: int) -> list[Path]:
        """Rename checkpoints newer than ``step`` to ``*.abandoned``: a rewind left that
        trajectory, and ``latest()`` / a resume must not pick them up."""
        self.wait()
        moved = []
        for c in self.list():
            if c.step > step:
                dst = c.path.with_name(c.path.name + ".abandoned")
                if dst.exists():
                    _remove(dst)
                os.replace(c.path, dst)
                moved.append(dst)
        if moved:
            _fsync_dir(self.directory)
        return moved

    # -- reading -----------------------------------------------------------------------------
    def load(self, path: str | os.PathLike[str] | CheckpointInfo) -> dict[str, Any]:
        """Read a checkpoint (``weights_only=True``, tensors on CPU); returns the payload with
        ``step``, ``clean``, ``reason`` and ``state``."""
        return load_checkpoint(path.path if isinstance(path, CheckpointInfo) else path, load_fn=self.load_fn)


def load_checkpoint(
    path: str | os.PathLike[str], *, load_fn: Callable[[str], dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Read an earlywarn checkpoint with ``torch.load(weights_only=True)`` (or ``load_fn``)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}")
    try:
        if load_fn is not None:
            payload = load_fn(str(p))
        else:
            payload = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {p}: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{p} is not an earlywarn checkpoint (format={found!r})")
    if payload.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{p} was written by a newer earlywarn (format version {payload['version']}); upgrade earlywarn to read it"
        )
    payload = dict(payload)
    payload["state"] = decode_safe(payload["state"])
    return payload
