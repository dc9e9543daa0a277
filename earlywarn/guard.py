"""The gradient guard behind ``earlywarn.watch(model, optimizer)``: the one line that guards a training run.

The watcher replaces ``optimizer.step`` on that one optimizer instance (and ``scaler.step`` when a
GradScaler is given). At each optimizer step, before the optimizer writes anything, it:

1. computes per-layer squared gradient norms on the device (``capture.gradstats``), plus the
   reported loss, into one small vector;
2. moves that vector to the host once (sync mode) or one step late (async mode);
3. skips the step when any gradient is non-finite (fused Adam/AdamW: ``found_inf`` on the device,
   no sync; other optimizers: ``step()`` is simply not called -- never "multiply by 0");
4. feeds the detector, asks the policy what to do, and runs the actions (checkpoint, rewind,
   repair, halt) and the sinks.

``detach()`` puts everything back as it was.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from earlywarn.capture.clipping import observe_clipping, unclip
from earlywarn.capture.gradstats import GradStats
from earlywarn.capture.grouping import GroupBy, build_layer_map
from earlywarn.capture.hostread import LateReader, SyncReader
from earlywarn.capture.updates import learning_rate
from earlywarn.detect import DetectorConfig, Observation, StreamingDetector
from earlywarn.events import ALERT_KINDS, Event, Kind, Level
from earlywarn.metrics import MetricsConfig, StepLevels, StepMetrics, sanitize_key
from earlywarn.policy import Action, Policy, PolicyConfig
from earlywarn.recover import Halt, Recovery, RecoveryConfig
from earlywarn.recover._state import fence_copies
from earlywarn.recover.ema import averaged_copies_warning  # issue 22
from earlywarn.recover.statecheck import StateCheck  # issue 22: the optimizer state checked every step
from earlywarn.sinks import Sink
from earlywarn.sinks.base import takes_metrics
from earlywarn.sinks.defaults import build_sinks, default_sink_specs

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
    group_by: GroupBy = "module"
    """What a layer is: ``"module"`` (owning module), ``"depth:N"`` / ``N`` (module path cut to N
    components), or a function ``param_name -> layer_name``."""
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

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {', '.join(_MODES)}")
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


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    # torch's fused Adam/AdamW/SGD honour `optimizer.found_inf` inside the kernel: a sync-free skip.
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
        return False
    return all(bool(g.get("fused")) for g in optimizer.param_groups)


def _onto(t: torch.Tensor, dev: torch.device, dt: torch.dtype) -> torch.Tensor:
    """A scalar onto the statistics vector's device without making the host wait."""
    if t.device == dev:
        return t.to(dt).reshape(1)
    if t.device.type == "cpu" and dev.type == "cuda":
        # A host value (report_loss(float)): a fill kernel takes it as an argument. Copying a
        # pageable tensor with non_blocking=True may be synchronous after all.
        return torch.full((1,), float(t), dtype=dt, device=dev)
    return t.to(dev, dt, non_blocking=dev.type == "cuda").reshape(1)  # non-blocking only toward CUDA


class _Tag:
    """What the host needs to know about a step whose vector may arrive a step late."""

    __slots__ = ("step", "batch", "loss_reported", "counts", "inv_scale", "gen", "users", "clip")

    def __init__(self, step: int, batch: Any, loss_reported: bool):
        self.step = step
        self.batch = batch  # drawn for this step: what blame and quarantine name, however late it is read
        self.loss_reported = loss_reported
        self.users: tuple[tuple[str, int], ...] = ()  # (user signal, its index in the vector) reported this step
        self.counts: np.ndarray | None = None
        self.inv_scale: torch.Tensor | None = None  # for the rare-path recount (sync mode)
        self.gen = 0  # the watcher's rewind generation when the step ran (async mode)
        self.clip: torch.Tensor | None = None  # the loop's clip factor, undone in the statistics (and the recount)


