"""The LR ceiling (recover/lrceiling.py): held while the loop's LR is above it, lifted only once
the loop's LR has stayed back for ``settle`` steps (a rewind that restores a ramping scheduler
puts the loop's LR under the ceiling for a few steps only); after a jump it warms back up on
calm steps (a jump the schedule meant trains on at its own rate)."""

import pytest
import torch

from earlywarn.capture.updates import learning_rate
from earlywarn.recover.lrceiling import LrCeiling


def _opt(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _set(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def test_a_ramp_restored_below_the_ceiling_is_held_again_when_it_passes_it():
    opt = _opt(1.0)
    ceiling = LrCeiling(opt, release=1.5, settle=10)
    ceiling.hold(1.0)
    lr, lifted = 0.8, []
    for _ in range(40):  # the restored ramp: under the ceiling for a few steps, then above it for good
        _set(opt, lr)
        lifted.append(ceiling.after_step(lr))
        lr *= 1.08
    assert not any(lifted) and ceiling.ceiling == 1.0
    assert ceiling.factor(lr) == pytest.approx(1.0 / lr)  # the optimizer steps at the ceiling


def test_a_pulse_that_ended_lifts_the_ceiling_after_settle_steps():
    opt = _opt(1.0)
    ceiling = LrCeiling(opt, release=1.5, settle=10)
    ceiling.hold(1.0)
    for _ in range(5):  # the pulse goes on
        _set(opt, 50.0)
        assert not ceiling.after_step(50.0)
    _set(opt, 1.0)  # over: the loop's LR back
    lifted = [ceiling.after_step(1.0) for _ in range(10)]
    assert lifted == [False] * 9 + [True] and ceiling.ceiling is None
    assert ceiling.factor(50.0) == 1.0


def test_the_ceiling_and_its_calm_count_survive_a_state_dict_round_trip():
    opt = _opt(1.0)
    ceiling = LrCeiling(opt, settle=10)
    ceiling.hold(0.5)
    _set(opt, 0.5)
    for _ in range(4):
        ceiling.after_step(0.5)
    other = LrCeiling(opt, settle=10)
    other.load_state_dict(ceiling.state_dict())
    assert other.ceiling == 0.5 and other.calm == 4
    other.load_state_dict({"lr_ceiling": None})  # an older state_dict: no calm count
    assert other.ceiling is None and other.calm == 0


def _warmed(opt: torch.optim.Optimizer, calm_steps: int) -> LrCeiling:
    """A jump's ceiling held at 1.0 (warming, doubling every 10 calm steps), after ``calm_steps``."""
    ceiling = LrCeiling(opt, rewarm=10)
    ceiling.hold(1.0, rewarm=True)
    for _ in range(calm_steps):
        ceiling.after_step(learning_rate(opt), calm=True)
    return ceiling


def test_a_jumps_ceiling_doubles_every_rewarm_calm_steps_up_to_the_loops_lr():
    # lr_jump-89-009 (benchmarks, held-out lr_jump family): a low-LR phase, then a 28x jump the run
    # took with a one-step loss bump; the rewind held it at the low phase's LR for the remaining
    # 250 steps (kept 0.11 of the bare run's progress). Warming, it is back at the loop's in ~50.
    opt = _opt(28.0)
    ceiling = _warmed(opt, 10)
    assert ceiling.ceiling == pytest.approx(2.0)
    for _ in range(5):  # steps near an incident, or with an episode building: it waits
        ceiling.after_step(learning_rate(opt), calm=False)
    assert ceiling.ceiling == pytest.approx(2.0)
    for _ in range(60):
        ceiling.after_step(learning_rate(opt), calm=True)
    assert ceiling.factor(28.0) == 1.0  # caught up: the optimizer steps at the loop's rate
    ceiling.hold(1.0, rewarm=True)
    _set(opt, 0.5)  # the loop's LR under the ceiling (a pulse ended): nothing to warm toward
    ceiling.after_step(learning_rate(opt), calm=True)
    assert ceiling.ceiling == 1.0


def test_a_rises_ceiling_stays_flat_on_calm_steps():
    # the instability came at the end of a climb: warming would climb into it again
    opt = _opt(10.0)
    ceiling = LrCeiling(opt, rewarm=10)
    ceiling.hold(1.0)
    for _ in range(30):
        ceiling.after_step(learning_rate(opt), calm=True)
    assert ceiling.ceiling == 1.0 and ceiling.factor(10.0) == pytest.approx(0.1)


def test_a_warming_ceiling_survives_a_state_dict_round_trip():
    opt = _opt(8.0)
    ceiling = _warmed(opt, 10)
    other = LrCeiling(opt, rewarm=10)
    other.load_state_dict(ceiling.state_dict())
    assert other.warming and other.ceiling == pytest.approx(2.0)
    other.load_state_dict({"lr_ceiling": 0.5, "lr_ceiling_calm": 0})  # an older state_dict: a flat ceiling
    assert not other.warming
