"""Training-thread cost per step of earlywarn's sinks vs calling the tracker SDK directly.

Each case logs the same step dict (``build_metrics`` with 200 per-layer norms + the aggregates,
~209 values) once per simulated training step, and times only what the training thread spends
building and handing over the metrics. A training step is simulated by ``time.sleep`` (like a
GPU step, it releases the GIL), so the background workers run between steps as they would.
"drain" is how long ``flush()`` then takes to deliver the backlog (direct calls have none).

    .venv/bin/python benchmarks/sinks.py [--steps 300] [--layers 200] [--step-ms 20]

W&B runs offline and MLflow uses a fresh embedded sqlite store, both under a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

import numpy as np


def _setup_env(root: str) -> None:
    for sub in ("wandb", "wandb/data", "wandb/cache", "wandb/config"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    os.environ.update(
        {
            "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true", "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_META": "true",
            "WANDB__SAVE_REQUIREMENTS": "false", "WANDB_DIR": os.path.join(root, "wandb"),
            "WANDB_DATA_DIR": os.path.join(root, "wandb/data"), "WANDB_CACHE_DIR": os.path.join(root, "wandb/cache"),
            "WANDB_CONFIG_DIR": os.path.join(root, "wandb/config"),
        }
    )


def _run_case(steps: int, step_s: float, make_step: Callable[[int], dict], log: Callable[[int, dict], None]) -> list[float]:
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        log(step, make_step(step))
        times.append(time.perf_counter() - t0)
        time.sleep(step_s)  # the rest of the training step (GIL released, as in a CUDA/torch op)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=20.0, help="simulated compute per training step")
    args = ap.parse_args(argv)

    root = tempfile.mkdtemp(prefix="earlywarn-bench-")
    _setup_env(root)
    cwd = os.getcwd()
    os.chdir(root)  # a sqlite MLflow store keeps artifacts under ./mlruns
    from earlywarn.metrics import MetricsConfig, build_metrics
    from earlywarn.sinks.background import BackgroundSink
    from earlywarn.sinks.jsonl import JsonlSink

    rng = np.random.default_rng(0)
    names = [f"model.layers.{i}.mlp.weight" for i in range(args.layers)]
    cfg = MetricsConfig(layer_every=1)  # every layer, every step: the worst case
    norms = rng.random((args.steps, args.layers)) + 0.5

    def make_step(step: int) -> dict:
        return build_metrics(step, grad_norm=float(norms[step].sum()), loss=2.0, layer_names=names,
                             layer_norms=norms[step], score=0.1, level=0, counters={}, config=cfg)

    n_values = len(make_step(0))
    step_s = args.step_ms / 1000.0
    rows: list[tuple[str, list[float], float | None]] = []

    def bench(label: str, log: Callable[[int, dict], None], drain: Callable[[], None] | None = None) -> None:
        make_step(0)  # warm the key cache
        times = _run_case(args.steps, step_s, make_step, log)
        d = None
        if drain is not None:
            t0 = time.perf_counter()
            drain()
            d = time.perf_counter() - t0
        rows.append((label, times, d))
        print(f"  done: {label}", file=sys.stderr, flush=True)

    bench("build_metrics only (no sink)", lambda s, m: None)

    jsonl = JsonlSink(os.path.join(root, "events.jsonl"), metrics=True)
    jsonl.start()
    bench("earlywarn jsonl sink (inline, metrics=True)", jsonl.log_metrics, jsonl.finish)

    import mlflow
    from mlflow import MlflowClient

    db = os.path.join(root, "mlflow.db")
    uri = f"sqlite:///{db}"
    MlflowClient(uri).search_experiments()  # create + migrate the store outside the timings
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_name="direct"):
        bench("direct mlflow.log_metrics (embedded sqlite)", lambda s, m: mlflow.log_metrics(m, step=s))

    from earlywarn.integrations.mlflow_sink import MlflowSink

    sink = BackgroundSink(MlflowSink(tracking_uri=uri, run_name="earlywarn"), exit_on_sigterm=False,
                          max_buffered_values=10_000_000)
    sink.start()
    bench("earlywarn mlflow sink (embedded sqlite)", sink.log_metrics, lambda: (sink.flush(600), sink.finish()))
    mlflow_stats = sink.stats()

    import wandb

    run = wandb.init(project="earlywarn-bench", name="direct")
    bench("direct wandb.log (offline)", lambda s, m: run.log(m))
    run.finish()

    from earlywarn.integrations.wandb_sink import WandbSink

    sink = BackgroundSink(WandbSink(project="earlywarn-bench", name="earlywarn"), exit_on_sigterm=False,
                          max_buffered_values=10_000_000)
    sink.start()
    bench("earlywarn wandb sink (offline)", sink.log_metrics, lambda: (sink.flush(600), sink.finish()))
    wandb_stats = sink.stats()

    print()
    print(f"{args.steps} steps, {n_values} values/step ({args.layers} per-layer norms), "
          f"simulated step {args.step_ms:g} ms, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print()
    print("| case | training-thread ms/step, median | p95 | max | drain after loop, s |")
    print("|---|---:|---:|---:|---:|")
    for label, times, d in rows:
        ms = [t * 1000 for t in times]
        p95 = float(np.percentile(ms, 95))
        print(f"| {label} | {statistics.median(ms):.3f} | {p95:.3f} | {max(ms):.2f} | "
              f"{'-' if d is None else f'{d:.1f}'} |")
    for label, st in (("mlflow", mlflow_stats), ("wandb", wandb_stats)):
        print(f"\n{label} sink: delivered {st['delivered_records']} steps, dropped {st['dropped_records']}, "
              f"failures {st['failures']}", end="")
    print()
    os.chdir(cwd)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
