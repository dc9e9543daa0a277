"""MLflow runs as analysis sources: ``mlflow:<tracking_uri>#<run_id>`` or
``mlflow:<tracking_uri>#experiment=<name>`` (every run of the experiment).

Each metric's full history is read with ``MlflowClient.get_metric_history`` (one call per key:
~30 ms per 1000 points through a server). Values are grouped into rows by step; a step logged
twice (a resumed run re-running steps) becomes two rows, ordered by timestamp, so the analyser
sees the resume. Incidents that earlywarn's MLflow sink stored as artifacts
(``earlywarn/incidents/*.json``) come back as logged events. The SDK is imported only here.

A tracking server that cannot be reached is said so at once (a TCP connect first, 5 s at most),
not after MLflow's own retries (7 by default, minutes in all): while reading, retries and the
request timeout are bounded unless ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``_TIMEOUT`` are set.
Messages never show the credentials of a URI.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.request
from collections import defaultdict
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

import numpy as np

from earlywarn.analyze.rawrun import AnalyzeError, RawRun, merge_adjacent_same_step
from earlywarn.events import Event
from earlywarn.sinks.base import strip_userinfo

INCIDENT_DIR = "earlywarn/incidents"
CONNECT_TIMEOUT = 5.0
READ_RETRIES = "2"
READ_TIMEOUT = "10"

scrub = strip_userinfo  # ``text`` with the ``user:password@`` of every URL in it removed


def _one_line(e: BaseException) -> str:
    return scrub(" ".join(str(e).split()))[:300] or type(e).__name__


def check_reachable(uri: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise AnalyzeError when the server of an http(s) tracking URI refuses or ignores a TCP
    connection (skipped behind a proxy: the proxy decides what is reachable)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise AnalyzeError(f"mlflow:{scrub(uri)}: bad port in the tracking URI") from None
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(host):
        return
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        if isinstance(e, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(e, (TimeoutError, socket.timeout)):
            why = f"no answer within {timeout:g} s"
        elif isinstance(e, socket.gaierror):
            why = f"unknown host {host!r}"
        else:
            why = e.strerror or type(e).__name__
        raise AnalyzeError(f"mlflow:{scrub(uri)}: cannot reach the MLflow tracking server at {host}:{port} ({why}); "
                           "start the server or fix the address") from None


@contextlib.contextmanager
def bounded_http() -> Iterator[None]:
    """MLflow's HTTP retries and timeout bounded while reading (the user's settings win)."""
    mine = {k: v for k, v in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", READ_RETRIES),
                              ("MLFLOW_HTTP_REQUEST_TIMEOUT", READ_TIMEOUT)) if k not in os.environ}
    os.environ.update(mine)
    try:
        yield
    finally:
        for k in mine:
            os.environ.pop(k, None)


def _not_found(e: BaseException) -> bool:
    return getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST" or (
        getattr(e, "get_http_status_code", lambda: None)() == 404)


def parse_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``mlflow:<uri>#<run_id>`` -> (uri, run_id, None); ``...#experiment=<name>`` -> (uri, None, name)."""
    body = spec[len("mlflow:"):]
    uri, sep, frag = body.rpartition("#")
    if not sep or not uri or not frag:
        raise AnalyzeError(f"{scrub(spec)}: use mlflow:<tracking_uri>#<run_id> or mlflow:<tracking_uri>#experiment=<name>")
    if frag.startswith("experiment="):
        name = frag[len("experiment="):]
        if not name:
            raise AnalyzeError(f"{scrub(spec)}: empty experiment name")
        return uri, None, name
    return uri, frag, None


def _client(uri: str):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise AnalyzeError("reading mlflow: runs needs the 'mlflow' package: pip install 'earlywarn[mlflow]'") from None
    if uri.startswith("sqlite:///"):
        db = uri[len("sqlite:///"):]
        if not os.path.isfile(db):
            # MLflow would silently create an empty database here
            raise AnalyzeError(f"mlflow:{uri}: no such database file {db}")
    check_reachable(uri)
    try:
        return MlflowClient(tracking_uri=uri)
    except Exception as e:
        raise AnalyzeError(f"mlflow:{scrub(uri)}: cannot open the tracking store ({type(e).__name__}: {_one_line(e)})") from None


