"""Round trips through the real tracker SDKs: write a run with MLflow / W&B (offline) / TensorBoard,
then analyse it. The hosted W&B path runs against a stand-in for ``wandb.Api``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from earlywarn.analyze import AnalyzeError, analyze
from earlywarn.events import Event, Kind, Level


def series(n=200, start=150, seed=0):
    """Calm, then the grad norm grows x3 per step for 5 steps (layer blocks.1 first), then the loss jumps."""
    rng = np.random.default_rng(seed)
    g = 0.2 * np.exp(rng.normal(0, 0.04, n))
    layers = np.stack([g / 2, g / 3], axis=1) * np.exp(rng.normal(0, 0.03, (n, 2)))
    loss = 2.5 + rng.normal(0, 0.01, n)
    for k in range(5):
        g[start + k] = 0.2 * 3.0 ** (k + 1)
        layers[start + k, 1] = (0.2 / 3) * 3.5 ** (k + 1)
    loss[start + 5:] = 6.0
    return loss, g, layers


def check_escalation(r, start=150):
    (inc,) = r.incidents
    assert inc.collapse_step == start + 5, [str(a) for a in r.alerts]
    assert inc.first_warning_step is not None and start <= inc.first_warning_step < start + 5
    assert inc.lead_steps >= 1


# ---------------------------------------------------------------------------------------------
# MLflow (embedded sqlite store, real SDK)
# ---------------------------------------------------------------------------------------------


def test_mlflow_run_and_experiment_round_trip(mlflow_sqlite_uri, tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(mlflow_sqlite_uri)
    exp = client.create_experiment("ew-analyze", artifact_location=(tmp_path / "artifacts").as_uri())
    loss, g, layers = series()
    now = int(time.time() * 1000)

    def log(run_id, steps, t0):
        batch = []
        for k, s in enumerate(steps):
            t = t0 + k
            batch += [Metric("loss", float(loss[s]), t, int(s)), Metric("grad_norm", float(g[s]), t, int(s)),
                      Metric("grad_norm/blocks.0", float(layers[s, 0]), t, int(s)),
                      Metric("grad_norm/blocks.1", float(layers[s, 1]), t, int(s))]
        for i in range(0, len(batch), 1000):
            client.log_batch(run_id, metrics=batch[i:i + 1000])

    a = client.create_run(exp, run_name="diverges").info.run_id
    log(a, range(200), now)
    client.log_dict(a, Event(step=152, kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message="seen live").to_dict(),
                    "earlywarn/incidents/1_step152_collapse_risk.json")
    b = client.create_run(exp, run_name="resumed").info.run_id
    log(b, range(120), now)
    log(b, range(100, 140), now + 10_000)  # resumed from a checkpoint at step 100
    client.log_metric(b, "loss", float("nan"), now + 20_000, 140)

    report = analyze([f"mlflow:{mlflow_sqlite_uri}#{a}"])
    (r,) = report.runs
    assert r.format == "mlflow" and r.steps == 200
    check_escalation(r)
    assert r.incidents[0].first_layer == "blocks.1"
    assert [e.message for e in r.logged_events] == ["seen live"]

    report = analyze([f"mlflow:{mlflow_sqlite_uri}#experiment=ew-analyze"])
    assert [x.run for x in report.runs] == [f"diverges/{a}", f"resumed/{b}"]
    rb = report.runs[1]
    assert rb.resumes == [{"step": 100, "previous_step": 119, "overlap_steps": 20,
                           "detector_restored_from_step": rb.resumes[0]["detector_restored_from_step"]}]
    assert any(x.kind == Kind.LOSS_NONFINITE and x.step == 140 for x in rb.alerts)

    with pytest.raises(AnalyzeError, match="no such MLflow run"):
        analyze([f"mlflow:{mlflow_sqlite_uri}#0123456789abcdef"])
    with pytest.raises(AnalyzeError, match="no MLflow experiment named 'nope'"):
        analyze([f"mlflow:{mlflow_sqlite_uri}#experiment=nope"])
    with pytest.raises(AnalyzeError, match="no such database file"):
        analyze([f"mlflow:sqlite:///{tmp_path}/missing.db#{a}"])
    with pytest.raises(AnalyzeError, match="use mlflow:<tracking_uri>#<run_id>"):
        analyze([f"mlflow:{mlflow_sqlite_uri}"])


# ---------------------------------------------------------------------------------------------
# W&B offline (real SDK) and hosted (stand-in Api)
# ---------------------------------------------------------------------------------------------


def test_wandb_offline_run_round_trip(wandb_env):
    wandb = pytest.importorskip("wandb")

    loss, g, layers = series()
    run = wandb.init(project="ew-analyze", mode="offline")
    for s in range(200):
        row = {"loss": float(loss[s]), "grad_norm": float(g[s])}
        if s % 10 == 0 or s >= 150:
            row.update({"grad_norm/blocks.0": float(layers[s, 0]), "grad_norm/blocks.1": float(layers[s, 1])})
        if s == 60:
            row["grad_norm"] = float("inf")
        run.log(row, step=s)
    run.alert(title="earlywarn warning: collapse_risk in blocks.1", text="step 151: escalating", level=wandb.AlertLevel.WARN)
    run.finish()
    wandb.teardown()

    report = analyze([str(wandb_env)])
    (r,) = report.runs
    assert r.format == "wandb-offline" and r.steps == 200
    check_escalation(r)
    assert any(a.kind in (Kind.NONFINITE_GRAD,) and a.step == 60 for a in r.alerts)
    (ev,) = r.logged_events
    assert (ev.step, ev.level, ev.kind) == (151, Level.WARNING, Kind.COLLAPSE_RISK)
    # the run directory and the .wandb file itself work too
    (run_dir,) = [p for p in (wandb_env / "wandb").iterdir() if p.name.startswith("offline-run-")]
    (wfile,) = list(run_dir.glob("*.wandb"))
    assert analyze([str(run_dir)]).runs[0].steps == 200
    assert analyze([str(wfile)]).runs[0].steps == 200


def test_wandb_offline_resumed_run_is_one_run_with_a_resume(wandb_env):
    wandb = pytest.importorskip("wandb")
    run = wandb.init(project="ew-analyze", id="resumed1", mode="offline")
    for s in range(50):
        run.log({"loss": 2.0, "grad_norm": 0.2}, step=s)
    run.finish()
    time.sleep(1.1)  # offline-run-<second>-<id>: the resumed directory sorts after the first
    run = wandb.init(project="ew-analyze", id="resumed1", mode="offline", resume="allow")
    for s in range(40, 60):
        run.log({"loss": 2.0, "grad_norm": 0.2}, step=s)
    run.finish()
    wandb.teardown()
    (r,) = analyze([str(wandb_env)]).runs
    assert r.steps == 70
    assert r.resumes == [{"step": 40, "previous_step": 49, "overlap_steps": 10, "detector_restored_from_step": 39}]


class _FakeRun:
    def __init__(self, rows, id_="abc123", name="diverges"):
        self._rows, self.id, self.name = rows, id_, name

    def scan_history(self, page_size=1000):
        yield from (dict(r) for r in self._rows)

    def history(self, *a, **k):  # pragma: no cover - the reader must not use the sampled history
        raise AssertionError("history() samples 500 rows: use scan_history()")


class _FakeApi:
    def __init__(self, runs):
        self._runs = runs

    def run(self, path):
        for r in self._runs:
            if path.endswith("/" + r.id):
                return r
        raise ValueError(f"Could not find run {path}")

    def runs(self, path):
        return list(self._runs)


def test_wandb_api_path_uses_scan_history(monkeypatch):
    from earlywarn.integrations import wandb_source

    loss, g, _ = series(n=800, start=750)
    rows = [{"_step": s, "_timestamp": 1.0 * s, "_runtime": 1.0, "train/loss": float(loss[s]),
             "train/grad_norm": float(g[s]), "train/global_step": s * 4} for s in range(800)]
    api = _FakeApi([_FakeRun(rows), _FakeRun(rows[:100], id_="zzz", name="short")])
    monkeypatch.setattr(wandb_source, "api_factory", lambda: api)
    (r,) = analyze(["wandb:team/proj/abc123"]).runs
    assert r.format == "wandb" and r.steps == 800  # every row: scan_history, not the 500-row sample
    assert r.keys["loss"] == "train/loss" and r.first_step == 0 and r.last_step == 799 * 4
    fw = r.first_warning
    assert fw is not None and 750 * 4 <= fw.step < 755 * 4
    both = analyze(["wandb:team/proj"]).runs
    assert [x.run for x in both] == ["diverges/abc123", "short/zzz"]
    with pytest.raises(AnalyzeError, match="cannot open the W&B run"):
        analyze(["wandb:team/proj/missing"])
    with pytest.raises(AnalyzeError, match="use wandb:<entity>/<project>/<run_id>"):
        analyze(["wandb:just-one-part"])


# ---------------------------------------------------------------------------------------------
# TensorBoard (tensorboard's own writer), past the 10k-scalar default of EventAccumulator
# ---------------------------------------------------------------------------------------------


def test_tensorboard_round_trip_beyond_10k_scalars_with_restart(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    def simple(tag, x):  # torch SummaryWriter / tensorboardX style
        return summary_pb2.Summary.Value(tag=tag, simple_value=x)

    def tensor(tag, x):  # TF2 tf.summary.scalar style
        t = tensor_pb2.TensorProto(dtype=1, tensor_shape=tensor_shape_pb2.TensorShapeProto(), float_val=[x])
        return summary_pb2.Summary.Value(tag=tag, tensor=t)

    n, start = 10_200, 10_100
    loss, g, layers = series(n=n, start=start)
    logdir = tmp_path / "tb" / "run1"
    t0 = time.time()

    def write(steps, t):
        w = EventFileWriter(str(logdir))
        for s in steps:
            vals = [simple("loss", float(loss[s])), tensor("grad_norm", float(g[s]))]
            if s >= 10_000:
                vals += [simple("grad_norm/blocks.0", float(layers[s, 0])), simple("grad_norm/blocks.1", float(layers[s, 1]))]
            w.add_event(event_pb2.Event(step=s, wall_time=t + s, summary=summary_pb2.Summary(value=vals)))
        w.close()

    write(range(10_050), t0)
    write(range(10_000, n), t0 + 1e5)  # the job restarted from a checkpoint at step 10,000

    report = analyze([str(tmp_path / "tb")])
    (r,) = report.runs
    assert r.format == "tensorboard"
    assert r.steps == 10_050 + (n - 10_000)  # no 10k cap, the overlap kept
    assert r.resumes[0]["step"] == 10_000 and r.resumes[0]["overlap_steps"] == 50
    check_escalation(r, start)
    assert r.incidents[0].first_layer == "blocks.1"
    first = min(logdir.glob("*tfevents*"), key=lambda p: p.stat().st_size)
    assert analyze([str(first)]).runs[0].steps == n - 10_000


def test_tensorboard_from_torch_summary_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    loss, g, layers = series()
    w = SummaryWriter(str(tmp_path / "tb"))
    for s in range(200):
        w.add_scalar("train/loss", float(loss[s]), s)
        w.add_scalar("train/grad_norm", float(g[s]), s)
        w.add_scalars("grad_norm", {"blocks.0": float(layers[s, 0])}, s)  # a sub-run directory
    w.close()
    report = analyze([str(tmp_path / "tb")], select="")
    main = [r for r in report.runs if r.run in ("", ".")]
    (r,) = main
    assert r.keys["loss"] == "train/loss" and r.steps == 200
    check_escalation(r)
