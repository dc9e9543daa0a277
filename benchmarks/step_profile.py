"""Where one step's host work goes (issue 23): two views of the same guard, run by ``overhead.py``.

    python benchmarks/overhead.py --profile gpt [--steps 300]              # each function, timed in place
    python benchmarks/overhead.py --knockout gpt [--rounds 8] [--block 25]  # each part, what removing it saves
    python benchmarks/overhead.py --cold gpt [--steps 200]                  # one call, first after backward vs again

``--profile``: the guard's functions timed in place on the thread's CPU clock (inclusive, a
wrapper each) over ``--steps`` steps with the default sinks. It names every function, but its
parts add up to more than the guard costs: each wrapper adds its own timer calls, and a part
timed alone is not what it costs inside a step whose caches the backward pass has emptied.

``--knockout``: the price of each part, paired. Copies of the same watched run train side by side
in one process (ABBA, as the table in ``overhead.py``): one intact, and one per part with that part
neutralised on its watcher -- the norm pass (the first step's values returned), the periodic
snapshots, the detector (no alerts), the optimizer-state check, the input fingerprint, the metric
row to the sinks. What a part costs is the intact run's in-place guard time less its copy's, per
round; the rest is the guard's own step (the vector, the host read, the judge, the policy, the
recovery bookkeeping). A copy without a part is no run anyone should train: it is a measurement.

``--cold``: why a part costs more inside a step than alone. In a bare loop of the shape, right
after each backward pass, one of a few calls of the kind the guard makes is timed -- the guard's
two-line ``stat_dtype`` and its ``learning_rate``, a small torch op and a small numpy call on a
29-element vector -- first, or behind an untimed call of another kind (the interpreter's own code
warm again), then again at once, then once more after a 10 ms sleep. The first call pays for the
caches and TLB entries the backward pass evicted; "again" is the call's own cost. Then what a
pass over the gradients pays per tensor: the same freshly written bytes passed over as the
shape's tensors (torch's multi-tensor calls) and as one tensor (the gradients made views of one
buffer) -- the part of a norm pass or a snapshot copy that a flat gradient buffer would save.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from overhead import WARM, _interleave, _on_thread_clock, _Run


def _profile_points() -> list[tuple[object, str, str, int]]:
    """(owner, attribute, label, depth): the guard's per-step functions, in the order a step calls them."""
    from earlywarn.capture.gradstats import GradStats
    from earlywarn.detect.detector import StreamingDetector
    from earlywarn.guard import calmstep, judge, respond, statistics as stats, telemetry, watcher
    from earlywarn.policy import Policy
    from earlywarn.recover import batches, recovery, snapshots, statecheck

    return [
        (stats.StepStatistics, "report_loss", "report_loss (outside step())", 0),
        (batches.BatchFingerprints, "observe", "input fingerprint, forward pre-hook (outside step())", 0),
        (watcher.Watcher, "_optimizer_step", "optimizer.step(), whole", 0),
        (watcher.Watcher, "_begin", "the statistics vector", 1),
        (GradStats, "layer_sq_norms", "per-layer gradient norms", 2),
        (statecheck.StateCheck, "flag", "optimizer-state finiteness flag (every Nth step)", 2),
        (stats.StepStatistics, "read_now", "the host read", 1),
        (calmstep.CalmSteps, "take", "a calm step: the test of its bands (and the policy's bookkeeping)", 1),
        (calmstep.CalmSteps, "fold", "calm steps folded in (detector, rows; amortised)", 2),
        (StreamingDetector, "observe_calm", "detector, calm steps in a block", 3),
        (stats.StepStatistics, "observation", "the Observation", 1),
        (judge.Judge, "__call__", "judge", 1),
        (StreamingDetector, "observe", "detector", 2),
        (Policy, "decide", "policy (a step with alerts, or watching)", 2),
        (Policy, "calm", "policy (a calm step)", 2),
        (respond.Responses, "announce", "announce", 1),
        (watcher.Watcher, "_run", "the update (the optimizer's own step)", 1),
        (watcher.Watcher, "_after_step", "after the step", 1),
        (recovery.Recovery, "after_step", "recovery bookkeeping", 2),
        (snapshots.SnapshotKeeper, "start_due", "snapshot copies (amortised)", 3),
        (snapshots.SnapshotKeeper, "judged", "snapshot confirmation", 3),
        (StreamingDetector, "score", "detector score", 2),
        (telemetry.Telemetry, "log_rows", "metric rows to the sinks (calm steps' when folded)", 2),
    ]


