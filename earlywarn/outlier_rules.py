"""The constants of the policy's rules for outlier gradients, each with why it has its value.

An outlier gradient is either a batch's fault (skip it) or the run's own kind of step (take it,
perhaps bounded). These name the evidence that tells them apart: a part of the model training
again (``IDLE_STEP_CAP``), a gradient that climbed into the outliers (``CLIMB_*``), a burst that
outlasted the skip budget (``BURST_END_*``), an outlier the model keeps producing after a skip
(``TRIAL_*``) and a heavy tail with the loss at its level (``TAIL_*``). Pure Python; read by
:class:`earlywarn.policy.Policy`.
"""

from __future__ import annotations

IDLE_STEP_CAP = 100.0
"""An outlier at which a part of the model idle for steps trains again (a rarely sampled task's
head, an expert) is the run's own kind of step and is applied, scaled down to this many typical
norms if above: the rare tasks of ``benchmarks/rescue.py`` reach ~70x, and where idle experts come
back at many steps a 1e4x gradient must not pass whole."""

IDLE_NOTE = "a part of the model idle for steps trains again (the run's own kind of step), bounded"

CLIMB_STEPS = 3
"""See ``CLIMB_GROWTH``: the elevated steps in a row before a run of outliers that make it a climb."""

CLIMB_GROWTH = 3.0
"""A run of outliers whose first came at most this many times the step before's gradient, itself
``outlier_clip_ratio`` times its typical norm or more and elevated for ``CLIMB_STEPS`` steps in a
row, climbed into the outliers: a loss weight ramped up (KL annealing, a consistency loss's
ramp-up), a regime moving over several steps. A burst of corrupt batches jumps there from an
ordinary step. A climb is applied, its growth bounded to this factor a step over the scale it has
reached: skipping it held ramped runs for 40 steps, and a 1e4x batch inside it passes bounded."""

BURST_END_DROP = 6.0
"""See ``BURST_END_LOSS``: a run ends in one step where its gradient falls this many times under
both the step before's and its level in the run (the geometric mean of its ratios), as a burst's
does when clean batches come back; a new regime is learned down gradually."""

BURST_END_LOSS = 2.0
"""A run of outliers trained on past ``outlier_skips`` that ends in one step (``BURST_END_DROP``)
with the loss this many times its level before the run or more was a burst of bad batches that
damaged the model (the model's gradient on clean batches stays elevated while it recovers):
rewound to before it. A regime that ends so (a loss weight raised for a phase) left the model
trained, its loss at its level. The cost: a deliberate phase of 41-100 steps of outlier-sized
gradients after which the model has forgotten the earlier data 2x is rewound too."""

BURST_END_TRAINED = 5
"""See ``BURST_END_LOSS``: a run is judged at its end once it was trained on for this many steps.
The first updates taken after the skips move a model that stood still for 40 steps (a part
unfrozen meanwhile takes its first steps, Adagrad's first is lr x the sign): its gradient may
fall at once by the run's own doing, and a burst that ends so soon did little damage."""

BURST_END_WITHIN = 100
"""See ``BURST_END_LOSS``: runs that end within this many steps of their start (the detector's
baselines move to a level held 100 steps: after that the ratios are no longer the run's before)."""

CLIMB_NOTE = "the gradient climbed into the outliers over several steps (a ramped loss weight, a moving regime), its growth bounded"

TRIAL_AFTER = 1
"""Outliers skipped in a row after which the next is taken, scaled to the typical norm, as a trial. A skip leaves the model as it was: an outlier that the model's own
state produces (a spike of the run's own, a warm-up overshoot) comes back at the next batch, and
skipping it again and again refuses the very step that heals it (skipped 40 in a row, the skip
budget). A bad batch's outlier does not heal when taken; the model's own does: its next gradient
is smaller (``TRIAL_FALL``). A trial that does not heal makes the skips before the next four
times as many: a burst of 40 corrupt batches meets three trials, each a step of ordinary size."""

TRIAL_FALL = 0.8
"""See ``TRIAL_AFTER``: a trial healed when the next outlier is at most this fraction of it (or
there is none) and the loss's excess over its level at most half of the trial's: the model's own
spike heals in both (its loss comes back), a batch's noise moves one of them by chance (outliers
of a phase or a burst vary 5x from batch to batch, their loss stays up). ``TRIAL_OWN`` heals in
a row make the run of outliers the run's own."""

TRIAL_OWN = 3
"""See ``TRIAL_FALL``: from then on the run's outliers are trained on, bounded, not skipped."""

TAIL_LOSS = 2.5
"""An outlier gradient on a batch whose loss is under this many times its level is not a batch the
model finds wrong: a heavy-tailed objective (a rare large reward, a rare heavy sample weight) or
a gradient corrupted after the loss (a bad reduction: rare). Corrupt data raises the loss with the
gradient (bursts and bad shards of the benchmark: 2.8x to 1e8x). Once one such outlier has been
seen (``TAIL_SEEN``) the next are the run's own distribution -- those with the loss at its
level, or at most twice as far above it as the tail's outliers have been (a reward's loss varies
from batch to batch) -- taken, bounded to ``TAIL_BOUND`` times the largest seen, unless one taken
was followed by damage (``TAIL_DAMAGE``)."""

TAIL_SEEN = 1
"""See ``TAIL_LOSS``: such outliers skipped before the next are taken."""

TAIL_BOUND = 4.0
"""See ``TAIL_LOSS``."""

TAIL_DAMAGE = 3.0
"""See ``TAIL_LOSS``: a loss this many times its level (or non-finite, or diverged) within
``TAIL_WATCH`` steps after one was taken: such outliers are skipped again, for the rest of the run."""

TAIL_WATCH = 3
"""See ``TAIL_DAMAGE``."""

TAIL_NOTE = "the run's own heavy tail (outliers with the loss at its level seen before, none damaged the run), bounded"

TRIAL_NOTE = ("the same outlier came back after the skips (a skip leaves the model as it was): taken at its "
               "typical norm, to see whether it heals (a bad batch's does not)")
OWN_NOTE = "the run's own spike (each bounded step taken made the next gradient smaller): trained on, bounded"
