"""A data loader for a map-style dataset whose position is ``(epoch, batch_index)``: saved,
restored, sought and skipped exactly and instantly, since the order of epoch ``e`` is a pure
function of ``(seed, e)``."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from .batches import BatchRef, DataPosition
from .errors import DataPositionError, FingerprintMismatch


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
