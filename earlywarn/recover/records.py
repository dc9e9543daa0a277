"""The records a recovery leaves: who is to blame, which batches are never trained, what a
rewind did. Plain data, JSON-ready (``to_dict``); unknown fields are left out, never null.

Their steps are training steps. A text that names them takes ``run``, which puts a training step
on the run's clock (the watcher's; the default leaves it as it is)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .batches import BatchRef

Run = Callable[[int], int]
"""A training step -> the same step on the run's clock."""


def _name_batch(batch: BatchRef | None, step: int) -> tuple[str, bool]:
    """How to name the batch drawn for ``step``: its position when a loader knows it, else the
    step (and the fingerprint when earlywarn saw the tensors). The bool: the name says the step."""
    if batch is not None and batch.batch_index is not None:
        return str(batch), False
    fp = f" (fingerprint {batch.fingerprint})" if batch is not None and batch.fingerprint else ""
    return f"the batch drawn for step {step}{fp}", True


@dataclass(frozen=True)
class Blame:
    """Who is responsible for an incident.

    ``step`` / ``batch``: the step whose batch caused it (e.g. the last update applied before
    the loss went NaN). ``symptom_step`` / ``symptom_batch``: where it showed. ``layer``: the
    first layer with non-finite or most-escalated gradients (from the watcher's capture).
    ``role``: how ``step`` relates to the incident (``"the batch responsible"``; ``"the episode
    began with"`` for a divergence, whose cause may be a hyperparameter rather than a batch)."""

    step: int
    batch: BatchRef | None = None
    layer: str | None = None
    symptom: str | None = None
    symptom_step: int | None = None
    symptom_batch: BatchRef | None = None
    role: str = "the batch responsible"

    @property
    def message(self) -> str:
        """"the loss turned NaN at step 12 on batch 11 of epoch 0 (samples ...); the batch
        responsible was batch 10 of epoch 0 (samples ...) at step 11; first layer: fc1.weight".
        Without a loader: "...; the batch responsible was the batch drawn for step 11
        (fingerprint 0f3a...)"."""
        return self.describe()

    def describe(self, run: Run = int) -> str:
        """:attr:`message` with its steps on the run's clock."""
        step = run(self.step)
        who, says_step = _name_batch(self.batch, step)
        at = "" if says_step else f" at step {step}"
        if self.symptom and self.symptom_step == self.step:
            if says_step:
                text = f"{self.symptom} at step {step}; {self.role}: {who}"
            else:
                text = f"{self.symptom} at step {step} on {who}, {self.role}"
        elif self.symptom and self.symptom_step is not None:
            on = ""
            if self.symptom_batch is not None and self.symptom_batch.batch_index is not None:
                on = f" on {self.symptom_batch}"
            verb = " was" if self.role.endswith("responsible") else ""
            text = f"{self.symptom} at step {run(self.symptom_step)}{on}; {self.role}{verb} {who}{at}"
        else:
            text = f"{self.role}: {who}{at}"
        if self.layer:
            text += f"; first layer: {self.layer}"
        return text

    def to_dict(self, run: Run = int) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch": None if self.batch is None else self.batch.to_dict(),
            "layer": self.layer,
            "symptom": self.symptom,
            "symptom_step": self.symptom_step,
            "symptom_batch": None if self.symptom_batch is None else self.symptom_batch.to_dict(),
            "message": self.describe(run),
        }


@dataclass(frozen=True)
class QuarantineRecord:
    """A batch that will never be trained: it was drawn after the restored snapshot (its update
    was undone), skipped over, or skipped as a bad batch. ``step`` is the step that drew it;
    the position (``epoch``, ``batch_index``, ``sample_indices``) when a loader knows it, the
    ``fingerprint`` when earlywarn saw the batch's tensors. Unknown fields are left out of the
    JSON record, never written as nulls."""

    incident_step: int
    reason: str
    epoch: int | None
    batch_index: int | None
    sample_indices: tuple[int, ...] | None
    step: int | None
    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"incident_step": self.incident_step, "reason": self.reason}
        for k in ("step", "epoch", "batch_index"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.sample_indices is not None:
            d["sample_indices"] = list(self.sample_indices)
        if self.fingerprint is not None:
            d["fingerprint"] = self.fingerprint
        return d

    @classmethod
    def from_dict(cls, q: Mapping[str, Any]) -> "QuarantineRecord":
        si = q.get("sample_indices")
        return cls(int(q["incident_step"]), str(q["reason"]), q.get("epoch"), q.get("batch_index"),
                   None if si is None else tuple(si), q.get("step"), q.get("fingerprint"))


@dataclass
class RewindReport:
    incident_step: int
    restored_step: int
    source: str
    """``"memory:<step>"`` or the checkpoint path."""
    reason: str
    attempt: int
    """1 for the episode's first rewind, 2 for the first recurrence, ... up to ``max_rewinds``."""
    quarantined: list[QuarantineRecord]
    blame: dict[str, Any] | None = None
    message: str = ""
    nonfinite: list[str] = field(default_factory=list)
    """Tensors that held NaN/Inf when the rewind began (``"name"`` or ``"name[state key]"``)."""
    rng_restored: bool = False
    """The global RNGs were put back to the snapshot's (see ``RecoveryConfig.rewind_restore_rng``)."""
    recurrence: str | None = None
    """The diagnosis, when this rewind answered an incident that came back (``on_recurrence``)."""
    lr_factor: float = 1.0
    """The learning-rate factor applied from now on (``on_recurrence="lower_lr"``)."""

    @property
    def lost_steps(self) -> int:
        """Optimizer steps of training this rewind threw away."""
        return self.incident_step - self.restored_step

    @property
    def resume_step(self) -> int:
        """The step the next ``optimizer.step()`` is (what the watcher's ``step`` is now)."""
        return self.restored_step + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "incident_step": self.incident_step,
            "nonfinite": list(self.nonfinite),
            "restored_step": self.restored_step,
            "lost_steps": self.lost_steps,
            "source": self.source,
            "reason": self.reason,
            "attempt": self.attempt,
            "rng_restored": self.rng_restored,
            "recurrence": self.recurrence,
            "lr_factor": self.lr_factor,
            "quarantined": [q.to_dict() for q in self.quarantined],
            "blame": self.blame,
            "message": self.message,
        }


