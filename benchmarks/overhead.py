"""Per-step overhead of earlywarn, paired and interleaved, on several model shapes (issue 23).

    python benchmarks/overhead.py [--rounds 12] [--block 25] [--shapes small,gpt,lora,tinylm,cnn,moe,gpt+clip]
    python benchmarks/overhead.py --profile gpt [--steps 300]     # where one step's host work goes (step_profile.py)
    python benchmarks/overhead.py --knockout gpt [--rounds 8]     # what each part costs, paired (step_profile.py)
    python benchmarks/overhead.py --cold gpt [--steps 200]        # a call's price right after backward (step_profile.py)
    python benchmarks/overhead.py --against REV [--shapes ...]    # the working tree's guard vs git REV's, paired
    python benchmarks/overhead.py --least gpt [--rounds 10]       # the least guard at rarer cadences, paired
    python benchmarks/overhead.py --alternatives [--steps 12]     # 11M GPT: vs clip, wandb.watch, .item()
    python benchmarks/overhead.py --agreement [--steps 60]        # DDP, gloo, 2 processes

The table (default): for each shape (``benchmarks/step_shapes.py``) up to seven copies of the same model
and data train side by side in one process -- the bare loop, the bare loop again (the A/A control:
what the machine's noise alone makes of two identical variants), the bare loop with torch's norm
pass over the gradients right after backward (the floor of any gradient guard), the bare loop with
one ``clip_grad_norm_`` there (what a loop that clips pays; both timed in place as the guard is, and
not for ``+clip`` shapes, which clip already), the least guard (:class:`LeastGuard`: the norm pass,
its read and decision, the state check and the snapshot copy at the defaults' cadences, nothing
else; in place too), ``watch(sinks=[])`` (the guard
alone) and ``watch()`` with the default sinks -- one step each in turn, the order reversed every
other turn (ABBA), so that they share the machine's every moment; ``--block`` turns make a round,
whose means include the amortised snapshots. "paired" is the median over rounds of (the
variant's mean step / the bare one's, same round); the range is the rounds' min..max. Besides, the guard's
own host time is timed in place on the thread's CPU clock (``optimizer.step()`` less the update
inside it, plus ``report_loss`` and the batch fingerprint), which the machine's noise barely
touches: its median over rounds, over the bare step, is the estimate the goals are judged on.
``small`` relates it to one ``clip_grad_norm_(foreach=True)`` over the same gradients, and prints
beside it the net figure: the watched ``optimizer.step()`` less the bare one, paired by round. The
in-place figure overstates it by what the guard does first and the update inside it then finds
done (each new gradient's Python object: ``--cold`` measures that share, ~90 us of small's ~1.5
ms), but it is far steadier: the net column's A/A value is its noise (~0.1x of a clip). ``gpt+clip``:
every variant clips at 1.0 (earlywarn reads the clip's own per-tensor norms: one norm pass).
After the table, each goal beside the least guard: the room it leaves for everything else (the
detector, the per-layer sums, the fingerprint, the metric row, the bookkeeping), and how much of
it the guard spends there. A goal below its least guard cannot be met at the defaults' cadences.
``moe`` (no goal in the issue: a shape it did not name) routes 8 tokens to 8 experts a layer, so
which parameters have a gradient changes from step to step. Held out from the default shapes:
``moe_wide``, ``vit``, ``unet``, ``gru`` (``--shapes vit,unet,gru``; step_shapes.py says what they are).

``--against REV``: the guard's in-place host time of the working tree against that of git revision
``REV`` (its ``earlywarn/`` package, imported under another name; sinks from the working tree's
``integrations/``), both with the default sinks, side by side in one process (ABBA) with the bare
loop and the least guard: a change of ~50 us per step shows through the machine's noise, which two
separate runs of the table do not; each revision's part beyond the least guard is paired by round.
Not for a loop that clips: both packages would wrap torch's clip functions.

``--profile`` and ``--knockout``: where one step's host work goes (``benchmarks/step_profile.py``).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import earlywarn  # noqa: E402
from earlywarn.capture.norms import NormPlan, NormSum  # noqa: E402
from tinygpt import GPT, GPTConfig, param_count  # noqa: E402


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt


def alternatives() -> None:
    """The 11M-parameter GPT (~1 s steps): earlywarn against the alternatives, side by side."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--alternatives", action="store_true")
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


