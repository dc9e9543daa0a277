"""The GPU check of the gradient guard (issue #2): no host sync on its hot path, and what it costs.

    python benchmarks/gpu_check.py [--steps 50] [--batch 8] [--seq 1024]
    python benchmarks/gpu_check.py --cpu-smoke      # the same code on a tiny model, on the CPU

One prepared script for a session that is lent a GPU (a few minutes of device time). GPT-2 small
(12 layers, d=768, 12 heads, vocab 50304, seq 1024) in bf16 autocast with fused AdamW, earlywarn
in its default mode for that setup (``auto`` -> ``async``: the per-layer norms go to pinned host
memory with a non-blocking copy and are read one step late; the fused optimizer skips a
non-finite step on the device).

1. Warm-up (kernels, allocator, earlywarn's first snapshot), then ``--steps`` rounds that
   alternate a bare step and an earlywarn step, each timed with CUDA events. Every earlywarn step
   runs under ``torch.cuda.set_sync_debug_mode("error")``: a host sync in the hook raises.
   Prints median ms/step of both and the paired ratio (median of per-round ratios).
2. One step with an inf gradient (a hook on one weight), under ``set_sync_debug_mode("warn")``
   for it and the step after: the step must be skipped (the weight unchanged) and reported one
   step late; the syncs an incident costs (if any) are counted, not hidden.

Without CUDA (and without ``--cpu-smoke``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import earlywarn  # noqa: E402
from tinygpt import GPT, GPTConfig, param_count  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, no sync check")
    a = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        print("no CUDA device here: nothing to check (use --cpu-smoke to exercise the script)")
        return 0
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        cfg = GPTConfig(vocab_size=50304, block_size=a.seq, n_layer=12, n_head=12, n_embd=768)
        amp = dict(device_type="cuda", dtype=torch.bfloat16)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        a.seq, a.batch, a.steps, a.warmup = 64, 2, min(a.steps, 6), 2
        cfg = GPTConfig(vocab_size=128, block_size=a.seq, n_layer=2, n_head=2, n_embd=32)
        amp = dict(device_type="cpu", dtype=torch.bfloat16)

    def make():
        torch.manual_seed(0)
        model = GPT(cfg).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)

    bare_model, bare_opt = make()
    ew_model, ew_opt = make()
    ew = earlywarn.watch(ew_model, ew_opt, sinks=[])
    print(f"model: {param_count(bare_model) / 1e6:.0f}M params, batch {a.batch} x {a.seq}, fused AdamW, "
          f"bf16 autocast; earlywarn mode: {ew.mode}")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev)

    def step(model, opt, guarded: bool) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(**amp):
            _, loss = model(x, y)
        if guarded:
            ew.report_loss(loss)  # stays on the device
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step(bare_model, bare_opt, False)
        step(ew_model, ew_opt, True)
    if cuda:
        torch.cuda.synchronize()

    # -- 1. clean steps: bare and earlywarn alternating; earlywarn's under sync_debug_mode("error")
    bare_ms, ew_ms = [], []
    for _ in range(a.steps):
        if cuda:
            b0, b1, e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            b0.record()
            step(bare_model, bare_opt, False)
            b1.record()
            torch.cuda.set_sync_debug_mode("error")  # a host sync in the guarded step raises
            try:
                e0.record()
                step(ew_model, ew_opt, True)
                e1.record()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            bare_ms.append(b0.elapsed_time(b1))
            ew_ms.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            step(bare_model, bare_opt, False)
            t1 = time.perf_counter()
            step(ew_model, ew_opt, True)
            bare_ms.append(1e3 * (t1 - t0))
            ew_ms.append(1e3 * (time.perf_counter() - t1))
    ratios = [e / b for b, e in zip(bare_ms, ew_ms)]
    print(f"{a.steps} earlywarn steps under set_sync_debug_mode('error'): "
          f"{'no host sync raised' if cuda else 'not checked (CPU smoke run)'}")
    print(f"bare step      {statistics.median(bare_ms):8.2f} ms  (median of {a.steps})")
    print(f"earlywarn step {statistics.median(ew_ms):8.2f} ms  -> {statistics.median(ew_ms) / statistics.median(bare_ms):.4f}x; "
          f"paired {statistics.median(ratios):.4f}x (median of per-round ratios)")

    # -- 2. one inf gradient: skipped on the device, reported one step late
    mid = len(ew_model.blocks) // 2
    weight = ew_model.blocks[mid].fc.weight
    before = weight.detach().clone()
    handle = weight.register_hook(lambda grad: grad * float("inf"))
    syncs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step(ew_model, ew_opt, True)
            handle.remove()
            after_fault = weight.detach().clone()
            step(ew_model, ew_opt, True)  # the fault step's statistics are read here
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    ew.flush()
    skipped = torch.equal(before, after_fault)
    c = ew.counters
    print(f"inf gradient in blocks.{mid}.fc: weight unchanged by that step: {skipped}; "
          f"counters: skipped_steps={c['skipped_steps']}, nonfinite_steps={c['nonfinite_steps']}, "
          f"alerts_critical={c['alerts_critical']}; host syncs during the incident: {len(syncs)}")
    for s in syncs[:5]:
        print(f"   sync: {s[:160]}")
    ew.close()
    ok = skipped and c["skipped_steps"] >= 1 and c["nonfinite_steps"] >= 1
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