def _ranges(refs: list[QuarantineRecord], run: Run = int) -> str:
    """'epoch 0 batches 12-14, epoch 1 batch 0', or by step when no loader knows the batches:
    '3 batches, drawn for steps 101-103 (fingerprints in the quarantine file)'."""
    if not refs:
        return "no batches"
    if refs[0].batch_index is None:
        steps = sorted(r.step for r in refs if r.step is not None)
        n = len(refs)
        what = f"{n} batch{'es' if n != 1 else ''}"
        if steps:
            what += f", drawn for {_step_spans(steps, run)}"
        fps = sum(r.fingerprint is not None for r in refs)
        if fps:
            what += " (fingerprint" + (f" {refs[0].fingerprint}" if n == 1 else "s in the quarantine file") + ")"
        return what
    out, start, prev = [], refs[0], refs[0]
    for r in refs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r.epoch == prev.epoch and r.batch_index == (prev.batch_index or 0) + 1:
            prev = r
            continue
        span = f"{start.batch_index}" if start is prev else f"{start.batch_index}-{prev.batch_index}"
        out.append(f"epoch {start.epoch} batch{'es' if start is not prev else ''} {span}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def _step_spans(steps: list[int], run: Run) -> str:
    """'step 7', 'steps 7-9', or on the run's clock 'steps 101-125, 153-160' (a span ends where
    the clock jumps: a rewind's steps before and after the point it went back to)."""
    spans: list[list[int]] = []  # [first, last] on the run's clock
    for prev, s in zip([None, *steps], steps):
        r = run(s)
        if spans and prev is not None and r - spans[-1][1] == s - prev:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    if len(spans) == 1 and spans[0][0] == spans[0][1]:
        return f"step {spans[0][0]}"
    return "steps " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _plain(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)


def _blame_dict(blame: Mapping[str, Any] | Blame | None, run: Run = int) -> dict[str, Any] | None:
    """A JSON-ready blame record with a ``message`` (its steps on the run's clock). Accepts a
    :class:`Blame` or a dict with any of ``step``, ``batch``, ``layer``, ``first_alert_step``,
    ``first_alert_batch``, ``symptom``, ``symptom_step``, ``symptom_batch`` (BatchRef values allowed)."""
    if blame is None:
        return None
    if isinstance(blame, Blame):
        return blame.to_dict(run)
    d = dict(blame)
    if "message" not in d and "step" in d:
        if d.get("first_alert_step") is not None and d["first_alert_step"] != d["step"]:
            b = Blame(step=int(d["first_alert_step"]), batch=_as_ref(d.get("first_alert_batch")),
                      layer=d.get("layer"), symptom=d.get("symptom") or "the incident",
                      symptom_step=int(d["step"]), symptom_batch=_as_ref(d.get("batch")))
        else:
            b = Blame(step=int(d["step"]), batch=_as_ref(d.get("batch")), layer=d.get("layer"),
                      symptom=d.get("symptom"), symptom_step=d.get("symptom_step"),
                      symptom_batch=_as_ref(d.get("symptom_batch")))
        d["message"] = b.describe(run)
    return _plain(d)


def _as_ref(x: Any) -> BatchRef | None:
    if x is None or isinstance(x, BatchRef):
        return x
    if isinstance(x, Mapping) and ("batch_index" in x or "fingerprint" in x):
        si = x.get("sample_indices")
        return BatchRef(x.get("epoch"), x.get("batch_index"), None if si is None else tuple(si), x.get("fingerprint"))
    if isinstance(x, int):
        return BatchRef(None, x, None)
    return None


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def batch_key(epoch: int | None, batch_index: int | None, fingerprint: str | None) -> str | None:
    """What identifies a batch across rewinds: its position, else its fingerprint."""
    return f"{epoch}:{batch_index}" if batch_index is not None else fingerprint


def _record_key(q: "QuarantineRecord") -> str | None:
    return batch_key(q.epoch, q.batch_index, q.fingerprint)
