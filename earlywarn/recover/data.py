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
what to change) for anything else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ._state import local
from .errors import DataPositionError, FingerprintMismatch

_FIX = (
    "wrap the map-style dataset in earlywarn.ResumableLoader(dataset, batch_size, seed=...) or use "
    "torchdata.stateful_dataloader.StatefulDataLoader"
)


@dataclass(frozen=True)
class DataPosition:
    """Where the *next* batch comes from: batch ``batch_index`` of epoch ``epoch`` (0-based)."""

    epoch: int
    batch_index: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    @classmethod
    def parse(cls, value: "DataPosition | Mapping[str, int] | Sequence[int]") -> "DataPosition":
        if isinstance(value, DataPosition):
            return value
        if isinstance(value, Mapping):
            return cls(int(value["epoch"]), int(value["batch_index"]))
        epoch, batch_index = value
        return cls(int(epoch), int(batch_index))

    def __str__(self) -> str:
        return f"epoch {self.epoch} batch {self.batch_index}"


@dataclass(frozen=True)
class BatchRef:
    """One batch, named by its position and (when known) the dataset indices it held.

    ``epoch`` / ``batch_index`` are ``None`` when the loader cannot tell; ``sample_indices`` is
    ``None`` for loaders that do not expose their sampler (torchdata). ``fingerprint``: a hash of
    the batch's tensors (:class:`BatchFingerprints`), when earlywarn saw them."""

    epoch: int | None
    batch_index: int | None
    sample_indices: tuple[int, ...] | None = None
    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """What is known, and nothing else (no keys holding ``None``)."""
        d: dict[str, Any] = {}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        if self.batch_index is not None:
            d["batch_index"] = self.batch_index
        if self.sample_indices is not None:
            d["sample_indices"] = list(self.sample_indices)
        if self.fingerprint is not None:
            d["fingerprint"] = self.fingerprint
        return d

    def describe(self) -> str:
        return str(self)

    def __str__(self) -> str:
        if self.batch_index is None:
            return f"the batch with fingerprint {self.fingerprint}" if self.fingerprint else "an unidentified batch"
        text = f"batch {self.batch_index}" + (f" of epoch {self.epoch}" if self.epoch is not None else "")
        if self.sample_indices is not None:
            ids = list(self.sample_indices)
            shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
            text += f" (samples {shown})"
        return text

    def with_fingerprint(self, fingerprint: str | None) -> "BatchRef":
        return self if fingerprint is None else dataclasses.replace(self, fingerprint=fingerprint)


def _mix(*xs: int) -> int:
    """A 63-bit seed from integers (stable across runs and platforms)."""
    h = hashlib.blake2b(",".join(str(int(x)) for x in xs).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


class _BatchSlice(Sampler[list[int]]):
    """Batches ``start..`` of one epoch's order: what the inner DataLoader is given, so a resume
    starts at the right batch without touching the ones before it."""

    def __init__(self, order: torch.Tensor, start: int, batch_size: int, num_batches: int) -> None:
        self._order = order
        self._start = start
        self._bs = batch_size
        self._n = num_batches

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self._start, self._n):
            yield self._order[b * self._bs : (b + 1) * self._bs].tolist()

    def __len__(self) -> int:
        return self._n - self._start


def _canonical_bytes(x: Any, out: "hashlib._Hash", depth: int = 0) -> None:
    if depth > 6:
        out.update(b"<deep>")
        return
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        out.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            out.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, (bytes, bytearray)):
        out.update(b"B" + bytes(x))
    elif isinstance(x, (str, int, float, bool, type(None))):
        out.update(f"{type(x).__name__}:{x!r}".encode())
    elif isinstance(x, Mapping):
        out.update(b"{")
        for k in sorted(x, key=repr):
            out.update(repr(k).encode())
            _canonical_bytes(x[k], out, depth + 1)
        out.update(b"}")
    elif isinstance(x, (list, tuple)):
        out.update(b"[")
        for v in x:
            _canonical_bytes(v, out, depth + 1)
        out.update(b"]")
    elif hasattr(x, "tobytes"):  # numpy arrays and scalars, PIL images
        out.update(type(x).__name__.encode() + str(getattr(x, "shape", "")).encode())
        out.update(x.tobytes())
    else:
        # a repr with a memory address would change every run: hash the type only
        r = repr(x)
        out.update((type(x).__qualname__ if " at 0x" in r else r).encode())


