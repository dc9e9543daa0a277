"""The quarantine: every batch that will never be trained -- skipped as a bad batch, or drawn after
a rewind's target -- as records and as a JSONL file (one line each, appended and fsynced)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..sinks.defaults import output_dir
from .config import RecoveryConfig
from .data import BatchRef
from .history import BatchHistory
from .records import QuarantineRecord


def quarantine_path(cfg: RecoveryConfig, checkpoint_dir: Path | None, rank: int | None) -> Path:
    """``cfg.quarantine_path``, else beside the checkpoints, else in earlywarn's output folder
    (one file per rank when ranks share a folder)."""
    if cfg.quarantine_path is not None:
        return Path(cfg.quarantine_path)
    if checkpoint_dir is not None:
        return checkpoint_dir / (f"quarantine.rank{rank}.jsonl" if cfg.collective and rank is not None
                                 else "quarantine.jsonl")
    return output_dir() / ("quarantine.jsonl" if rank is None else f"quarantine.rank{rank}.jsonl")


class Quarantine:
    """The records so far (``records``) and the file (``path``, written only when a batch is
    quarantined). Steps are the training trajectory's."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[QuarantineRecord] = []
        self._steps: set[int] = set()  # steps of this trajectory whose batch is quarantined already

    def skipped(self, step: int, reason: str, ref: BatchRef | None) -> QuarantineRecord:
        """The batch of ``step`` (``ref``, when known) was skipped as bad: never trained."""
        if ref is None:
            rec = QuarantineRecord(step, reason, None, None, None, step)
        else:
            rec = QuarantineRecord(step, reason, ref.epoch, ref.batch_index, ref.sample_indices, step, ref.fingerprint)
        self.add([rec])
        self._steps.add(step)
        return rec

    def rewound_over(self, refs: list[BatchRef] | None, history: BatchHistory, target: int, step: int,
                     reason: str, last: int | None = None) -> list[QuarantineRecord]:
        """The records of the batches a rewind from ``step`` to ``target`` skips (``refs``: as the
        loader names them; ``None``: positions unknown, one record per step drawn since the
        target). A batch skipped (and quarantined) on its own already is not listed twice.
        ``last``: async mode, the newest step applied before the incident was read (in flight)."""
        done = self._steps
        end = step if last is None else last
        fps = history.fingerprints.read([s for s in range(target + 1, end + 1) if s not in done])
        if refs is None:
            return [QuarantineRecord(step, reason, None, None, None, s, fps.get(s))
                    for s in range(target + 1, end + 1) if s not in done]
        drew = history.drawn_after(target, step)
        out = []
        for r in refs:
            s = drew.get((r.epoch, r.batch_index))
            if s is not None and s in done:
                continue
            out.append(QuarantineRecord(step, reason, r.epoch, r.batch_index, r.sample_indices, s,
                                        None if s is None else fps.get(s)))
        return out

    def forget_after(self, step: int) -> None:
        """A rewind to the state of ``step``: the steps after it come again (new batches)."""
        self._steps = {s for s in self._steps if s <= step}

    def add(self, records: list[QuarantineRecord]) -> None:
        """Append ``records`` to the file (fsynced: it must outlive a crash) and the list."""
        if records:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps(r.to_dict()) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.records.extend(records)
