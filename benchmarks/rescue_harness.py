"""The rescue benchmark's training loop: one config, one method -> one result (a JSON-able dict).

The loop is written the plain-user way: it keeps its own step counter ``it`` (a rewind sets the
model back, not the loop), draws batch ``it``, computes its LR schedule from ``it`` and writes it
into the param groups -- or steps the torch scheduler it passed to ``watch(scheduler=...)``.
Faults and events are applied the same way for every method (``Perturb``): data and sample
weights in the batch; gradient faults between ``backward()`` and the loop's clipping (so every
method, earlywarn's guard inside ``optimizer.step`` included, sees them); optimizer-state poison
between two steps; an LR pulse or climb through the loop's own schedule. Per step it records the
train loss, the total gradient norm every method is handed (after a gradient fault, before the
loop's clipping) and whether the method skipped the update (its skip count moved).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
import time
import traceback

import torch

from rescue_peers import make_method, total_norm
from rescue_tasks import gen, make_task

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HARNESS_FILES = ("rescue_tasks.py", "rescue_families.py", "rescue_peers.py", "rescue_harness.py",
                 os.path.join("..", "examples", "tinygpt.py"))
CURVE_BINS = 24


# ---------------------------------------------------------------- schedules
def lr_at(sched: dict, base: float, it: int, steps: int) -> float:
    """The loop's own schedule (``const``, ``cosine`` with linear warm-up, ``two_phase``, ``cyclic``,
    ``rewarm``)."""
    if sched["kind"] == "const":
        return base
    if sched["kind"] == "two_phase":
        return base * (sched["low"] if it < sched["at"] else 1.0)
    if sched["kind"] == "cyclic":  # flat at the low rate, then triangular cycles up to ``base``
        low = base / sched["ratio"]
        k = it - sched["at"]
        if k < 0:
            return low
        up = 1.0 - abs((k % (2 * sched["half"])) / sched["half"] - 1.0)  # 0 -> 1 -> 0 over a period
        return low + (base - low) * up
    if sched["kind"] == "rewarm":  # flat at the low rate, a linear warm-up back to ``base``, cosine down
        low = base / sched["ratio"]
        k = it - sched["at"]
        if k < 0:
            return low
        if k < sched["warmup"]:
            return low + (base - low) * (k + 1) / sched["warmup"]
        progress = min(1.0, (k - sched["warmup"]) / max(1, steps - sched["at"] - sched["warmup"]))
        return low + (base - low) * 0.5 * (1 + math.cos(math.pi * progress))
    warm = max(1, int(sched["warmup"] * steps))
    if it < warm:
        return base * (it + 1) / warm
    progress = min(1.0, (it - warm) / max(1, steps - warm))
    floor = sched["floor"]
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def torch_scheduler(sched: dict, opt: torch.optim.Optimizer, base: float, steps: int):
    if sched["kind"] == "warm_restarts":
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
            opt, T_0=max(1, sched["T_0"]), T_mult=sched["T_mult"], eta_min=base * sched["eta_min_frac"])
    if sched["kind"] == "onecycle":
        momentum = "betas" in opt.defaults or opt.defaults.get("momentum", 0) > 0
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=base * sched["max_lr_factor"], total_steps=steps, pct_start=sched["pct_start"],
            cycle_momentum=momentum)
    return None


# ---------------------------------------------------------------- faults and events
class Perturb:
    """The config's events (an outlier batch, heavy-tailed sample weights, a loss scale) and
    fault, as the loop applies them."""

    def __init__(self, config: dict, task) -> None:
        self.fault = config.get("fault") or {}
        self.kind = self.fault.get("kind")
        self.events = config.get("events", {})
        self.outlier = self.events.get("outlier")
        self.task, self.seed = task, config["seed"]
        self.norms: list[float] = []  # recent gradient norms (only tracked for an outlier event)

    def empty(self, it: int, micro: int) -> bool:
        """Whether the batch of (it, micro) is one whose samples are all masked out (``empty``)."""
        ev = self.events.get("empty")
        return bool(ev) and float(torch.rand((), generator=gen(self.seed, "empty", it, micro))) < ev["p"]

    def loss_weight(self, it: int) -> float:
        """The loss's weight at step ``it``: 1, or ramped toward ``factor`` (``loss_ramp``) -- linear,
        geometric, or a sigmoid as a consistency loss's ramp-up -- from ``at`` over ``length`` steps,
        or ``factor`` for ``length`` steps from ``at`` and 1 again after (``loss_phase``)."""
        ev = self.events.get("loss_phase")
        if ev:
            return ev["factor"] if ev["at"] <= it < ev["at"] + ev["length"] else 1.0
        ev = self.events.get("loss_ramp")
        if not ev or it < ev["at"]:
            return 1.0
        t = min(1.0, (it - ev["at"]) / ev["length"])
        if ev["shape"] == "geometric":
            return ev["factor"] ** t
        if ev["shape"] == "sigmoid":  # exp(-5 (1 - t)^2), scaled to run from 0 to 1
            t = (math.exp(-5.0 * (1.0 - t) ** 2) - math.exp(-5.0)) / (1.0 - math.exp(-5.0))
        return 1.0 + (ev["factor"] - 1.0) * t

    def lr_factor(self, it: int) -> float:
        f = self.fault
        if self.kind == "lr_pulse" and f["at"] <= it < f["at"] + f["length"]:
            return f["factor"]
        if self.kind == "lr_climb" and it >= f["at"]:
            return f["factor"] ** (it - f["at"] + 1)
        return 1.0

    def batch(self, it: int, micro: int, b: dict) -> dict:
        f, kind = self.fault, self.kind
        g = gen(self.seed, "perturb", it, micro)
        n = len(b["y"] if "y" in b else b["x"])
        if kind == "bad_batch" and it == f["at"] and micro == 0:
            idx = torch.arange(n) if f["samples"] == "all" else torch.randperm(n, generator=g)[:f["samples"]]
            if f["how"] == "nan_input":
                b["x"] = b["x"].clone()
                b["x"][idx] = math.nan
            else:
                b["w"] = torch.ones(n)
                b["w"][idx] = math.inf if f["how"] == "inf_weight" else math.nan
        if kind == "burst" and f["at"] <= it < f["at"] + f["length"] or (
                kind == "bad_shard" and it >= f["at"]
                and float(torch.rand((), generator=gen(self.seed, "shard", it))) < f["p"]):
            if f["how"] in ("scale", "both"):
                for key in self.task.float_inputs:
                    b[key] = b[key] * f["scale"]
            if f["how"] in ("shuffle", "both"):
                b["y"] = self._scrambled(b["y"], g)
        wts = self.events.get("weights")
        if wts:
            w = torch.exp(wts["sigma"] * torch.randn(n, generator=gen(self.seed, "weights", it, micro)))
            b["w"] = w if "w" not in b else b["w"] * w
        if self.outlier and it == self.outlier["at"] and micro == 0:
            b["y"] = self._scrambled(b["y"], g)
            if b["y"].is_floating_point():
                b["y"] = b["y"] + 3.0 * (b["y"].std() + 1.0)
        return b

    @staticmethod
    def _scrambled(y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if y.is_floating_point():
            return y[torch.randperm(len(y), generator=g)]
        return y.flatten()[torch.randperm(y.numel(), generator=g)].view_as(y)  # labels / tokens shuffled

    @torch.no_grad()
    def grads(self, it: int, params: list) -> None:
        f, kind = self.fault, self.kind
        live = [p for p in params if p.grad is not None]
        if self.outlier:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in live])))
            if it == self.outlier["at"] and self.norms:
                typical = sorted(self.norms[-20:])[len(self.norms[-20:]) // 2]
                for p in live:  # the outlier batch's gradient, at `factor` x the typical norm
                    p.grad.mul_(self.outlier["factor"] * typical / max(norm, 1e-12))
            else:
                self.norms.append(norm)
        if kind == "huge_grad" and it == f["at"]:
            for p in live:
                p.grad.mul_(f["factor"])
        if kind == "nonfinite_grad" and it in f["steps"] and live:
            g = gen(self.seed, "nonfinite", it)
            p = live[int(torch.randint(0, len(live), (1,), generator=g))]
            flat = p.grad.view(-1)
            n = flat.numel() if f["coords"] == "all" else min(f["coords"], flat.numel())
            flat[torch.randperm(flat.numel(), generator=g)[:n]] = float(f["value"])

    @torch.no_grad()
    def after_step(self, it: int, opts: list) -> None:
        f = self.fault
        if self.kind != "poisoned_state" or it != f["at"]:
            return
        opt = opts[0]
        names = {"second": ("exp_avg_sq", "square_avg", "sum", "momentum_buffer"),
                 "first": ("exp_avg", "momentum_buffer", "square_avg", "sum")}[f["slot"]]
        slots: list[torch.Tensor] = []
        for name in names:  # the first of these slots the optimizer has (Adam: exp_avg_sq / exp_avg)
            slots = [st[name] for st in opt.state.values() if torch.is_tensor(st.get(name)) and st[name].dim() > 0]
            if slots:
                break
        if not slots:
            return
        g = gen(self.seed, "poison")
        t = slots[int(torch.randint(0, len(slots), (1,), generator=g))].view(-1)
        n = t.numel() if f["coords"] == "all" else min(f["coords"], t.numel())
        t[torch.randperm(t.numel(), generator=g)[:n]] = math.nan


# ---------------------------------------------------------------- one run
def run_one(config: dict, method: str) -> dict:
    """Train ``config`` with ``method``; the result dict is what the cache stores."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = {"id": config["id"], "family": config["family"], "fault": (config.get("fault") or {}).get("kind"),
           "method": method, "halted": False, "halt_step": None, "halt_message": None, "error": None}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["EARLYWARN_OUTPUT_DIR"] = tmp  # a quarantine file, if any, stays out of the repo
            _train(config, method, res)
    except Exception:
        res["error"] = traceback.format_exc(limit=6)
    res["wall_s"] = round(time.perf_counter() - t0, 3)
    return res


