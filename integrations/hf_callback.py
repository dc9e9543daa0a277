"""Hugging Face: ``Trainer(..., callbacks=[EarlywarnTrainerCallback()])`` guards the run.

The Trainer wraps its optimizer in accelerate's ``AcceleratedOptimizer``; the callback watches
the torch optimizer inside (see :mod:`earlywarn.integrations.accelerate_support`), so a skipped
step really leaves parameters and optimizer state untouched, and a rewind restores them with
the LR scheduler.

The loss is read from the model's output (``outputs.loss``, which Hugging Face models return
when given labels) by a forward hook during training, combined over the accumulated
micro-batches on the device (summed when the Trainer passed ``num_items_in_batch`` so that each
is a share of the window, else averaged), and reported before each optimizer step. A loss computed outside
the model (a custom ``compute_loss``) is not seen; the gradient signals still are.

The Trainer clips gradients (``max_grad_norm``, 1.0 by default) before any callback hook and
before ``optimizer.step``, so the detector sees clipped norms: non-finite gradients are caught
and skipped, but a spike shows as at most ``max_norm``. Spike detection on raw norms needs
``max_grad_norm=0``.

Every rank runs the callback (each builds its watcher; decisions agree, see
``earlywarn.capture.distributed``); only rank 0 writes to trackers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from earlywarn.guard import Watcher

from .accelerate_support import watch_accelerated


class EarlywarnTrainerCallback(TrainerCallback):
    """``**options`` are those of :func:`earlywarn.watch` (``sinks``, ``detector``, ``policy``,
    ``recovery``, ``group_by``...)."""

    def __init__(self, **options: Any):
        self.options = options
        self.watcher: Watcher | None = None
        self._hook: Any = None
        self._share: torch.Tensor | None = None  # micro-batch losses already normalised per window
        self._loss_sum: torch.Tensor | None = None  # micro-batch means (averaged at the step)
        self._loss_count = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        self._close()
        if model is None or optimizer is None:
            raise RuntimeError("EarlywarnTrainerCallback needs the Trainer's model and optimizer at on_train_begin")
        options = dict(self.options)
        options.setdefault("scheduler", lr_scheduler)
        _name_mlflow_run(options, getattr(args, "run_name", None))
        self.watcher = watch_accelerated(None, model, optimizer, **options)
        self._hook = model.register_forward_hook(self._capture_loss, with_kwargs=True)

    def _capture_loss(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation forwards
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        loss = loss.detach().float()
        if kwargs.get("num_items_in_batch") is not None:
            # The model already divided by the token count of the whole accumulation window:
            # the window's loss is the sum of the micro-batch losses.
            self._share = loss if self._share is None else self._share + loss
        else:
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is not None:
            parts = [t for t in (self._share, None if self._loss_sum is None else self._loss_sum / self._loss_count)
                     if t is not None]
            if parts:
                self.watcher.report_loss(sum(parts[1:], parts[0]))  # device ops, no sync
        self._share, self._loss_sum, self._loss_count = None, None, 0

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.watcher is not None:
            self.watcher.close()
        self._share, self._loss_sum, self._loss_count = None, None, 0


def _name_mlflow_run(options: dict[str, Any], run_name: str | None) -> None:
    """The Trainer's ``run_name`` names earlywarn's MLflow run too. Without one, the sink's own
    default is unique per run (``set_seed`` fixes Python's ``random``, so MLflow's random names
    would repeat from one Trainer run to the next)."""
    from earlywarn.sinks.defaults import default_sink_specs

    specs = options.get("sinks")
    names = [s if isinstance(s, str) else getattr(s, "name", None) for s in (default_sink_specs() if specs is None else specs)]
    if not run_name or "mlflow" not in names:
        return
    sink_options = {k: dict(v) for k, v in (options.get("sink_options") or {}).items()}
    sink_options.setdefault("mlflow", {}).setdefault("run_name", run_name)
    options["sink_options"] = sink_options