class Watcher:
    """Owns the hook on one optimizer. Build it with :func:`earlywarn.watch`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: WatchConfig,
        *,
        scaler: "torch.amp.GradScaler | None" = None,
        loader: Any = None,
        scheduler: Any = None,
        extra_state: Mapping[str, Any] | None = None,
    ):
        if getattr(optimizer, "_earlywarn_watcher", None) is not None:
            raise RuntimeError(
                "this optimizer is already watched by earlywarn: call .detach() on the first watcher "
                "(or reuse it) before calling earlywarn.watch again"
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler= takes a torch.amp.GradScaler, got {type(scaler).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "earlywarn cannot guard torch.optim.LBFGS: its step() evaluates the closure up to "
                "max_iter times and moves the parameters between evaluations, so a NaN gradient met "
                "inside the line search is applied before any guard could see it. Train LBFGS "
                "without earlywarn (its own tolerance checks stop on non-finite losses), or use a "
                "first-order optimizer")
        for what, obj in (("scheduler", scheduler), *((f"extra_state[{k!r}]", v) for k, v in (extra_state or {}).items())):
            if obj is not None and not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(
                    f"{what}= takes an object with state_dict() and load_state_dict() (e.g. a "
                    f"torch.optim.lr_scheduler.LRScheduler), got {type(obj).__name__}: earlywarn "
                    "restores it on a rewind")
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        self.config = config
        self.layer_map = build_layer_map(model, optimizer, config.group_by)
        self.layer_names: tuple[str, ...] = self.layer_map.layer_names
        self._fused = _is_fused(optimizer)
        devices = {p.device for p in self.layer_map.params}
        self._all_cuda = all(d.type == "cuda" for d in devices)
        if config.mode == "async" and not self._fused:
            raise ValueError(
                f"mode='async' needs an optimizer that can skip on the device, but "
                f"{type(optimizer).__name__} is not fused: pass fused=True to torch.optim.Adam/AdamW/SGD, "
                "or use mode='sync' (one host read per step)"
            )
        if config.mode == "async" and not self._all_cuda and any(d.type == "cuda" for d in devices):
            raise ValueError(
                "mode='async' needs every parameter on a CUDA device, but some are on "
                f"{sorted(str(d) for d in devices if d.type != 'cuda')} (offloaded): the fused step would copy "
                "the device skip flag to them with non_blocking=True and read it before it lands. Use mode='sync'"
            )
        # Async only when every parameter is on CUDA (params[0] alone says nothing about the rest).
        late = config.mode == "async" or (config.mode == "auto" and self._fused and self._all_cuda)
        self.mode = "async" if late else "sync"
        dist = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        # Alone, a step is judged as soon as its vector has landed; under torch.distributed
        # exactly two steps late on every rank (a rewind or a repair issues collectives).
        self._reader = LateReader(fixed_lag=2 if dist else None) if late else SyncReader()
        # Async mode cannot recount a layer after the fact: exact (float64) norms from the start.
        self._stats = GradStats(self.layer_map, exact=late)
        # the loop's clip_grad_norm_ (between backward and this step): its factor, to read the raw norms
        self._clipping = observe_clipping(self.layer_map.params)
        self._state_check = StateCheck(optimizer)  # issue 22: the state's finiteness, the vector's last entry
        self._flags: tuple[torch.Tensor, torch.Tensor] | None = None  # found_inf constants (sync, fused)
        self._gen = 0  # async: bumped by a rewind; steps of an older generation were undone in flight

        self._dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self._dist else 0
        self.world_size = torch.distributed.get_world_size() if self._dist else 1
        # One all-reduce of the statistics vector per step, so every rank feeds the detector the
        # same vector and takes the same decisions (capture/distributed.py).
        self._reducer = None
        if self._dist and self.world_size > 1:
            from earlywarn.capture.distributed import StatsReducer

            self._reducer = StatsReducer(self.layer_map, self.world_size)

        self.detector = StreamingDetector(config.detector, self.layer_names, baseline=config.baseline)
        self.policy = Policy(config.policy or PolicyConfig())
        if late:
            ignored = [f.name for f in dataclasses.fields(self.policy.cfg) if f.name.startswith("on_")
                       and f.name != "on_nonfinite_grad" and getattr(self.policy.cfg, f.name) is Action.SKIP]
            if ignored:
                warnings.warn(f"earlywarn: PolicyConfig {', '.join(f'{n}=skip' for n in ignored)} cannot act in "
                              "async mode: a finite step's update is applied before its statistics arrive "
                              "(only non-finite steps are skipped, on the device); use mode='sync' to skip spikes")
        self.metrics_config = config.metrics or MetricsConfig()
        self.events: list[Event] = []
        self.counters: dict[str, int] = {
            "steps": 0, "skipped_steps": 0, "repaired_steps": 0, "rewinds": 0, "checkpoints": 0,
            "nonfinite_steps": 0, "alerts_info": 0, "alerts_warning": 0, "alerts_critical": 0,
        }
        self._step_levels = StepLevels()  # alert_level of the row being built (see _emit, _log_metrics)
        self._step = 0  # the training step (a rewind sets it back; events and metrics: _log_offset)
        self._nan: dict[tuple, torch.Tensor] = {}  # the vector's "not reported" entry, per (device, dtype)
        self._loss: torch.Tensor | None = None  # sum of the losses reported since the last step
        self._loss_count = 0
        self._user_names: list[str] = []  # user signals ("user/<name>"), in the order first reported
        self._user_acc: dict[str, list] = {}  # name -> [sum, count] of the values reported since the last step
        self._alert_step: int | None = None  # step of the latest alert, any level
        self._unclean_step: int | None = None  # ... of warning-or-worse ones: no snapshot for clean_window
        self._incident_step: int | None = None  # ... of those that are an incident (not a skipped bad step)
        self._incident_onset: int | None = None  # first abnormal step of the incident in progress
        self._rewind_callbacks: list[Callable[[Any], None]] = []
        self._input_hook: Any = None
        self._elevated = False  # the latest step judged had a gradient signal elevated (a spike)
        # Events and metrics go out on the run's own clock, which never goes back: a rewind sets
        # the training step back (ew.step), not the step trackers and logs count (log = step + offset).
        self._log_offset = 0
        self._scaler_observed: tuple[bool] | None = None
        self._deferring = False
        self._recorded: PendingStep | None = None
        self._detached = False
        self._step_lr: dict[int, float | None] = {}  # step -> its LR, until its vector is read

        self.sinks: list[Sink] = []  # built last: a config error must not leave a tracker run open
        ema_note = averaged_copies_warning(model, extra_state, depth=3)  # issue 22: an EMA not in extra_state
        if ema_note:
            warnings.warn(ema_note, RuntimeWarning, stacklevel=3)

        extra = {"earlywarn_detector": self.detector, "earlywarn_policy": self.policy, "earlywarn_watcher": _Counters(self)}
        extra.update(extra_state or {})
        self.recovery = Recovery(
            model, optimizer, config.recovery or RecoveryConfig(),
            scheduler=scheduler, scaler=self.scaler, loader=loader, extra_state=extra, emit=self._emit,
            # A rewind restores the model and the detector, not the policy's rewind budget or our counters.
            keep_on_rewind=("earlywarn_policy", "earlywarn_watcher"),
            # Our own bookkeeping follows the judgement of a step (late in async mode), not its update.
            late_state=("earlywarn_detector", "earlywarn_policy", "earlywarn_watcher"),
        )

        # Record the real backward order once (first backward), to name the first bad layer.
        self._backward_rank: np.ndarray | None = None
        self._grad_seq: list[int] = []
        self._order_hooks = [
            p.register_post_accumulate_grad_hook(self._make_order_hook(i))
            for i, p in enumerate(self.layer_map.params) if p.requires_grad
        ]

        # Install: an instance attribute shadows the class's step; detach() removes it again.
        # It is the optimizer's own bound method (see _watched_step), so wrappers that rebind
        # `optimizer.step.__func__` to the optimizer (LR schedulers do) keep working.
        below = _step_below(optimizer)
        # the real step, with the learning rate a recurrence may lower applied around it
        self._orig_step = self.recovery.wrap_step(
            below if below is not None else types.MethodType(type(optimizer).step, optimizer))
        optimizer.step = types.MethodType(_watched_step_fn(), optimizer)  # type: ignore[method-assign]
        optimizer._earlywarn_watcher = self  # type: ignore[attr-defined]
        if self.scaler is not None:
            self._had_scaler_attr = "step" in self.scaler.__dict__
            self._prev_scaler_step = self.scaler.__dict__.get("step")
            self._orig_scaler_step = self.scaler.step
            self.scaler.step = self._guarded_scaler_step  # type: ignore[method-assign]

        try:
            specs = config.sinks if config.sinks is not None else default_sink_specs()
            self.sinks = build_sinks(specs, config.sink_options, rank=self.rank)
            # the snapshot cadence and host-RAM budget, once (a note on the console; a warning if short)
            console = next((s for s in self.sinks if s.name == "console" and hasattr(s, "write")), None)
            self.recovery.report_plan(self._step, write=None if console is None else console.write)
            if not self.recovery.data.restorable and self.recovery.config.fingerprint_inputs:
                # no loader names the batches: fingerprint the model's inputs (on the device, no sync)
                self._input_hook = model.register_forward_pre_hook(_input_fingerprint(self), with_kwargs=True)
            # State that was poisoned before we were attached (a resumed checkpoint) is repaired now.
            if optimizer.state:
                report = self.recovery.repair(self._step)
                if report.repaired:
                    self.counters["repaired_steps"] += 1
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        """The step the next ``optimizer.step()`` is: steps taken on the current trajectory,
        skipped ones included. A rewind sets it back to the restored snapshot's step + 1, so a
        loop that computes its schedule from it follows the model (nanoGPT:
        ``iter_num = ew.step`` at the top of the loop). In async mode the steps still in flight
        at a rewind are undone with it (never judged nor logged). Events and tracker metrics
        keep the run's own clock, which never goes back: after a rewind from step 152 to the
        snapshot of step 125, ``step`` is 126 and the next metrics are logged at 153."""
        return self._step

    def on_rewind(self, callback: Callable[[Any], None]) -> Callable[[Any], None]:
        """Call ``callback(report)`` after every rewind (an :class:`earlywarn.recover.RewindReport`:
        ``report.resume_step`` is the step training continues at, ``report.lost_steps`` ...), so
        loop-owned state can follow: ``ew.on_rewind(lambda r: sched.resync(r.resume_step))``.
        It runs inside ``optimizer.step()``; returns ``callback`` (usable as a decorator)."""
        if not callable(callback):
            raise TypeError(f"on_rewind takes a callable, got {type(callback).__name__}")
        self._rewind_callbacks.append(callback)
        return callback

    def report_batch(self, batch: Any) -> None:
        """Tell earlywarn this step's batch (a tensor, or tuples / lists / dicts of them; call
        once per micro-batch). Only a fingerprint is kept, computed on the device with no host
        sync; skipped and quarantined batches are named by it when no loader can name them.
        The first call replaces the automatic fingerprint of the model's inputs."""
        fps = self.recovery.fingerprints
        if not fps.explicit:
            fps.use_explicit()
            if self._input_hook is not None:
                self._input_hook.remove()
                self._input_hook = None
        fps.observe(batch)

    @property
    def lr_factor(self) -> float:
        """The factor earlywarn applies to the learning rate around each optimizer step now
        (1.0 unless a recurrence lowered it, ``RecoveryConfig(on_recurrence="lower_lr")``)."""
        return self.recovery.lr_factor

    def report_loss(self, loss: torch.Tensor | float) -> None:
        """Tell earlywarn this step's loss. A tensor is kept on the device (no host sync) and read
        with the gradient statistics in the step's one transfer.

        Under gradient accumulation call it for every micro-batch: the losses reported between
        two optimizer steps are averaged (on the device), and one NaN micro-batch makes the step's
        loss NaN. The detector works on ratios, so a constant factor (nanoGPT reports
        ``loss / gradient_accumulation_steps``) changes nothing."""
        value = _scalar(loss, "report_loss", "loss")
        if self._loss is None:
            self._loss, self._loss_count = value, 1
        else:
            if value.device != self._loss.device:
                value = value.to(self._loss.device)
            self._loss, self._loss_count = self._loss + value, self._loss_count + 1

    def report(self, name: str, value: torch.Tensor | float) -> None:
        """Tell earlywarn a scalar of your own for this step, e.g. the largest attention logit
        (``ew.report("attn_logit_max", att.detach().abs().amax())``). A tensor stays on the device
        (no host sync) and rides in the step's one statistics vector, as the loss does.

        The detector tracks it as a run-level signal ``user/<name>``: an isolated spike is info;
        an escalation or a sustained rise (``DetectorConfig.user_alone_h``), or a NaN / inf
        value, is a warning that names it. Report a positive magnitude (it is judged in log
        space; values <= 0 are not tracked). Values reported between two optimizer steps are
        averaged; a name not reported at a step is absent there. Logged as
        ``earlywarn/user/<name>``, which ``earlywarn analyze`` reads back as the same signal.
        Under ``torch.distributed`` report the same names on every rank (the value is averaged
        over ranks)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"report(name, value) needs a non-empty name, got {name!r}")
        key = "user/" + sanitize_key(name.strip())
        value = _scalar(value, "report", "value")
        acc = self._user_acc.get(key)
        if acc is None:
            if key not in self._user_names:
                self._user_names.append(key)  # a new slot in the statistics vector from this step on
            self._user_acc[key] = [value, 1]
        else:
            if value.device != acc[0].device:
                value = value.to(acc[0].device)
            acc[0], acc[1] = acc[0] + value, acc[1] + 1

    def summary(self) -> dict[str, int]:
        return dict(self.counters)

    def state_dict(self) -> dict[str, Any]:
        """The watcher's state (detector, policy, recovery, counters, step) in plain types and
        tensors: ``torch.save`` it and ``torch.load(path)`` (``weights_only=True``) reads it back."""
        return _weights_only_safe({
            "step": self._step, "counters": dict(self.counters),
            "detector": self.detector.state_dict(), "policy": self.policy.state_dict(),
            "recovery": self.recovery.state_dict()})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = _from_saved(state)
        self._step = int(state["step"])
        self.counters.update({k: int(v) for k, v in state["counters"].items()})
        self.detector.load_state_dict(state["detector"])
        self.policy.load_state_dict(state["policy"])
        self.recovery.load_state_dict(state["recovery"])

    def flush(self, timeout: float = 10.0) -> None:
        """Process a step still in flight (async mode) and push buffered sink data out, waiting
        at most ``timeout`` seconds for all sinks together (a tracker that is down answers at
        once; its records stay buffered)."""
        for vec, tag in self._reader.drain():
            self._process(vec, tag)
        self.recovery.settle()  # a snapshot still being copied / confirmed
        levels = self._step_levels
        if levels.halted and levels.step is not None:
            # A halted step never reached _log_metrics: its row (level, counters) is logged here.
            self._log_metrics(levels.step - self._log_offset, None)  # levels count on the run's clock
        deadline = time.monotonic() + timeout
        for sink in self.sinks:
            _safe(sink, "flush", max(deadline - time.monotonic(), 0.0))

    def detach(self) -> None:
        """Restore the optimizer (and scaler) exactly as they were. Safe to call twice."""
        if self._detached:
            return
        try:
            for vec, tag in self._reader.drain():
                self._process(vec, tag)
        finally:
            self._detached = True
            self._clipping.close()
            for h in self._order_hooks:
                h.remove()
            self._order_hooks = []
            if self._input_hook is not None:
                self._input_hook.remove()
                self._input_hook = None
            opt = self.optimizer
            if _is_watched_step(opt.__dict__.get("step")):
                below = opt.__dict__.pop(_BELOW, None)
                if below is not None:
                    opt.step = below  # type: ignore[method-assign]
                else:
                    del opt.step
            # else: someone wrapped our step (an LR scheduler created later); it now passes through
            # to the step that was there before earlywarn (kept under _BELOW; None: the class's).
            opt.__dict__.pop("_earlywarn_watcher", None)
            if self.scaler is not None and self.scaler.__dict__.get("step") == self._guarded_scaler_step:
                if self._had_scaler_attr:
                    self.scaler.step = self._prev_scaler_step  # type: ignore[method-assign]
                else:
                    del self.scaler.step

    def close(self) -> None:
        """Detach and finish every sink (flushing with a timeout)."""
        try:
            self.detach()
        finally:
            for sink in self.sinks:  # all at once: two trackers that are down cost one wait, not two
                if hasattr(sink, "begin_finish"):
                    _safe(sink, "begin_finish")
            for sink in self.sinks:
                try:
                    sink.finish()
                except Exception as exc:  # a tracker must never kill training
                    warnings.warn(f"earlywarn: sink {sink.name!r} failed to finish: {_redact(sink, exc)}")

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the hot path
    def _make_order_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._grad_seq.append(index)
        return hook

    def _settle_backward_order(self) -> None:
        if self._backward_rank is not None:
            return
        n = self.layer_map.num_layers
        rank = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        for seq, p_index in enumerate(self._grad_seq):
            layer = self.layer_map.layer_of[p_index]
            rank[layer] = min(rank[layer], seq)
        # Layers never seen keep their registration-based position.
        unseen = rank == np.iinfo(np.int64).max
        rank[unseen] = len(self._grad_seq) + np.arange(n)[unseen]
        self._backward_rank = rank
        for h in self._order_hooks:
            h.remove()
        self._order_hooks = []
        self._grad_seq = []

    def _device_vector(self, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor, bool, tuple, torch.Tensor | None]:
        # [per-layer squared norms..., loss, loss scale, user signals...]: one vector, one transfer.
        fence_copies()  # a snapshot still copying the optimizer's tensors is done before this step writes them
        layer_sq = self._stats.layer_sq_norms(inv_scale)
        dev, dt = layer_sq.device, layer_sq.dtype
        clip = self._clipping.take(dev, dt)
        if clip is not None:  # the loop clipped these gradients: the detector reads them as they were
            layer_sq = unclip(layer_sq, clip)
        nan = self._nan.get((dev, dt))
        if nan is None:  # made once: a fill kernel per step is host work for nothing
            nan = self._nan[(dev, dt)] = torch.full((1,), math.nan, dtype=dt, device=dev)
        loss = self._loss
        reported = loss is not None
        if reported and self._loss_count > 1:
            loss = loss / self._loss_count  # micro-batch losses since the last step: their mean
        self._loss, self._loss_count = None, 0
        scale = self.scaler._scale if self.scaler is not None else None
        parts = [layer_sq, _onto(loss, dev, dt) if reported else nan,
                 _onto(scale, dev, dt) if scale is not None else nan]
        users: tuple[tuple[str, int], ...] = ()
        if self._user_names:
            # one slot per user signal ever reported (a stable layout); NaN where not reported now
            given = []
            for j, key in enumerate(self._user_names):
                acc = self._user_acc.get(key)
                if acc is None:
                    parts.append(nan)
                else:
                    parts.append(_onto(acc[0] / acc[1] if acc[1] > 1 else acc[0], dev, dt))
                    given.append((key, len(layer_sq) + 2 + j))
            self._user_acc = {}
            users = tuple(given)
        parts.append(self._state_check.flag(dev, dt))  # issue 22: the optimizer state's finiteness, last
        vec = torch.cat(parts)
        if self._reducer is not None:
            vec = self._reducer.reduce(vec)
        # the LR this step is taken with (a host number: no device work), kept until the step's
        # vector is read (a step later in async mode, when the scheduler has moved on)
        self._step_lr[self._step] = learning_rate(self.optimizer)
        return vec, reported, users, clip

    def _begin(self, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor, _Tag]:
        self._settle_backward_order()
        vec, reported, users, clip = self._device_vector(inv_scale)
        tag = _Tag(self._step, self.recovery.last_batch(), reported)
        tag.users = users
        tag.inv_scale, tag.gen, tag.clip = inv_scale, self._gen, clip
        self.recovery.fingerprints.bind(self._step)  # what the forward passes since the last step saw
        self._step += 1
        return vec, tag

    def _step_with_closure(self, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(closure)``: the closure runs backward, so it is evaluated first and the
        guard decides on the gradients it produced. The optimizer then gets the evaluated loss
        (torch.optim's optimizers evaluate a closure once; LBFGS, which evaluates it many times,
        is refused at watch()); a second call evaluates the real closure again."""
        closure = args[0] if args else kwargs.get("closure")
        if closure is None or self._detached or self._scaler_observed is not None:
            return self._guarded_step(*args, **kwargs)
        with torch.enable_grad():
            loss = closure()
        done = [False]

        def evaluated() -> Any:
            if done[0]:
                with torch.enable_grad():
                    return closure()
            done[0] = True
            return loss

        kwargs = {k: v for k, v in kwargs.items() if k != "closure"}
        out = self._guarded_step(evaluated, *args[1:], **kwargs)
        return loss if out is None else out

    def _guarded_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._detached:
            return self._orig_step(*args, **kwargs)
        if self._scaler_observed is not None:
            # The scaler wrapper already observed (and decided) this step.
            skip = self._scaler_observed[0]
            self._scaler_observed = None
            return None if skip else self._orig_step(*args, **kwargs)
        opt = self.optimizer
        grad_scale = getattr(opt, "grad_scale", None)  # set by GradScaler for fused optimizers
        inv_scale = grad_scale.double().reciprocal() if isinstance(grad_scale, torch.Tensor) else None
        vec, tag = self._begin(inv_scale)

        if self._fused:
            if self.mode == "async":
                # Device-side skip flag: the fused kernel reads it, no host sync needed. The layer
                # norms are exact (float64), so it is set by NaN/Inf elements only.
                layer_sq = vec[:self.layer_map.num_layers]
                found = (~torch.isfinite(layer_sq.sum()) | (layer_sq.amax() > _SQ_OVERFLOW)).to(torch.float32)
                ready = self._reader.push(vec, tag)  # this step's copy starts; earlier ones that landed
                ret = self._apply(found, args, kwargs, record=tag)
                for host, late_tag in ready:  # judged now, after this step's update was queued
                    self._process(host, late_tag)
                return ret
            host = self._read_now(vec, tag)
            decision = self._decide(host, tag)
            if decision.rewind:
                self._run_rewind_or_repair(tag, decision)
                return None
            ret = self._apply(self._skip_flag(decision.skip), args, kwargs)
            self._after_step(tag, decision)
            return ret

        host = self._read_now(vec, tag)
        decision = self._decide(host, tag)
        if decision.rewind:
            self._run_rewind_or_repair(tag, decision)
            return None
        ret = None if decision.skip else self._apply(None, args, kwargs)
        self._after_step(tag, decision)
        return ret

    def _apply(self, found: torch.Tensor | None, args: Any, kwargs: Any, record: "_Tag | None" = None) -> Any:
        """Run the real optimizer step (fused: with the device skip flag), or record it when the
        step is being decided ahead of time (:meth:`decide_step`). ``record``: async mode, the
        step whose update this is (recovery records it once it is queued)."""
        if self._deferring:
            self._recorded = PendingStep(apply=True, found_inf=found, tag=record)
            return None
        ret = self._fused_step(found, args, kwargs) if found is not None else self._orig_step(*args, **kwargs)
        if record is not None and record.gen == self._gen:
            self.recovery.record_step(record.step, maybe_clean=self._maybe_clean(record.step),
                                      building=self._building_at(record.step))
        return ret

    def _fused_step(self, found: torch.Tensor, args: Any, kwargs: Any) -> Any:
        opt = self.optimizer
        prior = getattr(opt, "found_inf", None)  # GradScaler's own flag, for fused optimizers
        if isinstance(prior, torch.Tensor):
            # GradScaler's found_inf is a *sum* over devices (2.0 on two); the fused kernels skip
            # only when it == 1 (and _fused_adam then subtracts it from `step`): 0 or 1, nothing else.
            found = ((found + prior.to(found.device, found.dtype)) > 0).to(found.dtype)
        if self._sgd_first_step() and bool(found.item()):
            # A skipped first fused-SGD step leaves the momentum buffers torch just allocated
            # uninitialised (empty_like): decide on the host (one read, first step only).
            return None
        opt.found_inf = found  # type: ignore[attr-defined]
        try:
            return self._orig_step(*args, **kwargs)
        finally:
            if prior is None:
                del opt.found_inf
            else:
                opt.found_inf = prior  # type: ignore[attr-defined]

    def _sgd_first_step(self) -> bool:
        opt = self.optimizer
        return (isinstance(opt, torch.optim.SGD) and not opt.state
                and any(g.get("momentum", 0) != 0 for g in opt.param_groups))

    def _skip_flag(self, skip: bool) -> torch.Tensor:
        """found_inf from the host's decision (sync mode): constants made once, no copy per step.
        On the CPU unless every parameter is on CUDA: the fused step copies found_inf to each
        parameter's device with non_blocking=True, and a non-blocking copy to the CPU is read
        before it lands."""
        if self._flags is None:
            dev = self._stats.device if self._all_cuda else torch.device("cpu")
            self._flags = (torch.zeros((), device=dev), torch.ones((), device=dev))
        return self._flags[int(skip)]

    def _building_at(self, step: int) -> bool:
        # An episode may be building at `step`: an alert of any level within clean_window steps
        # (after a rewind, through the steps that come again: their step is below the alert's),
        # or a gradient elevated at the latest step judged (async mode: a step or two back).
        a = self._alert_step
        return (a is not None and step - a <= self.recovery.config.clean_window) or self._elevated

    def _maybe_clean(self, step: int) -> bool:
        # What is known when a step's update is queued (async mode: earlier steps judged so far).
        return self._unclean_step is None or step - self._unclean_step > self.recovery.config.clean_window

    # ------------------------------------------------------------------ decide now, apply later
    def decide_step(self) -> "PendingStep":
        """Take this step's statistics and decision now; apply them with :meth:`apply_step`.

        For trainers that clip gradients between backward and ``optimizer.step`` (Lightning):
        call it after backward and before clipping, so the statistics see the raw gradients.
        Skips, rewinds and halts are decided here exactly as inside ``optimizer.step``.
        """
        self._deferring, self._recorded = True, PendingStep(apply=False, found_inf=None)
        try:
            self._guarded_step()
        finally:
            self._deferring = False
        pending, self._recorded = self._recorded, None
        return pending

    def apply_step(self, pending: "PendingStep", *args: Any, **kwargs: Any) -> Any:
        """Apply a step decided by :meth:`decide_step` (a skipped step leaves everything as is)."""
        return self._apply(pending.found_inf, args, kwargs, record=pending.tag) if pending.apply else None

    def _guarded_scaler_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._detached or optimizer is not self.optimizer or self._fused:
            # Fused optimizers: the scaler hands grad_scale/found_inf to step(), which we guard.
            return self._orig_scaler_step(optimizer, *args, **kwargs)
        scaler = self.scaler
        assert scaler is not None
        from torch.amp.grad_scaler import OptState

        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)  # what scaler.step would do first; grads are now unscaled
        vec, tag = self._begin(None)
        host = self._read_now(vec, tag)
        decision = self._decide(host, tag)
        if decision.rewind:
            self._run_rewind_or_repair(tag, decision)
            self._scaler_observed = (True,)
        else:
            # The scaler skips overflow steps itself (and never calls step()); we skip spikes too.
            self._scaler_observed = (decision.skip,)
        try:
            return self._orig_scaler_step(optimizer, *args, **kwargs)
        finally:
            self._scaler_observed = None
            if not decision.rewind:
                self._after_step(tag, decision)

    # ------------------------------------------------------------------ host side
    def _read_now(self, vec: torch.Tensor, tag: _Tag) -> np.ndarray:
        host, _ = self._reader.push(vec, tag)  # the step's one batched host read
        L = self.layer_map.num_layers  # host: [layer_sq (L)..., loss, loss scale, user signals...]
        if not math.isfinite(float(host[:L].sum())):
            # Rare path (a bad step): a second pass for exact per-layer element counts.
            counts = self._stats.layer_nonfinite_counts()
            if self._reducer is not None:  # every rank is on this path (same vector): matched collective
                counts = self._reducer.reduce_counts(counts)
            tag.counts = counts.cpu().numpy()
            overflowed = ~np.isfinite(host[:L]) & (tag.counts == 0)
            if overflowed.any():
                # Every element finite, yet the float32 squared norm overflowed (|g| >~ 1.8e19):
                # a huge finite gradient is a spike, not a non-finite one. Recount in float64.
                exact = self._stats.layer_sq_norms(tag.inv_scale, exact=True)
                if tag.clip is not None:
                    exact = unclip(exact, tag.clip)
                if self._reducer is not None:  # every rank is on this path too
                    pad = torch.full((2,), math.nan, dtype=exact.dtype, device=exact.device)
                    exact = self._reducer.reduce(torch.cat([exact, pad]))[:-2]
                host = host.copy()
                host[:L][overflowed] = exact.cpu().numpy()[overflowed]
        return host

    def _observation(self, host: np.ndarray, tag: _Tag) -> Observation:
        L = self.layer_map.num_layers
        layer_sq = host[:L]
        layer_norms = np.sqrt(layer_sq)
        total = float(np.sqrt(layer_sq.sum()))
        nonfinite = tag.counts if tag.counts is not None else (~np.isfinite(layer_sq)).astype(np.float64)
        extras = {"loss_scale": float(host[L + 1])} if self.scaler is not None else {}
        for key, j in tag.users:
            extras[key] = float(host[j])
        lr = self._step_lr.pop(tag.step, None)
        for k in [k for k in self._step_lr if k < tag.step]:
            del self._step_lr[k]  # steps never read (a rewind dropped them)
        if lr is not None:
            extras["lr"] = lr
        loss = float(host[L]) if tag.loss_reported else None
        return Observation(step=tag.step, grad_norm=total, layer_norms=layer_norms, loss=loss,
                           layer_nonfinite=nonfinite, skipped=not math.isfinite(total),
                           batch=_batch_index(tag.batch), extras=extras)

    def _decide(self, host: np.ndarray, tag: _Tag) -> "_Decision":
        if self._state_check.repair_if_poisoned(float(host[-1]), self.recovery, tag.step):  # issue 22
            self.counters["repaired_steps"] += 1
        obs = self._observation(host, tag)
        alerts = self.detector.observe(obs)
        # the global norm is finite iff every layer's is (and a recount's non-finite elements show in it)
        nonfinite = not math.isfinite(obs.grad_norm) if tag.counts is None else not obs.grad_finite
        loss_bad = obs.loss is not None and not math.isfinite(obs.loss)
        # no layer's square can overflow unless their sum does
        overflow = (not nonfinite and obs.grad_norm * obs.grad_norm > _SQ_OVERFLOW
                    and bool(np.any(host[:self.layer_map.num_layers] > _SQ_OVERFLOW)))
        scan = None
        if loss_bad or (nonfinite and self.scaler is None):
            # Rare path: was anything written? Finite parameters and optimizer state mean the bad
            # step was never applied: one bad batch, skipped, not a reason to rewind.
            scan = self.recovery.scan()
        state_finite = None if scan is None else not (scan.weights_poisoned or scan.state_poisoned)
        # ...unless an incident is in progress (a divergence, a warning): then finite is not fine
        window = self.recovery.config.clean_window
        if self._incident_step is not None and tag.step - self._incident_step <= window:
            state_finite = None if state_finite else state_finite
        actions = set(self.policy.decide(tag.step, alerts, state_finite=state_finite, skipped=overflow))
        decision = _Decision(obs=obs, alerts=alerts, actions=actions,
                             skip=nonfinite or overflow or loss_bad or Action.SKIP in actions,
                             rewind=Action.REWIND in actions, nonfinite=nonfinite, overflow=overflow,
                             loss_bad=loss_bad, scan=scan, bad_batch=bool(state_finite))
        for alert in alerts:
            self._emit(alert)
        for note in self.policy.suppressed:  # an action a critical alert asked for, not taken: say why
            self._emit(Event(step=tag.step, kind=Kind.REWIND, level=Level.WARNING, signal="policy",
                             message=f"{note}: not rewinding; "
                                     + ("the step is skipped" if decision.skip else "the step is applied as usual"),
                             values={"rewound": 0.0}, batch=_batch_index(tag.batch)))
        if Action.HALT in actions:
            why = (self.recovery.recurrence_of(tag.step, _reason(decision)) or self.recovery.lr_trend(tag.step)).rstrip(".")
            self._halt(tag, f"policy halted the run at step {tag.step}: {self.policy.halt_reason or 'configured'}; "
                            f"rewinds so far: {self.recovery.describe_rewinds()}. {why}. "
                            "The instability keeps coming back: lower the learning rate or inspect the quarantined "
                            f"batches in {self.recovery.quarantine_path}, then resume from the last clean checkpoint.")
        if Action.CHECKPOINT in actions and Action.REWIND not in actions:
            # Before this step's update is applied: the run is still clean now. Its CHECKPOINT
            # event (counted and sent to the sinks in _emit) comes from recovery.
            self.recovery.checkpoint(tag.step, reason="warning")
        return decision

    def _after_step(self, tag: _Tag, decision: "_Decision") -> None:
        obs = decision.obs
        if decision.skip:
            self.counters["skipped_steps"] += 1
            self._emit_skip(tag, decision)
            if decision.bad_batch:
                # one bad batch (the state was verified finite, no incident in progress): buffers
                # its forward poisoned (BatchNorm statistics) are copied back; it is never trained
                scan = decision.scan
                if scan is not None and scan.buffers:
                    if self.recovery.repair(tag.step, scan=scan, incident=False).repaired:
                        self.counters["repaired_steps"] += 1
                what = "non-finite loss" if decision.loss_bad else "non-finite gradient"
                self.recovery.quarantine_batch(
                    tag.step, f"{what}: bad batch",
                    note=" (parameters and optimizer state finite: the step was skipped before anything was "
                         "written, nothing rewound)")
        if decision.nonfinite:
            self.counters["nonfinite_steps"] += 1
        window = self.recovery.config.clean_window
        if decision.alerts:
            self._alert_step = tag.step
            # Info spikes that recovered leave snapshots clean; warning-or-worse alerts hold them
            # off for clean_window steps. An incident is such an alert that is not a non-finite
            # step skipped before anything was written (a bad batch): its onset is tracked.
            if any(a.level >= Level.WARNING for a in decision.alerts):
                self._unclean_step = tag.step
            serious = [a for a in decision.alerts if a.level >= Level.WARNING and a.kind not in _SKIPPED_KINDS]
            if serious:
                self._incident_step = tag.step
                onset = _onset(tag.step, serious)
                self._incident_onset = onset if self._incident_onset is None else min(self._incident_onset, onset)
        if self._incident_step is None or tag.step - self._incident_step > window:
            self._incident_onset = None
        clean = self._unclean_step is None or tag.step - self._unclean_step > window
        score = self.detector.score  # computed on demand: once per step, for both uses
        self._elevated = score >= self.detector.cfg.spike_z
        self.counters["steps"] = self._step
        self.recovery.after_step(tag.step, clean=clean and not decision.skip, building=self._building_at(tag.step))
        self._log_metrics(tag.step, obs, score)  # after recovery: its checkpoint or repair counts in this step's row

    def _process(self, host: np.ndarray, tag: _Tag) -> None:
        """Async mode: a step's vector arrived late (its update, and maybe later ones, already
        queued); the device already skipped it if it was non-finite."""
        if tag.gen != self._gen:
            return  # applied on a trajectory a rewind has undone since: never judged (as in sync mode)
        decision = self._decide(host, tag)
        # The device skipped exactly the non-finite steps. A finite step's update was applied
        # before its statistics arrived: a policy SKIP cannot be honoured, nor reported as done.
        decision.skip = decision.nonfinite or decision.overflow  # what the device flag skipped
        if decision.rewind:
            rewinds = self.recovery.rewinds
            self._run_rewind_or_repair(tag, decision)
            if self.recovery.rewinds != rewinds:
                # The steps still in flight belong to the undone trajectory: never judged nor
                # logged (the rewind set the step back to the restored snapshot's, as in sync mode).
                self._gen += 1
            return
        self._after_step(tag, decision)

    def _run_rewind_or_repair(self, tag: _Tag, decision: "_Decision") -> None:
        # Poisoned optimizer state with finite params: repair in place and keep the progress.
        # Anything else (params non-finite, a divergence, a non-finite streak): rewind to the
        # newest clean snapshot taken before the incident began.
        scan = decision.scan  # taken on a non-finite step; a finite divergence needs none here
        triggers = set(self.policy.rewind_triggers)
        lone = not triggers & {"nonfinite_streak", str(Kind.LOSS_DIVERGED), str(Kind.COLLAPSE_RISK)}
        if scan is not None and scan.state_poisoned and not scan.params_poisoned and lone:
            self.recovery.repair(tag.step, scan=scan)
            self.policy.withdraw_rewind()
            self.counters["repaired_steps"] += 1
            decision.skip, decision.bad_batch = True, False  # repaired: not a bad batch to quarantine
            self._after_step(tag, decision)
            return
        self.counters["nonfinite_steps"] += int(decision.nonfinite)
        onset = _onset(tag.step, [a for a in decision.alerts if a.level >= Level.WARNING])
        if "nonfinite_streak" in triggers:
            onset = min(onset, tag.step - self.policy.rewind_streak + 1)
        if self._incident_onset is not None:
            onset = min(onset, self._incident_onset)
        try:
            # a finite loss and finite gradients came from finite weights: no scan to take
            known_finite = scan is None and not (decision.nonfinite or decision.loss_bad or decision.overflow)
            report = self.recovery.rewind(tag.step, reason=_reason(decision), onset=max(0, onset), scan=scan,
                                          known_finite=known_finite,
                                          blame=self._blame(tag, decision, scan, max(0, onset)))
        except Halt as exc:
            self._halt(tag, str(exc), cause=exc)
        self.counters["rewinds"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._log_metrics(tag.step, decision.obs)
        # the training step goes back (the loop's schedule can follow: ew.step); the run's clock
        # for events and metrics goes on from the incident's
        self._log_offset += tag.step + 1 - report.resume_step
        self._step = report.resume_step
        self.counters["steps"] = self._step
        # the restored state is clean: what comes next is judged afresh (a recurrence is the
        # recovery's to diagnose); snapshots stay at the faster cadence for a while (_alert_step)
        self._incident_onset = self._incident_step = self._unclean_step = None
        for callback in self._rewind_callbacks:
            callback(report)

    def _blame(self, tag: _Tag, decision: "_Decision", scan: Any, onset: int) -> Any:
        """Who is responsible: when the symptom is a non-finite loss or poisoned parameters,
        the last step that was applied (its update wrote the damage); else the step where the
        incident began (a divergence may be a hyperparameter's fault: "the episode began with");
        else this step's own batch."""
        kinds = {a.kind for a in decision.alerts}
        # Poisoned state names its own origin (the rewind adds it when it scans); otherwise the
        # layer whose gradient moved first.
        poisoned = scan is not None and scan.params_poisoned
        layer = (scan.first_layer if scan is not None else None) or next((a.layer for a in decision.alerts if a.layer), None)
        if Kind.LOSS_NONFINITE in kinds:
            symptom = "the loss turned NaN" if decision.obs.loss is not None and math.isnan(decision.obs.loss) else "the loss turned non-finite"
        elif Kind.LOSS_DIVERGED in kinds:
            symptom = "the loss diverged"
        elif decision.nonfinite:
            symptom = "gradients turned non-finite"
        else:
            symptom = "the incident"
        role = "the batch responsible"
        if poisoned or Kind.LOSS_NONFINITE in kinds:
            responsible = max(tag.step - 1, 0)
        elif onset < tag.step:
            responsible, role = onset, "the episode began with"
        else:
            responsible = tag.step
        return self.recovery.blame(responsible, layer=layer, symptom=symptom, symptom_step=tag.step, role=role)

    def _halt(self, tag: _Tag, message: str, cause: BaseException | None = None) -> None:
        event = Event(step=tag.step, kind=Kind.HALT, level=Level.CRITICAL, message=message, batch=_batch_index(tag.batch))
        self._emit(event)
        self.flush()
        raise Halt(message, step=tag.step, reason=cause.reason if isinstance(cause, Halt) else "policy") from cause

    def _emit_skip(self, tag: _Tag, decision: "_Decision") -> None:
        obs = decision.obs
        bad = self._bad_layers(obs)
        if bad:
            what = f"non-finite gradient in {bad[0]!r} (first in backward order; {len(bad)} layer(s)"
            if tag.counts is not None:
                what += f", {int(np.nansum(obs.layer_nonfinite))} element(s)"
            what += ")"
        elif decision.overflow:
            huge = [self.layer_names[i] for i in np.flatnonzero(decision.obs.layer_norms ** 2 > _SQ_OVERFLOW)]
            what = (f"huge finite gradient in {huge[0]!r} (norm {decision.obs.grad_norm:.3g}: its square overflows "
                    "float32, so the optimizer's second moments would turn inf)")
        else:
            what = "gradient spike"
        # Without a restorable loader the batch is known by its step (and fingerprint, when seen).
        if tag.batch is not None:
            batch = str(tag.batch)
        else:
            ref = self.recovery.batch_at(tag.step)
            batch = f"the batch drawn for step {tag.step}" + (f" (fingerprint {ref.fingerprint})" if ref else "")
        level = Level.CRITICAL if decision.nonfinite else Level.WARNING
        if self.scaler is not None and decision.nonfinite:
            # The scaler doing its job (start-up, after each scale growth): info. A scale that
            # keeps collapsing is the detector's SCALER_OVERFLOW critical.
            action = "GradScaler skipped the step (loss-scale overflow or a bad batch)"
            level = Level.INFO
        else:
            action = "optimizer step skipped, params and optimizer state untouched"
        self._emit(Event(step=tag.step, kind=Kind.SKIP, level=level,
                         message=f"{what} from {batch}: {action}", signal="grad_norm", layers=tuple(bad),
                         values={"grad_norm": obs.grad_norm if obs.grad_norm is not None else math.nan},
                         batch=_batch_index(tag.batch) if tag.batch is not None else tag.step))

    def _bad_layers(self, obs: Observation) -> list[str]:
        if obs.layer_nonfinite is None:
            return []
        idx = np.flatnonzero(np.asarray(obs.layer_nonfinite) > 0)
        if self._backward_rank is not None:
            idx = idx[np.argsort(self._backward_rank[idx], kind="stable")]
        return [self.layer_names[i] for i in idx]

    def _emit(self, event: Event) -> None:
        if self._log_offset and event.step >= 0:
            event = dataclasses.replace(event, step=event.step + self._log_offset)
        self.events.append(event)
        if event.kind in ALERT_KINDS:
            self.counters[f"alerts_{event.level}"] = self.counters.get(f"alerts_{event.level}", 0) + 1
        written = event.kind is Kind.CHECKPOINT and event.signal != "checkpoint_failed"
        if written:  # periodic and on-warning alike: every checkpoint written counts
            self.counters["checkpoints"] += 1
        # The step's alert_level is the worst of its events, whatever a rewind restores later.
        self._step_levels.note(event.kind, event.level, event.step)
        for sink in self.sinks:
            _safe(sink, "alert", event)
        if written:
            path = _checkpoint_path(event)
            for sink in self.sinks:
                _safe(sink, "checkpoint", event.step, path, event.signal or "checkpoint")

    def _log_metrics(self, step: int, obs: Observation | None, score: float | None = None) -> None:
        step += self._log_offset  # the run's clock (see _log_offset)
        level = self._step_levels.take()
        if not any(takes_metrics(sink) for sink in self.sinks):
            # no sink does anything with metrics (console only, say): build nothing; every sink
            # still hears that the step is over (the console prints the step's incident then)
            for sink in self.sinks:
                _safe(sink, "log_metrics", step, _NO_METRICS)
            return
        # Built on first read, so tracker sinks build it on their own thread, not this one.
        metrics = StepMetrics(
            step, grad_norm=None if obs is None else obs.grad_norm, loss=None if obs is None else obs.loss,
            layer_names=self.layer_names, layer_norms=None if obs is None else obs.layer_norms,
            score=None if obs is None else (self.detector.score if score is None else score), level=level,
            counters=self.counters, config=self.metrics_config,
            user=None if obs is None else {k[5:]: v for k, v in obs.extras.items() if k.startswith("user/")},
        )
        for sink in self.sinks:
            _safe(sink, "log_metrics", step, metrics)


def _scalar(value: Any, fn: str, what: str) -> torch.Tensor:
    """A reported scalar as a 0-d tensor: a tensor stays where it is (no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{fn} takes a scalar {what}, got a tensor of shape {tuple(value.shape)}: "
                             "reduce it first (e.g. .mean())")
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"{fn} takes a scalar tensor or a float, got {type(value).__name__}")


def _weights_only_safe(tree: Any) -> Any:
    """numpy arrays -> tensors, numpy scalars -> Python numbers, tuples kept: what
    ``torch.load(weights_only=True)`` accepts (the detector is pure numpy)."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree).copy())
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, Mapping):
        return {k: _weights_only_safe(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_weights_only_safe(v) for v in tree)
    return tree


def _from_saved(tree: Any) -> Any:
    """Inverse of :func:`_weights_only_safe` (tensors -> numpy arrays)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, Mapping):
        return {k: _from_saved(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_from_saved(v) for v in tree)
    return tree


_BELOW = "_earlywarn_step_below"  # the optimizer's own `step` attribute before earlywarn installed itself


def _watched_step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step`` while watched. A plain function bound to the optimizer: an LR scheduler
    created after ``watch()`` rebinds ``optimizer.step.__func__`` to the optimizer, and any other
    wrapper that calls it finds its watcher here (or, once detached, the step that was below)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's own wrapper records
    watcher = optimizer.__dict__.get("_earlywarn_watcher")
    if watcher is not None:
        return watcher._step_with_closure(args, kwargs)
    below = optimizer.__dict__.get(_BELOW)
    if below is not None:
        return below(*args, **kwargs)
    return type(optimizer).step(optimizer, *args, **kwargs)


_WATCHED_STEP: Any = None


def _watched_step_fn() -> Any:
    # torch.compile(optimizer.step) after watch() must not trace the host-side guard (numpy,
    # Python control flow): dynamo runs it eagerly instead.
    global _WATCHED_STEP
    if _WATCHED_STEP is None:
        _WATCHED_STEP = torch.compiler.disable(_watched_step)
        # LR schedulers check this marker (and wrap the step to set _opt_called, which
        # _watched_step does itself): a scheduler built before watch() must not warn that
        # "optimizer.step() has been overridden after learning rate scheduler initialization".
        _WATCHED_STEP._wrapped_by_lr_sched = True
    return _WATCHED_STEP


def _is_watched_step(fn: Any) -> bool:
    return _WATCHED_STEP is not None and getattr(fn, "__func__", None) is _WATCHED_STEP


def _step_below(optimizer: torch.optim.Optimizer) -> Any:
    """What really steps the optimizer under earlywarn: the instance ``step`` that was there when
    earlywarn first attached (an LR scheduler's wrapper, a compiled step), or None for the class's.
    Re-watching an optimizer whose step was wrapped over ours keeps the first one."""
    d = optimizer.__dict__
    if _BELOW not in d:
        current = d.get("step")
        d[_BELOW] = current if current is not None and not _is_watched_step(current) else None
    return d[_BELOW]


class _Counters:
    """Lets checkpoints carry the watcher's counters and step (state_dict protocol)."""

    def __init__(self, watcher: Watcher):
        self._w = watcher

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._w._step, "counters": dict(self._w.counters), "log_offset": self._w._log_offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # Only a resume loads this (rewinds keep the live counters: keep_on_rewind). The step never
        # goes back: trackers drop rows whose step is lower than one already logged.
        self._w.counters.update(state["counters"])
        self._w._step = max(self._w._step, int(state["step"]))
        self._w._log_offset = max(self._w._log_offset, int(state.get("log_offset", 0)))
        self._w.counters["steps"] = self._w._step


@dataclass(frozen=True)
class PendingStep:
    """A step decided by :meth:`Watcher.decide_step`: whether to run the optimizer, and the
    device skip flag a fused optimizer gets (``None`` for the others)."""

    apply: bool
    found_inf: torch.Tensor | None
    tag: Any = None  # async mode: the step recovery records once the update is applied


@dataclass
class _Decision:
    obs: Observation
    alerts: list[Event]
    actions: set
    skip: bool
    rewind: bool
    nonfinite: bool
    overflow: bool = False  # finite, but a layer's squared norm overflows float32 (|g| >~ 1.8e19)
    loss_bad: bool = False
    scan: Any = None  # the state scan of a non-finite step (None: not taken)
    bad_batch: bool = False  # a lone non-finite step with the state verified finite: the batch's fault


# A finite gradient whose square overflows float32 poisons every second-moment state (Adam's v,
# Adagrad's sum, Adafactor's row/col variances become inf, then NaN): it is skipped like a
# non-finite one, and reported as the huge finite spike it is.
_SQ_OVERFLOW = float(np.finfo(np.float32).max)

# non-finite steps are skipped before anything is written: on their own they are no incident
_SKIPPED_KINDS = frozenset({Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE, Kind.SCALER_OVERFLOW})


def _onset(step: int, alerts: Sequence[Event]) -> int:
    """The first abnormal step the alerts speak of: an alert that counts consecutive steps
    (an escalation, a divergence, a non-finite streak: ``values["steps"]``) began that many back."""
    onset = step
    for a in alerts:
        n = a.values.get("steps", 1.0)
        n = int(n) if isinstance(n, (int, float)) and math.isfinite(n) and n >= 1 else 1
        onset = min(onset, int(a.step) - n + 1)
    return onset


def _input_fingerprint(watcher: "Watcher") -> Callable[..., None]:
    """A forward pre-hook folding the model's inputs (its first tensor argument) into the
    step's batch fingerprint: training forwards only, on the device, no host sync."""
    fps = watcher.recovery.fingerprints

    def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled() and not fps.explicit:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is None:
                first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if first is not None:
                fps.observe(first)

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(hook) if disable is not None else hook  # never traced into a compiled model


def _reason(decision: _Decision) -> str:
    worst = max(decision.alerts, key=lambda e: e.level, default=None)
    return str(worst.kind) if worst is not None else "policy"


def _batch_index(batch: Any) -> int | None:
    # `batch` is the recovery layer's BatchRef, or None without a restorable loader.
    return None if batch is None else batch.batch_index


def _safe(sink: Sink, method: str, *args: Any) -> None:
    try:
        getattr(sink, method)(*args)
    except Exception as exc:  # a tracker must never kill training
        warnings.warn(f"earlywarn: sink {sink.name!r}.{method} failed: {_redact(sink, exc)}")


_NO_METRICS: Mapping[str, float] = types.MappingProxyType({})  # a step's end, for sinks that take no metrics


def _redact(sink: Sink, exc: BaseException) -> str:
    """The error's text with the sink's credentials masked (URI user info, webhook tokens)."""
    return getattr(sink, "redact", str)(str(exc))


def _checkpoint_path(event: Event) -> str:
    """Where a CHECKPOINT event's checkpoint is: recovery ends the message with ``-> <path>``;
    an in-memory snapshot is ``memory:<step it holds>``."""
    head, sep, path = event.message.rpartition(" -> ")
    if sep:
        return path
    held = re.search(r"after step (\d+)", event.message)
    return f"memory:{held.group(1) if held else event.step}"


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(WatchConfig))


def watch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: "torch.amp.GradScaler | None" = None,
    loader: Any = None,
    scheduler: Any = None,
    extra_state: Mapping[str, Any] | None = None,
    **options: Any,
) -> Watcher:
    """Guard ``optimizer`` (which updates ``model``'s parameters). Your loop stays as it is.

    ``scaler``: the run's GradScaler (fp16), so overflow steps it skips are still observed.
    ``loader``: an :class:`earlywarn.ResumableLoader` or torchdata ``StatefulDataLoader``, so
    incidents name the batch and a rewind can skip exactly the batches that followed.
    ``scheduler``: the LR scheduler, restored on rewind. ``extra_state``: more objects with
    ``state_dict``/``load_state_dict`` to snapshot. ``options``: fields of :class:`WatchConfig`.
    """
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"earlywarn.watch() got unknown option(s) {', '.join(unknown)}; valid options: {', '.join(_OPTION_NAMES)}")
    config = WatchConfig(**options)
    return Watcher(model, optimizer, config, scaler=scaler, loader=loader, scheduler=scheduler, extra_state=extra_state)
