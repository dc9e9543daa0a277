"""The gradient guard behind ``earlywarn.watch(model, optimizer)``: the one line that guards a training run.

The story of one optimizer step (every entry point tells it; they differ only in how the
statistics are read and how the update is applied):

1. ``statistics.vector``: per-layer squared gradient norms on the device, the reported loss and
   signals, into one small vector (``earlywarn.guard.statistics``);
2. the host reads it once, now (sync) or a step late (async, :meth:`Watcher._judge_late`);
3. ``judge``: detector, state scan when a value is non-finite, policy -> one immutable Decision;
4. ``responses.announce``: alerts, a halt, a warning checkpoint -- before the update;
5. the update: applied, skipped (non-fused: ``step()`` is not called; fused: ``found_inf`` on the
   device), or replaced by a repair or a rewind;
6. ``_after_step``: skip report and bad-batch quarantine, the episode, recovery's snapshots, the
   step's metric row.

Most steps are calm and stop after 2: a step whose vector lies inside the bands the detector
drew at the last fold, with nothing else due, is applied at once; its detector update and
metric row are folded in later, in order, as they would have been (``earlywarn.guard.calmstep``).

Entry points: ``optimizer.step()`` (:meth:`Watcher._optimizer_step`, with or without a closure),
``scaler.step(optimizer)`` (:meth:`Watcher._scaler_step`: the scaler's overflow steps never call
``optimizer.step()``), and :meth:`Watcher.decide_step` / :meth:`Watcher.apply_step` for trainers
that clip between backward and step. ``detach()`` puts everything back as it was.
"""

from __future__ import annotations

import itertools
import time
import warnings
import weakref
from typing import Any, Callable, Mapping

import numpy as np
import torch

from earlywarn.capture.grouping import build_layer_map
from earlywarn.capture.updates import scale_free
from earlywarn.detect import StreamingDetector
from earlywarn.guard.config import OPTION_NAMES, WatchConfig
from earlywarn.guard.calmstep import CalmSteps, Current
from earlywarn.guard.episode import Episode
from earlywarn.guard.install import NO_UPDATE, Installation, PendingStep, is_fused
from earlywarn.guard.judge import Decision, Judge
from earlywarn.guard.respond import Responses
from earlywarn.guard.setup import check_arguments, input_fingerprint, run_mode, warn_unskippable
from earlywarn.guard.state import WatcherCheckpointState, from_saved, weights_only_safe
from earlywarn.guard.statistics import StepStatistics, StepTag
from earlywarn.guard.telemetry import RunClock, Telemetry
from earlywarn.metrics import MetricsConfig
from earlywarn.policy import Policy, PolicyConfig
from earlywarn.recover import Recovery, RecoveryConfig
from earlywarn.recover.ema import averaged_copies_warning
from earlywarn.recover.holders import has_state
from earlywarn.recover.statecheck import check_every
from earlywarn.sinks.defaults import build_sinks, default_sink_specs

_LIVE: "weakref.WeakSet[Watcher]" = weakref.WeakSet()  # watchers attached now: a name when there are several
_CREATED = itertools.count()  # the order watchers were made in (names are given in that order)


