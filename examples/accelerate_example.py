"""Accelerate with earlywarn: ``ew = watch_accelerated(accelerator, model, optimizer)``.

    python examples/accelerate_example.py

A small GPT on real text (the Python standard library's source, no download), prepared by
``accelerator.prepare``. At step 15 one gradient is corrupted (an inf) after backward;
earlywarn watches the torch optimizer inside accelerate's ``AcceleratedOptimizer`` and skips
that update. Launched on several processes, every process builds its watcher the same way
(the statistics and so the decisions agree across ranks, as with torchrun_example.py).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from earlywarn.integrations.accelerate_support import watch_accelerated
from tinygpt import GPT, CharDataset, GPTConfig, stdlib_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=15)
    args = ap.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(CharDataset(stdlib_text(300_000), block_size=64), batch_size=8, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ew = watch_accelerated(accelerator, model, opt, sinks=["console"])  # earlywarn

    step = 0
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad()
            _, loss = model(x, y)
            accelerator.backward(loss)
            if step == args.fault_step and accelerator.is_last_process:
                accelerator.unwrap_model(model).blocks[1].fc.weight.grad[0, 0] = float("inf")
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            ew.report_loss(loss)  # earlywarn
            opt.step()
            step += 1
            if step >= args.steps:
                break
    summary = ew.summary()
    ew.close()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    accelerator.print(f"earlywarn: {summary}; parameters finite: {finite}")


if __name__ == "__main__":
    main()