# -- the table (issue 23) ----------------------------------------------------------------------------

GOALS = {  # (shape, variant) -> the goal: a ratio at most this
    ("small", "defaults"): 0.5, ("small", "guard alone"): 0.3,
    ("gpt", "defaults"): 1.02, ("lora", "defaults"): 1.03, ("tinylm", "defaults"): 1.03,
    ("cnn", "defaults"): 1.03, ("gpt+clip", "defaults"): 1.02,
}
NORM_FLOOR, CLIP_FLOOR = "the norm pass alone", "one clip in place"
"""Two variants without earlywarn, each timed in place as the guard is, right after backward on
the caches it leaves: torch's own norm pass over the gradients (``get_total_norm(foreach=True)``),
the floor of any guard that reads them, and a whole ``clip_grad_norm_(foreach=True)`` (max_norm
1e9: the factor is 1, the gradients unchanged; torch still multiplies them by it), what a loop
that clips pays."""
LEAST_GUARD = "the least guard"
"""A third variant without earlywarn, timed in place as the guard is: the work that no guard with
the defaults' responses can skip, hand-written with nothing else (:class:`LeastGuard`). Each
goal is within reach only where this row is well below it."""
FLOORS = (NORM_FLOOR, CLIP_FLOOR, LEAST_GUARD)
VARIANTS = ("bare", "bare again (A/A)", *FLOORS, "guard alone", "defaults")


