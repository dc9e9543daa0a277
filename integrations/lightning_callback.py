"""Lightning: ``Trainer(callbacks=[EarlywarnCallback()])`` guards every optimizer of the run.

How it fits Lightning's step (``Precision.optimizer_step``): Lightning calls
``optimizer.step(closure)``; the closure runs forward and backward, then the
``on_before_optimizer_step`` hooks, then gradient clipping; only then does the optimizer update.
The callback takes the watcher's statistics and decision in ``on_before_optimizer_step`` --
gradients unscaled (AMP) and not yet clipped -- and applies it when the update would happen:
a skipped step leaves parameters and optimizer state untouched, a rewind restores them.

The loss is taken from ``on_before_backward`` (unscaled, summed over accumulated micro-batches,
kept on the device). ``state_dict()`` carries each watcher's detector, policy and counters in
Lightning checkpoints, so a resumed run keeps its baselines.

Works with DDP / FSDP strategies as ``earlywarn.watch`` does (every rank gets the same
statistics, so every rank takes the same decision; only rank 0 writes to trackers).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

import lightning.pytorch as pl

import earlywarn
from earlywarn.guard import Watcher

from ._deferred import DeferredStep


class EarlywarnCallback(pl.Callback):
    """Guard a Lightning run. ``**options`` are those of :func:`earlywarn.watch` (``sinks``,
    ``detector``, ``policy``, ``recovery``, ``group_by``, ``mode``...).

    ``loader``: an :class:`earlywarn.ResumableLoader` (or torchdata ``StatefulDataLoader``) that
    the run's ``train_dataloader`` returns, so incidents name batches and a rewind can skip them.
    """

    def __init__(self, *, loader: Any = None, **options: Any):
        super().__init__()
        self.options = options
        self.loader = loader
        self.watchers: list[Watcher] = []
        self._deferred: dict[int, DeferredStep] = {}
        self._loss: torch.Tensor | None = None
        self._saved: list[Mapping[str, Any]] | None = None

    @property
    def watcher(self) -> Watcher:
        """The watcher of the first optimizer (after fit: closed, with its events and counters)."""
        if not self.watchers:
            raise RuntimeError("EarlywarnCallback has no watcher yet: it is built in on_fit_start")
        return self.watchers[0]

    # -- lifecycle -------------------------------------------------------------------------
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close()
        self.watchers = []
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        schedulers = {id(c.scheduler.optimizer): c.scheduler for c in trainer.lr_scheduler_configs
                      if hasattr(c.scheduler, "optimizer")}
        for opt in trainer.optimizers:
            # The scaler is observed through the hook (Lightning unscales before it), so it is
            # only snapshotted with the rest, not wrapped a second time.
            extra = {"grad_scaler": scaler} if scaler is not None else None
            w = earlywarn.watch(pl_module, opt, loader=self.loader, scheduler=schedulers.get(id(opt)),
                                extra_state=extra, **self.options)
            self.watchers.append(w)
            self._deferred[id(opt)] = DeferredStep(w, scaler)
        if self._saved is not None:
            for w, state in zip(self.watchers, self._saved):
                w.load_state_dict(state)
            self._saved = None

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if not self.watchers or loss.numel() != 1:
            return
        loss = loss.detach().float()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            loss = loss / scaler._scale  # Lightning hands the hook the scaled loss (device op, no sync)
        # Lightning divided each micro-batch loss by accumulate_grad_batches: the sum is the mean.
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        deferred = self._deferred.get(id(optimizer))
        if deferred is None:
            return
        if self._loss is not None:
            deferred.watcher.report_loss(self._loss)
            self._loss = None
        deferred.observe()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        for w in self.watchers:
            w.flush()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._close()  # flushes the sinks: a halt is on record before the run ends

    def _close(self) -> None:
        # Closed watchers stay in self.watchers (events, counters) until the next fit.
        for w in self.watchers:
            d = self._deferred.pop(id(w.optimizer), None)
            if d is not None:
                d.remove()
                w.close()
        self._loss = None

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"watchers": [w.state_dict() for w in self.watchers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = list(state_dict.get("watchers", []))
        if self._deferred:  # watchers are live
            for w, s in zip(self.watchers, saved):
                w.load_state_dict(s)
        else:  # Lightning restores callbacks before on_fit_start builds the watchers
            self._saved = saved
