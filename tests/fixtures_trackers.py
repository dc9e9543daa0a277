"""Shared tracker fixtures: a migrated MLflow sqlite template, a real ``mlflow server`` (session),
and a hermetic offline W&B environment. Imported by ``tests/conftest.py``.

Creating an MLflow sqlite database runs its migrations (~6 s here); copying a migrated one takes
~0.15 s, so the template is made once and cached in pytest's cache folder (keyed by the mlflow
version). The server runs with ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` (otherwise it spawns
~9 job processes) and one worker.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import pytest

WANDB_HERMETIC = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB__DISABLE_STATS": "true",
    "WANDB__DISABLE_META": "true",
    "WANDB__SAVE_REQUIREMENTS": "false",
}


def wandb_env_vars(root: Path) -> dict[str, str]:
    """The env of a fast, quiet, offline W&B run writing under ``root``."""
    return {
        **WANDB_HERMETIC,
        "WANDB_DIR": str(root),
        "WANDB_DATA_DIR": str(root / "data"),
        "WANDB_CACHE_DIR": str(root / "cache"),
        "WANDB_CONFIG_DIR": str(root / "config"),
    }


@pytest.fixture
def wandb_env(tmp_path, monkeypatch) -> Path:
    """Offline, hermetic W&B under ``tmp_path/wandb``; returns that folder."""
    root = tmp_path / "wandb"
    for sub in ("", "data", "cache", "config"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for key, value in wandb_env_vars(root).items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(key, raising=False)
    return root


def _make_template(path: Path) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    # In a subprocess: the store keeps an engine open on the file it migrated.
    subprocess.run(
        [sys.executable, "-c", "import sys; from mlflow import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()",
         f"sqlite:///{tmp}"],
        check=True,
        capture_output=True,
        timeout=180,
    )
    os.replace(tmp, path)


@pytest.fixture(scope="session")
def mlflow_template_db(request, tmp_path_factory) -> Path:
    """A migrated, empty MLflow sqlite database (copy it, never write to it)."""
    pytest.importorskip("mlflow")
    name = f"mlflow-{version('mlflow')}.db"
    cache = getattr(request.config, "cache", None)
    folder = Path(cache.mkdir("earlywarn-mlflow")) if cache is not None else tmp_path_factory.mktemp("mlflow-template")
    path = folder / name
    if not path.exists():
        _make_template(path)
    return path


def copy_mlflow_db(template: Path, db: Path, artifact_root: Path | str) -> str:
    """Copy the template to ``db`` with the Default experiment's artifacts under ``artifact_root``
    (a folder, or a URI such as ``mlflow-artifacts:``); the template recorded the folder it was
    made in. Returns the ``sqlite:///`` URI."""
    shutil.copyfile(template, db)
    location = f"{artifact_root}/0" if isinstance(artifact_root, str) else str(artifact_root / "0")
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (location,))
    con.close()
    return f"sqlite:///{db}"


@pytest.fixture
def mlflow_sqlite_uri(tmp_path, monkeypatch, mlflow_template_db) -> str:
    """A fresh embedded MLflow store (``sqlite:///...``) for one test, run from ``tmp_path``: a
    sqlite store puts new experiments' artifacts under ``./mlruns`` of the working folder."""
    monkeypatch.chdir(tmp_path)
    return copy_mlflow_db(mlflow_template_db, tmp_path / "mlflow.db", tmp_path / "mlruns")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite backend; can be killed and restarted
    on the same port and database."""

    def __init__(self, db: Path, artifacts: Path, log: Path):
        self.db, self.artifacts, self.log = db, artifacts, log
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.uri + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 90.0) -> None:
        exe = Path(sys.executable).with_name("mlflow")
        cmd = [str(exe) if exe.exists() else "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{self.db}", "--artifacts-destination", str(self.artifacts),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server's process group (it was started in its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            for s in (sig, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, s)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.proc = None


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, mlflow_template_db):
    """One real MLflow tracking server for the whole session."""
    root = tmp_path_factory.mktemp("mlflow-server")
    db = root / "mlflow.db"
    copy_mlflow_db(mlflow_template_db, db, "mlflow-artifacts:")  # served by the server itself
    (root / "artifacts").mkdir()
    server = MlflowServer(db, root / "artifacts", root / "server.log")
    server.start()
    yield server
    server.stop(signal.SIGTERM)
