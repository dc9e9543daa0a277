"""``RecoveryConfig``: how earlywarn snapshots, repairs, rewinds and escalates (validated at
construction: a bad value raises a ValueError naming the field, the value and the fix)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

from .._renamed import renamed
from .budget import parse_memory
from .checkpoint import is_collective

SINCE_SNAPSHOT = "since_snapshot"
_RECURRENCE = ("halt", "lower_lr")


@renamed("max_rewinds", "max_rewinds_per_episode")
@dataclass
class RecoveryConfig:
    """How earlywarn recovers. The defaults protect a run that passes nothing: in-memory
    snapshots often enough that a rewind loses at most ``max_lost_steps`` steps, repair of
    poisoned optimizer state, a skip (no rewind) for a bad batch, a rewind on a collapse that
    never trains the batches that led into it again, and a halt with a diagnosis when the
    instability comes back after a rewind."""

    max_lost_steps: int = 50
    """A rewind should lose at most about this many steps. Sets the snapshot cadence:
    ``snapshot_every`` defaults to half of it (an incident takes some steps to show), and while
    an episode builds (alerts, the run's signals elevated) snapshots come five times as often."""
    snapshot_every: int | None = None
    """Steps between in-memory snapshots (host RAM; the first is taken at the first step).
    ``None``: ``max_lost_steps // 2``. 0 disables them; rewinds then need disk checkpoints."""
    snapshot_every_building: int | None = None
    """Steps between snapshots while an episode builds (an alert within ``clean_window`` steps --
    not an isolated spike, reported once over -- or one of the run's own signals elevated now:
    gradient norm, update, loss, not a single layer's). ``None``: ``snapshot_every // 5`` (at
    least 1)."""
    snapshot_keep: int = 3
    """Clean in-memory snapshots kept at most (one more slot holds the last warning's unclean
    copy); ``snapshot_memory`` may allow fewer."""
    snapshot_memory: int | float | str | None = None
    """Host RAM the in-memory snapshots may use, per process: bytes (int), a size (``"8GB"``,
    ``"512MiB"``, ``"20%"``) or a fraction of the memory available at ``watch()`` (float in
    (0, 1]). ``None``: 25% of the memory available at ``watch()``, shared by the processes of
    this node (``LOCAL_WORLD_SIZE``). The ring keeps as many snapshots as fit, up to
    ``snapshot_keep``; ``watch()`` reports the plan once."""
    checkpoint_dir: str | None = None
    """Directory for disk checkpoints; ``None``: no disk checkpoints. Under torch.distributed
    (world size > 1) the writer decides the layout (see ``collective_save``): per-rank writers
    (the default ``torch.save``) give each rank its own ``<checkpoint_dir>/rank<r>`` (its RNG and
    data shard differ; one writer per directory); a collective writer writes one checkpoint per
    step into ``<checkpoint_dir>`` itself, every rank its part."""
    checkpoint_every: int = 1000
    """Steps between periodic disk checkpoints (when ``checkpoint_dir`` is set)."""
    checkpoint_keep: int = 3
    """Clean disk checkpoints kept (plus the last unclean one, taken on a warning)."""
    checkpoint_async: bool = False
    """Copy state to host memory and write on a background thread."""
    save_fn: Callable[[dict[str, Any], str], None] | None = None
    """Replace ``torch.save`` (e.g. a ``torch.distributed.checkpoint`` writer): ``save_fn(payload, path)``."""
    load_fn: Callable[[str], dict[str, Any]] | None = None
    """Replace ``torch.load(weights_only=True)``: ``load_fn(path) -> payload`` as given to ``save_fn``."""
    collective_save: bool | None = None
    """Whether ``save_fn`` / ``load_fn`` are collectives that every rank calls together with the
    same path (``torch.distributed.checkpoint``: each rank writes its shards into one shared
    checkpoint; rank 0 alone commits it, see ``CheckpointManager``). ``None``: the ``collective``
    attribute of ``save_fn`` decides -- ``earlywarn.distributed.dcp_checkpoint_fns`` sets it, and
    the default ``torch.save`` writer is never collective. Needs ``checkpoint_async=False``."""
    clean_window: int = 20
    """A snapshot is clean when no warning-or-worse alert (an incident) came within this many
    steps before it; info spikes that recovered and bad batches that were skipped do not count.
    The steps after a repair or a rewind are unclean for this long too, and a rewind has *held*
    once the run trained this many steps past its incident. So are the steps of a run of outlier
    gradients until its end is judged, also where the detector took it as its new normal and
    they raise no alert (``earlywarn.policy.Policy.run_unjudged``)."""
    state_check_every: int | None = None
    """Every this many steps the optimizer's state is checked on the device (one fused norm over
    it, read with the step's statistics: no extra host read), and a poisoned moment is repaired
    before the update that would read it. ``None``: every step for an optimizer from outside
    ``torch.optim`` (its update may hide a NaN moment: Lion's ``sign(NaN) = 0`` freezes those
    coordinates and no NaN ever reaches the weights, the gradients or the loss), every 10 steps
    for ``torch.optim``'s own, whose NaN moment reaches the weights at the next update, where the
    loss and the gradients show it (the check costs about twice the guard's gradient-norm pass,
    ``docs/benchmarks.md``). 0: only the snapshots' finiteness pass."""
    repair: bool = True
    """Repair poisoned optimizer state (non-finite moments) in place."""
    repair_reset_state: bool = True
    """Poisoned optimizer state coordinates get the per-key reset (Adam m -> 0, v -> largest
    finite v); ``False``: copy them from the last clean snapshot when it has them."""
    repair_max_param_fraction: float = 0.01
    """Non-finite *parameter* coordinates are copied back from the last clean snapshot only
    while they are at most this share of all parameter elements; beyond, rewind."""
    rewind: bool = True
    """Rewind to the last clean snapshot on a collapse (else ``rewind()`` halts)."""
    rewind_skip_batches: int | Literal["since_snapshot"] = SINCE_SNAPSHOT
    """Batches skipped after the restored snapshot. ``"since_snapshot"``: every batch drawn
    since the snapshot (nothing that led into the incident is trained again; the data simply
    continues). An int K: the next batch after the rewind is the one K after the snapshot's
    (PaLM skipped ~200-500); K smaller than the batches since the snapshot replays some, which
    needs ``earlywarn.ResumableLoader``."""
    rewind_restore_rng: bool | None = None
    """Whether a rewind puts the global RNGs (python, numpy, torch, CUDA) back to the snapshot's.
    ``None``: only with a restorable loader (it, not the RNG, picks the batches). Without one the
    RNGs may be what draws the batches (nanoGPT: ``torch.randint``): restoring them would draw
    the same batches again, so they go on from where they are. The rewind event says which."""
    on_recurrence: str = "lower_lr"
    """What to do when an incident comes back before the rewind for it held -- on new batches,
    so not a bad batch (likely the learning rate or another hyperparameter): ``"lower_lr"``
    rewinds again (never further back than the episode's first rewind) and multiplies the
    learning rate by ``recurrence_lr_factor`` for ``recurrence_lr_steps`` steps; the run halts
    with the diagnosis once ``max_rewinds_per_episode`` rewinds did not hold (a run that cannot
    go on). ``"halt"``: halt with the diagnosis at the first recurrence."""
    recurrence_lr_factor: float = 0.5
    """``on_recurrence="lower_lr"``: the factor (0 < f < 1); it compounds on every recurrence."""
    recurrence_lr_steps: int = 200
    """``on_recurrence="lower_lr"``: optimizer steps the lower learning rate lasts. It is
    applied around each optimizer step, so it holds whoever sets the learning rate (a
    scheduler, the loop) and the loop's own values come back afterwards."""
    max_rewinds_per_episode: int = 3
    """Rewinds per episode (the first and the recurrences) before halting. (Rewinds within a
    window of steps, whatever their episode, are ``PolicyConfig.max_rewinds_per_window``.)"""
    quarantine_path: str | None = None
    """JSONL file listing every batch that will never be trained (skipped or rewound over);
    default ``<checkpoint_dir>/quarantine.jsonl``, or ``quarantine.jsonl`` in earlywarn's output
    folder (``./earlywarn_output/``, see ``earlywarn.sinks.defaults.output_dir``) without a
    checkpoint directory. Written only when a batch is quarantined."""
    fingerprint_inputs: bool = True
    """Without a restorable loader, hash the model's inputs (a forward pre-hook, on the device,
    no host sync) so that skipped and quarantined batches are named by a fingerprint;
    ``Watcher.report_batch(x)`` replaces it."""
    history: int = 4096
    """Steps for which the batch drawn is remembered (for blame and quarantine)."""

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"RecoveryConfig.{name}={getattr(self, name)!r}: {fix}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.state_check_every is not None and (not is_int(self.state_check_every) or self.state_check_every < 0):
            raise bad("state_check_every", "must be None (chosen by the optimizer), or an int >= 0 (0: never)")
        for name in ("checkpoint_every", "clean_window", "max_rewinds_per_episode", "recurrence_lr_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "must be an int >= 0")
        for name in ("snapshot_keep", "checkpoint_keep", "history", "max_lost_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be an int >= 1")
        for name in ("snapshot_every", "snapshot_every_building"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < (0 if name == "snapshot_every" else 1)):
                raise bad(name, "must be None (derived from max_lost_steps) or an int >= "
                                f"{0 if name == 'snapshot_every' else 1}")
        if self.checkpoint_dir is not None and self.checkpoint_every < 1:
            raise bad("checkpoint_every", "must be >= 1 when checkpoint_dir is set")
        rsb = self.rewind_skip_batches
        if not (rsb == SINCE_SNAPSHOT or (is_int(rsb) and rsb >= 0)):
            raise bad("rewind_skip_batches", f"use {SINCE_SNAPSHOT!r} or an int >= 0")
        for name in ("checkpoint_async", "repair", "repair_reset_state", "rewind", "fingerprint_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False (a string such as 'false' would count as true)")
        frac = self.repair_max_param_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
            raise bad("repair_max_param_fraction", "must be a number between 0 and 1 (a share of all parameter elements)")
        if self.rewind_restore_rng is not None and not isinstance(self.rewind_restore_rng, bool):
            raise bad("rewind_restore_rng", "use True, False or None (None: restore them only with a restorable loader)")
        if self.collective_save is not None and not isinstance(self.collective_save, bool):
            raise bad("collective_save", "use True, False or None (None: ask save_fn.collective)")
        if self.on_recurrence not in _RECURRENCE:
            raise bad("on_recurrence", f"use one of {', '.join(map(repr, _RECURRENCE))}")
        f = self.recurrence_lr_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < float(f) < 1.0:
            raise bad("recurrence_lr_factor", "must be a number between 0 and 1 (exclusive), e.g. 0.5")
        if self.snapshot_memory is not None:
            try:
                parse_memory(self.snapshot_memory, available=1 << 40)
            except ValueError as e:
                raise bad("snapshot_memory", str(e)) from None
        for name in ("save_fn", "load_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise bad(name, "must be callable")
        if (self.save_fn is None) != (self.load_fn is None):
            raise bad("save_fn", "give save_fn and load_fn together (a custom format needs its reader)")
        if self.collective_save and self.save_fn is None:
            raise bad("collective_save", "needs a collective save_fn/load_fn pair, e.g. "
                      "earlywarn.distributed.dcp_checkpoint_fns(model, optimizer); torch.save writes per rank")
        if self.collective and self.checkpoint_async:
            raise bad("checkpoint_async", "cannot be True with a collective save_fn: every rank must run the "
                      "collective write on its training thread; set checkpoint_async=False")
        if self.snapshot_every == 0 and self.checkpoint_dir is None and self.rewind:
            raise bad("snapshot_every", "is 0 and there is no checkpoint_dir: nothing to rewind to; "
                      "keep snapshots on, set checkpoint_dir, or set rewind=False")
        for name in ("checkpoint_dir", "quarantine_path"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise bad(name, "must be a path (str or os.PathLike), or None")
            if v is not None and os.fspath(v) == "":
                raise bad(name, "is empty: give a directory (e.g. 'checkpoints'), or None for none"
                          if name == "checkpoint_dir" else "is empty: give a file path, or None for the default")
            if v is not None:
                setattr(self, name, os.fspath(v))

    @property
    def collective(self) -> bool:
        """The checkpoint writer is a collective (``collective_save``, else ``save_fn.collective``)."""
        return is_collective(self.save_fn) if self.collective_save is None else self.collective_save

    @property
    def every(self) -> int:
        """Steps between in-memory snapshots (0: none)."""
        return max(1, self.max_lost_steps // 2) if self.snapshot_every is None else self.snapshot_every

    @property
    def every_building(self) -> int:
        """Steps between in-memory snapshots while an episode builds."""
        if self.snapshot_every_building is not None:
            return min(self.snapshot_every_building, self.every) if self.every else 0
        return max(1, self.every // 5) if self.every else 0
