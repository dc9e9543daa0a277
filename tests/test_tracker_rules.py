"""End to end: a real run with a skip, a warning, a repair and a rewind goes to MLflow (a real
``mlflow server`` on 127.0.0.1 and the embedded sqlite store) and to W&B (offline, read back from
the run file), with earlywarn owning the run and attached to the user's run (the user logging every
step, every 10th step, never). The documented alert rules are evaluated on what the tracker
stored: each fires at the steps it should and nowhere else."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from earlywarn.events import Kind, Level
from tracker_scenario import (
    P, SKIP_AT, carried_rows, check_scenario_has_every_incident, fire_all, mlflow_rows, run_scenario,
    truth_levels, wandb_rows, wandb_rows_with_wandbs_own_tool,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*noload.*:DeprecationWarning")  # inside mlflow's store
FAST_MLFLOW = {"start_timeout": 60, "batch_interval": 0.2}


def same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=1e-12)


def as_stored_by_mlflow(v: float) -> float:
    return math.nan if math.isinf(v) else v  # the sink sends +/-inf as NaN (MLflow would clamp it)


def check_rules_on_truth(scn) -> dict[str, list[int]]:
    """The rules on what earlywarn logged, checked against what happened (the watcher's events)."""
    fired = fire_all(scn.recorder.rows)
    levels = truth_levels(scn)
    assert fired["critical"] == sorted(s for s, lvl in levels.items() if lvl >= 3)
    assert fired["warning_or_worse"] == sorted(s for s, lvl in levels.items() if lvl >= 2)
    assert SKIP_AT in fired["critical"]
    rewind_steps = scn.steps_with(lambda e: e.kind is Kind.REWIND)
    assert rewind_steps and set(rewind_steps) <= set(fired["critical"])  # the rewind's own step: level 3
    assert fired["rewound"] == rewind_steps
    assert fired["state_repaired"] == scn.steps_with(lambda e: e.kind is Kind.REPAIR)
    skip_steps = scn.steps_with(lambda e: e.kind is Kind.SKIP)
    assert fired["steps_skipped"] == skip_steps
    assert fired["nonfinite_gradient"] == scn.steps_with(lambda e: e.kind is Kind.NONFINITE_GRAD)
    assert fired["gradient_not_finite"] == fired["nonfinite_gradient"]
    assert fired["loss_not_finite"] == scn.steps_with(lambda e: e.kind is Kind.LOSS_NONFINITE)
    assert fired["checkpoint_written"] == sorted(scn.steps_with(lambda e: e.kind is Kind.CHECKPOINT))
    warn_steps = scn.steps_with(lambda e: e.kind is Kind.COLLAPSE_RISK)
    assert warn_steps and set(warn_steps) <= set(fired["warning_or_worse"])
    return fired


# ------------------------------------------------------------------ MLflow
@pytest.fixture(params=["server", "sqlite"])
def mlflow_uri(request) -> str:
    return request.getfixturevalue("mlflow_server").uri if request.param == "server" else request.getfixturevalue("mlflow_sqlite_uri")


def check_mlflow_run(client, run_id, scn, fired):
    rows = mlflow_rows(client, run_id)
    want = scn.recorder.rows
    assert [s for s, _ in rows] == [s for s, _ in want]  # one point per step, every step
    for (s, got), (_, exp) in zip(rows, want):
        assert set(got) == set(exp), s
        for k in exp:
            assert same(got[k], as_stored_by_mlflow(exp[k])), (s, k, got[k], exp[k])
    assert fire_all(rows) == fired
    tags = client.get_run(run_id).data.tags
    crit = [e for e in scn.events if e.level >= Level.CRITICAL]
    assert tags["earlywarn.status"] == "critical" and tags["earlywarn.worst_level"] == "3"
    assert (tags["earlywarn.first_critical_kind"], int(tags["earlywarn.first_critical_step"])) == (str(crit[0].kind), crit[0].step)
    assert (tags["earlywarn.last_critical_kind"], int(tags["earlywarn.last_critical_step"])) == (str(crit[-1].kind), crit[-1].step)
    for kind in {str(e.kind) for e in scn.events}:
        assert int(tags[f"earlywarn.count.{kind}"]) == sum(str(e.kind) == kind for e in scn.events), kind
        assert kind in tags["earlywarn.kinds"].split(",")
    ckpts = [e for e in scn.events if e.kind is Kind.CHECKPOINT]
    assert json.loads(tags["earlywarn.last_checkpoint"])["step"] == ckpts[-1].step
    assert not tags["earlywarn.last_alert"].endswith(" ")  # cut at a word, never mid-word
    points = {(m.step, m.value) for m in client.get_metric_history(run_id, P + "incident_level")}
    assert points == {(e.step, float(int(e.level))) for e in scn.events}  # MLflow folds exact duplicates


def test_mlflow_owned_run_rules_fire_where_they_should(mlflow_uri, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    scn = run_scenario(["mlflow"], {"mlflow": {"tracking_uri": mlflow_uri, "experiment": "rules", **FAST_MLFLOW}})
    scn.watcher.close()
    check_scenario_has_every_incident(scn)
    fired = check_rules_on_truth(scn)
    (sink,) = [s for s in scn.watcher.sinks if s.name == "mlflow"]
    client = MlflowClient(mlflow_uri)
    check_mlflow_run(client, sink.inner.run_id, scn, fired)
    run = client.get_run(sink.inner.run_id)
    assert run.info.status == "FINISHED"
    assert sink.stats()["dropped_records"] == 0 and sink.stats()["delivered_events"] == len(scn.events) + len(scn.recorder.checkpoints)


@pytest.mark.parametrize("user_every", [1, 10, None], ids=["user-every-step", "user-every-10th", "user-never"])
def test_mlflow_attached_to_the_users_run(mlflow_uri, tmp_path, monkeypatch, user_every):
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)  # the user's setup (set_tracking_uri would outlive the test)
    with mlflow.start_run(run_name="user-run") as user_run:
        scn = run_scenario(["mlflow"], {"mlflow": FAST_MLFLOW}, user_every=user_every,
                           user_log=lambda step: mlflow.log_metric("user/step_done", step, step=step))
        scn.watcher.close()
        client = MlflowClient(mlflow_uri)
        assert client.get_run(user_run.info.run_id).info.status == "RUNNING"  # the user's run stays open
    check_scenario_has_every_incident(scn)
    fired = check_rules_on_truth(scn)
    (sink,) = [s for s in scn.watcher.sinks if s.name == "mlflow"]
    assert sink.inner.run_id == user_run.info.run_id and not sink.inner.owns_run
    check_mlflow_run(client, user_run.info.run_id, scn, fired)
    user_points = [m.step for m in client.get_metric_history(user_run.info.run_id, "user/step_done")]
    assert sorted(user_points) == scn.user_rows


def test_mlflow_readme_searches_against_a_real_store(mlflow_server, tmp_path, monkeypatch):
    """The filter strings docs/trackers.md gives, run against runs with and without incidents."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    opts = {"tracking_uri": mlflow_server.uri, "experiment": "searches", **FAST_MLFLOW}
    bad = run_scenario(["mlflow"], {"mlflow": {**opts, "run_name": "with-incidents"}})
    bad.watcher.close()
    healthy = run_scenario(["mlflow"], {"mlflow": {**opts, "run_name": "healthy"}}, steps=15)
    healthy.watcher.close()
    warned = run_scenario(["mlflow"], {"mlflow": {**opts, "run_name": "warned"}}, steps=50)
    warned.watcher.close()
    assert {e.kind for e in warned.events} >= {Kind.COLLAPSE_RISK} and warned.watcher.counters["rewinds"] == 0
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    exp = mlflow.get_experiment_by_name("searches")

    def names(filter_string: str) -> set[str]:
        found = mlflow.search_runs([exp.experiment_id], filter_string=filter_string, output_format="list")
        return {r.info.run_name for r in found}

    assert names("tags.`earlywarn.status` = 'critical'") == {"with-incidents", "warned"}  # warned: its skip at 20
    assert names("tags.`earlywarn.status` != 'ok'") == {"with-incidents", "warned"}
    assert names("tags.`earlywarn.kinds` LIKE '%nonfinite_grad%'") == {"with-incidents", "warned"}
    assert names("tags.`earlywarn.kinds` LIKE '%rewind%'") == {"with-incidents"}
    assert names("tags.`earlywarn.first_critical_kind` = 'nonfinite_grad'") == {"with-incidents", "warned"}
    assert names("tags.`earlywarn.count.collapse_risk` != ''") == {"with-incidents", "warned"}
    assert names("metrics.`earlywarn/rewinds` > 0") == {"with-incidents"}
    assert names("metrics.`earlywarn/skipped_steps` > 0") == {"with-incidents", "warned"}
    assert names("metrics.`earlywarn/alerts_critical` > 0") == {"with-incidents", "warned"}
    # the latest value: both runs ended calm, though one rewound
    assert names("metrics.`earlywarn/alert_level` >= 2") == set()


def test_mlflow_halt_marks_the_run_failed_and_logs_the_halted_step(mlflow_sqlite_uri, tmp_path, monkeypatch):
    import earlywarn
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    with pytest.raises(earlywarn.Halt):
        run_scenario(["mlflow"], {"mlflow": {"tracking_uri": mlflow_sqlite_uri, **FAST_MLFLOW}},
                     policy=earlywarn.PolicyConfig(on_loss_nonfinite="halt"))
    # run_scenario closed the watcher on the way out
    client = MlflowClient(mlflow_sqlite_uri)
    (run,) = client.search_runs(["0"])
    assert run.info.status == "FAILED"
    assert run.data.tags["earlywarn.status"] == "critical" and "halt" in run.data.tags["earlywarn.kinds"].split(",")
    halt_step = int(run.data.tags["earlywarn.last_critical_step"])
    level = {m.step: m.value for m in client.get_metric_history(run.info.run_id, P + "alert_level")}
    assert level[halt_step] == 3.0 and max(level) == halt_step  # the halted step has its row


# ------------------------------------------------------------------ W&B
def wandb_run_folder(run) -> Path:
    return Path(run.dir).parent


def check_wandb_rows(rows, scn, *, expect_ends=None):
    """Readback rows == earlywarn's steps carried into rows ending at each row's earlywarn/step."""
    ends = [s for s, _ in rows]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    assert ends[-1] == scn.recorder.rows[-1][0]  # nothing left behind at the end
    if expect_ends is not None:
        assert ends == expect_ends
    want = carried_rows(scn.recorder.rows, ends)
    assert [s for s, _ in want] == ends
    for (s, got), (_, exp) in zip(rows, want):
        for k, v in exp.items():
            assert k in got and same(float(got[k]), float(v)), (s, k, got.get(k), v)
    return want


def test_wandb_owned_run_rules_fire_where_they_should(wandb_env, tmp_path, monkeypatch):
    from earlywarn.integrations.wandb_offline_reader import read_offline_run

    monkeypatch.chdir(tmp_path)
    scn = run_scenario(["wandb"], {"wandb": {"project": "rules"}})
    (sink,) = [s for s in scn.watcher.sinks if s.name == "wandb"]
    run = sink.inner.run
    scn.watcher.close()
    check_scenario_has_every_incident(scn)
    fired = check_rules_on_truth(scn)
    r = read_offline_run(wandb_run_folder(run))
    rows = wandb_rows(r)
    check_wandb_rows(rows, scn, expect_ends=[s for s, _ in scn.recorder.rows])  # a row per step
    assert fire_all(rows) == fired
    assert fire_all(wandb_rows_with_wandbs_own_tool(r.path)) == fired  # W&B's own reader agrees
    assert r.summary[P + "status"] == "critical" and r.summary[P + "worst_level"] == 3
    assert r.summary[P + "first_critical_step"] == SKIP_AT and r.summary[P + "count/rewind"] == 1
    assert r.summary[P + "alert_level"]["max"] == 3
    assert {a["level"] for a in r.alerts} == {"WARN", "ERROR"} and r.exit_code == 0


@pytest.mark.parametrize("user_every", [1, 10, None], ids=["user-every-step", "user-every-10th", "user-never"])
def test_wandb_attached_rows_carry_the_worst_and_the_counters(wandb_env, tmp_path, monkeypatch, user_every):
    import wandb

    from earlywarn.integrations.wandb_offline_reader import read_offline_run

    monkeypatch.chdir(tmp_path)
    user_run = wandb.init(project="rules")
    try:
        scn = run_scenario(["wandb"], user_every=user_every, user_log=lambda step: user_run.log({"user/step_done": step}))
        (sink,) = [s for s in scn.watcher.sinks if s.name == "wandb"]
        assert sink.inner.run is user_run and not sink.inner.owns_run
        scn.watcher.close()
        assert wandb.run is user_run  # earlywarn leaves the user's run open
    finally:
        user_run.finish()
        wandb.teardown()
    check_scenario_has_every_incident(scn)
    fired_truth = check_rules_on_truth(scn)
    r = read_offline_run(wandb_run_folder(user_run))
    # the user's rows and W&B steps are the user's own
    user_rows = [row for row in r.history if "user/step_done" in row]
    assert [row["user/step_done"] for row in user_rows] == scn.user_rows
    assert [row["_step"] for row in r.history] == list(range(len(r.history)))
    last = scn.recorder.rows[-1][0]
    ends = scn.user_rows + ([last] if not scn.user_rows or scn.user_rows[-1] != last else [])
    rows = wandb_rows(r)
    want = check_wandb_rows(rows, scn, expect_ends=ends)
    fired = fire_all(rows)
    assert fired == fire_all(want) == fire_all(wandb_rows_with_wandbs_own_tool(r.path))
    for name in ("critical", "warning_or_worse", "nonfinite_gradient", "gradient_not_finite", "steps_skipped",
                 "state_repaired", "rewound", "checkpoint_written"):
        # a user row fires exactly when one of the steps it carries fired (a change needs a row before it)
        change = name in ("steps_skipped", "state_repaired", "rewound", "checkpoint_written")
        expect = [end for i, (prev, end) in enumerate(zip([-1, *ends], ends))
                  if not (change and i == 0) and any(prev < s <= end for s in fired_truth[name])]
        assert fired[name] == expect, name
    assert fired["critical"]  # no critical was lost on the way into the user's sparse rows
    assert r.summary[P + "status"] == "critical" and r.summary[P + "last_critical_step"] == max(
        e.step for e in scn.events if e.level >= Level.CRITICAL)


def test_wandb_attached_idle_commit_makes_rows_of_its_own(wandb_env, tmp_path, monkeypatch):
    import wandb

    from earlywarn.integrations.wandb_offline_reader import read_offline_run

    monkeypatch.chdir(tmp_path)
    user_run = wandb.init(project="rules")
    try:
        scn = run_scenario(["wandb"], {"wandb": {"idle_commit_seconds": 0}})
        scn.watcher.close()
    finally:
        user_run.finish()
        wandb.teardown()
    rows = wandb_rows(read_offline_run(wandb_run_folder(user_run)))
    # the user logged nothing; earlywarn committed rows of its own -- one per batch its sink's
    # worker took (how many steps a batch holds depends on the machine's load); without the idle
    # commit the carried values go out in one row, at finish
    assert len(rows) > 1
    check_wandb_rows(rows, scn)
    assert fire_all(rows)["critical"]