def profile(args: argparse.Namespace) -> None:
    run = _Run(args.profile, "defaults", tempfile.mkdtemp(prefix="ew-profile-"), timed=False)
    for _ in range(args.warm):
        run.step()
    spent: dict[str, float] = {}
    restore = []
    for owner, attr, label, _ in _profile_points():
        fn = owner.__dict__[attr]
        restore.append((owner, attr, fn))
        spent[label] = 0.0
        def add(dt: float, _l: str = label) -> None:
            spent[_l] += dt
        timed = (property(_on_thread_clock(fn.fget, add)) if isinstance(fn, property)
                 else _on_thread_clock(fn, add))
        setattr(owner, attr, timed)
    try:
        t0 = time.thread_time()
        for _ in range(args.steps):
            run.step()
        cpu = time.thread_time() - t0
    finally:
        for owner, attr, fn in restore:
            setattr(owner, attr, fn)
        run.close()
    n = args.steps
    print(f"{args.profile}: {cpu / n * 1e3:.2f} ms of thread CPU per step (defaults, the timers' own cost "
          f"included); host work per step, thread CPU, inclusive, mean over {n} steps:")
    for _, _, label, depth in _profile_points():
        print(f"  {'  ' * depth}{label:{60 - 2 * depth}s} {spent[label] / n * 1e6:8.1f} us")
    guard = spent["optimizer.step(), whole"] - spent["the update (the optimizer's own step)"]
    outside = spent["report_loss (outside step())"] + spent["input fingerprint, forward pre-hook (outside step())"]
    print(f"  {'the guard inside step() (whole minus the update)':60s} {guard / n * 1e6:8.1f} us")
    print(f"  {'the guard in all (with report_loss and the fingerprint)':60s} {(guard + outside) / n * 1e6:8.1f} us")


# -- cold calls: the first call after a backward pass against the same call again -------------------

def cold(args: argparse.Namespace) -> None:
    import numpy as np

    from earlywarn.capture.gradstats import stat_dtype
    from earlywarn.capture.updates import learning_rate

    run = _Run(args.cold, "bare", tempfile.mkdtemp(prefix="ew-cold-"), timed=False)
    small32 = torch.rand(29)
    small_np = small32.numpy()
    cpu = torch.device("cpu")
    calls: dict[str, Callable[[], Any]] = {
        "stat_dtype(device) (earlywarn's, two lines)": lambda: stat_dtype(cpu),
        "learning_rate(optimizer) (earlywarn's)": lambda: learning_rate(run.opt),
        "torch: 29 float32 values .to(float64)": lambda: small32.to(torch.float64),
        "numpy: np.square of them in float64": lambda: np.square(small_np, dtype=np.float64),
    }
    names = list(calls)
    modes = ("first after backward", "after backward, behind another call", "again", "first after a 10 ms sleep")
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(args.warm + args.steps):
        run.opt.zero_grad(set_to_none=True)
        run.loss_of(i).backward()
        # one kind of call a step, so that it alone meets the caches as backward left them; every
        # other step behind an untimed call of another kind (the interpreter's own code warm again)
        name, behind = names[i % len(names)], (i // len(names)) % 2 == 1
        if behind:
            calls[names[(i + 1) % len(names)]]()
        t0 = time.perf_counter()
        calls[name]()
        t1 = time.perf_counter()
        calls[name]()
        t2 = time.perf_counter()
        time.sleep(0.01)
        t3 = time.perf_counter()
        calls[name]()
        t4 = time.perf_counter()
        if i >= args.warm:
            for mode, dt in zip(modes, (None if behind else t1 - t0, t1 - t0 if behind else None, t2 - t1, t4 - t3)):
                if dt is not None:
                    times.setdefault((name, mode), []).append(dt)
        run.opt.step()
    print(f"{args.cold}: one call right after backward (the caches as the step left them) and the same call "
          f"again; median wall time, each kind of call on every {len(names)}th of {args.steps} steps")
    print("| call | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, m)]) * 1e6:.1f} us" for m in modes) + " |")
    _first_read(args)
    _per_tensor_price(args)


