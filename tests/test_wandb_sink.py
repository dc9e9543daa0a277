"""The W&B sink with the real SDK in offline mode; each run is read back from its ``.wandb`` file
(history, summary, alerts, metric definitions, artifacts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

wandb = pytest.importorskip("wandb")

from earlywarn.events import Event, Kind, Level  # noqa: E402
from earlywarn.integrations.wandb_offline_reader import (  # noqa: E402
    WandbFileError,
    iter_raw_records,
    read_offline_run,
)
from earlywarn.integrations.wandb_sink import WandbSink, alert_title  # noqa: E402
from earlywarn.metrics import MetricsConfig, build_metrics  # noqa: E402
from earlywarn.sinks.background import BackgroundSink  # noqa: E402
from earlywarn.sinks.defaults import build_sinks  # noqa: E402
from fixtures_trackers import wandb_env_vars  # noqa: E402

LAYERS = [f"h.{i}.mlp.c_fc" for i in range(12)]
FAST = {"backoff_initial": 0.05, "exit_on_sigterm": False}


def step_metrics(step: int, level: int = 0) -> dict[str, float]:
    return build_metrics(
        step, grad_norm=0.5 + step, loss=4.0, layer_names=LAYERS, layer_norms=np.full(len(LAYERS), 0.1 * step),
        score=float(level), level=level, counters={"rewinds": 1 if step >= 20 else 0},
        config=MetricsConfig(layer_every=10),
    )


def run_folder(run) -> Path:
    return Path(run.dir).parent  # .../offline-run-<time>-<id>/files -> the run folder


def spike(step: int, level: Level = Level.WARNING, layer: str = "h.3.mlp.c_fc") -> Event:
    return Event(step=step, kind=Kind.GRAD_SPIKE, level=level, message=f"spike at {step}", layers=(layer,),
                 values={"ratio": 8.5}, time=1000.0 + step)


def test_owned_offline_run_history_summary_alerts(wandb_env, tmp_path):
    ckpt = tmp_path / "step25.pt"
    ckpt.write_bytes(b"weights")
    (sink,) = build_sinks(["wandb"], {"wandb": {"project": "earlywarn-test", "upload_checkpoints": True}},
                          background_options=FAST, start_timeout=60)
    assert isinstance(sink, BackgroundSink)
    for step in range(30):
        level = 2 if step in (12, 13) else 3 if step == 17 else 0
        sink.log_metrics(step, step_metrics(step, level))
    sink.alert(spike(12))
    sink.alert(spike(13))  # same kind and layer within the wait: held back
    sink.alert(spike(14, Level.INFO))  # below alert_min_level: summary only
    sink.alert(Event(step=17, kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL, message="NaN gradient", layers=("h.5.attn",)))
    sink.checkpoint(25, str(ckpt), "critical")
    assert sink.flush(30)
    run = sink.inner.run
    sink.finish()
    assert sink.inner.alerts_sent == 2 and sink.inner.alerts_held == 1

    r = read_offline_run(run_folder(run))
    assert r.run_id == run.id and r.exit_code == 0 and not r.truncated
    assert r.series("earlywarn/grad_norm", "earlywarn/step") == (list(range(30)), [0.5 + s for s in range(30)])
    layer_steps, _ = r.series("earlywarn/layer_grad_norm/h.0.mlp.c_fc", "earlywarn/step")
    assert layer_steps == [0, 10, 12, 13, 17, 20]  # every 10 steps + the alert steps
    assert r.summary["earlywarn/alert_level"] == {"max": 3, "last": 0}
    assert r.summary["earlywarn/rewinds"]["last"] == 1
    assert r.summary["earlywarn/status"] == "critical"
    assert r.summary["earlywarn/last_checkpoint"] == {"step": 25, "path": str(ckpt), "reason": "critical"}
    assert [(a["title"], a["level"]) for a in r.alerts] == [
        ("earlywarn warning: grad_spike in h.3.mlp.c_fc", "WARN"),
        ("earlywarn critical: nonfinite_grad in h.5.attn", "ERROR"),
    ]
    assert "step 12: spike at 12" in r.alerts[0]["text"] and r.alerts[0]["wait_duration_s"] == 300.0
    assert all(len(a["title"]) < 64 for a in r.alerts)
    assert {"glob_name": "earlywarn/*", "step_metric": "earlywarn/step", "summary": ["max", "last"], "name": None} in r.metrics
    (art,) = r.artifacts
    assert art["type"] == "model" and "step-25" in art["aliases"] and art["metadata"]["reason"] == "critical"


def test_rewind_to_an_earlier_step_is_not_dropped(wandb_env):
    sink = WandbSink(project="earlywarn-test")
    sink.start()
    for step in [*range(0, 8), *range(5, 10)]:  # rewound from step 7 to step 5
        sink.log_metrics(step, {"earlywarn/grad_norm": float(step)})
    run = sink.run
    sink.finish()
    sink.finish()
    steps, _ = read_offline_run(run_folder(run)).series("earlywarn/grad_norm", "earlywarn/step")
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9]


def test_attaches_to_the_users_run_without_moving_its_step(wandb_env):
    user_run = wandb.init(project="earlywarn-test")
    try:
        (sink,) = build_sinks(["wandb"], background_options=FAST)
        assert sink.inner.run is user_run
        for step in range(5):
            sink.log_metrics(step, {"earlywarn/grad_norm": float(step)})
            assert sink.flush(10)
            user_run.log({"user/loss": 1.0 / (step + 1)}, step=step)  # explicit steps keep working
        sink.alert(spike(3))
        sink.finish()
        assert wandb.run is user_run  # not finished by the sink
    finally:
        user_run.finish()
        wandb.teardown()
    r = read_offline_run(run_folder(user_run))
    # the user's rows and steps are untouched ...
    assert [row["_step"] for row in r.history] == [0, 1, 2, 3, 4]
    assert [row["user/loss"] for row in r.history] == [1.0, 0.5, 1.0 / 3, 0.25, 0.2]
    # ... earlywarn's values ride on them (commit=False), charted against earlywarn/step; two
    # earlywarn steps before one user row keep the last (here step 0 shares a row with step 1)
    steps, values = r.series("earlywarn/grad_norm", "earlywarn/step")
    assert steps == [1, 2, 3, 4] and values == [1.0, 2.0, 3.0, 4.0]
    assert len(r.alerts) == 1 and r.summary["earlywarn/status"] == "warning"


def test_alert_title_is_short_and_stepless():
    e = Event(step=123456, kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message="x",
              layers=("model.transformer.h.23.attn.c_attn.very.long.parameter.group.name",))
    title = alert_title(e)
    assert len(title) < 64 and "123456" not in title and title.endswith("...")


def test_reader_stops_at_a_torn_tail_and_rejects_other_files(wandb_env):
    sink = WandbSink(project="earlywarn-test")
    sink.start()
    for step in range(2000):  # > 32 KiB: records span blocks
        sink.log_metrics(step, {"earlywarn/grad_norm": float(step), "earlywarn/loss": 1.0})
    run = sink.run
    sink.finish()
    full = read_offline_run(run_folder(run))
    assert full.series("earlywarn/grad_norm", "earlywarn/step")[0] == list(range(2000))
    data = Path(full.path).read_bytes()
    assert len(data) > 3 * 32 * 1024
    torn = list(iter_raw_records(data[: 2 * 32 * 1024 + 100]))
    assert 0 < len(torn) < len(list(iter_raw_records(data)))
    with pytest.raises(WandbFileError):
        list(iter_raw_records(b"not a wandb file"))


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from earlywarn.events import Event, Kind, Level
    from earlywarn.sinks.defaults import build_sinks

    (sink,) = build_sinks(["wandb"], {"wandb": {"project": "sigterm"}}, start_timeout=60)
    print(sink.inner.run.dir, flush=True)
    for step in range(1000):
        sink.log_metrics(step, {"earlywarn/grad_norm": float(step)})
        if step == 300:
            sink.alert(Event(step=step, kind=Kind.LOSS_DIVERGED, level=Level.CRITICAL, message="diverged"))
            os.kill(os.getpid(), signal.SIGTERM)  # pre-empted by the scheduler
        time.sleep(0.001)
    print("unreachable", flush=True)
    """
)