class Watcher:
    """Owns the hook on one optimizer. Build it with :func:`earlywarn.watch`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: WatchConfig, *,
                 scaler: "torch.amp.GradScaler | None" = None, loader: Any = None, scheduler: Any = None,
                 extra_state: Mapping[str, Any] | None = None):
        check_arguments(optimizer, scaler, scheduler, extra_state)
        self.model, self.optimizer, self.config = model, optimizer, config
        self.scaler = scaler if (scaler is not None and scaler.is_enabled()) else None
        layer_map = build_layer_map(model, optimizer, config.group_by)
        fused = is_fused(optimizer)
        self.mode = run_mode(config, fused, {p.device for p in layer_map.params})
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        recovery_cfg = config.recovery or RecoveryConfig()
        self.statistics = StepStatistics(layer_map, optimizer, self.scaler, late=self.mode == "async",
                                         world_size=torch.distributed.get_world_size() if dist else 1,
                                         state_check_every=check_every(optimizer, recovery_cfg.state_check_every))
        self._detector = StreamingDetector(config.detector, layer_map.layer_names, baseline=config.baseline)
        self._policy = Policy(config.policy or PolicyConfig(), scale_free=scale_free(optimizer))
        if self.mode == "async":
            warn_unskippable(self._policy.cfg)
        self.telemetry = Telemetry(RunClock(), layer_map.layer_names, config.metrics or MetricsConfig(),
                                   _name(config, model))
        # calm steps: applied on a test of their vector, folded into the detector and the trackers later
        self._calm = CalmSteps(self._detector, self._policy, self.telemetry, self.statistics, self._quiet_steps,
                               scaler=self.scaler is not None)
        self.telemetry.before_event = self._calm.fold
        self._created = next(_CREATED)
        ema_note = averaged_copies_warning(model, extra_state, depth=3)  # an EMA a rewind would leave poisoned
        if ema_note:
            warnings.warn(ema_note, RuntimeWarning, stacklevel=3)
        extra = {"earlywarn_detector": Current(self._detector, self._calm),
                 "earlywarn_policy": Current(self._policy, self._calm),
                 "earlywarn_watcher": WatcherCheckpointState(self.telemetry), **(extra_state or {})}
        self.recovery = Recovery(
            model, optimizer, recovery_cfg, scheduler=scheduler, scaler=self.scaler,
            loader=loader, extra_state=extra, emit=self.telemetry.emit_trained, run_step=self.telemetry.clock.run,
            # A rewind restores the model and the detector, not the policy's rewind budget or our counters.
            keep_on_rewind=("earlywarn_policy", "earlywarn_watcher"),
            # Our own bookkeeping follows the judgement of a step (late in async mode), not its update.
            late_state=("earlywarn_detector", "earlywarn_policy", "earlywarn_watcher"))
        self.statistics.effective_lr = self.recovery.effective_lr
        self.recovery.dry_run = config.dry_run
        self.judge = Judge(self._detector, self._policy, self.recovery, scaler=self.scaler is not None,
                           late=self.mode == "async", dry_run=config.dry_run)
        self.responses = Responses(self.recovery, self.telemetry, self.statistics, scaler=self.scaler is not None,
                                   flush=self.flush)
        self.episode = Episode(self.recovery.config.clean_window)
        self._rewind_callbacks: list[Callable[[Any], None]] = []
        self._gen = 0  # async: bumped by a rewind; steps of an older generation were undone in flight
        self._detached = False
        all_cuda = all(p.device.type == "cuda" for p in layer_map.params)
        self._install = Installation(self, optimizer, self.scaler, self.recovery.wrap_step, fused=fused,
                                     flag_device=self.statistics.stats.device if all_cuda else torch.device("cpu"))
        self._input_hook: Any = None
        try:
            self._start(config, model)
        except BaseException:
            self.close()
            raise

    def _start(self, config: WatchConfig, model: torch.nn.Module) -> None:
        """Sinks last (a config error must not leave a tracker run open), then what watch() says and does once."""
        specs = config.sinks if config.sinks is not None else default_sink_specs()
        self.telemetry.sinks = build_sinks(specs, config.sink_options, rank=self.rank)
        _LIVE.add(self)
        # the snapshot cadence and host-RAM budget, once (a note on the console; a warning if short)
        console = next((s for s in self.telemetry.sinks if s.name == "console" and hasattr(s, "write")), None)
        self.recovery.report_plan(self.step, write=None if console is None else console.write)
        if not self.recovery.data.restorable and self.recovery.config.fingerprint_inputs:
            # no loader names the batches: fingerprint the model's inputs (on the device, no sync)
            self._input_hook = model.register_forward_pre_hook(input_fingerprint(self.recovery), with_kwargs=True)
        # State that was poisoned before we were attached (a resumed checkpoint) is repaired now.
        if has_state(self.optimizer):
            self.recovery.repair(self.step)

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
        return self.telemetry.clock.step

    @property
    def detector(self) -> StreamingDetector:
        """The detector, with every calm step so far folded in."""
        self._calm.fold()
        return self._detector

    @property
    def policy(self) -> Policy:
        """The response policy, with every calm step so far folded in."""
        self._calm.fold()
        return self._policy

    @property
    def events(self) -> list:
        return self.telemetry.events

    @property
    def counters(self) -> dict[str, int]:
        return self.telemetry.counters

    @property
    def sinks(self) -> list:
        return self.telemetry.sinks

    @property
    def layer_map(self) -> Any:
        return self.statistics.layer_map

    @property
    def layer_names(self) -> tuple[str, ...]:
        return self.statistics.layer_map.layer_names

    @property
    def name(self) -> str | None:
        """What this watcher's lines and runs are called (``None`` while it is the only one)."""
        return self.telemetry.source

    @property
    def rank(self) -> int:
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        return torch.distributed.get_rank() if dist else 0

    @property
    def world_size(self) -> int:
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        return torch.distributed.get_world_size() if dist else 1

    @property
    def lr_factor(self) -> float:
        """The factor earlywarn applies to the learning rate around each optimizer step now
        (1.0 unless a recurrence lowered it, ``RecoveryConfig(on_recurrence="lower_lr")``)."""
        return self.recovery.lr_factor

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

    def report_loss(self, loss: torch.Tensor | float) -> None:
        """Tell earlywarn this step's loss. A tensor is kept on the device (no host sync) and read
        with the gradient statistics in the step's one transfer.

        Under gradient accumulation call it for every micro-batch: the losses reported between
        two optimizer steps are averaged (on the device), and one NaN micro-batch makes the step's
        loss NaN. The detector works on ratios, so a constant factor (nanoGPT reports
        ``loss / gradient_accumulation_steps``) changes nothing."""
        self.statistics.report_loss(loss)

    def report(self, name: str, value: torch.Tensor | float) -> None:
        """Tell earlywarn a scalar of your own for this step, e.g. the largest attention logit
        (``ew.report("attn_logit_max", att.detach().abs().amax())``). A tensor stays on the device
        (no host sync) and rides in the step's one statistics vector, as the loss does.

        The detector tracks it as a run-level signal ``user/<name>``: an isolated spike is info;
        an escalation or a sustained rise (``DetectorConfig.user_alone_h``), or a NaN / inf
        value, is a warning that names it. Report a positive magnitude (it is judged in log
        space; values <= 0 are not tracked). ``"attn_logit_max"`` (or ``"attn_logit_max/<layer>"``),
        the largest attention logit, has a rule of its own instead (:mod:`earlywarn.attention`: an
        absolute bound, the learning rate lowered past it). Values reported between two optimizer steps are
        averaged; a name not reported at a step is absent there. Logged as
        ``earlywarn/user/<name>``, which ``earlywarn analyze`` reads back as the same signal.
        Under ``torch.distributed`` report the same names on every rank (the value is averaged
        over ranks)."""
        self.statistics.report(name, value)

    def summary(self) -> dict[str, int]:
        return dict(self.counters)

    def state_dict(self) -> dict[str, Any]:
        """The watcher's state (detector, policy, recovery, counters, step and the run's clock) in
        plain types and tensors: ``torch.save`` it and ``torch.load(path)`` (``weights_only=True``)
        reads it back."""
        self._calm.fold()
        return weights_only_safe({
            **self.telemetry.clock.state_dict(), "counters": dict(self.counters),
            "detector": self.detector.state_dict(), "policy": self.policy.state_dict(),
            "recovery": self.recovery.state_dict()})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = from_saved(state)
        self._calm.fold()
        self.telemetry.clock.load_state_dict(state)
        self.counters.update({k: int(v) for k, v in state["counters"].items()})
        self.detector.load_state_dict(state["detector"])
        self.policy.load_state_dict(state["policy"])
        self.recovery.load_state_dict(state["recovery"])
        self._calm.judged()

    def flush(self, timeout: float = 10.0) -> None:
        """Process a step still in flight (async mode) and push buffered sink data out, waiting
        at most ``timeout`` seconds for all sinks together (a tracker that is down answers at
        once; its records stay buffered)."""
        for host, tag in self.statistics.reader.drain():
            self._judge_late(host, tag)
        self._calm.fold()
        self.recovery.settle()  # a snapshot still being copied / confirmed
        self.telemetry.log_halted_row()
        self.telemetry.flush(time.monotonic() + timeout)

    def detach(self) -> None:
        """Restore the optimizer (and scaler) exactly as they were. Safe to call twice."""
        if self._detached:
            return
        try:
            for host, tag in self.statistics.reader.drain():
                self._judge_late(host, tag)
            self._calm.fold()
        finally:
            self._detached = True
            _LIVE.discard(self)
            self.statistics.close()
            if self._input_hook is not None:
                self._input_hook.remove()
                self._input_hook = None
            self._install.remove(self)

    def close(self) -> None:
        """Detach and finish every sink (flushing with a timeout)."""
        try:
            self.detach()
        finally:
            self.telemetry.finish()

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ entry points
    def _optimizer_step(self, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(...)`` while watched."""
        if self._detached:
            return self._install.real_step(*args, **kwargs)
        decided = self._install.scaler_decided
        if decided is not None:  # scaler.step observed (and decided) this step already
            self._install.scaler_decided = None
            return None if decided else self._install.real_step(*args, **kwargs)
        closure = args[0] if args else kwargs.get("closure")
        if closure is None:
            return self._take_step(args, kwargs)
        # The closure runs backward, so it is evaluated first and the guard decides on the gradients
        # it produced. The optimizer then gets the evaluated loss (torch.optim's optimizers evaluate a
        # closure once; LBFGS, which evaluates it many times, is refused at watch()); a second call
        # evaluates the real closure again.
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
        out = self._take_step((evaluated, *args[1:]), kwargs)
        return loss if out is None else out

    def _scaler_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``scaler.step(optimizer)`` while watched (non-fused optimizers: the scaler skips its
        overflow steps without calling ``optimizer.step()``, so the step is observed here)."""
        install = self._install
        if self._detached or optimizer is not self.optimizer or install.fused:
            # Fused optimizers: the scaler hands grad_scale/found_inf to step(), which we guard.
            return install.real_scaler_step(optimizer, *args, **kwargs)
        from torch.amp.grad_scaler import OptState

        if self.scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.scaler.unscale_(optimizer)  # what scaler.step would do first; grads are now unscaled
        vec, tag = self._begin(None)
        host = self.statistics.read_now(vec, tag)
        lr = self.statistics.take_lr(tag.step)
        if self._calm.take(host, tag, lr):
            install.scaler_decided = False
            try:
                return install.real_scaler_step(optimizer, *args, **kwargs)
            finally:
                install.scaler_decided = None
                self._calm_after(tag, lr)
        decision = self._judge(host, tag, lr)
        if decision.restores:
            self._restore(decision, tag)
        elif decision.policy.clip_factor is not None:
            self.responses.clip(decision, tag)
        # The scaler skips overflow steps itself (and never calls step()); we skip spikes too.
        install.scaler_decided = decision.skip or decision.restores
        try:
            return install.real_scaler_step(optimizer, *args, **kwargs)
        finally:
            install.scaler_decided = None
            if not decision.restores:
                self._after_step(decision, tag)

    def decide_step(self) -> PendingStep:
        """Take this step's statistics and decision now; apply them with :meth:`apply_step`.

        For trainers that clip gradients between backward and ``optimizer.step`` (Lightning):
        call it after backward and before clipping, so the statistics see the raw gradients.
        Skips, rewinds and halts are decided here exactly as inside ``optimizer.step``.
        """
        return self._take_step((), {}, defer=True)

    def apply_step(self, pending: PendingStep, *args: Any, **kwargs: Any) -> Any:
        """Apply a step decided by :meth:`decide_step` (a skipped step leaves everything as is)."""
        return self._run(pending, args, kwargs)

    # ------------------------------------------------------------------ the step
    def _take_step(self, args: tuple, kwargs: dict, *, defer: bool = False) -> Any:
        """Statistics, judgement and responses of one step, and its update: applied (the
        optimizer's return value), or with ``defer`` returned unapplied (a :class:`PendingStep`)."""
        def apply(update: PendingStep) -> Any:
            return update if defer else self._run(update, args, kwargs)

        grad_scale = getattr(self.optimizer, "grad_scale", None)  # set by GradScaler for fused optimizers
        vec, tag = self._begin(grad_scale.double().reciprocal() if isinstance(grad_scale, torch.Tensor) else None)
        if self.mode == "async":
            # The device skips a non-finite step itself; the detector sees this step once its copy lands.
            update = self._install.update(self.statistics.device_skip_flag(vec), record=tag)
            ready = self.statistics.reader.push(vec, tag)  # this step's copy starts; earlier ones that landed
            out = apply(update)
            for host, late in ready:
                self._judge_late(host, late)  # judged now, after this step's update was queued
            return out
        host = self.statistics.read_now(vec, tag)
        lr = self.statistics.take_lr(tag.step)
        if self._calm.take(host, tag, lr):
            update = self._install.update(False)  # (a sync update records no step: _run would only run it)
            out = update if defer else self._install.run(update, args, kwargs)
            self._calm_after(tag, lr)
            return out
        decision = self._judge(host, tag, lr)
        if decision.restores:
            self._restore(decision, tag)
            return apply(NO_UPDATE)
        if decision.policy.clip_factor is not None:
            self.responses.clip(decision, tag)
        if decision.policy.add_held:
            self.responses.add_held(tag)
        elif self._policy.tail_held is None:
            self.responses.drop_held()  # let go by the policy (TAIL_RECALL steps on, a tail revoked)
        out = apply(self._install.update(decision.skip))
        self._after_step(decision, tag)
        return out

    def _run(self, update: PendingStep, args: tuple, kwargs: dict) -> Any:
        out = self._install.run(update, args, kwargs)
        tag = update.tag  # async mode: the step whose update this is; recovery records it once queued
        if update.apply and tag is not None and tag.gen == self._gen:
            ep = self.episode
            self.recovery.record_step(tag.step, maybe_clean=ep.clean(tag.step), building=ep.building(tag.step))
        return out

    def _begin(self, inv_scale: torch.Tensor | None) -> "tuple[torch.Tensor | np.ndarray, StepTag]":
        clock = self.telemetry.clock
        step = clock.step
        vec, tag = self.statistics.vector(step, inv_scale)
        # (before any rewind the run's clock is the training step)
        tag.run_step = clock.run(step) if clock.segments else step
        tag.batch, tag.gen = self.recovery.last_batch(), self._gen
        self.recovery.fingerprints.bind(step)  # what the forward passes since the last step saw
        clock.step = step + 1
        return vec, tag

    def _quiet_steps(self, step: int, k: int) -> int:
        """How many of the ``k`` steps from ``step`` on may be calm as far as the watcher goes:
        the policy watching nothing, no incident noted since the last metric row, recovery with
        nothing due but each step's record (each a calm step's: clean, building only while an
        alert is recent). Nothing of this moves until a step is judged, an event comes, or the
        calm steps are folded in: the calm steps draw their bands for these steps only."""
        if self._policy.watching or self.telemetry.levels.step is not None:
            return 0
        ep = self.episode.after(step, (), elevated=False)  # (a calm step elevates nothing: the bands see to it)
        return self.recovery.quiet_steps(step, k, clean=ep.clean, building=ep.building)

    def _calm_after(self, tag: StepTag, lr: float | None) -> None:
        """What a calm step leaves besides its kept row: the episode, the step count, its record."""
        ep = self.episode
        if ep.elevated or ep.onset is not None:
            self.episode = ep.after(tag.step, (), elevated=False)
        telemetry = self.telemetry
        telemetry.counters["steps"] = telemetry.clock.step  # (self.counters and self.step: two calls more)
        self.recovery.calm_step(tag.step, lr)

    def _judge(self, host: "np.ndarray | list[float]", tag: StepTag, lr: float | None) -> Decision:
        self._calm.fold()  # the detector and the policy up to date first
        host = np.asarray(host, dtype=np.float64)  # (the CPU's list of floats: see StepStatistics.read_now)
        # a poisoned optimizer moment (the vector's last entry) is repaired before this step's update
        self.statistics.state_check.repair_if_poisoned(float(host[-1]), self.recovery, tag.step)
        obs = self.statistics.observation(host, tag, lr)
        decision = self.judge(obs, host[:self.statistics.num_layers], tag.counts is not None,
                              tag.step, self.episode)
        self._calm.judged()
        self.responses.announce(decision, tag)
        return decision

    def _judge_late(self, host: np.ndarray, tag: StepTag) -> None:
        """Async mode: a step's vector arrived late (its update, and maybe later ones, already
        queued; the device already skipped it if it was non-finite)."""
        if tag.gen != self._gen:
            return  # applied on a trajectory a rewind has undone since: never judged (as in sync mode)
        lr = self.statistics.take_lr(tag.step)
        # (a copy started when a later step was queued is confirmed when its step is judged)
        if not self.recovery.copying and self._calm.take(host, tag, lr):
            self._calm_after(tag, lr)
            return
        decision = self._judge(host, tag, lr)
        if decision.restores:
            rewinds = self.recovery.rewinds
            self._restore(decision, tag)
            if self.recovery.rewinds != rewinds:
                # The steps still in flight belong to the undone trajectory: never judged nor
                # logged (the rewind set the step back to the restored snapshot's, as in sync mode).
                self._gen += 1
            return
        self._after_step(decision, tag)

    def _after_step(self, decision: Decision, tag: StepTag) -> None:
        if decision.skip:
            self.responses.skipped(decision, tag)
        if decision.nonfinite:
            self.telemetry.count("nonfinite_steps")
        # an episode builds on the run's own signals: one of hundreds of layers is elevated by chance
        elevated = self._detector.run_score >= self._detector.cfg.spike_z
        ep = self.episode = self.episode.after(tag.step, decision.alerts, elevated=elevated)
        self.counters["steps"] = self.step
        clean = ep.clean(tag.step) and not decision.skip and not self._policy.run_unjudged
        self.recovery.after_step(tag.step, clean=clean, building=ep.building(tag.step))
        self.telemetry.log_metrics(tag.run_step, decision.obs, self._detector.score)  # after recovery: its checkpoint or repair counts

    def _restore(self, decision: Decision, tag: StepTag) -> None:
        """The step ends in a repair (poisoned optimizer state, parameters finite: progress kept)
        or a rewind (anything else: back to the newest clean snapshot from before the incident)."""
        if decision.repair:
            self.responses.repair(decision, tag)
            self._after_step(decision, tag)
            return
        report = self.responses.rewind(decision, tag, self.episode)
        self.responses.drop_held()
        self.optimizer.zero_grad(set_to_none=True)
        self.telemetry.log_metrics(tag.run_step, decision.obs, self._detector.score)
        # the training step goes back (the loop's schedule can follow: ew.step); the run's clock
        # for events and metrics goes on from the incident's
        self.telemetry.clock.rewound(tag.step, report.resume_step)
        self.counters["steps"] = self.step
        self.episode = self.episode.rewound()
        for callback in self._rewind_callbacks:
            callback(report)


def _name(config: WatchConfig, model: torch.nn.Module) -> str | None:
    """The watcher's name: the configured one; else, once a second watcher exists in the process,
    the model's class name (numbered when two share it), and the unnamed ones already attached
    get theirs then too (their lines from then on say which they are); else none."""
    live = sorted((w for w in _LIVE if not w._detached), key=lambda w: w._created)
    if config.name is None and not live:
        return None
    taken: set[str] = {w.name for w in live if w.name is not None}

    def unique(base: str) -> str:
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        taken.add(name)
        return name

    for w in live:
        if w.name is None:
            w.telemetry.source = unique(type(w.model).__name__)
    return config.name.strip() if config.name is not None else unique(type(model).__name__)


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scaler: "torch.amp.GradScaler | None" = None,
          loader: Any = None, scheduler: Any = None, extra_state: Mapping[str, Any] | None = None,
          **options: Any) -> Watcher:
    """Guard ``optimizer`` (which updates ``model``'s parameters). Your loop stays as it is.

    ``scaler``: the run's GradScaler (fp16), so overflow steps it skips are still observed.
    ``loader``: an :class:`earlywarn.ResumableLoader` or torchdata ``StatefulDataLoader``, so
    incidents name the batch and a rewind can skip exactly the batches that followed.
    ``scheduler``: the LR scheduler, restored on rewind. ``extra_state``: more objects with
    ``state_dict``/``load_state_dict`` to snapshot. ``options``: fields of :class:`WatchConfig`.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"earlywarn.watch() got unknown option(s) {', '.join(unknown)}; valid options: {', '.join(OPTION_NAMES)}")
    config = WatchConfig(**options)
    return Watcher(model, optimizer, config, scaler=scaler, loader=loader, scheduler=scheduler, extra_state=extra_state)
