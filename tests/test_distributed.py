"""Real torch.distributed (gloo, 2 processes on CPU): DDP and FSDP2 give the single-process
numbers, every rank takes the same decision, a rewind moves every rank's data the same way.

One pair of processes runs every scenario (starting two interpreters with torch costs most of
the time); each test below checks the results one scenario left behind.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import re
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fixtures_models import MLP

pytestmark = pytest.mark.distributed

WORLD = 2
ROWS = 8  # per rank; the single-process reference sees all WORLD * ROWS rows


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(WORLD * ROWS, 8, generator=g, dtype=torch.float64),
            torch.randn(WORLD * ROWS, 1, generator=g, dtype=torch.float64))


def local_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    return x[rank * ROWS:(rank + 1) * ROWS].clone(), y[rank * ROWS:(rank + 1) * ROWS].clone()


def reference_layer_norms(model: nn.Module, step: int) -> dict[str, float]:
    """Per-layer gradient norms of the full global batch in one process (plus its loss)."""
    model.zero_grad()
    x, y = global_batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    out = {name: float(torch.sqrt(sum(p.grad.double().square().sum() for p in mod.parameters())))
           for name, mod in (("inp", model.inp), ("hidden", model.hidden), ("out", model.out))}
    out["loss"] = float(loss)
    return out


class Collectives(TorchDispatchMode):
    """Counts collective ops dispatched (c10d and functional collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def recovery_in(tmp: Path, rank: int) -> Any:
    # Defaults, but a rewind's quarantine list goes to the test's directory, not the cwd.
    from earlywarn.recover import RecoveryConfig

    return RecoveryConfig(quarantine_path=str(tmp / f"quarantine.rank{rank}.jsonl"))


def record(ew: Any) -> list[Any]:
    """What the detector sees, step by step: the steps it observes, and the calm steps as they are
    folded in (up to 16 steps later: ``ew.flush()`` folds them all)."""
    seen: list[Any] = []
    det = ew.detector
    orig, calm = det.observe, det.observe_calm
    det.observe = lambda obs: (seen.append(obs), orig(obs))[1]

    def observe_calm(cols: Any, scores: list) -> list:
        seen.extend(cols.observation(i) for i in range(len(cols)))
        return calm(cols, scores)

    det.observe_calm = observe_calm
    return seen


def events(ew: Any) -> list[tuple]:
    return [(e.step, str(e.kind), str(e.level), e.layers) for e in ew.events]


def without_samples(messages: list[str]) -> list[str]:
    """Messages with the sample indices left out: every rank draws its own samples of a batch."""
    return [re.sub(r" \(samples [0-9, ]+\)", "", m) for m in messages]


def samples(message: str) -> set[int]:
    return {int(i) for group in re.findall(r"\(samples ([0-9, ]+)\)", message) for i in group.split(", ")}


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach the live tensor); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [local(p).detach().clone() for p in model.parameters()]
    out += [local(v).detach().clone() for p in model.parameters() for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """Plain training steps on this rank's share of the global batches."""
    for step in steps:
        opt.zero_grad()
        x, y = local_batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def fsdp_mlp() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = MLP().double()
    for m in (model.inp, model.hidden, model.out, model):
        fully_shard(m)
    return model


def sharded_loader(rank: int) -> Any:
    """64 samples, every rank its half (the DistributedSampler split), 8 batches of 4 per epoch."""
    import earlywarn
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 8, generator=g, dtype=torch.float64),
                         torch.randn(64, 1, generator=g, dtype=torch.float64))
    return earlywarn.ResumableLoader(data, batch_size=4, seed=3, num_replicas=WORLD, rank=rank)


def full_digest(model: nn.Module) -> str:
    """The whole model (a collective: every rank gathers every parameter)."""
    return digest([p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()])


# ---------------------------------------------------------------------------------------- scenarios
def scenario_ddp_norms(rank: int, tmp: Path) -> dict[str, Any]:
    import earlywarn
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for report in (False, True):
        torch.manual_seed(0)
        ref = MLP().double()
        model = copy.deepcopy(ref)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ew = earlywarn.watch(ddp, opt, sinks=[], recovery=recovery_in(tmp, rank))
        seen = record(ew)
        got, want, losses, ref_losses, collectives = [], [], [], [], []
        for step in range(3):
            want.append(reference_layer_norms(ref, step))
            ref_losses.append(want[-1].pop("loss"))
            ref_opt.step()
            opt.zero_grad()
            x, y = local_batch(step, rank)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            if report:
                ew.report_loss(loss)
            with Collectives() as c:
                opt.step()
            collectives.append(len(c.ops))
            got.append({n.removeprefix("module."): float(v) for n, v in zip(ew.layer_names, seen[-1].layer_norms)})
            losses.append(seen[-1].loss)
        out[f"report={report}"] = {"got": got, "want": want, "collectives": collectives,
                                  "reducer": ew.statistics.reducer.collectives, "losses": losses, "ref_losses": ref_losses}
        ew.close()
    return out