class LeastGuard:
    """The least a guard that skips, repairs and rewinds does per step, at the defaults' cadences:

    - every step, the per-tensor norms of the gradients (the cheapest pass known here:
      ``earlywarn.capture.norms.NormPlan``, planned once), their total read on the host once,
      and the decision (a non-finite total skips);
    - every ``state_every`` steps, the optimizer state's finiteness (one norm sum, read);
    - every ``copy_every`` steps, a copy of the parameters and the optimizer state into host
      buffers kept from the first copy (what a rewind restores).

    No detector, no per-layer sums, no batch fingerprint, no metric row, no bookkeeping: what is
    left of a guard's price when all of that costs nothing."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, copy_every: int = 25,
                 state_every: int = 10) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.copy_every, self.state_every = copy_every, state_every
        self.plans: dict = {}
        self.copies: list[torch.Tensor] | None = None
        self.i = 0
        self.skipped = 0
        self.state_sum = None
        self.state_finite = True

    def _state(self) -> list[torch.Tensor]:
        return [t for st in self.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0]

    def __call__(self, clipped: torch.Tensor | None = None) -> None:
        """One step's work; ``clipped``: the total norm the loop's ``clip_grad_norm_`` returned
        (its norm pass serves, as earlywarn shares it: only the read is left)."""
        if clipped is not None:
            total = clipped.item()
        else:
            every = [p.grad for p in self.params]
            grads = [g for g in every if g is not None]
            # planned once per set of gradients present (an MoE's idle experts have none)
            key = len(grads) if len(grads) == len(every) else tuple(g is not None for g in every)
            plan = self.plans.get(key)
            if plan is None:
                plan = self.plans[key] = NormPlan(grads)
            total = torch.linalg.vector_norm(plan.norms(grads, torch.float32)).item()
        if not total < float("inf"):
            self.skipped += 1
            for p in self.params:
                p.grad = None  # the update then leaves them alone
        check, copy = self.i % self.state_every == 0, self.i % self.copy_every == 0
        state = self._state() if check or copy else []  # walked once for both
        if check and state:
            if self.state_sum is None or self.state_sum[0] != len(state):
                self.state_sum = (len(state), NormSum(state))  # planned once (torch.optim keeps its tensors)
            flag = self.state_sum[1].total(state, state[0].device, torch.float32)
            self.state_finite = flag.item() < float("inf")
        if copy:
            live = [p.detach() for p in self.params] + state
            if self.copies is None or len(self.copies) != len(live):
                self.copies = [torch.empty_like(t, device="cpu") for t in live]
            torch._foreach_copy_(self.copies, live)
        self.i += 1


def _on_thread_clock(fn, record):
    """``fn``, passing the thread CPU time of each call to ``record``."""
    def timed(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.thread_time() - t0)
    return timed


class _Run:
    """One variant of one shape: its own model, optimizer and watcher; ``step()`` is the loop's.

    Timed per step: the whole step (wall, thread CPU), and for a watched variant the guard's
    host work in place -- ``optimizer.step()`` less the optimizer's own update inside it, plus
    ``report_loss`` and the forward pre-hook's fingerprint -- on the thread's CPU clock."""

    def __init__(self, shape: str, variant: str, out_dir: str, *, timed: bool = True, package=earlywarn) -> None:
        from step_shapes import SHAPES

        self.clip = shape.endswith("+clip")
        self.model, self.opt, self.loss_of = SHAPES[shape.removesuffix("+clip")](0)
        self.ew = None
        if variant == "guard alone":
            self.ew = package.watch(self.model, self.opt, sinks=[])
        elif variant == "defaults":
            os.environ["EARLYWARN_OUTPUT_DIR"] = os.path.join(out_dir, shape, package.__name__)
            self.ew = package.watch(self.model, self.opt)
        self.floor = variant if variant in FLOORS else None
        self.least = LeastGuard(self.model, self.opt) if variant == LEAST_GUARD else None
        self.inner = 0.0  # CPU time of the update itself and of the fingerprints, this step
        if self.ew is not None and timed:
            self.ew._install.real_step = self._timed(self.ew._install.real_step, sign=1)
            fps = self.ew.recovery.fingerprints
            fps.observe = self._timed(fps.observe, sign=-1)  # counted as the guard's, outside step()
        self.i = 0

    def _timed(self, fn, sign: int):
        def add(dt: float) -> None:
            self.inner += sign * dt
        return _on_thread_clock(fn, add)

    def step(self) -> tuple[float, float, float, float]:
        """(wall, thread CPU, optimizer.step() CPU, the guard's host CPU) of one step."""
        w0, c0 = time.perf_counter(), time.thread_time()
        self.inner = 0.0
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_of(self.i)
        r0 = time.thread_time()
        if self.ew is not None:
            self.ew.report_loss(loss)
        r1 = time.thread_time()
        loss.backward()
        clipped = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0) if self.clip else None
        f0 = time.thread_time()
        if self.floor == NORM_FLOOR:
            torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None], foreach=True)
        elif self.floor == CLIP_FLOOR:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9, foreach=True)
        elif self.least is not None:
            self.least(clipped)
        s0 = time.thread_time()
        self.opt.step()
        s1 = time.thread_time()
        self.i += 1
        guard = (s1 - s0) - self.inner + (r1 - r0) if self.ew is not None else s0 - f0 if self.floor else 0.0
        return time.perf_counter() - w0, time.thread_time() - c0, s1 - s0, guard

    def clip_time(self) -> float:
        """CPU time of one clip_grad_norm_(foreach=True) over this model's current gradients
        (max_norm so large that the factor is 1: the same work, the gradients unchanged)."""
        t0 = time.thread_time()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9, foreach=True)
        return time.thread_time() - t0

    def close(self) -> None:
        if self.ew is not None:
            self.ew.close()


_FIGURES = ("wall", "cpu", "step", "guard", "clip")

WARM = 110
"""Steps every run takes before any is timed: the detector's warm-up and the first snapshots.
Until the ring of snapshots is full (steps 0, 25, 50 and 75 at the default cadence) each snapshot
allocates its buffers and plans its copy, walking the whole state (~1 ms more than a planned copy
on small); from step 100 on each reuses an evicted one's buffers and plan (moe's idle experts get
optimizer state as they are first routed: its last plan is made at step 100). Those are a run's
one-time costs, not its per-step price."""


