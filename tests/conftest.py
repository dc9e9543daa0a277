"""Shared fixtures. Keep this file small: put fixtures in topic modules and import them here."""

from fixtures_trackers import mlflow_server, mlflow_sqlite_uri, mlflow_template_db, wandb_env  # noqa: F401
