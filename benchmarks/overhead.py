"""Step-time overhead of earlywarn vs the alternatives, measured side by side in one process.

    python benchmarks/overhead.py [--steps 12] [--threads 2]
    python benchmarks/overhead.py --agreement [--steps 60]   # DDP, gloo, 2 processes
    python benchmarks/overhead.py --fast [--rounds 10]       # where the guard's time goes on a ~18 ms step


GPT-like model (6 layers, d=384, 6 heads, seq 256, batch 8, ~11M params) on CPU, fused AdamW.
Variants run interleaved (round-robin, rotating order) so machine noise hits all of them alike;
"ratio" is the median step time over the bare step's median; "paired" is the median over rounds of
(variant time / bare time in the same round), which cancels slow drifts of a shared machine.

``--agreement``: the cost of making every rank decide the same (one SUM all-reduce of the small
statistics vector per step, with or without ``report_loss``) under DDP with gloo on 2 processes:
a bare DDP step, earlywarn with the agreement collective (the default), and earlywarn with it
removed (rank-local decisions, as before), interleaved; on a fast (~15 ms) and a slower step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import earlywarn  # noqa: E402
from tinygpt import GPT, GPTConfig, param_count  # noqa: E402


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-wandb", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (8, 256), generator=g)
    y = torch.randint(0, 128, (8, 256), generator=g)

    variants: dict[str, dict] = {}

    def add(name, setup):
        model, opt = make()
        extra, ctx = setup(model, opt)
        variants[name] = {"model": model, "opt": opt, "extra": extra, "ctx": ctx, "times": []}

    add("bare step", lambda m, o: (None, None))

    def with_earlywarn(m, o):
        ew = earlywarn.watch(m, o, sinks=[])
        return (lambda loss, logits: ew.report_loss(loss)), ew

    def with_report(m, o):  # issue 14: a signal of the user's own, the output logits' largest magnitude
        ew = earlywarn.watch(m, o, sinks=[])
        return (lambda loss, logits: (ew.report_loss(loss), ew.report("logit_max", logits.detach().abs().amax()))), ew

    add("+ earlywarn (sync)", with_earlywarn)
    add("+ earlywarn + ew.report(output logit max)", with_report)
    add("+ clip_grad_norm_(foreach=True)", lambda m, o: ((lambda loss, logits: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9, foreach=True)), None))
    add("+ per-param .norm().item() loop", lambda m, o: ((lambda loss, logits: [p.grad.norm().item() for p in m.parameters()]), None))

    wandb_run = None
    if not args.no_wandb:
        tmp = tempfile.mkdtemp(prefix="ew-bench-wandb-")
        for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": tmp, "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                     "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB__DISABLE_STATS": "true",
                     "WANDB__DISABLE_META": "true", "WANDB_DATA_DIR": f"{tmp}/data", "WANDB_CACHE_DIR": f"{tmp}/cache",
                     "WANDB_CONFIG_DIR": f"{tmp}/config"}.items():
            os.environ[k] = v
        import wandb

        def with_wandb(m, o):
            nonlocal wandb_run
            wandb_run = wandb.init(project="earlywarn-bench")
            wandb.watch(m, log="gradients", log_freq=1)
            return (lambda loss, logits: wandb_run.log({"loss": loss.item()})), None

        add('+ wandb.watch(log="gradients", log_freq=1)', with_wandb)

    def one_step(v):
        model, opt = v["model"], v["opt"]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits, loss = model(x, y)
        loss.backward()
        if v["extra"] is not None:
            v["extra"](loss, logits)
        opt.step()
        return time.perf_counter() - t0

    names = list(variants)
    for v in variants.values():  # warm-up: allocator, optimizer state, wandb hooks
        one_step(v)
        one_step(v)
    for r in range(args.steps):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            variants[name]["times"].append(one_step(variants[name]))

    # The stats pass alone vs one bare foreach norm over the same gradients (the bandwidth floor).
    ew = variants["+ earlywarn (sync)"]["ctx"]
    grads = [p.grad for p in variants["+ earlywarn (sync)"]["model"].parameters()]
    t_stats, t_norm = [], []
    for r in range(200):
        pair = [("stats", lambda: ew.statistics.stats.layer_sq_norms().cpu().numpy()), ("norm", lambda: torch._foreach_norm(grads))]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]):
            t0 = time.perf_counter()
            fn()
            (t_stats if name == "stats" else t_norm).append(time.perf_counter() - t0)

    # Decomposed: the guard's own cost, paired on the same gradients (guarded step, then the bare
    # optimizer step it wraps), far less exposed to noise than whole ~1 s steps.
    guarded_opt = variants["+ earlywarn (sync)"]["opt"]
    extra = []
    for r in range(60):
        t0 = time.perf_counter()
        guarded_opt.step()
        t1 = time.perf_counter()
        ew._install.real_step()
        t2 = time.perf_counter()
        extra.append((t1 - t0) - (t2 - t1))

    base = statistics.median(variants["bare step"]["times"])
    model = variants["bare step"]["model"]
    print(f"model: {param_count(model) / 1e6:.1f}M params, batch 8 x 256, fused AdamW, {torch.get_num_threads()} threads, "
          f"{args.steps} interleaved steps per variant (median)")
    print(f"{'variant':45s} {'ms/step':>9s} {'ratio':>7s} {'paired':>7s}")
    bare_times = variants["bare step"]["times"]
    for name in names:
        times = variants[name]["times"]
        med = statistics.median(times)
        # Paired: each round's time over the same round's bare step, so slow drifts cancel.
        paired = statistics.median(t / b for t, b in zip(times, bare_times))
        print(f"{name:45s} {med * 1e3:9.1f} {med / base:7.3f}x {paired:6.3f}x")
    # the same with a user signal reported before each step (its value computed beforehand: this
    # is earlywarn's part, one more slot in the statistics vector and one more detector channel)
    ew_u = variants["+ earlywarn + ew.report(output logit max)"]["ctx"]
    opt_u = variants["+ earlywarn + ew.report(output logit max)"]["opt"]
    value = torch.tensor(3.0)
    extra_u = []
    for r in range(60):
        t0 = time.perf_counter()
        ew_u.report("logit_max", value)
        opt_u.step()
        t1 = time.perf_counter()
        ew_u._install.real_step()
        t2 = time.perf_counter()
        extra_u.append((t1 - t0) - (t2 - t1))
    guard_cost = statistics.median(extra)
    print(f"{'earlywarn guard cost, paired (60 reps)':45s} {guard_cost * 1e3:9.2f} -> {1 + guard_cost / base:.4f}x of the bare step")
    cost_u = statistics.median(extra_u)
    print(f"{'  the same with ew.report (one user signal)':45s} {cost_u * 1e3:9.2f} -> {1 + cost_u / base:.4f}x of the bare step")
    ms, mn = statistics.median(t_stats), statistics.median(t_norm)
    print(f"{'earlywarn stats pass (norms + 1 host read)':45s} {ms * 1e3:9.2f} {ms / mn:7.3f}x of one bare torch._foreach_norm ({mn * 1e3:.2f} ms)")
    # the step's LR for the detector (issue 14): a host read of param_groups, inside the guard cost above
    import timeit

    from earlywarn.capture.updates import learning_rate
    t_lr = min(timeit.repeat(lambda: learning_rate(guarded_opt), number=1000, repeat=5)) / 1000
    print(f"{'LR capture (host read of param_groups)':45s} {t_lr * 1e6:9.2f} us -> {1 + t_lr / base:.6f}x of the bare step")
    ew.close()
    ew_u.close()
    if wandb_run is not None:
        wandb_run.finish()


def _agreement_worker(rank: int, port: int, steps: int, out: "torch.multiprocessing.Queue") -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = []
    for label, cfg, batch in (("2-layer GPT, d=128, seq 64 (fast step)", GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64), 8),
                              ("4-layer GPT, d=256, seq 128", GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128), 8)):
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 128, (batch, cfg.block_size), generator=g)
        y = torch.randint(0, 128, (batch, cfg.block_size), generator=g)
        variants = {}
        for name in ("bare DDP step", "+ earlywarn, rank-local decisions", "+ earlywarn, agreement all-reduce"):
            torch.manual_seed(0)
            model = DDP(GPT(cfg))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            ew = None
            if name != "bare DDP step":
                ew = earlywarn.watch(model, opt, sinks=[], recovery=earlywarn.RecoveryConfig(snapshot_every=0, rewind=False))
                if "rank-local" in name:
                    ew.statistics.reducer = None  # what the watcher did before without report_loss
            variants[name] = (model, opt, ew, [])

        def step(model, opt) -> float:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            return time.perf_counter() - t0

        names = list(variants)
        for v in variants.values():
            step(v[0], v[1]), step(v[0], v[1])
        for r in range(steps):
            for name in names[r % 3:] + names[: r % 3]:  # the same order on both ranks
                model, opt, ew, times = variants[name]
                times.append(step(model, opt))
        # the collective alone, on the vector the watcher builds
        ew = variants["+ earlywarn, agreement all-reduce"][2]
        vec = torch.zeros(ew.layer_map.num_layers + 2, dtype=torch.float64)
        t_coll = []
        for _ in range(300):
            t0 = time.perf_counter()
            ew.statistics.reducer.reduce(vec)
            t_coll.append(time.perf_counter() - t0)
        bare = variants["bare DDP step"][3]
        row = {"label": label, "bare_ms": statistics.median(bare) * 1e3, "coll_us": statistics.median(t_coll) * 1e6}
        local = variants["+ earlywarn, rank-local decisions"][3]
        agree = variants["+ earlywarn, agreement all-reduce"][3]
        row["local_paired"] = statistics.median(a / b for a, b in zip(local, bare))
        row["agree_paired"] = statistics.median(a / b for a, b in zip(agree, bare))
        row["agree_vs_local"] = statistics.median(a / b for a, b in zip(agree, local))
        results.append(row)
        for _, _, ew_, _ in variants.values():
            if ew_ is not None:
                ew_.close()
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def agreement(steps: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_agreement_worker, args=(r, port, steps, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = q.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"DDP, gloo, 2 processes x 1 thread, fused AdamW, {steps} interleaved steps per variant; paired medians")
    print(f"{'model':42s} {'bare ms':>8s} {'rank-local':>11s} {'agreement':>10s} {'agree/local':>12s} {'all-reduce':>11s}")
    for r in results:
        print(f"{r['label']:42s} {r['bare_ms']:8.1f} {r['local_paired']:10.4f}x {r['agree_paired']:9.4f}x "
              f"{r['agree_vs_local']:11.4f}x {r['coll_us']:8.0f} us")
    print("agree/local: the cost of every rank deciding the same (one all-reduce of the statistics vector per step)")


def fast(rounds: int, block: int) -> None:
    """Where the guard's time goes on a fast (~18 ms) CPU step: forward, backward and step timed
    apart, the bare step and the watched one in alternating blocks (same data, same order)."""
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)
    variants = {}
    for name in ("bare", "watched"):
        torch.manual_seed(0)
        m = GPT(cfg)
        o = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        ew = earlywarn.watch(m, o, sinks=[]) if name == "watched" else None
        variants[name] = (m, o, ew, [])
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 128, (8, 64), generator=g), torch.randint(0, 128, (8, 64), generator=g))
            for _ in range(block)]

    def one(m, o, ew, out, x, y):
        t0 = time.thread_time()
        o.zero_grad(set_to_none=True)
        _, loss = m(x, y)
        t1 = time.thread_time()
        if ew is not None:
            ew.report_loss(loss)
        loss.backward()
        t2 = time.thread_time()
        o.step()
        out.append((t1 - t0, t2 - t1, time.thread_time() - t2))

    for r in range(rounds + 1):  # round 0 warms up
        for name in (("bare", "watched") if r % 2 else ("watched", "bare")):
            m, o, ew, out = variants[name]
            for x, y in data:
                one(m, o, ew, out if r else [], x, y)
    bare, watched = variants["bare"][3], variants["watched"][3]
    mean = lambda v: sum(v) / len(v)  # noqa: E731 - means: the snapshot steps count too
    print(f"GPT 2 layers, d=128 ({param_count(variants['bare'][0]) / 1e6:.2f}M params), batch 8 x 64, fused AdamW, "
          f"1 thread; {rounds} rounds x {block} steps per variant, alternating; thread CPU time, means")
    for k, part in enumerate(("forward", "backward", "optimizer.step")):
        b, w = mean([t[k] for t in bare]) * 1e3, mean([t[k] for t in watched]) * 1e3
        print(f"  {part:15s} bare {b:7.3f} ms   watched {w:7.3f} ms   +{(w - b) * 1e3:6.0f} us")
    b, w = mean([sum(t) for t in bare]), mean([sum(t) for t in watched])
    print(f"  {'whole step':15s} bare {b * 1e3:7.3f} ms   watched {w * 1e3:7.3f} ms   {w / b:.4f}x")
    variants["watched"][2].close()


if __name__ == "__main__":
    if "--fast" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--fast", action="store_true")
        ap.add_argument("--rounds", type=int, default=10)
        ap.add_argument("--block", type=int, default=100)
        a = ap.parse_args()
        fast(a.rounds, a.block)
    elif "--agreement" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--agreement", action="store_true")
        ap.add_argument("--steps", type=int, default=60)
        agreement(ap.parse_args().steps)
    else:
        main()
