"""earlywarn -> MLflow: metrics in batches, alerts as tags + a metric + JSON incident artifacts,
checkpoint records (and optional checkpoint upload).

MLflow has no alerting on runs, so an alert becomes something to *search and chart on*:

============================  ===================================================================
what                          where
============================  ===================================================================
``earlywarn.status`` tag      worst level so far: ``ok`` / ``info`` / ``warning`` / ``critical``
``earlywarn.last_alert`` tag  title and message of the last event
``earlywarn.last_checkpoint`` ``{"step", "path", "reason"}`` of the last checkpoint (JSON)
``earlywarn/incident_level``  metric, one point per event at its step (0-3)
incident artifacts            ``earlywarn/incidents/<n>_step<step>_<kind>.json`` (``Event.to_dict``)
checkpoint artifacts          ``earlywarn/checkpoints/step_<step>.json``; with
                              ``upload_checkpoints=True`` also the files under
                              ``earlywarn/checkpoints/step_<step>/``
============================  ===================================================================

The SDK is imported in ``start()``. Every call goes through an explicit ``MlflowClient`` and run
id (never the fluent API, whose active run is thread-local), so it works from the background
thread that ``build_sinks`` puts it on. MLflow's HTTP client retries a failed request itself
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, 7 by default, minutes in total); earlywarn's buffer and
backoff sit on top of that. Set ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0..2`` and
``MLFLOW_HTTP_REQUEST_TIMEOUT=10`` to notice an outage within seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Mapping, Sequence

from earlywarn.events import Event, Level
from earlywarn.metrics import sanitize_key
from earlywarn.sinks.base import METRIC_PREFIX, PermanentSinkError, Sink

_MAX_PER_BATCH = 1000  # the server's limit on values (metrics + tags) per log_batch
_MAX_TAG_VALUE = 5000
_PERMANENT_HTTP = (400, 401, 403, 404)


def _status_name(level: Level) -> str:
    return "ok" if level == Level.NONE else str(level)


class MlflowSink(Sink):
    """Logs to an MLflow run: the active one, ``run_id``, or a new one it creates (and ends).

    ``tracking_uri`` defaults to ``mlflow.get_tracking_uri()``: ``$MLFLOW_TRACKING_URI`` or, with
    nothing configured, the embedded ``sqlite:///<cwd>/mlflow.db`` that ``mlflow ui`` reads.
    ``experiment`` is a name (created if missing); without it the run goes where
    ``mlflow.start_run()`` would put it (``$MLFLOW_EXPERIMENT_NAME`` / ``_ID`` or Default).
    """

    name = "mlflow"
    io_bound = True

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        *,
        tags: Mapping[str, str] | None = None,
        upload_checkpoints: bool = False,
        incident_min_level: Level | str = Level.INFO,
        max_incident_artifacts: int = 1000,
    ):
        if max_incident_artifacts < 0:
            raise ValueError(f"MlflowSink.max_incident_artifacts={max_incident_artifacts!r}: use an int >= 0")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.tags = dict(tags or {})
        self.upload_checkpoints = upload_checkpoints
        self.incident_min_level = Level.parse(incident_min_level)
        self.max_incident_artifacts = max_incident_artifacts
        self.owns_run = False
        self._client: Any = None
        self._Metric: Any = None
        self._RunTag: Any = None
        self._worst = Level.NONE
        self._incidents = 0
        self._keys: dict[str, str] = {}
        # MLflow's active run is thread-local and start() may run on a worker thread: look for the
        # caller's active run here. No import: if mlflow was never imported there is no active run.
        mlflow = sys.modules.get("mlflow")
        if run_id is None and mlflow is not None:
            active = mlflow.active_run()
            if active is not None:
                self.run_id = active.info.run_id
                if tracking_uri is None:
                    self.tracking_uri = mlflow.get_tracking_uri()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._client is not None:
            return
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Metric, RunTag

        self._Metric, self._RunTag = Metric, RunTag
        uri = self.tracking_uri or mlflow.get_tracking_uri()
        client = MlflowClient(tracking_uri=uri)
        base_tags = {"earlywarn.version": _version(), **self.tags}
        if self.run_id is not None:
            run = self._call(client.get_run, self.run_id)
            tags = dict(base_tags)
            existing = run.data.tags.get("earlywarn.status")
            if existing is None:
                tags["earlywarn.status"] = "ok"
            else:  # resumed run: keep its worst level
                self._worst = max((lvl for lvl in Level if _status_name(lvl) == existing), default=Level.NONE)
            self._call(client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)
            self.owns_run = False
        else:
            exp_id = self._experiment_id(client)
            tags = {**base_tags, "earlywarn.status": "ok"}
            run = self._call(client.create_run, exp_id, tags=tags, run_name=self.run_name)
            self.run_id = run.info.run_id
            self.owns_run = True
        self.tracking_uri = uri
        self._client = client

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
        exp = self._call(client.get_experiment_by_name, name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self._call(client.create_experiment, name)
        except PermanentSinkError:  # created concurrently by another process
            exp = self._call(client.get_experiment_by_name, name)
            if exp is None:
                raise
            return exp.experiment_id

    def finish(self) -> None:
        client, self._client = self._client, None
        if client is not None and self.owns_run:
            from earlywarn.sinks.background import signal_exit_code

            status = "FINISHED" if signal_exit_code() is None else "KILLED"  # SIGTERM: pre-empted
            self._call(client.set_terminated, self.run_id, status)

    # ------------------------------------------------------------------ records
    @staticmethod
    def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args, **kwargs)
        except MlflowException as exc:
            if exc.get_http_status_code() in _PERMANENT_HTTP:
                raise PermanentSinkError(str(exc)[:1000]) from exc
            raise

    def _key(self, key: str) -> str:
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = sanitize_key(key)
        return k

    def _require_started(self) -> Any:
        if self._client is None:
            self.start()
        return self._client

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics_batch([(step, metrics, time.time())])

    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        client = self._require_started()
        Metric = self._Metric
        batch: list[Any] = []
        for step, metrics, t in records:
            ts = int(t * 1000)
            for key, value in metrics.items():
                batch.append(Metric(self._key(key), float(value), ts, int(step)))
        # A retry after a partial failure resends earlier chunks; MLflow ignores exact duplicates
        # (same key, value, timestamp, step), so nothing is counted twice.
        for i in range(0, len(batch), _MAX_PER_BATCH):
            self._call(client.log_batch, self.run_id, metrics=batch[i : i + _MAX_PER_BATCH], synchronous=True)

    def alert(self, event: Event) -> None:
        client = self._require_started()
        worst = max(self._worst, event.level)
        tags = [
            self._RunTag("earlywarn.status", _status_name(worst)),
            self._RunTag("earlywarn.last_alert", f"{event.title}: {event.message}"[:_MAX_TAG_VALUE]),
        ]
        metric = self._Metric(METRIC_PREFIX + "incident_level", float(int(event.level)), int(event.time * 1000), event.step)
        self._call(client.log_batch, self.run_id, metrics=[metric], tags=tags, synchronous=True)
        if event.level >= self.incident_min_level and self._incidents < self.max_incident_artifacts:
            name = sanitize_key(f"{self._incidents + 1:05d}_step{event.step}_{event.kind}")
            self._call(client.log_dict, self.run_id, event.to_dict(), f"earlywarn/incidents/{name}.json")
            self._incidents += 1
        self._worst = worst

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        client = self._require_started()
        record: dict[str, Any] = {"step": int(step), "path": path, "reason": reason, "time": time.time()}
        uploaded = None
        if self.upload_checkpoints and os.path.exists(path):
            uploaded = f"earlywarn/checkpoints/step_{int(step)}"
            if os.path.isdir(path):
                self._call(client.log_artifacts, self.run_id, path, uploaded)
            else:
                self._call(client.log_artifact, self.run_id, path, uploaded)
        record["artifact_path"] = uploaded
        tag = json.dumps({k: record[k] for k in ("step", "path", "reason")})[:_MAX_TAG_VALUE]
        self._call(client.set_tag, self.run_id, "earlywarn.last_checkpoint", tag)
        self._call(client.log_dict, self.run_id, record, f"earlywarn/checkpoints/step_{int(step)}.json")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("earlywarn")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "unknown"
