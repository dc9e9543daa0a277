"""Policy: alerts -> actions with hysteresis, cooldowns, rate limits; config validation; state."""

from __future__ import annotations

import json
import math

import pytest

from earlywarn.events import Event, Kind, Level
from earlywarn.policy import Action, Policy, PolicyConfig

LEVEL = {Kind.NONFINITE_GRAD: Level.CRITICAL, Kind.COLLAPSE_RISK: Level.WARNING,
         Kind.LOSS_NONFINITE: Level.CRITICAL, Kind.LOSS_DIVERGED: Level.WARNING,
         Kind.GRAD_SPIKE: Level.INFO, Kind.SCALER_OVERFLOW: Level.INFO, Kind.GRAD_OUTLIER: Level.WARNING}


def ev(step: int, kind: Kind, **values) -> Event:
    signal = values.pop("signal", None)
    return Event(step=step, kind=kind, level=LEVEL[kind], message=f"{kind} at {step}", signal=signal,
                 values=values)


def run(policy: Policy, script: dict[int, list[Kind]], steps: int) -> dict[int, list[Action]]:
    out = {}
    for s in range(steps):
        acts = list(policy.decide(s, [ev(s, k) for k in script.get(s, [])]).actions)
        if acts:
            out[s] = acts
    return out


def test_defaults_map_each_alert_to_its_documented_action():
    p = Policy()
    assert not p.decide(0, []).actions
    assert not p.decide(1, [ev(1, Kind.GRAD_SPIKE)]).actions
    assert not p.decide(2, [ev(2, Kind.SCALER_OVERFLOW)]).actions
    assert p.decide(3, [ev(3, Kind.NONFINITE_GRAD)]).actions == (Action.SKIP,)
    assert p.decide(4, [ev(4, Kind.COLLAPSE_RISK)]).actions == (Action.CHECKPOINT,)
    assert p.decide(5, [ev(5, Kind.LOSS_NONFINITE)]).actions == (Action.REWIND,)
    assert p.decide(6, [ev(6, Kind.GRAD_OUTLIER, ratio=1e4, loss_ratio=1.0, steps=1)]).actions == (Action.CLIP,)
    # a diverged loss with nothing abnormal before it: a change in the data, no rewind
    d = p.decide(7, [ev(7, Kind.LOSS_DIVERGED, steps=8)])
    assert not d.actions and "no abnormal update and no rising learning rate before it" in d.reasons[0]


def test_nonfinite_streak_turns_skips_into_a_rewind_then_starts_over():
    p = Policy(PolicyConfig(rewind_cooldown=20))
    acts = run(p, {s: [Kind.NONFINITE_GRAD] for s in range(10, 15)}, 15)
    assert acts[10] == [Action.SKIP] and acts[11] == [Action.SKIP]
    assert acts[12] == [Action.REWIND, Action.SKIP]  # most drastic first
    assert acts[13] == [Action.SKIP] and acts[14] == [Action.SKIP]
    # the streak restarted at the rewind; the next rewind would be inside the cooldown, and says so
    d = p.decide(15, [ev(15, Kind.NONFINITE_GRAD)])
    assert d.actions == (Action.SKIP,)
    assert any("no rewind" in r and "cooldown" in r for r in d.reasons)
    assert d.suppressed and "PolicyConfig.rewind_cooldown" in d.suppressed[0]
    # by default there is no cooldown: an instability that comes back is the recovery's to diagnose
    p = Policy()
    acts = run(p, {s: [Kind.NONFINITE_GRAD] for s in range(10, 15)}, 15)
    d = p.decide(15, [ev(15, Kind.NONFINITE_GRAD)])
    assert acts[12][0] is Action.REWIND and d.first is Action.REWIND and not d.suppressed
    assert d.nonfinite_streak == 3  # what the granted rewind was for (the onset of the streak)


def test_a_nonfinite_loss_counts_toward_the_streak():
    p = Policy()
    assert p.decide(10, [ev(10, Kind.LOSS_NONFINITE)], state_finite=True).actions == (Action.SKIP,)
    assert p.decide(11, [ev(11, Kind.NONFINITE_GRAD)]).actions == (Action.SKIP,)
    d = p.decide(12, [ev(12, Kind.LOSS_NONFINITE)], state_finite=True)
    assert d.actions == (Action.REWIND, Action.SKIP)
    assert d.rewind_triggers == ("nonfinite_streak",) and p.nonfinite_streak == 0


def test_the_state_check_makes_a_lone_nonfinite_step_a_skip_or_a_rewind():
    p = Policy()
    # finite parameters and state: the bad step was never applied -- one bad batch, skipped
    assert p.decide(0, [ev(0, Kind.NONFINITE_GRAD), ev(0, Kind.LOSS_NONFINITE)], state_finite=True).actions == (Action.SKIP,)
    assert not p.rewinds and p.nonfinite_streak == 1
    # poisoned already: a skip cannot fix it
    d = p.decide(1, [ev(1, Kind.NONFINITE_GRAD)], state_finite=False)
    assert d.actions == (Action.REWIND,) and d.rewind_triggers == ("nonfinite_grad",)
    # the streak still rewinds three bad steps in a row, finite state or not
    p = Policy()
    for s in range(2):
        p.decide(s, [ev(s, Kind.LOSS_NONFINITE)], state_finite=True)
    assert p.decide(2, [ev(2, Kind.LOSS_NONFINITE)], state_finite=True).actions == (Action.REWIND, Action.SKIP,)
    # a user who asked to halt on a NaN loss gets that, state or not
    p = Policy(PolicyConfig(on_loss_nonfinite="halt"))
    assert p.decide(0, [ev(0, Kind.LOSS_NONFINITE)], state_finite=True).actions == (Action.HALT,)


def test_poisoned_optimizer_state_alone_is_repaired_not_rewound():
    p = Policy(PolicyConfig(rewind_cooldown=10, max_rewinds_per_window=1))
    d = p.decide(0, [ev(0, Kind.NONFINITE_GRAD)], state_finite=False, repairable=True)
    assert d.actions == (Action.REPAIR,) and d.rewind_triggers == ("nonfinite_grad",)
    assert not p.rewinds and p.nonfinite_streak == 0  # the repair acted: the streak starts over
    assert p.decide(1, [ev(1, Kind.LOSS_NONFINITE)]).actions == (Action.REWIND,)  # neither cooldown nor limit hit
    # a divergence or a streak is not the optimizer state's alone: a rewind, repairable or not
    p = Policy()
    for s in range(2):
        p.decide(s, [ev(s, Kind.NONFINITE_GRAD)], state_finite=True)
    d = p.decide(2, [ev(2, Kind.NONFINITE_GRAD)], state_finite=False, repairable=True)
    assert d.first is Action.REWIND and "nonfinite_streak" in d.rewind_triggers


def test_warning_checkpoints_have_cooldown_hysteresis_and_a_rate_limit():
    cfg = PolicyConfig(checkpoint_cooldown=10, checkpoint_rearm=5, max_checkpoints=3, checkpoint_window=1000)
    p = Policy(cfg)
    # a warning every 3 steps: after the first checkpoint it never stays quiet for 5 steps
    acts = run(p, {s: [Kind.COLLAPSE_RISK] for s in range(0, 60, 3)}, 60)
    assert [s for s, a in acts.items() if Action.CHECKPOINT in a] == [0]
    # quiet periods re-arm, the cooldown spaces them, the rate limit caps them
    p = Policy(cfg)
    script = {s: [Kind.COLLAPSE_RISK] for s in (0, 4, 20, 40)}
    acts = run(p, script, 60)
    assert [s for s, a in acts.items() if Action.CHECKPOINT in a] == [0, 20, 40]
    d = p.decide(60, [ev(60, Kind.COLLAPSE_RISK)])
    assert not d.actions and any("rate limit" in r for r in d.reasons)
    p2 = Policy(cfg)
    run(p2, {0: [Kind.COLLAPSE_RISK]}, 5)
    d = p2.decide(5, [ev(5, Kind.COLLAPSE_RISK)])
    assert not d.actions and "cooldown" in d.reasons[0]