def scenario_fsdp_norms(rank: int, tmp: Path) -> dict[str, Any]:
    import earlywarn
    from torch.distributed.fsdp import fully_shard

    out: dict[str, Any] = {}
    for name, make in (("foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
                       ("fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))):
        torch.manual_seed(0)
        ref = MLP().double()
        model = copy.deepcopy(ref)
        for m in (model.inp, model.hidden, model.out, model):
            fully_shard(m)
        opt = make(model.parameters())
        ref_opt = make(ref.parameters())
        ew = earlywarn.watch(model, opt, sinks=[], recovery=recovery_in(tmp, rank))
        seen = record(ew)
        got, want, collectives = [], [], []
        for step in range(3):
            want.append(reference_layer_norms(ref, step))
            want[-1].pop("loss")
            ref_opt.step()
            opt.zero_grad()
            x, y = local_batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            with Collectives() as c:
                opt.step()
            collectives.append(c.ops)
            got.append(dict(zip(ew.layer_names, map(float, seen[-1].layer_norms))))
        out[name] = {"got": got, "want": want, "collectives": collectives, "sharded": ew.statistics.reducer.sharded}
        ew.close()
    return out


def scenario_ddp_inf_rank1(rank: int, tmp: Path) -> dict[str, Any]:
    """A bad sample on rank 1 only (its input holds an inf) and, separately, a gradient corrupted
    on rank 1 after DDP's all-reduce (a hardware fault) with the loss reported."""
    import earlywarn
    from earlywarn.events import Kind
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    # grad_after_reduce_no_loss: the defaults, no report_loss at all (the case: that rank
    # alone skipped and the replicas drifted apart)
    for fault in ("input", "grad_after_reduce", "grad_after_reduce_no_loss", "grad_after_reduce_fused"):
        torch.manual_seed(0)
        ddp = DDP(MLP().double() if fault != "grad_after_reduce_fused" else MLP())
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=fault == "grad_after_reduce_fused")
        ew = earlywarn.watch(ddp, opt, sinks=[], recovery=recovery_in(tmp, rank))
        bit_identical = None
        for step in range(10):
            opt.zero_grad()
            x, y = local_batch(step, rank)
            if fault != "grad_after_reduce":
                x = x.to(next(ddp.parameters()).dtype)
                y = y.to(x.dtype)
            if step == 2 and rank == 1 and fault == "input":
                x[0, 0] = float("inf")
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            if fault == "grad_after_reduce":
                ew.report_loss(loss)
            if fault.startswith("grad_after_reduce") and step == 2 and rank == 1:
                ddp.module.hidden.weight.grad[3, 5] = float("inf")
            before = local_state(ddp.module, opt)
            opt.step()
            if step == 2:
                bit_identical = same(before, local_state(ddp.module, opt))
        out[fault] = {"skips": [e.step for e in ew.events if e.kind is Kind.SKIP],
                      "events": events(ew), "bit_identical": bit_identical,
                      "digest": digest(local_state(ddp.module, opt)),
                      "finite": all(bool(torch.isfinite(t).all()) for t in local_state(ddp.module, opt))}
        ew.close()
    return out


def scenario_fsdp_inf_rank1(rank: int, tmp: Path) -> dict[str, Any]:
    """One inf in rank 1's local shard of a gradient; rank 0's shards are all finite."""
    import earlywarn
    from earlywarn.events import Kind
    from torch.distributed.fsdp import fully_shard

    out: dict[str, Any] = {}
    for name, make in (("foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
                       ("fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
                       ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))):
        torch.manual_seed(0)
        model = MLP().double()
        for m in (model.inp, model.hidden, model.out, model):
            fully_shard(m)
        opt = make(model.parameters())
        ew = earlywarn.watch(model, opt, sinks=[], recovery=recovery_in(tmp, rank))
        seen = record(ew)
        bit_identical, counts = None, None
        for step in range(5):
            opt.zero_grad()
            x, y = local_batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            if step == 2 and rank == 1:
                model.hidden.weight.grad.to_local()[0, 0] = float("inf")
            before = local_state(model, opt)
            opt.step()
            if step == 2:
                bit_identical = same(before, local_state(model, opt))
                counts = dict(zip(ew.layer_names, map(float, seen[-1].layer_nonfinite)))
        full = [p.full_tensor() for p in model.parameters()]  # collective: every rank gets the whole model
        out[name] = {"skips": [e.step for e in ew.events if e.kind is Kind.SKIP],
                     "events": events(ew), "bit_identical": bit_identical, "counts": counts,
                     "full_digest": digest(full),
                     "finite": all(bool(torch.isfinite(t).all()) for t in local_state(model, opt))}
        ew.close()
    return out


def scenario_rank_local_loss(rank: int, tmp: Path) -> dict[str, Any]:
    """Rank 1 reports a loss 50x higher for a few steps (its gradients stay normal): every rank
    must feed the detector the same numbers and take the same decisions."""
    import earlywarn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from earlywarn.sinks.base import Sink

    class Tracker(Sink):
        name = "tracker"

        def __init__(self) -> None:
            self.steps: list[int] = []

        def log_metrics(self, step: int, metrics: Any) -> None:
            self.steps.append(step)

    tracker = Tracker()
    torch.manual_seed(0)
    ddp = DDP(MLP().double())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    # the inflated loss goes on after the rewind: a cooldown keeps the run going (by default the
    # recurrence halts it) -- this scenario is about identical decisions, not their escalation
    from earlywarn.policy import PolicyConfig

    ew = earlywarn.watch(ddp, opt, sinks=[tracker], recovery=recovery_in(tmp, rank),
                         policy=PolicyConfig(rewind_cooldown=20))
    seen = record(ew)
    skipped = []
    for step in range(40):
        opt.zero_grad()
        x, y = local_batch(step % 4, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        shown = loss * 50 if (rank == 1 and step >= 30) else loss
        ew.report_loss(shown)
        before = digest(local_state(ddp.module, opt))
        opt.step()
        skipped.append(before == digest(local_state(ddp.module, opt)))
    ew.flush()  # (the calm steps still held folded in: every loss the detector sees)
    out = {"losses": [o.loss for o in seen], "events": events(ew), "skipped": skipped,
           "digest": digest(local_state(ddp.module, opt)), "collectives": ew.statistics.reducer.collectives,
           "sinks": [sink.name for sink in ew.sinks], "tracked_steps": len(tracker.steps)}
    ew.close()
    return out


def scenario_rewind(rank: int, tmp: Path) -> dict[str, Any]:
    """A weight of rank 1's replica turns NaN (loss reported): the mean loss is NaN on every
    rank, every rank rewinds to the same snapshot and skips the same data positions."""
    import earlywarn
    from earlywarn.events import Kind
    from earlywarn.recover import RecoveryConfig
    from torch.nn.parallel import DistributedDataParallel as DDP

    loader = sharded_loader(rank)
    torch.manual_seed(0)
    ddp = DDP(MLP().double())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ew = earlywarn.watch(ddp, opt, loader=loader, sinks=[],
                         recovery=RecoveryConfig(snapshot_every=4, clean_window=2, rewind_skip_batches=4,
                                                 quarantine_path=str(tmp / f"quarantine{rank}.jsonl")))
    positions, step = [], 0
    for _epoch in range(2):
        for x, y in loader:
            if step == 10 and rank == 1:
                with torch.no_grad():  # one weight of rank 1's replica turns NaN: the loss is NaN on every
                    ddp.module.hidden.weight[0, 0] = float("nan")  # rank (a NaN batch alone costs one skip)
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            ew.report_loss(loss)
            opt.step()
            positions.append(loader.position.to_dict())
            step += 1
    rewinds = [e for e in ew.events if e.kind is Kind.REWIND]
    out = {"positions": positions, "events": events(ew), "rewinds": [e.step for e in rewinds],
           "rewind_messages": [e.message for e in rewinds],
           "digest": digest(local_state(ddp.module, opt)),
           "finite": all(bool(torch.isfinite(t).all()) for t in local_state(ddp.module, opt))}
    ew.close()
    return out


def scenario_dcp(rank: int, tmp: Path) -> dict[str, Any]:
    """Sharded state written with torch.distributed.checkpoint and read back in place."""
    from torch.distributed.fsdp import fully_shard

    from earlywarn.distributed import dcp_checkpoint_fns
    from earlywarn.recover.safe import encode_safe
    from earlywarn.recover.checkpoint import FORMAT, VERSION, load_checkpoint
    from earlywarn.recover.snapshot import capture_state, restore_state

    torch.manual_seed(0)
    model = MLP().double()
    for m in (model.inp, model.hidden, model.out, model):
        fully_shard(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(steps: range) -> None:
        train_steps(model, opt, rank, steps)

    train(range(2))
    saved = local_state(model, opt)
    save_fn, load_fn = dcp_checkpoint_fns(model, opt)
    state = capture_state(2, model=model, optimizer=opt, data={"epoch": 0, "batch_index": 2 + rank}).wait()
    payload = {"format": FORMAT, "version": VERSION, "step": 2, "clean": True, "reason": "periodic",
               "state": encode_safe(state)}
    path = tmp / "dcp-ckpt"
    save_fn(payload, str(path))
    dist.barrier()
    train(range(2, 4))
    moved = not same(saved, local_state(model, opt))
    loaded = load_checkpoint(path, load_fn=load_fn)
    restore_state(loaded["state"], model=model, optimizer=opt)
    files = sorted(p.name for p in path.iterdir())
    sharded = [type(v).__name__ for v in loaded["state"]["model"].values()]
    return {"moved": moved, "restored": same(saved, local_state(model, opt)), "files": files,
            "data": loaded["state"]["data"], "step": loaded["step"], "sharded": sharded}


def train_through_a_nan_weight(ew: Any, model: nn.Module, opt: Any, loader: Any, rank: int,
                               poison: Callable[[], None], seen: Callable[[int], None]) -> tuple[list, list]:
    """Two epochs of ``loader`` with the loss reported; before step 6, rank 1 runs ``poison()``
    (its copy or shard of a weight turns NaN); ``seen(step)`` after every step. Returns the loader's
    position and the collectives of each ``opt.step()``."""
    positions, collectives, step = [], [], 0
    for _epoch in range(2):
        for x, y in loader:
            if step == 6 and rank == 1:
                with torch.no_grad():
                    poison()
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            ew.report_loss(loss)
            with Collectives() as c:
                opt.step()
            collectives.append(c.ops)
            seen(step)
            positions.append(loader.position.to_dict())
            step += 1
    return positions, collectives


def scenario_fsdp_rewind(rank: int, tmp: Path) -> dict[str, Any]:
    """FSDP2 with the default RecoveryConfig: rank 1's shard of a weight turns NaN (loss
    reported), every rank rewinds its shards to the same in-memory snapshot (step 0)."""
    import earlywarn
    from earlywarn.events import Kind

    loader = sharded_loader(rank)
    torch.manual_seed(0)
    model = fsdp_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, loader=loader, sinks=[], recovery=recovery_in(tmp, rank))
    kept: dict[str, Any] = {}

    def seen(step: int) -> None:
        if step == 0:  # the default snapshot: the state after the first step
            kept["snap_state"], kept["snap_digest"] = local_state(model, opt), full_digest(model)
        if step == 6:
            kept["restored"] = same(kept["snap_state"], local_state(model, opt))
            kept["restored_digest"] = full_digest(model)

    def poison() -> None:  # a NaN in rank 1's shard of a weight (a NaN batch alone is one skip)
        model.hidden.weight._local_tensor[0, 0] = float("nan")

    positions, collectives = train_through_a_nan_weight(ew, model, opt, loader, rank, poison, seen)
    restored, snap_digest, restored_digest = kept["restored"], kept["snap_digest"], kept["restored_digest"]
    rewinds = [e for e in ew.events if e.kind is Kind.REWIND]
    out = {"positions": positions, "events": events(ew), "rewinds": [e.step for e in rewinds],
           "rewind_messages": [e.message for e in rewinds], "restored": restored,
           "snap_digest": snap_digest, "restored_digest": restored_digest, "collectives": collectives,
           "digest": full_digest(model), "local_digest": digest(local_state(model, opt)),
           "finite": all(bool(torch.isfinite(t).all()) for t in local_state(model, opt))}
    ew.close()
    return out


def scenario_fsdp_repair(rank: int, tmp: Path) -> dict[str, Any]:
    """FSDP2, default RecoveryConfig: AdamW's second moment is poisoned (inf) in rank 1's shard
    only, then rank 1 draws a NaN batch. Rank 0's own shards are clean, yet every rank must see
    the same scan (state poisoned, parameters finite), choose repair over rewind, and reset the
    coordinate to the largest finite value of the whole tensor -- which lives in rank 0's shard."""
    import earlywarn
    from earlywarn.events import Kind

    torch.manual_seed(0)
    model = fsdp_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=recovery_in(tmp, rank))
    reports = []
    orig = ew.recovery.repair
    ew.recovery.repair = lambda *a, **k: (reports.append(orig(*a, **k)), reports[-1])[1]
    w = model.hidden.weight
    out: dict[str, Any] = {}
    for step in range(8):
        opt.zero_grad()
        x, y = local_batch(step, rank)
        if step == 4 and rank == 1:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        ew.report_loss(loss)
        if step == 4:
            params_before = [local(p).clone() for p in model.parameters()]
        opt.step()
        if step == 3:
            v, m = (local(opt.state[w][k]) for k in ("exp_avg_sq", "exp_avg"))
            with torch.no_grad():
                if rank == 0:
                    v[0, 0] = 5.0  # the largest finite second moment of the tensor, in rank 0's shard
                else:
                    v[0, 0] = float("inf")
            out["own_max"] = float(v[torch.isfinite(v)].max())  # what a rank-local repair would use
            out["m_before"] = float(m[0, 0])
        if step == 4:
            out["params_untouched"] = same(params_before, [local(p) for p in model.parameters()])
            out["v00"] = float(local(opt.state[w]["exp_avg_sq"])[0, 0])
            out["m00"] = float(local(opt.state[w]["exp_avg"])[0, 0])
    out.update({"events": events(ew), "counters": ew.summary(), "reports": [r.to_dict() for r in reports],
                "rewinds": [e.step for e in ew.events if e.kind is Kind.REWIND], "digest": full_digest(model),
                "finite": all(bool(torch.isfinite(t).all()) for t in local_state(model, opt))})
    ew.close()
    return out


def zero_mlp() -> tuple[nn.Module, Any]:
    """DDP with torch's ZeroRedundancyOptimizer (ZeRO-1): every rank holds the whole model and
    the AdamW state of its own share of the parameters only."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(MLP().double())
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)


def zero_share(zero: Any) -> list[torch.Tensor]:
    """This rank's share of the optimizer state (the local optimizer's tensors, in its order)."""
    return [v.detach().clone() for g in zero.optim.param_groups for p in g["params"]
            for v in zero.optim.state.get(p, {}).values() if torch.is_tensor(v)]


def scenario_zero_rewind(rank: int, tmp: Path) -> dict[str, Any]:
    """ZeRO-1, default RecoveryConfig: rank 1's replica of a weight turns NaN (loss reported);
    every rank rewinds to the same in-memory snapshot (step 0) and puts back its own share of the
    optimizer state -- without ZeRO's consolidation, which moves the whole state."""
    import earlywarn
    from earlywarn.events import Kind

    loader = sharded_loader(rank)
    ddp, zero = zero_mlp()
    ew = earlywarn.watch(ddp, zero, loader=loader, sinks=[], recovery=recovery_in(tmp, rank))
    kept: dict[str, Any] = {}

    def seen(step: int) -> None:
        if step == 0:
            kept["snap"] = (zero_share(zero), digest(list(ddp.module.parameters())))
        if step == 6:
            kept["restored"] = (same(kept["snap"][0], zero_share(zero)), digest(list(ddp.module.parameters())))

    def poison() -> None:
        ddp.module.hidden.weight[0, 0] = float("nan")

    estimated = ew.recovery.snapshots.snapshot_plan.size  # before the first step: from the optimizer's kind
    positions, collectives = train_through_a_nan_weight(ew, ddp, zero, loader, rank, poison, seen)
    snap, restored = kept["snap"], kept["restored"]
    rewinds = [e for e in ew.events if e.kind is Kind.REWIND]
    out = {"positions": positions, "events": events(ew), "rewinds": [e.step for e in rewinds],
           "rewind_messages": [e.message for e in rewinds], "restored": restored, "snap_digest": snap[1],
           "collectives": collectives, "digest": digest(list(ddp.module.parameters())),
           "share": len(zero_share(zero)), "finite": all(bool(torch.isfinite(t).all()) for t in
                                                        zero_share(zero) + list(ddp.module.parameters())),
           "estimated": estimated, "measured": ew.recovery.snapshots.snapshot_plan.size}
    ew.close()
    return out


def scenario_zero_repair(rank: int, tmp: Path) -> dict[str, Any]:
    """ZeRO-1, default RecoveryConfig: AdamW's second moment of `hidden.weight` is poisoned (inf)
    on the one rank that holds it, then the other rank draws a NaN batch. The other rank holds
    none of that state, yet every rank must see the same scan, choose repair over rewind and
    report the same repair; the holder resets the coordinate to the tensor's largest finite value."""
    import earlywarn
    from earlywarn.events import Kind

    ddp, zero = zero_mlp()
    ew = earlywarn.watch(ddp, zero, sinks=[], recovery=recovery_in(tmp, rank))
    reports = []
    orig = ew.recovery.repair
    ew.recovery.repair = lambda *a, **k: (reports.append(orig(*a, **k)), reports[-1])[1]
    w = ddp.module.hidden.weight
    holder = zero._param_to_rank[w]
    out: dict[str, Any] = {"holder": holder}
    for step in range(8):
        zero.zero_grad()
        x, y = local_batch(step, rank)
        if step == 4 and rank != holder:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        ew.report_loss(loss)
        if step == 4:
            params_before = [p.detach().clone() for p in ddp.module.parameters()]
        zero.step()
        if step == 3 and rank == holder:
            v = zero.optim.state[w]["exp_avg_sq"]
            with torch.no_grad():
                v[0, 0] = float("inf")
            out["max"] = float(v[torch.isfinite(v)].max())
        if step == 4:
            out["params_untouched"] = same(params_before, list(ddp.module.parameters()))
            if rank == holder:
                out["v00"] = float(zero.optim.state[w]["exp_avg_sq"][0, 0])
                out["m00"] = float(zero.optim.state[w]["exp_avg"][0, 0])
    out.update({"events": events(ew), "counters": ew.summary(), "reports": [r.to_dict() for r in reports],
                "rewinds": [e.step for e in ew.events if e.kind is Kind.REWIND],
                "digest": digest(list(ddp.module.parameters())),
                "finite": all(bool(torch.isfinite(t).all()) for t in zero_share(zero))})
    ew.close()
    return out


def scenario_zero_resume(rank: int, tmp: Path) -> dict[str, Any]:
    """ZeRO-1 with disk checkpoints (the default writer: one file per rank, each with its own
    share of the state): a fresh model and optimizer resume every rank's share exactly."""
    import earlywarn
    from earlywarn.recover import RecoveryConfig

    cfg = RecoveryConfig(checkpoint_dir=str(tmp / "zero_ckpt"), checkpoint_every=5,
                         quarantine_path=str(tmp / f"zero_quarantine{rank}.jsonl"))
    ddp, zero = zero_mlp()
    ew = earlywarn.watch(ddp, zero, sinks=[], recovery=cfg)
    train_steps(ddp, zero, rank, range(8))
    ew.flush()
    ew.close()
    ddp2, zero2 = zero_mlp()
    ew2 = earlywarn.watch(ddp2, zero2, sinks=[], recovery=cfg)
    step = ew2.recovery.resume(restore_data=False)
    share, params = zero_share(zero2), [p.detach().clone() for p in ddp2.module.parameters()]
    # the same run again, uninterrupted, to the checkpoint's step: the state it must equal
    ddp3, zero3 = zero_mlp()
    train_steps(ddp3, zero3, rank, range(step + 1))
    out = {"step": step, "share": len(share), "state_equal": same(share, zero_share(zero3)),
           "params_equal": same(params, [p.detach() for p in ddp3.module.parameters()]),
           "wrapper_state": len(zero2.state), "lr": [g["lr"] for g in zero2.param_groups]}
    train_steps(ddp2, zero2, rank, range(step + 1, step + 3))  # and it trains on
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in zero_share(zero2))
    ew2.close()
    return out


