"""earlywarn's main demo: train a small char-level GPT on real text, break it twice, watch it survive.

    bash scripts/demo.sh            # sets up .venv, then runs this file
    python examples/demo.py --steps 300 --tracker mlflow|wandb|none

Fault 1 (a bad batch): one inf written into one gradient coordinate. Unguarded, Adam's moments
turn NaN and so does every parameter one step later. earlywarn skips that step before the
optimizer writes anything, and names the layer and the batch.
Fault 2 (poisoned optimizer state, e.g. an unguarded step or a bit flip): NaN written into
Adam's ``exp_avg``. The next step turns parameters NaN; earlywarn repairs the state or rewinds
to the last clean snapshot and skips the batches that led there (quarantined, with sample ids).
Metrics and alerts go to the embedded MLflow store (``mlflow ui`` in this folder shows them).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import earlywarn  # noqa: E402
import earlywarn.sinks  # noqa: E402
from earlywarn.events import Kind, Level  # noqa: E402
from tinygpt import GPT, CharDataset, GPTConfig, param_count, stdlib_text  # noqa: E402


class ConsoleAboveBar(earlywarn.sinks.ConsoleSink):
    """The console sink, printing above the progress bar (clears the bar's line first)."""

    def alert(self, event: earlywarn.Event) -> None:
        sys.stderr.write("\r\x1b[K")
        super().alert(event)


def progress(step: int, total: int, loss: float, note: str = "") -> None:
    width = 30
    done = int(width * step / total)
    bar = "#" * done + "-" * (width - done)
    sys.stderr.write(f"\r[{bar}] step {step:4d}/{total} loss {loss:6.3f} {note:<28s}")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--bad-batch-step", type=int, default=60)
    ap.add_argument("--poison-step", type=int, default=150)
    ap.add_argument("--tracker", choices=["mlflow", "wandb", "none"], default="mlflow")
    ap.add_argument("--out", default="earlywarn_demo", help="folder for the event log, checkpoints and quarantine list")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)

    text = stdlib_text(600_000)
    dataset = CharDataset(text, block_size=64)
    loader = earlywarn.ResumableLoader(dataset, batch_size=16, shuffle=True, seed=0)
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=96, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    print(f"char-level GPT, {param_count(model) / 1e6:.2f}M params, on {len(text) / 1e6:.1f} MB of the Python "
          f"standard library's source ({len(dataset)} samples); {args.steps} steps")

    console = ConsoleAboveBar(min_level="info")
    sinks = {"mlflow": [console, "jsonl", "mlflow"], "wandb": [console, "jsonl", "wandb"], "none": [console, "jsonl"]}[args.tracker]
    sink_options = {
        "jsonl": {"path": os.path.join(args.out, "events.jsonl")},
        "mlflow": {"experiment": "earlywarn-demo", "run_name": "char-gpt-stdlib"},
        "wandb": {"project": "earlywarn-demo"},
    }
    ew = earlywarn.watch(
        model, opt, loader=loader, sinks=sinks, sink_options={k: v for k, v in sink_options.items() if k in sinks},
        recovery=earlywarn.RecoveryConfig(
            snapshot_every=25, checkpoint_dir=os.path.join(args.out, "checkpoints"), checkpoint_every=100,
            quarantine_path=os.path.join(args.out, "quarantine.jsonl"),
        ),
    )

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
            note = ""
            # each fault happens once (ew.step goes back after a rewind: a step-keyed fault would recur)
            if step == args.bad_batch_step and "bad_batch" not in fired:
                fired.add("bad_batch")
                model.blocks[2].fc.weight.grad[7, 3] = float("inf")  # fault 1: a bad batch
                note = "<- fault 1: inf gradient"
            if step == args.poison_step and "poison" not in fired:
                fired.add("poison")
                opt.state[model.blocks[1].attn.weight]["exp_avg"].fill_(float("nan"))  # fault 2: poisoned state
                note = "<- fault 2: NaN in Adam exp_avg"
            opt.step()
            if step % 10 == 0:
                last_loss = loss.item()  # a host sync, only for the progress bar every 10 steps
                if math.isfinite(last_loss):
                    finite_losses.append(last_loss)
            if note or step % 10 == 0:
                progress(step, args.steps, last_loss, note)
                if note:
                    sys.stderr.write("\n")
    ew.flush()
    elapsed = time.time() - t0
    sys.stderr.write("\n")

    print(f"\nfinished {ew.step} steps in {elapsed:.0f} s; loss {finite_losses[0]:.3f} -> {finite_losses[-1]:.3f}")
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"all parameters finite: {finite}")
    print("\nwhat earlywarn did:")
    print(f"  {'step':>5s}  {'level':8s}  {'what':14s}  message")
    for e in ew.events:
        if e.level >= Level.WARNING or e.kind in (Kind.REPAIR, Kind.REWIND, Kind.QUARANTINE, Kind.CHECKPOINT):
            full = e.kind in (Kind.REWIND, Kind.REPAIR)  # these carry the blame: print all of it
            msg = e.message if full or len(e.message) < 150 else e.message[:147] + "..."
            print(f"  {e.step:5d}  {str(e.level):8s}  {str(e.kind):14s}  {msg}")
    print("\ncounters: " + ", ".join(f"{k}={v}" for k, v in ew.summary().items() if v))
    print(f"event log: {os.path.join(args.out, 'events.jsonl')}; quarantine list: {os.path.join(args.out, 'quarantine.jsonl')}")
    if args.tracker == "mlflow":
        print("tracker: embedded MLflow store (run `mlflow ui` here, experiment 'earlywarn-demo')")
    ew.close()
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
