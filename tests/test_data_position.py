"""Exact data position: ResumableLoader and torchdata StatefulDataLoader resume, seek, skip."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from earlywarn.recover import (
    BatchRef,
    CheckpointManager,
    DataPosition,
    DataPositionError,
    FingerprintMismatch,
    Halt,
    Recovery,
    RecoveryConfig,
    ResumableLoader,
    data_position_adapter,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*")

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


class Counting(Dataset):
    """Sample i is the tensor [i]; counts reads (num_workers=0 only)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor([i])


def ids(batch: torch.Tensor) -> list[int]:
    return batch.reshape(-1).tolist()


def run_epochs(loader, epochs: int) -> list[list[int]]:
    return [ids(b) for _ in range(epochs) for b in loader]


# ---------------------------------------------------------------------------------------------
# ResumableLoader


def test_every_sample_once_per_epoch_and_epochs_differ():
    loader = ResumableLoader(Counting(23), 4, seed=7)
    assert len(loader) == 6
    e0, e1 = run_epochs(loader, 1), run_epochs(loader, 1)
    assert sorted(sum(e0, [])) == list(range(23)) == sorted(sum(e1, []))
    assert e0 != e1
    assert loader.position == DataPosition(2, 0)
    # the order is a function of (seed, epoch) only
    again = ResumableLoader(Counting(23), 4, seed=7)
    assert run_epochs(again, 2) == e0 + e1
    assert run_epochs(ResumableLoader(Counting(23), 4, seed=8), 1) != e0
    dl = ResumableLoader(Counting(23), 4, seed=7, drop_last=True)
    assert len(dl) == 5 and all(len(b) == 4 for b in run_epochs(dl, 1))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_wrapper_yields_the_uninterrupted_batches(tmp_path, num_workers):
    ds = Counting(50)
    full = run_epochs(ResumableLoader(ds, 6, seed=3, num_workers=num_workers), 3)

    first = ResumableLoader(ds, 6, seed=3, num_workers=num_workers)
    seen = []
    it = iter(first)
    for _ in range(5):
        seen.append(ids(next(it)))
    # through a real checkpoint file (weights_only load)
    mgr = CheckpointManager(tmp_path)
    mgr.save({"data": first.state_dict()}, step=5)
    del it, first
    state = mgr.load(mgr.latest())["state"]["data"]

    counting = Counting(50)
    resumed = ResumableLoader(counting, 6, seed=3, num_workers=num_workers)
    counting.reads = 0
    resumed.load_state_dict(state)
    assert resumed.position == DataPosition(0, 5)
    if num_workers == 0:
        assert counting.reads == 4  # instant: only the 4 fingerprint probes, not the 30 samples before
    for _ in range(3):
        seen += [ids(b) for b in resumed]
        if len(seen) >= len(full):
            break
    assert seen == full
    if num_workers == 0:
        assert counting.reads == 4 + 50 * 3 - 5 * 6  # plus only the batches actually yielded


def test_resumable_loader_does_not_draw_from_the_global_rng():
    loader = ResumableLoader(Counting(20), 4, seed=1)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    it = iter(loader)
    next(it)
    loader.seek((0, 3))
    next(it)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seek_during_iteration_is_honoured_by_the_held_iterator(num_workers):
    loader = ResumableLoader(Counting(40), 5, seed=2, num_workers=num_workers)
    order = run_epochs(ResumableLoader(Counting(40), 5, seed=2), 2)
    it = iter(loader)
    assert ids(next(it)) == order[0]
    assert ids(next(it)) == order[1]
    loader.seek(DataPosition(0, 6))  # forward within the epoch
    assert ids(next(it)) == order[6]
    loader.seek((0, 2))  # backward: what a rewind does inside optimizer.step
    assert ids(next(it)) == order[2]
    assert loader.last_batch == BatchRef(0, 2, tuple(order[2]))
    assert loader.position == DataPosition(0, 3)
    rest = [ids(b) for b in it]
    assert rest == order[3:8]
    assert loader.position == DataPosition(1, 0)