def dataset_fingerprint(dataset: Any, *, probes: int = 4) -> str:
    """``len`` plus a hash of a few samples spread over the dataset (reads ``probes`` samples)."""
    n = len(dataset)
    h = hashlib.sha256(f"len={n}".encode())
    idx = sorted({(n - 1) * i // max(1, probes - 1) for i in range(probes)}) if n else []
    for i in idx:
        h.update(f"|{i}|".encode())
        _canonical_bytes(dataset[i], h)
    return f"len={n}:sha256={h.hexdigest()[:16]}"


class ResumableLoader:
    """A data loader for a map-style dataset whose position can be saved, restored and moved
    exactly and instantly.

    The order of epoch ``e`` is ``torch.randperm(len(dataset))`` drawn from a generator seeded by
    ``(seed, e)`` (or ``range`` when ``shuffle=False``). The state is just ``(epoch,
    batch_index)`` of the next batch, plus a dataset fingerprint so that a position is never
    applied to a different dataset. Batches are loaded by an inner ``torch.utils.data.DataLoader``
    (``num_workers``, ``pin_memory``, ``collate_fn`` ... as usual) that starts at the current
    batch: resuming mid-epoch does not read the batches before it.

    Iterating yields the batches of the current epoch from the current position; when the epoch
    ends the position moves to ``(epoch + 1, 0)``, so ``for epoch in ...: for batch in loader:``
    works as with a ``DataLoader``. A :meth:`seek` or :meth:`skip` while a ``for`` loop holds an
    iterator takes effect at that iterator's next batch (a rewind happens inside
    ``optimizer.step``). Moving into a later epoch ends the running loop; moving back into an
    earlier epoch makes the running loop finish that earlier epoch first.

    Random augmentation drawn inside the dataset is not replayed by a seek (the inner loader's
    worker seeds depend on where it started); the sample order and batch composition are.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch.
        shuffle: a new permutation every epoch (seeded) or the dataset order.
        seed: the permutation seed.
        drop_last: drop the last incomplete batch of every epoch.
        num_workers: worker processes of the inner loader.
        collate_fn: as for ``DataLoader``.
        fingerprint: a string identifying the dataset version, or a callable
            ``dataset -> str``; default: length plus a hash of 4 samples spread over the dataset.
        num_replicas, rank: data-parallel sharding, as ``DistributedSampler`` does it: every rank
            draws the same permutation and takes every ``num_replicas``-th sample from ``rank``
            (padded by wrapping around, or truncated with ``drop_last``). Positions are the same
            on every rank, so one rank's saved position resumes all of them.
        **dataloader_kwargs: passed to the inner ``DataLoader`` (``pin_memory``,
            ``worker_init_fn``, ``prefetch_factor``, ``persistent_workers`` is refused).
    """

    _OWNED = ("sampler", "batch_sampler", "shuffle", "generator", "batch_size", "drop_last", "persistent_workers")

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        fingerprint: str | Callable[[Any], str] | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        **dataloader_kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"ResumableLoader needs a map-style dataset (__len__ and __getitem__), got "
                f"{type(dataset).__name__}; for an iterable dataset use "
                "torchdata.stateful_dataloader.StatefulDataLoader with a dataset that has state_dict()"
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a positive int")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r}: must be an int >= 0")
        if not isinstance(num_replicas, int) or num_replicas < 1 or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"num_replicas={num_replicas!r}, rank={rank!r}: need num_replicas >= 1 and 0 <= rank < num_replicas")
        owned = sorted(set(dataloader_kwargs) & set(self._OWNED))
        if owned:
            raise ValueError(
                f"ResumableLoader sets {', '.join(owned)} itself (the order must be a function of "
                "seed and epoch); remove them and use shuffle=/seed=/drop_last= instead"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self._fingerprint_arg = fingerprint
        self._fingerprint: str | None = fingerprint if isinstance(fingerprint, str) else None
        self._dl_kwargs = dataloader_kwargs
        self.num_replicas = num_replicas
        self.rank = rank
        self._num_samples = len(dataset)
        n = self._num_samples
        if num_replicas > 1:  # samples this rank sees per epoch
            n = n // num_replicas if drop_last else -(-n // num_replicas)
        self._rank_samples = n
        if len(self) == 0:
            raise ValueError(
                f"dataset of {self._num_samples} samples gives no batch with batch_size={batch_size} "
                f"and drop_last={drop_last}: use a smaller batch_size or drop_last=False"
            )
        self._epoch = 0
        self._batch = 0
        self._last: BatchRef | None = None
        self._orders: dict[int, torch.Tensor] = {}  # the last two epochs' orders

    # -- geometry ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = self._rank_samples, self.batch_size
        return n // b if self.drop_last else math.ceil(n / b)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch in self._orders:
            return self._orders[epoch]
        if self.shuffle:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(self._num_samples, generator=g)
        else:
            order = torch.arange(self._num_samples)
        if self.num_replicas > 1:
            total = self._rank_samples * self.num_replicas
            if total > len(order):  # pad by wrapping around, like DistributedSampler
                order = torch.cat([order, order[: total - len(order)]])
            order = order[:total][self.rank :: self.num_replicas]
        if len(self._orders) >= 2:  # around an epoch boundary both neighbours are in use
            self._orders.pop(next(iter(self._orders)))
        self._orders[epoch] = order
        return order

    def sample_indices(self, epoch: int, batch_index: int) -> tuple[int, ...]:
        """Dataset indices of batch ``batch_index`` of ``epoch`` (computed, nothing is loaded)."""
        if not 0 <= batch_index < len(self):
            raise IndexError(f"batch_index {batch_index} out of range: an epoch has {len(self)} batches")
        order = self._order(epoch)
        return tuple(order[batch_index * self.batch_size : (batch_index + 1) * self.batch_size].tolist())

    def batch_ref(self, epoch: int, batch_index: int) -> BatchRef:
        return BatchRef(epoch, batch_index, self.sample_indices(epoch, batch_index))

    def global_index(self, position: DataPosition) -> int:
        """Batches from the start of training to ``position`` (epochs have equal length)."""
        return position.epoch * len(self) + position.batch_index

    def position_at(self, global_index: int) -> DataPosition:
        e, b = divmod(int(global_index), len(self))
        return DataPosition(e, b)

    # -- position ---------------------------------------------------------------------------
    @property
    def position(self) -> DataPosition:
        """Position of the next batch."""
        return DataPosition(self._epoch, self._batch)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def last_batch(self) -> BatchRef | None:
        """The batch most recently yielded (position and sample indices)."""
        return self._last

    def seek(self, position: "DataPosition | Mapping[str, int] | Sequence[int]") -> None:
        """Make ``position`` the next batch. Instant: nothing is read. A live iterator follows."""
        pos = DataPosition.parse(position)
        if pos.epoch < 0 or not 0 <= pos.batch_index <= len(self):
            raise DataPositionError(
                f"cannot seek to {pos}: epochs start at 0 and an epoch has {len(self)} batches"
            )
        if pos.batch_index == len(self):
            pos = DataPosition(pos.epoch + 1, 0)
        self._epoch, self._batch = pos.epoch, pos.batch_index

    def skip(self, n: int) -> list[BatchRef]:
        """Move past the next ``n`` batches without loading them; returns what was skipped."""
        if n < 0:
            raise ValueError(f"skip(n={n}): n must be >= 0")
        start = self.global_index(self.position)
        refs = [self.batch_ref(*self._split(start + i)) for i in range(n)]
        self.seek(self.position_at(start + n))
        return refs

    def _split(self, g: int) -> tuple[int, int]:
        return divmod(g, len(self))

    # -- state ------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            fp = self._fingerprint_arg
            self._fingerprint = str(fp(self.dataset)) if callable(fp) else dataset_fingerprint(self.dataset)
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "earlywarn.ResumableLoader",
            "version": 1,
            "epoch": self._epoch,
            "batch_index": self._batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "num_samples": self._num_samples,
            "num_replicas": self.num_replicas,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "earlywarn.ResumableLoader":
            raise DataPositionError(
                f"not a ResumableLoader state (kind={state.get('kind')!r}): the checkpoint was saved "
                "with a different data loader; use the same kind of loader to resume"
            )
        if state["num_samples"] != self._num_samples or state["fingerprint"] != self.fingerprint():
            raise FingerprintMismatch(
                f"the saved data position belongs to a different dataset: saved "
                f"{state['fingerprint']!r}, this dataset {self.fingerprint()!r}. Resume with the "
                "same dataset (same files, same order), or pass fingerprint='<version>' to "
                "ResumableLoader if the dataset changed on purpose and the old position still applies"
            )
        for key in ("batch_size", "drop_last", "shuffle", "seed", "num_replicas"):
            if state.get(key, 1 if key == "num_replicas" else None) != getattr(self, key):
                raise DataPositionError(
                    f"saved {key}={state[key]!r} but this loader has {key}={getattr(self, key)!r}: "
                    f"the saved batch positions only mean the same batches with the same {key}; "
                    f"construct ResumableLoader with {key}={state[key]!r}"
                )
        self.seek(DataPosition(int(state["epoch"]), int(state["batch_index"])))

    # -- iteration --------------------------------------------------------------------------
    def __iter__(self) -> "_ResumableIterator":
        return _ResumableIterator(self)

    def _inner(self, epoch: int, start: int) -> Iterator[Any]:
        sampler = _BatchSlice(self._order(epoch), start, self.batch_size, len(self))
        # own generator: building the inner loader must not draw from torch's global RNG
        # (a resumed run would otherwise see different dropout masks than an uninterrupted one)
        gen = torch.Generator().manual_seed(_mix(self.seed, epoch, start, 1))
        kwargs = dict(self._dl_kwargs)
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        dl = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers, generator=gen, **kwargs)
        return iter(dl)

    def __repr__(self) -> str:
        return (
            f"ResumableLoader({type(self.dataset).__name__}[{self._num_samples}], "
            f"batch_size={self.batch_size}, shuffle={self.shuffle}, seed={self.seed}, at {self.position})"
        )