def test_too_many_rewinds_within_the_window_halt_the_run():
    cfg = PolicyConfig(rewind_cooldown=5, max_rewinds_per_window=3, rewind_window=100)
    p = Policy(cfg)
    acts = run(p, {s: [Kind.LOSS_NONFINITE] for s in (10, 12, 20, 30, 40)}, 50)
    assert acts[10] == [Action.REWIND]
    assert 12 not in acts  # inside the cooldown
    assert acts[20] == [Action.REWIND] and acts[30] == [Action.REWIND]
    assert acts[40] == [Action.HALT]
    # outside the window, rewinds are allowed again
    p = Policy(cfg)
    acts = run(p, {s: [Kind.LOSS_NONFINITE] for s in (0, 50, 100, 160)}, 170)
    assert all(acts[s] == [Action.REWIND] for s in (0, 50, 100, 160))


def test_configured_actions_and_none():
    p = Policy(PolicyConfig(on_collapse_risk="skip", on_loss_nonfinite=Action.HALT, on_nonfinite_grad="none",
                            rewind_after_nonfinite=0))
    assert p.decide(0, [ev(0, Kind.COLLAPSE_RISK)]).actions == (Action.SKIP,)
    assert p.decide(1, [ev(1, Kind.LOSS_NONFINITE)]).actions == (Action.HALT,)
    for s in range(2, 10):
        assert not p.decide(s, [ev(s, Kind.NONFINITE_GRAD)]).actions
    # action events (the guard's own records) are not inputs
    assert not p.decide(10, [Event(step=10, kind=Kind.REWIND, level=Level.WARNING, message="rewound")]).actions


def test_the_old_name_max_rewinds_still_works_and_names_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"PolicyConfig\(max_rewinds=\.\.\.\) is deprecated: use max_rewinds_per_window"):
        cfg = PolicyConfig(max_rewinds=1)
    assert cfg.max_rewinds_per_window == 1 and cfg == PolicyConfig(max_rewinds_per_window=1)
    with pytest.warns(DeprecationWarning, match=r"PolicyConfig.max_rewinds is deprecated: use max_rewinds_per_window"):
        assert cfg.max_rewinds == 1
    with pytest.warns(DeprecationWarning):
        assert PolicyConfig.from_dict({"max_rewinds": 2}).max_rewinds_per_window == 2  # a config saved before
    with pytest.raises(ValueError, match=r"max_rewinds=2 \(the deprecated name of max_rewinds_per_window\) and "
                                         r"max_rewinds_per_window=4 disagree"), pytest.warns(DeprecationWarning):
        PolicyConfig(max_rewinds=2, max_rewinds_per_window=4)
    assert "max_rewinds" not in PolicyConfig().to_dict()


def test_config_validation_names_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"on_collapse_risk='restart'.*checkpoint"):
        PolicyConfig(on_collapse_risk="restart")
    with pytest.raises(ValueError, match=r"max_rewinds_per_window=-1.*>= 0"):
        PolicyConfig(max_rewinds_per_window=-1)
    with pytest.raises(ValueError, match=r"rewind_window=0"):
        PolicyConfig(rewind_window=0)
    with pytest.raises(ValueError, match=r"checkpoint_cooldown=1.5"):
        PolicyConfig(checkpoint_cooldown=1.5)
    cfg = PolicyConfig(on_grad_spike="checkpoint")
    assert cfg.on_grad_spike is Action.CHECKPOINT
    assert PolicyConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="repair.*poisoned optimizer state"):
        PolicyConfig(on_loss_diverged="repair")
    with pytest.raises(ValueError, match="unknown field"):
        PolicyConfig.from_dict({"max_rewind": 3})


def test_state_dict_round_trip_mid_run_gives_the_same_decisions():
    script = {}
    for s in range(0, 400, 7):
        script[s] = [Kind.COLLAPSE_RISK]
    for s in (50, 51, 52, 53, 120, 200, 230, 260, 300):
        script.setdefault(s, []).append(Kind.NONFINITE_GRAD if s < 60 else Kind.LOSS_NONFINITE)
    cfg = PolicyConfig(checkpoint_cooldown=30, checkpoint_rearm=0, rewind_cooldown=10, rewind_window=150)
    whole = run(Policy(cfg), script, 400)
    for cut in (1, 52, 121, 255):
        first = Policy(cfg)
        got = run(first, {s: k for s, k in script.items() if s < cut}, cut)
        second = Policy(cfg)
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        for s in range(cut, 400):
            acts = list(second.decide(s, [ev(s, k) for k in script.get(s, [])]).actions)
            if acts:
                got[s] = acts
        assert got == whole, cut
    assert any(Action.HALT in a for a in whole.values())


def test_action_parse_and_str():
    assert Action.parse("Rewind") is Action.REWIND and str(Action.HALT) == "halt"
    with pytest.raises(ValueError, match="unknown action"):
        Action.parse("pause")


# -- the response to finite trouble (issue 20) -------------------------------------------------------

def test_an_outlier_is_taken_at_its_typical_norm_and_a_run_of_them_bounded():
    """No batch goes untrained for a finite outlier: the first of a run is taken at its typical
    norm, the rest at outlier_clip_ratio typical norms -- under plain SGD (its step is the
    gradient) at OUTLIER_GROWTH x the bound before, so that a new regime trains at full size within
    a few steps. Nothing is quarantined, nothing counts toward a rewind."""
    from earlywarn.policy import OUTLIER_GROWTH, Evidence

    out = lambda s, ratio=30.0: [ev(s, Kind.GRAD_OUTLIER, ratio=ratio, loss_ratio=5.0, steps=1)]
    p = Policy()  # Adam and its kin
    ds = [p.decide(s, out(s), Evidence(30.0, 5.0)) for s in range(10, 30)]
    assert all(d.actions == (Action.CLIP,) for d in ds)
    assert [d.clip_factor * 30.0 for d in ds] == pytest.approx([1.0] + [3.0] * 19)
    assert p.nonfinite_streak == 0 and p.abnormal is None  # a bounded outlier is no abnormal update
    p.decide(30, [], Evidence(1.0, 1.0))  # the bound starts over after an ordinary step
    assert p.decide(31, out(31), Evidence(30.0, 5.0)).clip_factor == pytest.approx(1.0 / 30.0)

    p = Policy(scale_free=False)  # plain SGD
    ds = [p.decide(s, out(s), Evidence(30.0, 5.0)) for s in range(10, 30)]
    grown = [OUTLIER_GROWTH ** k for k in range(20)]
    assert [d.clip_factor * 30.0 for d, g in zip(ds, grown) if g < 30.0] == pytest.approx([g for g in grown if g < 30.0])
    assert all(not d.actions for d, g in zip(ds, grown) if g >= 30.0)  # past its size: taken whole
    assert p.abnormal is None  # the run's regime, bound outgrown: still no abnormal update


def test_on_grad_outlier_skip_skips_the_first_outlier_skips_of_a_run_then_bounds_the_rest():
    from earlywarn.policy import Evidence

    p = Policy(PolicyConfig(on_grad_outlier="skip", outlier_skips=3))
    out = lambda s: [ev(s, Kind.GRAD_OUTLIER, ratio=30.0, loss_ratio=5.0, steps=1)]
    ds = [p.decide(s, out(s), Evidence(30.0, 5.0)) for s in range(10, 16)]
    assert [d.actions for d in ds[:3]] == [(Action.SKIP,)] * 3
    assert all(d.actions == (Action.CLIP,) for d in ds[3:]) and ds[3].clip_factor == pytest.approx(3.0 / 30.0)
    with pytest.raises(ValueError, match="on_loss_diverged='clip'.*only outlier gradients"):
        PolicyConfig(on_loss_diverged="clip")


def test_a_run_of_outliers_ends_when_the_gradient_is_back_near_its_typical_norm():
    """A noisy new regime: outliers (>= 20x) with steps of 5-15x between them. Those steps are
    applied and do not end the run; a gradient back under
    ``outlier_clip_ratio`` x typical does."""
    from earlywarn.policy import Evidence

    p = Policy()
    assert not p.watching
    out = lambda s: [ev(s, Kind.GRAD_OUTLIER, ratio=30.0, loss_ratio=5.0, steps=1)]
    factors = []
    for s in range(10, 22):
        if s % 2:  # elevated, under the outlier ratio: no alert, applied as it is
            assert p.watching  # a run is under way: the step's ratio decides whether it ends
            assert not p.decide(s, [], Evidence(8.0, 5.0)).actions
        else:
            factors.append(p.decide(s, out(s), Evidence(30.0, 5.0)).clip_factor * 30.0)
    assert factors == pytest.approx([1.0] + [3.0] * 5)
    # back near its typical norm: the run is over, the next outlier starts a new one at its typical norm
    assert not p.decide(22, [], Evidence(1.5, 1.0)).actions and not p.watching
    assert p.decide(23, out(23), Evidence(30.0, 5.0)).clip_factor == pytest.approx(1.0 / 30.0)
    # the count is part of the policy's state (a resumed run goes on with it)
    q = Policy()
    q.load_state_dict(p.state_dict())
    assert q.watching and q.outliers == 1


