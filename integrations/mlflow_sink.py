"""earlywarn -> MLflow: metrics in batches, alerts as tags + a metric + JSON incident artifacts,
checkpoint records (and optional checkpoint upload).

MLflow has no alerting on runs or metrics (its 3.x webhooks cover model-registry events only), so
an alert becomes something to *search and chart on*, and the ``webhook`` sink notifies:

===================================  ============================================================
what                                 where
===================================  ============================================================
``earlywarn.status`` tag             worst level so far: ``ok`` / ``info`` / ``warning`` / ``critical``
``earlywarn.worst_level`` tag        the same as a digit, ``0``-``3``
``earlywarn.kinds`` tag              every event kind seen, comma-separated and sorted
``earlywarn.first_critical_kind``    kind and step of the first critical event (``..._step``)
``earlywarn.last_critical_kind``     kind and step of the last critical event (``..._step``)
``earlywarn.count.<kind>`` tags      events of each kind so far
``earlywarn.last_alert`` tag         title and message of the last event, cut at a word
``earlywarn.last_checkpoint`` tag    ``{"step", "path", "reason"}`` of the last checkpoint (JSON)
``earlywarn/incident_level``         metric, one point per event at its step (0-3)
incident artifacts                   ``earlywarn/incidents/<n>_step<step>_<kind>.json`` (``Event.to_dict``)
checkpoint artifacts                 ``earlywarn/checkpoints/step_<step>.json``; with
                                     ``upload_checkpoints=True`` also the files under
                                     ``earlywarn/checkpoints/step_<step>/``
===================================  ============================================================

Where the work runs: in a child process (``process=True``, the default). MLflow's stores are
Python (SQLAlchemy for the embedded sqlite store: ~50 us of CPU per value, holding the GIL), so
in the training process they would slow the training thread down; the child takes them off the
GIL, runs at a lower CPU priority, and has its own HTTP settings (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
0 and ``MLFLOW_HTTP_REQUEST_TIMEOUT`` 10 s unless you set them: earlywarn retries with its own
backoff instead of MLflow's minutes of retries). The training process never imports mlflow for
this sink. If the training process dies, the child sees its pipe close, ends a run it created as
``KILLED`` and exits. ``process=False`` runs the same writer on the background thread instead.

Values MLflow cannot store: ``NaN`` is kept; ``+/-inf`` would be stored as ``+/-1.797e308``
(MLflow's stores clamp it), so earlywarn sends it as ``NaN``; ``earlywarn/grad_norm_finite``
and ``earlywarn/loss_finite`` (0/1) say which steps were non-finite.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from earlywarn.events import Event, Level
from earlywarn.metrics import sanitize_key
from earlywarn.sinks.base import METRIC_PREFIX, EventTally, PermanentSinkError, Redactor, Sink, SinkStarting, alert_line

_MAX_PER_BATCH = 1000  # the server's limit on values (metrics + tags) per log_batch
_MAX_TAG_VALUE = 5000
_PERMANENT_HTTP = (400, 401, 403, 404)
TAG_PREFIX = "earlywarn."


def unique_run_name(base: str | None = None) -> str:
    """``<base>-<YYYYmmdd-HHMMSS>-<4 hex>``: distinct for every run even when the training script
    seeded Python's ``random`` (a Hugging Face ``set_seed`` makes MLflow's own random names repeat).
    ``base`` defaults to the script's name."""
    if not base:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        base = os.path.splitext(script)[0] or "earlywarn"
        if base in ("-c", "-m", "__main__", "ipykernel_launcher"):
            base = "earlywarn"
    base = "".join(ch if (ch.isalnum() or ch in "-_.") else "-" for ch in str(base)).strip("-")[:60] or "earlywarn"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


