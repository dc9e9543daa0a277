"""Async mode, on CPU, against sync mode step by step.

On CUDA the guard's async mode reads each step's statistics one step late or more (a
non-blocking copy into pinned memory, polled with ``event.query()``), while the fused optimizer
skips non-finite steps on the device. Fused AdamW/SGD run on CPU too, so the same code runs here;
only the copy's completion marker is replaced by :class:`LateEvents`, whose events complete k
pushes late, in order, as CUDA events on one stream do. The same run in sync mode is the
reference: the same parameters after every kept step, the same snapshots (labels, clean-ness,
contents), the same warning checkpoints (label = the state they hold), the same blame,
quarantine and restored state.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from torch.utils._python_dispatch import TorchDispatchMode

import earlywarn
from earlywarn.capture.hostread import HOST_WAITS, LateReader
from earlywarn.events import Kind
from earlywarn.recover import RecoveryConfig, ResumableLoader
from earlywarn.recover.data import DataPosition
from fixtures_models import MLP

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*")

N, BS, EPOCHS = 160, 8, 3  # 20 batches per epoch, 60 in all
SNAP_EVERY, CLEAN_WINDOW = 5, 6
INF_AT, POISON_AT = 11, 33  # global batch indices: an inf gradient (skipped), poisoned parameters (rewind)


class LateEvents:
    """Completion markers for :class:`LateReader` that complete ``lag`` pushes after their own
    (``lag`` may be a function of the push number), in order, or when waited for."""

    def __init__(self, lag):
        self.lag = lag if callable(lag) else (lambda n: lag)
        self.created = 0
        self.events: list[_LateEvent] = []

    def __call__(self, device):
        self.created += 1
        ev = _LateEvent(self, self.created, self.lag(self.created))
        self.events.append(ev)
        return ev


class _LateEvent:
    def __init__(self, factory, n, lag):
        self.factory, self.n, self.lag, self.done = factory, n, lag, False

    def query(self) -> bool:
        # The reader collects before it pushes: at push m it sees factory.created == m - 1.
        return self.done or self.factory.created - self.n >= self.lag - 1

    def synchronize(self) -> None:
        self.done = True


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    return TensorDataset(x, y, torch.arange(N))


def train(mode: str, tmp_path, *, lag=1, inf_at=INF_AT, poison_at=POISON_AT, optimizer="adamw"):
    torch.manual_seed(0)
    model = MLP()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    loader = ResumableLoader(dataset(), BS, seed=1)
    ew = earlywarn.watch(
        model, opt, mode=mode, loader=loader, sinks=[],
        # one cadence: the faster one while an episode builds follows alerts as they are *read*,
        # `lag` steps late in async mode, so its snapshot steps would differ from sync mode's
        recovery=RecoveryConfig(snapshot_every=SNAP_EVERY, snapshot_every_building=SNAP_EVERY,
                                clean_window=CLEAN_WINDOW,
                                quarantine_path=str(tmp_path / f"quarantine-{mode}.jsonl")),
        # a warning checkpoint at the inf step: deterministic, and the skip still happens
        policy=earlywarn.PolicyConfig(on_nonfinite_grad="checkpoint"),
    )
    if mode == "async":
        ew.statistics.reader = LateReader(event_factory=LateEvents(lag))  # the test double: vectors k steps late
    else:
        # float64 norms as async mode takes them (and both modes do on CUDA): the detector then
        # sees the same numbers to the last bit, and its state can be compared exactly
        ew.statistics.stats.exact = True
    trace: dict[int, tuple[tuple[int, int], list[torch.Tensor]]] = {}  # kept steps: batch, params after
    skipped_after: dict[int, int] = {}
    poisoned = False
    waits0 = HOST_WAITS.snapshot()[0]
    while loader.epoch < EPOCHS:
        for xb, yb, _ in loader:
            ref = loader.last_batch
            g = loader.global_index(DataPosition(ref.epoch, ref.batch_index))
            if g == poison_at and not poisoned:  # silent corruption between two steps
                with torch.no_grad():
                    model.hidden.weight[0, 0] = math.nan
                poisoned = True
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(xb), yb)
            ew.report_loss(loss)
            loss.backward()
            if g == inf_at:
                model.hidden.weight.grad[3, 5] = math.inf
            step, rewinds = ew.step, ew.recovery.rewinds
            opt.step()
            if ew.recovery.rewinds != rewinds:
                restored = [e for e in ew.events if e.kind is Kind.REWIND][-1].values["restored_step"]
                trace = {k: v for k, v in trace.items() if k <= restored}  # undone
            else:
                trace[step] = ((ref.epoch, ref.batch_index), [p.detach().clone() for p in model.parameters()])
            skipped_after[step] = ew.counters["skipped_steps"]
    waits_training = HOST_WAITS.snapshot()[0] - waits0
    ew.flush()
    return dict(ew=ew, model=model, opt=opt, loader=loader, trace=trace, skipped_after=skipped_after,
                waits_training=waits_training, waits_flush=HOST_WAITS.snapshot()[0] - waits0 - waits_training)


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def next_index(loader: ResumableLoader, data: dict) -> int:
    return loader.global_index(DataPosition(data["epoch"], data["batch_index"]))


def checkpoint_label(ew) -> int:
    msg = next(e.message for e in ew.events if e.kind is Kind.CHECKPOINT and e.signal != "snapshot_plan")
    return int(msg.rsplit("after step ", 1)[1])


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    return train("sync", tmp_path_factory.mktemp("sync"))


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_async_matches_sync_step_by_step(sync_run, tmp_path, lag):
    s, a = sync_run, train("async", tmp_path, lag=lag)
    sew, aew = s["ew"], a["ew"]
    assert (sew.mode, aew.mode) == ("sync", "async")

    # Every step that was kept: the same batch and the same parameters, bit for bit.
    assert a["trace"].keys() == s["trace"].keys()
    for step in s["trace"]:
        (sb, sp), (ab, ap) = s["trace"][step], a["trace"][step]
        assert sb == ab, step
        assert all(torch.equal(x, y) for x, y in zip(sp, ap)), step
    assert all(torch.equal(x, y) for x, y in zip(s["model"].parameters(), a["model"].parameters()))
    assert a["loader"].position == s["loader"].position

    # Counters agree in the end, and move exactly `lag` steps late on the way.
    assert aew.counters == sew.counters
    assert sew.counters["skipped_steps"] == 1 and sew.counters["rewinds"] == 1
    assert s["skipped_after"][INF_AT - 1] == 0 and s["skipped_after"][INF_AT] == 1
    assert a["skipped_after"][INF_AT + lag - 1] == 0 and a["skipped_after"][INF_AT + lag] == 1

    # The same events (the skip message differs only in sync mode's element count).
    def key(e):
        return (e.kind, e.step, e.level, e.layers, e.batch)
    assert [key(e) for e in aew.events] == [key(e) for e in sew.events]
    for kind in (Kind.REWIND, Kind.QUARANTINE, Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE):
        def text(ew):
            return [e.message.split(" -> ")[0] for e in ew.events if e.kind is kind]  # quarantine paths differ
        assert text(aew) == text(sew) and text(sew)

    # Blame and quarantine: the same batches, the same sample ids.
    assert [q.to_dict() for q in aew.recovery.quarantine] == [q.to_dict() for q in sew.recovery.quarantine]
    rewind = next(e for e in sew.events if e.kind is Kind.REWIND)
    assert f"batch responsible was batch {(POISON_AT - 1) % 20} of epoch {(POISON_AT - 1) // 20}" in rewind.message

    # Snapshots: labels, clean-ness and contents (model, optimizer, data position, detector).
    sring = [x for x in sew.recovery.ring.entries if x.clean]
    aring = [x for x in aew.recovery.ring.entries if x.clean]
    assert [x.step for x in aring] == [x.step for x in sring] and len(sring) == 3  # snapshot_keep
    for x, y in zip(sring, aring):
        for part in ("model", "optimizer", "data", "scheduler", "rng"):
            assert same_tree(x.state[part], y.state[part]), (x.step, part)
        assert same_tree(x.state["extra"]["earlywarn_detector"], y.state["extra"]["earlywarn_detector"]), x.step

    # The warning checkpoint holds the state its label names, and the data position after it:
    # sync mode takes it before the inf step's update, async mode when it reads that step.
    trace = s["trace"]
    for run, label in ((s, INF_AT - 1), (a, INF_AT + lag)):
        assert checkpoint_label(run["ew"]) == label
        snap = next(x for x in run["ew"].recovery.ring.entries if not x.clean)
        assert snap.step == label
        assert all(torch.equal(v, p) for v, p in zip(snap.state["model"].values(), trace[label][1]))
        batch = trace[label][0]
        assert next_index(run["loader"], snap.state["data"]) == batch[0] * 20 + batch[1] + 1

    # No blocking wait while training; draining at the end waits for the last ones in flight.
    assert a["waits_training"] == 0 and a["waits_flush"] == lag - 1


def test_async_with_varying_lag_matches_sync(sync_run, tmp_path):
    rng = random.Random(3)
    lags = {}
    a = train("async", tmp_path, lag=lambda n: lags.setdefault(n, rng.choice([1, 1, 2, 3])))
    s = sync_run
    assert a["trace"].keys() == s["trace"].keys()
    assert all(all(torch.equal(x, y) for x, y in zip(s["trace"][k][1], a["trace"][k][1])) for k in s["trace"])
    assert a["ew"].counters == s["ew"].counters
    assert [q.to_dict() for q in a["ew"].recovery.quarantine] == [q.to_dict() for q in s["ew"].recovery.quarantine]
    def clean(run):
        return [x.step for x in run["ew"].recovery.ring.entries if x.clean]
    assert clean(a) == clean(s)


def test_fused_sgd_async_matches_sync_including_a_skipped_first_step(tmp_path):
    # Fused SGD honours found_inf too. A skipped *first* step would leave torch's freshly
    # allocated momentum buffers uninitialised: the guard does not run that step at all.
    s = train("sync", tmp_path, inf_at=0, optimizer="sgd")
    a = train("async", tmp_path, inf_at=0, optimizer="sgd", lag=2)
    assert a["ew"].counters == s["ew"].counters and s["ew"].counters["skipped_steps"] == 1
    assert a["trace"].keys() == s["trace"].keys()
    for k in s["trace"]:
        assert all(torch.equal(x, y) for x, y in zip(s["trace"][k][1], a["trace"][k][1])), k
    for run in (s, a):
        bufs = [st["momentum_buffer"] for st in run["opt"].state.values()]
        assert bufs and all(bool(torch.isfinite(b).all()) and float(b.abs().max()) < 10 for b in bufs)


def test_policy_skip_of_a_finite_spike_is_not_reported_as_a_skip_in_async_mode():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with pytest.warns(UserWarning, match="on_grad_spike=skip cannot act in async mode"):
        ew = earlywarn.watch(model, opt, mode="async", sinks=[], policy=earlywarn.PolicyConfig(on_grad_spike="skip"))
    ew.statistics.reader = LateReader(event_factory=LateEvents(1))
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 45:
            for p in model.parameters():
                p.grad.mul_(1e4)  # finite spike: the detector flags it, the policy says skip
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if i == 45:
            assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # applied
    ew.flush()
    assert any(e.kind is Kind.GRAD_OUTLIER for e in ew.events)  # a 1e4x gradient: an outlier, read after its update
    assert not [e for e in ew.events if e.kind is Kind.SKIP] and ew.counters["skipped_steps"] == 0
    ew.close()


def test_mode_selection():
    model = MLP()
    assert earlywarn.watch(model, torch.optim.AdamW(model.parameters(), fused=True), sinks=[]).mode == "sync"  # CPU: auto -> sync
    model = MLP()
    assert earlywarn.watch(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), mode="async", sinks=[]).mode == "async"
    model = MLP()
    with pytest.raises(ValueError, match="fused=True to torch.optim.Adam/AdamW/SGD"):
        earlywarn.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="async", sinks=[])


_HOST_READS = ("_local_scalar_dense", "item", "is_nonzero", "equal", "tolist")  # a tensor's value to the host


def _mlp_step(model: nn.Module, opt: torch.optim.Optimizer, ew: Any, *, clip: bool = False) -> Callable[[], None]:
    """One training step of ``model`` on fresh random data per call (the loop clips when ``clip``)."""
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


class _ScalarReads(TorchDispatchMode):
    """Counts the operations that hand a tensor's value to the host (a sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_an_async_step_reads_no_value_on_the_host():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ew = earlywarn.watch(model, opt, mode="async", sinks=[], recovery=RecoveryConfig(snapshot_every=1000))
    step = _mlp_step(model, opt, ew)
    for _ in range(3):  # warm: optimizer state, the first snapshot and its settling
        step()
    with _ScalarReads() as reads:
        for _ in range(3):
            step()  # each also judges an earlier step: detector, policy, metrics
    assert reads.count == 0
    ew.close()