def test_skip_names_batches_without_loading_and_can_end_the_epoch():
    ds = Counting(30)
    loader = ResumableLoader(ds, 4, seed=5)  # 8 batches
    order = run_epochs(ResumableLoader(Counting(30), 4, seed=5), 2)
    it = iter(loader)
    next(it)
    ds.reads = 0
    skipped = loader.skip(3)
    assert ds.reads == 0
    assert [s.batch_index for s in skipped] == [1, 2, 3]
    assert [list(s.sample_indices) for s in skipped] == order[1:4]
    assert ids(next(it)) == order[4]
    skipped = loader.skip(5)  # batches 5, 6, 7 and 0, 1 of epoch 1
    assert [(s.epoch, s.batch_index) for s in skipped] == [(0, 5), (0, 6), (0, 7), (1, 0), (1, 1)]
    with pytest.raises(StopIteration):  # the running epoch loop ends
        next(it)
    assert [ids(b) for b in loader] == order[10:16]


def test_fingerprint_and_geometry_mismatch_are_refused_with_the_fix():
    loader = ResumableLoader(Counting(30), 4, seed=5)
    state = loader.state_dict()

    class Shifted(Counting):
        def __getitem__(self, i):
            return torch.tensor([i + 1])

    with pytest.raises(FingerprintMismatch, match="different dataset.*fingerprint="):
        ResumableLoader(Shifted(30), 4, seed=5).load_state_dict(state)
    with pytest.raises(FingerprintMismatch):
        ResumableLoader(Counting(31), 4, seed=5).load_state_dict(state)
    with pytest.raises(DataPositionError, match="batch_size=4"):
        ResumableLoader(Counting(30), 5, seed=5).load_state_dict(state)
    # a user-supplied version string makes the decision explicit
    a = ResumableLoader(Counting(30), 4, seed=5, fingerprint="v2")
    b = ResumableLoader(Shifted(30), 4, seed=5, fingerprint="v2")
    b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="sampler"):
        ResumableLoader(Counting(30), 4, sampler=None)


# ---------------------------------------------------------------------------------------------
# torchdata StatefulDataLoader


def make_stateful(num_workers: int, n: int = 26, batch_size: int = 4) -> StatefulDataLoader:
    torch.manual_seed(11)
    return StatefulDataLoader(list(range(n)), batch_size=batch_size, shuffle=True, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_stateful_dataloader_yields_the_uninterrupted_batches(tmp_path, num_workers):
    full = run_epochs(make_stateful(num_workers), 3)  # 7 batches per epoch

    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_stateful(num_workers)
    rec = Recovery(model, opt, RecoveryConfig(checkpoint_dir=str(tmp_path), checkpoint_every=5), loader=loader)
    seen, step = [], 0
    it = iter(loader)
    for _ in range(5):  # mid-epoch
        seen.append(ids(next(it)))
        step += 1
        rec.after_step(step, clean=True)
    assert rec.checkpoints.latest().step == 5
    del it, loader, rec

    torch.manual_seed(999)  # the resumed process has other global RNG state
    loader2 = StatefulDataLoader(list(range(26)), batch_size=4, shuffle=True, num_workers=num_workers)
    rec2 = Recovery(model, opt, RecoveryConfig(checkpoint_dir=str(tmp_path)), loader=loader2)
    assert rec2.resume() == 5
    assert rec2.data.position() == DataPosition(0, 5)
    for _ in range(3):
        for b in loader2:
            seen.append(ids(b))
            rec2.data.observe()
        if len(seen) >= len(full):
            break
    assert seen == full
    assert rec2.data.position() == DataPosition(2, 7)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_skip_crosses_the_epoch_and_the_next_loop_continues_after_it(num_workers):
    full = run_epochs(make_stateful(num_workers), 2)  # 7 batches per epoch
    loader = make_stateful(num_workers)
    adapter = data_position_adapter(loader)
    got = []
    it = iter(loader)
    for _ in range(4):
        got.append(ids(next(it)))
    skipped = adapter.skip(5)  # 4, 5, 6 of epoch 0 and 0, 1 of epoch 1
    assert [(s.epoch, s.batch_index) for s in skipped] == [(0, 4), (0, 5), (0, 6), (1, 0), (1, 1)]
    assert [ids(b) for b in it] == []  # the held loop ends
    got += [ids(b) for b in loader]
    assert got == full[:4] + full[9:]


def test_plain_dataloader_is_flagged_not_restorable_with_the_fix():
    adapter = data_position_adapter(DataLoader(list(range(10)), batch_size=2))
    assert adapter is not None and not adapter.restorable
    assert "ResumableLoader" in adapter.why_not and "StatefulDataLoader" in adapter.why_not
    with pytest.raises(DataPositionError, match="ResumableLoader"):
        adapter.state_dict()
    assert data_position_adapter(None) is None

    # a rewind that has to move the data refuses and names the fix; the model is untouched
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=1, rewind_skip_batches=3),
                   loader=DataLoader(list(range(10)), batch_size=2))
    rec.after_step(1, clean=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    before = model.weight.clone()
    with pytest.raises(Halt, match="ResumableLoader"):
        rec.rewind(2, "loss_diverged")
    assert torch.equal(model.weight, before)


def test_stateful_rewind_backwards_on_a_live_iterator_is_refused():
    loader = make_stateful(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=100, rewind_skip_batches=1), loader=loader)
    it = iter(loader)
    for step in range(1, 5):
        next(it)
        rec.after_step(step, clean=True)
    next(it)
    with pytest.raises(Halt, match="cannot move backwards"):
        rec.rewind(5, "loss_diverged")  # would replay 3 of the 4 batches drawn since step 1


