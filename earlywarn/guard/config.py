"""``WatchConfig``: the options of :func:`earlywarn.watch` (validated at construction)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from earlywarn.detect import DetectorConfig
from earlywarn.metrics import MetricsConfig
from earlywarn.policy import PolicyConfig
from earlywarn.recover import RecoveryConfig
from earlywarn.sinks import Sink

_MODES = ("auto", "sync", "async")


@dataclass(kw_only=True)
class WatchConfig:
    """Options of :func:`earlywarn.watch`. Every default protects; options only tune."""

    mode: str = "auto"
    """``"sync"``: one batched host read per step, before the step (spikes can be skipped too).
    ``"async"``: no host read on the hot path; the fused optimizer skips non-finite steps on the
    device and the detector sees each step late -- one step, more when the host runs ahead
    (needs fused Adam/AdamW/SGD; a finite spike cannot be skipped: its update is applied before
    its statistics arrive). ``"auto"``: async when the optimizer is fused and every parameter is
    on CUDA, else sync."""
    group_by: Any = "module"
    """What a layer is: ``"module"`` (owning module), ``"depth:N"`` / ``N`` (module path cut to N
    components), or a function ``param_name -> layer_name``."""
    name: str | None = None
    """What this watcher's console lines, events and tracker runs are called when a process has
    several (a GAN's generator and discriminator). ``None``: nothing while it is the only one;
    with several, the model's class name (numbered when two share it)."""
    detector: DetectorConfig | str | os.PathLike | None = None
    """Detector thresholds, or a path to a config written by ``earlywarn calibrate``."""
    baseline: Mapping[str, float] | None = None
    """Prior typical values (e.g. ``{"grad_norm": 0.2}``) when resuming a run without history."""
    policy: PolicyConfig | None = None
    """How alerts map to actions (cooldowns, rewind limits)."""
    recovery: RecoveryConfig | None = None
    """Snapshots, checkpoints, rewind-and-skip."""
    sinks: Sequence[str | Sink] | None = None
    """Where metrics and events go; ``None`` = console + JSONL + embedded MLflow (see README)."""
    sink_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-sink options keyed by sink name, e.g. ``{"wandb": {"project": "x"}}``."""
    metrics: MetricsConfig | None = None
    """Which metrics go to the sinks and how often per-layer series are logged."""
    dry_run: bool = False
    """Watch without acting: everything is detected, judged, alerted and logged, and what
    earlywarn *would* have done (skip, clip, repair, rewind, learning rate held, halt) is reported
    as the event it would have made -- its message opens with ``"would have (dry run): "``, its
    ``values["dry_run"]`` is 1, and the trackers count it as ``would_<kind>`` -- but nothing is
    done: every update is applied as the loop asks, no state is written, no learning rate changed,
    nothing halts. The run's tensors are bit for bit those of the run without earlywarn. Snapshots
    and checkpoints are still taken (they only read, and cost what they would). How a team adopts
    earlywarn on a run that matters: watch it first, read what it would have done, then turn it on."""

    def __post_init__(self) -> None:
        if not isinstance(self.dry_run, bool):
            raise ValueError(f"dry_run={self.dry_run!r}: use True (watch without acting) or False")
        if self.mode not in _MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {', '.join(_MODES)}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(f"name={self.name!r}: give a non-empty string (e.g. 'generator'), or None")
        self._check_sinks()
        if self.baseline is not None:
            if not isinstance(self.baseline, Mapping):
                raise TypeError(f"baseline= takes {{signal: typical value}}, e.g. {{'grad_norm': 0.2}}; got {self.baseline!r}")
            for k, v in self.baseline.items():
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                if not isinstance(k, str) or not ok:
                    raise ValueError(f"baseline[{k!r}]={v!r}: a baseline is a typical value of that signal, "
                                     "a finite number > 0 (e.g. {'grad_norm': 0.2, 'loss': 2.3})")
        if isinstance(self.detector, (str, os.PathLike)):
            self.detector = DetectorConfig.from_file(self.detector)
        for name, typ in (("detector", DetectorConfig), ("policy", PolicyConfig),
                          ("recovery", RecoveryConfig), ("metrics", MetricsConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, typ):
                raise TypeError(f"{name}= takes an earlywarn {typ.__name__}, got {type(value).__name__}")

    def _check_sinks(self) -> None:
        if isinstance(self.sinks, (str, Sink)):
            raise TypeError(f"sinks= takes a list of sink names or Sink instances, got {self.sinks!r}: "
                            f"write sinks=[{self.sinks!r}]")
        if self.sinks is not None:
            if not isinstance(self.sinks, Sequence):
                raise TypeError(f"sinks= takes a list of sink names or Sink instances, got {type(self.sinks).__name__}")
            for i, spec in enumerate(self.sinks):
                if not isinstance(spec, (str, Sink)):
                    raise TypeError(f"sinks[{i}]={spec!r}: a sink is a registered name (e.g. 'console', "
                                    "'jsonl', 'mlflow', 'wandb', 'webhook') or an earlywarn.sinks.Sink instance")
        if not isinstance(self.sink_options, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Mapping) for k, v in self.sink_options.items()):
            raise TypeError("sink_options= takes {sink name: {option: value}}, e.g. "
                            f"{{'mlflow': {{'experiment': 'x'}}}}; got {self.sink_options!r}")


OPTION_NAMES = tuple(f.name for f in fields(WatchConfig))
