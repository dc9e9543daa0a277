"""What earlywarn's sinks cost a training run, measured side by side in one process.

    .venv/bin/python benchmarks/sinks.py                    # fast step (~15-20 ms), then the handoff table
    .venv/bin/python benchmarks/sinks.py --part fast --big  # also the 10.9M-parameter GPT
    .venv/bin/python benchmarks/sinks.py --part handoff     # only the 209-values-per-step table

**Fast step** (``--part fast``): a real training step of a 2-layer GPT on real text (the standard
library's source; d=128, 4 heads, batch 8 x 64, AdamW, one torch thread) under each sink setup:
the bare step, ``watch(sinks=[])`` (the guard alone), console only, the defaults (console + JSONL +
embedded MLflow), and each tracker alone (embedded MLflow, W&B offline, a webhook to a local HTTP
server), and the guard alone a second time: that A/A pair differs only by noise and by where
each model instance sits in memory, so its ratio is the resolution of the other rows. Each setup
has its own model and optimizer on the same batches. They run in contiguous
blocks of ``--block`` steps, in a rotating order, for ``--rounds`` rounds; after each block every
watcher is flushed (untimed) so one setup's backlog never lands in another's timings. Per round,
each block's median step time is divided by the bare step's and by the guard-alone step's; the
tables give the median over rounds ("x bare": the whole cost; "x guard": what the sinks add).
Also printed: the training thread's own time in the sink path per step (everything inside
``Telemetry.log_rows``: the step's metrics record and every sink call, a calm step's rows up to 16
at a time, each row its share; in brackets the part of it spent reading ``detector.score``, 0 since
the score comes with the row), and the CPU that
background work used per step (the MLflow writer process, W&B's worker thread). Both columns
are medians over steps; the ratios are medians over rounds of per-block medians.

**Handoff** (``--part handoff``): earlier table, kept: the training-thread cost of handing 209
values per step (200 per-layer norms every step, the worst case) to each sink against calling the
SDK directly, on a simulated 20 ms step (``time.sleep``, which releases the GIL like a GPU step).

W&B runs offline and MLflow uses a fresh embedded sqlite store, both under a temporary folder.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


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
    os.environ.pop("EARLYWARN_SINKS", None)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(root, 'mlflow.db')}"


class _Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _thread_cpu(native_id: int | None) -> float:
    """CPU seconds of one thread of this process (Linux), 0 when unknown."""
    if native_id is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{native_id}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _process_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _background_cpu(watcher: Any) -> float:
    """CPU seconds used so far by the watcher's background sink work (writer process, worker threads)."""
    total = 0.0
    for sink in watcher.sinks:
        inner = getattr(sink, "inner", None)
        thread = getattr(sink, "_thread", None)
        total += _thread_cpu(getattr(thread, "native_id", None))
        transport = getattr(inner, "_transport", None)
        proc = getattr(transport, "proc", None)
        total += _process_cpu(getattr(proc, "pid", None))
    return total