def test_data_parallel_shards_partition_each_epoch_and_share_positions():
    shards = [ResumableLoader(Counting(21), 2, seed=4, num_replicas=2, rank=r) for r in range(2)]
    epochs = [run_epochs(s, 1) for s in shards]
    assert len(shards[0]) == len(shards[1]) == 6  # 11 samples each (one wrapped around)
    flat = sum(epochs[0], []) + sum(epochs[1], [])
    assert sorted(set(flat)) == list(range(21)) and len(flat) == 22
    # rank 0's saved position resumes rank 1 at the same batch
    a = ResumableLoader(Counting(21), 2, seed=4, num_replicas=2, rank=0)
    next(iter(a)), a.skip(2)
    b = ResumableLoader(Counting(21), 2, seed=4, num_replicas=2, rank=1)
    b.load_state_dict(a.state_dict())
    assert ids(next(iter(b))) == epochs[1][3]
    with pytest.raises(DataPositionError, match="num_replicas"):
        ResumableLoader(Counting(21), 2, seed=4).load_state_dict(a.state_dict())


# ---------------------------------------------------------------------------------------------
# Batch fingerprints: naming batches no loader can name


def test_batch_fingerprints_tell_batches_apart_and_fold_micro_batches():
    from earlywarn.recover import BatchFingerprints

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 100, (8, 16), generator=g)
    fp = BatchFingerprints(history=3)
    for step, batch in enumerate([x, x.clone(), x + 1, x.float(), x.to(torch.bfloat16), x > 50, (x, x + 1), (x + 1, x)]):
        fp.observe(batch)
        fp.bind(step)
    got = fp.read(range(8))
    assert sorted(got) == [5, 6, 7]  # history=3: the oldest are forgotten
    fp2 = BatchFingerprints()
    for step, batch in enumerate([x, x.clone(), x + 1, x.float(), x.to(torch.bfloat16)]):
        fp2.observe(batch)
        fp2.bind(step)
    fp2.observe(x)  # two micro-batches of one step
    fp2.observe(x + 1)
    fp2.bind(5)
    fp2.observe((x + 1, x))
    fp2.bind(6)
    got = fp2.read(range(7))
    assert got[0] == got[1]  # the same data, the same fingerprint
    assert len({got[0], got[2], got[3], got[4], got[5], got[6]}) == 6  # values, dtypes, order all count
    assert fp2.read([99]) == {} and not fp2.has(99)
    big = torch.arange(5_000_000, dtype=torch.float32)
    fp2.observe(big)  # hashed on a stride: still one value, still deterministic
    fp2.bind(7)
    fp3 = BatchFingerprints()
    fp3.observe(big.clone())
    fp3.bind(0)
    assert fp2.read([7])[7] == fp3.read([0])[0]
    fp2.drop_after(5)
    assert sorted(fp2.read(range(10))) == [0, 1, 2, 3, 4, 5]


def test_quarantine_and_batch_refs_write_what_is_known_only():
    from earlywarn.recover import QuarantineRecord

    assert BatchRef(None, None, None, "ab12").to_dict() == {"fingerprint": "ab12"}
    assert str(BatchRef(None, None, None, "ab12")) == "the batch with fingerprint ab12"
    assert BatchRef(0, 3, (1, 2)).to_dict() == {"epoch": 0, "batch_index": 3, "sample_indices": [1, 2]}
    q = QuarantineRecord(9, "loss_diverged", None, None, None, 7, "ab12")
    assert q.to_dict() == {"incident_step": 9, "reason": "loss_diverged", "step": 7, "fingerprint": "ab12"}
    assert QuarantineRecord.from_dict(q.to_dict()) == q


