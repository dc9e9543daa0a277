"""The MLflow sink against a real ``mlflow server`` (killed and restarted mid-run) and against the
embedded sqlite store; everything is read back with ``MlflowClient``."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import pytest

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from earlywarn.events import Event, Kind, Level  # noqa: E402
from earlywarn.integrations.mlflow_sink import MlflowSink  # noqa: E402
from earlywarn.metrics import MetricsConfig, build_metrics  # noqa: E402
from earlywarn.sinks.background import BackgroundSink  # noqa: E402
from earlywarn.sinks.defaults import build_sinks, default_sink_specs  # noqa: E402
from fixtures_trackers import copy_mlflow_db  # noqa: E402

LAYERS = [f"blocks.{i}.attn.qkv" for i in range(20)]
CFG = MetricsConfig(layer_every=5)
pytestmark = pytest.mark.filterwarnings("ignore:.*noload.*:DeprecationWarning")  # inside mlflow's store

FAST = {"backoff_initial": 0.2, "backoff_max": 1.0, "exit_on_sigterm": False}


def step_metrics(step: int, level: int = 0) -> dict[str, float]:
    norms = np.linspace(0.1, 2.0, len(LAYERS)) * (1 + step / 100)
    return build_metrics(
        step, grad_norm=1.0 + step, loss=3.0 - step / 100, layer_names=LAYERS, layer_norms=norms,
        score=0.1 * level, level=level, counters={"skipped_steps": step // 10}, config=CFG,
    )


def history_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def read_json_artifact(client: MlflowClient, run_id: str, path: str, tmp_path) -> dict:
    local = client.download_artifacts(run_id, path, str(tmp_path))
    with open(local) as fh:
        return json.load(fh)


def test_server_killed_mid_run_training_goes_on_and_buffered_data_arrives(mlflow_server, monkeypatch, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    # Make MLflow's own HTTP retries short so the outage is noticed within seconds.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    (sink,) = build_sinks(
        ["mlflow"], {"mlflow": {"tracking_uri": mlflow_server.uri, "experiment": "outage", "run_name": "kill-test"}},
        background_options=FAST, start_timeout=60,
    )
    assert isinstance(sink, BackgroundSink) and sink.stats()["state"] == "running"
    run_id = sink.inner.run_id
    for step in range(10):
        sink.log_metrics(step, step_metrics(step))
    assert sink.flush(30)

    mlflow_server.stop()  # SIGKILL, mid-run
    times = []
    for step in range(10, 40):
        t0 = time.perf_counter()
        level = 3 if step == 27 else 0
        sink.log_metrics(step, step_metrics(step, level))
        if level:
            sink.alert(Event(step=step, kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL,
                             message="inf gradient in blocks.7.attn.qkv", layers=("blocks.7.attn.qkv",)))
        if step == 30:
            sink.checkpoint(step, "/ckpt/step30.pt", "critical")
        times.append(time.perf_counter() - t0)
        time.sleep(0.01)  # the rest of a training step
    end = time.monotonic() + 30
    while sink.stats()["failures"] == 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert sink.stats()["failures"] >= 1, "the sink never noticed the server was down"
    assert max(times) < 0.25, max(times)  # training never waited on the dead server (a call times out in 5 s)
    assert sink.pending() > 0
    assert not sink.flush(0.5)
    assert sum("failed to" in r.getMessage() for r in caplog.records) == 1  # warned once

    mlflow_server.start()  # same port, same database
    assert sink.flush(60), sink.stats()
    st = sink.stats()
    sink.finish()
    assert st["dropped_records"] == 0 and st["dropped_events"] == 0

    client = MlflowClient(mlflow_server.uri)
    assert history_steps(client, run_id, "earlywarn/grad_norm") == list(range(40))
    assert history_steps(client, run_id, "earlywarn/layer_grad_norm/blocks.0.attn.qkv") == sorted([*range(0, 40, 5), 27])  # + the alert step
    assert history_steps(client, run_id, "earlywarn/alert_level") == list(range(40))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["earlywarn.status"] == "critical"
    assert "nonfinite_grad" in run.data.tags["earlywarn.last_alert"]
    assert json.loads(run.data.tags["earlywarn.last_checkpoint"]) == {"step": 30, "path": "/ckpt/step30.pt", "reason": "critical"}
    (incident,) = client.list_artifacts(run_id, "earlywarn/incidents")
    body = read_json_artifact(client, run_id, incident.path, tmp_path)
    assert body["step"] == 27 and body["layers"] == ["blocks.7.attn.qkv"] and body["level"] == "critical"
    assert [m.step for m in client.get_metric_history(run_id, "earlywarn/incident_level")] == [27]


def test_embedded_store_metrics_tags_artifacts(mlflow_sqlite_uri, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"weights")
    sink = MlflowSink(tracking_uri=mlflow_sqlite_uri, experiment="embedded", run_name="r1", upload_checkpoints=True,
                      start_timeout=60)  # the writer process may take seconds to start on a busy host
    sink.start()
    sink.start()
    sink.log_metrics_batch([(s, step_metrics(s), 1_700_000_000.0 + s) for s in range(12)])
    sink.log_metrics(12, {"earlywarn/grad_norm": float("nan"), "earlywarn/loss": float("inf"), "bad key [x]": 1.0})
    sink.alert(Event(step=6, kind=Kind.GRAD_SPIKE, level=Level.WARNING, message="spike", layers=("blocks.3.attn.qkv",)))
    sink.alert(Event(step=7, kind=Kind.SKIP, level=Level.INFO, message="skipped step 7"))
    sink.checkpoint(8, str(ckpt), "warning")
    sink.finish()
    sink.finish()

    client = MlflowClient(mlflow_sqlite_uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    hist = sorted(client.get_metric_history(sink.run_id, "earlywarn/grad_norm"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(13))
    assert hist[0].timestamp == 1_700_000_000_000  # the time it was logged, not the time it was sent
    assert np.isnan(hist[-1].value)
    assert run.data.metrics["bad key _x_"] == 1.0  # sanitised, not rejected
    assert run.data.metrics["earlywarn/skipped_steps"] == 1.0
    assert run.data.tags["earlywarn.status"] == "warning"  # worst so far, not the last INFO
    assert run.data.tags["earlywarn.last_alert"].startswith("earlywarn info: skip")
    incidents = [a.path for a in client.list_artifacts(sink.run_id, "earlywarn/incidents")]
    assert incidents == ["earlywarn/incidents/00001_step6_grad_spike.json", "earlywarn/incidents/00002_step7_skip.json"]
    uploaded = [a.path for a in client.list_artifacts(sink.run_id, "earlywarn/checkpoints/step_8")]
    assert uploaded == ["earlywarn/checkpoints/step_8/model.pt"]
    record = read_json_artifact(client, sink.run_id, "earlywarn/checkpoints/step_8.json", tmp_path)
    assert record["reason"] == "warning" and record["artifact_path"] == "earlywarn/checkpoints/step_8"


def test_attaches_to_the_active_run_and_leaves_it_open(mlflow_sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite_uri)
    with mlflow.start_run(run_name="user-run") as run:
        mlflow.log_metric("user/loss", 1.0, step=0)
        (sink,) = build_sinks(["mlflow"], {"mlflow": {"start_timeout": 60}}, background_options=FAST)
        sink.log_metrics(0, step_metrics(0))
        sink.alert(Event(step=0, kind=Kind.GRAD_SPIKE, level=Level.WARNING, message="spike"))
        sink.finish()
        assert sink.inner.run_id == run.info.run_id and not sink.inner.owns_run
        assert mlflow.active_run().info.run_id == run.info.run_id
        assert MlflowClient().get_run(run.info.run_id).info.status == "RUNNING"
    data = MlflowClient().get_run(run.info.run_id).data
    assert {"user/loss", "earlywarn/grad_norm"} <= set(data.metrics) and data.tags["earlywarn.status"] == "warning"


def test_no_sinks_configured_goes_to_embedded_mlflow_and_jsonl(mlflow_template_db, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "EARLYWARN_SINKS", "EARLYWARN_OUTPUT_DIR", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)
    # pre-migrated, so the test skips the ~6 s of migrations a first run does
    (tmp_path / "earlywarn_output").mkdir()  # default files go there
    copy_mlflow_db(mlflow_template_db, tmp_path / "earlywarn_output" / "mlflow.db", tmp_path / "mlruns")
    assert default_sink_specs() == ["console", "jsonl", "mlflow"]
    sinks = build_sinks(None, background_options=FAST)
    assert [s.name for s in sinks] == ["console", "jsonl", "mlflow"]
    for s in sinks:
        s.log_metrics(3, step_metrics(3))
        s.alert(Event(step=3, kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message="escalating"))
        s.finish()
    client = MlflowClient(f"sqlite:///{tmp_path / 'earlywarn_output' / 'mlflow.db'}")
    run = client.get_run(sinks[2].inner.run_id)
    assert run.data.metrics["earlywarn/grad_norm"] == 4.0 and run.data.tags["earlywarn.status"] == "warning"
    lines = [json.loads(line) for line in (tmp_path / "earlywarn_output" / "events.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "event" and lines[0]["kind"] == "collapse_risk"
    # incident artifacts live beside the store, not in ./mlruns (no stray files in the working directory)
    assert run.info.artifact_uri.startswith((tmp_path / "earlywarn_output" / "mlruns").as_uri())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlywarn_output"]


def test_unknown_run_id_is_dropped_by_build_sinks(mlflow_sqlite_uri, caplog):
    caplog.set_level(logging.WARNING, logger="earlywarn.sinks")
    sinks = build_sinks(["mlflow"], {"mlflow": {"tracking_uri": mlflow_sqlite_uri, "run_id": "0" * 32, "start_timeout": 60}},
                        background_options=FAST)
    assert sinks == []
    assert any("failed to start" in r.getMessage() for r in caplog.records)


def test_run_ended_by_sigterm_is_marked_killed(mlflow_sqlite_uri, monkeypatch):
    import earlywarn.sinks.sigterm as background

    sink = MlflowSink(tracking_uri=mlflow_sqlite_uri, start_timeout=60)
    sink.start()
    monkeypatch.setattr(background, "_signal_exit_code", 143)  # what the SIGTERM handler records
    sink.finish()
    assert MlflowClient(mlflow_sqlite_uri).get_run(sink.run_id).info.status == "KILLED"


@pytest.mark.parametrize("store", ["server", "sqlite"])
def test_what_mlflow_stores_for_non_finite_values(store, request):
    """MLflow keeps NaN but clamps +/-inf to +/-1.797e308 (checked here on a raw log_batch);
    earlywarn sends inf as NaN and logs the finite flags that rules use."""
    from mlflow.entities import Metric

    uri = request.getfixturevalue("mlflow_server").uri if store == "server" else request.getfixturevalue("mlflow_sqlite_uri")
    client = MlflowClient(uri)
    raw = client.create_run("0")
    client.log_batch(raw.info.run_id, metrics=[Metric("x", v, 0, i) for i, v in enumerate([math.nan, math.inf, -math.inf])])
    stored = [m.value for m in sorted(client.get_metric_history(raw.info.run_id, "x"), key=lambda m: m.step)]
    assert math.isnan(stored[0]) and stored[1] == 1.7976931348623157e308 and stored[2] == -1.7976931348623157e308

    sink = MlflowSink(tracking_uri=uri, start_timeout=60)
    sink.start()
    for step, g in enumerate([1.0, math.nan, math.inf, -math.inf]):
        sink.log_metrics(step, build_metrics(step, grad_norm=g, loss=g, layer_names=None, layer_norms=None,
                                             score=0.0, level=3 * (step > 0), counters={}))
    sink.finish()
    hist = {k: [m.value for m in sorted(client.get_metric_history(sink.run_id, k), key=lambda m: m.step)]
            for k in ("earlywarn/grad_norm", "earlywarn/grad_norm_finite", "earlywarn/loss_finite")}
    assert hist["earlywarn/grad_norm"][0] == 1.0 and all(math.isnan(v) for v in hist["earlywarn/grad_norm"][1:])
    assert hist["earlywarn/grad_norm_finite"] == [1.0, 0.0, 0.0, 0.0] == hist["earlywarn/loss_finite"]


def test_every_checkpoint_is_counted_and_recorded(mlflow_sqlite_uri, tmp_path, monkeypatch):
    import earlywarn
    from earlywarn.events import Kind
    from tracker_scenario import run_scenario

    monkeypatch.chdir(tmp_path)
    recovery = earlywarn.RecoveryConfig(snapshot_every=10, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10)
    scn = run_scenario(["mlflow"], {"mlflow": {"tracking_uri": mlflow_sqlite_uri, "start_timeout": 60, "batch_interval": 0.2}},
                       recovery=recovery, steps=50)
    scn.watcher.close()
    ckpts = [e for e in scn.events if e.kind is Kind.CHECKPOINT]
    reasons = [e.signal for e in ckpts]
    assert "periodic" in reasons and "warning" in reasons, reasons
    assert scn.watcher.counters["checkpoints"] == len(ckpts)
    assert [(s, r) for s, _, r in scn.recorder.checkpoints] == [(e.step, e.signal) for e in ckpts]
    assert all(os.path.isfile(p) for _, p, _ in scn.recorder.checkpoints)
    counted = [m["earlywarn/checkpoints"] for _, m in scn.recorder.rows]
    assert counted == sorted(counted) and counted[-1] == len(ckpts)
    for (step, m) in scn.recorder.rows:  # a row counts every checkpoint of the steps before it
        assert m["earlywarn/checkpoints"] >= sum(e.step < step for e in ckpts)

    (sink,) = [s for s in scn.watcher.sinks if s.name == "mlflow"]
    client = MlflowClient(mlflow_sqlite_uri)
    run = client.get_run(sink.inner.run_id)
    step, path, reason = scn.recorder.checkpoints[-1]
    assert json.loads(run.data.tags["earlywarn.last_checkpoint"]) == {"step": step, "path": path, "reason": reason}
    stored = {a.path for a in client.list_artifacts(sink.inner.run_id, "earlywarn/checkpoints")}
    assert stored == {f"earlywarn/checkpoints/step_{s}.json" for s, _, _ in scn.recorder.checkpoints}
    assert run.data.metrics["earlywarn/checkpoints"] == len(ckpts)


def test_tracking_uri_from_the_environment(mlflow_sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite_uri)
    (sink,) = build_sinks(["mlflow"], {"mlflow": {"start_timeout": 60}}, background_options=FAST)
    sink.log_metrics(0, step_metrics(0))
    sink.finish()
    run = MlflowClient(mlflow_sqlite_uri).get_run(sink.inner.run_id)
    assert run.data.metrics["earlywarn/grad_norm"] == 1.0 and run.info.status == "FINISHED"


def test_run_names_differ_even_when_the_script_seeds_random(mlflow_sqlite_uri):
    import random

    names = []
    for _ in range(3):
        random.seed(42)  # what transformers.set_seed does; MLflow's own random names would repeat
        sink = MlflowSink(tracking_uri=mlflow_sqlite_uri, start_timeout=60, process=False)
        sink.start()
        sink.finish()
        names.append(MlflowClient(mlflow_sqlite_uri).get_run(sink.run_id).info.run_name)
    assert len(set(names)) == 3, names


def test_hugging_face_trainer_runs_get_distinct_names(mlflow_sqlite_uri, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.arange(8) % 50
            return {"input_ids": ids, "labels": ids}

    monkeypatch.chdir(tmp_path)
    names = {}
    for run_name in (None, None, "named-run"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, run_name=run_name)
        cb = EarlywarnTrainerCallback(sinks=["mlflow"], sink_options={"mlflow": {
            "tracking_uri": mlflow_sqlite_uri, "start_timeout": 60}})
        transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[cb]).train()
        (sink,) = cb.watcher.sinks
        names[sink.inner.run_id] = MlflowClient(mlflow_sqlite_uri).get_run(sink.inner.run_id).info.run_name
    assert len(set(names.values())) == 3, names
    assert "named-run" in names.values()  # a name the user gave is kept as given


KILLED_SCRIPT = """
import os, signal, sys
from earlywarn.integrations.mlflow_sink import MlflowSink
sink = MlflowSink(tracking_uri=sys.argv[1], start_timeout=60)
sink.start()
sink.log_metrics(0, {"earlywarn/grad_norm": 1.0})
print(sink.run_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the training process dies without finishing anything
"""


def test_training_process_killed_the_writer_ends_the_run_as_killed(mlflow_sqlite_uri, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(KILLED_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mlflow_sqlite_uri], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    run_id = proc.stdout.split()[0]
    client = MlflowClient(mlflow_sqlite_uri)
    end = time.monotonic() + 60
    while client.get_run(run_id).info.status == "RUNNING" and time.monotonic() < end:
        time.sleep(0.2)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.metrics["earlywarn/grad_norm"] == 1.0  # what was handed over before the kill arrived