def _train(config: dict, method_name: str, res: dict) -> None:
    import earlywarn

    task = make_task(config)
    steps, accum = config["steps"], config.get("accum", 1)
    spec = dict(config["opt"])
    fault = config.get("fault") or {}
    if fault.get("kind") == "hopeless":
        spec["lr"] = fault["lr"]
    method = make_method(method_name)
    opts = [method.optimizer(spec, task.params(k)) for k in range(task.n_opt)]
    scheds = [torch_scheduler(config["sched"], o, spec["lr"], steps) for o in opts]
    loop_lr = scheds[0] is None
    perturb = Perturb(config, task)
    res["E0"] = task.evaluate()
    method.attach(task, opts, scheds)
    losses = [[] for _ in opts]
    norms = [[] for _ in opts]  # the total gradient norm each method was handed (after a gradient fault, before clipping)
    skipped = [[] for _ in opts]  # the loop steps whose update the method skipped
    it = 0
    try:
        for it in range(steps):
            task.at_step(it)
            for k, opt in enumerate(opts):
                if loop_lr:
                    lr = lr_at(config["sched"], spec["lr"], it, steps) * perturb.lr_factor(it)
                    for group in opt.param_groups:
                        group["lr"] = lr
                before = method.skip_total()
                go_on = _one_step(task, method, perturb, opt, k, it, accum, losses[k], norms[k])
                if method.skip_total() > before:
                    skipped[k].append(it)
                if not go_on:
                    res["halted"], res["halt_step"], res["halt_message"] = True, it, "stopped: non-finite loss or grad norm"
                    break
                if scheds[k] is not None:
                    scheds[k].step()
            else:
                perturb.after_step(it, opts)
                continue
            break
    except earlywarn.Halt as exc:
        res["halted"], res["halt_step"], res["halt_message"] = True, it, str(exc)
    res.update(method.close())
    res["steps_run"] = it + 1
    res["E"] = task.evaluate()
    res["params_finite"] = all(bool(torch.isfinite(p).all()) for m in task.models for p in m.parameters())
    res["loss_curve"] = [_bins(l) for l in losses]
    res["losses"] = [[_short(v) for v in l] for l in losses]
    res["grad_norms"] = [[_short(v) for v in n] for n in norms]
    res["skipped_steps"] = skipped


