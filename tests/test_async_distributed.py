"""Async mode under torch.distributed (gloo, 2 processes): every rank judges each step at the same
step (exactly two late), agrees on every snapshot's finiteness, and takes the same decisions; the
result is the sync-mode run's, bit for bit."""

from __future__ import annotations

import datetime
import hashlib
import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

pytestmark = pytest.mark.distributed
WORLD = 2


def _digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for v in opt.state[p].values():
            if torch.is_tensor(v):
                h.update(v.numpy().tobytes())
    return h.hexdigest()


def _run(rank: int, mode: str, tmp: Path) -> dict[str, Any]:
    import earlywarn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset

    from earlywarn.capture.hostread import LateReader
    from earlywarn.recover import RecoveryConfig, ResumableLoader
    from fixtures_models import MLP

    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    data = TensorDataset(x, torch.tanh(x.sum(1, keepdim=True)))
    loader = ResumableLoader(data, 4, seed=1, num_replicas=WORLD, rank=rank)  # 12 batches per epoch
    torch.manual_seed(0)
    ddp = DDP(MLP())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
    ew = earlywarn.watch(ddp, opt, mode=mode, loader=loader, sinks=[],
                         recovery=RecoveryConfig(snapshot_every=4, clean_window=3,
                                                 quarantine_path=str(tmp / f"q-{mode}-{rank}.jsonl")))
    if mode == "sync":
        ew.statistics.stats.exact = True  # the norms async mode takes: the detector sees the same numbers
    else:
        from test_async import LateEvents

        # Each rank's device at its own pace (copies land 1 vs 3 steps late): the reader still
        # hands every rank each step exactly two steps late.
        ew.statistics.reader = LateReader(fixed_lag=ew.statistics.reader.fixed_lag, event_factory=LateEvents(1 if rank == 0 else 3))
    lag = ew.statistics.reader.fixed_lag if isinstance(ew.statistics.reader, LateReader) else 0
    step_of_skip = None
    for epoch in range(3):
        for i, (xb, yb) in enumerate(loader):
            n = epoch * 12 + i
            if n == 14 and rank == 0:  # one rank's replica corrupted: the loss is NaN there only
                with torch.no_grad():
                    ddp.module.hidden.weight[0, 0] = math.nan
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(xb), yb)
            ew.report_loss(loss)
            loss.backward()
            if n == 5 and rank == 1:  # a rank-local fault after DDP's reduction
                ddp.module.hidden.weight.grad[2, 2] = math.inf
            skipped = ew.counters["skipped_steps"]
            opt.step()
            if step_of_skip is None and ew.counters["skipped_steps"] > skipped:
                step_of_skip = ew.step - 1
    ew.flush()
    out = {"digest": _digest(ddp.module, opt), "counters": dict(ew.counters), "lag": lag,
           "events": [(e.kind.value, e.step, e.level.value, e.batch) for e in ew.events],
           "quarantine": [q.to_dict() for q in ew.recovery.quarantine], "skip_seen_at": step_of_skip,
           "snapshots": [(s.step, s.clean) for s in ew.recovery.ring.entries], "position": tuple(loader.position.to_dict().values())}
    ew.close()
    return out


def _worker(rank: int, port: int, tmp: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for mode in ("sync", "async"):
            results[mode] = _run(rank, mode, Path(tmp))
            dist.barrier()
    finally:
        torch.save(results, Path(tmp) / f"rank{rank}.pt")
        dist.destroy_process_group()


def test_async_ranks_decide_alike_and_match_sync_mode(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    for mode in ("sync", "async"):
        assert r0[mode]["digest"] == r1[mode]["digest"], mode  # replicas identical
        for key in ("counters", "events", "snapshots", "position", "skip_seen_at"):
            assert r0[mode][key] == r1[mode][key], (mode, key)
        positions = [[(q["epoch"], q["batch_index"], q["step"]) for q in r[mode]["quarantine"]] for r in (r0, r1)]
        assert positions[0] == positions[1] and positions[0], mode  # same positions (each rank its own samples)
    s, a = r0["sync"], r0["async"]
    assert a["lag"] == 2
    assert s["counters"]["skipped_steps"] == 1 and s["counters"]["rewinds"] == 1
    assert a["digest"] == s["digest"] and a["counters"] == s["counters"] and a["events"] == s["events"]
    for r in (r0, r1):
        assert r["async"]["quarantine"] == r["sync"]["quarantine"]  # sample ids included
    assert a["position"] == s["position"]
    assert [x for x in a["snapshots"] if x[1]] == [x for x in s["snapshots"] if x[1]]
    assert (s["skip_seen_at"], a["skip_seen_at"]) == (5, 7)  # judged exactly two steps late