def test_lone_outliers_with_the_loss_far_up_are_each_taken_at_their_typical_norm():
    """Lone outliers whose loss is far up: a bad shard's corrupt batches, or a rarely drawn hard
    task through a shared head -- nothing tells them apart when they come, and a skipped one is
    never learned from. Each is taken at its typical norm: a bad batch does one ordinary step."""
    from earlywarn.policy import Evidence

    p = Policy()
    for s in range(10, 200, 15):
        d = p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=60.0, loss_ratio=40.0, steps=1)], Evidence(60.0, 40.0))
        assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(1.0 / 60.0)
        assert not p.decide(s + 1, [], Evidence(1.0, 1.0)).actions


def test_outliers_right_after_a_large_update_of_the_runs_own_are_applied():
    from earlywarn.policy import Evidence

    p = Policy()
    # a part unfrozen: its first update carries a 25x gradient, new layers joined: applied ...
    joined = [ev(50, Kind.GRAD_OUTLIER, ratio=25.0, loss_ratio=1.0, steps=1, joined=1.0)]
    assert not p.decide(50, joined, Evidence(25.0, 1.0)).actions
    # ... and the run recovering from it has large gradients for a while: applied, as a bare run would
    out = lambda s: [ev(s, Kind.GRAD_OUTLIER, ratio=22.0, loss_ratio=6.0, steps=s - 49)]
    assert all(not p.decide(s, out(s), Evidence(12.0, 6.0)).actions for s in range(51, 70))


def test_an_outlier_where_an_idle_part_trains_again_is_applied_and_bounded():
    """A rarely sampled task's step (its head idle since its last one): the run's own kind of step,
    applied as it is up to IDLE_STEP_CAP typical norms; a 1e4x gradient where an idle expert came
    back is scaled down to the cap, not applied whole."""
    from earlywarn.policy import IDLE_STEP_CAP, Evidence

    p = Policy()
    idle = lambda s, ratio: [ev(s, Kind.GRAD_OUTLIER, ratio=ratio, loss_ratio=80.0, steps=1, joined=1.0, idle=1.0)]
    assert not p.decide(50, idle(50, 45.0), Evidence(45.0, 80.0)).actions
    for s in range(51, 60):
        p.decide(s, [], Evidence(1.0, 1.0))
    d = p.decide(60, idle(60, 1e4), Evidence(1e4, 80.0))
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(IDLE_STEP_CAP / 1e4)
    assert "idle for steps trains again" in d.clip_note
    # the first time a part trains (joined, not idle: a late unfreeze) is applied whole, as before
    q = Policy()
    assert not q.decide(50, [ev(50, Kind.GRAD_OUTLIER, ratio=1e4, loss_ratio=1.0, steps=1, joined=1.0)],
                        Evidence(1e4, 1.0)).actions


def test_a_diverged_loss_is_rewound_only_after_an_abnormal_update_and_to_before_it():
    cfg = PolicyConfig(on_grad_outlier="none")  # the outlier is taken in full, then the loss rises
    p = Policy(cfg)
    assert not p.decide(100, [ev(100, Kind.GRAD_OUTLIER, ratio=20.0, loss_ratio=1.0, steps=1)]).actions
    for s in range(101, 110):
        p.decide(s, [])
    d = p.decide(110, [ev(110, Kind.LOSS_DIVERGED, steps=8)])  # the rise began at 103
    assert d.actions == (Action.REWIND,) and d.onset_back == 11  # back to before step 100
    # the same rise with no abnormal update before it: a change in the data
    p = Policy(cfg)
    for s in range(50, 110):
        p.decide(s, [])
    assert not p.decide(110, [ev(110, Kind.LOSS_DIVERGED, steps=8)]).actions
    # an abnormal update long before the rise (beyond divergence_lookback) explains nothing
    p = Policy(cfg)
    p.decide(10, [ev(10, Kind.GRAD_OUTLIER, ratio=20.0, loss_ratio=1.0, steps=1)])
    for s in range(11, 110):
        p.decide(s, [])
    assert not p.decide(110, [ev(110, Kind.LOSS_DIVERGED, steps=8)]).actions


def test_an_lr_jump_is_copied_and_watched_and_an_unstable_run_rewinds_with_the_lr_held():
    from earlywarn.policy import Evidence

    jump = [ev(50, Kind.COLLAPSE_RISK, signal="lr", baseline=1e-3, ratio=50.0, lr_ref=1e-3, lr_jump_ratio=50.0)]
    p = Policy()
    d = p.decide(50, jump)
    assert d.lr_copy and Action.CHECKPOINT in d  # a clean copy before the jump's update
    assert not p.decide(51, [], Evidence(1.2, 1.0)).actions
    d = p.decide(52, [], Evidence(6.0, 1.1))  # two steps after the jump the gradient is 6x
    assert d.actions == (Action.REWIND,) and d.lr_ceiling == 1e-3 and d.onset_back == 2
    assert d.rewind_triggers == ("lr_jump",)
    # a jump the run takes calmly is kept; once the LR is back, the jump is over
    p = Policy()
    p.decide(50, jump)
    assert all(not p.decide(s, [], Evidence(1.3, 1.05, 5e-2)).actions for s in range(51, 60))
    assert p.probe is not None  # the LR is still up
    p.decide(60, [], Evidence(1.0, 1.0, 1e-3))
    assert p.probe is None
    # a pulse that the alert sees again later (its LR still up) is rewound to its first step
    p = Policy()
    p.decide(50, jump, Evidence(1.0, 1.0, 5e-2))
    for s in range(51, 60):
        p.decide(s, [], Evidence(1.2, 1.0, 5e-2))
    p.decide(60, [ev(60, Kind.COLLAPSE_RISK, signal="lr", baseline=1e-3, ratio=50.0, lr_ref=1e-3)], Evidence(1.2, 1.0, 5e-2))
    d = p.decide(61, [], Evidence(4.0, 1.0, 5e-2))
    assert d.actions == (Action.REWIND,) and d.onset_back == 11 and d.lr_ceiling == 1e-3
    # the probe and the latest abnormal update survive a save and a load
    p = Policy()
    p.decide(50, jump)
    q = Policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.decide(51, [], Evidence(9.0, 1.0)).lr_ceiling == 1e-3


def test_a_divergence_a_rising_learning_rate_led_into_is_rewound_with_the_lr_held():
    from earlywarn.policy import Evidence

    p = Policy()
    for s in range(100):  # the loop ramps its LR 1.03x a step from step 40
        p.decide(s, [], Evidence(1.0, 1.0, 1e-3 * 1.03 ** max(0, s - 40)))
    d = p.decide(100, [ev(100, Kind.LOSS_DIVERGED, steps=8)], Evidence(3.0, 5.0, 1e-3 * 1.03 ** 60))
    assert d.actions == (Action.REWIND,) and d.hold_lr_at_target and d.lr_ceiling is None
    # the same divergence under a flat LR: no rewind
    p = Policy()
    for s in range(100):
        p.decide(s, [], Evidence(1.0, 1.0, 1e-3))
    assert not p.decide(100, [ev(100, Kind.LOSS_DIVERGED, steps=8)], Evidence(3.0, 5.0, 1e-3)).actions


def test_an_lr_jump_told_by_a_warning_of_another_rule_is_watched_too():
    from earlywarn.policy import Evidence

    # the gradient and the loss rising together at the very step the LR jumped: one warning (the
    # together rule's), which says the LR jumped too -- the jump is copied and watched all the same
    together = [ev(50, Kind.COLLAPSE_RISK, signal="grad_norm", ratio=8.0, lr_ref=1e-3, lr_jump_ratio=60.0)]
    p = Policy()
    assert p.decide(50, together, Evidence(8.0, 1.6, 6e-2)).lr_copy
    d = p.decide(51, [], Evidence(5.0, 1.7, 6e-2))
    assert d.actions == (Action.REWIND,) and d.lr_ceiling == 1e-3 and d.onset_back == 1