class _GuardScalarReads(TorchDispatchMode):
    """Scalar reads made by earlywarn itself: not inside the optimizer's own update (torch's AdamW
    reads its step counts), and not the snapshot's finiteness flag, which on CUDA is a pinned host
    copy read once its copy event completed (``recover/hostcopy.py``: never a device sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _HOST_READS:
            import traceback

            frames = traceback.extract_stack()
            if not any("/torch/optim/" in f.filename for f in frames) and not any(
                    f.filename.endswith("recover/hostcopy.py") and f.name == "finite" for f in frames):
                self.where.append(" <- ".join(f"{f.name}" for f in frames[-6:]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("clip", [False, True])
def test_a_calm_sync_step_reads_no_scalar_on_the_host(clip):
    # sync mode's one host read per step is the statistics vector itself (a view on the CPU, one
    # copy on CUDA); the norms, the clip's shared norms, the state check, the fingerprint and the
    # snapshots hand no single value to the host
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(snapshot_every=2))
    step = _mlp_step(model, opt, ew, clip=clip)
    for _ in range(12):  # warm: optimizer state, the first snapshots and their settling
        step()
    with _GuardScalarReads() as reads:
        for _ in range(20):  # snapshots every 2 steps, the state check every 10th: both inside
            step()
    assert reads.where == []
    assert ew.counters["steps"] == 32 and ew.counters["skipped_steps"] == 0
    ew.close()