def fast_step(args: argparse.Namespace, root: str) -> None:
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import earlywarn
    from earlywarn.sinks import default_sink_specs
    from tinygpt import GPT, GPTConfig, CharDataset, param_count, stdlib_text

    torch.set_num_threads(args.threads)
    configs = [("GPT 2 layers, d=128", GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64), 8, args.block, args.rounds)]
    if args.big:
        configs.append(("GPT 6 layers, d=384 (10.9M)", GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256), 8,
                        args.big_block, args.big_rounds))

    from mlflow import MlflowClient

    MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).search_experiments()  # migrate the store outside the timings
    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    hook_url = f"http://127.0.0.1:{hook.server_address[1]}/services/T0/B0/bench"
    text = stdlib_text(400_000)

    for label, cfg, batch, block, rounds in configs:
        data = CharDataset(text, cfg.block_size)
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(len(data), generator=g)[: 64 * batch].view(64, batch)
        batches = [tuple(torch.stack(t) for t in zip(*(data[int(i)] for i in row))) for row in order]
        setups: dict[str, Any] = {
            "bare step": None,
            "watch(sinks=[]) (the guard alone)": [],
            "watch(sinks=[]) again: A/A control": [],
            "console": ["console"],
            "defaults: console + jsonl + mlflow (embedded)": None,
            "mlflow (embedded sqlite)": ["mlflow"],
            "wandb (offline)": ["wandb"],
            "webhook (local HTTP)": ["webhook"],
        }
        if args.no_wandb:
            setups.pop("wandb (offline)")
        runs: dict[str, dict[str, Any]] = {}
        for name, sinks in setups.items():
            torch.manual_seed(0)
            model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            ew = None
            if name != "bare step":
                opts = {"jsonl": {"path": os.path.join(root, f"events-{len(runs)}.jsonl")},
                        "wandb": {"project": "earlywarn-bench"}, "webhook": {"url": hook_url},
                        "mlflow": {"experiment": "earlywarn-bench"}}
                names = default_sink_specs() if sinks is None else sinks
                ew = earlywarn.watch(model, opt, sinks=sinks, sink_options={k: v for k, v in opts.items() if k in names})
                spent: list[float] = []
                score_spent: list[float] = []
                orig = ew.telemetry.log_rows

                def timed(rows: Any, _orig: Callable = orig, _spent: list = spent, _score: list = score_spent) -> None:
                    # the training thread's whole sink path: each row's metrics record and every sink
                    # call (calm steps' rows come up to 16 at once: each row gets its share)
                    t0 = time.perf_counter()
                    try:
                        _orig(rows)
                    finally:
                        share = (time.perf_counter() - t0) / max(len(rows), 1)
                        _spent.extend([share] * len(rows))
                        _score.extend([0.0] * len(rows))  # the score comes with the row (the detector's)

                ew.telemetry.log_rows = timed
            runs[name] = {"model": model, "opt": opt, "ew": ew, "spent": spent if ew else [], "blocks": [],
                          "score": score_spent if ew else [], "cpu": 0.0, "steps": 0, "i": 0}

        def one_step(r: dict) -> tuple[float, float]:
            x, y = batches[r["i"] % len(batches)]
            r["i"] += 1
            c0, t0 = time.thread_time(), time.perf_counter()
            r["opt"].zero_grad(set_to_none=True)
            _, loss = r["model"](x, y)
            if r["ew"] is not None:
                r["ew"].report_loss(loss)
            loss.backward()
            r["opt"].step()
            return time.perf_counter() - t0, time.thread_time() - c0

        def quiesce() -> None:
            for r in runs.values():
                if r["ew"] is not None:
                    r["ew"].flush()

        names = list(runs)
        for r in runs.values():  # warm-up: allocator, optimizer state, trackers started
            for _ in range(3):
                one_step(r)
        quiesce()
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                r = runs[name]
                cpu0 = _background_cpu(r["ew"]) if r["ew"] is not None else 0.0
                r["blocks"].append([one_step(r) for _ in range(block)])
                quiesce()
                if r["ew"] is not None:
                    r["cpu"] += _background_cpu(r["ew"]) - cpu0
                r["steps"] += block
            print(f"  {label}: round {rnd + 1}/{rounds}", file=sys.stderr, flush=True)

        def block_medians(name: str, which: int) -> list[float]:
            return [statistics.median(t[which] for t in b) for b in runs[name]["blocks"]]

        model = runs["bare step"]["model"]
        print()
        print(f"{label}: {param_count(model) / 1e6:.2f}M params, batch {batch} x {cfg.block_size}, AdamW, "
              f"{torch.get_num_threads()} torch thread(s); {rounds} rounds x {block} steps per setup, "
              f"rotating order; python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}")
        print("wall: step time; cpu: the training thread's CPU time per step (blind to other processes on a "
              "shared host, and to waits for the GIL)")
        print()
        print("| setup | wall ms/step | wall x bare | wall x guard alone | cpu ms/step | cpu x bare | cpu x guard alone | "
              "sink path on the training thread, us/step (of which detector.score) | background CPU, ms/step |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        ref = {w: (block_medians("bare step", w), block_medians("watch(sinks=[]) (the guard alone)", w)) for w in (0, 1)}
        for name in names:
            r = runs[name]
            cells = []
            for w in (0, 1):
                meds = block_medians(name, w)
                bare, guard = ref[w]
                vs_bare = statistics.median(m / b for m, b in zip(meds, bare))
                vs_guard = "-" if name == "bare step" else f"{statistics.median(m / g for m, g in zip(meds, guard)):.4f}x"
                cells += [f"{statistics.median(meds) * 1e3:.2f}", f"{vs_bare:.4f}x", vs_guard]
            sink_us = (f"{statistics.median(r['spent']) * 1e6:.1f} ({statistics.median(r['score']) * 1e6:.1f})"
                       if r["spent"] and r["score"] else "-")
            cpu = f"{r['cpu'] / max(r['steps'], 1) * 1e3:.3f}" if r["ew"] is not None else "-"
            print(f"| {name} | {' | '.join(cells)} | {sink_us} | {cpu} |")
        for r in runs.values():
            if r["ew"] is not None:
                r["ew"].close()
        lost = {n: s.stats()["dropped_records"] for n, r in runs.items() if r["ew"] for s in r["ew"].sinks if hasattr(s, "stats")}
        print(f"\nrecords dropped by any tracker sink: {sum(lost.values())}")
    hook.shutdown()


def _run_case(steps: int, step_s: float, make_step: Callable[[int], dict], log: Callable[[int, dict], None]) -> list[float]:
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        log(step, make_step(step))
        times.append(time.perf_counter() - t0)
        time.sleep(step_s)  # the rest of the training step (GIL released, as in a CUDA/torch op)
    return times


def handoff(args: argparse.Namespace, root: str) -> None:
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

    uri = os.environ["MLFLOW_TRACKING_URI"]
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_name="direct"):
        bench("direct mlflow.log_metrics (embedded sqlite)", lambda s, m: mlflow.log_metrics(m, step=s))

    from earlywarn.integrations.mlflow_sink import MlflowSink

    sink = BackgroundSink(MlflowSink(tracking_uri=uri, run_name="earlywarn", start_timeout=60), exit_on_sigterm=False,
                          max_buffered_values=10_000_000)
    sink.start()
    bench("earlywarn mlflow sink (embedded sqlite)", sink.log_metrics, lambda: (sink.flush(600), sink.finish()))
    mlflow_stats = sink.stats()

    wandb_stats = None
    if not args.no_wandb:
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
        if st is not None:
            print(f"\n{label} sink: delivered {st['delivered_records']} steps, dropped {st['dropped_records']}, "
                  f"failures {st['failures']}", end="")
    print()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "fast", "handoff"), default="all")
    ap.add_argument("--rounds", type=int, default=8, help="fast step: rounds (each setup runs one block per round)")
    ap.add_argument("--block", type=int, default=60, help="fast step: steps per block")
    ap.add_argument("--big", action="store_true", help="fast part: also the 10.9M-parameter GPT (batch 8 x 256)")
    ap.add_argument("--big-rounds", type=int, default=3)
    ap.add_argument("--big-block", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a loaded 2-core host is noisy with more)")
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--steps", type=int, default=200, help="handoff: steps per case")
    ap.add_argument("--layers", type=int, default=200, help="handoff: per-layer norms per step")
    ap.add_argument("--step-ms", type=float, default=20.0, help="handoff: simulated compute per training step")
    args = ap.parse_args(argv)

    root = tempfile.mkdtemp(prefix="earlywarn-bench-")
    _setup_env(root)
    cwd = os.getcwd()
    os.chdir(root)  # a sqlite MLflow store keeps artifacts under ./mlruns; the JSONL log goes here too
    try:
        with contextlib.redirect_stdout(sys.stdout):
            if args.part in ("all", "fast"):
                fast_step(args, root)
            if args.part in ("all", "handoff"):
                handoff(args, root)
    finally:
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
