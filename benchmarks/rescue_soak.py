"""The rescue benchmark's soak: 20,000 steps of an MLP at its Adam floor, a one-off x6 gradient
every 50 steps, bare and with earlywarn (defaults, plus a sink that records every
``log_metrics`` call).

    PYTHONPATH=$PWD python benchmarks/rescue.py --soak [--soak-steps 20000]

Reports, for earlywarn: halted (and where), rewinds, skips, the steps logged, gaps, duplicates
and steps out of order on the run's clock; for both: the final eval loss.
"""

from __future__ import annotations

import argparse
import time

import torch

from rescue_tasks import Regression

CONFIG = {"name": "regression", "d_in": 16, "width": 64, "depth": 2, "act": "relu", "batch": 32, "noise": 0.05}
SEED, SPIKE_EVERY, SPIKE_FACTOR, LR = 7, 50, 6.0, 1e-3


def make_recorder():
    from earlywarn.sinks.base import Sink

    class StepRecorder(Sink):
        """Records the step of every ``log_metrics`` call, in order."""

        name = "step_recorder"

        def __init__(self) -> None:
            self.steps: list[int] = []

        def log_metrics(self, step, metrics) -> None:
            self.steps.append(int(step))

    return StepRecorder()


def soak(steps: int, with_earlywarn: bool) -> dict:
    import earlywarn

    torch.set_num_threads(1)
    task = Regression(CONFIG, SEED)
    model = task.models[0]
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    recorder = make_recorder() if with_earlywarn else None
    ew = earlywarn.watch(model, opt, sinks=[recorder]) if with_earlywarn else None
    out = {"method": "earlywarn" if ew else "bare", "halted": None, "E0": task.evaluate()}
    t0 = time.perf_counter()
    tail: list[float] = []
    it = 0
    try:
        for it in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = task.loss(0, task.batch(it, 0))
            loss.backward()
            if ew:
                ew.report_loss(loss)
            if it % SPIKE_EVERY == SPIKE_EVERY // 2:  # a one-off outlier gradient
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.mul_(SPIKE_FACTOR)
            opt.step()
            if it >= steps - 500:
                tail.append(loss.item())
    except earlywarn.Halt as exc:
        out["halted"] = f"step {it}: {exc}"
    if ew:
        ew.close()
        out["counters"] = dict(ew.counters)
        logged = recorder.steps
        distinct = sorted(set(logged))
        out["steps_logged"] = len(logged)
        out["duplicates"] = len(logged) - len(distinct)
        out["out_of_order"] = sum(b <= a for a, b in zip(logged, logged[1:]))
        out["gaps"] = sum(b - a - 1 for a, b in zip(distinct, distinct[1:]) if b - a > 1)
        out["first_last_logged"] = (logged[0], logged[-1]) if logged else None
        out["events_warning_or_worse"] = [f"{e.step} {e.kind}/{e.level}: {e.message[:200]}"
                                          for e in ew.events if int(e.level) >= 2][:10]
    out["steps_run"] = it + 1
    out["E"] = task.evaluate()
    out["train_loss_last_500"] = sum(tail) / len(tail) if tail else float("nan")
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="rescue benchmark soak")
    ap.add_argument("--soak-steps", type=int, default=20_000)
    args, _ = ap.parse_known_args(argv)
    bare = soak(args.soak_steps, False)
    ew = soak(args.soak_steps, True)
    print(f"soak: {args.soak_steps} steps, MLP {CONFIG}, Adam lr {LR}, x{SPIKE_FACTOR:g} gradient every {SPIKE_EVERY} steps")
    for r in (bare, ew):
        print(f"  {r['method']:9s} halted: {r['halted'] or 'no'}; steps run {r['steps_run']}; eval E0 {r['E0']:.4f} -> "
              f"E {r['E']:.4f}; train loss (last 500) {r['train_loss_last_500']:.4f}; wall {r['wall_s']} s")
    c = ew.get("counters", {})
    print(f"  earlywarn: rewinds {c.get('rewinds')}, skipped {c.get('skipped_steps')}, alerts "
          f"info/warning/critical {c.get('alerts_info')}/{c.get('alerts_warning')}/{c.get('alerts_critical')}")
    print(f"  earlywarn logging: {ew['steps_logged']} log_metrics calls for {ew['steps_run']} steps, first/last "
          f"{ew['first_last_logged']}, gaps {ew['gaps']}, duplicates {ew['duplicates']}, out of order {ew['out_of_order']}")
    for line in ew["events_warning_or_worse"]:
        print(f"    {line}")