def test_calm_is_decide_of_a_step_without_alerts_while_nothing_is_watched():
    # random runs of every kind of alert (LR jumps watched, streaks, outliers, divergences): at each
    # step without alerts and nothing watched, calm() leaves the state decide() would and decides the same
    import copy
    import random

    from earlywarn.policy import Evidence

    kinds = [Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE, Kind.GRAD_SPIKE, Kind.COLLAPSE_RISK, Kind.LOSS_DIVERGED]
    compared = 0
    for seed in range(20):
        rng = random.Random(seed)
        p = Policy()
        for s in range(200):
            lr = rng.choice([1e-3, 1e-3, 1e-3, 3e-3, 1e-2])
            alerts = []
            if rng.random() < 0.15:
                kind = rng.choice(kinds + [Kind.GRAD_OUTLIER])
                values = {"steps": rng.randint(1, 6)}
                if kind is Kind.GRAD_OUTLIER:
                    values.update(ratio=rng.choice([30.0, 1e4]), loss_ratio=1.0)
                if kind is Kind.COLLAPSE_RISK and rng.random() < 0.5:
                    values["lr_ref"] = 1e-3
                alerts = [ev(s, kind, **values)]
            evidence = Evidence(rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), lr)
            if alerts or p.watching:
                p.decide(s, alerts, evidence, state_finite=rng.choice([None, True]))
                continue
            ref = copy.deepcopy(p)
            assert p.calm(lr) == ref.decide(s, [], evidence)
            assert p.state_dict() == ref.state_dict()
            compared += 1
    assert compared > 2000


def test_a_gradient_that_climbed_into_the_outliers_is_applied_with_its_growth_bounded():
    """A loss weight ramped up (KL annealing): the gradient was elevated for steps and the first
    outlier is at most CLIMB_GROWTH times the step before -- applied as it is; a 1e4x batch
    inside the climb is scaled to CLIMB_GROWTH times the scale reached; the climb's steps are not
    abnormal updates (a loss that stays up after them is not rewound). A burst that jumps from an
    ordinary step, or from one elevated step, is bounded from its typical norm."""
    from earlywarn.policy import CLIMB_GROWTH, Evidence

    def out(s, ratio, prev, elevated):
        return [ev(s, Kind.GRAD_OUTLIER, ratio=ratio, loss_ratio=ratio, steps=1, prev_ratio=prev, prev_elevated=elevated)]

    p = Policy()
    assert not p.decide(100, out(100, 21.0, 15.0, 6), Evidence(21.0, 21.0)).actions
    assert not p.decide(101, out(101, 40.0, 21.0, 7), Evidence(40.0, 40.0)).actions
    d = p.decide(102, out(102, 1e4, 40.0, 8), Evidence(1e4, 40.0))
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(CLIMB_GROWTH * 40.0 / 1e4)
    assert "climbed" in d.clip_note
    assert not p.decide(103, out(103, 60.0, 1e4, 9), Evidence(60.0, 60.0)).actions
    # the loss, up with the weight, reads as diverged: nothing abnormal was applied, no rewind
    d = p.decide(104, [ev(104, Kind.LOSS_DIVERGED, steps=8)], Evidence(30.0, 60.0))
    assert Action.REWIND not in d.actions
    # the policy's state keeps the climb
    q = Policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.climb == p.climb == 60.0

    # a jump from an ordinary step (a burst of corrupt batches), or from one noisy elevated step,
    # or more than CLIMB_GROWTH above a climb: no climb, bounded from its typical norm
    for prev, elevated, ratio in ((1.0, 0, 25.0), (8.0, 1, 25.0), (8.0, 5, 30.0)):
        p = Policy()
        d = p.decide(100, out(100, ratio, prev, elevated), Evidence(ratio, ratio))
        assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(1.0 / ratio) and p.climb != p.climb
    # a climb ends where the gradient is back under outlier_clip_ratio typical norms
    p = Policy()
    p.decide(100, out(100, 21.0, 15.0, 6), Evidence(21.0, 21.0))
    p.decide(101, [], Evidence(1.5, 1.0))
    assert p.climb != p.climb
    assert p.decide(102, out(102, 25.0, 1.0, 0), Evidence(25.0, 1.0)).clip_factor == pytest.approx(1.0 / 25.0)


def test_a_run_of_outliers_damaged_the_loss_only_where_it_lost_some_of_the_runs_progress():
    """BURST_END_LOSS (the loss 2x its level before the run) counts as damage only with at least
    BURST_END_MATTERS of the run's progress lost too: a run memorized down to a loss near 0 meets a
    new stage's floor at 100x+ that level, having lost nothing that counts. Half the progress lost
    is damage at any ratio (a classifier's loss is bounded by chance); unknown progress (a loss that
    is not positive): the ratio alone."""
    from earlywarn.outlier_rules import BURST_END_LOSS, BURST_END_LOST, BURST_END_MATTERS, damaged

    assert damaged(2.5, 0.2)  # shuffled labels: 2.5x its level, a fifth of the progress lost
    assert damaged(BURST_END_LOSS, BURST_END_MATTERS)
    assert damaged(2.5, math.nan)
    assert damaged(1.2, BURST_END_LOST)
    assert not damaged(142.0, 0.0004)  # memorized to ~1e-5, a new stage learned to ~1e-3
    assert not damaged(1.5, 0.3)


def test_a_burst_taken_bounded_is_rewound_when_it_ends_having_damaged_the_model():
    """A run of outliers trains on, bounded. If it then ends in one step (its norm from >=
    BURST_END_DROP x the clip ratio to under it) with the loss BURST_END_LOSS x its level before the
    run, and the loss is so still BURST_HEAL_STEPS later, it was a burst of bad batches that damaged
    the model: rewound to before its first outlier. A phase of other data that the run recovers from
    by then, a run that ends with the loss at its level (a loss weight raised for a phase), a regime
    learned down gradually, one whose ratio falls only because the detector's baseline moved to it,
    or one that outlasts the detector's baselines is not."""
    from earlywarn.policy import BURST_END_WITHIN, BURST_HEAL_STEPS, Evidence

    def step(ratio, loss, norm=None):  # the loss's level is 1.0, the typical norm 1.0
        return Evidence(ratio, loss, math.nan, loss, ratio if norm is None else norm)

    def run(p, length=10, ratio=40.0):
        for s in range(100, 100 + length):
            d = p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=ratio, loss_ratio=50.0, steps=1)], step(ratio, 50.0))
            assert d.actions == (Action.CLIP,)
        return 100 + length

    def after(p, end, losses):
        """The steps after the run's end, one per loss; -> the last decision."""
        for k, loss in enumerate(losses, 1):
            d = p.decide(end + k, [], step(1.0, loss))
            if k < len(losses):
                assert not d.actions and p.watching
        return d

    p = Policy()
    end = run(p)
    d = p.decide(end, [], step(0.8, 3.0))  # the next batch is clean again: the model is worse on it
    assert not d.actions and p.watching  # a phase of other data ends so too: watched
    d = after(p, end, [2.5] * BURST_HEAL_STEPS)
    assert d.actions == (Action.REWIND,) and d.rewind_triggers == ("burst_end",)
    assert d.onset_back == end + BURST_HEAL_STEPS - 100 + 1  # back to before the run's first outlier
    assert "still 2.5x its level" in d.reasons[0] and not p.watching

    # recovered by then: a phase of other data the run came back from
    p = Policy()
    end = run(p)
    p.decide(end, [], step(0.8, 3.0))
    d = after(p, end, [3.0 - 1.7 * k / BURST_HEAL_STEPS for k in range(1, BURST_HEAL_STEPS + 1)])
    assert not d.actions and not p.watching

    # still far above a memorized level, but falling fast with little of the run's progress lost: a
    # new stage being learned (BURST_HEAL_FALL), not rewound; the same fall with most of it lost is
    from earlywarn.outlier_rules import BURST_HEAL_FALL

    falling = [50.0 * (20.0 / 50.0) ** (k / BURST_HEAL_STEPS) for k in range(1, BURST_HEAL_STEPS + 1)]
    assert falling[-1] - 1.0 <= BURST_HEAL_FALL * (falling[0] - 1.0)
    for first_loss, rewound in ((2000.0, False), (30.0, True)):  # 1% of the run's progress lost / 68%
        p = Policy()
        p.decide(1, [], Evidence(1.0, first_loss, 1e-3, first_loss, 1.0))  # the run's first loss (its level 1.0)
        end = run(p)
        p.decide(end, [], step(0.8, 50.0))
        d = after(p, end, falling)
        assert (d.actions == (Action.REWIND,)) is rewound, first_loss

    # the policy's state carries a run in progress, and a run under watch, across a resume
    for watched in (False, True):
        p = Policy()
        end = run(p)
        if watched:
            p.decide(end, [], step(0.8, 3.0))
            after(p, end, [2.5] * 10)
        q = Policy()
        q.load_state_dict(json.loads(json.dumps(p.state_dict())))
        if watched:
            d = after(q, end + 10, [2.5] * (BURST_HEAL_STEPS - 10))
        else:
            q.decide(end, [], step(0.8, 3.0))
            d = after(q, end, [2.5] * BURST_HEAL_STEPS)
        assert d.actions == (Action.REWIND,)

    # a dip inside a noisy run is not its end: the step before was low already, or the run's level is
    not_a_burst = [
        dict(end=step(0.8, 1.2)),  # the loss at its level: a phase the run trained through
        dict(end=step(0.8, 3.0), before=[step(r, 3.0) for r in (25.0, 12.0, 6.0, 3.5)]),  # learned down
        dict(end=step(2.0, 3.0), before=[step(r, 3.0) for r in (40.0, 9.0)]),  # over two steps
        dict(end=step(21.0, 1e5), outlier=True),  # memorized data met again, forgotten: still an outlier
        dict(end=step(0.8, 3.0), length=4),  # four steps trained on: the run's own first updates moved it
        dict(end=step(0.8, 3.0), length=10, skips=10),  # never trained on: all of it was skipped
        dict(end=step(0.8, 3.0), length=BURST_END_WITHIN + 1),  # the baselines moved meanwhile
    ]
    for case in not_a_burst:
        skips = case.get("skips")
        p = Policy(PolicyConfig(on_grad_outlier="skip", outlier_skips=skips) if skips else None)
        length = case.get("length", 10)
        for s in range(100, 100 + length):
            p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=40.0, loss_ratio=50.0, steps=1)], step(40.0, 50.0))
        s = 100 + length
        for before in case.get("before", []):  # steps between 3x and the outlier ratio: the run goes on, lower
            assert not p.decide(s, [], before).actions
            s += 1
        alerts = []
        if case.get("outlier"):  # the run at 1000x, then 21x: an outlier still, the run goes on
            for s in range(s, s + 3):
                p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=1000.0, loss_ratio=1e7, steps=1)], step(1000.0, 1e7))
            s += 1
            alerts = [ev(s, Kind.GRAD_OUTLIER, ratio=21.0, loss_ratio=1e5, steps=1)]
        assert Action.REWIND not in p.decide(s, alerts, case["end"]).actions, case
        if alerts:
            continue
        assert not p.watching, case


