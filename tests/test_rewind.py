"""Rewind-and-skip with real training: a bad sample makes the run diverge, recovery rewinds to the
last clean snapshot, skips and quarantines the batches, and the run completes. Sample-id
accounting proves every batch was trained exactly once except exactly the quarantined ones."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from earlywarn.events import Kind
from earlywarn.recover import Halt, Recovery, RecoveryConfig, ResumableLoader, scan_state

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*")

N, BS, BAD = 192, 8, 77  # 24 batches per epoch; sample 77 has an absurd label


def dataset(bad: int = BAD) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    y = torch.tanh(x @ torch.randn(6, 1, generator=g))
    y[bad] = 1e5  # one corrupt record: its gradient throws SGD+momentum into divergence
    return TensorDataset(x, y, torch.arange(N))


def make_loader(kind: str, num_workers: int = 0, bad: int = BAD):
    ds = dataset(bad)
    if kind == "resumable":
        return ResumableLoader(ds, BS, seed=2, num_workers=num_workers)
    torch.manual_seed(3)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=BS, shuffle=True, num_workers=num_workers)
    return DataLoader(ds, batch_size=BS, shuffle=True)


def run(tmp_path, *, kind="resumable", skip="since_snapshot", epochs=2, lr=0.05, num_workers=0,
        snapshot_every=10, max_rewinds=3, bad=BAD, late=False, on_recurrence="lower_lr"):
    """``late``: the detector only sees a non-finite loss (the bad update is applied and the run
    diverges for a few steps first); else it catches the loss spike before the update."""
    loader = make_loader(kind, num_workers, bad)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    events = []
    cfg = RecoveryConfig(snapshot_every=snapshot_every, clean_window=5, rewind_skip_batches=skip,
                         max_rewinds_per_episode=max_rewinds, quarantine_path=str(tmp_path / "quarantine.jsonl"),
                         on_recurrence=on_recurrence)
    rec = Recovery(model, opt, cfg, loader=loader, emit=events.append)
    trained: list[tuple[int, tuple, list[int]]] = []  # (step, (epoch, batch), sample ids) still in the model
    reports, losses, step, finite_throughout = [], [], 0, True

    def epochs_left(e: int) -> bool:
        return loader.epoch < epochs if kind == "resumable" else e < epochs

    e = 0
    while epochs_left(e):
        for xb, yb, ib in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            recent = sorted(losses[-16:])
            median = recent[len(recent) // 2] if recent else math.inf
            spike = not late and loss.item() > 1000 * median
            if not math.isfinite(loss.item()) or spike:  # the test's detector
                blame = rec.blame(step, symptom="the loss spiked", symptom_step=step)
                report = rec.rewind(step, "loss_diverged", blame=blame)
                reports.append(report)
                trained = [t for t in trained if t[0] <= report.restored_step]  # those updates were undone
                losses = losses[: report.restored_step]
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref = rec.last_batch()
            trained.append((step, None if ref is None else (ref.epoch, ref.batch_index), ib.tolist()))
            losses.append(loss.item())
            finite_throughout &= scan_state(model, opt).clean
            rec.after_step(step, clean=True)
        e += 1
    return dict(rec=rec, model=model, opt=opt, trained=trained, reports=reports, losses=losses,
                events=events, loader=loader, finite=finite_throughout)


def check_accounting(out, epochs: int):
    """Trained + quarantined = every batch of every epoch exactly once, disjoint."""
    trained = out["trained"]
    quarantined = [q for r in out["reports"] for q in r.quarantined]
    t_pos = [p for _, p, _ in trained]
    q_pos = [(q.epoch, q.batch_index) for q in quarantined]
    assert len(set(t_pos)) == len(t_pos) and len(set(q_pos)) == len(q_pos)
    assert not set(t_pos) & set(q_pos)
    assert set(t_pos) | set(q_pos) == {(e, b) for e in range(epochs) for b in range(N // BS)}
    trained_ids = Counter(i for _, _, ids in trained for i in ids)
    return trained_ids, quarantined


def test_divergence_rewind_skip_and_exact_sample_accounting(tmp_path):
    out = run(tmp_path)
    reports, rec = out["reports"], out["rec"]
    assert len(reports) == 2  # the bad sample comes back in epoch 1
    trained_ids, quarantined = check_accounting(out, epochs=2)
    q_ids = Counter(i for q in quarantined for i in q.sample_indices)
    assert trained_ids + q_ids == Counter({i: 2 for i in range(N)})  # sample ids: exactly once each
    assert trained_ids[BAD] == 0 and q_ids[BAD] == 2  # the bad record never trained
    for r in reports:
        assert r.restored_step < r.incident_step and r.source.startswith("memory:")
        bad_batch = [q for q in r.quarantined if BAD in q.sample_indices]
        assert len(bad_batch) == 1 and bad_batch[0].step == r.incident_step
        assert f"at step {r.incident_step}" in r.blame["message"] and str(BAD) in r.blame["message"]
    # the run completed and is healthy
    assert out["finite"] and out["losses"][-1] < 1.0
    assert out["loader"].epoch == 2
    # quarantine: a JSONL file with exactly these batches, and the events
    lines = [json.loads(line) for line in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [(d["epoch"], d["batch_index"], d["sample_indices"]) for d in lines] == \
        [(q.epoch, q.batch_index, list(q.sample_indices)) for q in quarantined]
    kinds = [e.kind for e in out["events"]]
    assert kinds.count(Kind.REWIND) == 2 and kinds.count(Kind.QUARANTINE) == 2
    assert rec.rewinds == 2 and len(rec.quarantine) == len(quarantined)


def test_fixed_skip_count_larger_than_since_skips_ahead(tmp_path):
    out = run(tmp_path, skip=14)  # PaLM style: skip past the incident
    assert len(out["reports"]) == 2
    for r in out["reports"]:
        assert len(r.quarantined) == 14
        assert any(BAD in q.sample_indices for q in r.quarantined)
    epochs = out["loader"].epoch
    trained_ids, quarantined = check_accounting(out, epochs=epochs)
    q_ids = Counter(i for q in quarantined for i in q.sample_indices)
    assert trained_ids + q_ids == Counter({i: epochs for i in range(N)})
    assert out["finite"]


def test_fixed_skip_count_smaller_than_since_replays_the_rest(tmp_path):
    # the bad record is the first batch after the step-11 snapshot; the loss only turns
    # non-finite a few steps later, so more than 3 batches were drawn since the snapshot
    bad = ResumableLoader(dataset(), BS, seed=2).sample_indices(0, 11)[0]
    out = run(tmp_path, skip=3, epochs=1, bad=bad, late=True)
    (r,) = out["reports"]
    assert r.restored_step == 11
    since = r.incident_step - r.restored_step
    assert since > 3 and [q.batch_index for q in r.quarantined] == [11, 12, 13]
    replayed = [p[1] for s, p, _ in out["trained"] if s > r.incident_step and p[1] < 11 + since]
    assert replayed == list(range(14, 11 + since))  # trained again, from the restored state
    trained_ids, quarantined = check_accounting(out, epochs=1)
    q_ids = Counter(i for q in quarantined for i in q.sample_indices)
    assert trained_ids + q_ids == Counter({i: 1 for i in range(N)}) and q_ids[bad] == 1
    assert out["finite"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_rewind_with_stateful_dataloader(tmp_path, num_workers):
    out = run(tmp_path, kind="stateful", num_workers=num_workers)
    assert len(out["reports"]) == 2
    trained_ids, quarantined = check_accounting(out, epochs=2)
    assert trained_ids[BAD] == 0 and all(q.sample_indices is None for q in quarantined)
    assert sum(trained_ids.values()) + BS * len(quarantined) == 2 * N
    assert out["finite"]


def test_plain_dataloader_rewind_skips_unidentified_batches(tmp_path):
    out = run(tmp_path, kind="plain")
    assert len(out["reports"]) == 2 and out["finite"]
    trained_ids = Counter(i for _, _, ids in out["trained"] for i in ids)
    assert trained_ids[BAD] == 0
    for r in out["reports"]:
        assert [q.step for q in r.quarantined] == list(range(r.restored_step + 1, r.incident_step + 1))
        assert all(q.batch_index is None for q in r.quarantined)
    assert sum(trained_ids.values()) + BS * sum(len(r.quarantined) for r in out["reports"]) == 2 * N


def test_an_instability_that_comes_back_after_a_rewind_halts_with_a_diagnosis(tmp_path):
    # lr=4 diverges again right after every rewind, on new batches: not a bad batch
    with pytest.raises(Halt) as err:
        run(tmp_path, lr=4.0, snapshot_every=1, on_recurrence="halt")
    msg = str(err.value)
    assert err.value.reason == "recurrence"
    assert msg.startswith("recurrence: loss_diverged at step")
    assert "on new batches (none of the" in msg and "not a bad batch" in msg
    assert "learning rate (largest over param groups): 4 at step 2 (restored)" in msg and "flat: not the schedule" in msg
    assert "on_recurrence='lower_lr'" in msg
    # by default a recurrence is answered (a lower learning rate) until the episode's rewinds are spent
    with pytest.raises(Halt) as err:
        run(tmp_path, lr=4.0, snapshot_every=1)
    assert err.value.reason == "rewinds_exhausted" and "did not hold" in str(err.value)


def _trained_recovery(tmp_path, **cfg):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recovery(model, opt, RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl"), **cfg))
    weights = {}

    def train(steps):
        for step in steps:
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
            rec.after_step(step, clean=True)
            weights[step] = model.weight.detach().clone()

    return model, opt, rec, weights, train


def test_the_target_is_the_newest_clean_snapshot_before_the_onset(tmp_path):
    model, opt, rec, weights, train = _trained_recovery(tmp_path, snapshot_every=5, snapshot_keep=4)
    train(range(0, 22))
    assert [s.step for s in rec.ring.entries] == [5, 10, 15, 20]
    # the incident began at step 16: the state after 15 gave step 16 its gradient, so it is suspect
    report = rec.rewind(21, "loss_diverged", onset=16)
    assert report.restored_step == 10 and report.lost_steps == 11 and report.resume_step == 11
    assert torch.equal(model.weight, weights[10])
    assert "10 steps lost" not in report.message and "11 steps lost" in report.message


def test_a_recurrence_never_rewinds_further_back_than_the_first_rewind(tmp_path):
    model, opt, rec, weights, train = _trained_recovery(tmp_path, snapshot_every=5, snapshot_keep=3,
                                                        on_recurrence="lower_lr", max_rewinds_per_episode=3)
    train(range(1, 13))
    assert [s.step for s in rec.ring.entries] == [1, 6, 11]
    first = rec.rewind(13, "loss_diverged")
    assert (first.restored_step, first.attempt, first.recurrence, first.lr_factor) == (11, 1, None, 1.0)
    # back before it held: a recurrence; it began right after step 11, yet step 6 is never taken
    second = rec.rewind(12, "loss_diverged", onset=12)
    assert (second.restored_step, second.attempt, second.lr_factor) == (11, 2, 0.5)
    assert second.recurrence.startswith("recurrence: loss_diverged at step 12")
    assert "restoring step 11 again (a rewind never goes further back than the episode's first" in second.message
    assert torch.equal(model.weight, weights[11]) and rec.lr_factor == 0.5
    # the lowered learning rate is applied around each step and the loop's value comes back after it
    seen = []
    step = rec.wrap_step(lambda: seen.append(opt.param_groups[0]["lr"]))
    step()
    assert seen == [0.05] and opt.param_groups[0]["lr"] == 0.1
    third = rec.rewind(12, "loss_diverged")
    assert (third.restored_step, third.attempt, third.lr_factor) == (11, 3, 0.25)
    with pytest.raises(Halt, match=r"recurrence: .* 3 rewinds in this episode \(max_rewinds_per_episode=3\)") as err:
        rec.rewind(12, "loss_diverged")
    assert err.value.reason == "rewinds_exhausted"


def test_the_old_name_max_rewinds_still_works_and_names_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"RecoveryConfig\(max_rewinds=\.\.\.\) is deprecated: "
                                                r"use max_rewinds_per_episode"):
        cfg = RecoveryConfig(max_rewinds=2)
    assert cfg.max_rewinds_per_episode == 2
    with pytest.warns(DeprecationWarning, match=r"RecoveryConfig.max_rewinds is deprecated: use max_rewinds_per_episode"):
        assert cfg.max_rewinds == 2
    with pytest.raises(ValueError, match=r"max_rewinds_per_episode=-1: must be an int >= 0"):
        RecoveryConfig(max_rewinds_per_episode=-1)


def test_a_rewind_that_held_ends_the_episode_and_the_lowered_lr_ends_after_its_steps(tmp_path):
    model, opt, rec, weights, train = _trained_recovery(tmp_path, snapshot_every=5, clean_window=3,
                                                        on_recurrence="lower_lr", recurrence_lr_steps=4)
    train(range(1, 13))
    rec.rewind(13, "loss_diverged")
    rec.rewind(12, "loss_diverged")
    assert rec.lr_factor == 0.5
    train(range(12, 15))
    assert rec.lr_factor == 0.5
    train(range(15, 20))  # 4 steps at the lower rate, then the loop's own again
    assert rec.lr_factor == 1.0
    # trained clean_window steps past the incident: the next incident is a new episode
    report = rec.rewind(21, "loss_diverged")
    assert report.recurrence is None and report.attempt == 1


def test_quarantine_without_a_loader_names_steps_and_fingerprints_never_nulls(tmp_path):
    model, opt, rec, weights, train = _trained_recovery(tmp_path, snapshot_every=5)
    for step in range(1, 9):
        rec.fingerprints.observe(torch.full((2, 3), float(step)))  # what report_batch / the input hook do
        rec.fingerprints.bind(step)
        train([step])
    report = rec.rewind(9, "loss_diverged")
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [7, 8, 9] and report.restored_step == 6
    assert all(None not in r.values() for r in rows)
    assert all(len(r["fingerprint"]) == 16 for r in rows[:2]) and "fingerprint" not in rows[2]  # step 9: none seen
    assert len({r["fingerprint"] for r in rows[:2]}) == 2
    assert "3 batches, drawn for steps 7-9 (fingerprints in the quarantine file)" in report.message


def test_blame_without_a_loader_reads_as_a_sentence():
    from earlywarn.recover import BatchRef, Blame

    assert Blame(step=151, symptom="the loss diverged", symptom_step=152).message == (
        "the loss diverged at step 152; the batch responsible was the batch drawn for step 151")
    assert Blame(step=12, symptom="the loss turned NaN", symptom_step=12,
                 batch=BatchRef(None, None, None, "0f3a")).message == (
        "the loss turned NaN at step 12; the batch responsible: the batch drawn for step 12 (fingerprint 0f3a)")
    assert Blame(step=140, symptom="the loss diverged", symptom_step=152, role="the episode began with").message == (
        "the loss diverged at step 152; the episode began with the batch drawn for step 140")
    with_loader = Blame(step=11, batch=BatchRef(0, 10, (3, 4)), symptom="the loss turned NaN", symptom_step=12,
                        symptom_batch=BatchRef(0, 11, (5, 6)))
    assert with_loader.message == ("the loss turned NaN at step 12 on batch 11 of epoch 0 (samples 5, 6); "
                                   "the batch responsible was batch 10 of epoch 0 (samples 3, 4) at step 11")


# ---------------------------------------------------------------------------------------------
# End to end through earlywarn.watch: the detector and policy decide, recovery acts.


def test_watch_bounds_a_corrupt_batch_and_accounts_for_every_batch(tmp_path):
    import earlywarn

    loader = make_loader("resumable")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ew = earlywarn.watch(model, opt, loader=loader, sinks=[],
                         recovery=RecoveryConfig(snapshot_every=10, quarantine_path=str(tmp_path / "q.jsonl")))
    trained, skipped = [], []  # (watcher step, (epoch, batch)) of updates that stand / were skipped
    while loader.epoch < 2:
        for xb, yb, ib in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            ew.report_loss(loss)
            step, pos = ew.step, (loader.last_batch.epoch, loader.last_batch.batch_index)
            rewinds, skips = ew.counters["rewinds"], ew.counters["skipped_steps"]
            opt.step()
            if ew.counters["rewinds"] > rewinds:
                restored = int([e for e in ew.events if e.kind == Kind.REWIND][-1].values["restored_step"])
                trained = [t for t in trained if t[0] <= restored]
                skipped = [t for t in skipped if t[0] <= restored]
            elif ew.counters["skipped_steps"] > skips:
                skipped.append((step, pos))
            else:
                trained.append((step, pos))
    # epoch 0 meets the corrupt record in its first steps, before the gradient has a baseline:
    # its update is applied, the run blows up and is rewound; epoch 1 meets it with a baseline:
    # an outlier gradient, taken at its typical norm (one ordinary step), nothing rewound
    rewinds = [e for e in ew.events if e.kind == Kind.REWIND]
    assert len(rewinds) == 1 and rewinds[0].step < N // BS
    outliers = [e for e in ew.events if e.kind == Kind.GRAD_OUTLIER]
    assert len(outliers) == 1 and outliers[0].step >= N // BS and outliers[0].values["ratio"] > 1e3
    quarantined = ew.recovery.quarantine
    t_pos = [p for _, p in trained]
    q_pos = [(q.epoch, q.batch_index) for q in quarantined]
    s_pos = [p for _, p in skipped]
    assert set(s_pos) <= set(q_pos)  # every skipped batch is quarantined (the rewind quarantined more)
    everything = t_pos + q_pos
    assert len(everything) == len(set(everything))  # nothing trained twice, nothing counted twice
    assert set(everything) == {(e, b) for e in range(2) for b in range(N // BS)}
    bad_positions = {(e, b) for e in range(2) for b in range(N // BS) if BAD in loader.sample_indices(e, b)}
    assert {p for p in bad_positions if p[0] == 0} <= set(q_pos)  # the rewound-over one never trained
    clips = [e for e in ew.events if e.kind == Kind.CLIP]
    assert len(clips) == 1 and clips[0].step == outliers[0].step  # the other taken bounded, at its typical norm
    assert clips[0].values["clip_factor"] * outliers[0].values["ratio"] == pytest.approx(1.0)
    assert scan_state(model, opt).clean
    lines = (tmp_path / "q.jsonl").read_text().splitlines()
    assert len(lines) == len(quarantined)
