"""A control for the rescue benchmark's "left worse": how far an innocuous touch moves a healthy run.

    PYTHONPATH=$PWD python benchmarks/rescue_jitter.py --families heavy_reward [--at 20] [--eps 1e-3]

Runs each config of the families (seed bases 0, 23, 61, 307, 89, 137) bare and "jitter" -- bare
with every gradient of one step (``--at``) scaled by ``1 + eps`` -- and prints each run's kept
(the jitter's progress over bare's) and how many ``rescue.healthy_harm`` calls worse. A family
whose runs move far under such a touch is chaotic, and "worse" there says little; one whose runs
do not is one where a run earlywarn leaves worse was harmed. Not cached (the runs are short).
"""

from __future__ import annotations

import argparse
import os
import sys
from multiprocessing import Pool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rescue  # noqa: E402
import rescue_harness  # noqa: E402
import rescue_peers  # noqa: E402
from rescue_families import all_configs  # noqa: E402

BASES = (0, 23, 61, 307, 89, 137)


class Jitter(rescue_peers.Method):
    """Bare, but every gradient of step ``at`` scaled by ``1 + eps`` before its update."""

    name = "jitter"
    at, eps = 20, 1e-3

    def attach(self, task, opts, scheds):
        super().attach(task, opts, scheds)
        self.i = 0

    def step(self, k):
        if self.i == self.at:
            for p in self.task.params(k):
                if p.grad is not None:
                    p.grad.mul_(1.0 + self.eps)
        self.i += 1
        self.opts[k].step()


def _register(at: int, eps: float) -> None:
    Jitter.at, Jitter.eps = at, eps
    rescue_peers._CLASSES["jitter"] = Jitter


def _work(job):
    config, method, at, eps = job
    _register(at, eps)
    return config["id"], method, rescue_harness.run_one(config, method)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="heavy_reward")
    ap.add_argument("--at", type=int, default=20)
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    configs = [c for b in BASES for c in all_configs(b, args.families.split(","))]
    jobs = [(c, m, args.at, args.eps) for c in configs for m in ("bare", "jitter")]
    with Pool(args.jobs) as pool:
        results = {(cid, m): r for cid, m, r in pool.map(_work, jobs)}
    worse = 0
    for c in configs:
        bare, jit = results[(c["id"], "bare")], results[(c["id"], "jitter")]
        worse += rescue.healthy_harm(jit, bare)["worse"]
        print(f"{c['id']:28s} kept {rescue.kept(jit['E0'], jit['E'], bare['E']):.3f}  (bare's progress "
              f"{bare['E0'] - bare['E']:.4g})")
    print(f"jitter (step {args.at} x {1 + args.eps:g}): {worse} of {len(configs)} left worse")


if __name__ == "__main__":
    main()