def test_a_one_step_dip_inside_a_run_of_outliers_is_not_its_end():
    """A run's end is confirmed the step after: an outlier again there (one batch of a new phase's
    data the model already fits, its gradient 20x under the run's) means the run goes on, its
    start and its level kept; its real end is judged as any other (``phase-307-004`` was rewound
    with a CRITICAL so, the gradient back at its level the step after the dip)."""
    from earlywarn.policy import BURST_HEAL_STEPS, Evidence

    def step(ratio, loss):  # the loss's level and the typical norm before the run: 1.0
        return Evidence(ratio, loss, math.nan, loss, ratio)

    def outlier(p, s):
        return p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=40.0, loss_ratio=50.0, steps=1)], step(40.0, 50.0))

    p = Policy()
    for s in range(100, 110):
        assert outlier(p, s).actions == (Action.CLIP,)
    assert not p.decide(110, [], step(0.8, 3.0)).actions  # a dip: judged as an end, watched
    assert p.watching and p.burst_watch is not None
    assert outlier(p, 111).actions == (Action.CLIP,)  # the run again: the dip was not its end
    assert p.burst_watch is None and p.outliers == 11 and p.run_start == 1  # (ticks: the first decide is 1)
    for s in range(112, 120):
        outlier(p, s)
    d = p.decide(120, [], step(0.8, 3.0))  # its real end, the loss damaged and so it stays
    for k in range(1, BURST_HEAL_STEPS + 1):
        d = p.decide(120 + k, [], step(1.0, 2.5))
    assert d.actions == (Action.REWIND,) and d.onset_back == 120 + BURST_HEAL_STEPS - 100 + 1  # before the run's start

    # an end the next step confirms: watched from the step it ended
    p = Policy()
    for s in range(100, 110):
        outlier(p, s)
    p.decide(110, [], step(0.8, 3.0))
    p.decide(111, [], step(1.0, 2.5))
    assert p.burst_watch is not None and p.burst_watch[1] == 11 and p.run_start is None  # (tick 11: step 110)


@pytest.mark.parametrize("after_end", ["elevated", "at_run_level"])
def test_an_end_followed_by_a_large_gradient_without_an_outlier_is_still_judged(after_end):
    """Only an outlier the step after a run's end makes that end a dip. A gradient still
    ``outlier_clip_ratio`` times its typical norm without one is what clean batches give a model
    a burst damaged: its end stays watched. (Cancelling the watch on that too, the measured
    alternative, left ``burst-0-007-L80`` -- 80 steps of scaled, shuffled batches under RMSprop --
    unrewound at 0.00 of its twin's progress, against 0.99 rewound; nothing else moved over the
    six seed bases.)"""
    from earlywarn.policy import Evidence

    def step(ratio, loss, norm=math.nan):  # the loss's level and the typical norm before the run: 1.0
        return Evidence(ratio, loss, math.nan, loss, ratio if norm != norm else norm)

    p = Policy()
    for s in range(100, 110):
        d = p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=40.0, loss_ratio=50.0, steps=1)], step(40.0, 50.0))
        assert d.actions == (Action.CLIP,)
    assert not p.decide(110, [], step(0.8, 3.0)).actions  # the end, the loss damaged: watched
    watch = p.burst_watch
    assert watch is not None
    ratio = p.cfg.outlier_clip_ratio
    if after_end == "elevated":  # over the clip ratio, no alert
        p.decide(111, [], step(ratio * 1.5, 3.0))
    else:  # the detector's ratio ~1, the norm still at the run's level
        p.decide(111, [], step(1.0, 3.0, norm=40.0))
    assert p.burst_watch == watch  # still watched from the step it ended


def test_a_run_the_detector_took_as_its_new_normal_is_still_judged_when_it_ends():
    """The detector re-anchors a plateau held ``readapt_steps`` (a new regime trains whole from
    then on): the outliers stop, the ratio falls to ~1 while the norm holds at the run's level.
    The run stays open while its norm is ``outlier_clip_ratio`` times the typical norm before it
    or more (where it would go on had the baseline stayed), and no copy of its steps is clean:
    ended in one step with the loss damaged against its level *before* the run (the detector's
    has moved to the run's), and damaged still ``BURST_HEAL_STEPS`` later, it was a burst, rewound
    to before its first outlier. A regime that holds is let go ``BURST_END_WITHIN`` steps after
    its start; one that is learned down ends where its norm is back under 3x the typical."""
    from earlywarn.policy import BURST_END_WITHIN, BURST_HEAL_STEPS, Evidence

    def step(ratio, loss_ratio, norm, loss=None):  # the typical norm and the loss's level before the run: 1.0
        return Evidence(ratio, loss_ratio, math.nan, loss_ratio if loss is None else loss, norm)

    def regime(p, outliers=30, taken=20):
        for s in range(100, 100 + outliers):
            d = p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=40.0, loss_ratio=50.0, steps=1)], step(40.0, 50.0, 40.0))
            assert d.actions == (Action.CLIP,)
        s = 100 + outliers
        for s in range(s, s + taken):  # re-anchored: the ratios are the run's own level now
            d = p.decide(s, [], step(1.0, 1.0, 40.0, loss=50.0))
            assert not d.actions and p.watching and p.run_unjudged  # taken whole, its end still to be judged
        return s + 1

    # a burst: back to clean batches in one step, the model damaged against the level before it
    p = Policy()
    end = regime(p)
    d = p.decide(end, [], step(0.02, 0.06, 0.8, loss=3.0))  # ratios against the run's level now
    assert not d.actions and p.watching
    for k in range(1, BURST_HEAL_STEPS + 1):
        d = p.decide(end + k, [], step(0.02, 0.05, 0.8, loss=2.5))
        assert p.run_unjudged or k == BURST_HEAL_STEPS  # its end watched: no copy is clean
    assert d.actions == (Action.REWIND,) and d.rewind_triggers == ("burst_end",)
    assert d.onset_back == end + BURST_HEAL_STEPS - 100 + 1  # back to before the run's first outlier
    assert "still 2.5x its level" in d.reasons[0]

    # the same, the loss back at its level before the run: a phase the run trained through
    p = Policy()
    end = regime(p)
    assert not p.decide(end, [], step(0.02, 0.02, 0.8, loss=1.1)).actions
    assert not p.watching and not p.run_unjudged

    # a regime that holds: let go BURST_END_WITHIN steps after its first outlier
    p = Policy()
    end = regime(p, taken=BURST_END_WITHIN - 30)
    assert end == 100 + BURST_END_WITHIN
    assert not p.decide(end, [], step(1.0, 1.0, 40.0, loss=50.0)).actions
    assert not p.watching

    # learned down: the norm back under 3x the typical norm before the run, over several steps
    p = Policy()
    end = regime(p)
    for k, norm in enumerate((20.0, 8.0, 3.5)):
        assert not p.decide(end + k, [], step(norm / 40.0, 1.0, norm, loss=20.0)).actions
        assert p.watching
    assert not p.decide(end + 3, [], step(2.5 / 40.0, 1.0, 2.5, loss=2.0)).actions
    assert not p.watching and not p.run_unjudged

    # the policy's state carries the levels before the run across a resume
    p = Policy()
    end = regime(p)
    q = Policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.run_before == p.run_before == (1.0, 1.0)
    assert not q.decide(end, [], step(0.02, 0.06, 0.8, loss=3.0)).actions and q.watching


