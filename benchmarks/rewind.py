"""Rewind benchmark: steps lost per rewind, batches replayed, and what rewinds and snapshots cost.

    python benchmarks/rewind.py [--steps 300] [--threads 2] [--skip-cost]

Two training loops on a small char-level GPT (examples/tinygpt.py) over real text (the Python
standard library's source), each with earlywarn's defaults (``watch(model, optimizer)``, nothing
else but ``loader=`` in the second):

* ``nanogpt``: written the way nanoGPT's train.py is -- batches drawn with ``torch.randint`` from
  the global RNG, the learning rate computed by the loop from its own ``iter_num`` (warm-up +
  cosine) and written into the param groups, ``clip_grad_norm_(1.0)``, fused AdamW. It follows a
  rewind the documented way: ``iter_num = ew.step`` at the top of the loop.
* ``loader``: ``earlywarn.ResumableLoader`` batches and a ``LambdaLR`` scheduler given to
  ``watch(scheduler=...)``.

Faults, injected once at step ``--fault-step``:

* ``bad_batch``: one sample's embeddings are NaN (its loss is NaN): one skip, nothing rewound;
* ``adam_state``: NaN written into AdamW's ``exp_avg`` of one weight after a step: the next
  update writes NaN into that weight, the loss after it is NaN: a rewind;
* ``lr_spike``: one step at 100x the learning rate (a glitch, not the schedule);
* ``lr_ramp``: the loop's schedule ramps the learning rate up without bound from the fault step
  on (a misconfigured schedule): the instability the ramp brings is rewound once, and then the
  optimizer steps at the highest learning rate the run had survived while the loop's stays above
  it (the LR ceiling; issue 20), never rewinding further back than the first time.

Per run it prints the rewinds (steps lost each = incident step - restored step), the batches
replayed (a batch trained or abandoned before a rewind that is trained again after it -- by the
tokens' hash, or the loader's position), the quarantine file's rows (and any null field), skips,
and how the run ended.

Costs (on the 10.9M-parameter GPT of ``benchmarks/overhead.py``: 6 layers, d=384, batch 8x256,
fused AdamW), all measured side by side in this process:

* snapshot cost per step: the snapshot path (the finiteness scan + the host copy into recycled
  buffers) timed next to a training step in the same round, divided by the cadence (every 25
  steps), as a paired ratio of the step;
* snapshot RAM: what one snapshot holds, and the ring's total under the default budget;
* a rewind (restore in place from host memory) against one optimizer step and one checkpoint
  load (``torch.load(weights_only=True)`` of the same state from disk plus the restore).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import earlywarn  # noqa: E402
from earlywarn.events import Kind  # noqa: E402
from earlywarn.recover import Halt, RecoveryConfig  # noqa: E402
from earlywarn.recover.hostcopy import state_bytes  # noqa: E402
from earlywarn.recover.checkpoint import load_checkpoint  # noqa: E402
from earlywarn.recover.snapshot import restore_state  # noqa: E402
from tinygpt import GPT, CharDataset, GPTConfig, param_count, stdlib_text  # noqa: E402

BLOCK, BATCH, BASE_LR, WARMUP = 64, 16, 2e-3, 20
FAULTS = ("none", "bad_batch", "adam_state", "lr_spike", "lr_ramp")


def small_gpt() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=BLOCK))


def schedule(it: int, total: int, fault: str, fault_step: int) -> float:
    if it < WARMUP:
        lr = BASE_LR * (it + 1) / WARMUP
    else:
        lr = BASE_LR * (0.55 + 0.45 * math.cos(math.pi * min(1.0, (it - WARMUP) / max(1, total - WARMUP))))
    if fault == "lr_ramp" and it >= fault_step:
        lr *= 1.1 ** (it - fault_step)  # the loop's own schedule, ramping without bound
    return lr


def tokens_hash(x: torch.Tensor) -> str:
    return hashlib.blake2b(x.numpy().tobytes(), digest_size=8).hexdigest()


@dataclass
class Result:
    loop: str
    fault: str
    rewinds: list[tuple[int, int, int]] = field(default_factory=list)  # (incident, restored, lost)
    skipped: int = 0
    replayed: int = 0
    abandoned: int = 0
    quarantine_rows: int = 0
    null_fields: int = 0
    halt: str | None = None
    steps: int = 0
    final_loss: float = math.nan
    finite: bool = True
    events: list = field(default_factory=list)


class Injector:
    """One-shot faults, fired by the loop at the fault step (a glitch happens once)."""

    def __init__(self, model: GPT, opt: torch.optim.Optimizer, fault: str, at: int):
        self.fault, self.at, self.fired, self.model, self.opt = fault, at, False, model, opt
        self._nan_sample = False
        model.wte.register_forward_hook(self._embed_hook)

    def _embed_hook(self, module, args, out):
        if self._nan_sample:
            self._nan_sample = False
            out = out.clone()
            out[0] = float("nan")  # one corrupt sample in the batch
            return out
        return None

    def before_forward(self, it: int) -> None:
        if self.fault == "bad_batch" and it == self.at and not self.fired:
            self.fired = self._nan_sample = True

    def lr_scale(self, it: int) -> float:
        if self.fault == "lr_spike" and it == self.at and not self.fired:
            self.fired = True
            return 100.0
        return 1.0

    def after_step(self, it: int) -> None:
        if self.fault == "adam_state" and it == self.at and not self.fired:
            self.fired = True
            w = self.model.blocks[0].attn.weight
            self.opt.state[w]["exp_avg"].fill_(float("nan"))


def _track(res: Result, ew, drawn: dict[int, str], abandoned: set[str]) -> None:
    """On a rewind: what was drawn for the steps it threw away may never come back."""
    def on_rewind(report) -> None:
        res.rewinds.append((report.incident_step, report.restored_step, report.lost_steps))
        for s in [s for s in drawn if s > report.restored_step]:
            abandoned.add(drawn.pop(s))
    ew.on_rewind(on_rewind)


def _finish(res: Result, ew, model, qpath: str) -> Result:
    res.events = list(ew.events)
    res.skipped = ew.counters["skipped_steps"]
    res.steps = ew.step
    res.finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if os.path.exists(qpath):
        import json
        rows = [json.loads(line) for line in open(qpath, encoding="utf-8")]
        res.quarantine_rows = len(rows)
        res.null_fields = sum(v is None for r in rows for v in r.values())
    return res


def run_nanogpt(fault: str, steps: int, fault_step: int, data: torch.Tensor, tmp: str) -> Result:
    torch.manual_seed(1337)
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    qpath = os.path.join(tmp, f"q-nanogpt-{fault}.jsonl")
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(quarantine_path=qpath))
    res = Result("nanogpt", fault)
    inj = Injector(model, opt, fault, fault_step)
    drawn: dict[int, str] = {}
    abandoned: set[str] = set()
    _track(res, ew, drawn, abandoned)

    def get_batch():
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))  # the global RNG draws the batch, as in nanoGPT
        x = torch.stack([data[i:i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
        return x, y

    iter_num = 0
    try:
        while iter_num < steps:
            iter_num = ew.step  # follows a rewind: the schedule goes back with the model
            lr = schedule(iter_num, steps, fault, fault_step) * inj.lr_scale(iter_num)
            for g in opt.param_groups:
                g["lr"] = lr
            X, Y = get_batch()
            h = tokens_hash(X)
            res.replayed += h in abandoned
            drawn[iter_num] = h
            inj.before_forward(iter_num)
            _, loss = model(X, Y)
            ew.report_loss(loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            inj.after_step(iter_num)
            if iter_num % 10 == 0:
                res.final_loss = loss.item()
            iter_num += 1
    except Halt as e:
        res.halt = str(e)
    res.abandoned = len(abandoned)
    out = _finish(res, ew, model, qpath)
    ew.close()
    return out


def run_loader(fault: str, steps: int, fault_step: int, dataset: CharDataset, tmp: str) -> Result:
    torch.manual_seed(1337)
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    loader = earlywarn.ResumableLoader(dataset, BATCH, shuffle=True, seed=0)
    ramp = {"on": fault == "lr_ramp"}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda it: schedule(it, steps, fault if ramp["on"] else "none", fault_step) / BASE_LR)
    qpath = os.path.join(tmp, f"q-loader-{fault}.jsonl")
    ew = earlywarn.watch(model, opt, loader=loader, scheduler=sched, sinks=[],
                         recovery=RecoveryConfig(quarantine_path=qpath))
    res = Result("loader", fault)
    inj = Injector(model, opt, fault, fault_step)
    drawn: dict[int, str] = {}
    abandoned: set[str] = set()
    _track(res, ew, drawn, abandoned)
    try:
        while ew.step < steps:
            for x, y in loader:
                it = ew.step
                if it >= steps:
                    break
                ref = loader.last_batch
                key = f"{ref.epoch}:{ref.batch_index}"
                res.replayed += key in abandoned
                drawn[it] = key
                scale = inj.lr_scale(it)
                if scale != 1.0:
                    for g in opt.param_groups:
                        g["lr"] *= scale
                inj.before_forward(it)
                _, loss = model(x, y)
                ew.report_loss(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if scale != 1.0 and ew.step == it + 1:  # the spiked step went through: back to the schedule
                    for g in opt.param_groups:
                        g["lr"] /= scale
                sched.step()
                inj.after_step(it)
                if it % 10 == 0:
                    res.final_loss = loss.item()
    except Halt as e:
        res.halt = str(e)
    res.abandoned = len(abandoned)
    out = _finish(res, ew, model, qpath)
    ew.close()
    return out


# --------------------------------------------------------------------------------------------
# Costs on the 10.9M-parameter GPT


def big_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt


def costs(rounds: int) -> None:
    from earlywarn.recover import Recovery

    model, opt = big_gpt()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (8, 256), generator=g)
    y = torch.randint(0, 128, (8, 256), generator=g)
    tmp = tempfile.mkdtemp(prefix="ew-rewind-bench-")
    # the recovery layer the watcher drives, driven here directly: its snapshot and rewind paths
    # are timed on their own, beside a training step
    rec = Recovery(model, opt, RecoveryConfig(quarantine_path=os.path.join(tmp, "q.jsonl")))
    clock = [0]

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0, time.perf_counter() - t1

    def snapshot_path() -> float:
        # what after_step does when a snapshot is due: the host copy into the buffers of the
        # snapshot it recycles, the device finiteness flag, keeping it in the ring
        clock[0] += 1
        rec.snapshots.last_snapshot = None  # due now
        t0 = time.perf_counter()
        rec.after_step(clock[0], clean=True)
        rec.settle()
        return time.perf_counter() - t0

    for _ in range(2):  # warm-up: AdamW's state exists
        step()
    every = rec.config.every
    for _ in range(rec.ring.keep + 2):  # fill the ring: from now on every snapshot recycles buffers
        snapshot_path()
    step_t, snap_t, opt_t, ratios = [], [], [], []
    for r in range(rounds):
        pair = [("step", step), ("snap", snapshot_path)]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]):
            v = fn()
            if name == "step":
                step_t.append(v[0])
                opt_t.append(v[1])
            else:
                snap_t.append(v)
        ratios.append(1.0 + (snap_t[-1] / every) / step_t[-1])
    one = rec.ring.latest().nbytes
    slots = rec.ring.keep + rec.ring.keep_unclean
    print(f"\ncosts on the {param_count(model) / 1e6:.1f}M-parameter GPT (batch 8 x 256, fused AdamW, "
          f"{torch.get_num_threads()} threads), {rounds} paired rounds (median):")
    print(f"  training step                    {statistics.median(step_t) * 1e3:9.1f} ms")
    print(f"  snapshot (copy into recycled buffers + finiteness flag) {statistics.median(snap_t) * 1e3:7.1f} ms, "
          f"every {every} steps -> {statistics.median(snap_t) / every * 1e3:.2f} ms/step")
    print(f"  snapshot cost per step, paired   {statistics.median(ratios):9.4f}x of the step (target <= 1.01x)")
    print(f"  snapshot RAM                     {one / 1e6:9.1f} MB each (model {state_bytes(model.state_dict()) / 1e6:.1f} MB "
          f"+ AdamW state), ring of {slots} -> {slots * one / 1e6:.0f} MB")
    print(f"  plan reported at watch():        {rec.plan}")

    # a rewind (in memory) vs one optimizer step vs one checkpoint load of the same state
    from earlywarn.recover.checkpoint import CheckpointManager
    mgr = CheckpointManager(os.path.join(tmp, "ckpt"), keep=1)
    path = mgr.save(rec.ring.latest().host, clock[0], clean=True, reason="bench")
    mgr.wait()
    scanned, finite, load_t = [], [], []
    for r in range(max(3, rounds // 2)):
        for kind in ("scan", "finite", "load"):
            step()  # the state moves on from the snapshot; then it is put back
            t0 = time.perf_counter()
            if kind == "load":
                payload = load_checkpoint(path)
                restore_state(payload["state"], model=model, optimizer=opt)
            else:
                clock[0] += 1
                rec.rewind(clock[0], "benchmark", known_finite=kind == "finite")
                rec.recurrence.episode = None  # each timed rewind is a first one (not a recurrence)
            (load_t if kind == "load" else scanned if kind == "scan" else finite).append(time.perf_counter() - t0)
            snapshot_path()
    ld, st = statistics.median(load_t), statistics.median(opt_t)
    for label, ts in (("a NaN incident (the state scan included)", scanned), ("a divergence (finite: no scan)", finite)):
        rw = statistics.median(ts)
        print(f"  rewind in memory, {label:42s} {rw * 1e3:7.1f} ms = {rw / st:5.2f}x one optimizer step "
              f"({st * 1e3:.1f} ms), {rw / ld:.2f}x one checkpoint load ({ld * 1e3:.1f} ms; target <= 1x)")
    print("  (checkpoint load: torch.load(weights_only=True) of the same state from the page cache + the restore)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fault-step", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the fault runs")
    ap.add_argument("--cost-threads", type=int, default=2, help="torch threads for the 10.9M GPT costs")
    ap.add_argument("--verbose", action="store_true", help="print the rewind, quarantine and halt events")
    ap.add_argument("--rounds", type=int, default=10, help="paired rounds for the cost measurements")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--faults", default=",".join(FAULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import warnings
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    # LambdaLR notices that watch() replaced optimizer.step after the scheduler was made; harmless here
    warnings.filterwarnings("ignore", message=".*optimizer.step\(\)` has been overridden.*")

    text = stdlib_text(600_000)
    dataset = CharDataset(text, block_size=BLOCK)
    data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
    tmp = tempfile.mkdtemp(prefix="ew-rewind-")
    print(f"tiny GPT {param_count(small_gpt()) / 1e6:.2f}M params, batch {BATCH} x {BLOCK}, {args.steps} steps, "
          f"fault at step {args.fault_step}; earlywarn defaults (RecoveryConfig(): max_lost_steps=50)")
    print(f"{'loop':8s} {'fault':10s} {'rewinds (incident->restored: lost)':40s} {'max lost':>8s} {'replayed':>8s} "
          f"{'skips':>5s} {'q rows':>6s} {'nulls':>5s}  end")
    worst = 0
    for fault in args.faults.split(","):
        for loop in ("nanogpt", "loader"):
            t0 = time.perf_counter()
            r = (run_nanogpt(fault, args.steps, args.fault_step, data, tmp) if loop == "nanogpt"
                 else run_loader(fault, args.steps, args.fault_step, dataset, tmp))
            rw = ", ".join(f"{i}->{s}: {lost}" for i, s, lost in r.rewinds) or "-"
            lost = max((x[2] for x in r.rewinds), default=0)
            worst = max(worst, lost)
            end = (f"Halt: {r.halt}" if r.halt else
                   f"finished step {r.steps}, loss {r.final_loss:.3f}, params finite: {r.finite}")
            print(f"{loop:8s} {fault:10s} {rw:40s} {lost:8d} {r.replayed:8d} {r.skipped:5d} "
                  f"{r.quarantine_rows:6d} {r.null_fields:5d}  {end}  [{time.perf_counter() - t0:.0f} s]")
            if args.verbose:
                for e in r.events:
                    if e.kind in (Kind.REWIND, Kind.QUARANTINE, Kind.SKIP, Kind.HALT, Kind.REPAIR) or e.level >= 3:
                        print(f"    {e}")
    print(f"worst steps lost per rewind: {worst} (target <= 50)")
    if not args.skip_cost:
        torch.set_num_threads(args.cost_threads)
        costs(args.rounds)


if __name__ == "__main__":
    main()
