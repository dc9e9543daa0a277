"""Shared fixtures. Keep this file small: put fixtures in topic modules and import them here."""

from fixtures_trackers import mlflow_server, mlflow_sqlite_uri, mlflow_template_db, wandb_env  # noqa: F401

import os

import pytest


@pytest.fixture(autouse=True)
def _no_watcher_outlives_its_test():
    """A watcher a test left attached would make the next tests' watchers name themselves (a
    process with several): detach what a test left behind."""
    yield
    import sys

    watcher = sys.modules.get("earlywarn.guard.watcher")
    if watcher is not None:
        for w in list(watcher._LIVE):
            w.detach()


@pytest.fixture(autouse=True)
def _output_dir_restored():
    """The rescue harness's ``run_one`` points ``EARLYWARN_OUTPUT_DIR`` at a folder it deletes after
    (its worker processes' quarantine files stay out of the repo); in this process that would send
    the next test's default output there. Each test starts with the variable as the session had it."""
    before = os.environ.get("EARLYWARN_OUTPUT_DIR")
    yield
    if before is None:
        os.environ.pop("EARLYWARN_OUTPUT_DIR", None)
    else:
        os.environ["EARLYWARN_OUTPUT_DIR"] = before