def test_a_learning_rate_the_run_took_calmly_for_steps_did_not_lead_into_a_loss_rise():
    """The LR-rise rewind wants the LR still rising into the loss's rise: a warm-up that ended 40
    steps before a change in the data is not it; a ramp rising to the onset is."""
    from earlywarn.policy import Evidence

    def loop(lr_at, onset):
        p = Policy()
        for s in range(onset + 8):
            p.decide(s, [], Evidence(1.0, 1.0, lr_at(s)))
        return p.decide(onset + 8, [ev(onset + 8, Kind.LOSS_DIVERGED, steps=8)], Evidence(1.0, 6.0, lr_at(onset + 8)))

    warmup = lambda s: 1e-3 * min(1.0, (s + 1) / 5)
    d = loop(warmup, 45)
    assert not d.actions and "no rising learning rate" in d.reasons[0]
    ramp = lambda s: 1e-3 * 1.08 ** max(0, s - 20)
    d = loop(ramp, 45)
    assert d.actions == (Action.REWIND,) and d.hold_lr_at_target
    # a warm-up that ends a few steps before the rise: the LR led into it
    d = loop(lambda s: 1e-3 * min(1.0, (s + 1) / 40), 45)
    assert d.actions == (Action.REWIND,)


# -- trouble the run makes itself (issue 48) ---------------------------------------------------------

def _lrs(p: Policy, lrs, alerts_at=None, start=0):
    from earlywarn.policy import Evidence
    out = {}
    for s, lr in enumerate(lrs, start):
        alerts = [ev(s, Kind.COLLAPSE_RISK)] if alerts_at and s in alerts_at else []
        d = p.decide(s, alerts, Evidence(1.0, 1.0, lr)) if alerts else p.calm(lr)
        out[s] = d
    return out


def test_a_learning_rate_creeping_up_is_not_held_on_a_warning_alone():
    """A rise after a calm stretch with warnings on it but the loss still improving: the warnings
    alone hold nothing (they held healthy warm restarts and cycles on rescue.py's rewarm and
    lr_cycle families); the loss getting worse is what holds it (next test)."""
    import random

    rng = random.Random(4)
    base = [1e-3 * (1.0 - 0.002 * s) for s in range(100)]  # a slow decay, then the rise
    creep = [base[-1] * 1.02 ** k for k in range(1, 60)]
    lrs = base + creep
    losses = [3.0 - 0.005 * s + rng.gauss(0.0, 0.05) for s in range(len(lrs))]
    from earlywarn.policy import Evidence
    p = Policy()
    for s, (lr, loss) in enumerate(zip(lrs, losses)):
        alerts = [ev(s, Kind.COLLAPSE_RISK)] if s in (130, 150) else []
        d = p.decide(s, alerts, Evidence(1.0, 1.0, lr, loss)) if alerts or p.watching else p.calm(lr, loss)
        assert d.lr_hold is None, s
    assert p.lr_trend.creeping


def test_a_warm_up_a_one_cycle_ramp_and_a_restart_are_no_creep():
    """Rises from the run's first steps, or in one jump, are the schedule's: a warning on them
    holds nothing."""
    warm = [1e-3 * min(1.0, (s + 1) / 80) for s in range(120)]  # linear warm-up over 80 steps
    assert all(d.lr_hold is None for d in _lrs(Policy(), warm, alerts_at={60, 79}).values())
    onecycle = [4e-5 + (1e-3 - 4e-5) * min(1.0, s / 90) for s in range(120)]
    assert all(d.lr_hold is None for d in _lrs(Policy(), onecycle, alerts_at={70}).values())
    restart = [1e-3 * (1.0 - (s % 60) / 60) + 1e-5 for s in range(180)]  # cosine-like restarts: one jump up
    assert all(d.lr_hold is None for d in _lrs(Policy(), restart, alerts_at={61, 121, 125}).values())
    # a rise after a calm stretch, too small (under 1.2x the rate it rose from): nothing
    small = [1e-3] * 100 + [1e-3 * 1.001 ** k for k in range(1, 60)]
    assert all(d.lr_hold is None for d in _lrs(Policy(), small, alerts_at={150}).values())


def _lrs_losses(p: Policy, lrs, losses):
    """Every step through the guard's own choice: decide while the policy is watching, else calm."""
    from earlywarn.policy import Evidence
    return {s: (p.decide(s, [], Evidence(1.0, 1.0, lr, loss)) if p.watching else p.calm(lr, loss))
            for s, (lr, loss) in enumerate(zip(lrs, losses))}


def test_a_creep_past_twice_the_highest_rate_with_the_loss_worse_is_held_with_no_warning():
    """A schedule bug's climb (x1.02 a step from step 100) while the loss gets worse: held at
    the rate it rose from once the LR is 2x the highest the run took, without waiting for the
    detector's warnings (they come hundreds of steps later, the run damaged), and rewound to
    before the window that got worse (its steps at the highest rates did the damage). Once for
    the rise."""
    import random

    from earlywarn.lrtrend import BEYOND, LOSS_STEPS

    rng = random.Random(3)
    lrs = [1e-3] * 100 + [1e-3 * 1.02 ** k for k in range(1, 120)]
    # improves, then worsens slowly (0.1x its noise a step) as the rate climbs
    losses = [2.5 - 0.002 * min(s, 100) + 0.01 * max(0, s - 100) + rng.gauss(0.0, 0.1) for s in range(len(lrs))]
    p = Policy()
    ds = _lrs_losses(p, lrs, losses)
    held = [s for s, d in ds.items() if d.lr_hold is not None]
    first = min(s for s in range(len(lrs)) if lrs[s] >= BEYOND * 1e-3)
    assert len(held) == 1 and first <= held[0] <= first + 20 and lrs[held[0]] < 3e-3, (held, first)
    d = ds[held[0]]
    assert d.lr_hold == pytest.approx(1e-3) and d.actions == (Action.REWIND,)
    # back to before the loss began to worsen (its 20-step mean last within one error of its level)
    assert LOSS_STEPS < d.onset_back and held[0] - d.onset_back >= 90  # not before the rise (step 100)
    assert d.rewind_triggers == ("lr_creep",)
    assert any("while the loss got worse than before it began to rise" in r for r in d.reasons)
    q = Policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.lr_trend.state_dict() == p.lr_trend.state_dict()


def test_a_rise_the_loss_gains_from_and_a_rise_to_rates_the_run_took_before_are_not_held():
    """A re-warm-up after a calm stretch (continued training: 10x in 150 steps) whose loss keeps
    improving, and a cyclic schedule's later cycles (back to rates it took before), rise step
    after step too: they hold nothing, whatever the loss does in the cycles."""
    import random

    rng = random.Random(5)
    rewarm = [1e-4] * 120 + [1e-4 * 10 ** min(1.0, k / 150) for k in range(1, 200)]
    losses = [3.0 - 0.004 * s + rng.gauss(0.0, 0.1) for s in range(len(rewarm))]
    assert all(d.lr_hold is None for d in _lrs_losses(Policy(), rewarm, losses).values())
    tri = [1e-4 + 9e-4 * (1.0 - abs((s % 100) / 50.0 - 1.0)) for s in range(600)]  # triangular, period 100
    flat = [2.0 + rng.gauss(0.0, 0.1) for _ in tri]
    assert all(d.lr_hold is None for d in _lrs_losses(Policy(), tri, flat).values())