def read_mlflow(spec: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    with bounded_http():
        return _read_mlflow(spec, key_map)


def _read_mlflow(spec: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    uri, run_id, experiment = parse_spec(spec)
    client = _client(uri)
    shown = scrub(spec)  # the source as printed: without credentials
    if run_id is not None:
        try:
            run = client.get_run(run_id)
        except Exception as e:
            what = "no such MLflow run" if _not_found(e) else "cannot read the MLflow run"
            raise AnalyzeError(f"{shown}: {what} ({type(e).__name__}: {_one_line(e)})") from None
        return [_guarded(read_run, client, run, shown, name="", source=shown)]
    try:
        exp = client.get_experiment_by_name(experiment)
    except Exception as e:
        raise AnalyzeError(f"{shown}: cannot look up the experiment ({type(e).__name__}: {_one_line(e)})") from None
    if exp is None:
        raise AnalyzeError(f"{shown}: no MLflow experiment named {experiment!r}")
    runs = []
    token = None
    while True:
        page = _guarded(client.search_runs, [exp.experiment_id], max_results=1000, page_token=token,
                        order_by=["attributes.start_time ASC"], source=shown)
        runs.extend(page)
        token = getattr(page, "token", None)
        if not token:
            break
    out = []
    for run in runs:
        if not run.data.metrics:
            continue  # a run that logged nothing (params only, or failed at start)
        name = f"{run.info.run_name or ''}/{run.info.run_id}".strip("/")
        out.append(_guarded(read_run, client, run, shown, name=name, source=shown))
    if not out:
        raise AnalyzeError(f"{shown}: no run of experiment {experiment!r} logged metrics (empty runs)")
    return out


def _guarded(fn: Any, *args: Any, source: str, **kwargs: Any) -> Any:
    """``fn(...)``, with a tracker failure midway (the server went away) as one AnalyzeError line."""
    from mlflow.exceptions import MlflowException

    try:
        return fn(*args, **kwargs)
    except MlflowException as e:
        raise AnalyzeError(f"{source}: reading from MLflow failed ({_one_line(e)})") from None


def read_run(client: Any, run: Any, source: str, name: str) -> RawRun:
    run_id = run.info.run_id
    keys = sorted(run.data.metrics)
    if not keys:
        raise AnalyzeError(f"{source}: the MLflow run logged no metrics (empty run)")
    # (step, k-th time this step was logged for this key) identifies one row
    cells: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    first_time: dict[tuple[int, int], int] = {}
    repeated = False
    for key in keys:
        hist = client.get_metric_history(run_id, key)
        hist = sorted(hist, key=lambda m: (m.timestamp, m.step))
        seen: dict[int, int] = defaultdict(int)
        for m in hist:
            occ = seen[m.step]
            seen[m.step] += 1
            repeated |= occ > 0
            rid = (int(m.step), occ)
            cells[rid][key] = float(m.value)
            t = int(m.timestamp)
            if rid not in first_time or t < first_time[rid]:
                first_time[rid] = t
    if not cells:
        raise AnalyzeError(f"{source}: the MLflow run holds no metric values (empty run)")
    if repeated:
        # a step logged twice: the run was resumed; logging order tells which came first
        order = sorted(cells, key=lambda rid: (first_time[rid], rid[0], rid[1]))
    else:
        order = sorted(cells)  # no resume: step order (timestamps of batched logs may tie)
    n = len(order)
    step = np.fromiter((rid[0] for rid in order), dtype=np.int64, count=n)
    cols = {k: np.full(n, np.nan) for k in keys}
    miss = {k: np.ones(n, dtype=bool) for k in keys}
    for i, rid in enumerate(order):
        for k, v in cells[rid].items():
            cols[k][i] = v
            miss[k][i] = False
    notes: list[str] = []
    step, cols, miss, merged = merge_adjacent_same_step(step, cols, miss)
    raw = RawRun(source, name, "mlflow", step, cols, miss, notes=notes)
    raw.events = _incident_events(client, run_id)
    return raw


def _incident_events(client: Any, run_id: str) -> list[Event]:
    """Events earlywarn's MLflow sink stored as JSON artifacts (best effort: none if unreadable)."""
    try:
        arts = client.list_artifacts(run_id, INCIDENT_DIR)
    except Exception:
        return []
    events = []
    for a in arts:
        if a.is_dir or not a.path.endswith(".json"):
            continue
        try:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                local = client.download_artifacts(run_id, a.path, tmp)
                with open(local, encoding="utf-8") as fh:
                    events.append(Event.from_dict(json.load(fh)))
        except Exception:
            continue
    events.sort(key=lambda e: e.step)
    return events