def _first_read(args: argparse.Namespace) -> None:
    """The update's share of the guard's first read. Reading ``p.grad`` right after backward makes
    each new gradient's Python object, which the optimizer's update would otherwise make itself:
    timed in place, the guard is charged for work the update then no longer does. Two copies of
    the shape step in turn (ABBA); one has its gradients read (``[p.grad for p in params]``, the
    guard's first touch) just before ``optimizer.step()``; per step, both updates are timed."""
    runs = {k: _Run(args.cold, "bare", tempfile.mkdtemp(prefix="ew-cold-"), timed=False) for k in ("plain", "read")}
    params = {k: list(r.model.parameters()) for k, r in runs.items()}
    upd: dict[str, list[float]] = {k: [] for k in runs}
    read: list[float] = []
    for i in range(args.warm + 2 * args.steps):
        for k in (("plain", "read") if i % 2 else ("read", "plain")):
            run = runs[k]
            run.opt.zero_grad(set_to_none=True)
            run.loss_of(i).backward()
            t0 = time.thread_time()
            if k == "read":
                grads = [p.grad for p in params[k]]
                del grads
            t1 = time.thread_time()
            run.opt.step()
            t2 = time.thread_time()
            if i >= args.warm:
                upd[k].append(t2 - t1)
                if k == "read":
                    read.append(t1 - t0)
    saved = statistics.median(a - b for a, b in zip(upd["plain"], upd["read"]))
    print(f"\n{args.cold}: the optimizer's update with and without the gradients read first "
          f"({len(params['plain'])} tensors; thread CPU, {2 * args.steps} steps each, ABBA)")
    print(f"  the read itself {statistics.median(read) * 1e6:.0f} us; the update after it is {saved * 1e6:.0f} us "
          f"cheaper (paired median; update alone {statistics.median(upd['plain']) * 1e3:.2f} ms): the in-place "
          "guard time counts this work, the paired step() column does not")


def _per_tensor_price(args: argparse.Namespace) -> None:
    """What a pass over the gradients costs per tensor on the CPU, right after backward. The
    shape's gradients are made views of one flat buffer (zeroed in place, so backward writes into
    it), and each step one pass is timed first: over the tensors, as torch's multi-tensor calls
    make it (the clip's ``_foreach_norm``; a snapshot's ``_foreach_copy_``), or over the same bytes
    as one tensor. Same memory, as freshly written: the difference is the price per tensor."""
    import numpy as np

    run = _Run(args.cold, "bare", tempfile.mkdtemp(prefix="ew-cold-"), timed=False)
    params = [p for p in run.model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)  # (every shape's: one dtype)
    grads, at = [], 0
    for p in params:
        p.grad = flat[at:at + p.numel()].view_as(p)
        grads.append(p.grad)
        at += p.numel()
    flat_np, starts = flat.numpy(), np.cumsum([0] + [p.numel() for p in params[:-1]])
    flat_copy, copies = torch.empty_like(flat), [torch.empty_like(p) for p in params]
    # (the pass over the tensors, the same pass over one tensor): torch has no per-segment norm,
    # so one tensor's per-tensor norms are numpy's squares summed by segment
    passes: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "per-tensor norms (one tensor: np.square, np.add.reduceat)": (
            lambda: torch.stack(torch._foreach_norm(grads)),
            lambda: np.sqrt(np.add.reduceat(np.square(flat_np), starts))),
        "total norm (one tensor: vector_norm)": (
            lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
            lambda: torch.linalg.vector_norm(flat)),
        "a copy, as a snapshot's (one tensor: copy_)": (
            lambda: torch._foreach_copy_(copies, grads),
            lambda: flat_copy.copy_(flat)),
    }
    kinds = [(name, j) for name in passes for j in (0, 1)]
    times: dict[tuple[str, int], list[float]] = {k: [] for k in kinds}
    for i in range(args.warm + len(kinds) * args.steps):
        run.opt.zero_grad(set_to_none=False)
        run.loss_of(i).backward()
        assert params[0].grad.data_ptr() == flat.data_ptr()  # backward wrote into the views
        name, j = kinds[i % len(kinds)]
        t0 = time.thread_time()
        passes[name][j]()
        t1 = time.thread_time()
        if i >= args.warm:
            times[(name, j)].append(t1 - t0)
        run.opt.step()
    n = len(params)
    print(f"\n{args.cold}: one pass over the gradients right after backward, over {n} tensors (torch's multi-tensor "
          f"calls) and over the same {flat.numel() * flat.element_size() / 1e6:.2f} MB as one tensor (the gradients made views of one "
          f"buffer); median thread CPU, each pass on every {len(kinds)}th of {len(kinds) * args.steps} steps")
    print(f"| pass | over {n} tensors | over one tensor | the price per tensor |")
    print("|---|---:|---:|---:|")
    for name in passes:
        a, b = (statistics.median(times[(name, j)]) for j in (0, 1))
        print(f"| {name} | {a * 1e6:.0f} us | {b * 1e6:.0f} us | {(a - b) / n * 1e6:.1f} us |")


