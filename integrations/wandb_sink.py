"""earlywarn -> Weights & Biases: metrics for Automations, ``run.alert`` notifications, summary,
checkpoint records (and optional checkpoint artifacts).

* Metrics are logged as rows holding ``earlywarn/step``, declared as the step metric of
  ``earlywarn/*`` with ``summary="max,last"``: never ``run.log(step=...)``, because W&B silently
  drops a row whose step is lower than the last one, and a rewind goes back in steps.
* On a run this sink created, each step is its own row.
* Attached to your run (``wandb.run`` was active, or ``run=`` given), it logs with
  ``commit=False``: its values ride on your next row and never move your step counter (so your
  ``wandb.log(..., step=s)`` keeps working). Between two of your rows it *carries*, it does not
  overwrite: the row gets the worst ``alert_level``, ``nonfinite_layers``, ``instability_score``
  and ``grad_norm`` (NaN/Inf counting as worst), the lowest ``*_finite`` flag, and the latest
  counters and ``earlywarn/step`` of every earlywarn step since your previous row. So an
  Automation on ``alert_level >= 3`` fires on the first row of yours after a critical step.
* When your run gets no rows of its own: earlywarn's data is live in the run summary
  (``earlywarn/status``, ``earlywarn/worst_level``, first / last critical kind and step, a count
  per kind, ``earlywarn/last_alert``), ``run.alert`` notifies as usual, and the carried row goes
  out with your next ``log`` or your ``run.finish()``. earlywarn does not commit rows into your
  run by default: a row it commits would take a W&B step, and a later ``wandb.log(..., step=s)``
  of yours with a lower ``s`` (``step=epoch`` is common) would be dropped by W&B.
  ``idle_commit_seconds=N`` makes it commit its carried row itself after ``N`` seconds without
  a row of yours (safe when you never pass ``step=``); ``commit=True`` commits every step.
* ``run.alert``: title < 64 characters and without the step, so W&B's own per-title
  ``wait_duration`` and this sink's de-duplication agree; the same kind of event in the same layer
  is sent at most once per ``alert_wait_seconds`` unless its level rises.
* Offline runs: ``finish()`` ends the run this sink created (exit code 1 after an
  ``earlywarn.Halt``, 143 after SIGTERM) and calls ``wandb.teardown()`` (right after
  ``run.finish()`` the run file can still miss its tail); the background wrapper runs
  ``finish`` at exit and turns SIGTERM into a clean exit, so the tail (alerts included) is kept.
* What W&B stores: NaN and +/-Infinity are kept as such in history.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any, Mapping, Sequence

from earlywarn.events import Event, Level
from earlywarn.sinks.base import METRIC_PREFIX, EventTally, Sink, alert_line, status_name

_W_LEVEL = {Level.NONE: "INFO", Level.INFO: "INFO", Level.WARNING: "WARN", Level.CRITICAL: "ERROR"}
_TITLE_MAX = 63  # W&B wants titles < 64 characters

# How a row carries several earlywarn steps (attached to the user's run): the worst, else the latest.
_CARRY_MAX = frozenset(METRIC_PREFIX + k for k in ("alert_level", "nonfinite_layers", "instability_score", "grad_norm"))
_CARRY_MIN = frozenset(METRIC_PREFIX + k for k in ("grad_norm_finite", "loss_finite"))


def _worse(old: float, new: float) -> float:
    """The worse of two values: a non-finite one, else the larger."""
    if not math.isfinite(old):
        return old
    if not math.isfinite(new):
        return new
    return new if new > old else old


def carry(row: dict[str, float], metrics: Mapping[str, float]) -> None:
    """Fold one step's ``metrics`` into ``row`` (see :data:`_CARRY_MAX`, :data:`_CARRY_MIN`)."""
    for key, value in metrics.items():
        old = row.get(key)
        if old is None:
            row[key] = value
        elif key in _CARRY_MAX:
            row[key] = _worse(old, value)
        elif key in _CARRY_MIN:
            row[key] = value if value < old else old
        else:
            row[key] = value


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+inf" if v > 0 else "-inf"
    return f"{v:.4g}"


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
        lines.append("values: " + ", ".join(f"{k}={_fmt(float(v))}" for k, v in list(event.values.items())[:10]))
    if event.batch is not None:
        lines.append(f"batch: {event.batch}")
    if held:
        lines.append(f"(+{held} similar events held back since the last alert)")
    return "\n".join(lines)


