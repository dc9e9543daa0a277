"""Host RAM and time of in-memory snapshots for a peft LoRA model (issue 22, item 4).

    python benchmarks/lora_snapshots.py [--steps 77] [--layers 8] [--hidden 512]

A Llama from a tiny config (random init, no download; ~110 MB of fp32 weights at the defaults)
with LoRA r=8 on q_proj / v_proj, AdamW over the adapters, snapshots every 5 steps (ring of 3
clean + 1), real text-free random tokens. Prints the frozen base's size, the unique host bytes the
snapshots hold (shared storage once, the model's own tensors not at all), the process's RSS growth
over the run, and the median step time on snapshot steps against the others.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import earlywarn
from earlywarn.recover import RecoveryConfig
from earlywarn.recover._tree import leaves


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=77)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--snapshot-every", type=int, default=5, help="0: no snapshots (the RSS baseline)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    notes: list[str] = []
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(snapshot_every=args.snapshot_every, snapshot_keep=3,
                                                                    rewind=args.snapshot_every > 0))
    ew.recovery.report_plan(0, write=notes.append)
    g = torch.Generator().manual_seed(0)
    start = rss()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.steps):
        ids = torch.randint(0, 2048, (2, 65), generator=g)
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        before = len(ew.recovery.ring or ())
        last = ew.recovery._last_snapshot_step
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        times[ew.recovery._last_snapshot_step != last or len(ew.recovery.ring or ()) != before].append(dt)
    ew.recovery.settle()
    grown = rss() - start
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, held = set(), 0
    for snap in (ew.recovery.ring.entries if ew.recovery.ring is not None else []):
        for _, t in leaves(snap.state):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in live and ptr not in seen:
                seen.add(ptr)
                held += t.untyped_storage().nbytes()
    ew.close()
    print(notes[0])
    print(f"frozen base {frozen / 1e6:.1f} MB, adapters {trained / 1e6:.2f} MB; {len(ew.recovery.ring or ())} snapshots "
          f"in the ring after {args.steps} steps")
    print(f"host bytes the snapshots hold: {held / 1e6:.2f} MB = {held / frozen:.1%} of the frozen base (target <= 25%)")
    print(f"RSS growth over the run: {grown / 1e6:.1f} MB")
    snap_ms = statistics.median(times[True]) * 1e3 if times[True] else float("nan")
    print(f"optimizer.step (guard included): {statistics.median(times[False]) * 1e3:.2f} ms on other steps, "
          f"{snap_ms:.2f} ms on the {len(times[True])} snapshot steps (medians)")


if __name__ == "__main__":
    main()