def scenario_zero_overlap_refused(rank: int, tmp: Path) -> dict[str, Any]:
    """ZeRO-1 stepped inside DDP's communication hook (overlap_with_ddp=True): no step to guard."""
    import earlywarn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(MLP().double())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2, overlap_with_ddp=True)
    try:
        earlywarn.watch(ddp, zero, sinks=[], recovery=recovery_in(tmp, rank))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def scenario_dcp_manager(rank: int, tmp: Path) -> dict[str, Any]:
    """CheckpointManager + dcp_checkpoint_fns on both ranks: one shared checkpoint per step,
    committed by rank 0; then the same through the watcher, with a rewind from disk."""
    import earlywarn
    from earlywarn.distributed import dcp_checkpoint_fns
    from earlywarn.events import Kind
    from earlywarn.recover import Recovery, RecoveryConfig
    from earlywarn.recover.checkpoint import CheckpointManager
    from earlywarn.recover.snapshot import capture_state, restore_state

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = fsdp_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(steps: range) -> None:
        train_steps(model, opt, rank, steps)

    save_fn, load_fn = dcp_checkpoint_fns(model, opt)
    manager = CheckpointManager(tmp / "manager", keep=1, save_fn=save_fn, load_fn=load_fn)
    train(range(2))
    manager.save(capture_state(2, model=model, optimizer=opt), 2)
    train(range(2, 4))
    saved = local_state(model, opt)
    path = manager.save(capture_state(4, model=model, optimizer=opt, data={"epoch": 0, "batch_index": rank}), 4)
    out["listing"] = [(c.step, c.tag, c.path.name) for c in manager.list()]  # step 2 pruned by rank 0
    out["entries"] = sorted(p.name for p in (tmp / "manager").iterdir())
    out["files"] = sorted(p.name for p in Path(path).iterdir())
    train(range(4, 6))
    out["moved"] = not same(saved, local_state(model, opt))
    loaded = manager.load(manager.latest())
    restore_state(loaded["state"], model=model, optimizer=opt)
    out["restored"] = same(saved, local_state(model, opt))
    out["data"] = loaded["state"]["data"]

    # through the watcher: disk checkpoints only (every 3 steps), a NaN weight on rank 1 at step 7
    loader = sharded_loader(rank)
    torch.manual_seed(0)
    model = fsdp_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_fn, load_fn = dcp_checkpoint_fns(model, opt)
    cfg = RecoveryConfig(checkpoint_dir=str(tmp / "run"), checkpoint_every=3, snapshot_every=0,
                         save_fn=save_fn, load_fn=load_fn)
    ew = earlywarn.watch(model, opt, loader=loader, sinks=[], recovery=cfg)
    positions, at6, restored = [], None, None
    for step, (x, y) in enumerate(loader):
        if step == 7 and rank == 1:
            with torch.no_grad():  # a NaN in rank 1's shard of a weight (a NaN batch alone is one skip)
                model.hidden.weight._local_tensor[0, 0] = float("nan")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        ew.report_loss(loss)
        opt.step()
        if step == 6:
            at6 = local_state(model, opt)
        if step == 7:
            restored = same(at6, local_state(model, opt))
        positions.append(loader.position.to_dict())
    rewinds = [e for e in ew.events if e.kind is Kind.REWIND]
    # Each rank writes its own quarantine list after the rewind's last collective: wait for the
    # other rank before listing the shared directory (it may still be writing its file).
    torch.distributed.barrier()
    out["watch"] = {"rewinds": [e.step for e in rewinds], "messages": [e.message for e in rewinds],
                    "restored": restored, "positions": positions, "events": events(ew),
                    "entries": sorted(p.name for p in (tmp / "run").iterdir()),
                    "quarantine": ew.recovery.quarantine_path.name}
    ew.close()

    # the default torch.save writer is not collective: each rank its own complete files
    rec = Recovery(model, opt, RecoveryConfig(checkpoint_dir=str(tmp / "perrank"), checkpoint_every=1,
                                              snapshot_every=0))
    saved = local_state(model, opt)
    rec.after_step(1, clean=True)
    train(range(2))
    rec.resume(restore_data=False)
    out["per_rank"] = {"entries": sorted(p.name for p in (tmp / "perrank").iterdir()),
                       "files": sorted(p.name for p in (tmp / "perrank" / f"rank{rank}").iterdir()),
                       "restored": same(saved, local_state(model, opt))}
    return out


