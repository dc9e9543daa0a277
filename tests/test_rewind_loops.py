"""Rewinds inside training loops written the way users write them: nanoGPT-style batches drawn
from the global RNG and a learning rate the loop computes itself, a loader loop, a bad batch.
Invariants: a bad batch costs one skip; no batch is trained again after a rewind; a rewind loses
at most ``max_lost_steps``; loop-owned state follows the rewind; an instability that comes back is
diagnosed (a Halt naming the recurrence and the learning rate), never rewound further back."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import earlywarn
from earlywarn.events import Kind, Level
from earlywarn.recover import BatchFingerprints, Halt, RecoveryConfig, ResumableLoader, scan_state
from fixtures_models import MLP

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*")

W = torch.randn(8, 1, generator=torch.Generator().manual_seed(5))


def key(x: torch.Tensor) -> str:
    return hashlib.blake2b(x.numpy().tobytes(), digest_size=8).hexdigest()


def nanogpt_loop(tmp_path, *, steps=80, poison_at=None, nan_at=(), lr_ramp_from=None, resync=True,
                 opt_name="adamw", **recovery):
    """Batches from torch.randn (the global RNG), the LR written by the loop from its own
    iter_num, clip_grad_norm_; returns what happened. ``resync``: ``iter_num = ew.step``."""
    torch.manual_seed(0)
    model = MLP()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt_name == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    loop = earlywarn.LoopState(iter_num=0)
    ew = earlywarn.watch(model, opt, sinks=[], extra_state={"loop": loop},
                         recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl"), **recovery))
    out = {"ew": ew, "model": model, "opt": opt, "loop": loop, "reports": [], "replayed": 0, "drawn": {},
           "abandoned": set(), "halt": None, "at_rewind": []}

    def on_rewind(report):
        out["reports"].append(report)
        out["at_rewind"].append((ew.step, loop.iter_num))
        for s in [s for s in out["drawn"] if s > report.restored_step]:
            out["abandoned"].add(out["drawn"].pop(s))

    ew.on_rewind(on_rewind)
    iter_num, poisoned = 0, False
    try:
        while iter_num < steps:
            if resync:
                iter_num = ew.step
            lr = 1e-2 if opt_name == "adamw" else 2e-2
            if lr_ramp_from is not None and iter_num >= lr_ramp_from:
                lr *= 1.08 ** (iter_num - lr_ramp_from)
            for g in opt.param_groups:
                g["lr"] = lr
            x = torch.randn(32, 8)
            y = x @ W + 0.1 * torch.randn(32, 1)
            if iter_num in nan_at:
                x = x.clone()
                x[3, 1] = float("nan")  # one corrupt sample: its loss, and the batch's, is NaN
            k = key(x)
            out["replayed"] += k in out["abandoned"]
            out["drawn"][iter_num] = k
            loss = nn.functional.mse_loss(model(x), y)
            ew.report_loss(loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if poison_at is not None and iter_num == poison_at + 1 and not poisoned:  # the update after poison_at
                poisoned = True
                model.hidden.weight.detach().fill_(float("nan"))  # NaN weights, as that update leaves them
            iter_num += 1
            loop.iter_num += 1
    except Halt as e:
        out["halt"] = e
    out["rows"] = ([json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
                   if (tmp_path / "q.jsonl").exists() else [])
    ew.close()
    return out


def test_without_a_loader_a_rewind_replays_no_batch_and_the_loop_follows(tmp_path):
    out = nanogpt_loop(tmp_path, poison_at=40)
    (r,) = out["reports"]
    ew = out["ew"]
    # NaN in Adam's m after step 40 -> NaN weights after 41 -> NaN loss at 42: rewind before 41
    assert (r.incident_step, r.restored_step, r.lost_steps) == (42, 25, 17) and r.lost_steps <= 50
    assert not r.rng_restored and out["replayed"] == 0 and len(out["abandoned"]) == 17
    rewind = next(e for e in ew.events if e.kind is Kind.REWIND)
    assert "the global RNGs were not restored" in rewind.message and "the batches that follow are new ones" in rewind.message
    # loop-owned state followed: ew.step and the LoopState are at the restored step + 1 / its value
    assert out["at_rewind"] == [(26, 25)]  # the loop's `+= 1` after optimizer.step() makes it 26
    assert ew.step == 80 and out["loop"].iter_num == 80
    # the quarantine names what is known: the step and the input's fingerprint, never a null
    rows = out["rows"]
    assert [q["step"] for q in rows] == list(range(26, 43))
    assert all(None not in q.values() and set(q) == {"incident_step", "reason", "step", "fingerprint"} for q in rows)
    assert len({q["fingerprint"] for q in rows}) == 17
    assert scan_state(out["model"], out["opt"]).clean


def test_the_control_restoring_the_rng_without_a_loader_replays_the_same_batches(tmp_path):
    out = nanogpt_loop(tmp_path, poison_at=40, rewind_restore_rng=True)
    assert out["reports"][0].rng_restored and out["replayed"] == 17  # every batch drawn since the snapshot


def test_quarantine_fingerprints_are_the_model_inputs_hash(tmp_path):
    out = nanogpt_loop(tmp_path, steps=45, poison_at=40)
    first = out["rows"][0]
    torch.manual_seed(0)  # replay the draws up to step 26 outside the run and fingerprint them
    fp = BatchFingerprints()
    MLP()
    xs = []
    for _ in range(27):
        x = torch.randn(32, 8)
        torch.randn(32, 1)
        xs.append(x)
    fp.observe(xs[26])
    fp.bind(26)
    assert first["step"] == 26 and fp.read([26])[26] == first["fingerprint"]


@pytest.mark.parametrize("at", [0, 30])
def test_a_nan_loss_from_one_corrupt_sample_costs_one_skip(tmp_path, at):
    out = nanogpt_loop(tmp_path, steps=60, nan_at={at})
    ew = out["ew"]
    assert out["halt"] is None and not out["reports"] and ew.counters["rewinds"] == 0
    assert ew.counters["skipped_steps"] == 1 and ew.step == 60
    (row,) = out["rows"]
    assert row["step"] == at and "bad batch" in row["reason"] and len(row["fingerprint"]) == 16
    q = next(e for e in ew.events if e.kind is Kind.QUARANTINE)
    assert "skipped before anything was written, nothing rewound" in q.message
    assert not [e for e in ew.events if e.kind in (Kind.REWIND, Kind.HALT)]
    assert scan_state(out["model"], out["opt"]).clean


def test_a_bad_batch_with_a_loader_is_named_and_the_skip_leaves_the_state_bit_identical(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ W
    x[77, 2] = float("nan")  # one corrupt record
    loader = ResumableLoader(TensorDataset(x, y), 16, seed=1)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, loader=loader, sinks=[],
                         recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    bad_steps, identical = [], []
    for _epoch in range(2):
        for xb, yb in loader:
            before = [p.detach().clone() for p in model.parameters()] + [
                v.clone() for st in opt.state.values() for v in st.values()]
            loss = nn.functional.mse_loss(model(xb), yb)
            ew.report_loss(loss)
            opt.zero_grad()
            loss.backward()
            step = ew.step
            opt.step()
            if not math.isfinite(loss.item()):
                bad_steps.append(step)
                after = [p.detach() for p in model.parameters()] + [v for st in opt.state.values() for v in st.values()]
                identical.append(all(torch.equal(a, b) for a, b in zip(before, after)))
    assert len(bad_steps) == 2 and all(identical)  # sample 77 in each epoch, skipped before anything was written
    assert ew.counters["skipped_steps"] == 2 and ew.counters["rewinds"] == 0
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == bad_steps and all(77 in r["sample_indices"] for r in rows)
    assert all(None not in r.values() for r in rows)
    ew.close()


@pytest.mark.parametrize("resync", [True, False])
def test_a_loop_lr_ramp_is_rewound_and_trains_on_at_the_highest_lr_it_took(tmp_path, resync):
    out = nanogpt_loop(tmp_path, steps=200, lr_ramp_from=40, resync=resync, opt_name="sgd")
    ew = out["ew"]
    # the loss diverged with the learning rate rising into it: a rewind, and the learning rate held
    # at the restored state's while the loop's ramp stays above it -- the run trains on, no halt
    assert out["halt"] is None and ew.step >= 150  # (without resync the loop's own count ends it earlier)
    first = out["reports"][0]
    assert first.lost_steps <= 50 and out["replayed"] == 0
    held = [e for e in ew.events if e.kind is Kind.LR_HOLD]
    assert held and "a rise" in held[0].message and held[0].values["lr_ceiling"] > 0
    lr_at_target = 2e-2 * 1.08 ** (first.restored_step - 40)
    assert held[0].values["lr_ceiling"] == pytest.approx(lr_at_target, rel=1e-6)
    diverged = [e for e in ew.events if e.kind is Kind.LOSS_DIVERGED]
    assert diverged and all(e.level is Level.WARNING for e in diverged)  # the rewind is the critical event


def test_a_ramp_the_rewind_set_back_stays_held_by_the_ceiling_to_the_end(tmp_path):
    # the loop counts its schedule from ew.step: the rewind sets its LR back under the ceiling for a
    # few steps, then the ramp passes it again. The ceiling must not lift on those few steps (it
    # did: the ramp then diverged a second time, and a third); it holds to the end, one rewind in all
    out = nanogpt_loop(tmp_path, steps=200, lr_ramp_from=40, opt_name="sgd", on_recurrence="lower_lr")
    ew = out["ew"]
    assert out["halt"] is None and ew.step == 200 and len(out["reports"]) == 1
    lifted = [e for e in ew.events if e.kind is Kind.LR_RELEASE and e.signal == "lr_ceiling"]
    assert not lifted and ew.recovery.lr_ceiling.ceiling is not None


def test_an_lr_jump_that_stays_is_warmed_back_up_to_the_highest_rate_the_run_can_take(tmp_path):
    # the loop's LR jumps 60x at step 62 and stays there: too high for this run. The jump's rewind
    # holds it at the 0.02 it had survived, warming the ceiling back up on calm steps (a jump the
    # schedule meant trains on at its own rate); where the run turns unstable again, the rewind is
    # "a rise" and the ceiling stays flat at the rate the restored step took -- not the loop's
    # 1.2, which the recurrence history used to record (it records what each step took now)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    _train_until(ew, model, opt, 220, lambda it: 2e-2 * (60.0 if it >= 62 else 1.0))
    held = [e for e in ew.events if e.kind is Kind.LR_HOLD]
    assert [("a jump" in e.message, "a rise" in e.message) for e in held] == [(True, False), (False, True)]
    assert held[0].values["lr_ceiling"] == pytest.approx(2e-2) and "doubling every 10 calm steps" in held[0].message
    flat = held[1].values["lr_ceiling"]
    assert 2e-2 < flat < 1.2 / 4  # warmed above what it had survived, well below the loop's
    ceiling = ew.recovery.lr_ceiling
    assert ceiling.ceiling == flat and not ceiling.warming  # flat to the end
    assert ew.counters["rewinds"] == 2 and ew.step == 220
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ew.close()


def _train_until(ew, model, opt, until, lr_at=None, after_step=None, before_step=None) -> None:
    """The MLP regression loop until ``ew.step`` reaches ``until``: the learning rate set by the
    loop from ``ew.step`` (``lr_at``; None: left as it is); ``before_step`` runs before each
    step's forward, ``after_step`` after each ``opt.step()``."""
    while ew.step < until:
        if before_step is not None:
            before_step()
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(ew.step)
        x = torch.randn(32, 8)
        loss = nn.functional.mse_loss(model(x), x @ W)
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()


