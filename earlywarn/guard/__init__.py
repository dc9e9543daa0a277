"""The gradient guard: ``earlywarn.watch(model, optimizer)`` and the parts of one step.

- :mod:`~earlywarn.guard.watcher`: the :class:`Watcher`, the story of a step, and :func:`watch`;
- :mod:`~earlywarn.guard.install`: where it sits (``optimizer.step``, ``scaler.step``) and how an update is applied;
- :mod:`~earlywarn.guard.statistics`: the step's statistics vector and the Observation it becomes;
- :mod:`~earlywarn.guard.judge`: Observation -> one immutable Decision;
- :mod:`~earlywarn.guard.episode`: the episode (clean window, onset, incident), pure;
- :mod:`~earlywarn.guard.respond`: carrying out a Decision (skip, quarantine, repair, rewind, halt);
- :mod:`~earlywarn.guard.telemetry`: events, counters, metrics, on one :class:`RunClock`.
"""

from earlywarn.guard.config import WatchConfig
from earlywarn.guard.install import PendingStep, _is_watched_step
from earlywarn.guard.watcher import Watcher, watch

__all__ = ["PendingStep", "WatchConfig", "Watcher", "watch"]