def _interleave(runs: dict[str, _Run], rounds: int, block: int, warm: int, *,
                clip: bool = False) -> dict[str, dict[str, list[float]]]:
    """The runs step in turn, one step each, the order reversed every other turn (ABBA), so that
    they share the machine's every moment; a round is ``block`` turns. Per round and run, the
    mean of each figure of :meth:`_Run.step` and (``clip``) of one clip after each step. Closes
    the runs."""
    order = list(runs)
    for run in runs.values():  # warm-up: detector baselines, optimizer state, the first snapshots
        for _ in range(warm):
            run.step()
    rec = {k: {f: [] for f in _FIGURES} for k in order}
    for r in range(rounds):
        sums = {k: [0.0] * len(_FIGURES) for k in order}
        for turn in range(block):
            for k in (order if turn % 2 == 0 else order[::-1]):
                acc = sums[k]
                for j, t in enumerate((*runs[k].step(), runs[k].clip_time() if clip else 0.0)):
                    acc[j] += t
        for k in order:
            for j, f in enumerate(_FIGURES):
                rec[k][f].append(sums[k][j] / block)
    for run in runs.values():
        run.close()
    return rec


def _measure(shape: str, rounds: int, block: int, warm: int, out_dir: str) -> dict[str, dict[str, list[float]]]:
    """The table's variants of ``shape``, interleaved (:func:`_interleave`); ``small`` with a clip."""
    # a loop that clips has paid for torch's norm pass and clip already (the least guard reads its norm)
    variants = [v for v in VARIANTS if not (v in (NORM_FLOOR, CLIP_FLOOR) and shape.endswith("+clip"))]
    return _interleave({v: _Run(shape, v, out_dir) for v in variants}, rounds, block, warm, clip=shape == "small")


def _paired(xs: list[float], base: list[float]) -> tuple[float, float, float]:
    ratios = [x / b for x, b in zip(xs, base)]
    return statistics.median(ratios), min(ratios), max(ratios)


