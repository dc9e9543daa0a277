"""Offline analysis: replay the live detector over runs that are already logged.

    from earlywarn.analyze import analyze
    report = analyze(["runs/main.csv", "mlflow:sqlite:///mlflow.db#<run_id>"],
                     baseline={"grad_norm": 0.2})
    report.to_dict()          # the documented JSON schema (see earlywarn.analyze.report)

Readers (:mod:`.readers`) -> hygiene (:mod:`.hygiene`) -> the same ``StreamingDetector`` as
``watch()`` (:mod:`.replay`) -> incidents and report (:mod:`.report`). Calibration of detector
thresholds on healthy runs is :func:`calibrate`. Pure numpy: no torch, no tracker SDK (those are
imported only for tracker / TensorBoard sources).
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

from earlywarn.analyze.hygiene import check_key_map, clean
from earlywarn.analyze.rawrun import AnalyzeError, RawRun
from earlywarn.analyze.readers import SOURCE_FORMS, read_source
from earlywarn.analyze.report import Incident, Report, RunReport, build_run_report, plot, render_text
from earlywarn.analyze.replay import replay

__all__ = [
    "AnalyzeError", "Incident", "RawRun", "Report", "RunReport", "SOURCE_FORMS",
    "analyze", "calibrate", "CalibrationResult", "load_config", "check_baseline", "read_runs", "plot",
    "render_text",
]


def load_config(config: Any = None):
    """``None`` (defaults), a ``DetectorConfig``, a dict of its fields, or a path to a JSON file
    written by ``DetectorConfig.to_file`` / ``earlywarn calibrate``."""
    from earlywarn.detect import DetectorConfig

    if config is None:
        return DetectorConfig()
    if isinstance(config, DetectorConfig):
        return config
    if isinstance(config, Mapping):
        try:
            return DetectorConfig.from_dict(dict(config))
        except (TypeError, ValueError) as e:
            raise AnalyzeError(f"detector config: {e}") from None
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise AnalyzeError(f"{path}: no such config file")
        try:
            return DetectorConfig.from_file(path)
        except (TypeError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AnalyzeError(f"{path}: bad detector config: {msg}") from None
        except UnicodeDecodeError:
            raise AnalyzeError(f"{path}: not a JSON detector config") from None
    raise AnalyzeError(f"config must be a DetectorConfig, a dict or a path, got {type(config).__name__}")


BASELINE_KEYS = ("grad_norm", "loss", "update_norm", "param_norm")


def check_baseline(baseline: Mapping[str, Any] | None) -> dict[str, float] | None:
    """``{"grad_norm": 0.2, "loss": 2.3}``: typical values known before the run (positive, finite)."""
    if baseline is None:
        return None
    if not isinstance(baseline, Mapping):
        raise AnalyzeError(f"baseline must be a mapping like {{'grad_norm': 0.2}}, got {type(baseline).__name__}")
    out = {}
    for k, v in baseline.items():
        if k not in BASELINE_KEYS and not (isinstance(k, str) and k.startswith("grad_norm/") and len(k) > 10):
            raise AnalyzeError(f"baseline {k!r}: use one of {', '.join(BASELINE_KEYS)} or grad_norm/<layer>")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise AnalyzeError(f"baseline {k}={v!r}: use a positive number") from None
        if not (x > 0 and x < float("inf")):
            raise AnalyzeError(f"baseline {k}={v!r}: use a positive finite number")
        out[str(k)] = x
    return out


def _as_list(sources: Any) -> list:
    if isinstance(sources, (str, os.PathLike, RawRun)):
        return [sources]
    try:
        items = list(sources)
    except TypeError:
        raise AnalyzeError(f"sources must be a path / address or a list of them, got {type(sources).__name__}") from None
    if not items:
        raise AnalyzeError("no sources given")
    return items


def read_runs(sources: Any, *, key_map: Mapping[str, str] | None = None, select: str | None = None) -> list[RawRun]:
    """Read every source (a path, a tracker address, or a :class:`RawRun`) into runs."""
    key_map = check_key_map(key_map)
    runs: list[RawRun] = []
    for src in _as_list(sources):
        if isinstance(src, RawRun):
            runs.append(src)
        else:
            runs.extend(read_source(os.fspath(src), key_map))
    if select:
        runs = [r for r in runs if select in r.label]
        if not runs:
            raise AnalyzeError(f"no run matches --run {select!r}")
    return runs


def analyze(
    sources: Any,
    *,
    config: Any = None,
    key_map: Mapping[str, str] | None = None,
    baseline: Mapping[str, float] | None = None,
    select: str | None = None,
) -> Report:
    """Replay the detector over logged runs and return the :class:`Report`.

    ``sources``: one or many of the forms in :data:`SOURCE_FORMS` (paths, ``mlflow:...``,
    ``wandb:...``). ``config``: a ``DetectorConfig``, dict or JSON path (``earlywarn calibrate``
    writes one). ``key_map``: ``{"loss": "train/loss", "step": "iteration", ...}`` for other column
    names. ``baseline``: typical values known ahead, e.g. ``{"grad_norm": 0.2, "loss": 2.3}``.
    ``select``: keep only runs whose label contains this text. Problems with the input raise
    :class:`AnalyzeError` (one line).
    """
    t0 = time.perf_counter()
    cfg = load_config(config)
    base = check_baseline(baseline)
    key_map = check_key_map(key_map)
    raws = read_runs(sources, key_map=key_map, select=select)
    reports = []
    for raw in raws:
        run = clean(raw, key_map)
        rep = replay(run, cfg, base)
        reports.append(build_run_report(run, rep, base))
    return Report(runs=reports, detector=cfg.to_dict(), baseline=base, seconds=time.perf_counter() - t0)


from earlywarn.analyze.calibrate import CalibrationResult, calibrate  # noqa: E402  (needs analyze's helpers)