class WandbSink(Sink):
    """Logs to the active ``wandb.run``, to ``run``, or to a run it starts with ``wandb.init``.

    ``init_kwargs`` go to ``wandb.init`` (``mode="offline"``, ``dir``, ``tags``, ...);
    ``project`` / ``entity`` / ``name`` are shortcuts for the common ones. ``commit``: ``None``
    (default) commits each step as a row on a run this sink created and carries steps into your
    rows on yours (see the module docstring); ``True`` / ``False`` force it.
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
        idle_commit_seconds: float | None = None,
        define_metrics: bool = True,
        upload_checkpoints: bool = False,
        teardown: bool = True,
        step_key: str = METRIC_PREFIX + "step",
        down_timeout: float = 3.0,
        spool_path: str | None = None,
    ):
        if not alert_wait_seconds >= 0:
            raise ValueError(f"WandbSink.alert_wait_seconds={alert_wait_seconds!r}: use seconds >= 0")
        if idle_commit_seconds is not None and not idle_commit_seconds >= 0:
            raise ValueError(f"WandbSink.idle_commit_seconds={idle_commit_seconds!r}: use None (never) or seconds >= 0")
        if commit not in (None, True, False):
            raise ValueError(f"WandbSink.commit={commit!r}: use None (automatic), True or False")
        self.init_kwargs = dict(init_kwargs or {})
        for key, value in (("project", project), ("entity", entity), ("name", name)):
            if value is not None:
                self.init_kwargs.setdefault(key, value)
        self.alert_min_level = Level.parse(alert_min_level)
        self.alert_wait_seconds = float(alert_wait_seconds)
        self.commit = commit
        self.idle_commit_seconds = idle_commit_seconds
        self.define_metrics = define_metrics
        self.upload_checkpoints = upload_checkpoints
        self.teardown = teardown
        self.step_key = step_key
        self.down_timeout = float(down_timeout)
        self.spool_path = spool_path
        self.owns_run = False
        self.alerts_sent = 0
        self.alerts_held = 0
        self._run = run
        if run is None:
            # Attach to the caller's active run (looked up here, on the caller's thread); no import.
            wandb = sys.modules.get("wandb")
            self._run = getattr(wandb, "run", None) if wandb is not None else None
        # Riding on the user's rows wants each step delivered at once; rows of our own can batch.
        self.batch_interval = 0.0 if (self._run is not None or commit is False) else 0.5
        self._started = False
        self._finished = False
        self._halted = False
        self._tally = EventTally()
        self._last_alert: dict[tuple, tuple[float, Level]] = {}
        self._held: dict[tuple, int] = {}
        self._carried: dict[str, float] = {}  # what the user's pending row holds from us
        self._carried_row: int | None = None  # the user's row it belongs to
        self._row_seen_at = time.monotonic()

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
        if not self.owns_run:  # a resumed or shared run: continue its earlywarn summary
            try:
                prior = {k: run.summary.get(k) for k in run.summary.keys() if str(k).startswith(METRIC_PREFIX)}
            except Exception:  # noqa: BLE001 - a summary that cannot be read is no reason to fail
                prior = {}
            self._tally.restore_tags({k.replace("count/", "count."): v for k, v in prior.items()}, METRIC_PREFIX)
        run.summary.update({METRIC_PREFIX + "status": status_name(self._tally.worst),
                            METRIC_PREFIX + "worst_level": int(self._tally.worst)})
        self._carried_row = self._user_row()
        self._started = True

    def _user_row(self) -> int | None:
        # The W&B step the next row will get. `_local_step` is the SDK's own client-side counter
        # (no round trip to the service); `run.step` asks the service.
        step = getattr(self._run, "_local_step", None)
        if isinstance(step, int):
            return step
        try:
            return int(self._run.step)
        except Exception:  # noqa: BLE001 - a run that cannot say: treat every log as a new row
            return None

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics_batch([(step, metrics, 0.0)])

    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        if not self._started:
            self.start()
        if self._finished:
            return
        if self.commit:
            for step, metrics, _ in records:
                row = dict(metrics)
                row[self.step_key] = int(step)
                self._run.log(row, commit=True)
            return
        now = self._user_row()
        if now is None or now != self._carried_row:
            # The user's run committed a row since our last log: it took what we had carried.
            self._carried = {}
            self._carried_row = now
            self._row_seen_at = time.monotonic()
        for step, metrics, _ in records:
            carry(self._carried, metrics)
            self._carried[self.step_key] = int(step)
        idle = (self.idle_commit_seconds is not None
                and time.monotonic() - self._row_seen_at >= self.idle_commit_seconds)
        self._run.log(dict(self._carried), commit=bool(idle))
        after = self._user_row()
        if idle or after != now:
            # Our own row went out (idle commit); or the user committed while we logged, so where
            # our values landed is unknown: keep carrying them (a row may repeat a worst level,
            # none loses one).
            if idle:
                self._carried = {}
            self._carried_row = after
            self._row_seen_at = time.monotonic()

    def alert(self, event: Event) -> None:
        if not self._started:
            self.start()
        if self._finished:
            return
        run = self._run
        if str(event.kind) == "halt":
            self._halted = True
        changed = self._tally.update(event)
        summary = {METRIC_PREFIX + k.replace("count.", "count/"): v for k, v in changed.items()}
        summary[METRIC_PREFIX + "last_alert"] = alert_line(event)
        run.summary.update(summary)
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
        if code is None and self._halted:
            code = 1  # earlywarn.Halt stopped the run: it shows as failed
        if code is None:
            self._run.finish()
        else:  # pre-empted or halted: the run shows as failed with that exit code, not as finished
            self._run.finish(exit_code=code)
        # run.finish() can return before the run file has its tail; teardown waits for the
        # service. Skipped when another run is still live in this process.
        if self.teardown and wandb.run is None:
            wandb.teardown()
