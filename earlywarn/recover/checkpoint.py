"""Disk checkpoints that a crash cannot corrupt, loaded with ``weights_only=True`` only.

Write protocol: serialise to a hidden temp file in the same directory, ``flush`` + ``fsync``,
``os.replace`` onto the final name, ``fsync`` the directory. A crash at any point leaves either
the previous set of checkpoints or the previous set plus the complete new one; a torn temp file
is never under a checkpoint name and is removed when a manager next opens the directory.

Names: ``step-<step:010d>.<tag>.pt`` with tag ``clean`` for checkpoints taken with no alert in
the clean window, else the reason (``warning``...). Retention keeps the newest ``keep`` clean
ones and the newest ``keep_unclean`` others. A rewind renames checkpoints newer than its target
to ``*.abandoned`` (kept for forensics, never loaded by ``latest``).

Under torch.distributed (world size > 1) there are two modes, chosen by the writer:

* **Per-rank files** (the default ``torch.save`` writer, or any ``save_fn`` that is not
  collective): every rank writes its own complete checkpoint, in its own directory
  (``RecoveryConfig`` uses ``<checkpoint_dir>/rank<r>``). One writer per directory.
* **Collective** (``save_fn.collective = True``, set by
  :func:`earlywarn.distributed.dcp_checkpoint_fns`, or ``collective=True``): every rank calls
  ``save_fn`` together on one shared directory (a filesystem all ranks see) and each writes its
  part. The temp path is the same on every rank (derived from the step and tag, not the pid);
  after the save all ranks agree that every part was written, then rank 0 alone fsyncs, renames,
  prunes and renames abandoned checkpoints, and all ranks wait for it before going on -- so every
  rank lists the same checkpoints afterwards. Every method that writes is then a collective: call
  it on every rank. Collective writes run on the calling thread (``async_write`` is refused).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .forms import distributed_rank
from .hostcopy import HostCopy, to_host
from .safe import decode_safe, encode_safe
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


def is_collective(save_fn: Any) -> bool:
    """Whether ``save_fn`` declares itself a collective (``save_fn.collective = True``)."""
    return save_fn is not None and getattr(save_fn, "collective", False) is True


def _group_rank(collective: bool) -> int | None:
    """This rank when a collective writer runs under torch.distributed with more than one
    process; ``None`` when this process writes alone."""
    return distributed_rank() if collective else None


def _agree(ok: bool) -> bool:
    """Every rank's ``ok``, ANDed over all ranks: a barrier that also carries a failure."""
    d = torch.distributed
    device = torch.device("cpu")
    if "gloo" not in str(d.get_backend()) and torch.cuda.is_available():  # NCCL: CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    d.all_reduce(flag, op=d.ReduceOp.MIN)
    return bool(flag.item())