# ---------------------------------------------------------------------------------------------
# The writer: the only code that talks to MLflow (in the child process, or in-process)
# ---------------------------------------------------------------------------------------------
class MlflowWriter:
    """Logs to one MLflow run through an explicit ``MlflowClient`` and run id (never the fluent
    API, whose active run is thread-local). Built from :class:`MlflowSink`'s options."""

    def __init__(self, options: Mapping[str, Any]):
        self.o = dict(options)
        self.client: Any = None
        self.run_id: str | None = self.o.get("run_id")
        self.owns_run = False
        self.finished = False
        self.tally = EventTally()
        self._incidents = 0
        self._keys: dict[str, str] = {}
        self._last_alert: str | None = None

    # -- lifecycle
    def start(self) -> dict[str, Any]:
        if self.client is not None:
            return self._info()
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Metric, RunTag

        # A new sqlite store announces its table creation at INFO on stderr: not news to the user
        # (set after the import, which configures mlflow's loggers).
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

        self._Metric, self._RunTag = Metric, RunTag
        uri = self.o.get("tracking_uri") or mlflow.get_tracking_uri()
        client = MlflowClient(tracking_uri=uri)
        base_tags = {TAG_PREFIX + "version": self.o.get("version", "unknown"), **self.o.get("tags", {})}
        if self.run_id is not None:
            run = self._call(client.get_run, self.run_id)
            tags = dict(base_tags)
            self.tally.restore_tags(run.data.tags, TAG_PREFIX)
            self._incidents = min(sum(self.tally.counts.values()), int(self.o.get("max_incident_artifacts", 1000)))
            if TAG_PREFIX + "status" not in run.data.tags:
                tags[TAG_PREFIX + "status"] = "ok"
            self._call(client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()],
                       synchronous=True)
            self.owns_run = bool(self.o.get("owns_run", False))
        else:
            exp_id = self._experiment_id(client)
            tags = {**base_tags, TAG_PREFIX + "status": "ok", TAG_PREFIX + "worst_level": "0"}
            run = self._call(client.create_run, exp_id, tags=tags, run_name=self.o.get("run_name") or unique_run_name())
            self.run_id = run.info.run_id
            self.owns_run = True
        self.o["tracking_uri"] = uri
        self.client = client
        return self._info()

    def _info(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "owns_run": self.owns_run, "tracking_uri": self.o.get("tracking_uri")}

    def _experiment_id(self, client: Any) -> str:
        name = self.o.get("experiment") or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        location = self.o.get("artifact_location")
        if not name:
            if os.environ.get("MLFLOW_EXPERIMENT_ID") or not location:
                return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
            # MLflow's Default experiment keeps its artifacts in <cwd>/mlruns, fixed when the store
            # was made: an artifact location needs an experiment of our own.
            name = "earlywarn"
        exp = self._call(client.get_experiment_by_name, name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self._call(client.create_experiment, name, artifact_location=location)
        except PermanentSinkError:  # created concurrently by another process
            exp = self._call(client.get_experiment_by_name, name)
            if exp is None:
                raise
            return exp.experiment_id

    def finish(self, status: str = "FINISHED") -> None:
        if self.finished or self.client is None:
            self.finished = True
            return
        if self.owns_run:
            self._call(self.client.set_terminated, self.run_id, status)
        self.finished = True

    @staticmethod
    def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args, **kwargs)
        except MlflowException as exc:
            if exc.get_http_status_code() in _PERMANENT_HTTP:
                raise PermanentSinkError(str(exc)[:1000]) from exc
            raise ConnectionError(str(exc)[:1000]) from exc

    def _key(self, key: str) -> str:
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = sanitize_key(key)
        return k

    # -- records
    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        Metric = self._Metric
        batch: list[Any] = []
        for step, metrics, t in records:
            ts = int(t * 1000)
            for key, value in metrics.items():
                v = float(value)
                if math.isinf(v):
                    v = math.nan  # MLflow would store +/-1.797e308; the *_finite flags say which
                batch.append(Metric(self._key(key), v, ts, int(step)))
        # A retry after a partial failure resends earlier chunks; MLflow ignores exact duplicates
        # (same key, value, timestamp, step), so nothing is counted twice.
        for i in range(0, len(batch), _MAX_PER_BATCH):
            self._call(self.client.log_batch, self.run_id, metrics=batch[i : i + _MAX_PER_BATCH], synchronous=True)

    def alert(self, event: Event) -> None:
        tally = self.tally.copy()  # kept only once the tags are written: a retry sends them again
        changed = tally.update(event)
        tags = {TAG_PREFIX + k: str(v) for k, v in changed.items()}
        last = alert_line(event)
        if last != self._last_alert:
            tags[TAG_PREFIX + "last_alert"] = last
        metric = self._Metric(METRIC_PREFIX + "incident_level", float(int(event.level)), int(event.time * 1000), event.step)
        self._call(self.client.log_batch, self.run_id, metrics=[metric],
                   tags=[self._RunTag(k, v[:_MAX_TAG_VALUE]) for k, v in tags.items()], synchronous=True)
        self.tally, self._last_alert = tally, last
        min_level = Level.parse(self.o.get("incident_min_level", Level.INFO))
        if event.level >= min_level and self._incidents < int(self.o.get("max_incident_artifacts", 1000)):
            name = sanitize_key(f"{self._incidents + 1:05d}_step{event.step}_{event.kind}")
            self._call(self.client.log_dict, self.run_id, event.to_dict(), f"earlywarn/incidents/{name}.json")
            self._incidents += 1

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        record: dict[str, Any] = {"step": int(step), "path": path, "reason": reason, "time": time.time()}
        uploaded = None
        if self.o.get("upload_checkpoints") and os.path.exists(path):
            uploaded = f"earlywarn/checkpoints/step_{int(step)}"
            if os.path.isdir(path):
                self._call(self.client.log_artifacts, self.run_id, path, uploaded)
            else:
                self._call(self.client.log_artifact, self.run_id, path, uploaded)
        record["artifact_path"] = uploaded
        tag = json.dumps({k: record[k] for k in ("step", "path", "reason")})[:_MAX_TAG_VALUE]
        self._call(self.client.set_tag, self.run_id, TAG_PREFIX + "last_checkpoint", tag)
        self._call(self.client.log_dict, self.run_id, record, f"earlywarn/checkpoints/step_{int(step)}.json")