def _one_step(task, method, perturb, opt, k, it, accum, losses, norms) -> bool:
    """One optimizer step of optimizer ``k``; False when the method stops the run."""
    opt.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for micro in range(accum):
        batch = perturb.batch(it, micro, task.batch(it, micro, k))
        loss = task.loss(k, batch)
        ls = perturb.events.get("loss_scale")
        if ls and it >= ls["at"]:
            loss = loss * ls["factor"]
        if "loss_ramp" in perturb.events or "loss_phase" in perturb.events:
            loss = loss * perturb.loss_weight(it)
        if perturb.empty(it, micro):  # every sample masked out: a zero loss, zero gradients
            loss = loss * 0.0
        (loss / accum if accum > 1 else loss).backward()
        method.report_loss(k, loss)
        total = total + loss.detach()
    loss = total / accum
    losses.append(float(loss))
    if k == 0:
        perturb.grads(it, task.params(k))
    norms.append(float(total_norm(task.params(k))))
    norm = method.clip(k)
    action = method.before_step(k, loss, norm)
    if action == "stop":
        return False
    if action == "step":
        method.step(k)
    return True


def _short(v: float) -> float | None:
    """``v`` to 5 significant digits (None when non-finite: the cache is plain JSON)."""
    return float(f"{v:.5g}") if math.isfinite(v) else None


