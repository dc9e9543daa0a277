"""The constants of the policy's rules for outlier gradients, each with why it has its value.

An outlier gradient is either a batch's fault or the run's own kind of step; which, is mostly
told after it, so each is taken bounded until the evidence says otherwise. These name the evidence that tells them apart: a part of the model training
again (``IDLE_STEP_CAP``), a gradient that climbed into the outliers (``CLIMB_*``), a burst that
outlasted the skip budget (``BURST_END_*``), an outlier the model keeps producing after a skip
and a heavy tail with the loss at its level (``TAIL_*``); an outlier of no kind is taken, its
size bounded (``OUTLIER_GROWTH``). Pure Python; read by
:class:`earlywarn.policy.Policy`.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable

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
"""See ``BURST_END_LOSS``: a run ends in one step where its gradient norm falls this many times
under both the step before's and its level in the run (the geometric mean of its norms), as a
burst's does when clean batches come back; a new regime is learned down gradually. The norm, not
its ratio to the typical: ``readapt_steps`` (30) steps into a run the detector's baseline moves to
it and the ratio falls in one step while the norm holds (a loss scaled 8x on purpose was rewound
so). Such a run stays open, trained whole, while its norm is ``outlier_clip_ratio`` times the
typical norm before it or more. An end is confirmed the step after: an outlier again there means
a one-step dip inside the run (a batch of a new phase's data the model already fits), and the run
goes on (``phase-307-004``, healthy, was rewound with a CRITICAL so)."""

BURST_END_LOSS = 2.0
"""A run of outliers trained on (bounded) that ends in one step (``BURST_END_DROP``) with the loss
this many times its level before the run or more, and is so still ``BURST_HEAL_STEPS`` later, was a
burst of bad batches that damaged the model: rewound to before it. A regime that ends so (a loss
weight raised for a phase) left the model trained, its loss at its level; a phase of other data
(a new pool for 45-95 steps) ends with the model having forgotten the earlier data (3.2x), and
recovers it within those steps (1.3x)."""

BURST_END_MATTERS = 0.01
"""See ``BURST_END_LOSS``: a loss that many times its level is damage only where it has also lost
at least this fraction of the run's progress (where that is known). A run that memorized its data
down to a loss near 0 meets a new stage's floor at 100x+ that level, having lost next to nothing
(``pool_switch-23-004``, its new stage learned fast with each element free up to one ordinary
step, was rewound so, and 40 steps skipped)."""

BURST_END_LOST = 0.5
"""See ``BURST_END_LOSS``: ... or with this fraction of the run's progress lost (the loss this
far from its level before the run back to the run's first loss): a classifier's loss is bounded
by chance, so a burst that erased what it learned can leave it under 2x its level."""

BURST_HEAL_STEPS = 30
"""See ``BURST_END_LOSS``: a run that ended with the loss damaged is judged this many steps after
its end, on the mean loss of the last ``HEAL_MEAN`` steps. Measured on the rescue families (seed
bases 0, 23, 61), with no rewind: a 32-step phase of another data pool ended at 3.2x its level and
was at 1.7x 20 steps later, 1.3x 30 later; a burst of shuffled labels that bare dies of ended at
2.4x and stayed there (2.4x, 2.4x). Four bursts that ended damaged healed so by themselves and
kept 0.97-0.99 of their twin's progress unrewound. The cost: a burst whose damage the loss hides
by then is not rewound (seed base 89: one of seven, 0.84 kept where the rewind at its end kept 0.98)."""

HEAL_MEAN = 5
"""See ``BURST_HEAL_STEPS``."""

BURST_HEAL_FALL = 0.5
"""See ``BURST_HEAL_STEPS``: a run whose loss above its level before the run has fallen to this
fraction of what it was just after the end (the means of the first and of the last ``HEAL_MEAN``
steps) is being learned, not damage that stays: a new stage under plain SGD after a memorized one
(``pool_switch-811-006``) ended 50x its old level and fell to 20x 30 steps later, the new stage's
floor, with 3% of the run's progress lost; a burst's damage stays where it ended (2.4x, 2.4x).
Not where ``BURST_END_LOST`` of the progress is lost: a small batch's loss on a classifier a burst
erased halves and doubles from one 5-step mean to the next (``burst-811-005``, 95% lost, rescued
only by the rewind)."""

BURST_END_TRAINED = 5
"""See ``BURST_END_LOSS``: a run is judged at its end once it was trained on for this many steps
(a part unfrozen meanwhile takes its first steps, Adagrad's first is lr x the sign: the gradient
may fall at once by the run's own doing), and a burst that ends so soon did little damage."""

BURST_END_WITHIN = 100
"""See ``BURST_END_LOSS``: runs that end within this many steps of their start. The detector takes
a run held ``readapt_steps`` (30) steps as its new normal (no outlier any more: trained whole);
the policy keeps such a run open while its norm holds (``BURST_END_DROP``: 3x the typical norm
before it) and judges its end against the loss's level before it, which it kept (the
detector's has moved to the run's): a 70-step burst of 100x targets, taken whole from its 31st
step, is rewound at its end (``tests/test_rewind_loops.py``: 1.44x its twin's loss, where bounded
through it ended 1.65x)."""

BURST_AGAIN_NOTE = (f"a burst of bad batches was rewound within the last {BURST_END_WITHIN} steps: outliers now are "
                    "more of it, skipped")
"""Why an outlier is skipped after a burst's rewind (``BURST_END_WITHIN`` steps): the data is
what went bad, and a skip leaves the model where the rewind put it."""

CLIMB_NOTE = "the gradient climbed into the outliers over several steps (a ramped loss weight, a moving regime), its growth bounded"

RUN_ELEMENT_RMS = 0.5
"""The outliers of a run after its first, under an optimizer that keeps a running second moment:
each element may take up to this many times its running RMS -- half an ordinary step -- and none
less than the whole's factor (``outlier_clip_ratio`` typical norms). One factor alone left the
elements a new regime moves less than its largest at a fraction of their own RMS, all but
frozen: a new stage after a memorized one kept 0.71 of bare's progress (``pool_switch-23-000``).
Measured on it and on ``tests/test_rewind_loops.py``'s loops (a loss weight raised 50x for 70
steps; a 70-step burst of 100x targets): 0.3 / 0.5 / 1 RMS kept it 0.79 / 0.84 / 0.94, the loss
weight's loop ended 0.98 / 0.99 / 1.06x bare's loss (one whole ordinary step frees the elements
whose gradient is mostly noise too), the burst 1.58 / 1.65 / 2.07x its twin's (one factor alone:
1.56x; bare: 720x), with the detector re-anchoring at 100 steps then (``BURST_END_WITHIN``)."""

OUTLIER_GROWTH = 1.25
"""An outlier is taken at its typical size (element by element against the optimizer's second
moment where it keeps one: ``earlywarn.guard.bound``; at ``outlier_clip_ratio`` times it where
the batch's loss is at its level, ``loss_at_level``: not a batch the model finds wrong), and
those after it in the same run scaled to ``outlier_clip_ratio`` typical norms (each element free
up to ``RUN_ELEMENT_RMS`` times its running RMS) -- or, under plain SGD, to this many times the
bound before (x9 after 10 steps, x87 after 20). A bad batch does one step of ordinary size; a
spike of the model's own heals as it does under clipping (skipped, it left the model where the
spike put it and the next gradient was the same outlier: 40 skipped in a row). Under an
optimizer whose step hardly depends on the gradient's scale (Adam, Lion, Adafactor) a steady
bound trains a loss's scale changed on purpose, a new stage or a phase at most at the
optimizer's steady rate, about one ordinary step a step. Taken whole, a new regime goes further
while the second moment trails its scale: against the bound, 1.0x as far over 100 steps at beta2
0.95, 1.2x at 0.99, 1.9x at 0.999 (3.3x in the first 20 steps; ``tests/test_bound.py``). One
factor for the whole also left the elements a new regime moves less than its largest at a
fraction of their own RMS, all but frozen (``RUN_ELEMENT_RMS``). That extra reach is what a burst
of bad batches takes whole, so the bound stays: it keeps a burst from inflating the second moment
(grown, a 70-step burst x100 got through and the run ended as bare did, 81x its twin's loss).
Plain SGD's step is the gradient: held at 3x, a new stage of 40x gradients lost 22% of its
progress (``pool_switch``). A burst is told from a regime when it ends (``BURST_END_LOSS``);
skipping its steps instead cost healthy runs that change their loss's scale, start a new stage
or a phase 6-21% of their steps. The bound lasts ``readapt_steps`` (30) steps of a run: then the
detector takes the run as its new normal and it trains whole, its end still judged
(``BURST_END_WITHIN``). Held through (re-anchored at 100 steps), a new regime under Adam at beta2
0.999 kept 0.84 of bare's progress (``pool_switch-23-000``: its loss did not fall in the held
steps); a phase that ends (a loss weight raised for 45-95 steps) gains from the bound, and taken
whole after 30 steps is trained as bare trains it (``benchmarks/rescue.py``: no phase under 0.98
of bare's progress; one loop 1.12x bare's final loss, 0.998 of its progress:
``tests/test_rewind_loops.py``)."""

TAIL_LOSS = 2.5
"""An outlier gradient on a batch whose loss is under this many times its level is not a batch the
model finds wrong: a heavy-tailed objective (a rare large reward, a rare heavy sample weight) or
a gradient corrupted after the loss (a bad reduction: rare). Corrupt data raises the loss with the
gradient (bursts and bad shards of the benchmark: 2.8x to 1e8x); so does no heavy tail by as much
(``TAIL_LOSS_POWER``). Once one such outlier has been
seen (``TAIL_SEEN``) the next are the run's own distribution -- those with the loss at its
level, or at most twice as far above it as the tail's outliers have been (a reward's loss varies
from batch to batch) -- taken, bounded to ``TAIL_BOUND`` times the largest seen, unless one taken
was followed by damage (``TAIL_DAMAGE``)."""

TAIL_LOSS_POWER = 0.25
"""See ``TAIL_LOSS``: an outlier ``r`` times its typical norm whose loss is under ``r ** TAIL_LOSS_POWER``
times its level is not a batch the model finds wrong either: its gradient grew by orders of magnitude
more than its loss did. A wrong batch raises both together (the bursts and bad shards of
``benchmarks/rescue.py``, six seed bases, 789 outliers with the loss 2.5x up or more: at least
``r ** 0.29`` times its level, ``r ** 0.46`` past 1e3x); a rare reward raises the gradient by the reward
and the loss by the reward against a loss its other terms keep (``heavy_reward``: ``r ** 0.09`` to
``r ** 0.33``; a 1e5x gradient at 4.3x, ``r ** 0.13``, was bounded to one ordinary step each time, and
the run kept 0.03 of its progress)."""

TAIL_LOSS_FAR = 1e3
"""See ``TAIL_LOSS_POWER``: past this many times its typical norm the bound on the loss grows from
its value here as ``(r / TAIL_LOSS_FAR) ** TAIL_LOSS_POWER_FAR``: wrong data rises further with its
gradient there (bursts, bad shards and hopeless runs, every seed base measured: 822 outliers past 1e3x
with the loss 2.5x up or more: at least ``r ** 0.35``, bad shards and bursts ``r ** 0.41``), a rare
reward no further (``heavy_reward``: at most ``r ** 0.33``; a first reward of 2.1e5x at 31.9x, ``r **
0.28``, held to one ordinary step, left its run 0.30 of bare's progress on seed base 1153)."""

TAIL_LOSS_POWER_FAR = 0.35
"""See ``TAIL_LOSS_FAR`` (a 1e5x gradient: the loss under 28x its level, where ``TAIL_LOSS_POWER``
alone says 17.8x)."""

TAIL_SIGNAL_Z = 1000.0
"""See ``TAIL_LOSS``: the first outlier with the loss at its level is bounded, because a gradient
corrupted after its loss (a bad reduction) looks the same to the ratios -- unless its loss moved
this many times its typical step-to-step change (:func:`loss_jump`). A corrupted gradient leaves
the loss inside its noise (``benchmarks/rescue.py``, every seed base measured: ``huge_grad``'s 131
first outliers at their level moved it at most 24x); a rare large reward moves a loss its other
terms keep all but constant by thousands of times it (``heavy_reward``'s first: 1.1e3x to 2.8e7x),
and bounded, the reward was lost (kept 0.82-0.97 of bare's progress on 8 of 42 runs). Such an
outlier is the run's signal: taken whole, and watched as the tail's are (``TAIL_DAMAGE``). Wrong
data at the loss's level moves it less (bad shards, bursts, bad batches, LR pulses: at most 74x;
hopeless runs 144x)."""

TAIL_SEEN = 1
"""See ``TAIL_LOSS``: such outliers bounded as any other before the next are taken whole."""

TAIL_BOUND = 4.0
"""See ``TAIL_LOSS``."""

TAIL_DAMAGE = 3.0
"""See ``TAIL_LOSS``: a loss this many times its level (or non-finite, or diverged) within
``TAIL_WATCH`` steps after one was taken: such outliers are bounded again, for the rest of the run."""

TAIL_WATCH = 3
"""See ``TAIL_DAMAGE``."""

TAIL_RECALL = 50
"""The first outlier of a run with the loss at its level is bounded (it may be a gradient corrupted
after the loss; ``TAIL_SIGNAL_Z`` says where it cannot be); what the bound took off it is kept this
many steps: the next such outlier taken as the run's heavy tail (``TAIL_SEEN``) takes it too, so
that the tail's first member is not lost."""

TAIL_SIGNAL_NOTE = "the run's own signal (its loss moved thousands of times its noise, in ratio little): taken whole"

TAIL_NOTE = "the run's own heavy tail (outliers with the loss at its level seen before, none damaged the run), bounded"

TRIAL_NOTE = ("the same outlier came back after the skips (a skip leaves the model as it was): taken at its "
               "typical norm, to see whether it heals (a bad batch's does not)")
OWN_NOTE = "the run's own spike (each bounded step taken made the next gradient smaller): trained on, bounded"


def loss_at_level(loss: float, ratio: float) -> bool:
    """An outlier ``ratio`` times its typical norm on a batch whose loss is ``loss`` times its level is
    not a batch the model finds wrong (``TAIL_LOSS``, ``TAIL_LOSS_POWER``, ``TAIL_LOSS_FAR``; False
    on NaN)."""
    if not ratio < math.inf:
        return loss < TAIL_LOSS
    bound = ratio ** TAIL_LOSS_POWER if ratio < TAIL_LOSS_FAR else (
        TAIL_LOSS_FAR ** TAIL_LOSS_POWER * (ratio / TAIL_LOSS_FAR) ** TAIL_LOSS_POWER_FAR)
    return loss < TAIL_LOSS or loss < bound


def loss_jump(losses: Iterable[float]) -> float:
    """How many times its typical step-to-step change the last of ``losses`` (the run's latest, in
    order) moved from the one before: over the median size of the changes before it (NaN with
    fewer than 10 of them, or where most were exactly 0: a loss reported stale is not read)."""
    xs = list(losses)
    if len(xs) < 11 or not all(map(math.isfinite, xs)):
        return math.nan
    typical = statistics.median(abs(b - a) for a, b in zip(xs[:-1], xs[1:-1]))
    return abs(xs[-1] - xs[-2]) / typical if typical > 0.0 else math.nan


def damaged(ratio: float, lost: float) -> bool:
    """A run of outliers left the loss damaged (``BURST_END_*``): the loss ``ratio`` times its level
    before the run, ``lost`` the fraction of the run's progress lost (NaN: not known)."""
    return lost >= BURST_END_LOST or ratio >= BURST_END_LOSS and not lost < BURST_END_MATTERS


def outlier_note(nth: int, bound: float, scale_free: bool) -> str:
    """Why an outlier was taken at ``bound`` typical norms, the ``nth`` of its run (a clip's message)."""
    if nth <= 1:
        if bound > 1.0:
            return (f"taken at {bound:.3g}x its typical size: a bad batch does a few ordinary steps, a rare large "
                    "gradient of the run's own keeps part of its signal, a spike of the run's own heals")
        return "taken at its typical size: a bad batch does one ordinary step, a spike of the run's own heals"
    how = (f"held at {bound:.3g}x its typical norm while the run lasts, each element free up to "
           f"{RUN_ELEMENT_RMS:g}x its running RMS (the optimizer's step hardly depends on the gradient's scale: a new "
           "regime trains at its steady rate)" if scale_free else
           "its bound growing while the run lasts (plain SGD: a new regime trains at full size within a few steps)")
    return f"the {_ordinal(nth)} in a row, {how}; a burst is judged when it ends"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
