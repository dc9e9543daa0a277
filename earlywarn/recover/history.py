"""The batch history: which batch each recent step drew, who is to blame, and which step the live
state is at. What blame, quarantine and a recurrence's diagnosis read; rewinds forget what came
after their target. Steps are the training trajectory's."""

from __future__ import annotations

from collections import OrderedDict

from .data import BatchFingerprints, BatchRef, DataPositionAdapter
from .records import Blame, batch_key


class BatchHistory:
    """``data``: the loader's position adapter; ``fingerprints``: the batches' fingerprints
    (without a loader that names them); ``size``: steps remembered (``RecoveryConfig.history``)."""

    def __init__(self, data: DataPositionAdapter, fingerprints: BatchFingerprints, size: int) -> None:
        self.data = data
        self.fingerprints = fingerprints
        self.size = size
        self._refs: OrderedDict[int, BatchRef | None] = OrderedDict()
        self.last_step: int | None = None
        """The last step recorded: the step the live state is at (``None`` right after a rewind)."""
        self._drawn_mark = data.drawn()  # batches drawn as of last_step (None: unknown)
        # a loader that names no batch (none given, or one that cannot be restored): its
        # observe / last_batch / drawn do nothing, so a step's record makes none of those calls
        self._blind = all(getattr(type(data), m) is getattr(DataPositionAdapter, m)
                          for m in ("observe", "last_batch", "drawn"))

    # -- recording ---------------------------------------------------------------------------------
    def record(self, step: int) -> None:
        """The update of ``step`` was applied (or skipped): remember the batch it drew."""
        refs = self._refs
        if self._blind:
            refs[step] = None
        else:
            self.data.observe()
            refs[step] = self.data.last_batch()
            self._drawn_mark = self.data.drawn()
        refs.move_to_end(step)
        self.last_step = step
        while len(refs) > self.size:
            refs.popitem(last=False)

    def pending(self) -> int:
        """Batches drawn since the last recorded step: their update is not in the live state."""
        now = self.data.drawn()
        if now is None or self._drawn_mark is None:
            return 0
        return max(0, now - self._drawn_mark)

    def forget_after(self, step: int) -> None:
        """A rewind to the state of ``step``: the steps after it never happened."""
        for s in [s for s in self._refs if s > step]:
            del self._refs[s]
        self.fingerprints.drop_after(step)
        self.last_step = None
        self._drawn_mark = self.data.drawn()

    def reset(self, step: int) -> None:
        """A resume at ``step``: nothing before it is known."""
        self._refs.clear()
        self.fingerprints.clear()
        self.last_step = step
        self._drawn_mark = self.data.drawn()

    # -- reading -----------------------------------------------------------------------------------
    def batch_at(self, step: int) -> BatchRef | None:
        """The batch drawn for ``step`` (for the step in progress: the batch just drawn), with
        its fingerprint when known (one host read)."""
        ref: BatchRef | None
        if step in self._refs:
            ref = self._refs[step]
        else:
            last = max(self._refs) if self._refs else None
            if last is None or step > last:
                self.data.observe()
                ref = self.data.last_batch()
            else:
                ref = None
        fp = self.fingerprints.read([step]).get(step)
        if ref is None:
            return BatchRef(None, None, None, fp) if fp else None
        return ref.with_fingerprint(fp)

    def blame(self, step: int, *, layer: str | None = None, symptom: str | None = None,
              symptom_step: int | None = None, role: str = "the batch responsible") -> Blame:
        """Name the batch of ``step`` as responsible (see :meth:`Recovery.blame`)."""
        return Blame(
            step=step,
            batch=self.batch_at(step),
            layer=layer,
            symptom=symptom,
            symptom_step=symptom_step,
            symptom_batch=None if symptom_step is None or symptom_step == step else self.batch_at(symptom_step),
            role=role,
        )

    def last_batch(self) -> BatchRef | None:
        """The batch most recently drawn from the loader (``None`` when unknown)."""
        if self._blind:
            return None
        self.data.observe()
        return self.data.last_batch()

    def keys(self, steps: list[int]) -> list[str | None]:
        """What identifies the batches of ``steps`` (a position, else a fingerprint; one host read)."""
        fps = self.fingerprints.read(steps)
        out: list[str | None] = []
        newest = max(self._refs) if self._refs else None
        for s in steps:
            ref = self._refs.get(s)
            if ref is None and (newest is None or s > newest):
                ref = self.data.last_batch()  # the step in progress drew the loader's latest batch
            out.append(batch_key(ref.epoch, ref.batch_index, fps.get(s)) if ref is not None else fps.get(s))
        return out

    def steps_after(self, step: int) -> list[int]:
        """Recorded steps after ``step`` (async mode: updates applied before ``step`` was judged)."""
        return [s for s in self._refs if s > step]

    def drawn_after(self, target: int, step: int) -> dict[tuple[int | None, int | None], int]:
        """(epoch, batch index) -> the step that drew it, for the steps after ``target``; the batch
        just drawn counts for ``step`` when that step is not recorded yet (the incident's own)."""
        drew = {(b.epoch, b.batch_index): s for s, b in self._refs.items() if b is not None and s > target}
        cur = self.data.last_batch()
        if cur is not None and (cur.epoch, cur.batch_index) not in drew and step not in self._refs:
            drew[(cur.epoch, cur.batch_index)] = step
        return drew

    def skip_through(self, step: int, since: list[BatchRef]) -> int | None:
        """Of the batches ``since`` a snapshot, how many up to the one of ``step`` (None: unknown)."""
        ref = self._refs.get(step)
        if ref is None:
            return None
        hits = [i for i, b in enumerate(since) if (b.epoch, b.batch_index) == (ref.epoch, ref.batch_index)]
        return hits[-1] + 1 if hits else None
