"""Checkpoints: exact resume of everything, crash safety, retention, weights_only, async, custom
save/load, warning checkpoints, the in-memory ring."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import earlywarn
from earlywarn.events import Kind, Level
from earlywarn.recover import (
    CheckpointError,
    CheckpointManager,
    DataPosition,
    Recovery,
    RecoveryConfig,
    ResumableLoader,
    SnapshotRing,
)

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


class NumpyDetectorState:
    """Stands in for the detector: numpy state, as the pure-numpy detectors keep it."""

    def __init__(self) -> None:
        self.window = np.zeros(8)
        self.count = np.int64(0)

    def update(self, v: float) -> None:
        self.window = np.roll(self.window, 1)
        self.window[0] = v
        self.count += 1

    def state_dict(self):
        return {"window": self.window.copy(), "count": self.count, "name": "robust"}

    def load_state_dict(self, d):
        self.window = np.array(d["window"], dtype=np.float64)
        self.count = np.int64(d["count"])


def build(seed: int = 0):
    """Same data every time; ``seed`` changes the model's initialisation and torch's RNG."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).sin()
    ds = torch.utils.data.TensorDataset(x, y)
    loader = ResumableLoader(ds, 8, seed=4)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    det = NumpyDetectorState()
    return loader, model, opt, sched, scaler, det


def train_steps(loader, model, opt, sched, scaler, det, rec, start: int, stop: int) -> list[float]:
    """Train steps start+1..stop, drawing across epochs; randomness from every RNG source."""
    out, step = [], start
    while step < stop:
        for xb, yb in loader:
            step += 1
            noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3  # python + numpy RNG
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb) + noise  # dropout: torch RNG
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            det.update(loss.item())
            out.append(loss.item())
            rec.after_step(step, clean=True)
            if step == stop:
                break
    return out


@pytest.mark.parametrize("async_write", [False, True])
def test_resume_restores_everything_bit_exactly(tmp_path, async_write):
    cfg = dict(checkpoint_dir=str(tmp_path), checkpoint_every=17, checkpoint_async=async_write)
    random.seed(1)
    np.random.seed(1)
    loader, model, opt, sched, scaler, det = build()
    rec = Recovery(model, opt, RecoveryConfig(**cfg), scheduler=sched, scaler=scaler, loader=loader,
                   extra_state={"detector": det})
    train_steps(loader, model, opt, sched, scaler, det, rec, 0, 17)  # mid-epoch 1 (12 batches/epoch)
    reference = train_steps(loader, model, opt, sched, scaler, det, rec, 17, 30)
    rec.close()
    final = [p.detach().clone() for p in model.parameters()]
    final_scale = scaler.get_scale()

    random.seed(99)  # a new process: every RNG elsewhere
    np.random.seed(99)
    loader2, model2, opt2, sched2, scaler2, det2 = build(seed=5)
    events = []
    rec2 = Recovery(model2, opt2, RecoveryConfig(**cfg), scheduler=sched2, scaler=scaler2, loader=loader2,
                    extra_state={"detector": det2}, emit=events.append)
    assert rec2.resume() == 17
    assert loader2.position == DataPosition(1, 5)
    assert int(det2.count) == 17 and sched2.last_epoch == 17
    resumed = train_steps(loader2, model2, opt2, sched2, scaler2, det2, rec2, 17, 30)
    assert resumed == reference
    assert all(torch.equal(a, b) for a, b in zip(final, model2.parameters()))
    assert scaler2.get_scale() == final_scale
    assert events[-1].kind == Kind.RESUME