def table() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=25, help="turns per round (a snapshot every 25 steps)")
    ap.add_argument("--warm", type=int, default=WARM)
    ap.add_argument("--shapes", default="small,gpt,lora,tinylm,cnn,moe,gpt+clip")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out_dir = tempfile.mkdtemp(prefix="ew-overhead-")
    print(f"one torch thread; {args.rounds} rounds x {args.block} steps per variant, one step each in turn (ABBA); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    print("| shape | variant | bare step | guard host time / step (in place) | as x of the bare step | "
          "whole step, paired (wall) | rounds min..max | thread CPU, paired | goal | met |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    reach: list[str] = []  # per goal: the goal beside the least guard's figure and the guard's
    for shape in args.shapes.split(","):
        rec = _measure(shape, args.rounds, args.block, args.warm, out_dir)
        bare = rec["bare"]
        ests: dict[str, float] = {}
        for v in list(rec)[1:]:
            goal = GOALS.get((shape, v))
            guard = statistics.median(rec[v]["guard"])
            wall, lo, hi = _paired(rec[v]["wall"], bare["wall"])
            cpu = _paired(rec[v]["cpu"], bare["cpu"])[0]
            if shape == "small":  # optimizer.step()'s extra time, in clip_grad_norm_ calls (same gradients)
                clip = statistics.median(rec[v]["clip"])
                base = f"step() {statistics.median(bare['step']) * 1e3:.2f} ms; clip {clip * 1e6:.0f} us"
                est = statistics.median(g / c for g, c in zip(rec[v]["guard"], rec[v]["clip"])) if guard else 0.0
                # the net figure: step() less the bare loop's, same round (its A/A row is the noise)
                net = statistics.median((s - b) / c for s, b, c in zip(rec[v]["step"], bare["step"], rec[v]["clip"]))
                est_s = f"{est:.3f}x of one clip_grad_norm_ " + (
                    "(before step(): no net figure)" if v in FLOORS else f"(step() paired: {net:+.3f}x)")
            else:
                base = f"{statistics.median(bare['cpu']) * 1e3:.2f} ms"
                est = 1 + statistics.median(g / b for g, b in zip(rec[v]["guard"], bare["cpu"]))
                est_s = f"{est:.4f}x"
            ests[v] = est
            met = "-" if goal is None else ("yes" if est <= goal else "**no**")
            print(f"| {shape} | {v} | {base} | {guard * 1e6:.0f} us | {est_s} | {wall:.4f}x | {lo:.3f}..{hi:.3f} | "
                  f"{cpu:.4f}x | {'-' if goal is None else f'<= {goal}x'} | {met} |", flush=True)
        least = ests.get(LEAST_GUARD)
        for v, est in ests.items():
            goal = GOALS.get((shape, v))
            if goal is not None and least is not None:
                room, beyond = goal - least, est - least
                said = (f"{room:+.3f} clips for everything else (the guard spends {beyond:+.3f} there)"
                        if shape == "small" else
                        f"{room:+.2%} of the step for everything else (the guard spends {beyond:+.2%} there)")
                reach.append(f"{shape} {v}: goal <= {goal}x; the least guard {least:.4f}x, leaving " + said
                             + ("" if room > 0 else ": the goal is below the floor"))
    if reach:
        print("Within reach? Each goal beside the least guard (the norm pass, its read and decision, the state "
              "check and the snapshot copy at the defaults' cadences, and nothing else):")
        for line in reach:
            print("  " + line)
    print(f"load average {os.getloadavg()[0]:.1f} at the end. 'met' judges the in-place estimate (the guard's "
          "own host time over the bare step's CPU time); the paired whole-step columns check it, to within "
          "what the A/A rows show of the machine's noise. small's 'step() paired': the watched step() less the "
          "bare one, same round, in clips -- the net extra time, which the in-place figure overstates by what "
          "the guard does first and the update then skips (the gradients' first read: overhead.py --cold "
          "small); far noisier, its A/A row is its noise")


# -- the least guard at other cadences ---------------------------------------------------------------
LEAST_CADENCES = {  # name -> (copy_every, state_every); None: at the first step only, never after
    "the defaults' cadences (a copy every 25 steps, a state check every 10)": (25, 10),
    "no state check (a copy every 25)": (25, None),
    "a copy every 100, no state check": (100, None),
    "the norms, their read and the decision only": (None, None),
}


def least() -> None:
    """``--least SHAPE``: the least guard at rarer cadences than the defaults', side by side (ABBA):
    what a goal would leave if a guard gave up state checks or snapshots to meet it."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--least", required=True, metavar="SHAPE")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=25)
    ap.add_argument("--warm", type=int, default=WARM)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out_dir = tempfile.mkdtemp(prefix="ew-least-")
    never = 1 << 62
    runs = {"bare": _Run(args.least, "bare", out_dir)}
    for name, (copy_every, state_every) in LEAST_CADENCES.items():
        run = runs[name] = _Run(args.least, LEAST_GUARD, out_dir)
        run.least = LeastGuard(run.model, run.opt, copy_every=copy_every or never, state_every=state_every or never)
    rec = _interleave(runs, args.rounds, args.block, args.warm)
    bare = rec["bare"]["cpu"]
    goal = GOALS.get((args.least, "defaults"))
    print(f"{args.least}: the least guard in place, {args.rounds} rounds x {args.block} steps, ABBA; bare step "
          f"{statistics.median(bare) * 1e3:.2f} ms; the goal {'-' if goal is None else f'<= {goal}x'}")
    print("| cadence | host time / step (in place) | as x of the bare step |")
    print("|---|---:|---:|")
    for name in LEAST_CADENCES:
        g = rec[name]["guard"]
        est = 1 + statistics.median(x / b for x, b in zip(g, bare))
        print(f"| {name} | {statistics.median(g) * 1e6:.0f} us | {est:.4f}x |", flush=True)


# -- the working tree against an earlier revision ------------------------------------------------------
def _earlywarn_at(rev: str):
    """``earlywarn/`` as of git revision ``rev``, imported as ``earlywarn_at_<rev>`` (its imports
    rewritten; its tracker sinks are the working tree's, ``integrations/`` lives outside it)."""
    import importlib
    import re
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    name = "earlywarn_at_" + re.sub(r"\W", "_", rev)
    tmp = tempfile.mkdtemp(prefix="ew-against-")
    tar = subprocess.run(["git", "-C", root, "archive", rev, "earlywarn"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
    os.rename(os.path.join(tmp, "earlywarn"), os.path.join(tmp, name))
    for folder, _, files in os.walk(os.path.join(tmp, name)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path) as fh:
                    src = fh.read()
                src = re.sub(r"\bearlywarn(?=[. ]|$)", name, src, flags=re.M)
                src = src.replace(f"{name}.integrations", "earlywarn.integrations")
                with open(path, "w") as fh:
                    fh.write(src)
    sys.path.insert(0, tmp)
    return importlib.import_module(name)


def against() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=25)
    ap.add_argument("--warm", type=int, default=WARM)
    ap.add_argument("--shapes", default="small,gpt,lora,tinylm,cnn,moe")
    args = ap.parse_args()
    if any(s.endswith("+clip") for s in args.shapes.split(",")):
        ap.error("--against cannot measure a clipping loop: both packages wrap torch's clip functions, so "
                 "each watcher's shared-norm path sees the other's wrapper; compare +clip shapes with the table")
    torch.set_num_threads(1)
    older = _earlywarn_at(args.against)
    out_dir = tempfile.mkdtemp(prefix="ew-against-out-")
    print(f"the guard's host time per step in place (defaults), {args.against} vs the working tree, one process, "
          f"ABBA, {args.rounds} rounds x {args.block} steps; load average {os.getloadavg()[0]:.1f}")
    print(f"| shape | bare step | the least guard | {args.against} | working tree | difference, paired (median, rounds "
          f"min..max) | beyond the least guard, paired: {args.against} | working tree | working tree, % of the step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    us = lambda v: f"{v * 1e6:.0f} us"  # noqa: E731
    for shape in args.shapes.split(","):
        rec = _interleave({"bare": _Run(shape, "bare", out_dir), "least": _Run(shape, LEAST_GUARD, out_dir),
                           "old": _Run(shape, "defaults", out_dir, package=older),
                           "new": _Run(shape, "defaults", out_dir)}, args.rounds, args.block, args.warm)
        old, new, least = rec["old"]["guard"], rec["new"]["guard"], rec["least"]["guard"]
        diff = [n - o for n, o in zip(new, old)]
        # each revision's part beyond the least guard: its host time less the least guard's, same round
        b_old = statistics.median(o - q for o, q in zip(old, least))
        b_new = [n - q for n, q in zip(new, least)]
        share = statistics.median(b / c for b, c in zip(b_new, rec["bare"]["cpu"]))
        print(f"| {shape} | {statistics.median(rec['bare']['cpu']) * 1e3:.2f} ms | {us(statistics.median(least))} | "
              f"{us(statistics.median(old))} | {us(statistics.median(new))} | {statistics.median(diff) * 1e6:+.0f} us "
              f"({min(diff) * 1e6:+.0f}..{max(diff) * 1e6:+.0f}) | {us(b_old)} | {us(statistics.median(b_new))} | "
              f"{share * 100:.2f}% |", flush=True)


if __name__ == "__main__":
    if "--agreement" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--agreement", action="store_true")
        ap.add_argument("--steps", type=int, default=60)
        agreement(ap.parse_args().steps)
    elif "--alternatives" in sys.argv:
        alternatives()
    elif "--against" in sys.argv:
        against()
    elif "--least" in sys.argv:
        least()
    elif "--profile" in sys.argv or "--knockout" in sys.argv or "--cold" in sys.argv:
        import step_profile

        step_profile.main()
    else:
        table()
