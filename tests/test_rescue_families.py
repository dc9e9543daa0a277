"""The rescue benchmark's generator, peers, scoring and cache (benchmarks/rescue*.py)."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import rescue  # noqa: E402
import rescue_harness  # noqa: E402
from rescue_families import FAMILIES, FAULT_FAMILIES, HEALTHY, _loop_lr, twin_of  # noqa: E402
from rescue_harness import cache_key, run_one  # noqa: E402
from rescue_peers import SkipStepAdamW, SkipStepWindow  # noqa: E402


def test_the_generator_has_the_families_and_sizes_the_benchmark_promises():
    assert len(HEALTHY) >= 12 and sum(f.default_n for f in HEALTHY.values()) >= 110
    faults = [f for f in FAULT_FAMILIES.values() if f.kind == "fault"]
    assert len(faults) >= 6 and sum(f.default_n for f in faults) >= 66
    assert FAULT_FAMILIES["hopeless"].kind == "hopeless"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_generates_valid_configs_deterministically(name):
    fam = FAMILIES[name]
    configs = fam.configs(0, 4)
    assert configs == fam.configs(0, 4)
    assert json.loads(json.dumps(configs)) == configs  # plain JSON
    assert configs != fam.configs(1, 4)  # another seed base, other runs
    assert len({c["id"] for c in configs}) == len({c["seed"] for c in configs}) == 4
    for c in configs:
        assert c["family"] == name and 150 <= c["steps"] <= 600
        assert all(0 <= s < c["steps"] for s in c["task"].get("stages", []))
        fault = c["fault"]
        if fam.kind == "healthy":
            assert fault is None
        else:
            assert fault["kind"] == name and c["base_family"] in HEALTHY
            at = fault.get("at", (fault.get("steps") or [None])[0])
            if at is not None:
                assert 0.2 * c["steps"] - 1 <= at <= 0.7 * c["steps"] + 1
            assert twin_of(c)["fault"] is None and twin_of(c)["task"] == c["task"]


def _smallest(fam, n=4):
    return min(fam.configs(0, n), key=lambda c: c["steps"] * (4 if c["task"]["name"] == "chargpt" else 1) * c["accum"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_one_config_of_every_healthy_family_trains_bare(name):
    res = run_one(_smallest(HEALTHY[name]), "bare")
    assert res["error"] is None, res["error"]
    assert math.isfinite(res["E"]) and res["params_finite"] and not res["halted"]
    assert res["E"] < res["E0"], (res["E0"], res["E"])


def _strong(name: str) -> dict:
    """The config of fault family ``name`` with the highest LR among its first Adam MLP ones (a
    bad shard: the lowest among the regressions), its fault at the strong end of its range and
    late (less time to recover; a bad shard: from early on, its batches corrupt 12% of the time)."""
    adam_mlps = [c for c in FAULT_FAMILIES[name].configs(0, 12)
                 if c["opt"]["name"] in ("adam", "adamw") and c["task"]["name"] in ("regression", "classify")]
    if name == "bad_shard":  # the slowest Adam regression: its moments, inflated again and again, recover least
        cfg = min((c for c in adam_mlps if c["task"]["name"] == "regression"), key=lambda c: c["opt"]["lr"])
    else:
        cfg = max(adam_mlps, key=lambda c: c["opt"]["lr"])
    cfg = copy.deepcopy(cfg)
    f, late = cfg["fault"], int(0.7 * cfg["steps"])
    if name == "huge_grad":
        f.update(at=late, factor=1e6)
    elif name == "burst":
        f.update(at=late, length=40, how="both", scale=200.0)
    elif name == "lr_pulse":
        f.update(at=late, length=30, factor=100.0)
    elif name == "bad_shard":
        f.update(at=int(0.2 * cfg["steps"]), p=0.12, how="both", scale=200.0)
    elif name == "lr_climb":  # the earliest and steepest climb: 1.03x a step from 30% of the run on
        f.update(at=int(0.3 * cfg["steps"]), factor=1.03)
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, f in FAULT_FAMILIES.items() if f.kind == "fault"))
def test_one_config_of_every_fault_family_makes_the_bare_run_dying(name):
    cfg = _strong(name)
    bare, twin = run_one(cfg, "bare"), run_one(twin_of(cfg), "bare")
    assert bare["error"] is None and twin["error"] is None
    assert twin["E"] < twin["E0"]
    assert rescue.is_dying(bare, twin), (name, bare["E0"], bare["E"], twin["E"])


def _res(E0=2.0, E=1.0, halted=False, events=(), rewinds=0):
    return {"E0": E0, "E": E, "halted": halted, "events": list(events), "counters": {"rewinds": rewinds}}


def test_scoring_on_hand_made_numbers():
    assert rescue.kept(2.0, 1.0, 0.0) == 0.5
    assert rescue.kept(2.0, math.nan, 0.0) == 0.0 and rescue.kept(2.0, math.inf, 0.0) == 0.0
    assert math.isnan(rescue.kept(2.0, 1.0, 2.5))  # the twin made no progress: undefined
    assert rescue.kept(0.5, -0.5, -1.5) == 0.5  # losses below zero (Gaussian NLL)
    bare = _res(E=1.0)
    assert not any(rescue.healthy_harm(_res(E=1.0), bare).values())
    assert rescue.healthy_harm(_res(E=1.03), bare)["worse"]  # kept 0.97 < 1 - 0.02
    assert not rescue.healthy_harm(_res(E=1.01), bare)["worse"]
    harm = rescue.healthy_harm(_res(halted=True, rewinds=1, events=[{"level": "critical"}]), bare)
    assert harm == {"halted": True, "rewound": True, "critical": True, "worse": False}
    twin = _res(E=0.0)
    assert rescue.is_dying(_res(E=math.nan), twin) and rescue.is_dying(_res(E=0.3), twin)  # kept 0.85
    assert not rescue.is_dying(_res(E=0.1), twin)  # kept 0.95
    assert rescue.is_rescued(_res(E=0.1), twin) and not rescue.is_rescued(_res(E=0.1, halted=True), twin)
    assert not rescue.is_rescued(_res(E=0.2), twin)  # kept 0.9


def test_skip_harm_counts_a_streak_only_once_the_loss_is_back_at_its_level():
    level, up = [3.0] * 20, [9.0] * 6
    losses = level + up + [3.0] * 14  # 40 steps: a loss spike at steps 20-25, back from 26 on
    # skipped 20-33: the first 6 while the loss is up (not counted at level), 8 once it is back
    st = rescue.skip_stats({"skipped_steps": [list(range(20, 34))], "losses": [losses]})
    assert st == {"fraction": 14 / 40, "streak": 14, "streak_at_level": 8}
    assert rescue.skip_harmed(st)
    # skipped only while the loss is up: the streak is 6, none of it at the level
    st = rescue.skip_stats({"skipped_steps": [list(range(20, 26))], "losses": [losses]})
    assert st["streak"] == 6 and st["streak_at_level"] == 0
    # a one-step wobble above the level does not end "back at the level" (the median of three)
    wobbly = level + [3.0, 3.0, 3.5, 3.0, 3.0, 3.0] + [3.0] * 14
    st = rescue.skip_stats({"skipped_steps": [list(range(20, 27))], "losses": [wobbly]})
    assert st["streak_at_level"] == 7
    # a loss below zero: back at the level means within 10% of |top| above it
    neg = [-2.0] * 20 + [-1.5] * 5 + [-1.9] * 15
    st = rescue.skip_stats({"skipped_steps": [list(range(20, 30))], "losses": [neg]})
    assert st["streak_at_level"] == 5
    # a loss whose scale moved up 30x: never back at the old level, even across a step applied in
    # between (skips less than LEVEL_STEPS apart share the level from before the first)
    scaled = level + [30.0] * 20
    st = rescue.skip_stats({"skipped_steps": [[20, 21, 22] + list(range(24, 34))], "losses": [scaled]})
    assert st["streak"] == 10 and st["streak_at_level"] == 0
    # the limits: 1 of 200 steps is 0.5% (allowed), 2 are not; 5 in a row at the level allowed, 6 not
    flat = [1.0] * 200
    assert not rescue.skip_harmed(rescue.skip_stats({"skipped_steps": [[50]], "losses": [flat]}))
    assert rescue.skip_harmed(rescue.skip_stats({"skipped_steps": [[50, 90]], "losses": [flat]}))
    assert not rescue.skip_harmed({"fraction": 0.004, "streak": 5, "streak_at_level": 5})
    assert rescue.skip_harmed({"fraction": 0.004, "streak": 6, "streak_at_level": 6})
    # the worst optimizer of a two-optimizer run (a GAN) counts
    st = rescue.skip_stats({"skipped_steps": [[], [5, 6, 7]], "losses": [flat, flat]})
    assert st["streak"] == 3 and st["fraction"] == 3 / 200


def test_a_bare_spike_is_a_gradient_over_the_outlier_ratio_times_the_median_before_it():
    norms = [1.0] * 30
    norms[12], norms[25] = 19.0, 25.0
    assert [t for t, _ in rescue.bare_spikes({"grad_norms": [norms]})] == [25]
    norms[3] = 100.0  # before SPIKE_FROM: the first steps have no typical norm yet
    assert [t for t, _ in rescue.bare_spikes({"grad_norms": [norms]})] == [25]


def test_an_lr_climb_multiplies_the_loops_lr_by_its_factor_once_more_every_step():
    cfg = copy.deepcopy(FAULT_FAMILIES["lr_climb"].configs(0, 1)[0])
    cfg["fault"].update(at=10, factor=1.02)
    perturb = rescue_harness.Perturb(cfg, task=None)
    assert [perturb.lr_factor(it) for it in (0, 9)] == [1.0, 1.0]
    assert perturb.lr_factor(10) == pytest.approx(1.02) and perturb.lr_factor(109) == pytest.approx(1.02 ** 100)
    assert all(_loop_lr(c["base_family"]) for c in FAULT_FAMILIES["lr_climb"].configs(0, 12))


@pytest.mark.slow
def test_the_harness_records_the_steps_each_skipping_method_skipped():
    cfg = copy.deepcopy(min((c for c in FAULT_FAMILIES["nonfinite_grad"].configs(0, 12)
                             if c["task"]["name"] == "regression"), key=lambda c: c["steps"]))
    faulted = cfg["fault"]["steps"]
    peer = run_one(cfg, "gradscaler_skip")
    assert peer["error"] is None and peer["skipped_steps"] == [faulted] and peer["skips"] == len(faulted)
    ew = run_one(cfg, "earlywarn")
    assert ew["error"] is None
    assert len(ew["skipped_steps"][0]) == ew["counters"]["skipped_steps"] and set(faulted) <= set(ew["skipped_steps"][0])
    assert len(ew["losses"][0]) == len(ew["grad_norms"][0]) == cfg["steps"]


def test_the_cache_key_follows_earlywarn_files_for_earlywarn_runs_only(tmp_path):
    for folder, text in (("earlywarn", "a = 1\n"), ("integrations", "b = 1\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.py").write_text(text)
    cfg = HEALTHY["regression_floor"].configs(0, 1)[0]

    def keys():
        rescue_harness.earlywarn_hash.cache_clear()
        return {m: cache_key(cfg, m, ew_root=str(tmp_path)) for m in ("bare", "zclip", "earlywarn")}

    before = keys()
    assert before == keys()
    for folder in ("earlywarn", "integrations"):
        (tmp_path / folder / "m.py").write_text("changed = True\n")
        after = keys()
        assert after["earlywarn"] != before["earlywarn"]
        assert after["bare"] == before["bare"] and after["zclip"] == before["zclip"]
        before = after
    other = dict(cfg, seed=cfg["seed"] + 1)
    assert cache_key(other, "bare", ew_root=str(tmp_path)) != before["bare"]
    rescue_harness.earlywarn_hash.cache_clear()


def test_olmo_skipstep_waits_64_losses_and_a_nan_loss_holds_its_window_128_steps():
    w = SkipStepWindow()
    gen = torch.Generator().manual_seed(0)
    factors = []
    for i in range(400):
        loss = torch.tensor(math.nan) if i == 150 else 2.0 + 0.01 * torch.randn((), generator=gen)
        norm = torch.tensor(50.0) if i == 40 else 1.0 + 0.01 * torch.randn((), generator=gen)
        w.push(loss, norm)
        factors.append(float(w.factor()))
    assert factors[40] == 1.0  # before the 64th loss: never skips
    assert factors[150] == 0.0 and all(f == 0.0 for f in factors[150:150 + 129])
    assert factors[150 + 129] == 1.0  # the NaN left the window


def test_olmo_skipstep_adamw_skip_keeps_the_zero_times_nan_hole():
    p = torch.nn.Parameter(torch.ones(4))
    opt = SkipStepAdamW([p], lr=0.1)
    opt.window.losses = [torch.tensor(1.0 + 0.01 * i) for i in range(100)] + [torch.tensor(100.0)]
    opt.window.norms = [torch.tensor(1.0 + 0.01 * i) for i in range(101)]
    p.grad = torch.tensor([1.0, 1.0, 1.0, 1.0])
    opt.step()  # a loss spike: factor 0, nothing moves
    assert float(opt.last_factor) == 0.0 and torch.equal(p.detach(), torch.ones(4))
    p.grad = torch.tensor([math.nan, 1.0, 1.0, 1.0])
    opt.step()  # still factor 0 (the spike is in the window's tail); the NaN gradient poisons anyway
    assert float(opt.last_factor) == 0.0
    assert torch.isnan(opt.state[p]["exp_avg"][0]) and torch.isnan(p.detach()[0])


def test_burst_length_refuses_a_length_under_one_and_says_so():
    with pytest.raises(SystemExit) as exc:
        rescue.main(["--families", "burst", "--burst-length", "0", "--methods", "bare"])
    assert str(exc.value) == "--burst-length 0: use a number of steps >= 1"
