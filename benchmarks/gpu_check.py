"""The GPU check of the gradient guard: no host sync on its hot path, the right numbers, and what it costs.

    python benchmarks/gpu_check.py [--steps 40] [--batch 8] [--seq 1024]
    python benchmarks/gpu_check.py --cpu-smoke      # the same code on a tiny model, on the CPU

One prepared script for a session that is lent a GPU (a few minutes of device time), runnable
from the repository root as written (no PYTHONPATH, no install needed). GPT-2 small (12 layers,
d=768, vocab 50304, seq 1024) in bf16 autocast with fused AdamW; earlywarn in its default mode
for that setup (``auto`` -> ``async``: each step's per-layer norms go to pinned host memory with
a non-blocking copy, polled with ``event.query()``; the fused optimizer skips a non-finite step on
the device), with ``snapshot_every=5`` so that snapshots (side-stream copies, a device
finiteness flag read a step later) happen inside the checked regions.

1. Overhead, ABBA: rounds of bare, earlywarn, earlywarn, bare, each step timed with CUDA events
   and every one -- the bare control too -- under ``torch.cuda.set_sync_debug_mode("error")``: a
   host sync raises. Paired ratio = median over rounds of (e1 + e2) / (b1 + b2).
2. Free-running: ``--steps`` guarded steps back to back (no synchronize: the host runs ahead),
   again under "error", with an unused-parameter step (its gradient dropped) in the middle.
   Afterwards every norm the detector saw is compared with one computed on the device at that
   step, and the newest snapshot's parameters with the parameters at its step: a copy read
   before it landed, or taken after the next update, shows here.
3. One inf gradient, with a synchronize after every step (outside the checked region): the
   weight is unchanged by that step, and the counters move exactly one step late.
4. With two GPUs: a model split over cuda:1 and cuda:0 (the current device), so that the
   statistics live on a device that is not the current one; the same checks as 2 and 3.

Blocking waits on device events (``event.synchronize()``, which sync-debug mode cannot see) are
counted and timed by earlywarn (``earlywarn.capture.hostread.HOST_WAITS``) and printed for each
part; a check that had to wait says so. Without CUDA (and without ``--cpu-smoke``) it says so
and exits 0. ``--cpu-smoke`` runs parts 1-3 on a tiny model with ``mode="async"`` forced (the
CPU copy is done when it returns, so the reader is exactly one step late there too); nothing
about syncs is checked on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "examples")]  # runnable from a bare checkout

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import earlywarn  # noqa: E402
from earlywarn.capture.hostread import HOST_WAITS  # noqa: E402
from tinygpt import GPT, GPTConfig, param_count  # noqa: E402

FAILURES: list[str] = []


def check(ok: bool, what: str) -> bool:
    print(f"  [{'ok' if ok else 'FAILED'}] {what}")
    if not ok:
        FAILURES.append(what)
    return ok


@contextlib.contextmanager
def no_sync(cuda: bool):
    """A host sync inside raises (CUDA only)."""
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)


class Waits:
    def __init__(self) -> None:
        self.n0, self.s0 = HOST_WAITS.snapshot()

    def __str__(self) -> str:
        n, s = HOST_WAITS.snapshot()
        return f"{n - self.n0} blocking event waits ({1e3 * (s - self.s0):.2f} ms)"

    @property
    def count(self) -> int:
        return HOST_WAITS.snapshot()[0] - self.n0


def grad_norm_on_device(model: nn.Module) -> torch.Tensor:
    # The reference, with no host read: float64 per tensor, summed on the first parameter's device.
    dev = next(model.parameters()).device
    sq = [p.grad.double().norm().square().to(dev) for p in model.parameters() if p.grad is not None]
    return torch.stack(sq).sum().sqrt()


def param_sum(tensors) -> torch.Tensor:
    # sum of squares: positive and large, so one missed or extra update shows far above rounding
    ts = list(tensors)
    dev = ts[0].device
    return torch.stack([t.detach().double().square().sum().to(dev) for t in ts]).sum()


class Split(nn.Module):
    """A small residual MLP stack split over two devices (the first half on ``first``)."""

    def __init__(self, width: int, depth: int, first: torch.device, second: torch.device):
        super().__init__()
        self.devs = (first, second)
        self.a = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(first)
        self.b = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x.to(self.devs[0]))
        return self.b(torch.tanh(x).to(self.devs[1])).square().mean()


def watch(model: nn.Module, opt: torch.optim.Optimizer, cuda: bool) -> "earlywarn.Watcher":
    ew = earlywarn.watch(model, opt, sinks=[], mode="auto" if cuda else "async",
                         recovery=earlywarn.RecoveryConfig(snapshot_every=5, clean_window=3))
    seen: dict[int, float] = {}
    log_rows = ew.telemetry.log_rows

    def rows(rs: list) -> None:  # every step's row, a calm step's folded in later: what the detector saw
        seen.update((r[0], r[1]) for r in rs)
        log_rows(rs)

    ew.telemetry.log_rows = rows
    ew._seen = seen  # type: ignore[attr-defined]
    return ew


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, no sync check")
    a = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        print("no CUDA device here: nothing to check (use --cpu-smoke to exercise the script)")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        cfg = GPTConfig(vocab_size=50304, block_size=a.seq, n_layer=12, n_head=12, n_embd=768)
        amp = dict(device_type="cuda", dtype=torch.bfloat16)
        print(f"device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}")
    else:
        a.seq, a.batch, a.steps, a.rounds, a.warmup = 32, 2, min(a.steps, 12), min(a.rounds, 3), 2
        cfg = GPTConfig(vocab_size=64, block_size=a.seq, n_layer=2, n_head=2, n_embd=16)
        amp = dict(device_type="cpu", enabled=False)  # float32: bf16 autocast is slow on a small CPU
        print(f"CPU smoke run, torch {torch.__version__}: sync checks off, mode='async' forced")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def make():
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)

    bare_model, bare_opt = make()
    ew_model, ew_opt = make()
    ew = watch(ew_model, ew_opt, cuda)
    print(f"model: {param_count(bare_model) / 1e6:.1f}M params, batch {a.batch} x {a.seq}, fused AdamW, "
          f"{'bf16 autocast' if cuda else 'float32'}; earlywarn mode: {ew.mode}, snapshot_every=5"
          + ("" if cuda else "; CPU timings below mean nothing (a tiny model on a shared host)"))
    check(ew.mode == "async", "earlywarn chose async mode")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev)

    def step(model, opt, guarded: bool, *, drop: nn.Parameter | None = None, fault: nn.Parameter | None = None) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(**amp):
            _, loss = model(x, y)
        if guarded:
            ew.report_loss(loss)  # stays on the device
        loss.backward()
        if drop is not None:
            drop.grad = None  # an unused parameter this step: the guard re-plans its statistics
        if fault is not None:
            fault.grad[0, 0] = math.inf
        opt.step()

    for _ in range(a.warmup):  # kernels, allocator, the first snapshot, the optimizer state
        step(bare_model, bare_opt, False)
        step(ew_model, ew_opt, True)
    sync()

    def timed(model, opt, guarded: bool) -> float:
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(model, opt, guarded)
            e1.record()
            return (e0, e1)  # type: ignore[return-value]
        t0 = time.perf_counter()
        step(model, opt, guarded)
        return 1e3 * (time.perf_counter() - t0)

    def ms(t) -> float:
        return t[0].elapsed_time(t[1]) if cuda else t

    # -- 1. overhead, ABBA, everything under sync-debug "error" (the bare step is the control)
    print("1. overhead: rounds of bare, earlywarn, earlywarn, bare, all under set_sync_debug_mode('error')")
    waits = Waits()
    rounds, control_ok, guard_ok = [], True, True
    for _ in range(a.rounds):
        times = []
        for guarded in (False, True, True, False):
            try:
                with no_sync(cuda):
                    times.append(timed(ew_model if guarded else bare_model, ew_opt if guarded else bare_opt, guarded))
            except RuntimeError as e:
                if guarded:
                    guard_ok = False
                else:
                    control_ok = False
                print(f"   sync raised in the {'guarded' if guarded else 'bare'} step: {str(e)[:200]}")
                times.append(None)
        sync()
        if None not in times:
            b1, e1, e2, b2 = (ms(t) for t in times)
            rounds.append((b1 + b2, e1 + e2))
    unchecked = "" if cuda else " [not checked on the CPU]"
    check(control_ok, f"bare step (control) ran without a host sync{unchecked}")
    check(guard_ok, f"earlywarn step ran without a host sync, snapshots included{unchecked}")
    if rounds:
        bare = statistics.median(b for b, _ in rounds) / 2
        guarded = statistics.median(e for _, e in rounds) / 2
        ratio = statistics.median(e / b for b, e in rounds)
        print(f"   bare step      {bare:8.2f} ms  (median of {len(rounds)} rounds)")
        print(f"   earlywarn step {guarded:8.2f} ms  -> paired {ratio:.4f}x (median of per-round (e1+e2)/(b1+b2))")
    print(f"   {waits}")

    # -- 2. free-running, with an unused-parameter step; then the numbers are checked
    print(f"2. {a.steps} guarded steps back to back (no synchronize), one with an unused parameter, under 'error'")
    waits = Waits()
    refs: dict[int, torch.Tensor] = {}
    sums: dict[int, torch.Tensor] = {}
    drop = ew_model.blocks[0].attn.bias
    ok = True
    try:
        with no_sync(cuda):
            for i in range(a.steps):
                s = ew.step
                step(ew_model, ew_opt, True, drop=drop if i == a.steps // 2 else None)
                refs[s] = grad_norm_on_device(ew_model)
                sums[s] = param_sum(ew_model.parameters())
    except RuntimeError as e:
        ok = False
        print(f"   sync raised: {str(e)[:300]}")
    check(ok, "no host sync in free-running steps (unused-parameter step and snapshots included)"
          + ("" if cuda else " [not checked on the CPU]"))
    print(f"   {waits} while free-running")
    ew.flush()
    sync()
    seen = ew._seen
    errs = [abs(seen[s] - float(r)) / float(r) for s, r in refs.items() if s in seen]
    check(len(errs) == len(refs) and max(errs) < 1e-5,
          f"every norm the detector saw matches the device's at that step ({len(errs)}/{len(refs)}, "
          f"max rel. error {max(errs) if errs else float('nan'):.1e})")
    snap = ew.recovery.ring.latest()
    if snap is not None and snap.step in sums:
        names = [n for n, _ in ew_model.named_parameters()]
        host = param_sum(snap.state["model"][n] for n in names)
        rel = abs(float(host) - float(sums[snap.step])) / abs(float(sums[snap.step]))
        check(rel < 1e-12, f"snapshot of step {snap.step} holds the parameters of step {snap.step} (rel. diff {rel:.1e})")
    else:
        check(False, f"a snapshot from the free-running steps is in the ring (newest: {snap.step if snap else None})")

    # -- 3. one inf gradient: skipped on the device, counted exactly one step late
    print("3. one inf gradient; a synchronize after each step (outside the checked region)")
    weight = ew_model.blocks[len(ew_model.blocks) // 2].fc.weight
    late_check(ew, lambda fault: step(ew_model, ew_opt, True, fault=weight if fault else None), weight, cuda, sync)
    ew.close()

    # -- 4. two devices, statistics on the one that is not current
    if cuda and torch.cuda.device_count() >= 2:
        print("4. a model split over cuda:1 and cuda:0 (current: cuda:0), statistics gathered on cuda:1")
        torch.cuda.set_device(0)
        torch.manual_seed(0)
        split = Split(1024, 4, torch.device("cuda", 1), torch.device("cuda", 0))
        sopt = torch.optim.AdamW(split.parameters(), lr=1e-3, fused=True)
        sew = watch(split, sopt, cuda)
        check(sew.mode == "async" and sew.statistics.stats.device == torch.device("cuda", 1), f"async, statistics on {sew.statistics.stats.device}")
        xs = torch.randn(256, 1024, device="cuda:1")

        def split_step(fault: bool = False) -> None:
            sopt.zero_grad(set_to_none=True)
            loss = split(xs)
            sew.report_loss(loss)
            loss.backward()
            if fault:
                split.b[0].weight.grad[0, 0] = math.inf
            sopt.step()

        for _ in range(a.warmup):
            split_step()
        sync()
        refs = {}
        waits = Waits()
        ok = True
        try:
            with no_sync(cuda):
                for _ in range(a.steps):
                    s = sew.step
                    split_step()
                    refs[s] = grad_norm_on_device(split)
        except RuntimeError as e:
            ok = False
            print(f"   sync raised: {str(e)[:300]}")
        check(ok, "no host sync with two devices")
        print(f"   {waits} while free-running")
        sew.flush()
        sync()
        seen = sew._seen
        errs = [abs(seen[s] - float(r)) / float(r) for s, r in refs.items() if s in seen]
        check(len(errs) == len(refs) and max(errs) < 1e-5, f"two devices: every norm matches ({len(errs)}/{len(refs)})")
        late_check(sew, split_step, split.b[0].weight, cuda, sync)
        sew.close()
    elif cuda:
        print("4. two devices: skipped (one GPU here)")
    else:
        print("4. two devices: skipped (CPU smoke run)")

    print("OK" if not FAILURES else f"FAILED: {len(FAILURES)} check(s): " + "; ".join(FAILURES))
    return 0 if not FAILURES else 1


def late_check(ew, run_step, weight: nn.Parameter, cuda: bool, sync) -> None:
    waits = Waits()
    c0 = dict(ew.counters)
    before = weight.detach().clone()
    with no_sync(cuda):
        run_step(True)
    sync()
    unchanged = torch.equal(before, weight.detach())
    c1 = dict(ew.counters)
    with no_sync(cuda):
        run_step(False)
    sync()
    c2 = dict(ew.counters)
    with no_sync(cuda):
        run_step(False)
    sync()
    c3 = dict(ew.counters)
    check(unchanged, f"weight unchanged by that step: {unchanged}")
    moved = [c[k] - c0[k] for c in (c1, c2, c3) for k in ("skipped_steps",)]
    check(moved == [0, 1, 1] and c2["nonfinite_steps"] - c0["nonfinite_steps"] == 1,
          f"counters move exactly one step late: skipped_steps +{moved} after the fault step and the two after it")
    print(f"   {waits}; counters now: skipped_steps={c3['skipped_steps']}, nonfinite_steps={c3['nonfinite_steps']}, "
          f"alerts_critical={c3['alerts_critical']}")


if __name__ == "__main__":
    raise SystemExit(main())