# ---------------------------------------------------------------------------------------------
# Transports: the writer in a child process (default) or in this process
# ---------------------------------------------------------------------------------------------
_FRAME = struct.Struct("<I")


def _send(fh: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(_FRAME.pack(len(data)) + data)
    fh.flush()


def _recv(fh: Any) -> Any:
    head = fh.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError
    (n,) = _FRAME.unpack(head)
    data = fh.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def _error_reply(exc: BaseException) -> tuple:
    if isinstance(exc, PermanentSinkError):
        kind = "permanent"
    elif isinstance(exc, ImportError):
        kind = "import"
    elif isinstance(exc, (ValueError, TypeError)):
        kind = "value"
    elif isinstance(exc, OSError):
        kind = "transient"
    else:
        kind = "other"
    return ("err", kind, type(exc).__name__, str(exc)[:2000])


def _raise_reply(reply: tuple) -> None:
    _, kind, name, message = reply
    cls = {"permanent": PermanentSinkError, "import": ImportError, "value": ValueError,
           "transient": ConnectionError}.get(kind)
    if cls is None:
        raise RuntimeError(f"{name}: {message}")
    raise cls(message)


class _InProcess:
    def __init__(self, options: Mapping[str, Any]):
        self.writer = MlflowWriter(options)

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self.writer, op)(*args)

    def alive(self) -> bool:
        return True

    def close(self, kill: bool = False) -> None:
        pass


