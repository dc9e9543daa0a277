"""Tracker and framework integrations, installed as ``earlywarn.integrations``.

Each module imports its SDK (wandb, mlflow, lightning, transformers, accelerate) only when used;
importing this package imports none of them. Sinks are reached by name through the registry in
:mod:`earlywarn.sinks.base` (``"wandb"`` -> ``wandb_sink.WandbSink``, ``"mlflow"`` ->
``mlflow_sink.MlflowSink``); ``wandb_offline_reader`` reads a W&B run file without a server.
"""