SCENARIOS: dict[str, Callable[[int, Path], Any]] = {
    "ddp_norms": scenario_ddp_norms,
    "fsdp_norms": scenario_fsdp_norms,
    "ddp_inf_rank1": scenario_ddp_inf_rank1,
    "fsdp_inf_rank1": scenario_fsdp_inf_rank1,
    "rank_local_loss": scenario_rank_local_loss,
    "rewind": scenario_rewind,
    "dcp": scenario_dcp,
    "fsdp_rewind": scenario_fsdp_rewind,
    "fsdp_repair": scenario_fsdp_repair,
    "dcp_manager": scenario_dcp_manager,
    "zero_rewind": scenario_zero_rewind,
    "zero_repair": scenario_zero_repair,
    "zero_resume": scenario_zero_resume,
    "zero_overlap_refused": scenario_zero_overlap_refused,
}


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name, fn in SCENARIOS.items():
            try:
                results[name] = fn(rank, Path(tmp))
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, Path(tmp) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("dist")
    mp.start_processes(_worker, args=(_free_port(), str(tmp)), nprocs=WORLD, start_method="spawn", join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def get(results: list[dict[str, Any]], name: str) -> list[Any]:
    per_rank = [r[name] for r in results]
    for r, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"scenario {name} failed on rank {r}:\n{res['error']}")
    return per_rank