def _fingerprints_of(batches, **kw) -> dict[int, str]:
    from earlywarn.recover import BatchFingerprints

    fp = BatchFingerprints(**kw)
    for step, batch in enumerate(batches):
        fp.observe(batch)
        fp.bind(step)
    return fp.read(range(len(batches)))


@pytest.mark.parametrize("hold", [dict(hold_steps=0), dict(hold_steps=3), dict(hold_bytes=700)])
def test_held_batches_are_hashed_to_the_values_hashed_at_once(hold):
    # hashing later (held for a few steps, or until a byte budget) gives what hashing each batch
    # as it comes gives, whatever the hold
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 100, (4, 16), generator=g) for _ in range(7)] + [torch.randn(3, 5, generator=g)]
    assert _fingerprints_of(batches, **hold) == _fingerprints_of(batches, hold_steps=0)
    assert len(set(_fingerprints_of(batches, **hold).values())) == 8


def test_a_reused_input_buffer_loses_one_fingerprint_and_then_hashes_as_batches_come():
    # A loop that copies each batch into one preallocated buffer: a held batch is gone once it is
    # overwritten. Its fingerprint is unknown (never the next batch's), and the rest are exact.
    from earlywarn.recover import BatchFingerprints

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 100, (4, 16), generator=g) for _ in range(6)]
    buffer = torch.empty(4, 16, dtype=torch.int64)
    fp = BatchFingerprints()
    for step, b in enumerate(batches):
        buffer.copy_(b)
        fp.observe(buffer)
        fp.bind(step)
    got = fp.read(range(6))
    expected = _fingerprints_of(batches, hold_steps=0)
    assert 0 not in got and {s: got[s] for s in range(1, 6)} == {s: expected[s] for s in range(1, 6)}
    # written in place after the step, before anything hashed it: unknown, never a wrong name
    fp2 = BatchFingerprints()
    x = batches[0].clone()
    fp2.observe(x)
    fp2.bind(0)
    x.add_(1)
    assert fp2.read([0]) == {}


def test_a_held_input_that_requires_grad_does_not_keep_its_graph():
    import weakref

    from earlywarn.recover import BatchFingerprints

    fp = BatchFingerprints()
    leaf = torch.randn(4, 8, requires_grad=True)
    saved = torch.randn(4, 8)
    x = leaf * saved  # an input made by autograd, whose graph keeps `saved` for the backward pass
    expected = _fingerprints_of([x.detach().clone()])
    gone = weakref.ref(saved)
    fp.observe(x)
    fp.bind(0)
    del x, saved
    assert gone() is None  # held without the graph behind it
    assert fp.read([0]) == expected


def test_batch_fingerprints_are_the_values_earlier_versions_wrote():
    # A quarantine file written by an earlier run names its batches by these values: the planned,
    # cheaper hash (one dot product on the CPU) must give the same ones.
    from earlywarn.recover import BatchFingerprints

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 64), generator=g)
    images = torch.randn(4, 3, 5, generator=g)
    fp = BatchFingerprints()
    for step, batch in enumerate([ids, images, (ids, {"b": images})]):
        fp.observe(batch)
        fp.observe(batch)  # two micro-batches
        fp.bind(step)
    assert fp.read([0, 1, 2]) == {0: "f95ddc415abb7883", 1: "2732a0613e910cf2", 2: "b15079fcc6363103"}  # by the code before the plan


def test_a_conjugate_complex_batch_is_hashed_by_its_values():
    # a conjugate view (x.conj()) cannot be viewed as real pairs as it is: it is resolved, not an
    # error in the forward pre-hook that would stop training
    from earlywarn.recover import BatchFingerprints

    def fingerprint(batch: torch.Tensor) -> str:
        fp = BatchFingerprints()
        fp.observe(batch)
        fp.bind(0)
        return fp.read([0])[0]

    x = torch.randn(6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    assert fingerprint(x.conj()) == fingerprint(x.conj().resolve_conj()) != fingerprint(x)
