"""Exact data position: which batch comes next, which samples a batch held, and how to get back.

``torch.utils.data.DataLoader`` cannot save or restore its position (pytorch#36650). Two ways
work here:

* :class:`ResumableLoader` wraps a map-style dataset. The order of epoch ``e`` is a pure
  function of ``(seed, e)``, so a position is ``(epoch, batch_index)``: resuming, seeking and
  skipping are arithmetic, no data is read, and the sample indices of any batch are known
  (quarantine and blame name them).
* torchdata's ``StatefulDataLoader``: its own ``state_dict()`` restores the position; skipping
  forward is done by drawing batches from the live iterator.

:func:`data_position_adapter` gives the recovery layer one view over both, and says why (and
what to change) for anything else. The loader is :mod:`.loader`; batch positions, references and
fingerprints are :mod:`.batches`.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch.utils.data import DataLoader

from .batches import BatchFingerprints, BatchRef, DataPosition
from .errors import DataPositionError
from .loader import ResumableLoader, dataset_fingerprint

__all__ = [  # the adapters, and the loader and batch names recovery imports from here
    "BatchFingerprints", "BatchRef", "DataPosition", "DataPositionAdapter", "ResumableAdapter", "ResumableLoader",
    "StatefulAdapter", "data_position_adapter", "dataset_fingerprint",
]

_FIX = (
    "wrap the map-style dataset in earlywarn.ResumableLoader(dataset, batch_size, seed=...) or use "
    "torchdata.stateful_dataloader.StatefulDataLoader"
)


class DataPositionAdapter:
    """What recovery needs from a loader, whatever it is.

    ``restorable``: a position can be saved and restored exactly. ``why_not`` says otherwise
    and names the fix. ``state_dict()`` is what a snapshot stores; ``since(state)`` lists the
    batches drawn after that state; ``rewind(state, skip)`` moves the data for a rewind to that
    state and returns the batches that will never be trained (the quarantine).
    """

    kind: str = "unknown"
    restorable: bool = False
    why_not: str | None = None

    def observe(self) -> None:
        """Cheap per-step bookkeeping (called after every optimizer step)."""

    def position(self) -> DataPosition | None:
        return None

    def last_batch(self) -> BatchRef | None:
        return None

    def drawn(self) -> int | None:
        """Batches drawn so far, counted on one axis (for "how many since"); ``None``: unknown."""
        return None

    def state_dict(self, pending: int = 0) -> dict[str, Any] | None:
        """The position as of ``pending`` batches ago (batches drawn for a step whose update is
        not part of the state being saved)."""
        raise DataPositionError(self.why_not or "data position not restorable")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise DataPositionError(self.why_not or "data position not restorable")

    def since(self, state: Mapping[str, Any] | None) -> list[BatchRef] | None:
        """Batches drawn after ``state`` up to now, oldest first; ``None`` when unknown."""
        return None

    def rewind(self, state: Mapping[str, Any] | None, skip: int | None) -> list[BatchRef] | None:
        """Data side of a rewind to a snapshot that saved ``state``.

        ``skip=None``: the batches drawn since then are skipped and the data simply continues
        (nothing moves). ``skip=K``: the next batch becomes the one K after ``state``'s.
        Returns the skipped batches (``None``: unknown identities)."""
        if skip is None:
            return self.since(state)
        raise DataPositionError(
            f"cannot skip a given number of batches ({skip}) with this loader: {self.why_not}"
        )


class _Unrestorable(DataPositionAdapter):
    kind = "unrestorable"

    def __init__(self, why: str) -> None:
        self.why_not = why


class ResumableAdapter(DataPositionAdapter):
    kind = "earlywarn.ResumableLoader"
    restorable = True

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader

    def position(self) -> DataPosition:
        return self.loader.position

    def last_batch(self) -> BatchRef | None:
        return self.loader.last_batch

    def drawn(self) -> int:
        return self.loader.global_index(self.loader.position)

    def state_dict(self, pending: int = 0) -> dict[str, Any]:
        state = self.loader.state_dict()
        if pending:
            pos = self.loader.position_at(max(0, self.drawn() - pending))
            state.update(epoch=pos.epoch, batch_index=pos.batch_index)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def since(self, state: Mapping[str, Any] | None) -> list[BatchRef] | None:
        if state is None:
            return None
        L = self.loader
        a = L.global_index(DataPosition(state["epoch"], state["batch_index"]))
        b = L.global_index(L.position)
        return [L.batch_ref(*divmod(g, len(L))) for g in range(a, b)]

    def rewind(self, state: Mapping[str, Any] | None, skip: int | None) -> list[BatchRef] | None:
        if skip is None:
            return self.since(state)
        if state is None:
            raise DataPositionError("the snapshot holds no data position; cannot skip a given number of batches")
        self.loader.load_state_dict(state)
        return self.loader.skip(skip)


class StatefulAdapter(DataPositionAdapter):
    """torchdata ``StatefulDataLoader``.

    The position is restored with its own ``state_dict``. Epochs are counted here (the loader
    does not); skipping forward draws batches from the live iterator. A rewind that would move
    a live iterator *backwards* is refused (the user's ``for`` loop holds that iterator):
    use ``rewind_skip_batches="since_snapshot"``, a K at least as large as the batches drawn since
    the snapshot, or :class:`ResumableLoader`. Sample indices are not exposed by torchdata.
    """

    kind = "torchdata.StatefulDataLoader"
    restorable = True

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._epoch = 0
        self._global = 0  # batches drawn since this adapter started counting
        self._last_it: Any = None
        self._last_n = 0
        self._resume_pending = False
        try:
            self._len: int | None = len(loader)
        except TypeError:  # an iterable dataset without __len__: positions within epochs unknown
            self._len = None

    def _live(self) -> Any:
        return getattr(self.loader, "_iterator", None)

    def observe(self) -> None:
        it = self._live()
        if it is None:
            return
        n = int(getattr(it, "_num_yielded", 0))
        if it is self._last_it:
            if n < self._last_n:  # persistent workers reset the same iterator for a new epoch
                self._epoch += 1
                self._global += n
            else:
                self._global += n - self._last_n
        elif self._resume_pending or self._last_it is None and n > 0:
            # the iterator that load_state_dict prepared: same epoch, counting from the saved point
            self._global += n - self._last_n
            self._resume_pending = False
        else:
            if self._last_it is not None:
                self._epoch += 1
            self._global += n
        self._last_it, self._last_n = it, n

    def position(self) -> DataPosition:
        self.observe()
        return DataPosition(self._epoch, self._last_n)

    def last_batch(self) -> BatchRef | None:
        self.observe()
        if self._last_n == 0:
            return None
        return BatchRef(self._epoch, self._last_n - 1, None)

    def drawn(self) -> int:
        self.observe()
        return self._global

    def state_dict(self, pending: int = 0) -> dict[str, Any]:
        self.observe()
        epoch, b = self._epoch, self._last_n - pending
        while b < 0 and self._len:  # the pending batches began in an earlier epoch
            epoch, b = epoch - 1, b + self._len
        return {
            "kind": self.kind,
            "loader": self.loader.state_dict(),
            "epoch": epoch,
            "batch_index": b,
            "global": self._global - pending,
            "pending": pending,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise DataPositionError(
                f"not a StatefulDataLoader state (kind={state.get('kind')!r}): the checkpoint was "
                "saved with a different data loader; use the same kind of loader to resume"
            )
        if state.get("pending"):
            raise DataPositionError(
                "this StatefulDataLoader position was saved in the middle of a step (a checkpoint taken "
                "before the step's update): torchdata cannot step back the batch drawn for it; resume "
                "from a periodic (clean) checkpoint, or use earlywarn.ResumableLoader"
            )
        it = self._live()
        if it is not None and not getattr(it, "_finished", False) and getattr(it, "_num_yielded", 0) > 0:
            raise DataPositionError(
                "cannot restore a StatefulDataLoader position while an iterator over it is running "
                "(the for loop keeps drawing from the old one): resume before iterating, or use "
                "earlywarn.ResumableLoader, whose live iterators follow a seek"
            )
        self.loader.load_state_dict(state["loader"])
        self._epoch = int(state["epoch"])
        self._last_n = int(state["batch_index"])
        self._global = int(state["global"])
        self._last_it = None
        self._resume_pending = True

    def _refs(self, epoch0: int, b0: int, count: int) -> list[BatchRef]:
        if self._len is None:
            return [BatchRef(None, None, None) for _ in range(count)]
        refs, e, b = [], epoch0, b0
        for _ in range(count):
            if b >= self._len:
                e, b = e + 1, 0
            refs.append(BatchRef(e, b, None))
            b += 1
        return refs

    def since(self, state: Mapping[str, Any] | None) -> list[BatchRef] | None:
        if state is None:
            return None
        self.observe()
        count = self._global - int(state["global"])
        return self._refs(int(state["epoch"]), int(state["batch_index"]), count)

    def rewind(self, state: Mapping[str, Any] | None, skip: int | None) -> list[BatchRef] | None:
        if skip is None:
            return self.since(state)
        if state is None:
            raise DataPositionError("the snapshot holds no data position; cannot skip a given number of batches")
        drawn = self.since(state) or []
        if skip < len(drawn):
            raise DataPositionError(
                f"rewind_skip_batches={skip} would replay {len(drawn) - skip} batches already drawn "
                "from a running StatefulDataLoader iterator, which cannot move backwards: use "
                f"rewind_skip_batches='since_snapshot' or >= {len(drawn)}, or earlywarn.ResumableLoader"
            )
        return drawn + self.skip(skip - len(drawn))

    def skip(self, n: int) -> list[BatchRef]:
        """Draw and drop the next ``n`` batches, crossing into the next epoch when needed.

        Within the epoch the batches come from the iterator the user's loop holds. If that one
        runs out, a fresh iterator draws the rest and its position is loaded back into the
        loader, so the user's next ``iter(loader)`` continues after the skipped batches."""
        if n < 0:
            raise ValueError(f"skip(n={n}): n must be >= 0")
        self.observe()
        refs: list[BatchRef] = []
        it = self._live()
        fresh = None
        while len(refs) < n:
            if it is None or getattr(it, "_finished", False):
                new_epoch = it is not None
                it = fresh = iter(self.loader)
                if new_epoch:
                    self._epoch += 1
                self._last_n = int(getattr(it, "_num_yielded", 0))
                self._last_it, self._resume_pending = it, False
            try:
                next(it)
            except StopIteration:
                continue  # the iterator marked itself finished; the next round starts an epoch
            refs.append(BatchRef(self._epoch, self._last_n, None))
            self._last_n += 1
            self._global += 1
        if fresh is not None:
            self.loader.load_state_dict(self.loader.state_dict())
            shutdown = getattr(fresh, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._last_it, self._resume_pending = None, True
        return refs


def data_position_adapter(loader: Any) -> DataPositionAdapter | None:
    """The recovery layer's view of ``loader``.

    ``None`` for ``None``; a :class:`ResumableAdapter` / :class:`StatefulAdapter` for the two
    loaders whose position can be restored exactly; for anything else (a plain ``DataLoader``,
    a generator) an adapter with ``restorable=False`` whose ``why_not`` names the fix, so that a
    rewind that needs to move the data refuses with that message instead of silently replaying
    or losing batches.
    """
    if loader is None:
        return None
    if isinstance(loader, DataPositionAdapter):
        return loader
    if isinstance(loader, ResumableLoader):
        return ResumableAdapter(loader)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # torchdata is optional
        StatefulDataLoader = None  # type: ignore[assignment]
    if StatefulDataLoader is not None and isinstance(loader, StatefulDataLoader):
        return StatefulAdapter(loader)
    if isinstance(loader, DataLoader):
        why = (
            "torch.utils.data.DataLoader cannot save or restore its position (pytorch#36650): "
            + _FIX
        )
    else:
        why = f"earlywarn cannot save or restore the position of a {type(loader).__name__}: " + _FIX
    return _Unrestorable(why)
