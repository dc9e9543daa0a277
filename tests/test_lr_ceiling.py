"""The LR ceiling (recover/lrceiling.py): held while the loop's LR is above it, lifted only once
the loop's LR has stayed back for ``settle`` steps (a rewind that restores a ramping scheduler
puts the loop's LR under the ceiling for a few steps only)."""

import pytest
import torch

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
        lifted.append(ceiling.after_step())
        lr *= 1.08
    assert not any(lifted) and ceiling.ceiling == 1.0
    assert ceiling.factor(lr) == pytest.approx(1.0 / lr)  # the optimizer steps at the ceiling


def test_a_pulse_that_ended_lifts_the_ceiling_after_settle_steps():
    opt = _opt(1.0)
    ceiling = LrCeiling(opt, release=1.5, settle=10)
    ceiling.hold(1.0)
    for _ in range(5):  # the pulse goes on
        _set(opt, 50.0)
        assert not ceiling.after_step()
    _set(opt, 1.0)  # over: the loop's LR back
    lifted = [ceiling.after_step() for _ in range(10)]
    assert lifted == [False] * 9 + [True] and ceiling.ceiling is None
    assert ceiling.factor(50.0) == 1.0


def test_the_ceiling_and_its_calm_count_survive_a_state_dict_round_trip():
    opt = _opt(1.0)
    ceiling = LrCeiling(opt, settle=10)
    ceiling.hold(0.5)
    _set(opt, 0.5)
    for _ in range(4):
        ceiling.after_step()
    other = LrCeiling(opt, settle=10)
    other.load_state_dict(ceiling.state_dict())
    assert other.ceiling == 0.5 and other.calm == 4
    other.load_state_dict({"lr_ceiling": None})  # an older state_dict: no calm count
    assert other.ceiling is None and other.calm == 0
