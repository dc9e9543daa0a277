"""earlywarn -> Weights & Biases: metrics for Automations, ``run.alert`` notifications, summary,
checkpoint records (and optional checkpoint artifacts).

* Metrics are logged as rows holding ``earlywarn/step``, declared as the step metric of
  ``earlywarn/*`` with ``summary="max,last"``: never ``run.log(step=...)``, because W&B silently
  drops a row whose step is lower than the last one, and a rewind goes back in steps.
* On a run this sink created, each step is its own row. Attached to your run (``wandb.run`` was
  active, or ``run=`` given), it logs with ``commit=False``: the values ride on your next row and
  never move your step counter (so your ``wandb.log(..., step=s)`` keeps working); if several
  earlywarn steps arrive between two of your rows, the last one wins in history.
* ``run.alert``: title < 64 characters and without the step, so W&B's own per-title
  ``wait_duration`` and this sink's de-duplication agree; the same kind of event in the same layer
  is sent at most once per ``alert_wait_seconds`` unless its level rises.
* Summary: ``earlywarn/status`` (worst level so far), ``earlywarn/last_alert``,
  ``earlywarn/last_checkpoint``.
* Offline runs: ``finish()`` ends the run this sink created and calls ``wandb.teardown()`` (right
  after ``run.finish()`` the run file can still miss its tail); the background wrapper runs
  ``finish`` at exit and turns SIGTERM into a clean exit, so the tail (alerts included) is kept.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Mapping, Sequence

from earlywarn.events import Event, Level
from earlywarn.sinks.base import METRIC_PREFIX, Sink

_W_LEVEL = {Level.NONE: "INFO", Level.INFO: "INFO", Level.WARNING: "WARN", Level.CRITICAL: "ERROR"}
_TITLE_MAX = 63  # W&B wants titles < 64 characters


def alert_title(event: Event) -> str:
    """``earlywarn warning: grad_spike in blocks.3.attn`` (no step: W&B de-duplicates by title)."""
    where = f" in {event.layer}" if event.layer else ""
    title = f"earlywarn {event.level}: {event.kind}{where}"
    return title if len(title) <= _TITLE_MAX else title[: _TITLE_MAX - 3] + "..."


def alert_text(event: Event, held: int = 0) -> str:
    lines = [f"step {event.step}: {event.message}"]
    if event.layers:
        lines.append("layers (first moved first): " + ", ".join(event.layers[:10]) + (" ..." if len(event.layers) > 10 else ""))
    if event.values:
        lines.append("values: " + ", ".join(f"{k}={v:.4g}" for k, v in list(event.values.items())[:10]))
    if event.batch is not None:
        lines.append(f"batch: {event.batch}")
    if held:
        lines.append(f"(+{held} similar events held back since the last alert)")
    return "\n".join(lines)


class WandbSink(Sink):
    """Logs to the active ``wandb.run``, to ``run``, or to a run it starts with ``wandb.init``.

    ``init_kwargs`` go to ``wandb.init`` (``mode="offline"``, ``dir``, ``tags``, ...);
    ``project`` / ``entity`` / ``name`` are shortcuts for the common ones.
    """

    name = "wandb"
    io_bound = True

    def __init__(
        self,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        *,
        run: Any = None,
        init_kwargs: Mapping[str, Any] | None = None,
        alert_min_level: Level | str = Level.WARNING,
        alert_wait_seconds: float = 300.0,
        commit: bool | None = None,
        define_metrics: bool = True,
        upload_checkpoints: bool = False,
        teardown: bool = True,
        step_key: str = METRIC_PREFIX + "step",
    ):
        if not alert_wait_seconds >= 0:
            raise ValueError(f"WandbSink.alert_wait_seconds={alert_wait_seconds!r}: use seconds >= 0")
        self.init_kwargs = dict(init_kwargs or {})
        for key, value in (("project", project), ("entity", entity), ("name", name)):
            if value is not None:
                self.init_kwargs.setdefault(key, value)
        self.alert_min_level = Level.parse(alert_min_level)
        self.alert_wait_seconds = float(alert_wait_seconds)
        self.commit = commit
        self.define_metrics = define_metrics
        self.upload_checkpoints = upload_checkpoints
        self.teardown = teardown
        self.step_key = step_key
        self.owns_run = False
        self.alerts_sent = 0
        self.alerts_held = 0
        self._run = run
        if run is None:
            # Attach to the caller's active run (looked up here, on the caller's thread); no import.
            wandb = sys.modules.get("wandb")
            self._run = getattr(wandb, "run", None) if wandb is not None else None
        self._started = False
        self._finished = False
        self._worst = Level.NONE
        self._last_alert: dict[tuple, tuple[float, Level]] = {}
        self._held: dict[tuple, int] = {}

    @property
    def run(self) -> Any:
        return self._run

    def start(self) -> None:
        if self._started or self._finished:
            return
        import wandb

        if self._run is None and wandb.run is not None:
            self._run = wandb.run
        if self._run is None:
            self._run = wandb.init(**self.init_kwargs)
            self.owns_run = True
        run = self._run
        if self.commit is None:
            self.commit = self.owns_run
        if self.define_metrics:
            run.define_metric(self.step_key)
            run.define_metric(METRIC_PREFIX + "*", step_metric=self.step_key, summary="max,last")
        run.summary[METRIC_PREFIX + "status"] = "ok"
        self._started = True

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics_batch([(step, metrics, 0.0)])

    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        if not self._started:
            self.start()
        if self._finished:
            return
        for step, metrics, _ in records:
            row = dict(metrics)
            row[self.step_key] = int(step)
            self._run.log(row, commit=self.commit)

    def alert(self, event: Event) -> None:
        if not self._started:
            self.start()
        if self._finished:
            return
        run = self._run
        self._worst = max(self._worst, event.level)
        run.summary[METRIC_PREFIX + "status"] = "ok" if self._worst == Level.NONE else str(self._worst)
        run.summary[METRIC_PREFIX + "last_alert"] = f"{event.title}: {event.message}"
        if event.level < self.alert_min_level:
            return
        key = (str(event.kind), event.layer)
        last = self._last_alert.get(key)
        if last is not None and event.time - last[0] < self.alert_wait_seconds and event.level <= last[1]:
            self._held[key] = self._held.get(key, 0) + 1
            self.alerts_held += 1
            return
        run.alert(
            title=alert_title(event),
            text=alert_text(event, self._held.get(key, 0)),
            level=_W_LEVEL[event.level],
            wait_duration=timedelta(seconds=self.alert_wait_seconds) if self.alert_wait_seconds else None,
        )
        self._last_alert[key] = (event.time, event.level)
        self._held.pop(key, None)
        self.alerts_sent += 1

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        if not self._started:
            self.start()
        if self._finished:
            return
        import os

        record = {"step": int(step), "path": path, "reason": reason}
        self._run.summary[METRIC_PREFIX + "last_checkpoint"] = record
        if self.upload_checkpoints and os.path.exists(path):
            import wandb

            art = wandb.Artifact(name=f"earlywarn-checkpoint-{self._run.id}", type="model", metadata=record)
            if os.path.isdir(path):
                art.add_dir(path)
            else:
                art.add_file(path)
            aliases = ["latest", f"step-{int(step)}"]
            if reason and reason.replace("-", "").replace("_", "").isalnum():
                aliases.append(reason)
            self._run.log_artifact(art, aliases=aliases)

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if not (self._started and self.owns_run):
            return
        import wandb

        from earlywarn.sinks.background import signal_exit_code

        code = signal_exit_code()
        if code is None:
            self._run.finish()
        else:  # pre-empted: the run shows as failed with the signal's exit code, not as finished
            self._run.finish(exit_code=code)
        # run.finish() can return before the run file has its tail; teardown waits for the
        # service. Skipped when another run is still live in this process.
        if self.teardown and wandb.run is None:
            wandb.teardown()
