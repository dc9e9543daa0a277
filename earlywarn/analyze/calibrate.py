"""Calibration: pick detector thresholds that meet a false-alarm target on runs known to be healthy.

Every warning (or worse) on a healthy run is a false alarm. The detector's warning thresholds are
moved together along one *sensitivity* axis ``s`` (1 = the given config, > 1 stricter, < 1 more
sensitive): z and CUSUM thresholds scale by ``s``, ratio thresholds are raised to the power
``s``, step counts scale by ``s``. The most sensitive setting whose false-alarm rate meets the target is
found by bisection over a fixed ladder, then ``margin`` notches stricter are added so that the
healthy runs do not sit on the edge. The result is a ``DetectorConfig`` JSON file that
``watch(config=...)`` and ``earlywarn analyze --config`` load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from earlywarn.events import Level

LADDER = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.15, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
"""Sensitivities tried (more sensitive first)."""

# the config's warning thresholds, by how they scale (fields a config lacks are skipped)
_Z = ("spike_z", "drift_h", "drift_alone_h", "update_alone_h", "loss_only_h")
_RATIOS = ("spike_ratio", "loss_spike_ratio", "warn_ratio", "loss_warn_ratio", "jump_ratio", "loss_diverge_ratio",
           "lr_jump_ratio")
_COUNTS: tuple[str, ...] = ()  # step counts stay as configured: only thresholds move


def scaled_config(base: Any, s: float) -> Any:
    """``base`` with its warning thresholds moved to sensitivity ``s`` (see the module doc).

    Raises ``ValueError`` (from the config's own validation) when ``s`` breaks one of its
    invariants; :func:`calibrate` skips such settings.
    """
    names = {f.name for f in fields(base)}
    kw: dict[str, Any] = {}
    for n in _Z:
        if n in names:
            v = float(getattr(base, n))
            kw[n] = v * s if math.isfinite(v) else v
    for n in _RATIOS:
        if n in names:
            v = float(getattr(base, n))
            kw[n] = v if not math.isfinite(v) else max(1.0, v ** s)
    for n in _COUNTS:
        if n in names:
            kw[n] = max(1, int(round(getattr(base, n) * s)))
    # keep the config's own invariants
    if "admit_z" in names and "spike_z" in kw:
        kw["admit_z"] = min(float(base.admit_z), kw["spike_z"])
    return replace(base, **kw)


@dataclass
class CalibrationResult:
    config: Any
    """The chosen ``DetectorConfig``."""
    sensitivity: float
    target_rate: float
    """Allowed false alarms (warning or worse) per 10,000 healthy steps."""
    false_alarms: int
    """False alarms of the chosen config on the healthy runs."""
    steps: int
    runs: list[str]
    met: bool
    tried: list[dict[str, Any]] = field(default_factory=list)
    """``{"sensitivity", "false_alarms", "rate_per_10k"}`` for every setting evaluated."""
    alarms: list[dict[str, Any]] = field(default_factory=list)
    """Where the chosen config still alarms (``run``, ``step``, ``level``, ``signal``)."""

    @property
    def rate_per_10k(self) -> float:
        return 1e4 * self.false_alarms / max(1, self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "sensitivity": self.sensitivity,
            "target_rate_per_10k": self.target_rate,
            "false_alarms": self.false_alarms,
            "rate_per_10k": round(self.rate_per_10k, 4),
            "steps": self.steps,
            "runs": list(self.runs),
            "met": self.met,
            "tried": list(self.tried),
            "alarms": list(self.alarms),
        }


def calibrate(
    healthy: Any,
    *,
    target_rate: float = 0.0,
    config: Any = None,
    key_map: Mapping[str, str] | None = None,
    baseline: Mapping[str, float] | None = None,
    margin: int = 1,
    out: str | None = None,
) -> CalibrationResult:
    """Choose detector thresholds for the runs in ``healthy`` (sources as for ``analyze``).

    ``target_rate``: false alarms allowed per 10,000 steps (0: none). ``config``: the starting
    config (defaults otherwise). ``margin``: ladder notches added beyond the boundary. ``out``: write
    the chosen config there (JSON) when the target is met. Raises :class:`AnalyzeError` when the
    target cannot be met even at the strictest setting (the runs are probably not healthy).
    """
    from earlywarn.analyze import AnalyzeError, check_baseline, load_config, read_runs
    from earlywarn.analyze.hygiene import check_key_map, clean
    from earlywarn.analyze.replay import replay

    try:
        target = float(target_rate)
    except (TypeError, ValueError):
        raise AnalyzeError(f"target rate {target_rate!r}: use a number of false alarms per 10,000 steps >= 0") from None
    if not (target >= 0 and math.isfinite(target)):
        raise AnalyzeError(f"target rate {target_rate!r}: use a number of false alarms per 10,000 steps >= 0")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise AnalyzeError(f"margin {margin!r}: use an int >= 0 (ladder notches beyond the boundary)")
    base_cfg = load_config(config)
    base = check_baseline(baseline)
    km = check_key_map(key_map)
    runs = [clean(r, km) for r in read_runs(healthy, key_map=km)]
    steps = sum(len(r) for r in runs)
    allowed = target * steps / 1e4
    cache: dict[int, tuple[int, list[dict[str, Any]]]] = {}

    ladder = []
    for sens in LADDER:
        try:
            ladder.append((sens, scaled_config(base_cfg, sens)))
        except ValueError:
            continue  # this sensitivity breaks an invariant of the config: not a candidate
    if not ladder:
        raise AnalyzeError("no sensitivity setting gives a valid detector config from the starting config")

    def evaluate(k: int) -> tuple[int, list[dict[str, Any]]]:
        if k not in cache:
            cfg = ladder[k][1]
            alarms = []
            for r in runs:
                for ev in replay(r, cfg, base).alerts:
                    if ev.level >= Level.WARNING:
                        alarms.append({"run": r.raw.label, "step": ev.step, "level": str(ev.level),
                                       "signal": ev.signal or str(ev.kind)})
            cache[k] = (len(alarms), alarms)
        return cache[k]

    lo, hi = 0, len(ladder) - 1
    if evaluate(hi)[0] > allowed:
        n = evaluate(hi)[0]
        raise AnalyzeError(
            f"no setting meets {target:g} false alarms per 10k steps: even the strictest (sensitivity "
            f"{ladder[hi][0]}) raises {n} warning(s) on {steps} steps; are these runs healthy? (earlywarn analyze shows where)"
        )
    if evaluate(lo)[0] <= allowed:
        hi = lo
    else:
        while hi - lo > 1:  # invariant: lo fails, hi meets the target
            mid = (lo + hi) // 2
            if evaluate(mid)[0] <= allowed:
                hi = mid
            else:
                lo = mid
    k = min(hi + margin, len(ladder) - 1)
    n, alarms = evaluate(k)
    cfg = ladder[k][1]
    tried = [{"sensitivity": ladder[i][0], "false_alarms": cache[i][0],
              "rate_per_10k": round(1e4 * cache[i][0] / max(1, steps), 4)} for i in sorted(cache)]
    result = CalibrationResult(
        config=cfg, sensitivity=ladder[k][0], target_rate=target, false_alarms=n, steps=steps,
        runs=[r.raw.label for r in runs], met=n <= allowed, tried=tried, alarms=alarms,
    )
    if out is not None:
        try:
            cfg.to_file(out)
        except OSError as e:
            raise AnalyzeError(f"{out}: cannot write the config ({e.strerror})") from None
    return result