def test_a_rewind_the_cooldown_suppresses_is_reported(tmp_path):
    from earlywarn.policy import PolicyConfig

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)
    ew = earlywarn.watch(model, opt, sinks=[], policy=PolicyConfig(rewind_cooldown=500),
                         recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl"), on_recurrence="lower_lr"))
    poisoned = []

    def poison_after_the_first_rewind() -> None:
        if ew.counters["rewinds"] == 1 and not poisoned:
            poisoned.append(ew.step)  # a second incident soon after the first rewind: NaN weights
            model.hidden.weight.detach().fill_(float("nan"))

    try:
        _train_until(ew, model, opt, 200, lambda it: 2e-2 * 1.08 ** max(0, it - 40), poison_after_the_first_rewind)
    except Halt:
        pass
    assert poisoned
    notes = [e for e in ew.events if e.kind is Kind.NO_REWIND]
    assert notes and "cooldown" in notes[0].message and "PolicyConfig.rewind_cooldown" in notes[0].message
    assert ew.counters["rewinds"] == 1  # the second trigger got a note (or the halt), not a rewind
    ew.close()


def test_info_spikes_do_not_make_snapshots_unclean_nor_faster_once_over(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    taken = set()
    while ew.step < 190:
        it = ew.step
        x = torch.randn(32, 8)
        loss = nn.functional.mse_loss(model(x), x @ W + 0.1 * torch.randn(32, 1))
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        if it == 110:
            for p in model.parameters():
                p.grad.mul_(6)  # one spike that recovers: an info alert (below an outlier's 10x)
        opt.step()
        taken |= {(s.step, s.clean) for s in ew.recovery.ring.entries}
    assert [e.kind for e in ew.events if e.level >= Level.INFO and e.kind is not Kind.CHECKPOINT] == [Kind.GRAD_SPIKE]
    assert all(clean for _, clean in taken)
    steps = sorted(s for s, _ in taken)
    # the spike's own step is elevated -- the run's gradient norm -- (a copy then); once it is
    # reported as over, the cadence is periodic again
    assert steps == [0, 25, 50, 75, 100, 110, 135, 160, 185]
    ew.close()


def test_loop_state_round_trips_and_loads_with_weights_only(tmp_path):
    loop = earlywarn.LoopState(iter_num=7, best=1.5, name="x", hist=[1, 2])
    loop.iter_num += 1
    path = tmp_path / "s.pt"
    torch.save(loop.state_dict(), path)
    other = earlywarn.LoopState()
    other.load_state_dict(torch.load(path, weights_only=True))
    assert other.as_dict() == {"iter_num": 8, "best": 1.5, "name": "x", "hist": [1, 2]}
    with pytest.raises(AttributeError, match="LoopState has no value 'missing'"):
        other.missing


def test_async_mode_rewinds_one_step_late_and_drops_the_step_in_flight(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ew = earlywarn.watch(model, opt, mode="async", sinks=[],
                         recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    reports, seen = [], []
    ew.on_rewind(reports.append)
    poisoned = []

    def poison_after_step_41() -> None:
        if ew.step == 42 and not poisoned:  # after the update of step 41
            poisoned.append(True)
            model.hidden.weight.detach().fill_(float("nan"))

    _train_until(ew, model, opt, 70, after_step=poison_after_step_41, before_step=lambda: seen.append(ew.step))
    ew.flush()
    (r,) = reports
    # NaN weights after step 41, NaN loss at 42, read one step late (inside step 43)
    assert (r.incident_step, r.restored_step) == (42, 25)
    assert seen.count(26) == 2 and seen.count(43) == 2  # trained again from 26; step 43's vector was dropped
    assert [e.step for e in ew.events if e.kind is Kind.REWIND] == [42]
    assert scan_state(model, opt).clean and ew.counters["rewinds"] == 1
    ew.close()


def test_report_batch_replaces_the_input_hook_and_detach_removes_it(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    assert ew._input_hook is not None  # no loader names the batches: the inputs are hashed
    fps = ew.recovery.fingerprints

    def step(x, report=None):
        loss = nn.functional.mse_loss(model(x), x @ W)
        if report is not None:
            ew.report_batch(report)
        opt.zero_grad()
        loss.backward()
        opt.step()

    x0, x1 = torch.randn(16, 8), torch.randn(16, 8)
    step(x0)
    with torch.no_grad():
        model(x1)  # an eval forward is not the step's batch
    step(x0)
    got = fps.read([0, 1])
    assert got[0] == got[1]
    step(x1, report={"ids": torch.arange(16)})  # the first report_batch: only what it is given counts
    assert ew._input_hook is None
    ref = BatchFingerprints()
    ref.observe({"ids": torch.arange(16)})
    ref.bind(0)
    assert fps.read([2])[2] == ref.read([0])[0]
    ew.detach()
    again = earlywarn.watch(model, opt, sinks=[])
    assert len(model._forward_pre_hooks) == 1
    again.detach()
    assert not model._forward_pre_hooks
    with_loader = earlywarn.watch(model, opt, sinks=[], loader=ResumableLoader(TensorDataset(x0), 4))
    assert with_loader._input_hook is None  # positions name the batches
    with_loader.close()


def test_an_lr_jump_the_run_does_not_take_is_rewound_to_the_copy_taken_before_its_update(tmp_path):
    # the jump's own warning opens the episode; its update, not the state before it, is what went
    # wrong: the rewind goes to the copy of the step before the jump (2 steps lost), not to the
    # periodic snapshot before that (12 steps further back)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    reports = []
    ew.on_rewind(reports.append)
    _train_until(ew, model, opt, 120, lambda it: 2e-2 * (60.0 if 62 <= it < 80 else 1.0))  # a pulse from step 62 on
    assert reports, "the pulse was taken"
    first = reports[0]
    assert first.restored_step == 61 and first.lost_steps <= 5
    held = [e for e in ew.events if e.kind is Kind.LR_HOLD and "a jump" in e.message]
    assert held and held[0].values["lr_ceiling"] == pytest.approx(2e-2)  # stepped at the LR it had survived
    ew.close()


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.main = nn.Linear(32, 1)
        self.aux = nn.Linear(32, 1)


def _rare_task_loop(*, set_to_none=True, shared_head=False, steps=200):
    """A multi-task loop whose auxiliary task is drawn every 15th step from step 60: its loss is
    ~100x the main one, so each of its steps has an outlier gradient, and (unless ``shared_head``)
    its own head gets a gradient only then. -> (the watcher, the steps at which the aux head's
    weights moved, the aux steps)."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ew = earlywarn.watch(model, opt, sinks=[])
    g = torch.Generator().manual_seed(1)
    aux_steps, moved = list(range(60, steps, 15)), []
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        h = model.trunk(x)
        loss = nn.functional.mse_loss(model.main(h), x @ W)
        if step in aux_steps:
            head = model.main if shared_head else model.aux
            loss = loss + nn.functional.mse_loss(head(h), 40.0 * torch.sin(x @ W))
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        ew.report_loss(loss)
        before = model.aux.weight.detach().clone()
        opt.step()
        if not torch.equal(before, model.aux.weight):
            moved.append(step)
    ew.close()
    return ew, moved, aux_steps


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_rarely_drawn_task_with_its_own_head_is_trained_on(set_to_none, tmp_path, monkeypatch):
    """Its steps are outliers at which its head, idle since its last one, has a gradient again:
    the run's own kind of step, applied (its head moves at each), never skipped or rewound. A
    head left at 0 (``zero_grad(set_to_none=False)``) is idle the same way."""
    monkeypatch.setenv("EARLYWARN_OUTPUT_DIR", str(tmp_path))  # where a quarantine file would go
    ew, moved, aux_steps = _rare_task_loop(set_to_none=set_to_none)
    outliers = [e for e in ew.events if e.kind == Kind.GRAD_OUTLIER]
    assert len(outliers) >= 4 and {e.step for e in outliers} <= set(aux_steps), [e.step for e in outliers]
    assert all(e.values["joined"] == 1.0 and "trains only on some steps" in e.message for e in outliers)
    assert ew.counters["skipped_steps"] == 0 and ew.counters["rewinds"] == 0
    assert not any(e.level >= Level.CRITICAL for e in ew.events)
    if set_to_none:  # (left at 0, AdamW's momentum and decay move it every step)
        assert {e.step for e in outliers} <= set(moved)
    # the same task through the shared head: no part of the model tells its steps from corrupt
    # batches of the usual kind; each is taken at its typical norm (bounded, never skipped)
    ew, _, aux_steps = _rare_task_loop(shared_head=True)
    outliers = [e.step for e in ew.events if e.kind == Kind.GRAD_OUTLIER]
    clipped = [e for e in ew.events if e.kind == Kind.CLIP]
    assert outliers and [e.step for e in clipped] == outliers and ew.counters["skipped_steps"] == 0
    assert all(e.values["clip_factor"] * e.values["ratio"] == pytest.approx(1.0) for e in clipped)


def _ramped_loop(watched: bool, tmp_path, weight_at, scale_at=lambda it: 1.0, steps: int = 300):
    """Adam on the MLP regression, its loss weighted by ``weight_at(it)`` (a KL-annealing-like
    ramp) and its targets scaled by ``scale_at(it)`` (a burst of corrupt batches); -> (eval loss,
    watcher or None)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(
        quarantine_path=str(tmp_path / "q.jsonl"))) if watched else None
    g = torch.Generator().manual_seed(1)
    for it in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = weight_at(it) * nn.functional.mse_loss(model(x), scale_at(it) * (x @ W))
        if ew is not None:
            ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    xe = torch.randn(512, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(xe), xe @ W)), ew


def test_a_loss_weight_ramped_up_trains_as_without_earlywarn_and_a_burst_is_bounded(tmp_path):
    # the loss's weight ramps 30x over 5 steps from step 120 (geometric), then stays: the gradient
    # climbs to a plateau just under the outliers, and its noise takes it over. Those outliers used
    # to be skipped 40 steps and clipped (eval 0.095 where bare reaches 0.075); they train as the
    # bare loop does. (Gentler ramps never leave this MLP's gradient baseline behind.)
    ramp = lambda it: 30.0 ** min(1.0, max(0.0, (it - 120) / 5))
    bare, _ = _ramped_loop(False, tmp_path, ramp)
    watched, ew = _ramped_loop(True, tmp_path, ramp)
    assert ew.counters["skipped_steps"] == 0 and ew.counters["rewinds"] == 0
    assert not [e for e in ew.events if e.level is Level.CRITICAL]
    assert watched <= bare * 1.02
    # the same loop with a burst of 12 corrupt batches (targets x100) jumping from ordinary steps:
    # each taken bounded (the first at its typical norm, the rest at 3x), none skipped; Adam's
    # moments stay at the run's scale and it ends near its twin (bare: 78x it)
    burst = lambda it: 100.0 if 150 <= it < 162 else 1.0
    twin, _ = _ramped_loop(False, tmp_path, lambda it: 1.0)
    bare, _ = _ramped_loop(False, tmp_path, lambda it: 1.0, burst)
    watched, ew = _ramped_loop(True, tmp_path, lambda it: 1.0, burst)
    clipped = [e for e in ew.events if e.kind is Kind.CLIP]
    assert [e.step for e in clipped] == list(range(150, 162)) and ew.counters["skipped_steps"] == 0
    assert [round(e.values["clip_factor"] * e.values["ratio"], 6) for e in clipped] == [1.0] + [3.0] * 11
    assert ew.counters["rewinds"] == 0 and bare > 50 * twin and watched <= 1.2 * twin, (bare, watched, twin)
    ew.close()


def test_a_long_burst_is_rewound_at_its_end_and_a_loss_weight_phase_keeps_bare_s_progress(tmp_path):
    # 70 corrupt batches (targets x100): bounded for the detector's readapt_steps (30), then its
    # new normal, taken whole as bare takes it (bare ends 0.11 -> 81); clean batches back, the loss
    # still far above its level before the burst 30 steps later: rewound to before it, its batches
    # quarantined, and the run ends near its twin (bounded all through, it ended 1.65x the twin's)
    burst = lambda it: 100.0 if 150 <= it < 220 else 1.0
    twin, _ = _ramped_loop(False, tmp_path, lambda it: 1.0, steps=400)
    bare, _ = _ramped_loop(False, tmp_path, lambda it: 1.0, burst, steps=400)
    watched, ew = _ramped_loop(True, tmp_path, lambda it: 1.0, burst, steps=400)
    assert ew.counters["skipped_steps"] == 0 and ew.counters["rewinds"] == 1
    (rewind,) = [e for e in ew.events if e.kind is Kind.REWIND]
    assert rewind.step == 220 + 30 and "a run of 70 steps" in rewind.message and "its level before the run" in rewind.message
    assert rewind.values["lost_steps"] > 250 - 150  # to a copy from before the burst: none of its steps was clean
    assert bare > 100 * twin and watched <= 1.6 * twin, (bare, watched, twin)
    ew.close()
    # a loss weight raised 50x for a 70-step phase (an auxiliary objective's): the same shape of
    # run, never skipped, never rewound, no critical. Taken whole from its 31st step it ends 1.12x
    # bare's final loss (bounded all through it ended 0.99x; a phase is told from a lasting regime
    # only when it ends): 0.998 of bare's progress from the loss at the start, the rescue
    # benchmark's harm line is 0.98 (``benchmarks/rescue.py``'s phase family: none under it)
    phase = lambda it: 50.0 if 150 <= it < 220 else 1.0
    e0, _ = _ramped_loop(False, tmp_path, phase, steps=0)
    bare, _ = _ramped_loop(False, tmp_path, phase, steps=400)
    watched, ew = _ramped_loop(True, tmp_path, phase, steps=400)
    assert ew.counters["rewinds"] == 0 and ew.counters["skipped_steps"] == 0
    assert not [e for e in ew.events if e.level is Level.CRITICAL]
    assert (e0 - watched) / (e0 - bare) >= 0.99 and watched <= 1.15 * bare, (e0, watched, bare)
    ew.close()


def _creeping_loop(watched: bool, tmp_path, creep_from=None, rate=1.03, steps=400, lr=3e-3):
    """Adam on the MLP regression, the loop's LR multiplied by ``rate`` every step from ``creep_from``
    on (a schedule bug); -> (eval loss, watcher or None)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(
        quarantine_path=str(tmp_path / "q.jsonl"))) if watched else None
    g = torch.Generator().manual_seed(1)
    for it in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (rate ** (it - creep_from) if creep_from is not None and it >= creep_from else 1.0)
        x = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ W)
        if ew is not None:
            ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    xe = torch.randn(512, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(xe), xe @ W)), ew


def test_a_learning_rate_that_keeps_climbing_is_held_at_the_rate_the_run_trained_at_before(tmp_path):
    # x1.03 a step from step 150: bare ends ~1000x worse than its twin. The climb helps at first
    # (warnings on the way hold nothing); a factor left in the loop 16x past the highest rate the
    # run took (lrtrend.CREEP_FAR) is held at 3e-3, the rate before the climb, before the loss got
    # worse than before it began: nothing to rewind
    twin, _ = _creeping_loop(False, tmp_path)
    bare, _ = _creeping_loop(False, tmp_path, creep_from=150)
    watched, ew = _creeping_loop(True, tmp_path, creep_from=150)
    held = [e for e in ew.events if e.kind is Kind.LR_HOLD]
    assert len(held) == 1 and held[0].values["lr_ceiling"] == pytest.approx(3e-3), [e.message for e in held]
    assert "crept up" in held[0].message and "no schedule rises so" in held[0].message
    assert 150 + 93 <= held[0].step <= 150 + 95  # 1.03 ** 94 = 16.1
    assert not [e for e in ew.events if e.kind is Kind.REWIND]
    assert ew.counters["skipped_steps"] == 0
    # the same climb from a rate 3x higher: the loss is worse than before the climb at ~4x, long
    # before 16x -- held at the rate before the climb, and rewound past the worse steps
    twin_hi, _ = _creeping_loop(False, tmp_path, lr=1e-2)
    bare_hi, _ = _creeping_loop(False, tmp_path, creep_from=150, lr=1e-2)
    watched_hi, ew_hi = _creeping_loop(True, tmp_path, creep_from=150, lr=1e-2)
    held_hi = [e for e in ew_hi.events if e.kind is Kind.LR_HOLD]
    rewinds = [e for e in ew_hi.events if e.kind is Kind.REWIND]
    assert len(held_hi) == 1 and held_hi[0].values["lr_ceiling"] == pytest.approx(1e-2)
    assert "loss got worse" in held_hi[0].message and held_hi[0].step < 150 + 94
    assert len(rewinds) == 1 and rewinds[0].step == held_hi[0].step and "crept up" in rewinds[0].message
    assert bare_hi > 1000 * twin_hi and watched_hi <= 2.0 * twin_hi, (bare_hi, watched_hi, twin_hi)
    ew_hi.close()
    assert bare > 100 * twin and watched <= 1.1 * twin, (bare, watched, twin)
    ew.close()
