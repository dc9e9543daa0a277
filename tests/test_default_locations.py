"""Where default files go: one folder (./earlywarn_output), said once at watch(); an MLflow the
user configured (environment, set_tracking_uri, an active run) wins over the embedded store."""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlflow
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import earlywarn
from earlywarn.sinks import ConsoleSink
from earlywarn.sinks import defaults
from fixtures_models import MLP

torch.set_num_threads(1)


@pytest.fixture
def clean_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "EARLYWARN_SINKS", "EARLYWARN_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(defaults, "_announced", set())
    return tmp_path


def test_watch_keeps_its_files_in_one_folder_and_says_so_once(clean_cwd):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g))
    loader = earlywarn.ResumableLoader(data, batch_size=8, seed=0)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = io.StringIO()
    ew = earlywarn.watch(model, opt, loader=loader, sinks=[ConsoleSink(stream=out), "jsonl"],
                         recovery=earlywarn.RecoveryConfig(snapshot_every=5))
    folder = clean_cwd / "earlywarn_output"
    notes = out.getvalue().splitlines()
    assert notes[0] == f"[earlywarn] writing to {folder}/: events.jsonl (event log) (set EARLYWARN_OUTPUT_DIR to move them)"
    # and, once, the snapshot plan (cadence and host RAM)
    assert len(notes) == 2 and notes[1].startswith("[earlywarn] in-memory snapshots every 5 steps")
    for i, (x, y) in enumerate(loader):
        if i == 12:
            break
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == 8:  # NaN weights: the next loss is NaN and earlywarn rewinds, quarantining batches
            model.hidden.weight.detach().fill_(float("nan"))
        opt.step()
    ew.close()
    assert [p.name for p in clean_cwd.iterdir()] == ["earlywarn_output"]
    assert sorted(p.name for p in folder.iterdir()) == ["events.jsonl", "quarantine.jsonl"]
    kinds = [json.loads(r)["kind"] for r in (folder / "events.jsonl").read_text().splitlines()]
    assert "rewind" in kinds and "quarantine" in kinds
    assert out.getvalue().rstrip().endswith(f"quarantine list: {folder / 'quarantine.jsonl'}")

    # a second watcher writing to the same place is not told again
    other = MLP()
    ew = earlywarn.watch(other, torch.optim.SGD(other.parameters(), lr=0.1), sinks=[ConsoleSink(stream=out), "jsonl"])
    ew.close()
    assert out.getvalue().count("[earlywarn] writing to") == 1


def test_output_folder_moves_with_the_environment_and_explicit_paths_stay(clean_cwd, monkeypatch):
    monkeypatch.setenv("EARLYWARN_OUTPUT_DIR", str(clean_cwd / "runs" / "ew"))
    options, placed = defaults.with_default_locations(["console", "jsonl", "mlflow"], {})
    assert options["jsonl"]["path"] == str(clean_cwd / "runs" / "ew" / "events.jsonl")
    assert options["mlflow"]["tracking_uri"] == f"sqlite:///{clean_cwd / 'runs' / 'ew' / 'mlflow.db'}"
    assert set(placed) == {"jsonl", "mlflow"}
    assert "ui --backend-store-uri sqlite:///" in placed["mlflow"]
    options, placed = defaults.with_default_locations(
        ["jsonl", "mlflow"], {"jsonl": {"path": "mine.jsonl"}, "mlflow": {"tracking_uri": "http://h:5000"}})
    assert options == {"jsonl": {"path": "mine.jsonl"}, "mlflow": {"tracking_uri": "http://h:5000"}} and placed == {}
    assert not (clean_cwd / "runs").exists()  # nothing is created before a sink writes


def test_an_mlflow_the_user_configured_wins(clean_cwd, monkeypatch, mlflow_sqlite_uri):
    def chosen() -> dict:
        return defaults.with_default_locations(["mlflow"], {})[0].get("mlflow", {})

    assert chosen()["tracking_uri"].endswith("/earlywarn_output/mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_sqlite_uri)
    assert chosen() == {}  # MlflowSink reads the environment itself
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(mlflow_sqlite_uri)
    try:
        assert chosen() == {}
        with mlflow.start_run():
            assert chosen() == {}  # the sink logs into the active run
    finally:
        mlflow.set_tracking_uri(None)
    assert chosen()["tracking_uri"].startswith("sqlite:///")


def test_without_credentials():
    assert defaults.without_credentials("http://bob:s3cret@host:5000/x?y=1") == "http://host:5000/x?y=1"
    assert defaults.without_credentials("sqlite:////a/b.db") == "sqlite:////a/b.db"


def test_mlflow_ui_command_names_the_script_of_this_python(clean_cwd):
    cmd = defaults.mlflow_ui_command("sqlite:////x/mlflow.db")
    exe = cmd.split(" ui ")[0]
    assert cmd.endswith(" ui --backend-store-uri sqlite:////x/mlflow.db")
    assert exe == "mlflow" or Path(exe).resolve() == (Path(__import__("sys").executable).parent / "mlflow").resolve()
