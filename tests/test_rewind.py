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
        snapshot_every=10, max_rewinds=3, bad=BAD, late=False):
    """``late``: the detector only sees a non-finite loss (the bad update is applied and the run
    diverges for a few steps first); else it catches the loss spike before the update."""
    loader = make_loader(kind, num_workers, bad)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    events = []
    cfg = RecoveryConfig(snapshot_every=snapshot_every, clean_window=5, rewind_skip_batches=skip,
                         max_rewinds=max_rewinds, quarantine_path=str(tmp_path / "quarantine.jsonl"))
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


def test_rewinds_that_do_not_hold_go_further_back_then_halt(tmp_path):
    with pytest.raises(Halt, match=r"3 rewinds in a row.*max_rewinds=3") as err:
        run(tmp_path, lr=4.0, snapshot_every=1)  # diverges again right after every rewind
    assert err.value.reason == "rewinds_exhausted"


def test_retry_targets_older_snapshots(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=5, snapshot_keep=3, clean_window=2,
                                              quarantine_path=str(tmp_path / "q.jsonl")))
    weights = {}
    for step in range(1, 13):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        rec.after_step(step, clean=True)
        weights[step] = model.weight.detach().clone()
    assert [s.step for s in rec.ring.entries] == [1, 6, 11]
    first = rec.rewind(13, "loss_diverged")
    second = rec.rewind(14, "loss_diverged")  # no clean snapshot since: go further back
    assert (first.restored_step, first.attempt, second.restored_step, second.attempt) == (11, 1, 6, 2)
    assert torch.equal(model.weight, weights[6])
    assert [s.step for s in rec.ring.entries] == [1, 6]


# ---------------------------------------------------------------------------------------------
# End to end through earlywarn.watch: the detector and policy decide, recovery acts.


def test_watch_divergence_rewinds_and_accounts_for_every_batch(tmp_path):
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
    rewinds = [e for e in ew.events if e.kind == Kind.REWIND]
    assert len(rewinds) >= 1
    quarantined = ew.recovery.quarantine
    t_pos = [p for _, p in trained]
    q_pos = [(q.epoch, q.batch_index) for q in quarantined]
    s_pos = [p for _, p in skipped]
    everything = t_pos + q_pos + s_pos
    assert len(everything) == len(set(everything))  # nothing trained twice, nothing counted twice
    assert set(everything) == {(e, b) for e in range(2) for b in range(N // BS)}
    assert not s_pos  # every step the guard skipped lay inside a rewound window here
    bad_positions = {(e, b) for e in range(2) for b in range(N // BS) if BAD in loader.sample_indices(e, b)}
    assert bad_positions <= set(q_pos)  # the corrupt record never trained
    assert scan_state(model, opt).clean
    lines = (tmp_path / "q.jsonl").read_text().splitlines()
    assert len(lines) == len(quarantined)
