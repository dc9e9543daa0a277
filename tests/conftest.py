"""Shared fixtures. Keep this file small: put fixtures in topic modules and import them here."""

from fixtures_trackers import mlflow_server, mlflow_sqlite_uri, mlflow_template_db, wandb_env  # noqa: F401


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
