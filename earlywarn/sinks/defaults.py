"""Which sinks run when the user names none, where their files go, and building sinks from names.

Default sinks: console + JSONL event log + MLflow's embedded store when mlflow is installed, so
``mlflow ui`` shows earlywarn's metrics and alerts with no setup. ``EARLYWARN_SINKS=console,jsonl``
(comma-separated names; ``none`` for no sink at all) overrides the default.

Default files go to one folder, ``./earlywarn_output/`` (``$EARLYWARN_OUTPUT_DIR`` moves it):
``events.jsonl`` (the JSONL sink), ``mlflow.db`` (the embedded MLflow store) and
``quarantine.jsonl`` (batches a rewind skipped, without a checkpoint directory). An MLflow
configured by the user wins over the embedded store: ``$MLFLOW_TRACKING_URI``,
``mlflow.set_tracking_uri(...)`` or an active MLflow run. ``watch()`` says once where the files go.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from earlywarn.sinks.background import BackgroundSink
from earlywarn.sinks.base import Sink, make_sink, strip_userinfo

log = logging.getLogger("earlywarn.sinks")

ENV_VAR = "EARLYWARN_SINKS"
OUTPUT_DIR_ENV = "EARLYWARN_OUTPUT_DIR"
OUTPUT_DIR = "earlywarn_output"
"""The folder for default files, in the working directory (not ``earlywarn/``: that name is the package's)."""
_noted = False
_announced: set[str] = set()


def output_dir() -> Path:
    """Where default files go: ``$EARLYWARN_OUTPUT_DIR`` or ``./earlywarn_output``, absolute (a
    later ``chdir`` must not split a run's files). Nothing is created here."""
    return Path(os.environ.get(OUTPUT_DIR_ENV) or OUTPUT_DIR).expanduser().absolute()


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


def mlflow_configured() -> bool:
    """Whether the user already chose an MLflow store: ``$MLFLOW_TRACKING_URI``,
    ``mlflow.set_tracking_uri()`` or an active run. mlflow is looked at only if the user
    imported it (never imported here)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return True
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return False
    for check in (getattr(mlflow, "is_tracking_uri_set", None), lambda: mlflow.active_run() is not None):
        try:
            if check is not None and check():
                return True
        except Exception:  # noqa: BLE001 - an mlflow without it: ask the next question
            continue
    return False


def embedded_mlflow_uri(folder: Path | None = None) -> str:
    """``sqlite:///<folder>/mlflow.db``, the embedded store (absolute: ``mlflow ui`` can open it from anywhere)."""
    return f"sqlite:///{(folder or output_dir()) / 'mlflow.db'}"


without_credentials = strip_userinfo  # ``uri`` with any ``user:password@`` removed (safe to print)


def mlflow_ui_command(uri: str) -> str:
    """The command that opens ``uri`` in MLflow's UI, with the ``mlflow`` script of this Python
    (``.venv/bin/mlflow`` is not on PATH unless the venv is activated)."""
    bindir = Path(sys.executable).parent
    script = bindir / ("mlflow.exe" if os.name == "nt" else "mlflow")
    exe = "mlflow"
    if script.exists():
        on_path = shutil.which("mlflow")
        if not (on_path and Path(on_path).resolve() == script.resolve()):
            try:
                exe = str(script.relative_to(Path.cwd()))
            except ValueError:
                exe = str(script)
    return f"{exe} ui --backend-store-uri {without_credentials(uri)}"


def with_default_locations(specs: Iterable[str | Sink], options_by_name: Mapping[str, Mapping[str, Any]]
                           ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Options with the default file locations filled in for sinks named without one, and what
    went where by sink name (for the one-time note). Locations the user gave are left alone."""
    out = {k: dict(v) for k, v in options_by_name.items()}
    folder = output_dir()
    placed: dict[str, str] = {}
    names = [s for s in specs if isinstance(s, str)]
    if "jsonl" in names and "path" not in out.get("jsonl", {}):
        out.setdefault("jsonl", {})["path"] = str(folder / "events.jsonl")
        placed["jsonl"] = "events.jsonl (event log)"
    mlflow_opts = out.get("mlflow", {})
    if ("mlflow" in names and not mlflow_opts.get("tracking_uri") and not mlflow_opts.get("run_id")
            and not mlflow_configured()):
        uri = embedded_mlflow_uri(folder)
        out.setdefault("mlflow", {})["tracking_uri"] = uri
        out["mlflow"].setdefault("artifact_location", (folder / "mlruns").as_uri())  # not ./mlruns
        placed["mlflow"] = f"mlflow.db (MLflow store; to look: {mlflow_ui_command(uri)})"
    return out, placed


def _announce(placed: Mapping[str, str], sinks: list[Sink]) -> None:
    running = {s.name for s in sinks}
    what = [text for name, text in placed.items() if name in running]
    if not what:
        return
    text = f"[earlywarn] writing to {output_dir()}{os.sep}: " + ", ".join(what) + f" (set {OUTPUT_DIR_ENV} to move them)"
    if text in _announced:
        return
    _announced.add(text)
    console = next((s for s in sinks if s.name == "console" and hasattr(s, "write")), None)
    if console is not None:
        console.write(text)
    else:
        print(text, file=sys.stderr, flush=True)


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
    options_by_name, placed = with_default_locations(specs, dict(options_by_name or {}))
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
    kept = [s for s in sinks if (s in started) or (isinstance(s, BackgroundSink) and id(s) not in failed)]
    if rank in (None, 0):
        _announce(placed, kept)
    return kept
