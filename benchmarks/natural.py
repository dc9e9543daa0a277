"""Natural-instability benchmark (issue 48): runs whose instability is their own, nothing injected.

    PYTHONPATH=$PWD python benchmarks/natural.py [--jobs 2] [--quick] [--models chargpt,vit]
        [--methods a,b] [--seeds 3] [--signals] [--no-cache] [--cache DIR] [--png PATH] [--json OUT]

Two kinds of model (benchmarks/natural_models.py: a pre-LayerNorm char GPT without qk-norm, a
ViT-style classifier), each swept over learning rates from half its best rate to 32x it (AdamW,
linear warm-up then cosine), several seeds, every method side by side (benchmarks/natural_run.py:
bare, earlywarn's defaults, ZClip, SPAM, Stable-SPAM, AdaGC, OLMo-core's SkipStep; qk-layernorm
and z-loss as model-side references). Runs are cached in benchmarks/.cache/natural/ by config,
method and the harness's files (earlywarn runs also by every file under earlywarn/ and
integrations/: a change there re-runs earlywarn only). Prints the tables, the issue's done-when
checks (met / not met with the numbers) and, with ``--signals``, which recorded signal moves
first on the unstable runs; writes eval loss against learning rate to docs/img/natural.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from natural_run import METHODS, OPTIMIZER_PEERS, REFERENCES, run_one  # noqa: E402
from rescue_harness import ROOT, _hash_files, _zclip_version, earlywarn_hash  # noqa: E402

from earlywarn.events import ALERT_KINDS  # noqa: E402

CACHE = os.path.join(HERE, ".cache", "natural")
PNG = os.path.join(ROOT, "docs", "img", "natural.png")
HARNESS_FILES = ("natural_models.py", "natural_run.py", "rescue_peers.py", "rescue_tasks.py", "rescue_harness.py")

MODELS = {
    "chargpt": {"task": dict(name="chargpt", layers=2, heads=4, embd=64, block=32, batch=8, eval_n=128),
                "best_lr": 6e-3},
    "vit": {"task": dict(name="vit", layers=2, heads=4, embd=48, patch=4, classes=10, shift=2, noise=0.5,
                         batch=32, eval_n=512),
            "best_lr": 7e-3},
}
FACTORS = (0.5, 1, 2, 4, 8, 16, 32)  # x each model's best rate (measured with the bare runs)
STEPS, SEEDS = 500, 3
QUICK = {"factors": (1, 4, 32), "steps": 40, "seeds": 1}
OPT = {"name": "adamw", "betas": [0.9, 0.95], "wd": 0.1}
# a long warm-up: the run learns before its rate reaches the unstable range (instabilities
# appear as the LR climbs), which leaves a warning something to lead
SCHED = {"kind": "cosine", "warmup": 0.25, "floor": 0.1}

# trains: within 10% of the best run's progress (the ViT's best-rate seeds alone spread over 7% of it)
TRAINS_KEPT, DIVERGES_KEPT = 0.9, 0.5
SMOOTH = 20  # steps in the causal mean of the train loss
DEGRADE_FROM = SMOOTH  # the first step with a full mean; the signal study's reference step
DEGRADE_RATIO = 1.10  # "the loss degrades": 10% above the best rate's bare run, same seed, same step
SPIKE_SIGMA, SPIKE_WINDOW, SPIKE_MIN = 7.0, 1000, 20
MECHANISM_WORDS = ("attention", "logit")
WARN_LEVELS = ("warning", "critical")
ALERTS = {str(k) for k in ALERT_KINDS}
DEFINITIONS = f"""\
Definitions
  E = eval cross-entropy on the model's fixed held-out set at the end (E0: at initialisation),
  median over seeds [min-max]. The best rate (per model) is the rate whose bare median E is lowest
  (E_best); kept = (E0 - E) / (E0 - E_best). A (model, rate) trains when bare's median E keeps
  >= {TRAINS_KEPT}, diverges when it keeps < {DIVERGES_KEPT} or is non-finite, else degrades; its seeds'
  runs are its settings (unstable: degrades or diverges; the checks count an unstable rate's runs
  whose train loss degrades, defined below).
  LR sensitivity (Wortsman et al. 2023) per method = mean over the sweep's rates of
  [min(E(rate), E0) - min over the sweep of E], E the method's median over seeds (non-finite: E0).
  Spike score (OLMo 2) of a series = % of its steps t >= {SPIKE_MIN} whose value is >= {SPIKE_SIGMA:g} std
  from the mean of the finite values of the last min(t, {SPIKE_WINDOW}) steps (std of the same; runs are
  {STEPS} steps: the window is the whole past); a non-finite value counts as a spike. Median over seeds.
  skip% = updates a method skipped / steps run (median over seeds).
  Smoothed train loss L(t) = mean of the last {SMOOTH} steps' train cross-entropy (non-finite: inf).
  The loss degrades at the first step t >= {DEGRADE_FROM} where bare's L(t) > {DEGRADE_RATIO} x L_best(t), L_best
  the best rate's bare run of the same seed; a warning = a detector alert ({', '.join(sorted(str(k) for k in ALERT_KINDS))})
  at level WARNING or worse (its skip / quarantine / checkpoint events are responses, not counted);
  lead = degrade step - earlywarn's first warning in the same seed (until it acts, earlywarn's run
  is bare's, bit for bit).
  Names the layer: the event's layers are not empty; names the mechanism: its message says
  {' or '.join(repr(w) for w in MECHANISM_WORDS)} (attention-logit growth, output-logit divergence).
  Warnings / 1k steps: earlywarn's warnings per 1,000 steps run."""


