"""What the per-step optimizer-state check costs (earlywarn/recover/statecheck.py), paired.

    python benchmarks/statecheck.py [--rounds 30] [--threads 2]

For two GPT sizes from examples/tinygpt.py under fused AdamW (the overhead benchmark's ~11M model
and the fast step's 0.44M one): after a real backward and step, times in alternating order (ABBA)
one training step, the guard's gradient-norm pass (what the guard already does every step) and
the state flag (walking the state and one fused norm over it), and prints medians and ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tinygpt import GPT, GPTConfig, param_count  # noqa: E402

from earlywarn.recover.statecheck import StateCheck  # noqa: E402


def measure(cfg: GPTConfig, batch: int, seq: int, rounds: int) -> None:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 128, (batch, seq))
    y = torch.randint(0, 128, (batch, seq))
    check = StateCheck(opt)
    grads = lambda: [p.grad for p in model.parameters() if p.grad is not None]  # noqa: E731

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()

    def norms() -> None:
        torch.stack(torch._foreach_norm(grads())).square().sum().item()

    def flag() -> None:
        check.flag(torch.device("cpu"), torch.float32).item()

    step()
    fns = {"training step": step, "gradient-norm pass": norms, "state flag": flag}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n_state = sum(t.numel() for t in check.tensors())
    print(f"{param_count(model) / 1e6:.2f}M params, state {n_state / 1e6:.2f}M floats, batch {batch} x {seq}, "
          f"{rounds} rounds ABBA (medians)")
    print(f"  training step        {med['training step']:9.3f} ms")
    print(f"  gradient-norm pass   {med['gradient-norm pass']:9.3f} ms")
    print(f"  state flag           {med['state flag']:9.3f} ms   = {med['state flag'] / med['training step']:.4f}x "
          f"of the step, {med['state flag'] / med['gradient-norm pass']:.2f}x the norm pass")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    measure(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256), 8, 256, args.rounds)
    measure(GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64), 8, 64, args.rounds * 5)


if __name__ == "__main__":
    main()
