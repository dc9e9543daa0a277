"""When an instability comes back after a rewind: episodes, the learning-rate trend, the diagnosis
and the lowered learning rate (``RecoveryConfig.on_recurrence``).

An *episode* opens with a rewind and closes once the run has trained ``clean_window`` steps past
its latest incident without another (the rewind *held*). An incident while it is open is a
recurrence: on new batches (no rewind replays any), so the batches are not to blame -- likely the
learning rate or another hyperparameter. The learning rate -- the largest over the param groups, the
detector's rule (``capture.updates.learning_rate``): a frozen group's 0 never hides the one that
trains -- is recorded every step (a float read; a tensor learning rate on an accelerator is read
only for a diagnosis) so the diagnosis can show its
trend: at the first rewind's target, at the first incident, now -- and whether the loop's own
schedule went back with the rewind.

Steps are the training trajectory's; the steps a message names are on the run's clock
(``run_step``, the watcher's :class:`~earlywarn.guard.telemetry.RunClock`), and those a later
message names after the trajectory went back (the first incident, the rewind log) are converted
when they are recorded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from earlywarn.capture.updates import learning_rate

from .lrceiling import scaled_step
from .window import CleanWindow


def _fmt_lr(lr: float | None) -> str:
    return "?" if lr is None else f"{lr:.3g}"


@dataclass
class Episode:
    """Rewinds for one instability, from the first until one holds. Steps are training steps;
    the ``*_run`` fields are the same steps on the run's clock, for messages."""

    first_incident: int
    first_target: int
    first_reason: str
    rewinds: int = 1
    last_incident: int = 0
    last_target: int = 0
    lr_factor: float = 1.0
    quarantined: list[str] = field(default_factory=list)
    """Keys of the batches quarantined by this episode's rewinds (positions / fingerprints)."""
    lr_path: dict[int, float] = field(default_factory=dict)
    """The learning rate per step on the first way up to the first incident."""
    first_incident_run: int | None = None
    first_target_run: int | None = None
    last_target_run: int | None = None

    def run(self, name: str) -> int:
        """``first_incident`` / ``first_target`` / ``last_target`` on the run's clock (an episode
        saved before these were recorded: the training step)."""
        at = getattr(self, f"{name}_run")
        return getattr(self, name) if at is None else at

    def to_dict(self) -> dict[str, Any]:
        return {"first_incident": self.first_incident, "first_target": self.first_target,
                "first_reason": self.first_reason, "rewinds": self.rewinds,
                "last_incident": self.last_incident, "last_target": self.last_target,
                "lr_factor": self.lr_factor, "quarantined": list(self.quarantined),
                "lr_path": {str(k): v for k, v in self.lr_path.items()},
                "first_incident_run": self.run("first_incident"), "first_target_run": self.run("first_target"),
                "last_target_run": self.run("last_target")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Episode":
        return cls(int(d["first_incident"]), int(d["first_target"]), str(d["first_reason"]), int(d["rewinds"]),
                   int(d["last_incident"]), int(d["last_target"]), float(d["lr_factor"]),
                   list(d.get("quarantined", [])), {int(k): float(v) for k, v in d.get("lr_path", {}).items()},
                   *(None if d.get(k) is None else int(d[k])
                     for k in ("first_incident_run", "first_target_run", "last_target_run")))


class Recurrence:
    """The open episode, the learning-rate history, and the lowered learning rate in force.

    ``factor`` / ``lr_steps``: ``RecoveryConfig.recurrence_lr_factor`` / ``recurrence_lr_steps``;
    ``history``: steps of learning rate kept; ``window``: when a rewind has held; ``run_step``: a
    training step on the run's clock (for messages; default: the training step itself)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, factor: float, lr_steps: int, history: int,
                 window: CleanWindow, run_step: Callable[[int], int] = int) -> None:
        self.optimizer = optimizer
        self.factor = factor
        self.lr_steps = lr_steps
        self.window = window
        self.run_step = run_step
        self.episode: Episode | None = None
        self._lr: deque[tuple[int, float | None]] = deque(maxlen=history)  # (step, largest lr)
        self._cut: list[float] | None = None  # [factor, steps left]
        self._log: deque[tuple[int, int, str]] = deque(maxlen=8)  # (incident, restored, reason) on the run's clock

    @property
    def lr_factor(self) -> float:
        """The factor applied to the learning rate now (1.0 unless a recurrence lowered it)."""
        return 1.0 if self._cut is None else float(self._cut[0])

    # -- per step --------------------------------------------------------------------------------
    def after_step(self, step: int, lr: float | None, *, clean: bool) -> bool:
        """Record the learning rate the step took (``lr``), count the lowered one down, close the
        episode once it held. Returns True when the lowered learning rate just ended."""
        self._lr.append((step, lr))
        ended = False
        if self._cut is not None:
            self._cut[1] -= 1
            if self._cut[1] <= 0:
                self._cut, ended = None, True
        ep = self.episode
        if ep is not None and clean and self.window.held(ep.last_incident, step):
            self.episode = None  # trained past the incident: the rewind held
        return ended

    @property
    def quiet(self) -> bool:
        """No episode open and no lowered learning rate: :meth:`after_step` would only record."""
        return self.episode is None and self._cut is None

    def record_lr(self, step: int, lr: float | None) -> None:
        """:meth:`after_step` while :attr:`quiet`."""
        self._lr.append((step, lr))

    def lr_at(self, step: int) -> float | None:
        """The learning rate recorded at ``step`` (None when it is no longer in the history)."""
        return next((lr for s, lr in reversed(self._lr) if s == step), None)

    def live_lr(self) -> float | None:
        return learning_rate(self.optimizer, read_device=True)  # rare path: a host read is fine here

    # -- rewinds ---------------------------------------------------------------------------------
    def rewound(self, step: int, target: int, reason: str, quarantined: list[str],
                live_lr: float | None = None) -> Episode:
        """A rewind from ``step`` to ``target`` happened: open the episode, or count a recurrence
        in it (and lower the learning rate for ``lr_steps`` steps, compounding). ``live_lr``: the
        learning rate of the incident step, read before the restore put the snapshot's back.
        Call it before the run's clock takes the rewind (``step`` and ``target`` are named on it)."""
        run_step, run_target = self.run_step(step), self.run_step(target)
        self._log.append((run_step, run_target, reason))
        ep = self.episode
        if ep is None:
            lr_path = {s: lr for s, lr in self._lr if target <= s <= step and lr is not None}
            live = live_lr
            if live is not None:
                lr_path[step] = live
            ep = self.episode = Episode(step, target, reason, 1, step, target, 1.0, [], lr_path,
                                        run_step, run_target, run_target)
        else:
            ep.rewinds += 1
            ep.last_incident = max(ep.last_incident, step)
            ep.last_target, ep.last_target_run = target, run_target
            ep.lr_factor *= self.factor
            self._cut = [ep.lr_factor, float(self.lr_steps)]
        ep.quarantined += quarantined
        return ep

    def lr_trend(self, step: int) -> str:
        """'learning rate (largest over param groups): 0.001 at step 125 (restored) -> 0.0024 at step 152
        (first incident) -> 0.0025 at step 160 (now), rising' for the open episode."""
        ep = self.episode
        now = self.live_lr()
        run = self.run_step(step)
        if ep is None:
            return f"learning rate (largest over param groups): {_fmt_lr(now)} at step {run}"
        at_target = ep.lr_path.get(ep.first_target)
        at_first = ep.lr_path.get(ep.first_incident)
        text = (f"learning rate (largest over param groups): {_fmt_lr(at_target)} at step {ep.run('first_target')} (restored) -> "
                f"{_fmt_lr(at_first)} at step {ep.run('first_incident')} (first incident) -> {_fmt_lr(now)} at step "
                f"{run} (now)")
        if self._cut is not None:
            text += f" (earlywarn applies {self.lr_factor:g}x of it)"
        ref = at_target if at_target else at_first
        if now is not None and ref:
            trend = "rising" if now > 1.05 * ref else "falling" if now < 0.95 * ref else "flat"
            text += f", {trend}"
            before = ep.lr_path.get(step)
            if before and now > 1.05 * before:
                text += (f"; the loop's learning rate did not go back with the rewind ({_fmt_lr(now)} at step {run} "
                         f"now, {_fmt_lr(before)} there before): recompute it from ew.step, ew.on_rewind(...) or an "
                         "earlywarn.LoopState in extra_state")
            elif trend == "flat":
                text += (": not the schedule -- look at the learning rate itself or another hyperparameter (warmup, "
                         "weight decay, batch size, clipping, the loss scale)")
        return text

    def diagnose(self, step: int, reason: str, keys: list[str | None], fresh_draws: bool) -> str:
        """Why the incident at ``step`` is a recurrence and what is likely at fault. ``keys``:
        what identifies the batches trained since the last rewind (None: unknown);
        ``fresh_draws``: no loader, and the RNGs that draw the batches were not restored."""
        ep = self.episode
        assert ep is not None
        since = max(0, step - ep.last_target)
        known = [k for k in keys if k is not None]
        quarantined = set(ep.quarantined)
        replayed = sum(k in quarantined for k in known)
        if replayed:
            data = (f"{replayed} of the batches since the rewind were ones it had quarantined (they were replayed): "
                    "the data may be at fault")
        else:
            how = (f"none of the {len(quarantined)} quarantined batches came back" if known and quarantined else
                   "the global RNGs were not restored, so they were fresh draws" if fresh_draws else
                   "the loader moved past the quarantined ones")
            data = (f"on new batches ({how}), so it is not a bad batch: likely the learning rate or another "
                    "hyperparameter")
        return (f"recurrence: {reason} at step {self.run_step(step)}, {since} steps after the rewind to step "
                f"{ep.run('last_target')} (the first incident: {ep.first_reason} at step {ep.run('first_incident')}), "
                f"{data}. {self.lr_trend(step)}.")

    def describe_rewinds(self) -> str:
        """The recent rewinds, for a halt message: 'at step 152 (loss_diverged) to step 125, ...'."""
        if not self._log:
            return "no rewinds yet"
        return ", ".join(f"at step {i} ({r}) to step {t}" for i, t, r in self._log)

    # -- the lowered learning rate ------------------------------------------------------------
    def wrap_step(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` (the optimizer's own ``step``) with the lowered learning rate applied
        around it while one is in force: every param group's ``lr`` times the factor for the
        call, put back right after, so a scheduler or the loop that sets ``lr`` keeps its
        values. Nothing but one check when none is in force."""
        def step(*args: Any, **kwargs: Any) -> Any:
            cut = self._cut
            if cut is None:
                return step_fn(*args, **kwargs)
            return scaled_step(self.optimizer, float(cut[0]), step_fn, args, kwargs)
        return step

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"episode": None if self.episode is None else self.episode.to_dict(),
                "lr_cut": None if self._cut is None else list(self._cut),
                "rewind_log": [list(r) for r in self._log]}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        ep = d.get("episode")
        self.episode = None if ep is None else Episode.from_dict(ep)
        cut = d.get("lr_cut")
        self._cut = None if cut is None else [float(cut[0]), float(cut[1])]
        if "rewind_log" in d:
            self._log.clear()
            self._log.extend((int(i), int(t), str(r)) for i, t, r in d["rewind_log"])