# ---------------------------------------------------------------- configs and running
def make_configs(models: list[str], quick: bool, seeds: int | None) -> list[dict]:
    factors = QUICK["factors"] if quick else FACTORS
    steps = QUICK["steps"] if quick else STEPS
    n_seeds = seeds or (QUICK["seeds"] if quick else SEEDS)
    out = []
    for name in models:
        spec = MODELS[name]
        for f in factors:
            lr = float(f"{spec['best_lr'] * f:.4g}")
            for seed in range(n_seeds):
                out.append({"id": f"{name}-lr{lr:g}-s{seed}", "task": spec["task"], "seed": seed, "steps": steps,
                            "opt": {**OPT, "lr": lr}, "sched": SCHED})
    return out


def _pytorch_optimizer_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pytorch_optimizer")
    except PackageNotFoundError:
        return "missing"


def cache_key(config: dict, method: str) -> str:
    import torch

    payload = {"config": config, "method": method, "torch": torch.__version__,
               "harness": _hash_files([os.path.join(HERE, f) for f in HARNESS_FILES], ROOT),
               "earlywarn": earlywarn_hash() if method == "earlywarn" else None,
               "zclip": _zclip_version() if method == "zclip" else None,
               "pytorch_optimizer": _pytorch_optimizer_version() if method in ("spam", "stable_spam", "adagc") else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _work(job):
    key, cfg, method = job
    return key, run_one(cfg, method)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def run_all(jobs: list[tuple[dict, str]], n_jobs: int, cache: str, use_cache: bool) -> dict:
    os.makedirs(cache, exist_ok=True)
    out, todo = {}, []
    for cfg, method in jobs:  # keys taken before any run: the code a run is stored under is the code it ran
        key = cache_key(cfg, method)
        path = os.path.join(cache, key + ".json")
        if use_cache and os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                out[(cfg["id"], method)] = json.load(fh)
        else:
            todo.append((key, cfg, method))
    todo.sort(key=lambda j: (j[2] == "earlywarn", j[1]["opt"]["lr"]), reverse=True)  # the slowest first
    print(f"{len(jobs)} runs: {len(jobs) - len(todo)} cached, {len(todo)} to run on {n_jobs} process(es)", file=sys.stderr)
    t0 = time.monotonic()

    def store(key, res):
        out[(res["id"], res["method"])] = res
        tmp = os.path.join(cache, key + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(res, fh)
        os.replace(tmp, os.path.join(cache, key + ".json"))
        done = len(out) - (len(jobs) - len(todo))
        if done % 25 == 0 or done == len(todo):
            print(f"  {done}/{len(todo)} runs, {time.monotonic() - t0:.0f} s", file=sys.stderr)

    if n_jobs <= 1:
        _init_worker()
        for job in todo:
            store(*_work(job))
    elif todo:
        with mp.get_context("spawn").Pool(n_jobs, initializer=_init_worker) as pool:
            for key, res in pool.imap_unordered(_work, todo, chunksize=1):
                store(key, res)
    return out


# ---------------------------------------------------------------- scoring
def _num(v) -> float:
    """A cached value as a float (None, a non-finite value: inf -- a diverged run is worst)."""
    return float(v) if v is not None and math.isfinite(v) else math.inf


def median(xs) -> float:
    xs = [_num(x) for x in xs]
    return statistics.median(xs) if xs else math.nan


def spike_score(values: list) -> float:
    """OLMo 2's spike score of one series, in % (see DEFINITIONS)."""
    import numpy as np

    v = np.array([_num(x) for x in values], dtype=float)
    if len(v) <= SPIKE_MIN:
        return 0.0
    fin = np.isfinite(v)
    x = np.where(fin, v, 0.0)
    c = np.concatenate([[0], np.cumsum(fin)])
    s1 = np.concatenate([[0.0], np.cumsum(x)])
    s2 = np.concatenate([[0.0], np.cumsum(x * x)])
    t = np.arange(SPIKE_MIN, len(v))
    lo = np.maximum(0, t - SPIKE_WINDOW)
    n = c[t] - c[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (s1[t] - s1[lo]) / n
        std = np.sqrt(np.maximum((s2[t] - s2[lo]) / n - mean * mean, 0.0))
        spike = ~fin[t] | ((n > 1) & (std > 0) & (np.abs(v[t] - mean) >= SPIKE_SIGMA * std))
    return 100.0 * float(spike.sum()) / len(t)


def smoothed(values: list, width: int = SMOOTH) -> list[float]:
    """The causal mean of the last ``width`` values (inf where one of them is non-finite)."""
    out, window = [], []
    for v in values:
        window.append(_num(v))
        del window[:-width]
        out.append(sum(window) / len(window))
    return out


def degrade_step(bare: dict, best: dict, start: int) -> int | None:
    """The first step >= ``start`` where bare's smoothed loss is DEGRADE_RATIO x the best rate's."""
    lb, lbest = smoothed(bare["signals"]["loss"]), smoothed(best["signals"]["loss"])
    return next((t for t in range(start, min(len(lb), len(lbest))) if lb[t] > DEGRADE_RATIO * lbest[t]), None)


def lr_sensitivity(es: list[float], e0: float) -> float:
    vals = [min(e, e0) if math.isfinite(e) else e0 for e in es]
    return statistics.mean(v - min(vals) for v in vals)


def warnings_of(res: dict) -> list[dict]:
    return [e for e in res.get("events", []) if e["level"] in WARN_LEVELS and e["kind"] in ALERTS]


def names_mechanism(e: dict) -> bool:
    return any(w in e["message"].lower() for w in MECHANISM_WORDS)


class Sweep:
    """The results of one model, indexed by (method, rate, seed), with bare's classification."""

    def __init__(self, model: str, configs: list[dict], results: dict, methods: list[str]):
        self.model, self.methods = model, methods
        self.configs = [c for c in configs if c["task"]["name"] == model]
        self.rates = sorted({c["opt"]["lr"] for c in self.configs})
        self.seeds = sorted({c["seed"] for c in self.configs})
        self.runs = {(m, c["opt"]["lr"], c["seed"]): r for c in self.configs for m in methods
                     for r in [results.get((c["id"], m))] if r is not None and not r.get("error")}
        self.errors = [results[(c["id"], m)] for c in self.configs for m in methods
                       if (c["id"], m) in results and results[(c["id"], m)].get("error")]
        self.e0 = median(r["E0"] for (m, _, _), r in self.runs.items() if m == "bare")
        self.E = {(m, lr): median(r["E"] for s in self.seeds for r in [self.runs.get((m, lr, s))] if r)
                  for m in methods for lr in self.rates}
        self.best = min(self.rates, key=lambda lr: self.E[("bare", lr)])
        self.kind = {lr: self.classify(self.E[("bare", lr)]) for lr in self.rates}
        self.warm = max(1, int(SCHED["warmup"] * self.configs[0]["steps"]))

    def classify(self, e: float) -> str:
        gain = self.e0 - self.E[("bare", self.best)]
        kept = (self.e0 - e) / gain if math.isfinite(e) and gain > 0 else -math.inf
        return "trains" if kept >= TRAINS_KEPT else "diverges" if kept < DIVERGES_KEPT else "degrades"

    def unstable(self) -> list[float]:
        return [lr for lr in self.rates if self.kind[lr] != "trains"]

    def seeds_of(self, method: str, lr: float) -> list[dict]:
        return [r for s in self.seeds for r in [self.runs.get((method, lr, s))] if r]

    def degrade(self, lr: float, seed: int) -> int | None:
        bare, best = self.runs.get(("bare", lr, seed)), self.runs.get(("bare", self.best, seed))
        return degrade_step(bare, best, DEGRADE_FROM) if bare and best else None

    def sensitivity(self, method: str) -> float:
        return lr_sensitivity([self.E[(method, lr)] for lr in self.rates], self.e0)


# ---------------------------------------------------------------- tables
def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _f(x: float, spec: str = ".3f") -> str:
    return "nan" if x != x else ("inf" if x == math.inf else format(x, spec))


def _spread(rs: list[dict]) -> str:
    es = sorted(_num(r["E"]) for r in rs)
    return f"{_f(statistics.median(es))} [{_f(es[0])}-{_f(es[-1])}]" if es else "-"


def sweep_table(sw: Sweep) -> str:
    rows = []
    for lr in sw.rates:
        bare = sw.seeds_of("bare", lr)
        degr = [sw.degrade(lr, s) for s in sw.seeds]
        attn = [max(_num(v) for k, col in r["signals"].items() if k.startswith("attn_max/") for v in col) for r in bare]
        rows.append([f"{lr:g}", f"{lr / sw.best:g}x", _spread(bare), sw.kind[lr],
                     " ".join("-" if d is None else str(d) for d in degr) if lr != sw.best else "(best)",
                     _f(median(attn), ".3g")])
    return _table([f"{sw.model}: rate", "x best", "bare E [min-max]", "class", "10% behind the best at step (per seed)",
                   "max attention logit (median)"], rows)


def method_table(sw: Sweep) -> str:
    """Eval loss per method (rows) and rate (columns), the LR sensitivity last."""
    rows = [[m] + [_f(sw.E[(m, lr)]) for lr in sw.rates] + [_f(sw.sensitivity(m))] for m in sw.methods]
    return _table([f"{sw.model}: median E"] + [f"{lr:g} ({sw.kind[lr][:3]})" for lr in sw.rates] + ["LR sensitivity"], rows)


def detail_table(sw: Sweep) -> str:
    rows = []
    for m in sw.methods:
        for lr in sw.rates:
            rs = sw.seeds_of(m, lr)
            if not rs:
                continue
            sig = [r["signals"] for r in rs]
            rows.append([m, f"{lr:g}", _spread(rs), _f(median(spike_score(s["loss"]) for s in sig), ".2f"),
                         _f(median(spike_score(s["grad_norm"]) for s in sig), ".2f"),
                         _f(median(100 * r.get("skips", 0) / max(1, r["steps_run"]) for r in rs), ".1f"),
                         sum(r["halted"] for r in rs)])
    return _table([f"{sw.model}: method", "rate", "E [min-max]", "spike% loss", "spike% grad", "skip%", "halted"], rows)


def _named(e: dict) -> str:
    where = ",".join(e["layers"][:2]) or "-"
    return f"{e['kind']} {e['signal'] or '-'} @ {where}"


def earlywarn_table(sw: Sweep) -> str:
    rows = []
    for lr in sw.rates:
        for s in sw.seeds:
            ew, bare = sw.runs.get(("earlywarn", lr, s)), sw.runs.get(("bare", lr, s))
            if not ew or not bare:
                continue
            warns = warnings_of(ew)
            first = warns[0] if warns else None
            d = sw.degrade(lr, s) if sw.kind[lr] != "trains" else None
            lead = d - first["step"] if first and d is not None else None
            rows.append([f"{lr:g}", sw.kind[lr], s, first["step"] if first else "-", _named(first) if first else "-",
                         "-" if d is None else d, "-" if lead is None else lead,
                         _f(1000 * len(warns) / max(1, ew["steps_run"]), ".1f"), ew.get("skips", 0),
                         _f(_num(ew["E"]) - _num(bare["E"]), "+.3f")])
    return _table([f"{sw.model}: rate", "class", "seed", "1st warning", "kind signal @ layers", "degrades at", "lead",
                   "warn/1k", "skips", "E - bare E"], rows)


# ---------------------------------------------------------------- the checks
def checks(sweeps: list[Sweep]) -> list[str]:
    out = []
    harm, warn_rate, cells = [], [], 0
    for sw in sweeps:
        for lr in (lr for lr in sw.rates if sw.kind[lr] == "trains"):
            pairs = [(sw.runs[("earlywarn", lr, s)], sw.runs[("bare", lr, s)]) for s in sw.seeds
                     if ("earlywarn", lr, s) in sw.runs and ("bare", lr, s) in sw.runs]
            if not pairs:
                continue
            cells += 1
            bare_es = [_num(b["E"]) for _, b in pairs]
            noise = statistics.stdev(bare_es) if len(bare_es) > 1 else 0.0
            diff = statistics.median(_num(e["E"]) - _num(b["E"]) for e, b in pairs)
            per_k = 1000 * sum(len(warnings_of(e)) for e, _ in pairs) / sum(max(1, e["steps_run"]) for e, _ in pairs)
            if not diff <= noise:
                harm.append(f"{sw.model} {lr:g}: {diff:+.4f} > noise {noise:.4f}")
            if per_k > 1.0:
                warn_rate.append(f"{sw.model} {lr:g}: {per_k:.1f}/1k")
    ok = not harm and not warn_rate
    out.append(f"[{'met' if ok else 'NOT MET'}] where bare trains ({cells} model-rates): earlywarn's E within noise of bare "
               f"(median paired difference <= the std of bare's E over seeds) and <= 1 warning / 1k steps"
               + ("" if ok else ": " + "; ".join(harm + warn_rate)))
    fails, n = [], 0
    for sw in sweeps:
        for lr in sw.unstable():
            n += 1
            e_ew, e_bare, e_qk = sw.E[("earlywarn", lr)], sw.E[("bare", lr)], sw.E.get(("qk_layernorm", lr), math.nan)
            peers = {m: sw.E[(m, lr)] for m in OPTIMIZER_PEERS if m in sw.methods}
            beaten = [f"{m} {e:.3f}" for m, e in peers.items() if e < e_ew]
            closed = (e_bare - e_ew) / (e_bare - e_qk) if math.isfinite(e_bare - e_qk) and e_bare > e_qk else math.nan
            if beaten or not closed >= 0.5:
                fails.append(f"{sw.model} {lr:g} ({sw.kind[lr]}): earlywarn {_f(e_ew)}, bare {_f(e_bare)}, "
                             f"qk-layernorm {_f(e_qk)}, gap closed {_f(closed, '.2f')}"
                             + (f", below it: {', '.join(beaten)}" if beaten else ""))
    out.append(f"[{'met' if not fails and n else 'NOT MET'}] where bare degrades or diverges ({n} model-rates): earlywarn's "
               f"median E <= every optimizer-level peer's and closes >= half the gap qk-layernorm closes"
               + "".join(f"\n      {f}" for f in fails))
    settings = warned = before = layer = mech = left_out = 0
    for sw in sweeps:
        for lr in sw.unstable():
            for s in sw.seeds:
                ew, d = sw.runs.get(("earlywarn", lr, s)), sw.degrade(lr, s)
                if ew is None or d is None:
                    left_out += ew is not None  # its train loss never fell 10% behind the best rate's
                    continue
                settings += 1
                warns = warnings_of(ew)
                if not warns:
                    continue
                warned += 1
                first = warns[0]
                if first["step"] < d:
                    before += 1
                    layer += bool(first["layers"])
                    mech += bool(first["layers"]) and names_mechanism(first)
    pct = lambda k: f"{k} ({100 * k / settings:.0f}%)" if settings else str(k)  # noqa: E731
    out.append(f"[{'met' if settings and mech >= 0.8 * settings else 'NOT MET'}] a WARNING before the loss degrades on "
               f">= 80% of the {settings} unstable settings whose loss degrades ({left_out} runs of unstable rates "
               f"whose loss did not, left out), naming the layer and the mechanism: warned {pct(warned)}, before the "
               f"loss degrades {pct(before)}, of those naming a layer {pct(layer)}, a layer and the mechanism {pct(mech)}")
    moon = [(sw.model, sw.sensitivity("earlywarn"), sw.sensitivity("qk_layernorm")) for sw in sweeps
            if "qk_layernorm" in sw.methods]
    out.append(f"[{'met' if moon and all(a <= b for _, a, b in moon) else 'NOT MET'}] moonshot: earlywarn's LR sensitivity "
               f"<= qk-layernorm's: " + ", ".join(f"{m} {a:.3f} vs {b:.3f}" for m, a, b in moon))
    return out


# ---------------------------------------------------------------- the signal study (--signals)
SIGNAL_SMOOTH = 5  # a causal median over this many steps: one noisy step is no crossing


def _layers(sig: dict, prefix: str) -> list[list[float]]:
    return [[_num(v) for v in col] for k, col in sig.items() if k.startswith(prefix)]


def signal_series(sig: dict) -> dict[str, list[list[float]]]:
    """Per signal, its per-layer (or one run-level) series, as recorded (see natural_run.py)."""
    n = len(sig["loss"])
    lr_g = [_num(a) * _num(b) for a, b in zip(sig["lr"], sig["grad_norm"])]
    qk = [[a * b for a, b in zip(q, k)] for q, k in zip(_layers(sig, "q_norm/"), _layers(sig, "k_norm/"))]
    loss = smoothed(sig["loss"])
    run_min = [min(loss[:t + 1]) for t in range(n)]
    return {"attention logit max": _layers(sig, "attn_max/"), "|Wq| |Wk|": qk,
            "q weight norm": _layers(sig, "q_norm/"), "k weight norm": _layers(sig, "k_norm/"),
            "output head norm": [[_num(v) for v in sig["head_norm"]]],
            "output logit max": [[_num(v) for v in sig["out_max"]]],
            "log-partition |mean|": [[abs(_num(v)) for v in sig["lse_mean"]]],
            "update/weight (per layer)": _layers(sig, "update/"),
            "grad norm": [[_num(v) for v in sig["grad_norm"]]], "LR x grad norm": [lr_g],
            "loss / its running min": [[a / b for a, b in zip(loss, run_min)]]}


def curve(series: list[list[float]], ref: int | None) -> list[float]:
    """Per step from DEGRADE_FROM on, the largest over layers of the value (``ref`` None) or of
    the value over its value at step ``ref``, each smoothed by a causal median of SIGNAL_SMOOTH steps."""
    out = []
    for t in range(DEGRADE_FROM, len(series[0])):
        top = -math.inf
        for s in series:
            v = statistics.median(s[max(0, t - SIGNAL_SMOOTH + 1):t + 1])
            if ref is not None:
                v = v / s[ref] if s[ref] and math.isfinite(s[ref]) else math.nan
            top = max(top, v if v == v else math.inf)
        out.append(top)
    return out


def _crossings(unstable: list, above) -> str:
    """``n/N (median lead; range)``: the unstable runs whose curve goes ``above`` its threshold
    before their loss degrades, and how many steps before."""
    leads = []
    for c, d in unstable:
        first = next((i for i in range(d) if above(c, i)), None)
        if first is not None:
            leads.append(d - first)
    if not leads:
        return f"0/{len(unstable)}"
    return f"{len(leads)}/{len(unstable)} ({statistics.median(leads):.0f}; {min(leads)}-{max(leads)})"


def signal_study(sweeps: list[Sweep]) -> str:
    """Per signal, the trains runs (the false-alarm side) against the unstable runs before their
    loss degrades: its ratio to step DEGRADE_FROM, and its value, each against the highest any
    trains run reached."""
    rows = []
    groups = [(sw.model, [sw]) for sw in sweeps] + ([("both", sweeps)] if len(sweeps) > 1 else [])
    for label, sws in groups:
        curves: dict[str, dict[str, dict[str, list]]] = {}
        for sw in sws:
            for lr in sw.rates:
                for s in sw.seeds:
                    bare = sw.runs.get(("bare", lr, s))
                    d = sw.degrade(lr, s) if sw.kind[lr] != "trains" else None
                    if not bare or sw.kind[lr] != "trains" and d is None:
                        continue  # unstable by its eval loss, its train loss never 10% behind the best's
                    side = "trains" if d is None else "unstable"
                    for name, ser in signal_series(bare["signals"]).items():
                        for how, ref in (("ratio", None if name.startswith("loss") else DEGRADE_FROM), ("value", None)):
                            cv = curves.setdefault(name, {}).setdefault(how, {"trains": [], "unstable": []})
                            c = curve(ser, ref)
                            cv[side].append(c if d is None else (c, d - DEGRADE_FROM))
        for name, by in curves.items():
            ratio, value = by["ratio"], by["value"]
            if not value["trains"] or not value["unstable"]:
                continue
            r_thr = max(max(c) for c in ratio["trains"])
            v_thr = max(max(c) for c in value["trains"])
            rows.append([label, name, _f(statistics.median(c[d] for c, d in value["unstable"]), ".3g"),
                         _f(r_thr, ".3g"), _crossings(ratio["unstable"], lambda c, i: c[i] > r_thr),
                         _f(v_thr, ".3g"), _crossings(value["unstable"], lambda c, i: c[i] > v_thr)])
    return _table(["model", "signal", "unstable: value at degrade (median)", "ratio: trains max",
                   "ratio: crossed before degrade (lead)", "value: trains max", "value: crossed before degrade (lead)"], rows)


# ---------------------------------------------------------------- the picture
COLORS = {"bare": "tab:red", "earlywarn": "black", "zclip": "tab:blue", "spam": "tab:orange", "stable_spam": "tab:green",
          "adagc": "tab:purple", "olmo_skipstep": "tab:brown", "qk_layernorm": "tab:gray", "z_loss": "tab:pink"}


def plot(sweeps: list[Sweep], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.2 * len(sweeps), 4.0), squeeze=False)
    for ax, sw in zip(axes[0], sweeps):
        for m in sw.methods:
            es = [min(sw.E[(m, lr)], sw.e0) for lr in sw.rates]  # a diverged run plotted at E0
            style = {"earlywarn": dict(lw=2.4, zorder=5), "bare": dict(lw=1.8)}.get(
                m, dict(ls="--", lw=1.4) if m in REFERENCES else dict(lw=1.0, alpha=0.85))
            ax.plot(sw.rates, es, marker="o", ms=3, label=m, color=COLORS.get(m), **style)
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate (AdamW)")
        ax.set_ylabel("final eval loss (median over seeds)")
        ax.set_title(f"{sw.model}: {len(sw.seeds)} seeds, {sw.configs[0]['steps']} steps")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['steps']} steps, rates x{QUICK['factors']}, 1 seed")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--methods", default=None, help=f"comma-separated, of: {', '.join(METHODS)}")
    ap.add_argument("--seeds", type=int, default=None, help=f"default {SEEDS} ({QUICK['seeds']} with --quick)")
    ap.add_argument("--signals", action="store_true", help="print the signal study")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--cache", default=CACHE)
    ap.add_argument("--png", default=PNG, help="where the picture goes ('' for none)")
    ap.add_argument("--json", default=None, metavar="OUT", help="every result, signals included")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    methods = args.methods.split(",") if args.methods else list(METHODS)
    bad = [m for m in models if m not in MODELS] + [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown model(s) or method(s) {bad}: models {', '.join(MODELS)}; methods {', '.join(METHODS)}")
    methods = ["bare"] + [m for m in methods if m != "bare"]  # every score is relative to bare
    if args.seeds is not None and args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: use 1 or more")
    configs = make_configs(models, args.quick, args.seeds)
    t0, c0 = time.monotonic(), time.process_time()
    results = run_all([(c, m) for c in configs for m in methods], args.jobs, args.cache, not args.no_cache)
    wall = time.monotonic() - t0
    ran = [r for r in results.values()]
    print(DEFINITIONS)
    print(f"\n{len(configs)} configs x {len(methods)} methods, {configs[0]['steps']} steps each; wall {wall:.0f} s on "
          f"{args.jobs} process(es); the runs' own CPU time (cached ones as measured then) {sum(r['cpu_s'] for r in ran):.0f} s")
    sweeps = [Sweep(m, configs, results, methods) for m in models]
    for sw in sweeps:
        best, e_best = sorted(_num(r["E"]) for r in sw.seeds_of("bare", sw.best)), sw.E[("bare", sw.best)]
        print(f"\n== {sw.model}: E0 {sw.e0:.3f}, best rate {sw.best:g} (bare E {e_best:.3f}, its seeds {best[0]:.3f}-"
              f"{best[-1]:.3f}: {100 * (best[-1] - best[0]) / (sw.e0 - e_best):.1f}% of E0 - E_best), warm-up {sw.warm} steps\n")
        print(sweep_table(sw) + "\n\n" + method_table(sw) + "\n\n" + detail_table(sw))
        if "earlywarn" in methods:
            print("\n" + earlywarn_table(sw))
    if "earlywarn" in methods and "qk_layernorm" in methods:
        print("\nThe issue's checks")
        for line in checks(sweeps):
            print("  " + line)
    if args.signals:
        print(f"\nSignal study (bare runs, per step from {DEGRADE_FROM}; per signal the largest over layers of its value "
              f"(value) or of its value over its value at step {DEGRADE_FROM} (ratio; the loss's trend is a ratio already), "
              f"a causal median of {SIGNAL_SMOOTH} steps. Trains max = the highest any trains run of the group reached at "
              f"any step: a rule with that threshold raises no false alarm on them. Crossed = unstable runs whose curve "
              f"goes above it before their loss degrades (median lead in steps; range).)\n")
        print(signal_study(sweeps))
    errors = [r for sw in sweeps for r in sw.errors]
    if errors:
        print(f"\n{len(errors)} run(s) failed:")
        for r in errors[:10]:
            print(f"  {r['id']} {r['method']}: {r['error'].strip().splitlines()[-1]}")
    if args.png:
        plot(sweeps, args.png)
        print(f"\npicture: {os.path.relpath(args.png, ROOT)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"configs": configs, "results": ran}, fh)


if __name__ == "__main__":
    main()
