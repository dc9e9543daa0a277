"""Detector speed: replay 100,000 steps x 50 layers through the live code path, on one core.

The run is synthetic but not trivially calm: log-normal noise on every layer, the loss falling,
isolated spikes every ~500 steps, a three-step escalation, a non-finite step and a layer that is
zero for a while, so the general (masked) path is exercised as well as the calm one. Every step
carries its learning rate (a warm-up, then a cosine), as the live guard hands it. Observations
are built before the clock starts (that is the caller's cost, live or offline). Reports wall and
CPU time (the CPU time is the honest figure on a shared machine) and checks that memory does not
grow with the number of steps.

Usage: ``python benchmarks/detector_speed.py [--steps 100000] [--layers 50]``

``--against DIR`` (another checkout's root, e.g. ``git worktree add /tmp/main main``) times instead
this tree and that one interleaved in one process (ABBA rounds: a shared machine drifts), with
this tree against a copy of itself as the noise floor: the live cost of one calm step
(``StreamingDetector.observe``, a 50-layer guard observation with its LR), and ``observe`` /
``observe_columns`` over the synthetic run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from earlywarn.detect import Detector, Observation, StepColumns, StreamingDetector  # noqa: E402
from earlywarn.events import Level  # noqa: E402


def synthetic_columns(steps: int, layers: int, seed: int = 0) -> StepColumns:
    """The run replayed here (and pinned by ``tests/detector_golden.py``): spikes, an escalation,
    a non-finite step, a zero layer, an LR warm-up and cosine."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-3, 1, layers))
    lay = scale * np.exp(rng.normal(0, 0.1, (steps, layers)))
    spikes = rng.choice(np.arange(1000, steps - 10), size=max(1, steps // 500), replace=False)
    lay[spikes] *= rng.uniform(3, 8, (len(spikes), 1))
    esc = steps // 2
    for j, f in enumerate((3.0, 9.0, 30.0)):
        lay[esc + j] *= f
    lay[esc + 10, 3] = np.nan
    lay[steps // 3: steps // 3 + 200, 7] = 0.0
    g = np.sqrt(np.nansum(lay ** 2, axis=1))
    g[esc + 10] = np.nan
    loss = 3.0 * np.exp(-np.linspace(0, 0.5, steps) + rng.normal(0, 0.01, steps))
    return StepColumns(step=np.arange(steps), grad_norm=g, loss=loss, layer_norms=lay,
                       extras={"lr": (learning_rates(steps), None)})


def synthetic(steps: int, layers: int, seed: int = 0) -> list[Observation]:
    cols = synthetic_columns(steps, layers, seed)
    return [cols.observation(i) for i in range(steps)]


def learning_rates(steps: int) -> np.ndarray:
    t = np.arange(steps)
    return np.where(t < 2000, 3e-4 * (t + 1) / 2000, 3e-5 + 2.7e-4 * 0.5 * (1 + np.cos(np.pi * t / steps)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timed replays")
    ap.add_argument("--against", type=Path, help="another checkout's root: time both, paired")
    ap.add_argument("--rounds", type=int, default=20, help="--against: ABBA rounds")
    a = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    if a.against is not None:
        return paired_live_step(a.against, a.rounds, a.layers)
    names = [f"layer{i}" for i in range(a.layers)]
    t0 = time.perf_counter()
    obs = synthetic(a.steps, a.layers)
    t_build = time.perf_counter() - t0

    # how fast is this core right now? (shared / oversubscribed machines vary 2-3x): a numpy add
    # of one step's worth of floats, timed just before and just after each replay
    import timeit

    ref = np.ones(a.layers + 4)

    def add_ns() -> float:
        return min(timeit.repeat(lambda: ref + ref, number=20000, repeat=3)) / 20000 * 1e9

    # the offline replay's entry point: the same per-step code over columns (calm rows without
    # an Observation each); it must raise exactly the alerts observe() raised. Timed in the same
    # repetitions as observe(), alternating (the host's speed drifts).
    cols = StepColumns(step=np.array([o.step for o in obs]), grad_norm=np.array([o.grad_norm for o in obs]),
                       loss=np.array([o.loss for o in obs]), layer_norms=np.stack([o.layer_norms for o in obs]),
                       extras={"lr": (learning_rates(a.steps), None)})
    best_wall = best_cpu = best_cols = float("inf")
    t_add = float("nan")
    for _ in range(a.repeat):
        sd_cols = StreamingDetector(layer_names=names)
        c = time.process_time()
        col_alerts = sd_cols.observe_columns(cols)
        best_cols = min(best_cols, time.process_time() - c)
        before = add_ns()
        sd = StreamingDetector(layer_names=names)
        w, c = time.perf_counter(), time.process_time()
        n_alerts = n_warn = 0
        for o in obs:
            alerts = sd.observe(o)
            if alerts:
                n_alerts += len(alerts)
                n_warn += sum(e.level >= Level.WARNING for e in alerts)
        best_wall = min(best_wall, time.perf_counter() - w)
        cpu = time.process_time() - c
        if cpu < best_cpu:
            best_cpu, t_add = cpu, 0.5 * (before + add_ns())

    same = len(col_alerts) == n_alerts and np.array_equal(sd_cols.state.stats, sd.state.stats)

    # one signal of the user's own on every step (ew.report): one more run-level channel
    rng = np.random.default_rng(7)
    user = 20.0 * np.exp(rng.normal(0, 0.05, a.steps))
    obs_u = [Observation(step=o.step, grad_norm=o.grad_norm, loss=o.loss, layer_norms=o.layer_norms,
                         extras={"lr": o.extras["lr"], "user/attn_logit_max": float(user[i])})
             for i, o in enumerate(obs)]
    best_user = float("inf")
    for _ in range(a.repeat):
        sd_u = StreamingDetector(layer_names=names)
        c = time.process_time()
        for o in obs_u:
            sd_u.observe(o)
        best_user = min(best_user, time.process_time() - c)

    # one path only: every step through the general (masked) path, what a single per-step path
    # would cost (the calm path exists because this misses the target)
    n_full = min(a.steps, 20_000)
    sd_full = StreamingDetector(layer_names=names)
    sd_full.detector._force_full = True
    c = time.process_time()
    for o in obs[:n_full]:
        sd_full.observe(o)
    us_full = 1e6 * (time.process_time() - c) / n_full

    # memory: the live wrapper updates one working state in place, the pure pair returns a new
    # one; neither may accumulate. numpy fills internal caches the first time each path runs
    # (the escalation, the non-finite step, the zero layer), so the traced replay is the second
    # one, with a fresh detector.
    def traced(make_step, seq) -> tuple[int, int, int]:
        for o in seq:  # warm-up pass
            make_step.step(o)
        make_step.reset()
        mark = {len(seq) // 4, (3 * len(seq)) // 5}
        tracemalloc.start()
        got = []
        for i, o in enumerate(seq):
            if i in mark:
                got.append(tracemalloc.get_traced_memory()[0])
            make_step.step(o)
        got.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        return got[0], got[1], got[2]

    class Live:
        def reset(self):
            self.sd = StreamingDetector(layer_names=names)

        def step(self, o):
            self.sd.observe(o)

    class Pure:
        def reset(self):
            self.det = Detector()
            self.state = self.det.init(names)

        def step(self, o):
            self.state = self.det.update(self.state, o)[1]

    live_run, pure_run = Live(), Pure()
    live_run.reset()
    pure_run.reset()
    live = traced(live_run, obs)
    # the pure pair copies the state every step (slower): a shorter run of the same kind
    n_pure = min(a.steps, 20_000)
    pure_mem = traced(pure_run, synthetic(n_pure, a.layers, seed=1))
    snap = pure_run.state
    state_kib = (snap.stats.nbytes + (0 if snap.dev is None else snap.dev.nbytes)) / 1024

    us = 1e6 * best_cpu / a.steps
    print(f"{a.steps:,} steps x {a.layers} layers, one core: {best_cpu:.2f} s CPU "
          f"({us:.1f} us/step), {best_wall:.2f} s wall (best of {a.repeat}); "
          f"{n_alerts} alerts ({n_warn} warning or worse)")
    print(f"offline replay (observe_columns): {best_cols:.2f} s CPU ({1e6 * best_cols / a.steps:.1f} us/step), "
          f"{'the same alerts and final state as observe()' if same else 'DIFFERENT from observe()'}")
    print(f"with one user signal on every step (ew.report): {best_user:.2f} s CPU "
          f"({1e6 * best_user / a.steps:.1f} us/step, {best_user / best_cpu:.2f}x)")
    for label, n, (m1, m2, m3) in (("observe (in place)", a.steps, live),
                                   ("Detector.update (pure)", n_pure, pure_mem)):
        print(f"memory, {label}: {m1 / 1024:.1f} KiB after {n // 4:,} steps, {m2 / 1024:.1f} KiB after "
              f"{(3 * n) // 5:,}, {m3 / 1024:.1f} KiB after {n:,} (growth over the last "
              f"{n - (3 * n) // 5:,} steps {(m3 - m2) / 1024:+.1f} KiB; one state snapshot is "
              f"{state_kib:.1f} KiB)")
    print(f"general path only (one masked path for every step, {n_full:,} steps): {us_full:.1f} us/step -> "
          f"{us_full * a.steps / 1e6:.2f} s for {a.steps:,} steps, {us_full / us:.1f}x the calm path's replay")
    print(f"building the observations took {t_build:.2f} s (not timed)")
    print(f"reference: one numpy add of {a.layers + 4} floats took {t_add:.0f} ns on this core around the "
          f"best replay; a step costs {1000 * us / t_add:.1f} such adds (scale by your machine's add time)")
    return 0


def _detector_of(root: Path, alias: str):
    """``StreamingDetector`` of the checkout at ``root``, imported as a package of its own
    (``alias``), so that two versions run side by side in one process."""
    dest = Path(tempfile.mkdtemp()) / alias
    shutil.copytree(root / "earlywarn", dest, ignore=shutil.ignore_patterns("__pycache__", "integrations"))
    for f in dest.rglob("*.py"):
        f.write_text(re.sub(r"\bearlywarn\.", alias + ".", f.read_text()))
    sys.path.insert(0, str(dest.parent))
    return importlib.import_module(alias + ".detect").StreamingDetector


def paired_live_step(against: Path, rounds: int, layers: int, warm: int = 1500, n: int = 2000) -> int:
    """CPU ns per step of this tree, a copy of it (the A/A noise) and ``against``, interleaved:
    the live calm step (``observe`` of a calm guard observation) and the first 20,000 steps of
    the synthetic run through ``observe`` and ``observe_columns``."""
    impls = {"this tree": StreamingDetector,
             "this tree again": _detector_of(Path(__file__).resolve().parents[1], "ew_this"),
             f"{against}": _detector_of(against.resolve(), "ew_against")}
    rng = np.random.default_rng(1)
    lay = np.exp(rng.normal(-3, 1, layers)) * np.exp(rng.normal(0, 0.05, (warm + n, layers)))
    loss = 3.0 * np.exp(-np.linspace(0, 0.2, warm + n) + rng.normal(0, 0.005, warm + n))
    lr = np.linspace(3e-4, 2.9e-4, warm + n)
    zeros = np.zeros(layers)  # what the guard hands: per-layer non-finite flags, the LR of the step
    calm = [Observation(step=i, grad_norm=float(np.sqrt((lay[i] ** 2).sum())), layer_norms=lay[i],
                        loss=float(loss[i]), layer_nonfinite=zeros, extras={"lr": float(lr[i])})
            for i in range(warm + n)]
    m = 20_000
    run = synthetic(m, layers)
    cols = StepColumns(step=np.arange(m), grad_norm=np.array([o.grad_norm for o in run]),
                       loss=np.array([o.loss for o in run]), layer_norms=np.stack([o.layer_norms for o in run]),
                       extras={"lr": (learning_rates(m), None)})
    names = [f"layer{i}" for i in range(layers)]

    def live(cls) -> float:
        sd = cls(layer_names=names)
        for o in calm[:warm]:
            sd.observe(o)
        observe = sd.observe
        c = time.process_time()
        for o in calm[warm:]:
            observe(o)
        return (time.process_time() - c) / n * 1e9

    def rows(cls) -> float:
        observe = cls(layer_names=names).observe
        c = time.process_time()
        for o in run:
            observe(o)
        return (time.process_time() - c) / m * 1e9

    def columns(cls) -> float:
        sd = cls(layer_names=names)
        c = time.process_time()
        sd.observe_columns(cols)
        return (time.process_time() - c) / m * 1e9

    work = {f"live calm step ({layers} layers + LR)": live, f"observe, synthetic {m:,} steps": rows,
            f"observe_columns, synthetic {m:,} steps": columns}
    got = {w: {k: [] for k in impls} for w in work}
    for r in range(rounds):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))
        for w, fn in work.items():
            for key in order:
                got[w][key].append(fn(impls[key]))
    print(f"{rounds} interleaved rounds (ABBA), CPU ns per step; ratio: median over rounds of the round's ratio")
    for w in work:
        base = got[w]["this tree"]
        print(f"{w}:")
        for key, t in got[w].items():
            ratio = statistics.median([x / b for x, b in zip(t, base)])
            print(f"  {key:24s} min {min(t):6.0f}  median {statistics.median(t):6.0f}  vs this tree {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