CRASH_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    import earlywarn.recover.checkpoint as ck
    from earlywarn.recover import CheckpointManager
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    mgr = CheckpointManager(sys.argv[1], keep=3)
    mgr.save({"model": model.state_dict()}, step=1)          # complete
    with torch.no_grad():
        model.weight.add_(1.0)
    where = sys.argv[2]
    if where == "write":                                       # die half way through the bytes
        real_save = torch.save
        def torn(obj, f):
            import io
            buf = io.BytesIO(); real_save(obj, buf)
            data = buf.getvalue(); f.write(data[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        ck.torch.save = torn
    elif where == "rename":                                    # die after fsync, before the rename
        def dead(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        ck.os.replace = dead
    mgr.save({"model": model.state_dict()}, step=2)
    print("not reached")
    """
)


@pytest.mark.parametrize("where", ["write", "rename"])
def test_crash_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, where):
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(tmp_path), where], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp.")]
    assert leftovers  # the torn write is really there ...
    mgr = CheckpointManager(tmp_path)  # ... and a new manager clears it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp.")]
    assert [c.step for c in mgr.list()] == [1]
    torch.manual_seed(0)
    expected = torch.nn.Linear(64, 64).state_dict()
    got = mgr.load(mgr.latest())["state"]["model"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)


KILL_LOOP_CHILD = textwrap.dedent(
    """
    import sys, torch
    from earlywarn.recover import CheckpointManager
    model = torch.nn.Linear(512, 512)
    mgr = CheckpointManager(sys.argv[1], keep=2)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model.weight.fill_(step)
        mgr.save({"model": model.state_dict()}, step=step)
        if step == 1:
            print("first", flush=True)
    """
)


def test_sigkill_at_a_random_moment_never_leaves_a_broken_checkpoint(tmp_path):
    rng = random.Random(7)
    for _ in range(2):
        d = tmp_path / str(rng.random())
        child = subprocess.Popen([sys.executable, "-c", KILL_LOOP_CHILD, str(d)], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "first"
        time.sleep(rng.uniform(0.05, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        mgr = CheckpointManager(d, keep=2)
        found = mgr.list()
        assert found
        for info in found:  # every listed checkpoint is complete and matches its step
            w = mgr.load(info)["state"]["model"]["weight"]
            assert torch.all(w == info.step)


def test_retention_keeps_the_last_k_clean_and_the_last_unclean(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, keep_unclean=1)
    state = {"x": torch.ones(2)}
    for step in (10, 20, 30):
        mgr.save(state, step)
    mgr.save(state, 33, clean=False, reason="warning")
    mgr.save(state, 36, clean=False, reason="warning")
    mgr.save(state, 40)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-0000000030.clean.pt", "step-0000000036.warning.pt", "step-0000000040.clean.pt"]
    assert mgr.latest().step == 40 and mgr.latest(clean_only=False, before=40).step == 36
    mgr.discard_after(30)
    assert [c.step for c in mgr.list()] == [30]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".abandoned"))


def test_only_weights_only_loading_and_unsafe_state_fails_at_save(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "step-0000000005.clean.pt"
    torch.save({"format": "earlywarn.checkpoint", "version": 1, "step": 5, "state": {"x": Evil()}}, bad)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read"):
        mgr.load(mgr.latest())
    assert not marker.exists()

    with pytest.raises(CheckpointError, match=r"state\.extra\.detector\.when.*weights_only"):
        mgr.save({"extra": {"detector": {"when": time.struct_time((2024,) + (1,) * 8)}}}, 6)
    assert mgr.latest().step == 5  # nothing half-written


def test_custom_save_and_load_functions_directory_format(tmp_path):
    calls = []

    def save_fn(payload, path):  # e.g. a torch.distributed.checkpoint writer: a directory
        os.makedirs(path)
        torch.save(payload, os.path.join(path, "rank0.pt"))
        calls.append(("save", path))

    def load_fn(path):
        calls.append(("load", path))
        return torch.load(os.path.join(path, "rank0.pt"), weights_only=True)

    loader, model, opt, sched, scaler, det = build()
    cfg = RecoveryConfig(checkpoint_dir=str(tmp_path), checkpoint_every=5, save_fn=save_fn, load_fn=load_fn)
    rec = Recovery(model, opt, cfg, loader=loader)
    train_steps(loader, model, opt, sched, scaler, det, rec, 0, 5)
    final = [p.detach().clone() for p in model.parameters()]
    ckpt = tmp_path / "step-0000000005.clean.pt"
    assert ckpt.is_dir() and calls[0][1] != str(ckpt)  # written to a temp path, then renamed

    loader2, model2, opt2, *_ = build(seed=3)
    rec2 = Recovery(model2, opt2, cfg, loader=loader2)
    assert rec2.resume() == 5 and calls[-1] == ("load", str(ckpt))
    assert all(torch.equal(a, b) for a, b in zip(final, model2.parameters()))
    assert loader2.position == loader.position


def test_async_write_error_is_reported_once_and_leaves_no_checkpoint(tmp_path):
    def failing(payload, path):
        raise OSError(28, "No space left on device")

    failed = []
    mgr = CheckpointManager(tmp_path, async_write=True, save_fn=failing, load_fn=lambda p: {})
    mgr.on_failure = lambda path, err: failed.append((path.name, err.errno))
    mgr.save({"x": torch.ones(3)}, 1)  # returns at once
    with pytest.warns(RuntimeWarning, match=r"could not write checkpoint .*step-0000000001\.clean\.pt .*Errno 28.*training goes on"):
        mgr.wait()
    mgr.save({"x": torch.ones(3)}, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure is counted, not warned again
        mgr.wait()
    assert mgr.failures == 2 and failed == [("step-0000000001.clean.pt", 28), ("step-0000000002.clean.pt", 28)]
    assert mgr.list() == [] and not list(tmp_path.iterdir())


def test_a_failed_write_keeps_training_and_the_last_good_checkpoints(tmp_path):
    """Disk full hours in: the write fails, a warning names the path and errno, training goes on,
    and the checkpoints written before are still there and load."""
    full = {"now": False}

    def save(payload, path):
        if full["now"]:
            raise OSError(28, "No space left on device", path)
        torch.save(payload, path)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(
        checkpoint_dir=str(tmp_path), checkpoint_every=5, save_fn=save,
        load_fn=lambda p: torch.load(p, weights_only=True)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(30):
            full["now"] = step >= 12
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    ew.close()
    said = [str(w.message) for w in caught if "could not write checkpoint" in str(w.message)]
    assert len(said) == 1 and "[Errno 28] No space left on device" in said[0], said  # once, with the errno
    kept = [c.step for c in ew.recovery.checkpoints.list()]
    assert kept and max(kept) < 12, kept  # the good ones stay
    assert ew.recovery.checkpoints.failures >= 3
    failures = [e for e in ew.events if e.kind is Kind.CHECKPOINT_FAILED]
    assert failures and "No space left on device" in failures[0].message
    written = [e for e in ew.events if e.kind is Kind.CHECKPOINT]
    assert ew.counters["checkpoints"] == len(written) == len(kept)  # a failed write is not a checkpoint
    for c in ew.recovery.checkpoints.list():
        ew.recovery.checkpoints.load(c)  # every kept checkpoint loads


def test_an_unwritable_checkpoint_dir_is_refused_at_watch(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions: use a path under a file instead
            ro = tmp_path / "a_file"
            ro.write_text("x")
            ro = ro / "checkpoints"
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(CheckpointError, match=r"checkpoint directory .* is not writable .*Errno \d+.*checkpoint_dir="):
            earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(checkpoint_dir=str(ro)))
        assert getattr(opt, "_earlywarn_watcher", None) is None  # nothing left attached
    finally:
        (tmp_path / "ro").chmod(0o700)



def test_a_shared_directory_opened_by_several_ranks_at_once_is_writable_on_each(tmp_path, monkeypatch):
    # A collective writer's directory is shared: rank 0 opens its manager by removing the torn
    # ".tmp." files an earlier crash left, and another rank's writability probe, written a moment
    # before, is one of them. That rank had proved the directory writable; it must not be refused
    # (a refused rank skips the collectives the others then wait in, and the run hangs).
    real_unlink = Path.unlink

    def probe_removed_by_rank0_first(self, missing_ok=False):
        if self.name.startswith(".tmp.writable."):
            real_unlink(self)  # rank 0's cleanup, between this rank's write and its unlink
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", probe_removed_by_rank0_first)
    manager = CheckpointManager(tmp_path / "shared", keep=1)
    assert manager.directory.is_dir() and not any(manager.directory.iterdir())  # no probe left behind


def test_resume_falls_back_from_a_truncated_newest_checkpoint_and_says_so(tmp_path):
    loader, model, opt, sched, scaler, det = build()
    cfg = RecoveryConfig(snapshot_every=1000, checkpoint_dir=str(tmp_path), checkpoint_every=2, checkpoint_keep=3)
    rec = Recovery(model, opt, cfg, loader=loader)
    it = iter(loader)
    for step in range(1, 7):
        xb, yb = next(it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        rec.after_step(step, clean=True)
    newest = rec.checkpoints.latest()
    assert newest.step == 6
    newest.path.write_bytes(newest.path.read_bytes()[:100])  # torn by a crash on a full disk
    events = []
    loader2, model2, opt2, *_ = build(seed=3)
    rec2 = Recovery(model2, opt2, cfg, loader=loader2, emit=events.append)
    with pytest.warns(RuntimeWarning, match=r"resuming from .*step-0000000004\.clean\.pt instead: .*step-0000000006\.clean\.pt"):
        assert rec2.resume() == 4
    assert any(e.kind is Kind.CHECKPOINT_FAILED and e.signal == "checkpoint_read" for e in events)


@pytest.mark.parametrize("state", [42, {"model": "not a state dict"}, {"model": {"nope": torch.ones(1)}}])
def test_a_checkpoint_with_garbage_state_gives_a_checkpoint_error_naming_the_file(tmp_path, state):
    from earlywarn.recover.checkpoint import FORMAT, VERSION

    loader, model, opt, *_ = build()
    bad = tmp_path / "step-0000000001.clean.pt"
    torch.save({"format": FORMAT, "version": VERSION, "step": 1, "clean": True, "state": state}, bad)
    rec = Recovery(model, opt, RecoveryConfig(checkpoint_dir=str(tmp_path)), loader=loader)
    with pytest.raises(CheckpointError, match=re.escape(str(bad))):
        rec.resume(bad, restore_data=False)


def test_warning_checkpoint_before_the_update_is_consistent_and_a_last_resort(tmp_path):
    loader, model, opt, sched, scaler, det = build()
    events = []
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=1000, checkpoint_dir=str(tmp_path),
                                              checkpoint_every=1000), loader=loader, emit=events.append)
    it = iter(loader)
    for step in range(1, 4):
        xb, yb = next(it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        rec.after_step(step, clean=True)  # the ring's first (clean) snapshot is at step 1
    xb, yb = next(it)  # step 4: a warning arrives before its update
    path = rec.checkpoint(4, reason="warning")
    assert path.endswith("step-0000000003.warning.pt")  # the state is "after step 3"
    saved = rec.checkpoints.load(path)["state"]
    assert saved["data"]["batch_index"] == 3  # batch 3 (step 4's) is still to be trained
    w_at_3 = model[0].weight.detach().clone()
    # rewinds prefer the clean snapshot (step 1) over the newer warning one
    report = rec.rewind(4, "loss_diverged")
    assert report.restored_step == 1 and report.source == "memory:1"
    assert not torch.equal(model[0].weight, w_at_3)
    assert [(q.epoch, q.batch_index) for q in report.quarantined] == [(0, 1), (0, 2), (0, 3)]
    assert any(e.kind == Kind.CHECKPOINT for e in events)


def test_snapshot_ring_recycles_buffers_and_never_aliases_live_state():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ring = SnapshotRing(keep=2)

    def step():
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()

    step()
    a = ring.capture(1, model=model, optimizer=opt)
    step()
    ring.capture(2, model=model, optimizer=opt)
    buf = a.state["model"]["weight"]
    step()
    c = ring.capture(3, model=model, optimizer=opt)  # evicts step 1 and reuses its buffers
    assert [s.step for s in ring.entries] == [2, 3]
    assert c.state["model"]["weight"].data_ptr() == buf.data_ptr()
    saved = c.state["model"]["weight"].clone()
    saved_v = c.state["optimizer"]["state"][0]["exp_avg_sq"].clone()
    from earlywarn.recover import restore_state

    step()
    restore_state(c.state, model=model, optimizer=opt)
    assert torch.equal(model.weight, saved)
    step()  # training after a restore must not write into the snapshot
    assert torch.equal(c.state["model"]["weight"], saved)
    assert torch.equal(c.state["optimizer"]["state"][0]["exp_avg_sq"], saved_v)


def test_async_checkpoints_match_their_step_while_the_ring_keeps_capturing(tmp_path):
    def slow_save(payload, path):  # a slow disk: the next snapshot is captured meanwhile
        time.sleep(0.15)
        torch.save(payload, path)

    loader, model, opt, sched, scaler, det = build()
    cfg = RecoveryConfig(snapshot_every=1, snapshot_keep=1, checkpoint_dir=str(tmp_path), checkpoint_every=1,
                         checkpoint_keep=10, checkpoint_async=True, save_fn=slow_save,
                         load_fn=lambda p: torch.load(p, weights_only=True))
    rec = Recovery(model, opt, cfg, loader=loader)
    weights = {}
    for step in range(1, 5):
        xb, yb = next(iter(loader))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        rec.after_step(step, clean=True)
        weights[step] = model[0].weight.detach().clone()
    rec.close()
    infos = rec.checkpoints.list()
    assert [c.step for c in infos] == [1, 2, 3, 4]
    for c in infos:
        assert torch.equal(rec.checkpoints.load(c)["state"]["model"]["0.weight"], weights[c.step])


def test_rewind_from_disk_when_memory_snapshots_are_off_and_keep_on_rewind(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, d):
            self.n = d["n"]

    loader, model, opt, sched, scaler, det = build()
    policy_like, detector_like = Counter(), Counter()
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=0, checkpoint_dir=str(tmp_path), checkpoint_every=3),
                   loader=loader, extra_state={"policy": policy_like, "detector": detector_like},
                   keep_on_rewind=["policy"])
    train_steps(loader, model, opt, sched, scaler, det, rec, 0, 3)
    w3 = model[0].weight.detach().clone()
    policy_like.n = detector_like.n = 7
    train_steps(loader, model, opt, sched, scaler, det, rec, 3, 5)
    report = rec.rewind(6, "loss_diverged")
    assert report.restored_step == 3 and report.source.endswith("step-0000000003.clean.pt")
    assert torch.equal(model[0].weight, w3)
    assert (policy_like.n, detector_like.n) == (7, 0)  # the policy keeps its memory of the rewind
    assert [(q.epoch, q.batch_index) for q in report.quarantined] == [(0, 3), (0, 4)]


def _rank_worker(rank: int, world: int, tmp: str, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = Recovery(model, opt, RecoveryConfig(checkpoint_dir=tmp, checkpoint_every=1))
        rec.after_step(1, clean=True)
        assert rec.checkpoints.directory == Path(tmp) / f"rank{rank}"
        assert rec.quarantine_path == Path(tmp) / f"rank{rank}" / "quarantine.jsonl"
    finally:
        dist.barrier()  # neither rank tears the group down while the other still uses it
        dist.destroy_process_group()


def test_a_collective_writer_is_chosen_explicitly_and_never_runs_in_the_background(tmp_path):
    # Under torch.distributed the mode decides the layout: per-rank directories (torch.save, or a
    # save_fn that is not collective) or one shared checkpoint (tests/test_distributed.py).
    from earlywarn.distributed import dcp_checkpoint_fns

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    save_fn, load_fn = dcp_checkpoint_fns(model, opt)
    assert save_fn.collective is True and load_fn.collective is True
    d = str(tmp_path)
    assert RecoveryConfig(checkpoint_dir=d, save_fn=save_fn, load_fn=load_fn).collective
    assert not RecoveryConfig(checkpoint_dir=d, save_fn=save_fn, load_fn=load_fn, collective_save=False).collective
    assert not RecoveryConfig(checkpoint_dir=d).collective

    def plain_save(payload, path):
        torch.save(payload, path)

    def plain_load(path):
        return torch.load(path, weights_only=True)

    assert not RecoveryConfig(checkpoint_dir=d, save_fn=plain_save, load_fn=plain_load).collective
    assert RecoveryConfig(checkpoint_dir=d, save_fn=plain_save, load_fn=plain_load, collective_save=True).collective
    assert CheckpointManager(tmp_path, save_fn=save_fn, load_fn=load_fn).collective
    assert not CheckpointManager(tmp_path, save_fn=plain_save, load_fn=plain_load).collective
    with pytest.raises(ValueError, match="collective_save"):
        RecoveryConfig(checkpoint_dir=d, collective_save=True)
    with pytest.raises(ValueError, match="collective_save"):
        RecoveryConfig(checkpoint_dir=d, save_fn=plain_save, load_fn=plain_load, collective_save="yes")
    with pytest.raises(ValueError, match="checkpoint_async"):
        RecoveryConfig(checkpoint_dir=d, checkpoint_async=True, save_fn=save_fn, load_fn=load_fn)
    with pytest.raises(ValueError, match="async_write"):
        CheckpointManager(tmp_path, async_write=True, save_fn=save_fn, load_fn=load_fn)
    with pytest.raises(ValueError, match="collective=True"):
        CheckpointManager(tmp_path, collective=True)


@pytest.mark.distributed
def test_each_rank_writes_its_own_directory(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)
    for rank in range(2):
        torch.manual_seed(rank)
        expected = torch.nn.Linear(3, 1).weight
        got = CheckpointManager(tmp_path / f"rank{rank}").load(tmp_path / f"rank{rank}" / "step-0000000001.clean.pt")
        assert torch.equal(got["state"]["model"]["weight"], expected)
