"""Lightning with earlywarn: one line, ``Trainer(callbacks=[EarlywarnCallback()])``.

    python examples/lightning_example.py

A small GPT on real text (the Python standard library's source, no download), trained with
gradient clipping. At step 20 one layer's gradient overflows to inf during backward (the loss is
finite). earlywarn looks at the gradients in
``on_before_optimizer_step`` -- before Lightning clips them -- and skips that update, so the
parameters stay finite and training goes on.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from earlywarn.integrations.lightning_callback import EarlywarnCallback
from tinygpt import GPT, CharDataset, GPTConfig, stdlib_text


def _overflow_once():
    fired = []

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        if fired:
            return None
        fired.append(True)
        return grad.index_fill(0, torch.tensor([0]), float("inf"))

    return hook


class LitGPT(pl.LightningModule):
    def __init__(self, fault_step: int) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
        self.fault_step = fault_step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.gpt(x, y)
        if self.global_step == self.fault_step:
            # One layer's gradient overflows during this backward (the loss itself is finite).
            self.gpt.blocks[0].fc.weight.register_hook(_overflow_once())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-step", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = CharDataset(stdlib_text(300_000), block_size=64)
    guard = EarlywarnCallback(sinks=["console"])  # earlywarn
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[guard])
    model = LitGPT(args.fault_step)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"earlywarn: {guard.watcher.summary()}; parameters finite: {finite}")


if __name__ == "__main__":
    main()
