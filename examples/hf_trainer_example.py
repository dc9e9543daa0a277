"""Hugging Face Trainer with earlywarn: one line, ``callbacks=[EarlywarnTrainerCallback()]``.

    python examples/hf_trainer_example.py

A tiny GPT-2 built from a config (nothing is downloaded) learns real text, one byte per token
(the Python standard library's source). At step 10 one gradient is corrupted (an inf) after
backward; earlywarn, watching the torch optimizer inside the Trainer's ``AcceleratedOptimizer``,
skips that update and training goes on with finite parameters.

The Trainer clips gradients (``max_grad_norm``) before any callback hook: earlywarn sees clipped
norms, so it catches non-finite gradients but not spikes larger than ``max_grad_norm``. Pass
``max_grad_norm=0`` for spike detection on raw norms.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from earlywarn.integrations.hf_callback import EarlywarnTrainerCallback
from tinygpt import CharDataset, stdlib_text


class Bytes(torch.utils.data.Dataset):
    """CharDataset windows as Hugging Face causal-LM examples (labels = inputs, shifted inside)."""

    def __init__(self, chars: CharDataset) -> None:
        self.chars = chars

    def __len__(self) -> int:
        return len(self.chars)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.chars[i]
        return {"input_ids": x, "labels": x}


class CorruptOneGradient(TrainerCallback):
    """The fault: an inf in one gradient at one step (after backward, before the update)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step == self.step:
            model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=10)
    ap.add_argument("--output-dir", default="hf_example_output")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    data = Bytes(CharDataset(stdlib_text(300_000), block_size=64))
    guard = EarlywarnTrainerCallback(sinks=["console"])  # earlywarn
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                                 learning_rate=3e-3, report_to=[], save_strategy="no", logging_steps=10,
                                 use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=data,
                      callbacks=[guard, CorruptOneGradient(args.fault_step)])
    trainer.train()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert guard.watcher is not None
    print(f"earlywarn: {guard.watcher.summary()}; parameters finite: {finite}")


if __name__ == "__main__":
    main()