# -- knock-outs: what each part costs inside a real step ------------------------------------------------

def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _without_norms(ew: Any) -> None:
    stats = ew.statistics.stats
    first: list[torch.Tensor] = []
    real = stats.layer_sq_norms

    def first_values(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not first:
            first.append(real(*args, **kwargs))
        return first[0]
    stats.layer_sq_norms = first_values


def _without_snapshots(ew: Any) -> None:
    ew.recovery.snapshots.start_due = _nothing


def _without_detector(ew: Any) -> None:
    # (a detector that never warms up draws no bands: every step takes the judged path, without it)
    det = ew.detector
    det.observe = lambda obs: []
    det.observe_calm = lambda cols, scores: scores.extend([0.0] * len(cols)) or []


def _without_state_check(ew: Any) -> None:
    st = ew.statistics
    st.state_check.flag = lambda device, dtype: st._zero_entry


def _without_fingerprint(ew: Any) -> None:
    fps = ew.recovery.fingerprints
    fps.observe = fps.bind = _nothing


def _without_metric_row(ew: Any) -> None:
    ew.telemetry.log_rows = _nothing  # (every row goes through it: a judged step's, calm steps' folded)


KNOCKOUTS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "norms": ("the gradient norm pass (per-tensor norms, per-layer sums)", _without_norms),
    "snapshots": ("the periodic snapshots (copies, finiteness flag, confirmation)", _without_snapshots),
    "detector": ("the detector", _without_detector),
    "state check": ("the optimizer-state check (every Nth step)", _without_state_check),
    "fingerprint": ("the input fingerprint (forward pre-hook)", _without_fingerprint),
    "metric row": ("the metric row to the sinks", _without_metric_row),
}


def knockout(args: argparse.Namespace) -> None:
    out_dir = tempfile.mkdtemp(prefix="ew-knockout-")
    runs = {"bare": _Run(args.knockout, "bare", out_dir), "intact": _Run(args.knockout, "defaults", out_dir)}
    for name, (_, neutralise) in KNOCKOUTS.items():
        run = runs[name] = _Run(args.knockout, "defaults", out_dir)
        neutralise(run.ew)
    rec = _interleave(runs, args.rounds, args.block, args.warm)
    intact = rec["intact"]["guard"]
    whole = statistics.median(intact)
    print(f"{args.knockout}: the guard's host time in place (defaults) {whole * 1e6:.0f} us a step on a "
          f"{statistics.median(rec['bare']['cpu']) * 1e3:.2f} ms bare step; {args.rounds} rounds x {args.block} "
          f"steps, {len(runs)} copies side by side (ABBA)")
    print("| part | what removing it saves, paired (median) | rounds min..max | share |")
    print("|---|---:|---:|---:|")
    rest = whole
    for name, (label, _) in KNOCKOUTS.items():
        saved = [a - b for a, b in zip(intact, rec[name]["guard"])]
        med = statistics.median(saved)
        rest -= med
        print(f"| {label} | {med * 1e6:.0f} us | {min(saved) * 1e6:.0f}..{max(saved) * 1e6:.0f} us | "
              f"{med / whole:.0%} |")
    print(f"| the rest: the guard's own step (vector, host read, judge, policy, bookkeeping) | {rest * 1e6:.0f} us | "
          f"- | {rest / whole:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", metavar="SHAPE")
    ap.add_argument("--knockout", metavar="SHAPE")
    ap.add_argument("--cold", metavar="SHAPE")
    ap.add_argument("--steps", type=int, default=300, help="--profile, --cold: steps timed")
    ap.add_argument("--rounds", type=int, default=8, help="--knockout: rounds")
    ap.add_argument("--block", type=int, default=25, help="--knockout: steps per round (a snapshot every 25)")
    ap.add_argument("--warm", type=int, default=WARM)
    args = ap.parse_args()
    if sum(a is not None for a in (args.profile, args.knockout, args.cold)) != 1:
        ap.error("give one of --profile SHAPE, --knockout SHAPE and --cold SHAPE")
    torch.set_num_threads(1)
    if args.profile is not None:
        profile(args)
    elif args.cold is not None:
        cold(args)
    else:
        knockout(args)
