"""The peers' published rules, holes included, behind earlywarn's observe() shape."""

from __future__ import annotations

import math

import numpy as np
import pytest

from earlywarn.detect import Observation, StreamingDetector
from earlywarn.detect.peers import (PEERS, KillLossSpike, LightningSpikeDetection, NanLossCheck,
                                    NonfiniteGradCheck, OlmoSkipStep, ZClipRule)
from earlywarn.events import Event


def obs(step, g=1.0, loss=2.0):
    return Observation(step=step, grad_norm=g, loss=loss)


def noisy(n, seed=0, g=1.0, loss=2.0):
    rng = np.random.default_rng(seed)
    return [obs(i, float(g * np.exp(rng.normal(0, 0.05))), float(loss * np.exp(rng.normal(0, 0.01))))
            for i in range(n)]


def fires(rule, observations):
    return [o.step for o in observations if rule.observe(o)]


@pytest.mark.parametrize("name", sorted(PEERS))
def test_every_peer_has_the_detector_shape_and_a_state_round_trip(name):
    seq = noisy(300, seed=1)
    seq[250] = obs(250, 50.0, 9.0)
    seq += [obs(300 + i, 30.0, 10.0) for i in range(10)]
    whole = PEERS[name]() if name != "killlossspike" else KillLossSpike()
    expected = [(o.step, [e.message for e in whole.observe(o)]) for o in seq]
    first = PEERS[name]() if name != "killlossspike" else KillLossSpike()
    got = [(o.step, [e.message for e in first.observe(o)]) for o in seq[:200]]
    second = PEERS[name]() if name != "killlossspike" else KillLossSpike()
    second.load_state_dict(first.state_dict())
    got += [(o.step, [e.message for e in second.observe(o)]) for o in seq[200:]]
    assert got == expected
    events = [e for o in seq for e in StreamingDetector().observe(o)]  # same observe() shape
    assert all(isinstance(e, Event) for e in events)
    if name not in ("nan-loss", "nonfinite-grad"):
        assert any(msgs for _, msgs in expected)


def test_nan_loss_check_fires_only_on_non_finite_losses():
    rule = NanLossCheck()
    assert fires(rule, [obs(0), obs(1, loss=float("nan")), obs(2, g=float("inf")), obs(3, loss=float("inf"))]) == [1, 3]


def test_olmo_skipstep_waits_64_steps_fires_beyond_6_sigma_and_a_nan_poisons_its_window():
    seq = noisy(200, seed=2)
    seq[10] = obs(10, 100.0)  # before max(20, 128 // 2) = 64 losses: ignored (and out of the window by 150)
    seq[150] = obs(150, 1.6)  # 1.6x is > 6 sigma of a 5%-noise norm
    rule = OlmoSkipStep()
    assert fires(rule, seq) == [150]
    # one NaN loss enters the window: every step is skipped until it leaves (~128 steps)
    rule = OlmoSkipStep()
    seq = noisy(500, seed=3)
    seq[200] = obs(200, loss=float("nan"))
    f = fires(rule, seq)
    assert f[0] == 200 and 200 + 128 in f and len(f) >= 128 and 200 + 130 not in f


def test_olmo_skipstep_spikes_inflate_its_std():
    # a 1000x spike at step 100 inflates std for 128 steps: a 3x spike right after is missed
    seq = noisy(300, seed=4)
    seq[100] = obs(100, 1000.0)
    seq[110] = obs(110, 3.0)
    seq[260] = obs(260, 3.0)
    assert fires(OlmoSkipStep(), seq) == [100, 260]


def test_zclip_fires_above_z_2_5_after_25_steps_and_a_nan_disables_it_forever():
    seq = noisy(100, seed=5)
    seq[10] = obs(10, 5.0)  # warm-up: collecting, never fires
    seq[60] = obs(60, 5.0)
    rule = ZClipRule()
    assert 60 in fires(rule, seq) and 10 not in fires(ZClipRule(), seq)
    rule = ZClipRule()
    seq = noisy(100, seed=6)
    seq[50] = obs(50, float("nan"))
    seq[80] = obs(80, 1000.0)
    for o in seq:
        rule.observe(o)
    assert math.isnan(rule.mean)  # adaptive clipping is silently off from here on
    assert not rule.observe(obs(100, 1e9))


def test_killlossspike_needs_a_full_window_and_five_consecutive_2x_losses():
    base = noisy(100, seed=7)
    four = [obs(100 + i, loss=5.0) for i in range(4)] + [obs(104, loss=2.0)]
    assert fires(KillLossSpike(), base + four) == []
    five = [obs(100 + i, loss=5.0) for i in range(6)]
    assert fires(KillLossSpike(), base + five) == [104, 105]
    assert fires(KillLossSpike(), base[:50] + [obs(50 + i, loss=9.0) for i in range(10)]) == []
    # the window is 5% of the run when that is longer than 100 steps
    assert KillLossSpike(max_steps=10_000).window == 500


def test_nonfinite_grad_check_fires_on_any_non_finite_gradient_value():
    rule = NonfiniteGradCheck()
    seq = noisy(20)
    seq[5] = obs(5, math.inf)
    seq[9] = Observation(step=9, grad_norm=1.0, loss=2.0, layer_nonfinite=np.array([0, 1]))
    seq[12] = Observation(step=12, grad_norm=1.0, loss=2.0, layer_norms=np.array([0.5, math.nan]))
    assert fires(rule, seq) == [5, 9, 12]


def test_lightning_spike_detection_as_published():
    seq = [obs(i, loss=2.0) for i in range(30)]
    seq[15] = obs(15, loss=5.9)  # 2.95x the running mean: not a spike (rtol 2: >= 3x)
    assert fires(LightningSpikeDetection(), seq) == []
    seq[15] = obs(15, loss=6.0)  # 3x: a spike, kept out of the running mean
    seq[16] = obs(16, loss=6.5)  # still a spike (worse than the last admitted value)
    seq[20] = obs(20, loss=math.nan)  # non-finite: a spike (finite_only=True)
    assert fires(LightningSpikeDetection(), seq) == [15, 16, 20]
    # a loss that improved on the previous one is never a spike, however high
    rule = LightningSpikeDetection()
    seq = [obs(0, loss=100.0)] + [obs(i, loss=1.0) for i in range(1, 12)] + [obs(12, loss=1.0)]
    assert fires(rule, seq) == []
    # the first batch (warmup=1) is never judged
    assert fires(LightningSpikeDetection(), [obs(0, loss=math.nan)]) == []
