"""How fast `earlywarn analyze` is on a long run: 150,000 steps x 50 per-layer series.

    python benchmarks/analyze_speed.py [--steps 150000] [--layers 50] [--runs 20] [--keep DIR]

Writes the run as CSV (step, loss, grad_norm, grad_norm/<layer> x 50: ~85 MB), as .npz, and as a
CSV whose last layer is blank on 9 rows of 10 (a metric logged less often), then times each stage
separately, best of ``--repeat``:

  parse   read_source (CSV: pyarrow's reader when installed, else numpy's C parser; npz: np.load)
          + hygiene (clean)
  detect  the replay through earlywarn.detect.StreamingDetector (observe_columns: the live
          per-step code, calm rows without building an Observation)
  report  incidents and the report object

and, for "many runs in one call", ``--runs`` runs of 10,000 steps in one ``analyze`` call.
The target in issue #6 is the whole analysis (parse + detect + report) < 2 s for the 150k x 50 run. Wall-clock and CPU time are
both printed (on a shared machine wall-clock is inflated); nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from earlywarn.analyze import analyze
from earlywarn.analyze.hygiene import clean
from earlywarn.analyze.readers import read_source
from earlywarn.analyze.replay import replay
from earlywarn.analyze.report import build_run_report

TARGET_S = 2.0


def make_run(steps: int, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A healthy run with a decaying loss, noisy norms, a few isolated spikes and, near the end,
    an escalation in one layer followed by a loss jump."""
    rng = np.random.default_rng(seed)
    s = np.arange(steps)
    loss = 3.0 + 5.0 * np.exp(-s / 5000) + rng.normal(0, 0.02, steps)
    g = 0.25 * np.exp(rng.normal(0, 0.08, steps))
    lay = (0.25 / np.sqrt(layers)) * np.exp(rng.normal(0, 0.08, (steps, layers)))
    spikes = rng.choice(steps - 100, size=steps // 5000, replace=False)
    g[spikes] *= 4.0
    lay[spikes, 3] *= 6.0
    e = steps - 60
    for k in range(5):
        g[e + k] *= 3.0 ** (k + 1)
        lay[e + k, 7] *= 4.0 ** (k + 1)
    loss[e + 5:] += 4.0
    cols = {"step": s.astype(np.float64), "loss": loss, "grad_norm": g}
    for j in range(layers):
        cols[f"grad_norm/blocks.{j}"] = lay[:, j]
    return cols


def write_csv(path: str, cols: dict[str, np.ndarray], sparse_last: int = 0) -> None:
    """``sparse_last=k``: the last column is written on every k-th row only (blank elsewhere), as
    a logger that computes one metric less often leaves it."""
    data = np.column_stack(list(cols.values()))
    with open(path, "w") as fh:
        fh.write(",".join(cols) + "\n")
        if not sparse_last:
            np.savetxt(fh, data, delimiter=",", fmt="%.7g")
            return
        for i, row in enumerate(data):
            cells = [f"{v:.7g}" for v in row]
            if i % sparse_last:
                cells[-1] = ""
            fh.write(",".join(cells) + "\n")


def time_one(path: str, repeat: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        raw = read_source(path)[0]
        run = clean(raw)
        t1, c1 = time.perf_counter(), time.process_time()
        rep = replay(run)
        t2, c2 = time.perf_counter(), time.process_time()
        report = build_run_report(run, rep)
        t3, c3 = time.perf_counter(), time.process_time()
        cur = {"parse": t1 - t0, "detect": t2 - t1, "report": t3 - t2, "total": t3 - t0,
               "parse_cpu": c1 - c0, "detect_cpu": c2 - c1, "report_cpu": c3 - c2}
        for k, v in cur.items():
            best[k] = min(best.get(k, float("inf")), v)
    best["alerts"] = len(report.alerts)
    best["incidents"] = len(report.incidents)
    best["lead"] = report.incidents[0].lead_steps if report.incidents else None
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150_000)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--runs", type=int, default=20, help="runs of 10,000 steps analysed in one call")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", metavar="DIR", help="write the files here (default: a temp dir, removed)")
    args = ap.parse_args()

    tmp = None
    if args.keep:
        out = args.keep
        os.makedirs(out, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory()
        out = tmp.name
    cols = make_run(args.steps, args.layers)
    csv_path = os.path.join(out, "run.csv")
    npz_path = os.path.join(out, "run.npz")
    t = time.perf_counter()
    write_csv(csv_path, cols)
    np.savez(npz_path, **cols)
    sparse_path = os.path.join(out, "run_sparse.csv")
    write_csv(sparse_path, cols, sparse_last=10)
    print(f"wrote {args.steps} steps x {args.layers} layers: CSV {os.path.getsize(csv_path) / 1e6:.0f} MB, "
          f"npz {os.path.getsize(npz_path) / 1e6:.0f} MB ({time.perf_counter() - t:.1f} s, not timed)")

    for label, path in (("csv", csv_path), ("npz", npz_path), ("csv, one layer on every 10th row", sparse_path)):
        r = time_one(path, args.repeat)
        per_step = 1e6 * r["detect"] / args.steps
        verdict = ""
        if path != sparse_path:  # the target is about the full run; the sparse file is for comparison
            verdict = f" -> {'meets' if r['total'] < TARGET_S else 'MISSES'} the {TARGET_S:.0f} s target"
        print(f"{label}: parse {r['parse']:.2f} s | detect {r['detect']:.2f} s ({per_step:.1f} us/step) | "
              f"report {r['report']:.3f} s | total {r['total']:.2f} s wall{verdict}; "
              f"{r['alerts']} alerts, {r['incidents']} incident(s), lead {r['lead']} steps")
        print(f"     CPU time: parse {r['parse_cpu']:.2f} s | detect {r['detect_cpu']:.2f} s "
              f"({1e6 * r['detect_cpu'] / args.steps:.1f} us/step) | report {r['report_cpu']:.3f} s "
              "(wall > CPU means the machine was shared)")

    if args.runs:
        paths = []
        for i in range(args.runs):
            small = make_run(10_000, 8, seed=i + 1)
            p = os.path.join(out, f"many_{i}.npz")
            np.savez(p, **small)
            paths.append(p)
        t = time.perf_counter()
        rep = analyze(paths)
        dt = time.perf_counter() - t
        s = rep.summary()
        print(f"many runs: {args.runs} runs x 10,000 steps x 8 layers in one call: {dt:.2f} s "
              f"({1e6 * dt / s['steps']:.1f} us/step); {s['incidents']} incident(s), "
              f"{s['incidents_warned']} warned ahead")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