def _check_writable(directory: Path) -> None:
    """Create ``directory`` and prove a file can be written there, at watch() time: a run that
    would only learn hours in that its checkpoints go nowhere must fail before it starts."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".tmp.writable.{os.getpid()}.{threading.get_ident()}"
        with open(probe, "wb") as f:
            f.write(b"earlywarn")
        # written: the directory is writable. Gone already: in a shared directory rank 0 removes
        # ".tmp." files left by a crash as it opens its manager, another rank's live probe included
        probe.unlink(missing_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {directory} is not writable ({type(e).__name__}: [Errno {e.errno}] "
            f"{e.strerror}): give RecoveryConfig(checkpoint_dir=...) a directory this process can "
            "write to, or None for in-memory snapshots only") from e


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
        collective: ``save_fn`` is a collective that every rank calls with the same path (see
            the module docstring). ``None``: the ``collective`` attribute of ``save_fn`` decides
            (``dcp_checkpoint_fns`` sets it); the default ``torch.save`` writer never is.
            Only matters under torch.distributed with more than one process.
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
        collective: bool | None = None,
    ) -> None:
        collective = is_collective(save_fn) if collective is None else bool(collective)
        if collective and save_fn is None:
            raise ValueError("collective=True needs a collective save_fn (e.g. earlywarn.distributed.dcp_checkpoint_fns): "
                             "the default torch.save writer writes one file per rank")
        if collective and async_write:
            raise ValueError("async_write=True with a collective save_fn: a collective must run on the training "
                             "thread of every rank (a background thread would interleave it with the training "
                             "collectives); use async_write=False")
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1 (the last clean checkpoint is what a rewind or resume needs)")
        if keep_unclean < 0:
            raise ValueError(f"keep_unclean={keep_unclean}: must be >= 0")
        self.directory = Path(directory)
        _check_writable(self.directory)
        self.keep = keep
        self.keep_unclean = keep_unclean
        self.async_write = async_write
        self.save_fn = save_fn
        self.load_fn = load_fn
        self.collective = collective
        self._counter = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_path: Path | None = None
        self.failures = 0
        """Writes that failed (disk full, read-only, a save_fn that raised): each was warned about
        (the first loudly), training went on, and the last good checkpoints were kept."""
        self.on_failure: Callable[[Path, BaseException], None] | None = None
        """Called with (path, error) after a failed write (the recovery layer emits an event)."""
        self._lock = threading.Lock()
        # torn temp files from a crash of an earlier writer (a shared directory: rank 0 owns them)
        if _group_rank(self.collective) in (None, 0):
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
        """Write a checkpoint; returns its final path (in async mode, the path it will have), or
        ``None`` when the write failed.

        ``state`` is a state tree (see :mod:`earlywarn.recover.snapshot`) or a :class:`HostCopy`
        of one. In async mode a live tree is first copied to host memory (the training thread
        then keeps going while the copy is written). A failed write (disk full, read-only
        filesystem, a ``save_fn`` that raises) never stops training: it is warned about, counted
        in ``failures``, leaves no partial file, and the last good checkpoints are kept."""
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
                except Exception as e:  # reported by the next save/wait/close (training thread)
                    self._error, self._error_path = e, final
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
            except Exception as e:
                if self.collective and _group_rank(True) is not None:
                    raise  # every rank saw the same failure (_write_collective agrees on it)
                self._failed(final, e)
                return None
            finally:
                if on_done is not None:
                    on_done()
        return str(final)

    def _failed(self, path: Path, error: BaseException) -> None:
        self.failures += 1
        if self.failures == 1:
            errno = getattr(error, "errno", None)
            code = f"[Errno {errno}] " if errno is not None else ""
            warnings.warn(
                f"earlywarn: could not write checkpoint {path} ({type(error).__name__}: {code}"
                f"{getattr(error, 'strerror', None) or error}); training goes on and the last good "
                f"checkpoints in {self.directory} are kept. Later failures are counted, not repeated "
                "(free space, or point checkpoint_dir at a writable disk).", RuntimeWarning, stacklevel=3)
        if self.on_failure is not None:
            self.on_failure(path, error)

    def _write(self, payload: dict[str, Any], final: Path) -> None:
        if _group_rank(self.collective) is not None:
            self._write_collective(payload, final)
            return
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

    def _write_collective(self, payload: dict[str, Any], final: Path) -> None:
        """Every rank writes its part to one shared temp path; rank 0 commits (module docstring)."""
        assert self.save_fn is not None
        rank = _group_rank(True)
        tmp = self.directory / f".tmp.{final.name}"  # the same on every rank
        if rank == 0:
            _remove(tmp)  # left by an attempt at this step that failed
        _agree(True)  # nobody writes into it before it is gone
        error: BaseException | None = None
        try:
            self.save_fn(payload, str(tmp))
        except Exception as e:  # still take part in the agreement below, or the others hang
            error = e
        if not _agree(error is None):
            if rank == 0:
                _remove(tmp)
            if error is not None:
                raise error
            raise CheckpointError(f"another rank failed to write its part of {final.name}; nothing was committed")
        if rank == 0:
            try:
                if not tmp.exists():
                    raise CheckpointError(f"save_fn wrote nothing at {tmp}: it must write to the path it is given")
                _fsync_path(tmp)
                if final.is_dir():  # os.replace cannot replace a non-empty directory
                    _remove(final)
                os.replace(tmp, final)
                _fsync_dir(self.directory)
                self._retain()
            except Exception as e:
                error = e
                _remove(tmp)
        if not _agree(error is None):  # the others wait for the commit: then all list the same
            if error is not None:
                raise error
            raise CheckpointError(f"rank 0 could not commit {final.name} (see its error)")

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
        """Block until a background write has finished; a failed one is reported (warned about,
        counted in ``failures``), never raised: training must not die of a full disk."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            path, self._error_path = self._error_path, None
            self._failed(path or self.directory, err)

    def close(self) -> None:
        self.wait()

    def discard_after(self, step: int) -> list[Path]:
        """Rename checkpoints newer than ``step`` to ``*.abandoned``: a rewind left that
        trajectory, and ``latest()`` / a resume must not pick them up."""
        self.wait()
        rank = _group_rank(self.collective)
        moved = []
        for c in self.list():
            if c.step > step:
                dst = c.path.with_name(c.path.name + ".abandoned")
                moved.append(dst)
                if rank in (None, 0):  # a shared directory: rank 0 renames, the others wait
                    if dst.exists():
                        _remove(dst)
                    os.replace(c.path, dst)
        if moved and rank in (None, 0):
            _fsync_dir(self.directory)
        if rank is not None:
            _agree(True)
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