# ---------------------------------------------------------------------------------------- tests
def assert_norms(got: list[dict[str, float]], want: list[dict[str, float]]) -> None:
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-6), k


def test_ddp_layer_norms_equal_single_process_with_one_small_allreduce_per_step(results):
    for res in get(results, "ddp_norms"):
        r = res["report=False"]
        assert_norms(r["got"], r["want"])
        # one all-reduce of the small statistics vector per step, even without a reported loss (a
        # rank-local fault after DDP's reduction must reach every rank); step 0 also takes the
        # default snapshot, whose state scan agrees its counts over ranks in one more
        assert r["collectives"] == [2, 1, 1] and r["reducer"] == 3


def test_ddp_reported_loss_is_averaged_in_one_allreduce(results):
    per_rank = get(results, "ddp_norms")
    for res in per_rank:
        r = res["report=True"]
        assert_norms(r["got"], r["want"])
        assert r["collectives"] == [2, 1, 1] and r["reducer"] == 3  # + the snapshot scan at step 0
        # both halves have the same size: the mean of the ranks' losses is the global-batch loss
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9)
    assert per_rank[0]["report=True"]["losses"] == per_rank[1]["report=True"]["losses"]


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_fsdp2_layer_norms_equal_single_process_with_one_allreduce(results, optimizer):
    for res in get(results, "fsdp_norms"):
        r = res[optimizer]
        assert r["sharded"]
        assert_norms(r["got"], r["want"])
        # one all-reduce of one small vector per step, nothing per parameter; step 0 also takes
        # the default snapshot, whose state scan agrees its counts over ranks in one more
        assert r["collectives"] == [["c10d.allreduce_.default"] * 2] + [["c10d.allreduce_.default"]] * 2


