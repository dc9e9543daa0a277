"""What the general path finds out about a step, phase by phase: the records
:func:`earlywarn.detect.general.general_step` builds and :mod:`earlywarn.detect.messages` words.
A module of their own, so that the messages need not import the general path that imports them."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Values(NamedTuple):
    """The step's values: run-level ones as given (the fixed ones, then the user signals) and
    every channel's in log space (NaN: absent; a zero norm is absent too)."""

    given: list[float]
    logv: np.ndarray
    user_bad: list[int]  # user signals given as NaN / inf (absent from every baseline)
    layer_norms: np.ndarray | None


class Trouble(NamedTuple):
    """What is wrong with the step."""

    grad_bad: bool  # a non-finite gradient
    loss_bad: bool  # a non-finite loss
    overflow: bool  # a loss-scaler overflow
    scale_pending: bool  # an overflow whose scale drop has not been read yet
    new_scale: float  # the loss scale after the step
    skipped: bool  # the step's values stay out of every baseline and streak


class Deviations(NamedTuple):
    present: np.ndarray  # the channel has a value
    dev: np.ndarray  # log-deviation from the baseline
    z: np.ndarray  # dev in units of the scale
    warm: np.ndarray  # enough values admitted (as of before this step)
    judged: np.ndarray  # present and warm
    elevated: np.ndarray  # judged, z >= spike_z and above the minimum ratio (never on a skipped step)
    any_elevated: bool
    z_fixed: list[float]  # z of the fixed channels, as floats
    judged_fixed: list[bool]
    diverging: bool  # the loss far above its baseline (rules.loss_diverging)


class Evidence(NamedTuple):
    cusums: list[float]  # the run-level CUSUMs (the fixed channels', then the user signals')
    joint: float  # the together evidence
    term: float  # this step's together term (NaN: none)


class Lr(NamedTuple):
    rising: bool  # the LR at a new high
    jump: tuple[float, float] | None  # (lr, the highest it had run at) when it jumped


class Chosen(NamedTuple):
    """The warning rule that holds and the channel it names."""

    rule: str  # escalating | jump | together | alone | layers | user_value | lr_jump
    chan: int
    hot_layers: int  # layers elevated to their warn ratio