def _tail_step(p, s, ratio=None, loss=1.0):
    """One step of a heavy-tail run: an outlier ``ratio`` times the typical norm, its loss
    ``loss`` times its level (``ratio`` None: an ordinary step)."""
    from earlywarn.policy import Evidence

    if ratio is None:
        return p.decide(s, [], Evidence(1.0, loss))
    return p.decide(s, [ev(s, Kind.GRAD_OUTLIER, ratio=ratio, loss_ratio=loss, steps=1)], Evidence(ratio, loss))


def test_rare_outliers_with_the_loss_at_its_level_are_the_runs_own_heavy_tail_once_seen():
    """A policy gradient's rare rewards: isolated outliers thousands of times the typical norm, the
    loss near its level. The first is taken bounded, element by element to 3x its RMS (a gradient
    corrupted after the loss looks the same, once; corrupt data, its loss far up, and any outlier of
    a run whose tail did damage: to its typical norm); from the second on they are taken, bounded
    to TAIL_BOUND x the largest seen. Corrupt data raises the loss with the gradient: bounded as any outlier. A tail
    outlier followed by damage to the loss ends the rule for the run."""
    from earlywarn.policy import TAIL_BOUND

    step = _tail_step
    p = Policy()
    d = step(p, 10, 5000.0, 1.4)
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(3.0 / 5000.0)  # the first: bounded
    assert d.clip_rms == 3.0 and "keeps part of its signal" in d.clip_note
    step(p, 11)
    d = step(p, 20, 6000.0, 0.8)
    assert not d.actions and p.tail_taken == p.tick  # the run's own tail: taken as it is
    step(p, 21), step(p, 22)
    d = step(p, 30, 4200.0, 2.7)  # its loss further up, but within twice the tail's (1.4): the tail's
    assert not d.actions
    step(p, 31)
    d = step(p, 40, 1e6, 1.0)  # far beyond the tail: bounded
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(TAIL_BOUND * 6000.0 / 1e6)
    assert "heavy tail" in d.clip_note
    step(p, 41)
    d = step(p, 50, 80.0, 40.0)  # corrupt data: the loss far up with it
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(1.0 / 80.0)
    step(p, 51)
    assert p.abnormal is None  # the tail's steps are the run's own, no abnormal update
    q = Policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.state_dict() == p.state_dict()
    # taken, then the loss far above its level on the next ordinary step: bounded again from then on
    assert not step(p, 60, 5000.0, 1.0).actions
    d = step(p, 61, loss=4.0)
    assert p.tail_revoked and any("bounded again" in r for r in d.reasons)
    assert step(p, 70, 5000.0, 1.0).clip_factor == pytest.approx(1.0 / 5000.0)


def test_the_rest_of_the_first_outlier_at_its_level_goes_with_the_run_s_heavy_tail():
    """The first outlier of a run with the loss at its level is bounded, and what the bound takes
    off is kept (``hold_rest``): the next such outlier within ``TAIL_RECALL`` steps, taken as the
    run's heavy tail, takes it too (``add_held``) -- a policy gradient's first rare reward is not
    lost. Later, a corrupt batch (its loss far up), plain SGD (no element bound) or a skip keep none."""
    from earlywarn.policy import TAIL_RECALL

    step = _tail_step
    p = Policy()
    d = step(p, 10, 5000.0, 1.4)
    assert d.actions == (Action.CLIP,) and d.hold_rest and not d.add_held
    step(p, 11)
    d = step(p, 20, 6000.0, 0.8)  # the run's tail: taken, with the rest
    assert not d.actions and d.add_held and not d.hold_rest
    step(p, 21)
    assert not step(p, 30, 5000.0, 1.0).add_held  # taken once only

    p = Policy()  # no second within TAIL_RECALL steps: let go
    step(p, 10, 5000.0, 1.4)
    for s in range(11, 12 + TAIL_RECALL):
        step(p, s)
    assert p.tail_held is None and not step(p, 12 + TAIL_RECALL, 6000.0, 1.0).add_held

    p = Policy()  # a first outlier far beyond the tail's size (a gradient corrupted 1e4x): its rest let go
    step(p, 10, 5e6, 1.0)
    step(p, 11)
    d = step(p, 20, 6000.0, 1.0)
    assert not d.actions and not d.add_held and p.tail_held is None

    # a corrupt batch (the loss far up with it) and plain SGD's outliers keep no rest
    assert not step(Policy(), 10, 80.0, 40.0).hold_rest
    assert not step(Policy(scale_free=False), 10, 5000.0, 1.0).hold_rest
    p = Policy(PolicyConfig(on_grad_outlier="skip"))
    assert step(p, 10, 5000.0, 1.0).actions == (Action.SKIP,) and p.tail_held is None


def test_an_outlier_whose_loss_rose_orders_of_magnitude_less_than_its_gradient_is_the_run_s_heavy_tail():
    """A policy gradient whose loss its other terms keep (an entropy bonus, no baseline): a rare
    reward raises the gradient 1e5x and the loss only 4.3x. That is no batch the model finds wrong
    (``TAIL_LOSS_POWER``): the first is bounded to 3x its RMS with its rest kept, the next taken as
    the run's tail with that rest. A wrong batch raises the loss with the gradient -- a bad shard at
    1e3x and 500x, a mildly wrong one at 90x and 4.1x: each does one ordinary step, never a tail."""
    from earlywarn.outlier_rules import TAIL_LOSS_POWER, loss_at_level

    step = _tail_step
    p = Policy()
    d = step(p, 69, 1e5, 4.25)
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(3.0 / 1e5) and d.hold_rest
    step(p, 70)
    d = step(p, 91, 1.2e5, 4.3)
    assert not d.actions and d.add_held and p.tail_taken == p.tick
    step(p, 92)
    assert not step(p, 161, 1.4e5, 7.7).actions  # within twice the tail's loss: the tail's

    q = Policy()
    for s, (ratio, loss) in zip(range(10, 100, 20), [(1e3, 500.0), (90.0, 4.1), (1e3, 494.0), (4e7, 1.1e5)]):
        d = step(q, s, ratio, loss)
        assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(1.0 / ratio) and not d.hold_rest
        step(q, s + 1)
    assert q.tail_seen == 0 and q.tail_taken is None
    # the rule itself: the loss under the gradient's ratio to the TAIL_LOSS_POWER, or under TAIL_LOSS
    assert loss_at_level(2.0, 30.0) and loss_at_level(9.0, 1e4) and 1e4 ** TAIL_LOSS_POWER > 9.0
    assert not loss_at_level(4.1, 90.0) and not loss_at_level(float("nan"), 1e5)
    assert not loss_at_level(3.0, float("nan")) and not loss_at_level(3.0, float("inf"))


def test_far_out_an_outlier_s_loss_may_rise_further_and_still_be_the_run_s_tail():
    """Past ``TAIL_LOSS_FAR`` (1e3x) wrong data raises the loss at least ``r ** 0.35`` (bad shards
    and bursts ``r ** 0.41``) and a rare reward at most ``r ** 0.33``: the bound grows from its value
    there as ``r ** TAIL_LOSS_POWER_FAR``. A first reward of 2.1e5x at 31.9x is the run's tail (it
    was held to one ordinary step, and the run kept 0.30 of bare's progress); a bad shard at 1080x
    and 17x, a burst at 2180x and 34.5x, and a hopeless run's 1.8e4x at 30.9x are still wrong
    batches; under 1e3x nothing moved, and the bound is continuous there."""
    from earlywarn.outlier_rules import TAIL_LOSS_FAR, TAIL_LOSS_POWER, loss_at_level

    assert loss_at_level(31.9, 2.07e5) and loss_at_level(27.0, 1e5) and not loss_at_level(29.0, 1e5)
    assert not any(loss_at_level(loss, r) for r, loss in [(1080.0, 17.0), (2180.0, 34.5), (1.83e4, 30.9)])
    edge = TAIL_LOSS_FAR ** TAIL_LOSS_POWER
    assert loss_at_level(edge * 0.999, TAIL_LOSS_FAR * 0.999) and loss_at_level(edge * 0.999, TAIL_LOSS_FAR)
    assert not loss_at_level(edge * 1.001, TAIL_LOSS_FAR * 0.999) and not loss_at_level(edge * 1.001, TAIL_LOSS_FAR)
    assert loss_at_level(4.0, 300.0) and not loss_at_level(4.2, 300.0)  # 300 ** 0.25 = 4.16: as before

    step = _tail_step
    p = Policy()
    d = step(p, 22, 2.07e5, 31.9)  # the first: bounded to 3x its RMS, its rest kept (it was held to 1x)
    assert d.actions == (Action.CLIP,) and d.clip_rms == 3.0 and d.hold_rest