def _bins(values: list[float]) -> list[float | None]:
    """The curve as CURVE_BINS means (None for a bin with a non-finite value)."""
    if not values:
        return []
    n = len(values)
    out = []
    for i in range(min(CURVE_BINS, n)):
        chunk = values[i * n // min(CURVE_BINS, n):(i + 1) * n // min(CURVE_BINS, n)]
        out.append(round(sum(chunk) / len(chunk), 5) if all(math.isfinite(v) for v in chunk) else None)
    return out


# ---------------------------------------------------------------- cache keys
def _hash_files(paths: list[str], root: str) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def _tree_files(folder: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):  # does not follow earlywarn/integrations (a symlink)
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not os.path.islink(os.path.join(dirpath, d)))
        out += [os.path.join(dirpath, f) for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return out


@functools.lru_cache(maxsize=None)
def harness_hash() -> str:
    return _hash_files([os.path.join(HERE, f) for f in HARNESS_FILES], ROOT) + "-torch" + torch.__version__


@functools.lru_cache(maxsize=None)
def earlywarn_hash(root: str = ROOT) -> str:
    """Every file under ``earlywarn/`` and ``integrations/`` in ``root``."""
    return _hash_files(_tree_files(os.path.join(root, "earlywarn")) + _tree_files(os.path.join(root, "integrations")), root)


def _zclip_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("zclip")
    except PackageNotFoundError:
        return "missing"


def cache_key(config: dict, method: str, *, ew_root: str = ROOT) -> str:
    """Depends on the config, the method, the harness's own files; and for earlywarn runs on
    earlywarn's and the integrations' files (a change there re-runs earlywarn only)."""
    payload = {"config": config, "method": method, "harness": harness_hash(),
               "earlywarn": earlywarn_hash(ew_root) if method == "earlywarn" else None,
               "zclip": _zclip_version() if method == "zclip" else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
