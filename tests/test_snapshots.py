"""In-memory snapshots: a cadence that bounds the steps a rewind loses, a ring that keeps the
recent past covered and recycles its buffers, a host-RAM budget reported once at watch()."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

import earlywarn
from earlywarn.events import Kind, Level
from earlywarn.recover import Recovery, RecoveryConfig, SnapshotRing
from earlywarn.recover.budget import estimate_snapshot_bytes, parse_memory
from fixtures_models import MLP

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*")


def _model_opt():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt):
    opt.zero_grad()
    x = torch.randn(16, 8)
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()


def _ptrs(snap):
    return [t.data_ptr() for t in snap.host.tree["model"].values()] + [
        v.data_ptr() for st in snap.host.tree["optimizer"]["state"].values() for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0]


def test_a_full_ring_recycles_the_buffers_of_the_snapshot_it_replaces():
    model, opt = _model_opt()
    ring = SnapshotRing(keep=2, keep_unclean=0)
    _step(model, opt)
    first = ring.capture(0, model=model, optimizer=opt)
    second = ring.capture(5, model=model, optimizer=opt)
    owned = {tuple(_ptrs(first)), tuple(_ptrs(second))}
    for step in range(10, 60, 5):
        _step(model, opt)
        snap = ring.capture(step, model=model, optimizer=opt)
        assert tuple(_ptrs(snap)) in owned  # no host allocation per snapshot
        assert torch.equal(snap.state["model"]["inp.weight"], model.inp.weight)
    assert [s.step for s in ring.entries] == [50, 55]


def test_a_recycled_snapshot_replays_its_copy_plan_and_walks_again_when_the_state_changed():
    from earlywarn.recover.snapshot import capture_state

    model, opt = _model_opt()
    _step(model, opt)
    first = capture_state(0, model=model, optimizer=opt, check_finite=True)
    assert set(first.plans) >= {("model",), ("optimizer", "state")}
    rows = [v for st in first.tree["optimizer"]["state"].values() for v in st.values() if v.dim() > 0]
    assert any(r._base is not None for r in rows)  # small tensors of one shape: rows of one buffer
    _step(model, opt)
    again = capture_state(1, model=model, optimizer=opt, check_finite=True, reuse=first)
    assert again.tree["model"] is first.tree["model"]  # the plan replayed: no walk, same buffers
    assert again.finite() and again.owned_finite()
    for name, t in model.state_dict().items():
        assert torch.equal(again.tree["model"][name], t)
    for i, st in enumerate(opt.state_dict()["state"].values()):
        for k, v in st.items():
            assert torch.equal(again.tree["optimizer"]["state"][i][k], v)
    # reallocated weights (a .data swap) and poisoned state: walked again, still exact, flagged
    model.hidden.weight.data = model.hidden.weight.data.clone()
    next(iter(opt.state.values()))["exp_avg"].view(-1)[0] = float("nan")
    third = capture_state(2, model=model, optimizer=opt, check_finite=True, reuse=again)
    assert torch.equal(third.tree["model"]["hidden.weight"], model.hidden.weight)
    assert not third.finite() and not third.owned_finite()


def test_faster_snapshots_thin_the_newest_and_keep_the_older_ones():
    model, opt = _model_opt()
    _step(model, opt)
    ring = SnapshotRing(keep=4, keep_unclean=0)
    for step in (25, 50, 75, 100):  # the steady cadence
        ring.capture(step, model=model, optimizer=opt)
    ring.capture(105, model=model, optimizer=opt)  # an episode builds: every 5 steps
    assert [s.step for s in ring.entries] == [50, 75, 100, 105]
    for step in (110, 115, 120):
        ring.capture(step, model=model, optimizer=opt)
    assert [s.step for s in ring.entries] == [50, 75, 100, 120]  # the newest is thinned, the reach stays


def test_default_cadence_bounds_the_steps_a_rewind_loses(tmp_path):
    cfg = RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl"))
    assert (cfg.every, cfg.every_building) == (25, 5)
    assert (RecoveryConfig(max_lost_steps=20).every, RecoveryConfig(max_lost_steps=20).every_building) == (10, 2)
    worst = 0
    for incident in range(30, 130, 7):
        for lag in (0, 5, 12, 23):  # how long the incident took to show after it began
            model, opt = _model_opt()
            rec = Recovery(model, opt, cfg)
            for step in range(incident):
                _step(model, opt)
                rec.after_step(step, clean=True)
            report = rec.rewind(incident, "loss_diverged", onset=incident - lag)
            assert report.restored_step <= incident - lag - 2
            worst = max(worst, report.lost_steps)
    assert worst <= cfg.max_lost_steps


def test_a_building_episode_snapshots_every_few_steps_and_stays_clean(tmp_path):
    model, opt = _model_opt()
    rec = Recovery(model, opt, RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    for step in range(60):
        _step(model, opt)
        rec.after_step(step, clean=True, building=40 <= step < 50)
    # 40 and 45 while building; the ring of 3 keeps 0 and 25 and the newest of the fast ones
    assert [(s.step, s.clean, s.building) for s in rec.ring.entries] == [
        (0, True, False), (25, True, False), (45, True, True)]


def test_the_memory_budget_sizes_the_ring_and_is_reported_once(tmp_path):
    model, opt = _model_opt()
    estimate = estimate_snapshot_bytes(model, opt)
    _step(model, opt)
    size = estimate_snapshot_bytes(model, opt)
    assert estimate <= size <= 1.01 * estimate  # the estimate before AdamW's first step (no step counters)
    from earlywarn.sinks.console import ConsoleSink

    out = io.StringIO()
    ew = earlywarn.watch(model, opt, sinks=[ConsoleSink(stream=out)], recovery=RecoveryConfig(
        snapshot_memory=3 * size, quarantine_path=str(tmp_path / "q.jsonl")))
    (plan,) = out.getvalue().splitlines()  # a note on the console at watch(), not an incident
    assert plan.startswith("[earlywarn] in-memory snapshots every 25 steps (5 while an episode builds)")
    assert "2 clean + 1 warning copy" in plan and "the budget holds 2 of snapshot_keep=3" in plan
    assert plan == f"[earlywarn] {ew.recovery.plan}"
    assert (ew.recovery.ring.keep, ew.recovery.ring.keep_unclean) == (2, 1)
    for _ in range(60):
        _step(model, opt)
    ew.flush()
    assert len(ew.recovery.ring.entries) == 2 and out.getvalue().splitlines() == [plan]  # said once
    assert not [e for e in ew.events if e.signal == "snapshot_plan"]
    ew.close()


def test_a_budget_too_small_for_one_snapshot_turns_them_off_and_says_so(tmp_path):
    from earlywarn.sinks.console import ConsoleSink

    model, opt = _model_opt()
    out = io.StringIO()
    with pytest.warns(RuntimeWarning, match="in-memory snapshots are OFF"):
        ew = earlywarn.watch(model, opt, sinks=[ConsoleSink(stream=out)], recovery=RecoveryConfig(
            snapshot_memory="1kB", quarantine_path=str(tmp_path / "q.jsonl")))
    (plan,) = out.getvalue().splitlines()
    assert plan.startswith("[earlywarn] in-memory snapshots are OFF: one takes ~")
    assert "raise snapshot_memory or set checkpoint_dir" in plan and ew.recovery.ring is None
    assert not [e for e in ew.events if e.kind is Kind.CHECKPOINT] and ew.counters["checkpoints"] == 0
    ew.close()


def test_memory_sizes_parse_and_bad_ones_name_the_field():
    assert parse_memory(1000, available=None) == 1000
    assert parse_memory("8GB", available=None) == 8 * 10**9
    assert parse_memory("512 MiB", available=None) == 512 * 2**20
    assert parse_memory("20%", available=1000) == 200
    assert parse_memory(0.5, available=1000) == 500
    for bad in ("lots", -1, 1.5, True, "0%"):
        with pytest.raises(ValueError, match=r"RecoveryConfig.snapshot_memory="):
            RecoveryConfig(snapshot_memory=bad)
    for name, value in (("max_lost_steps", 0), ("snapshot_every_building", 0), ("on_recurrence", "retry"),
                        ("recurrence_lr_factor", 1.5), ("rewind_restore_rng", "yes"), ("repair", "false"),
                        ("checkpoint_dir", ""), ("quarantine_path", 3)):
        with pytest.raises(ValueError, match=rf"RecoveryConfig.{name}="):
            RecoveryConfig(**{name: value})


def test_quiet_steps_agree_with_the_rule_step_by_step(tmp_path):
    # quiet_steps answers the usual case (clean, nothing building) from the first step due; the
    # rule it stands for, step by step: the first step recorded anew, clean and due ends them
    import random

    from earlywarn.guard.episode import Episode

    model, opt = _model_opt()
    rng = random.Random(5)
    for ckpt in (None, 7):
        cfg = RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl"), snapshot_every=6, snapshot_keep=2,
                             clean_window=4, checkpoint_dir=None if ckpt is None else str(tmp_path / "c"),
                             checkpoint_every=ckpt or 1000)
        rec = Recovery(model, opt, cfg)
        for _ in range(400):
            step = rng.randrange(0, 60)
            snaps = rec.snapshots
            snaps.last_snapshot = rng.choice([None, *range(max(0, step - 10), step + 3)])
            snaps.last_checkpoint = rng.randrange(max(0, step - 10), step + 3)
            rec.history.last_step = rng.choice([None, step - 1, step, step + 2])
            rec.window.since = rng.choice([None, step - 6, step - 2, step + 1])
            pick = rng.choice([None, step - 6, step - 2, step + 1])
            ep = Episode(4, alert=pick, unclean=rng.choice([None, step - 6, step - 1]))
            seen, k = rec.history.last_step, rng.randrange(1, 20)
            want = next((j for j in range(k) if (seen is None or step + j > seen) and ep.clean(step + j)
                         and rec.window.clean(step + j) and snaps.due(step + j, ep.building(step + j))), k)
            assert rec.quiet_steps(step, k, clean=ep.clean, building=ep.building) == want
