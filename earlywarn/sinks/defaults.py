"""Which sinks run when the user names none, and building a list of sinks from names.

Default: console + JSONL event log + MLflow's embedded store (``sqlite:///<cwd>/mlflow.db``, or
``$MLFLOW_TRACKING_URI``) when mlflow is installed, so ``mlflow ui`` shows earlywarn's metrics and
alerts with no setup. ``EARLYWARN_SINKS=console,jsonl`` (comma-separated names; ``none`` for no
sink at all) overrides the default.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import Any, Iterable, Mapping

from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import Sink, make_sink

log = logging.getLogger("earlywarn.sinks")

ENV_VAR = "EARLYWARN_SINKS"
_noted = False


def default_sink_specs() -> list[str]:
    """Sink names used when the user passes none (see the module docstring)."""
    global _noted
    env = os.environ.get(ENV_VAR)
    if env is not None:
        names = [s.strip() for s in env.split(",") if s.strip()]
        return [] if names == ["none"] else names
    if importlib.util.find_spec("mlflow") is not None:  # finds, does not import
        return ["console", "jsonl", "mlflow"]
    if not _noted:
        _noted = True
        log.warning(
            "earlywarn: mlflow is not installed, so events go to the console and the JSONL log only "
            "(pip install mlflow for the embedded tracker, or set %s)",
            ENV_VAR,
        )
    return ["console", "jsonl"]


def build_sinks(
    specs: Iterable[str | Sink] | None = None,
    options_by_name: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    background: bool = True,
    background_options: Mapping[str, Any] | None = None,
    start_timeout: float = 15.0,
    rank: int | None = None,
) -> list[Sink]:
    """Build and start sinks from names (or ``Sink`` instances); ``None`` means the defaults.

    ``options_by_name[name]`` are the keyword arguments of sink ``name``. Sinks with
    ``io_bound = True`` (trackers, webhook) are wrapped in a :class:`BackgroundSink`
    (``background_options`` are its keyword arguments) and started together, waiting at most
    ``start_timeout`` seconds in all. A sink that fails to start is dropped with a warning; a
    tracker still starting after the timeout is kept and buffers. An unknown name or bad options
    raise (a configuration error, found before training starts). With ``rank`` > 0 sinks marked
    ``main_process_only`` are left out.
    """
    specs = default_sink_specs() if specs is None else list(specs)
    options_by_name = dict(options_by_name or {})
    unknown = set(options_by_name) - {s if isinstance(s, str) else s.name for s in specs}
    if unknown:
        log.warning("earlywarn: options given for sinks that are not used: %s", ", ".join(sorted(unknown)))
    sinks: list[Sink] = []
    for spec in specs:
        name = spec if isinstance(spec, str) else spec.name
        sink = make_sink(spec, options_by_name.get(name))
        if rank not in (None, 0) and sink.main_process_only:
            continue
        if background and sink.io_bound and not isinstance(sink, BackgroundSink):
            sink = BackgroundSink(sink, start_timeout=start_timeout, **dict(background_options or {}))
        sinks.append(sink)

    started: list[Sink] = []
    waiting: list[BackgroundSink] = []
    for sink in sinks:
        if isinstance(sink, BackgroundSink):
            sink.begin_start()
            waiting.append(sink)
            continue
        try:
            sink.start()
        except Exception as exc:  # noqa: BLE001 - one broken sink must not stop training
            log.warning("earlywarn: sink %r failed to start (%s: %s); continuing without it", sink.name, type(exc).__name__, exc)
            continue
        started.append(sink)
    deadline = time.monotonic() + start_timeout
    failed: set[int] = set()
    for sink in waiting:
        try:
            sink.wait_started(max(deadline - time.monotonic(), 0.0))
        except Exception as exc:  # noqa: BLE001
            log.warning("earlywarn: sink %r failed to start (%s: %s); continuing without it", sink.name, type(exc).__name__, exc)
            sink.finish(0)
            failed.add(id(sink))
    # Keep the order the user gave.
    return [s for s in sinks if (s in started) or (isinstance(s, BackgroundSink) and id(s) not in failed)]
