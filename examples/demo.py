"""earlywarn's main demo: train a small char-level GPT on real text, break it twice, watch it survive.

    bash scripts/demo.sh            # sets up .venv, then runs this file
    .venv/bin/python examples/demo.py --steps 300 --tracker mlflow|wandb|none --out earlywarn_demo

Fault 1 (a bad batch): one inf written into one gradient coordinate. Unguarded, Adam's moments
turn NaN and so does every parameter one step later. earlywarn skips that step before the
optimizer writes anything, and names the layer and the batch.
Fault 2 (poisoned weights, e.g. an unguarded update or a bit flip): NaN written into one weight
matrix. The next loss is NaN; earlywarn rewinds to the last clean snapshot and skips the batches
that led there (quarantined, with sample ids). (NaN in the optimizer's state alone is repaired
before the update that would read it: no step is lost.)

Everything it writes goes under ``--out``: the event log, checkpoints, the quarantine list, the
embedded MLflow store (``mlflow.db``, artifacts in ``mlruns/``) and ``run.png``, a picture of the
run. The last lines it prints say how to open each.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import earlywarn  # noqa: E402
import earlywarn.sinks  # noqa: E402
from earlywarn.events import Event, Kind, Level  # noqa: E402
from earlywarn.sinks.console import ALERT_KINDS  # noqa: E402
from earlywarn.sinks.defaults import mlflow_ui_command  # noqa: E402
from tinygpt import GPT, CharDataset, GPTConfig, param_count, stdlib_text  # noqa: E402

EXPERIMENT = "earlywarn-demo"


class Screen:
    """stdout: finished lines, and a progress bar under them when stdout is a terminal (piped
    to a file or a test, plain progress lines instead: no carriage returns, no escape codes)."""

    def __init__(self, total: int, stream=sys.stdout):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self._bar = False

    def line(self, text: str) -> None:
        if self._bar:
            self.stream.write("\r\x1b[K")  # clear the bar; it is drawn again on the next update
            self._bar = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, step: int, loss: float) -> None:
        if self.tty:
            done = int(30 * step / self.total)
            self.stream.write(f"\r[{'#' * done}{'-' * (30 - done)}] step {step:4d}/{self.total} loss {loss:6.3f}")
            self.stream.flush()
            self._bar = True
        elif step % 40 == 0:
            self.line(f"step {step:4d}/{self.total}  loss {loss:.3f}")

    def close(self) -> None:
        if self._bar:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._bar = False


class ConsoleOnScreen(earlywarn.sinks.ConsoleSink):
    """earlywarn's console sink (one line per incident), printed above the progress bar."""

    def __init__(self, screen: Screen, **kw):
        super().__init__(**kw)
        self.screen = screen

    def write(self, line: str) -> None:
        self.screen.line(line)


class RunRecord(earlywarn.sinks.Sink):
    """Keeps what the picture needs: earlywarn's own loss and grad norm at every step."""

    name = "run-record"

    def __init__(self) -> None:
        self.step: list[int] = []
        self.loss: list[float] = []
        self.grad_norm: list[float] = []

    def log_metrics(self, step, metrics) -> None:
        self.step.append(step)
        self.loss.append(float(metrics.get("earlywarn/loss", math.nan)))
        self.grad_norm.append(float(metrics.get("earlywarn/grad_norm", math.nan)))


def mlflow_store(out: Path) -> str:
    """The demo's own embedded MLflow store, ``<out>/mlflow.db``, its artifacts in ``<out>/mlruns``."""
    import logging

    import mlflow  # importing it sets up its loggers: quiet the store's table creation after that

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(EXPERIMENT) is None:
        # a sqlite store puts artifacts under ./mlruns of the working directory unless told
        client.create_experiment(EXPERIMENT, artifact_location=(out / "mlruns").as_uri())
    return uri