_BOOT = ("import json, os, sys; sys.path[:0] = [p for p in json.loads(os.environ.pop('_EARLYWARN_SYS_PATH', '[]')) "
         "if p not in sys.path]; from earlywarn.integrations.mlflow_sink import _child_main; _child_main()")


class _ChildProcess:
    """The writer in ``python -c <boot>``: pickled requests on its stdin, replies on its stdout."""

    def __init__(self, options: Mapping[str, Any], env: Mapping[str, str], redact: Any):
        child_env = dict(os.environ)
        for k, v in env.items():
            child_env.setdefault(k, v)
        child_env["_EARLYWARN_SYS_PATH"] = json.dumps([os.path.abspath(p) if p else os.getcwd() for p in sys.path])
        child_env["_EARLYWARN_REDACT"] = json.dumps(redact.pairs)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env,
            cwd=os.getcwd(), start_new_session=True,  # Ctrl-C in the terminal must not kill it mid-write
        )
        self._replies: queue.Queue = queue.Queue()
        self._ids = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="earlywarn-mlflow-replies", daemon=True).start()
        self._send(("init", dict(options)))

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            try:
                reply = _recv(out)
            except (EOFError, OSError, pickle.UnpicklingError, ValueError):
                self._replies.put(None)
                return
            self._replies.put(reply)

    def _send(self, msg: tuple) -> int:
        with self._lock:
            self._ids += 1
            rid = self._ids
            assert self.proc.stdin is not None
            _send(self.proc.stdin, (rid, *msg))
            return rid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        try:
            rid = self._send((op, args))
        except (BrokenPipeError, OSError) as exc:
            raise ConnectionError(f"the mlflow worker process is gone ({exc})") from None
        return self.wait(rid, timeout)

    def wait(self, rid: int, timeout: float | None) -> Any:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no answer from MLflow within {timeout:.0f} s")
            try:
                reply = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if reply is None:
                self._replies.put(None)  # keep answering "gone" to every waiter
                raise ConnectionError(f"the mlflow worker process exited (code {self.proc.poll()})")
            got, *rest = reply
            if got != rid:
                continue  # the answer to a request we stopped waiting for
            if rest[0] == "ok":
                return rest[1]
            _raise_reply(tuple(rest))

    def close(self, kill: bool = False) -> None:
        """EOF on its stdin: the child exits by itself (its work is acknowledged, so nobody waits
        for its interpreter to shut down). ``kill``: a child that stopped answering."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        if kill and self.proc.poll() is None:
            self.proc.kill()


class _RedactingStream:
    """The child's stderr: MLflow's log lines and warnings, with credentials masked."""

    def __init__(self, stream: Any, pairs: list):
        self._stream = stream
        self._redact = Redactor(tuple(p) for p in pairs)

    def write(self, text: str) -> int:
        return self._stream.write(self._redact(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _child_main() -> None:
    """Entry point of the child process (see :class:`_ChildProcess`)."""
    proto_in = sys.stdin.buffer
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the reply pipe
    pairs = json.loads(os.environ.pop("_EARLYWARN_REDACT", "[]"))
    sys.stderr = _RedactingStream(sys.stderr, pairs)  # before mlflow's loggers capture it
    sys.stdout = sys.stderr
    try:
        os.nice(10)  # the training process comes first
    except (AttributeError, OSError):
        pass
    writer: MlflowWriter | None = None
    while True:
        try:
            rid, op, *rest = _recv(proto_in)
        except (EOFError, OSError):
            break
        if op == "init":
            writer = MlflowWriter(rest[0])
            continue
        args = rest[0]
        try:
            assert writer is not None
            result = getattr(writer, op)(*args)
            reply: tuple = (rid, "ok", result)
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            reply = (rid, *_error_reply(exc))
        try:
            _send(proto_out, reply)
        except OSError:
            break
        if op == "finish":
            break
    # The training process went away without finishing: a run we created ends as KILLED.
    if writer is not None and writer.client is not None and not writer.finished and writer.owns_run:
        try:
            writer.finish("KILLED")
        except Exception:  # noqa: BLE001 - the tracker may be down; nothing more to do
            pass


# ---------------------------------------------------------------------------------------------
# The sink
# ---------------------------------------------------------------------------------------------
class MlflowSink(Sink):
    """Logs to an MLflow run: the active one, ``run_id``, or a new one it creates (and ends).

    ``tracking_uri`` defaults to the caller's ``mlflow.get_tracking_uri()`` when mlflow is
    imported, else ``$MLFLOW_TRACKING_URI``, else MLflow's default (the embedded
    ``sqlite:///<cwd>/mlflow.db`` that ``mlflow ui`` reads). ``experiment`` is a name (created
    if missing); without it the run goes where ``mlflow.start_run()`` would put it
    (``$MLFLOW_EXPERIMENT_NAME`` / ``_ID`` or Default). ``artifact_location`` (a URI): where a
    new experiment keeps its artifacts; with no experiment named, the run goes to an experiment
    ``earlywarn`` created there (the Default one's location is fixed when the store is made,
    ``<cwd>/mlruns`` for sqlite). ``run_name`` defaults to a unique
    ``<script>-<time>-<hex>`` (see :func:`unique_run_name`). A run this sink created ends as
    ``FINISHED``, ``FAILED`` after an ``earlywarn.Halt``, ``KILLED`` after SIGTERM.

    ``start_timeout`` bounds how long ``watch()`` waits for the tracker (then the sink keeps
    connecting in the background), ``down_timeout`` how long ``close()`` keeps retrying a tracker
    that is down; ``spool_path`` is a JSONL file for what could not be delivered by then
    (default: dropped, and said so). ``batch_interval`` seconds of metric steps go in one
    ``log_batch``.
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
        process: bool = True,
        start_timeout: float = 4.0,
        down_timeout: float = 3.0,
        request_timeout: float = 120.0,
        http_timeout: float = 10.0,
        batch_interval: float = 1.0,
        spool_path: str | os.PathLike | None = None,
        artifact_location: str | None = None,
    ):
        if not isinstance(max_incident_artifacts, int) or max_incident_artifacts < 0:
            raise ValueError(f"MlflowSink.max_incident_artifacts={max_incident_artifacts!r}: use an int >= 0")
        for field_name, value in (("start_timeout", start_timeout), ("down_timeout", down_timeout),
                                  ("request_timeout", request_timeout), ("http_timeout", http_timeout),
                                  ("batch_interval", batch_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"MlflowSink.{field_name}={value!r}: use a number of seconds >= 0")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.tags = dict(tags or {})
        self.upload_checkpoints = upload_checkpoints
        self.incident_min_level = Level.parse(incident_min_level)
        self.max_incident_artifacts = max_incident_artifacts
        self.process = bool(process)
        self.start_timeout = float(start_timeout)
        self.down_timeout = float(down_timeout)
        self.request_timeout = float(request_timeout)
        self.http_timeout = float(http_timeout)
        self.batch_interval = float(batch_interval)
        self.spool_path = spool_path
        self.artifact_location = artifact_location
        self.owns_run = False
        self._halted = False
        self._transport: Any = None
        self._start_rid: int | None = None
        self._started = False
        self._finished = False
        # MLflow's active run is thread-local and start() may run on a worker thread: look for the
        # caller's active run here. No import: if mlflow was never imported there is no active run.
        mlflow = sys.modules.get("mlflow")
        if mlflow is not None:
            if run_id is None:
                active = mlflow.active_run()
                if active is not None:
                    self.run_id = active.info.run_id
            if tracking_uri is None:
                self.tracking_uri = mlflow.get_tracking_uri()
        if self.tracking_uri is None:
            self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        self._redactor = Redactor.for_url(self.tracking_uri)

    def redact(self, text: str) -> str:
        return self._redactor(text)

    def _options(self) -> dict[str, Any]:
        return {
            "tracking_uri": self.tracking_uri, "experiment": self.experiment, "run_name": self.run_name,
            "run_id": self.run_id, "tags": self.tags, "upload_checkpoints": self.upload_checkpoints,
            "incident_min_level": int(self.incident_min_level), "max_incident_artifacts": self.max_incident_artifacts,
            "version": _version(), "owns_run": self.owns_run, "artifact_location": self.artifact_location,
        }

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Connect (spawning the writer process on the first call) and open the run. Waits at
        most ``start_timeout``; still connecting after that raises
        :class:`~earlywarn.sinks.base.SinkStarting` (the background wrapper then lets training go
        on and calls again)."""
        if self._started or self._finished:
            return
        if self._transport is None or not self._transport.alive():
            if importlib.util.find_spec("mlflow") is None:
                raise ImportError("the mlflow sink needs the 'mlflow' package: pip install mlflow")
            self._start_rid = None
            if self.process:
                env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(max(self.http_timeout, 1)))}
                self._transport = _ChildProcess(self._options(), env, self._redactor)
            else:
                self._transport = _InProcess(self._options())
        if isinstance(self._transport, _InProcess):
            info = self._transport.call("start")
        else:
            if self._start_rid is None:
                self._start_rid = self._transport._send(("start", ()))
            try:
                info = self._transport.wait(self._start_rid, self.start_timeout)
            except TimeoutError:
                raise SinkStarting(f"MLflow at {self.redact(str(self.tracking_uri or 'the default store'))} "
                                   f"did not answer within {self.start_timeout:g} s; still connecting") from None
            except BaseException:
                self._start_rid = None  # the next start() asks again
                raise
        self.run_id = info["run_id"]
        self.owns_run = bool(info["owns_run"])
        uri = info.get("tracking_uri")
        if uri and uri != self.tracking_uri:
            self.tracking_uri = uri
            self._redactor = Redactor(self._redactor.pairs + Redactor.for_url(uri).pairs)
        self._started = True

    def _request(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        if not self._started:
            self.start()
        try:
            return self._transport.call(op, *args, timeout=self.request_timeout if timeout is None else timeout)
        except TimeoutError:
            # The writer is stuck (a tracker that hangs): start a fresh one for the retry.
            self._restart()
            raise
        except ConnectionError:
            if not self._transport.alive():
                self._restart()
            raise

    def _restart(self) -> None:
        old, self._transport = self._transport, None
        self._started = False
        if old is not None:
            old.close(kill=True)
        # the next start() attaches to the same run (run_id, owns_run are in _options())

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        transport = self._transport
        if transport is None:
            return
        from earlywarn.sinks.background import signal_exit_code

        if signal_exit_code() is not None:
            status = "KILLED"  # SIGTERM: pre-empted
        elif self._halted:
            status = "FAILED"  # earlywarn.Halt stopped the run
        else:
            status = "FINISHED"
        try:
            if self._started:
                transport.call("finish", status, timeout=max(self.down_timeout, 1.0) + self.http_timeout)
        finally:
            transport.close()

    # ------------------------------------------------------------------ records
    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics_batch([(step, metrics, time.time())])

    def log_metrics_batch(self, records: Sequence[tuple[int, Mapping[str, float], float]]) -> None:
        self._request("log_metrics_batch", [(int(s), dict(m), float(t)) for s, m, t in records])

    def alert(self, event: Event) -> None:
        if str(event.kind) == "halt":
            self._halted = True
        self._request("alert", event)

    def checkpoint(self, step: int, path: str, reason: str) -> None:
        long = 3600.0 if self.upload_checkpoints else None  # uploading a large checkpoint takes time
        self._request("checkpoint", int(step), str(path), str(reason), timeout=long)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("earlywarn")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "unknown"