def test_sigterm_keeps_the_tail_of_an_offline_run(tmp_path):
    root = tmp_path / "wandb"
    for sub in ("data", "cache", "config"):
        (root / sub).mkdir(parents=True)
    script = tmp_path / "job.py"
    script.write_text(SIGTERM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(wandb_env_vars(root))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 128 + 15, proc.stderr[-2000:]
    assert "unreachable" not in proc.stdout
    r = read_offline_run(Path(proc.stdout.splitlines()[0]).parent)
    assert [a["title"] for a in r.alerts] == ["earlywarn critical: loss_diverged"]  # the tail made it
    assert r.series("earlywarn/grad_norm", "earlywarn/step")[0] == list(range(301))
    assert r.exit_code == 143


def test_what_wandb_stores_for_non_finite_values(wandb_env):
    sink = WandbSink(project="earlywarn-test")
    sink.start()
    for step, g in enumerate([1.0, float("nan"), float("inf"), float("-inf")]):
        sink.log_metrics(step, build_metrics(step, grad_norm=g, loss=1.0, layer_names=None, layer_norms=None,
                                             score=0.0, level=0, counters={}))
    run = sink.run
    sink.finish()
    r = read_offline_run(run_folder(run))
    _, values = r.series("earlywarn/grad_norm", "earlywarn/step")
    assert values[0] == 1.0 and np.isnan(values[1]) and values[2] == float("inf") and values[3] == float("-inf")
    assert r.series("earlywarn/grad_norm_finite", "earlywarn/step")[1] == [1.0, 0.0, 0.0, 0.0]


def test_carry_keeps_the_worst_and_the_latest():
    from earlywarn.integrations.wandb_sink import carry

    row: dict = {}
    carry(row, {"earlywarn/alert_level": 3.0, "earlywarn/grad_norm": float("nan"), "earlywarn/grad_norm_finite": 0.0,
                "earlywarn/skipped_steps": 1.0, "earlywarn/loss": 2.0})
    carry(row, {"earlywarn/alert_level": 0.0, "earlywarn/grad_norm": 5.0, "earlywarn/grad_norm_finite": 1.0,
                "earlywarn/skipped_steps": 1.0, "earlywarn/loss": 1.5, "earlywarn/instability_score": 0.2})
    assert row["earlywarn/alert_level"] == 3.0 and np.isnan(row["earlywarn/grad_norm"])
    assert row["earlywarn/grad_norm_finite"] == 0.0 and row["earlywarn/loss"] == 1.5
    assert row["earlywarn/skipped_steps"] == 1.0 and row["earlywarn/instability_score"] == 0.2


def test_halted_owned_run_exits_with_code_1(wandb_env):
    sink = WandbSink(project="earlywarn-test")
    sink.start()
    sink.alert(Event(step=3, kind=Kind.HALT, level=Level.CRITICAL, message="policy halted the run"))
    run = sink.run
    sink.finish()
    r = read_offline_run(run_folder(run))
    assert r.exit_code == 1 and r.summary["earlywarn/status"] == "critical" and r.summary["earlywarn/count/halt"] == 1