def picture(path: Path, rec: RunRecord, events: list[Event], faults: dict[int, str], title: str) -> None:
    """PNG of the run: loss and grad norm per step, with the faults, alerts, skips, rewinds and
    checkpoints marked. The legend names only what is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    step = np.asarray(rec.step)
    loss = np.asarray(rec.loss)
    grad = np.asarray(rec.grad_norm)
    fig, (ax_l, ax_g) = plt.subplots(2, 1, sharex=True, figsize=(13, 6.5))
    ok = np.isfinite(loss)
    ax_l.plot(step[ok], loss[ok], lw=0.9, color="tab:green", label="loss")
    ax_l.set_ylabel("loss")
    ok_g = np.isfinite(grad) & (grad > 0)
    ax_g.semilogy(step[ok_g], grad[ok_g], lw=0.9, color="tab:blue", label="grad norm")
    ax_g.set_ylabel("grad norm (log)")
    ax_g.set_xlabel("optimizer step (earlywarn's count: it never goes back)")
    for ax, values, what in ((ax_l, loss, "loss"), (ax_g, grad, "grad norm")):
        bad = ~np.isfinite(values)
        if bad.any():  # nothing to draw at NaN/Inf: a mark at the top edge
            ax.plot(step[bad], np.full(bad.sum(), 0.97), "X", ms=9, color="red",
                    transform=ax.get_xaxis_transform(), label=f"non-finite {what}", zorder=5)

    def once(label: str, seen: set[str]) -> str | None:
        if label in seen:
            return None
        seen.add(label)
        return label

    seen: set[str] = set()
    for s, text in faults.items():
        for ax in (ax_l, ax_g):
            ax.axvline(s, color="black", ls="--", lw=1.2, label=once("fault injected", seen) if ax is ax_l else None)
        ax_l.annotate(text, (s, 0.02), xycoords=("data", "axes fraction"), xytext=(4, 0), textcoords="offset points",
                      fontsize=8, rotation=90, va="bottom")
    colors = {Level.INFO: "tab:cyan", Level.WARNING: "tab:orange", Level.CRITICAL: "tab:red"}
    for e in events:
        if e.kind in ALERT_KINDS:
            label = {Level.INFO: "info alert (isolated spike)", Level.WARNING: "warning"}.get(e.level, "critical alert")
            ax_g.axvline(e.step, color=colors[e.level], lw=0.8 if e.level <= Level.INFO else 1.4,
                         alpha=0.5 if e.level <= Level.INFO else 0.9, label=once(label, seen))
        elif e.kind is Kind.SKIP:
            for ax in (ax_l, ax_g):
                ax.axvline(e.step, color="tab:red", lw=4, alpha=0.3,
                           label=once("step skipped", seen) if ax is ax_g else None)
            ax_g.annotate("skipped", (e.step, 0.8), xycoords=("data", "axes fraction"), xytext=(6, 0),
                          textcoords="offset points", fontsize=8, color="tab:red")
        elif e.kind is Kind.REWIND:
            back = int(e.values.get("restored_step", e.step))
            n = int(e.values.get("skipped", 0))
            for ax in (ax_l, ax_g):
                ax.axvspan(back, e.step, color="tab:purple", alpha=0.15,
                           label=once(f"rewound: back to step {back}, {n} batches quarantined", seen) if ax is ax_g else None)
            ax_g.annotate(f"rewind to {back}", xy=(back, 0.8), xycoords=("data", "axes fraction"),
                          xytext=(e.step + 6, 0.8), textcoords=("data", "axes fraction"), fontsize=8,
                          color="tab:purple", va="center",
                          arrowprops={"arrowstyle": "->", "color": "tab:purple"})
        elif e.kind is Kind.CHECKPOINT:
            ax_g.plot([e.step], [0.03], "v", ms=7, color="dimgray", transform=ax_g.get_xaxis_transform(),
                      label=once("checkpoint", seen))
    ax_l.set_title(title, fontsize=10)
    for ax in (ax_l, ax_g):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.7)
        ax.grid(alpha=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--bad-batch-step", type=int, default=60)
    ap.add_argument("--poison-step", type=int, default=150)
    ap.add_argument("--tracker", choices=["mlflow", "wandb", "none"], default="mlflow")
    ap.add_argument("--out", default="earlywarn_demo",
                    help="folder for everything the demo writes (event log, checkpoints, quarantine list, MLflow "
                         "store, picture); a rerun replaces its files there, MLflow keeps every run")
    # one thread: a 0.37M-parameter model gains little from two, and loses 5x when the cores are busy
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    # A rerun starts its own log, quarantine list and checkpoints (MLflow keeps every run).
    for old in [out / "events.jsonl", out / "quarantine.jsonl", out / "run.png", *out.glob("checkpoints/step-*")]:
        old.unlink(missing_ok=True)
    screen = Screen(args.steps)

    text = stdlib_text(600_000)
    dataset = CharDataset(text, block_size=64)
    loader = earlywarn.ResumableLoader(dataset, batch_size=16, shuffle=True, seed=0)
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=96, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    screen.line(f"char-level GPT, {param_count(model) / 1e6:.2f}M params, on {len(text) / 1e6:.1f} MB of the Python "
                f"standard library's source ({len(dataset)} samples); {args.steps} steps, faults at steps "
                f"{args.bad_batch_step} and {args.poison_step}")

    # The console shows warnings and worse; info alerts (isolated spikes) are in the log and the picture.
    record = RunRecord()
    sinks: list = [ConsoleOnScreen(screen, min_level="warning"), "jsonl", record]
    sink_options: dict = {"jsonl": {"path": str(out / "events.jsonl")}}
    mlflow_uri = None
    if args.tracker == "mlflow":
        mlflow_uri = mlflow_store(out)
        sinks.append("mlflow")
        sink_options["mlflow"] = {"tracking_uri": mlflow_uri, "experiment": EXPERIMENT, "run_name": "char-gpt-stdlib"}
    elif args.tracker == "wandb":
        sinks.append("wandb")
        sink_options["wandb"] = {"project": EXPERIMENT, "init_kwargs": {"dir": str(out)}}
    ew = earlywarn.watch(
        model, opt, loader=loader, sinks=sinks, sink_options=sink_options,
        recovery=earlywarn.RecoveryConfig(
            snapshot_every=25, checkpoint_dir=str(out / "checkpoints"), checkpoint_every=100,
            quarantine_path=str(out / "quarantine.jsonl"),
        ),
    )

    faults: dict[int, str] = {}
    t0 = time.time()
    fired: set[str] = set()
    last_loss = float("nan")
    finite_losses: list[float] = []
    while ew.step < args.steps:
        for x, y in loader:
            if ew.step >= args.steps:
                break
            step = ew.step
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            ew.report_loss(loss)  # stays on the device; read with the gradient stats
            loss.backward()
            # each fault happens once (ew.step goes back after a rewind: a step-keyed fault would recur)
            if step == args.bad_batch_step and "bad_batch" not in fired:
                fired.add("bad_batch")
                model.blocks[2].fc.weight.grad[7, 3] = float("inf")  # fault 1: a bad batch
                faults[step] = "fault 1: inf gradient"
                screen.line(f"[demo] step {step}: fault 1 injected: inf in one gradient coordinate of blocks.2.fc.weight")
            if step == args.poison_step and "poison" not in fired:
                fired.add("poison")
                model.blocks[1].attn.weight.detach().fill_(float("nan"))  # fault 2: poisoned weights
                faults[step] = "fault 2: NaN in the weights"
                screen.line(f"[demo] step {step}: fault 2 injected: NaN written into the weights of blocks.1.attn.weight "
                            "(as an unguarded update or a bit flip leaves them)")
            opt.step()
            if step % 10 == 0:
                last_loss = loss.item()  # a host sync, only for the progress display every 10 steps
                if math.isfinite(last_loss):
                    finite_losses.append(last_loss)
                screen.progress(step, last_loss)
    ew.flush()
    elapsed = time.time() - t0
    screen.close()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    counters = ", ".join(f"{k}={v}" for k, v in ew.summary().items() if v)
    events = list(ew.events)
    ew.close()  # finishes the MLflow run

    screen.line(f"finished {ew.step} steps in {elapsed:.0f} s; loss {finite_losses[0]:.3f} -> {finite_losses[-1]:.3f}; "
                f"all parameters finite: {finite}")
    screen.line(f"counters: {counters}")
    png = out / "run.png"
    try:
        picture(png, record, events, faults,
                f"earlywarn demo: char-level GPT, {ew.step} steps, {len(faults)} injected faults")
    except ImportError:
        png = None
    screen.line("")
    screen.line("What it logged, and how to look at it:")
    if png is not None:
        screen.line(f"  picture of this run   {png}")
    else:
        screen.line("  picture of this run   (skipped: matplotlib is not installed; pip install matplotlib)")
    if mlflow_uri is not None:
        screen.line(f"  MLflow UI             {mlflow_ui_command(mlflow_uri)}")
        screen.line(f"                        then open http://127.0.0.1:5000 (it takes up to a minute to start), "
                    f"experiment '{EXPERIMENT}'")
    if args.tracker == "wandb":
        screen.line(f"  W&B run files         {out / 'wandb'}{os.sep} (wandb sync uploads an offline run)")
    screen.line(f"  event log (JSONL)     {out / 'events.jsonl'}")
    quarantine = out / "quarantine.jsonl"
    screen.line(f"  quarantine list       {quarantine if quarantine.exists() else '(none: no rewind skipped a batch)'}")
    screen.line(f"  checkpoints           {out / 'checkpoints'}{os.sep}")
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