class _ResumableIterator:
    """Follows the loader's cursor: the next batch is always the one at ``loader.position``."""

    def __init__(self, loader: ResumableLoader) -> None:
        self._loader = loader
        self._epoch = loader._epoch
        self._inner: Iterator[Any] | None = None
        self._inner_next: tuple[int, int] | None = None  # position the inner iterator yields next
        self._done = False

    def __iter__(self) -> "_ResumableIterator":
        return self

    def _close_inner(self) -> None:
        inner, self._inner, self._inner_next = self._inner, None, None
        shutdown = getattr(inner, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __next__(self) -> Any:
        L = self._loader
        if self._done:
            raise StopIteration
        e, b = L._epoch, L._batch
        if e > self._epoch:  # this epoch is over (last batch taken, or a skip moved past it)
            self._done = True
            self._close_inner()
            raise StopIteration
        self._epoch = e  # a rewind into an earlier epoch: finish that one
        if self._inner is None or self._inner_next != (e, b):
            self._close_inner()
            self._inner = L._inner(e, b)
        batch = next(self._inner)
        self._inner_next = (e, b + 1)
        L._last = L.batch_ref(e, b)
        L.seek(DataPosition(e, b + 1))
        return batch

    def __del__(self) -> None:
        try:
            self._close_inner()
        except Exception:
            pass


# ============================================================================================
# A uniform view for the recovery layer


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


# ============================================================================================
# Batch fingerprints: naming a batch no loader can name


_FP_CAP = 1 << 20  # elements hashed per tensor; a larger one is hashed on an even stride
_FP_MIX = 1_000_003
_FP_MASK = (1 << 64) - 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensors(x: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif depth < 4 and isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out, depth + 1)
    elif depth < 4 and isinstance(x, Mapping):
        for k in sorted(x, key=str):
            _tensors(x[k], out, depth + 1)


class BatchFingerprints:
    """A fingerprint per step of the batch the step trained on, computed on the device.

    Without a restorable loader nothing else identifies a batch (nanoGPT draws them with
    ``torch.randint``). :meth:`observe` hashes the batch's tensors where they are -- their raw
    bits times a fixed random vector, summed (int64, wrapping) -- with no host sync; micro-batches
    of one step are folded together. :meth:`bind` attaches what was observed to the step that
    consumes it; :meth:`read` moves the requested fingerprints to the host in one transfer (the
    rare path: a skip, a quarantine). Shapes and dtypes are folded in on the host. A tensor of
    more than 2**20 elements is hashed on an even stride of 2**20 of them.
    """

    def __init__(self, history: int = 4096) -> None:
        self.history = history
        self.explicit = False
        """``report_batch`` was called: the automatic hook on the model's inputs stands down."""
        self._pending: torch.Tensor | None = None
        self._meta = 0
        self._steps: OrderedDict[int, tuple[torch.Tensor, int]] = OrderedDict()
        self._weights: dict[Any, torch.Tensor] = {}

    def _weight(self, device: torch.device, n: int) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None or w.numel() < n:
            size = 1 << max(10, (n - 1).bit_length())
            g = torch.Generator().manual_seed(0x5EED)
            w = (torch.randint(-(1 << 62), 1 << 62, (size,), generator=g, dtype=torch.int64) | 1).to(device)
            self._weights[device] = w
        return w[:n]

    def _hash(self, t: torch.Tensor) -> torch.Tensor | None:
        t = t.detach()
        if t.layout != torch.strided or t.numel() == 0 or t.device.type == "meta":
            return None
        t = local(t)  # a DTensor: this rank's shard
        flat = t.reshape(-1)
        n = flat.numel()
        if n > _FP_CAP:
            flat = flat[:: -(-n // _FP_CAP)]
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        elif flat.is_floating_point():
            flat = flat.contiguous().view(_INT_OF_SIZE[flat.element_size()])
        v = flat.to(torch.int64)
        return (v * self._weight(v.device, v.numel())).sum()

    def observe(self, batch: Any) -> None:
        """Fold ``batch`` (a tensor, or lists / tuples / dicts of them) into this step's fingerprint."""
        found: list[torch.Tensor] = []
        _tensors(batch, found)
        with torch.no_grad():
            for t in found:
                h = self._hash(t)
                if h is None:
                    continue
                meta = f"{tuple(t.shape)}:{t.dtype}".encode()
                self._meta = zlib.crc32(meta, self._meta)
                if self._pending is None:
                    self._pending = h
                else:
                    self._pending = self._pending.to(h.device) * _FP_MIX + h

    def use_explicit(self) -> None:
        """From now on only what ``observe`` is given explicitly counts (``report_batch``):
        what the automatic hook folded in for the step in progress is dropped."""
        self.explicit = True
        self._pending, self._meta = None, 0

    def bind(self, step: int) -> None:
        """What was observed since the last bind is the batch of ``step``."""
        if self._pending is None:
            return
        self._steps[int(step)] = (self._pending, self._meta)
        self._steps.move_to_end(int(step))
        self._pending, self._meta = None, 0
        while len(self._steps) > self.history:
            self._steps.popitem(last=False)

    def has(self, step: int) -> bool:
        return int(step) in self._steps

    def read(self, steps: Sequence[int]) -> dict[int, str]:
        """Fingerprints of ``steps`` (those known), as 16 hex digits; one host read."""
        known = [int(s) for s in steps if int(s) in self._steps]
        if not known:
            return {}
        vals = [self._steps[s][0] for s in known]
        dev = vals[0].device
        host = torch.stack([v.to(dev) for v in vals]).tolist()
        return {s: f"{(int(v) ^ (self._steps[s][1] * 0x9E3779B97F4A7C15)) & _FP_MASK:016x}"
                for s, v in zip(known, host)}

    def drop_after(self, step: int) -> None:
        """Forget the steps after ``step`` (a rewind abandoned them)."""
        for s in [s for s in self._steps if s > step]:
            del self._steps[s]

    def clear(self) -> None:
        self._steps.clear()
        self._pending, self._meta = None, 0
