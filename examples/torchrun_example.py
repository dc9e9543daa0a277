"""Data-parallel training with earlywarn, launched by torchrun (CPU/gloo or CUDA/NCCL).

    torchrun --nproc_per_node 2 examples/torchrun_example.py            # DDP
    torchrun --nproc_per_node 2 examples/torchrun_example.py --fsdp     # FSDP2 (fully_shard)

A small GPT on real text (the Python standard library's source, no download). At step 12 one
gradient on rank 1 alone turns non-finite after the all-reduce (a hardware fault); rank 0's
gradients are fine. Every rank must skip that step: a rank that stepped while another skipped
would leave the replicas (or the shards) out of step for good. At the end each rank prints a
digest of the whole model: all ranks print the same one.

What earlywarn adds to the loop is marked ``# earlywarn``: one ``watch`` call, ``report_loss``.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

import earlywarn
from tinygpt import GPT, CharDataset, GPTConfig, stdlib_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=12, help="step at which rank 1's gradient is corrupted (-1: none)")
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # several processes share the CPU cores

    # Every rank reads its own shard of the data; the loader knows its exact position.
    data = CharDataset(stdlib_text(400_000), block_size=64)
    shard = Subset(data, range(rank, len(data), world))
    loader = earlywarn.ResumableLoader(shard, batch_size=8, seed=0, fingerprint=f"{data.fingerprint}/{rank}-of-{world}")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = DDP(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)

    # earlywarn: every rank builds its watcher; the statistics are made identical on every
    # rank (DDP: they already are; FSDP2 or a reported loss: one small all-reduce per step),
    # so every rank takes the same decision. Only rank 0 writes to the console / trackers.
    # The defaults (snapshots, repair, rewind) work on FSDP2's shards too, with no gather.
    ew = earlywarn.watch(wrapped, opt, loader=loader, sinks=["console"])

    step = 0
    while step < args.steps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            _, loss = wrapped(x, y)
            loss.backward()
            if step == args.fault_step and rank == 1:
                # A fault on one rank only, after the gradients were reduced (a flipped bit, a
                # bad kernel): an inf in rank 1's copy (DDP) or shard (FSDP2) of one gradient.
                grad = model.blocks[0].fc.weight.grad
                (grad.to_local() if args.fsdp else grad)[0, 0] = float("inf")
            ew.report_loss(loss)  # earlywarn: averaged over ranks with the statistics (no extra sync)
            opt.step()
            step += 1
            if step >= args.steps:
                break

    summary = ew.summary()
    ew.close()
    params = [p.detach() for p in model.parameters()]
    if args.fsdp:
        params = [p.full_tensor() for p in params]  # gather: every rank then holds the whole model
    digest = hashlib.sha256(b"".join(p.float().cpu().numpy().tobytes() for p in params)).hexdigest()[:16]
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    print(f"rank {rank}: {summary['steps']} steps, {summary['skipped_steps']} skipped, "
          f"params finite={finite}, digest={digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