@pytest.mark.parametrize("fault", ["input", "grad_after_reduce", "grad_after_reduce_no_loss", "grad_after_reduce_fused"])
def test_ddp_inf_on_rank1_only_both_ranks_skip_and_stay_identical(results, fault):
    r0, r1 = (res[fault] for res in get(results, "ddp_inf_rank1"))
    assert r0["skips"] == r1["skips"] == [2]
    assert r0["bit_identical"] and r1["bit_identical"]
    assert r0["events"] == r1["events"]
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]
    if fault.startswith("grad_after_reduce"):  # rank 0's copy was finite; both ranks still name the layer
        assert [e[3] for e in r0["events"] if e[1] == "skip"] == [("hidden",)]  # as the model names it (no DDP `module.`)


@pytest.mark.parametrize("optimizer", ["foreach", "fused", "sgd"])
def test_fsdp2_inf_in_rank1_shard_both_ranks_skip(results, optimizer):
    r0, r1 = (res[optimizer] for res in get(results, "fsdp_inf_rank1"))
    assert r0["skips"] == r1["skips"] == [2]
    assert r0["bit_identical"] and r1["bit_identical"]  # nobody's shard moved
    assert r0["events"] == r1["events"]
    # the global count: rank 0's shard of `hidden` was finite, yet both ranks count the one inf
    assert r0["counts"] == r1["counts"] and r0["counts"]["hidden"] == 1.0
    assert sum(r0["counts"].values()) == 1.0
    assert r0["full_digest"] == r1["full_digest"] and r0["finite"] and r1["finite"]