def test_a_first_outlier_that_moves_a_loss_standing_still_is_the_run_s_signal_taken_whole():
    """A policy gradient without a baseline: its entropy term keeps the loss all but constant
    (-0.011, changes of 1e-6) until a rare reward moves it to 2.4 with a gradient 1e4x its typical
    norm. Bounded as a gradient corrupted after its loss would be, the reward was lost (kept
    0.82-0.97 of bare's progress); it moved the loss 1e5x its noise, which no corruption after the
    loss does (``TAIL_SIGNAL_Z``): taken whole, watched as the tail's (a loss 3x up after it: such
    outliers are bounded again). The same outlier on a loss that moves as much every step, or one
    with no loss history, is bounded as before."""
    import random

    from earlywarn.outlier_rules import TAIL_SIGNAL_Z, loss_jump
    from earlywarn.policy import Evidence

    rng = random.Random(3)

    def run(noise, reward_loss, after=(1.0, 1.0, 1.0), lr=1e-3):
        p, d = Policy(), None
        loss = -0.011
        for s in range(40):
            loss = -0.011 + rng.gauss(0.0, noise)
            p.decide(s, [], Evidence(1.0, 1.0, lr, loss))
        d = p.decide(40, [ev(40, Kind.GRAD_OUTLIER, ratio=1e4, loss_ratio=1.4, steps=1)],
                     Evidence(1e4, 1.4, lr, reward_loss))
        later = [p.decide(41 + i, [], Evidence(1.0, r, lr, -0.011)) for i, r in enumerate(after)]
        return p, d, later

    p, d, _ = run(1e-6, 2.4)
    assert not d.actions and d.clip_factor is None and p.tail_taken == p.tick - 3  # taken whole
    assert not p.tail_revoked
    p, d, later = run(1e-6, 2.4, after=(1.0, 3.5))  # the loss 3.5x its level after it: the rule ends
    assert not d.actions and p.tail_revoked and any("bounded again" in r for r in later[1].reasons)
    p, d, _ = run(0.5, 2.4)  # a loss that moves as much every step: bounded, its rest kept
    assert d.actions == (Action.CLIP,) and d.clip_factor == pytest.approx(3.0 / 1e4) and d.hold_rest
    p, d, _ = run(1e-6, 2.4, lr=math.nan)  # no learning rate, no loss history: as before
    assert d.actions == (Action.CLIP,) and d.hold_rest
    # the measure: the step's change over the typical change of the steps before it
    trend = [1.0 - 0.01 * i for i in range(20)]
    assert loss_jump(trend) == pytest.approx(1.0)  # a smooth descent's next step
    jump = loss_jump(trend[:-1] + [trend[-2] + 50.0])  # 50 where the steps moved 0.01
    assert jump == pytest.approx(5000.0) and jump >= TAIL_SIGNAL_Z
    wobble = [1.0 + 0.1 * (-1) ** i for i in range(20)]  # two batches in turn
    assert loss_jump(wobble + [wobble[-1] + 0.3]) == pytest.approx(1.5)
    nan = [[0.0] * 5, [2.0] * 20 + [3.0], [1.0] * 19 + [math.nan, 1.0]]  # too few; a stale loss; a NaN
    assert all(loss_jump(xs) != loss_jump(xs) for xs in nan)


def test_a_factor_left_in_the_loop_is_held_past_sixteen_times_whatever_the_loss():
    """x1.03 a step after a calm stretch, the loss still improving (a climb the train loss does not
    show: on the rescue benchmark ten dying climbs never got a worse loss): held once at the rate it
    rose from, with no rewind, when it passes ``CREEP_FAR`` times the highest rate taken; later,
    a loss worse than before the climb still rewinds. A linear ramp to 9.5x, a factor that stops
    at 7x and a geometric re-warm-up to 10x (the test above) are not held."""
    import random

    from earlywarn.lrtrend import CREEP_FAR

    rng = random.Random(8)
    low, flat = 1e-3, 120

    def improving(n):
        return [3.0 - 0.004 * s + rng.gauss(0.0, 0.05) for s in range(n)]

    creep = [low] * flat + [low * 1.03 ** k for k in range(1, 120)]
    ds = _lrs_losses(Policy(), creep, improving(len(creep)))
    held = [s for s, d in ds.items() if d.lr_hold is not None]
    assert len(held) == 1 and ds[held[0]].lr_hold == pytest.approx(low) and not ds[held[0]].actions
    assert CREEP_FAR * low <= creep[held[0]] < 1.04 * CREEP_FAR * low
    assert "no schedule rises so" in ds[held[0]].lr_hold_why
    # capped, then the loss worse than before the climb: the loss rule still rewinds
    worse = improving(flat + 100) + [4.0 + rng.gauss(0.0, 0.05) for _ in range(len(creep) - flat - 100)]
    p = Policy()
    ds = _lrs_losses(p, creep, worse)
    rewound = [s for s, d in ds.items() if Action.REWIND in d.actions]
    assert len(rewound) == 1 and rewound[0] > held[0] and ds[rewound[0]].lr_hold == pytest.approx(low)
    ramp = [low] * flat + [low * (1.0 + 8.5 * k / 100) for k in range(1, 101)]  # linear, to 9.5x
    assert all(d.lr_hold is None for d in _lrs_losses(Policy(), ramp, improving(len(ramp))).values())
    short = [low] * flat + [low * 1.03 ** k for k in range(1, 67)] + [low * 1.03 ** 66] * 40  # stops at 7x
    assert all(d.lr_hold is None for d in _lrs_losses(Policy(), short, improving(len(short))).values())


def test_a_scheduled_linear_ramp_whose_loss_worsens_at_its_top_is_held_only_past_ten_times():
    """A cyclic schedule's first rise after a flat stretch (1x to 7x over 54 steps, the loss worse
    and worse as it climbs, better as it comes down) adds the same amount every step, where a
    factor left in the loop grows its steps with the rate (that climb, above, is held). Not held (a
    healthy ``lr_cycle`` run was rewound with a CRITICAL so, at 6.9x); the same ramp going on
    without end is held once past ``RAMP_BEYOND`` times the highest rate taken, and a factor of
    1.02 on a cosine's decay is still a creep."""
    import random

    from earlywarn.lrtrend import BEYOND, RAMP_BEYOND

    rng = random.Random(6)
    low, flat = 1e-3, 150
    up = [low * (1.0 + 6.0 * k / 54) for k in range(1, 55)]
    tri = [low] * flat + up + up[::-1][1:] + [low] * 40

    def worse_while_up(lrs):  # improves, then 0.5x its noise worse a step while the rate is above 2x
        return [2.5 - 0.002 * min(s, flat) + 0.05 * sum(1 for x in lrs[flat:s] if x > BEYOND * low)
                + rng.gauss(0.0, 0.1) for s in range(len(lrs))]

    p = Policy()
    assert all(d.lr_hold is None and not d.actions for d in _lrs_losses(p, tri, worse_while_up(tri)).values())
    assert p.lr_trend.peak == pytest.approx(7 * low)
    ramp = [low] * flat + [low * (1.0 + 6.0 * k / 54) for k in range(1, 200)]  # a ramp without end
    ds = _lrs_losses(Policy(), ramp, worse_while_up(ramp))
    held = [s for s, d in ds.items() if d.lr_hold is not None]
    assert len(held) == 1 and ramp[held[0]] >= RAMP_BEYOND * low and ds[held[0]].lr_hold == pytest.approx(low)
    # a factor left in the loop on a cosine schedule's decay (x1.02 a step from step 150 of 600): held near 2x
    cos = [low * (0.1 + 0.45 * (1.0 + math.cos(math.pi * s / 600))) for s in range(600)]
    creep = cos[:flat] + [c * 1.02 ** (s - flat) for s, c in enumerate(cos[flat:], flat)]
    ds = _lrs_losses(Policy(), creep, worse_while_up(creep))
    held = [s for s, d in ds.items() if d.lr_hold is not None]
    assert len(held) == 1 and creep[held[0]] < 3.0 * max(cos[:flat]), (held, creep[held[0]] / low)
