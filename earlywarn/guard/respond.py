"""Carrying out a :class:`~earlywarn.guard.judge.Decision`: the events it announces, the skip it
reports, the bad batch it quarantines, and the repair, rewind or halt it ends in.

The watcher decides *when* (before or after the update, now or a step late); this module decides
nothing and only does what the decision says, through :class:`earlywarn.recover.Recovery`. In a
dry run (``watch(dry_run=True)``) it says what the decision would have done, each as the event it
would have made, marked (``events.DRY_RUN``, ``values["dry_run"] = 1``), and does none of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NoReturn

import numpy as np

from earlywarn.events import DRY_RUN, Event, Kind, Level
from earlywarn.guard.bound import Rest, bound_gradients
from earlywarn.guard.episode import Episode, onset
from earlywarn.guard.judge import Decision
from earlywarn.guard.statistics import SQ_OVERFLOW, StepStatistics, StepTag
from earlywarn.guard.telemetry import Telemetry
from earlywarn.policy import TAIL_RECALL, Action
from earlywarn.recover import Halt, Recovery, RewindReport


class Responses:
    """``flush``: the watcher's own (drains steps in flight, settles recovery, flushes the sinks),
    run before a Halt leaves."""

    def __init__(self, recovery: Recovery, telemetry: Telemetry, statistics: StepStatistics, *,
                 scaler: bool, flush: Callable[[], None]):
        self.recovery = recovery
        self.telemetry = telemetry
        self.statistics = statistics
        self.scaler = scaler
        self._flush = flush
        self._dry = False  # saying what a dry run's decision would have done (_would)
        # what the bound took off a lone outlier with the loss at its level (PolicyDecision.hold_rest),
        # until the run's heavy tail takes it (add_held) or it is let go (drop_held)
        self._held: Rest | None = None

    def _emit(self, event: Event) -> None:
        if self._dry:
            event = dataclasses.replace(event, message=DRY_RUN + event.message,
                                        values={**event.values, "dry_run": 1.0})
        self.telemetry.emit(event)

    # -- before the update ---------------------------------------------------------------------------
    def announce(self, decision: Decision, tag: StepTag) -> None:
        """The step's alerts; a rewind the policy wanted and did not take (and why); a halt; a
        warning checkpoint, taken now, before this step's update, while the run is still clean."""
        for alert in decision.alerts:
            self._emit(alert)
        for note in decision.policy.suppressed:
            self._emit(Event(
                step=tag.run_step, kind=Kind.NO_REWIND, level=Level.WARNING, signal="policy",
                message=f"{note}: not rewinding; "
                        + ("the step is skipped" if decision.skip else "the step is applied as usual"),
                values={"skipped": float(decision.skip)}, batch=_batch_index(tag)))
        if decision.halt:
            reason = _reason(decision)
            why = (self.recovery.recurrence_of(tag.step, reason) or self.recovery.lr_trend(tag.step)).rstrip(".")
            self.halt(tag, f"policy halted the run at step {tag.run_step}: {decision.policy.halt_reason or 'configured'}; "
                           f"rewinds so far: {self.recovery.describe_rewinds()}. {why}. "
                           "The instability keeps coming back: lower the learning rate or inspect the quarantined "
                           f"batches in {self.recovery.quarantine_path}, then resume from the last clean checkpoint.")
        if decision.policy.lr_hold is not None and not decision.restores:
            self.hold_lr(decision, tag, decision.policy.lr_hold, jump=False)
        if decision.policy.lr_copy:
            # an LR jump: the state before its update is what a rewind goes back to if the run
            # does not take it (the policy watches the next steps); clean when nothing came before
            self.recovery.checkpoint(tag.step, reason="lr_jump", clean=decision.clean_before)
        elif decision.checkpoint:
            self.recovery.checkpoint(tag.step, reason="warning")  # its CHECKPOINT event comes from recovery
        if decision.would is not None:
            self._would(decision, tag)

    def _would(self, decision: Decision, tag: StepTag) -> None:
        """A dry run: each thing the decision would have done, as the event it would have made
        (marked), and none of it done -- no skip, clip, repair, rewind, learning rate or halt."""
        d = dataclasses.replace(decision, policy=decision.would, skip=decision.would_skip, would=None)
        self._dry = True
        try:
            for note in d.policy.suppressed:
                self._emit(Event(step=tag.run_step, kind=Kind.NO_REWIND, level=Level.WARNING, signal="policy",
                                 message=f"{note}: not rewinding", values={"skipped": float(d.skip)},
                                 batch=_batch_index(tag)))
            if d.halt:
                self._emit(Event(step=tag.run_step, kind=Kind.HALT, level=Level.CRITICAL, batch=_batch_index(tag),
                                 message=f"policy halted the run at step {tag.run_step}: "
                                         f"{d.policy.halt_reason or 'configured'}"))
            if d.policy.lr_hold is not None:
                self.hold_lr(d, tag, d.policy.lr_hold, jump=False)
            elif d.policy.lr_ceiling is not None:
                self.hold_lr(d, tag, d.policy.lr_ceiling, jump=True)
            if d.repair:
                self.recovery.repair(tag.step, scan=d.scan)  # says what it would have repaired (Recovery.dry_run)
            elif d.restores:
                self._emit(Event(step=tag.run_step, kind=Kind.REWIND, level=Level.CRITICAL, signal=_reason(d),
                                 message=f"{_reason(d)}: rewound to the newest clean snapshot from before the "
                                         "incident, the batches since it never trained again",
                                 batch=_batch_index(tag)))
            elif d.policy.clip_factor is not None:
                self.clip(d, tag)
            elif d.skip:
                self._skip_event(d, tag)
        finally:
            self._dry = False

    # -- a clipped step -------------------------------------------------------------------------------
    def clip(self, decision: Decision, tag: StepTag) -> None:
        """An outlier gradient taken bounded: scaled down before the update, element by element
        where the policy says so (:mod:`earlywarn.guard.bound`)."""
        factor = decision.policy.clip_factor
        out = next((a for a in decision.alerts if a.kind is Kind.GRAD_OUTLIER), None)
        ratio = out.values.get("ratio", math.nan) if out is not None else math.nan
        rms = decision.policy.clip_rms
        rest = None
        if not self._dry:
            params = self.statistics.layer_map.params
            rest = Rest(params) if decision.policy.hold_rest and Rest.fits(params) else None
            if rms is not None:
                bound_gradients(params, self.recovery.optimizer, factor, rms, tag.inv_scale)
            else:
                self.statistics.scale_gradients(factor)
            if rest is not None:
                self._held = rest.taken(tag.inv_scale)
        why = decision.policy.clip_note or "bounded"
        if rest is not None:
            why += (f"; what the bound takes off is kept {TAIL_RECALL} steps, for the next such outlier "
                    "taken as the run's own heavy tail")
        how = (f"each element held to {rms:.3g}x its running RMS where the optimizer keeps one, the whole "
               f"scaled by {factor:.3g} at least ({ratio * factor:.3g}x its typical norm)" if rms is not None else
               f"scaled by {factor:.3g} to {ratio * factor:.3g}x its typical norm")
        self._emit(Event(
            step=tag.run_step, kind=Kind.CLIP, level=Level.WARNING, signal="grad_norm",
            layers=out.layers if out is not None else (),
            message=f"outlier gradient ({ratio:.3g}x its typical norm), {why}: {how} before the update",
            values={"clip_factor": factor, "ratio": ratio, "each": rms if rms is not None else 0.0},
            batch=_batch_index(tag)))

    def add_held(self, tag: StepTag) -> None:
        """Add the rest a lone outlier's bound kept (:meth:`clip`) to this step's gradients: that
        outlier was the first of the run's heavy tail, which this step's outlier is taken as."""
        held, self._held = self._held, None
        if held is not None and not self._dry:
            held.add_to_gradients(tag.inv_scale)

    def drop_held(self) -> None:
        """Let a kept rest go (the policy let it go, or a rewind undid the steps it would have joined)."""
        self._held = None

    # -- a skipped step -------------------------------------------------------------------------------
    def skipped(self, decision: Decision, tag: StepTag) -> None:
        """Report a skipped step; a bad batch (state verified finite) is quarantined, and the
        buffers its forward poisoned (BatchNorm statistics) are copied back."""
        self.telemetry.count("skipped_steps")
        self._skip_event(decision, tag)
        outlier = decision.outlier
        if outlier is not None:
            self.recovery.quarantine_batch(
                tag.step, f"outlier gradient ({outlier.values.get('ratio', math.nan):.3g}x its typical norm)",
                note=" (the step was skipped before anything was written)")
            return
        if not decision.bad_batch:
            return
        scan = decision.scan
        if scan is not None and scan.buffers:
            self.recovery.repair(tag.step, scan=scan, incident=False)
        what = "non-finite loss" if decision.loss_bad else "non-finite gradient"
        self.recovery.quarantine_batch(
            tag.step, f"{what}: bad batch",
            note=" (parameters and optimizer state finite: the step was skipped before anything was "
                 "written, nothing rewound)")

    def _skip_event(self, decision: Decision, tag: StepTag) -> None:
        obs = decision.obs
        bad = self.bad_layers(decision)
        if bad:
            what = f"non-finite gradient in {bad[0]!r} (first in backward order; {len(bad)} layer(s)"
            if tag.counts is not None:
                what += f", {int(np.nansum(obs.layer_nonfinite))} element(s)"
            what += ")"
        elif decision.outlier is not None:
            out = decision.outlier
            where = f" in {out.layers[0]!r} (first to move)" if out.layers else ""
            what = (f"outlier gradient{where}: norm {obs.grad_norm:.3g}, {out.values.get('ratio', math.nan):.3g}x "
                    "its typical norm" + (f", {decision.policy.clip_note}" if decision.policy.clip_note else ""))
        elif self.recovery.unrepaired is not None:  # a rewind the policy did not grant yet
            what = f"optimizer state a repair left non-finite ({self.recovery.unrepaired.after.summary()}), no rewind yet"
        elif decision.overflow:
            huge = self.statistics.in_backward_order(np.flatnonzero(obs.layer_norms ** 2 > SQ_OVERFLOW))
            what = (f"huge finite gradient in {self.telemetry.layer_names[huge[0]]!r} (norm {obs.grad_norm:.3g}: its "
                    "square overflows float32, so the optimizer's second moments would turn inf)")
        else:
            what = "gradient spike"
        # Without a restorable loader the batch is known by its step (and fingerprint, when seen).
        if tag.batch is not None:
            batch = str(tag.batch)
        else:
            ref = self.recovery.batch_at(tag.step)
            batch = f"the batch drawn for step {tag.run_step}" + (f" (fingerprint {ref.fingerprint})" if ref else "")
        level = Level.CRITICAL if decision.nonfinite else Level.WARNING
        if self.scaler and decision.nonfinite:
            # The scaler doing its job (start-up, after each scale growth): info. A scale that
            # keeps collapsing is the detector's SCALER_OVERFLOW critical.
            action = "GradScaler skipped the step (loss-scale overflow or a bad batch)"
            level = Level.INFO
        else:
            action = "optimizer step skipped, params and optimizer state untouched"
        self._emit(Event(
            step=tag.run_step, kind=Kind.SKIP, level=level, message=f"{what} from {batch}: {action}",
            signal="grad_norm", layers=tuple(bad),
            values={"grad_norm": obs.grad_norm if obs.grad_norm is not None else math.nan},
            batch=_batch_index(tag) if tag.batch is not None else tag.step))

    def bad_layers(self, decision: Decision) -> list[str]:
        """Layers with a non-finite gradient, the first reached in backward first."""
        nonfinite = decision.obs.layer_nonfinite
        if nonfinite is None:
            return []
        names = self.telemetry.layer_names
        return [names[i] for i in self.statistics.in_backward_order(np.flatnonzero(np.asarray(nonfinite) > 0))]

    # -- instead of the update ----------------------------------------------------------------------
    def repair(self, decision: Decision, tag: StepTag) -> None:
        """Poisoned optimizer state with finite parameters: repaired in place, progress kept."""
        self.recovery.repair(tag.step, scan=decision.scan)

    def rewind(self, decision: Decision, tag: StepTag, episode: Episode) -> RewindReport:
        """Back to the newest clean snapshot taken before the incident began (raises Halt when
        recovery cannot)."""
        self.telemetry.count("nonfinite_steps", int(decision.nonfinite))
        first = onset(tag.step, [a for a in decision.alerts if a.level >= Level.WARNING])
        if "nonfinite_streak" in decision.policy.rewind_triggers:
            first = min(first, tag.step - decision.policy.nonfinite_streak + 1)
        began = episode.onset
        if decision.policy.onset_back:  # the policy traced the incident back (an abnormal update, an LR jump)
            traced = tag.step - decision.policy.onset_back + 1
            if "lr_jump" in decision.policy.rewind_triggers and began == traced - 1:
                # the episode opened with the jump's own warning: its update is what went wrong, the
                # state before it (the copy taken then) is clean
                began = None
            first = min(first, traced)
        if began is not None:
            first = min(first, began)
        first = max(0, first)
        scan = decision.scan  # taken on a non-finite step; a finite divergence needs none here
        # a finite loss and finite gradients came from finite weights: no scan to take
        known_finite = scan is None and not (decision.nonfinite or decision.loss_bad or decision.overflow)
        try:
            report = self.recovery.rewind(tag.step, reason=_reason(decision), onset=first, scan=scan,
                                          known_finite=known_finite, blame=self._blame(decision, tag, first))
        except Halt as exc:
            self.halt(tag, str(exc), cause=exc)
        self.telemetry.count("rewinds")
        ceiling = decision.policy.lr_ceiling
        if decision.policy.lr_hold is not None:
            self.hold_lr(decision, tag, decision.policy.lr_hold, jump=False)
        elif ceiling is not None:
            self.hold_lr(decision, tag, ceiling, jump=True)
        elif decision.policy.hold_lr_at_target:
            self.hold_lr(decision, tag, self.recovery.lr_at(report.restored_step), jump=False)
        return report

    def hold_lr(self, decision: Decision, tag: StepTag, ceiling: float | None, *, jump: bool) -> None:
        """The learning rate led the run into trouble: step at no more than ``ceiling`` while the
        loop's stays above it. After a jump the ceiling warms back up (a schedule's own jump trains on
        at its rate); after a rise or a creep it stays flat."""
        if ceiling is None:
            return
        if not self._dry:
            self.recovery.hold_lr(ceiling, rewarm=jump)
        how = f", doubling every {self.recovery.lr_ceiling.rewarm} calm steps" if jump else ""
        how += " while the loop's learning rate stays above it"
        if decision.policy.lr_hold is not None:  # the policy says why (a creep, the attention logits)
            what, rate = decision.policy.lr_hold_why, ""
        else:
            what, rate = ("a jump" if jump else "a rise"), " (the highest it had run at calmly)"
        self._emit(Event(
            step=tag.run_step, kind=Kind.LR_HOLD, level=Level.WARNING, signal="lr_ceiling",
            message=(f"the learning rate led the run into trouble ({what}): "
                     f"earlywarn steps at no more than {ceiling:.3g}{rate}{how}"),
            values={"lr_ceiling": ceiling}, batch=_batch_index(tag)))

    def _blame(self, decision: Decision, tag: StepTag, first: int) -> Any:
        """Who is responsible: when the symptom is a non-finite loss or poisoned parameters,
        the last step that was applied (its update wrote the damage); else the step where the
        incident began (a divergence may be a hyperparameter's fault: "the episode began with");
        else this step's own batch."""
        kinds = {a.kind for a in decision.alerts}
        scan = decision.scan
        # Poisoned state names its own origin (the rewind adds it when it scans); otherwise the
        # layer whose gradient moved first.
        poisoned = scan is not None and scan.params_poisoned
        layer = (scan.first_layer if scan is not None else None) or next((a.layer for a in decision.alerts if a.layer), None)
        loss = decision.obs.loss
        if Kind.LOSS_NONFINITE in kinds:
            symptom = "the loss turned NaN" if loss is not None and math.isnan(loss) else "the loss turned non-finite"
        elif Kind.LOSS_DIVERGED in kinds:
            symptom = "the loss diverged"
        elif decision.nonfinite:
            symptom = "gradients turned non-finite"
        else:
            symptom = "the incident"
        role = "the batch responsible"
        if poisoned or Kind.LOSS_NONFINITE in kinds:
            responsible = max(tag.step - 1, 0)
        elif first < tag.step:
            responsible, role = first, "the episode began with"
        else:
            responsible = tag.step
        return self.recovery.blame(responsible, layer=layer, symptom=symptom, symptom_step=tag.step, role=role)

    def halt(self, tag: StepTag, message: str, cause: BaseException | None = None) -> NoReturn:
        self._emit(Event(step=tag.run_step, kind=Kind.HALT, level=Level.CRITICAL, message=message,
                         batch=_batch_index(tag)))
        self._flush()
        raise Halt(message, step=tag.step, reason=cause.reason if isinstance(cause, Halt) else "policy") from cause


def _reason(decision: Decision) -> str:
    """What a rewind's message opens with: the worst alert's kind, or -- a rule of the policy's
    own, on a step without alerts (a burst that ended) -- the policy's line for it."""
    worst = max(decision.alerts, key=lambda e: e.level, default=None)
    if worst is not None:
        return str(worst.kind)
    head = f"{Action.REWIND.value}: "  # (PolicyDecision.reasons: one "<action>: <why>" line per action)
    line = next((r for r in decision.policy.reasons if r.startswith(head)), None)
    return line[len(head):] if line is not None else "policy"


def _batch_index(tag: StepTag) -> int | None:
    # `batch` is the recovery layer's BatchRef, or None without a restorable loader.
    return None if tag.batch is None else tag.batch.batch_index