def test_rank_local_loss_gives_identical_decisions(results):
    r0, r1 = get(results, "rank_local_loss")
    assert r0["losses"] == r1["losses"]  # bit for bit: the same vector on both ranks
    assert r0["events"] == r1["events"]
    assert r0["skipped"] == r1["skipped"]
    assert r0["digest"] == r1["digest"]
    assert r0["collectives"] == 40
    # only rank 0 talks to trackers
    assert r0["sinks"] == ["tracker"] and r0["tracked_steps"] == 40
    assert r1["sinks"] == [] and r1["tracked_steps"] == 0
    # rank 1's inflated loss reached the detector as the mean of the two ranks
    late = np.array(r0["losses"][30:])
    early = np.array(r0["losses"][26:30])
    assert late.mean() > 10 * early.mean()


def test_rewind_on_both_ranks_resumes_the_same_data_positions(results):
    r0, r1 = get(results, "rewind")
    assert r0["rewinds"] == r1["rewinds"] == [10], (r0["events"], r0["rewind_messages"])
    assert r0["events"] == r1["events"]
    assert r0["positions"] == r1["positions"]
    # restored to step 8, whose next batch was epoch 1 batch 1; rewind_skip_batches=4 moves both
    # ranks' loaders to epoch 1 batch 5 (batches 1-4 quarantined)
    assert r0["positions"][9] == {"epoch": 1, "batch_index": 2}
    assert r0["positions"][10] == {"epoch": 1, "batch_index": 5}
    assert "epoch 1 batches 1-4" in r0["rewind_messages"][0]
    # the same batches on every rank, each made of that rank's own samples (the sharded loader)
    assert without_samples(r0["rewind_messages"]) == without_samples(r1["rewind_messages"])
    assert samples(r0["rewind_messages"][0]) and not samples(r0["rewind_messages"][0]) & samples(r1["rewind_messages"][0])
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_dcp_round_trip_of_sharded_state(results):
    for rank, r in enumerate(get(results, "dcp")):
        assert r["moved"] and r["restored"]
        assert r["step"] == 2 and r["data"] == {"epoch": 0, "batch_index": 2 + rank}  # each rank's own
        assert set(r["sharded"]) == {"DTensor"}
        assert ".metadata" in r["files"] and "earlywarn.rank0.pt" in r["files"] and "earlywarn.rank1.pt" in r["files"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_fns_plug_into_the_checkpoint_manager(tmp_path):
    # One process (no process group): the same pair works as CheckpointManager's save_fn/load_fn,
    # through its temp-directory-and-rename protocol, and the checkpoint loads with weights_only.
    from earlywarn.distributed import dcp_checkpoint_fns
    from earlywarn.recover.checkpoint import CheckpointManager
    from earlywarn.recover.snapshot import capture_state, restore_state

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        x, y = local_batch(step, 0)
        nn.functional.mse_loss(model(x.float()), y.float()).backward()
        opt.step()
    saved = local_state(model, opt)
    save_fn, load_fn = dcp_checkpoint_fns(model, opt)
    manager = CheckpointManager(tmp_path / "ckpt", save_fn=save_fn, load_fn=load_fn)
    state = capture_state(2, model=model, optimizer=opt, data={"epoch": 0, "batch_index": 2},
                          extra={"counts": _Stateful({"hist": np.arange(3.0)})})
    path = manager.save(state, 2)
    assert Path(path).is_dir() and (Path(path) / "earlywarn.rank0.pt").exists()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    restored = manager.load(manager.latest())
    restore_state(restored["state"], model=model, optimizer=opt)
    assert same(saved, local_state(model, opt))
    assert restored["state"]["data"] == {"epoch": 0, "batch_index": 2}
    np.testing.assert_array_equal(restored["state"]["extra"]["counts"]["hist"], np.arange(3.0))


class _Stateful:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def one_agreed_rewind(r0: dict[str, Any], r1: dict[str, Any]) -> None:
    """Both ranks rewound at step 6, with the same events and messages (their own samples aside),
    to the default ring's snapshot of step 0."""
    assert r0["rewinds"] == r1["rewinds"] == [6], (r0["events"], r0["rewind_messages"])
    assert r0["events"] == r1["events"]
    assert without_samples(r0["rewind_messages"]) == without_samples(r1["rewind_messages"])
    assert "memory:0" in r0["rewind_messages"][0]


def test_fsdp2_rewind_on_both_ranks_restores_the_same_snapshot(results):
    r0, r1 = get(results, "fsdp_rewind")
    one_agreed_rewind(r0, r1)
    # every rank put its own shards back bit for bit: the whole model is the snapshot's again
    assert r0["restored"] and r1["restored"]
    assert r0["restored_digest"] == r1["restored_digest"] == r0["snap_digest"] == r1["snap_digest"]
    # both loaders skipped the batches drawn since the snapshot (1-6) and go on together
    assert r0["positions"] == r1["positions"]
    assert r0["positions"][6] == {"epoch": 0, "batch_index": 7}
    assert r0["digest"] == r1["digest"] and r0["local_digest"] != r1["local_digest"]  # one model, two shards
    assert r0["finite"] and r1["finite"]
    # capture, snapshot and restore never gather: all-reduces only (the stats vector, the scans)
    for r in (r0, r1):
        assert {op for ops in r["collectives"] for op in ops} == {"c10d.allreduce_.default"}


def one_agreed_repair(r0: dict[str, Any], r1: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """Both ranks saw the same events and the same one repair at step 4, no rewind: the one
    poisoned coordinate of `hidden.weight`'s second moment, counted once over the whole tensor.
    Returns the repair's actions by (key, action)."""
    assert r0["events"] == r1["events"] and r0["reports"] == r1["reports"]
    assert r0["rewinds"] == r1["rewinds"] == []  # a rank-local scan would have made one rank rewind
    assert r0["counters"]["repaired_steps"] == r1["counters"]["repaired_steps"] == 1
    (report,) = r0["reports"]
    assert report["found"]["flags"] == [{"name": "hidden.weight", "key": "exp_avg_sq", "nonfinite": 1, "numel": 256}]
    assert report["ok"] and report["step"] == 4
    done = {(a["key"], a["action"]): a for a in report["repaired"]}
    assert set(done) == {("exp_avg", "zero"), ("exp_avg_sq", "finite_max")}
    return done


def test_fsdp2_state_poisoned_in_one_shard_is_repaired_identically_on_both_ranks(results):
    r0, r1 = get(results, "fsdp_repair")
    done = one_agreed_repair(r0, r1)
    # the largest finite value of the whole tensor, not of rank 1's shard
    assert r1["own_max"] < r0["own_max"] == 5.0
    assert done[("exp_avg_sq", "finite_max")]["value"] == 5.0
    assert r1["v00"] == 5.0 and r1["m00"] == 0.0
    assert r0["v00"] == 5.0 and r0["m00"] == r0["m_before"]  # rank 0's shard had nothing to reset
    assert r0["params_untouched"] and r1["params_untouched"]  # the step was skipped, not applied
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_checkpoint_manager_with_dcp_writes_one_shared_checkpoint(results):
    r0, r1 = get(results, "dcp_manager")
    for rank, r in enumerate((r0, r1)):
        assert r["listing"] == [(4, "clean", "step-0000000004.clean.pt")]  # step 2 pruned, by rank 0 only
        assert r["entries"] == ["step-0000000004.clean.pt"]  # no temp directories left
        assert ".metadata" in r["files"] and {"earlywarn.rank0.pt", "earlywarn.rank1.pt"} <= set(r["files"])
        assert r["moved"] and r["restored"]
        assert r["data"] == {"epoch": 0, "batch_index": rank}


def test_watcher_with_dcp_checkpoints_rewinds_every_rank_from_the_shared_checkpoint(results):
    w0, w1 = (r["watch"] for r in get(results, "dcp_manager"))
    assert w0["rewinds"] == w1["rewinds"] == [7], w0["events"]
    assert "step-0000000006.clean.pt" in w0["messages"][0]
    assert without_samples(w0["messages"]) == without_samples(w1["messages"])
    assert w0["restored"] and w1["restored"]
    assert w0["events"] == w1["events"] and w0["positions"] == w1["positions"]
    # one directory for all ranks (no rank<r>), the checkpoint after the incident abandoned;
    # quarantine lists stay per rank
    assert w0["entries"] == w1["entries"]
    assert not [e for e in w0["entries"] if e.startswith("rank") or e.startswith(".tmp")]
    assert "step-0000000006.clean.pt" in w0["entries"]
    assert {w0["quarantine"], w1["quarantine"]} == {"quarantine.rank0.jsonl", "quarantine.rank1.jsonl"}


def test_default_writer_keeps_one_directory_per_rank_for_sharded_state(results):
    for rank, r in enumerate(get(results, "dcp_manager")):
        r = r["per_rank"]
        assert r["entries"] == ["rank0", "rank1"]
        assert r["files"] == ["step-0000000001.clean.pt"]
        assert r["restored"]  # this rank's shards, read back with weights_only and copied in place


def test_zero1_rewind_on_both_ranks_restores_each_share_of_the_state(results):
    r0, r1 = get(results, "zero_rewind")
    one_agreed_rewind(r0, r1)
    # every rank put its own share of the state back bit for bit, and the one model with it
    assert r0["restored"][0] and r1["restored"][0]
    assert r0["restored"][1] == r1["restored"][1] == r0["snap_digest"] == r1["snap_digest"]
    assert r0["share"] and r1["share"]  # both ranks hold some of the state
    assert r0["positions"] == r1["positions"] and r0["positions"][6] == {"epoch": 0, "batch_index": 7}
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]
    # the snapshot size planned before the first step is of this rank's share (AdamW's two moments of
    # the local optimizer's parameters), not of the whole state: the copy measured at the first
    # snapshot differs only by the per-parameter step counters
    for r in (r0, r1):
        assert r["measured"] != r["estimated"] and abs(r["measured"] - r["estimated"]) <= 0.02 * r["measured"]
    # no consolidation of the state (ZeRO's broadcasts of it): ZeRO's broadcasts of the
    # parameters and earlywarn's all-reduces (the stats vector, the snapshot flags); the bad step
    # (rewound, not applied: no broadcast) alone gathers the state's layout (paths and dtypes)
    for r in (r0, r1):
        calm = {op for step, ops in enumerate(r["collectives"]) if step != 6 for op in ops}
        assert calm == {"c10d.allreduce_.default", "c10d.broadcast_.default"}
        assert set(r["collectives"][6]) == {"c10d.allreduce_.default", "c10d.allgather_.default"}


def test_zero1_state_poisoned_on_its_one_holder_is_repaired_with_one_report_on_every_rank(results):
    r0, r1 = get(results, "zero_repair")
    holder = (r0, r1)[r0["holder"]]
    done = one_agreed_repair(r0, r1)  # one rank holds the tensor: its size counted once on both
    assert done[("exp_avg_sq", "finite_max")]["value"] == holder["max"]
    assert holder["v00"] == holder["max"] and holder["m00"] == 0.0
    assert r0["params_untouched"] and r1["params_untouched"]  # the NaN step was skipped
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_zero1_checkpoint_resumes_each_ranks_share_exactly(results):
    r0, r1 = get(results, "zero_resume")
    assert r0["step"] == r1["step"] == 5
    assert r0["share"] and r1["share"] and r0["share"] + r1["share"] == 3 * 6  # AdamW: step, m, v per parameter
    assert r0["state_equal"] and r1["state_equal"] and r0["params_equal"] and r1["params_equal"]
    assert r0["wrapper_state"] == r1["wrapper_state"] == 0  # no second copy of the share
    assert r0["lr"] == r1["lr"] == [1e-2]
    assert r0["finite"] and r1["finite"]


def test_zero1_stepped_inside_ddps_hook_is_refused_with_the_reason(results):
    for r in get(results, "zero_overlap_refused"):
        assert r["refused"] and "overlap_with_ddp=True" in r["refused"] and "overlap_with_ddp=False" in r["refused"]
