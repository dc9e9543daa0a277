"""Rescue benchmark: does a response policy harm healthy runs, and does it rescue dying ones?

    PYTHONPATH=$PWD python benchmarks/rescue.py [--jobs 2] [--quick] [--families a,b] [--methods a,b]
        [--seed-base 0] [--per-family N] [--no-cache] [--show CONFIG_ID] [--json out.json] [--soak]
        [--burst-length STEPS]

Every config of every family (benchmarks/rescue_families.py: healthy families, fault families
and "hopeless") is trained with every method (benchmarks/rescue_peers.py: bare, a GradScaler-style
skip, a torchtitan-style stop, OLMo-core's SkipStep, ZClip, earlywarn's defaults) in one loop
(benchmarks/rescue_harness.py); a faulted config is also trained bare without its fault (its
twin). Healthy harm counts skipped steps too (a skip% or a streak at the loss's level over issue
48's limits; DEFINITIONS). Results are cached in benchmarks/.cache/rescue/, keyed by the config, the method, the
harness's files, and for earlywarn by every file under earlywarn/ and integrations/: a change to
earlywarn re-runs only earlywarn. ``--soak``: benchmarks/rescue_soak.py.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rescue_families import FAMILIES, FAULT_FAMILIES, HEALTHY, all_configs, twin_of  # noqa: E402
from rescue_harness import cache_key, run_one  # noqa: E402
from rescue_peers import METHODS  # noqa: E402

from earlywarn.detect.config import DetectorConfig  # noqa: E402

CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache", "rescue")

WORSE_MARGIN = 0.02
DYING_BELOW = 0.9
RESCUED_AT = 0.95
SKIP_FRACTION_LIMIT = 0.005  # issue 48: a healthy run skips no more than 0.5% of its steps ...
SKIP_STREAK_LIMIT = 5  # ... and no more than 5 in a row once its loss is back at its level
LEVEL_STEPS = 10  # the level of a streak: the steps just before its first skip
LEVEL_TOLERANCE = 0.1  # back at the level: within 10% of its top (of |top|, for a loss below zero)
SPIKE_FROM, SPIKE_WINDOW = 5, 20  # a bare gradient spike: from step 5, over the median of the 20 steps before
OUTLIER_RATIO = DetectorConfig().outlier_ratio
DEFINITIONS = f"""\
Definitions
  E0 = eval loss on the config's fixed held-out set at initialisation; E = at the end (a halted or
  stopped run: the model as it is at the stop); E_twin = E of the fault-free bare twin (for a
  healthy config, bare itself).
  kept = (E0 - E) / (E0 - E_twin); a non-finite E keeps 0 (no progress).
  Healthy harm (h/r/c/w): h = halted (earlywarn.Halt, or a peer's stop); r = rewound
  (counters["rewinds"] > 0); c = any event at level CRITICAL; w = left worse: kept < kept_bare - {WORSE_MARGIN}.
  Skipped steps (every method that skips: earlywarn's skipped_steps counter, gradscaler_skip,
  olmo_skipstep's 0-factor steps), per optimizer of a run, the loop step of each recorded:
  skip% = skipped steps / steps run; streak = the most consecutive skipped steps;
  streak@level = the most consecutive skipped steps once the loss is back at its level: skips
  less than {LEVEL_STEPS} steps apart are one episode, whose level is the top of the train loss,
  smoothed (the median of the step, the one before and the one after it), over the steps from
  {LEVEL_STEPS} before its first skip to 2 before it (no skip in them); each streak in it counts its skips
  from the first one whose smoothed train loss is <= top + {LEVEL_TOLERANCE} |top| (a skip while the loss is
  still up -- the model damaged, or the loss's scale changed -- is not counted; an episode with
  no steps before it is counted whole).
  s = skip harm: skip% > {100 * SKIP_FRACTION_LIMIT:g}% or streak@level > {SKIP_STREAK_LIMIT} (the worst optimizer of the run).
  Faulted: dying = bare keeps < {DYING_BELOW} (or ends non-finite); rescued = the method keeps >= {RESCUED_AT}
  and was not halted. The rescue table counts dying configs only.
  Bare spikes (self_spike): a step >= {SPIKE_FROM} of a bare run whose gradient norm is more than the
  detector's outlier_ratio ({OUTLIER_RATIO:g}x) times the median of the {SPIKE_WINDOW} steps before it; detector
  outliers: earlywarn runs with a grad_outlier event.
  Hopeless (LR 30-300x the top of the healthy range, from step 0): per method, halted (median
  step), finished non-finite, finished finite (median kept vs the normal-LR twin); warned: runs
  with an event at level WARNING or worse (earlywarn)."""


# ---------------------------------------------------------------- scoring
def kept(e0: float, e: float, e_twin: float) -> float:
    """Fraction of the twin's progress kept; 0.0 for a non-finite E; NaN when the twin made none."""
    if e is None or not math.isfinite(e):
        return 0.0
    denom = e0 - e_twin
    if not (math.isfinite(denom) and denom > 0):
        return math.nan
    return (e0 - e) / denom


def healthy_harm(res: dict, bare: dict) -> dict[str, bool]:
    k_bare = kept(bare["E0"], bare["E"], bare["E"])
    k = kept(res["E0"], res["E"], bare["E"])
    return {"halted": bool(res["halted"]),
            "rewound": res.get("counters", {}).get("rewinds", 0) > 0,
            "critical": any(e["level"] == "critical" for e in res.get("events", [])),
            "worse": bool(k < k_bare - WORSE_MARGIN)}


def _smoothed(losses: list, t: int) -> float:
    """The median of the train loss at steps t-1..t+1 (non-finite / missing values left out; NaN if none)."""
    vals = [v for v in losses[max(0, t - 1):t + 2] if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else math.nan


def streaks(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps in a sorted list, as (first, last)."""
    out: list[tuple[int, int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def skip_stats(res: dict) -> dict:
    """skip% (a fraction), streak and streak@level (see DEFINITIONS), the worst optimizer's each."""
    out = {"fraction": 0.0, "streak": 0, "streak_at_level": 0}
    for skipped, losses in zip(res.get("skipped_steps") or [], res.get("losses") or []):
        if not skipped:
            continue
        out["fraction"] = max(out["fraction"], len(skipped) / max(1, len(losses)))
        top = math.nan
        for i, (first, last) in enumerate(runs := streaks(sorted(skipped))):
            out["streak"] = max(out["streak"], last - first + 1)
            if i == 0 or first - runs[i - 1][1] > LEVEL_STEPS:  # a new episode: its level, from steps with no skip
                level = [_smoothed(losses, t) for t in range(max(0, first - LEVEL_STEPS), first - 1)]
                top = max((v for v in level if math.isfinite(v)), default=math.nan)
            if not math.isfinite(top):
                out["streak_at_level"] = max(out["streak_at_level"], last - first + 1)
                continue
            back = next((t for t in range(first, last + 1) if _smoothed(losses, t) <= top + LEVEL_TOLERANCE * abs(top)), None)
            if back is not None:
                out["streak_at_level"] = max(out["streak_at_level"], last - back + 1)
    return out


def skip_harmed(stats: dict) -> bool:
    return stats["fraction"] > SKIP_FRACTION_LIMIT or stats["streak_at_level"] > SKIP_STREAK_LIMIT


def grad_ratios(res: dict) -> list[tuple[int, float]]:
    """(step, gradient norm over the median of the SPIKE_WINDOW steps before) from SPIKE_FROM on, optimizer 0."""
    norms = (res.get("grad_norms") or [[]])[0]
    out = []
    for t in range(SPIKE_FROM, len(norms)):
        before = [v for v in norms[max(0, t - SPIKE_WINDOW):t] if v is not None]
        if norms[t] is None or not before or statistics.median(before) <= 0:
            continue
        out.append((t, norms[t] / statistics.median(before)))
    return out


def bare_spikes(res: dict) -> list[tuple[int, float]]:
    """(step, ratio) of every bare gradient spike (see DEFINITIONS) of optimizer 0."""
    return [(t, r) for t, r in grad_ratios(res) if r > OUTLIER_RATIO]


def is_dying(bare_faulted: dict, twin: dict) -> bool:
    k = kept(bare_faulted["E0"], bare_faulted["E"], twin["E"])
    return not math.isfinite(bare_faulted["E"]) or k < DYING_BELOW


def is_rescued(res: dict, twin: dict) -> bool:
    return not res["halted"] and kept(res["E0"], res["E"], twin["E"]) >= RESCUED_AT


# ---------------------------------------------------------------- running
def jobs_for(configs: list[dict], methods: list[str]) -> list[tuple[dict, str]]:
    jobs = [(c, m) for c in configs for m in methods]
    jobs += [(twin_of(c), "bare") for c in configs if c.get("fault")]
    return jobs


def _cost(job) -> float:
    cfg, method = job
    per_step = {"chargpt": 12.0 if cfg["family"] == "self_spike" else 6.0, "cnn": 3.0, "lstm": 3.0,
                "gan": 2.0}.get(cfg["task"]["name"], 1.0)
    return cfg["steps"] * per_step * cfg.get("accum", 1) * (1.5 if method in ("earlywarn", "olmo_skipstep") else 1.0)


def _work(job) -> tuple[str, dict]:
    cfg, method = job
    return cache_key(cfg, method), run_one(cfg, method)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def run_all(jobs: list[tuple[dict, str]], n_jobs: int, use_cache: bool) -> dict[tuple[str, str], dict]:
    os.makedirs(CACHE, exist_ok=True)
    out: dict[tuple[str, str], dict] = {}
    todo = []
    for cfg, method in jobs:
        path = os.path.join(CACHE, cache_key(cfg, method) + ".json")
        if use_cache and os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                out[(cfg["id"], method)] = json.load(fh)
        else:
            todo.append((cfg, method))
    todo.sort(key=_cost, reverse=True)  # longest first: the pool ends together
    print(f"{len(jobs)} runs: {len(jobs) - len(todo)} cached, {len(todo)} to run on {n_jobs} process(es)", file=sys.stderr)
    t0 = time.monotonic()

    def store(key: str, res: dict) -> None:
        out[(res["id"], res["method"])] = res
        tmp = os.path.join(CACHE, key + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(res, fh)
        os.replace(tmp, os.path.join(CACHE, key + ".json"))
        done = len(out) - (len(jobs) - len(todo))
        if done % 50 == 0 or done == len(todo):
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


# ---------------------------------------------------------------- tables
def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


HARMS = ("halted", "rewound", "critical", "worse", "skips")


def harm_table(configs, results, methods) -> tuple[str, list[str]]:
    rows, totals, notes = [], {m: [0] * len(HARMS) for m in methods}, []
    fams = [f for f in HEALTHY if any(c["family"] == f for c in configs)]
    for fam in fams:
        row = [fam, 0]
        counts = {m: [0] * len(HARMS) for m in methods}
        for c in (c for c in configs if c["family"] == fam):
            bare = results.get((c["id"], "bare"))
            if bare is None or bare.get("error") or not math.isfinite(kept(bare["E0"], bare["E"], bare["E"])):
                notes.append(f"{c['id']}: bare made no progress or failed; left out")
                continue
            row[1] += 1
            for m in methods:
                res = results.get((c["id"], m))
                if res is None or res.get("error"):
                    continue
                h = healthy_harm(res, bare)
                h["skips"] = skip_harmed(skip_stats(res))
                for i, key in enumerate(HARMS):
                    counts[m][i] += h[key]
                    totals[m][i] += h[key]
                if m == "earlywarn" and any(h.values()):
                    notes.append(_harm_note(c, res, bare, h))
        rows.append(row + ["/".join(map(str, counts[m])) for m in methods])
    rows.append(["total", sum(r[1] for r in rows)] + ["/".join(map(str, totals[m])) for m in methods])
    return _table(["healthy family", "n"] + [f"{m} h/r/c/w/s" for m in methods], rows), notes


SKIPPING = ("gradscaler_skip", "olmo_skipstep", "earlywarn")


def skip_table(configs, results, methods) -> str:
    """Per healthy family and method that skips: runs over the limits, the largest skip%,
    streak and streak@level over its runs."""
    ms = [m for m in methods if m in SKIPPING]
    rows = []
    for fam in (f for f in HEALTHY if any(c["family"] == f for c in configs)):
        row = [fam]
        for m in ms:
            stats = [skip_stats(r) for c in configs if c["family"] == fam
                     for r in [results.get((c["id"], m))] if r and not r.get("error")]
            if not stats:
                row.append("-")
                continue
            row.append(f"{sum(map(skip_harmed, stats))} | {100 * max(st['fraction'] for st in stats):.1f}% "
                       f"{max(st['streak'] for st in stats)} {max(st['streak_at_level'] for st in stats)}")
        rows.append(row)
    return _table(["skipped steps, healthy"] + [f"{m}: s | max skip% streak streak@level" for m in ms], rows)


def spike_table(configs, results) -> str:
    """How often the bare runs of ``self_spike`` spike on their own, and what earlywarn did."""
    rows = []
    for fam in ("self_spike",):
        cs = [c for c in configs if c["family"] == fam]
        bares = [results.get((c["id"], "bare")) for c in cs]
        bares = [b for b in bares if b and not b.get("error")]
        if not bares:
            continue
        spikes = [bare_spikes(b) for b in bares]
        top = sorted(max((r for _, r in grad_ratios(b)), default=0.0) for b in bares)
        ews = [results.get((c["id"], "earlywarn")) for c in cs]
        ews = [r for r in ews if r and not r.get("error")]
        outl = sum(any(e["kind"] == "grad_outlier" for e in r.get("events", [])) for r in ews)
        skipped = sum(bool(sum(map(len, r.get("skipped_steps") or []))) for r in ews)
        steps = [t for sp in spikes for t, _ in sp]
        rows.append([fam, len(bares), sum(bool(sp) for sp in spikes),
                     f"{statistics.median(top):.1f} ({top[0]:.1f}-{top[-1]:.1f})",
                     f"{min(steps)}-{max(steps)}" if steps else "-",
                     f"{outl} of {len(ews)}" if ews else "-", f"{skipped} of {len(ews)}" if ews else "-"])
    return _table(["own spikes", "bare runs", f"with a spike > {OUTLIER_RATIO:g}x", "largest ratio: median (range)", "at steps",
                   "earlywarn: grad_outlier", "earlywarn: skipped"], rows) if rows else ""


def _harm_note(c, res, bare, h) -> str:
    what = ",".join(k for k, v in h.items() if v)
    st = skip_stats(res)
    if st["streak"]:
        what += f" (skip {100 * st['fraction']:.1f}%, streak {st['streak']}, @level {st['streak_at_level']})"
    first = next((e for e in res.get("events", []) if e["level"] in ("critical",) or e["kind"] in ("rewind", "halt")), None)
    first = first or next((e for e in res.get("events", []) if e["kind"] == "skip"), None)
    msg = f" first: step {first['step']} {first['kind']}/{first['level']}: {first['message'][:160]}" if first else ""
    k = kept(res["E0"], res["E"], bare["E"])
    return f"{c['id']} ({c['task']['name']}, {c['steps']} steps): {what}; kept {k:.2f}" + (
        f"; halted at {res['halt_step']}" if res["halted"] else "") + msg


def rescue_table(configs, results, methods) -> tuple[str, dict]:
    rows, tot = [], {"n": 0, "dying": 0, **{m: 0 for m in methods}}
    for fam in (f for f in FAULT_FAMILIES if f != "hopeless"):
        cs = [c for c in configs if c["family"] == fam]
        if not cs:
            continue
        n = dying = 0
        rescued = {m: 0 for m in methods}
        for c in cs:
            twin, bare = results.get((c["id"] + "~twin", "bare")), results.get((c["id"], "bare"))
            if not twin or not bare or twin.get("error") or bare.get("error") or not math.isfinite(kept(twin["E0"], twin["E"], twin["E"])):
                continue
            n += 1
            if not is_dying(bare, twin):
                continue
            dying += 1
            for m in methods:
                res = results.get((c["id"], m))
                rescued[m] += bool(res and not res.get("error") and is_rescued(res, twin))
        tot["n"] += n
        tot["dying"] += dying
        for m in methods:
            tot[m] += rescued[m]
        rows.append([fam, n, dying] + [rescued[m] for m in methods])
    pct = lambda x: f"{x} ({100 * x / tot['dying']:.0f}%)" if tot["dying"] else str(x)  # noqa: E731
    rows.append(["total", tot["n"], tot["dying"]] + [pct(tot[m]) for m in methods])
    return _table(["fault family", "n", "dying"] + [f"{m} rescued" for m in methods], rows), tot


def kept_table(configs, results, methods) -> str:
    """Median kept per fault family and method over all (not only dying) configs."""
    rows = []
    for fam in FAULT_FAMILIES:
        cs = [c for c in configs if c["family"] == fam]
        if not cs:
            continue
        row = [fam]
        for m in methods:
            ks = []
            for c in cs:
                twin, res = results.get((c["id"] + "~twin", "bare")), results.get((c["id"], m))
                if twin and res and not res.get("error") and not twin.get("error"):
                    k = kept(res["E0"], res["E"], twin["E"])
                    if math.isfinite(k):
                        ks.append(k)
            row.append(f"{statistics.median(ks):.2f}" if ks else "-")
        rows.append(row)
    return _table(["median kept (all configs)"] + methods, rows)


def hopeless_table(configs, results, methods) -> str:
    cs = [c for c in configs if c["family"] == "hopeless"]
    rows = []
    for m in methods:
        halted, nonfinite, finite, warned = [], 0, [], 0
        for c in cs:
            res, twin = results.get((c["id"], m)), results.get((c["id"] + "~twin", "bare"))
            if not res or res.get("error") or not twin:
                continue
            warned += any(e["level"] in ("warning", "critical") for e in res.get("events", []))
            if res["halted"]:
                halted.append(res["halt_step"])
            elif not math.isfinite(res["E"]):
                nonfinite += 1
            else:
                finite.append(kept(res["E0"], res["E"], twin["E"]))
        med = lambda xs, f: f.format(statistics.median(xs)) if xs else "-"  # noqa: E731
        rows.append([m, len(cs), f"{len(halted)} (step {med(halted, '{:.0f}')})", nonfinite,
                     f"{len(finite)} (kept {med([k for k in finite if math.isfinite(k)], '{:.2f}')})",
                     warned if m == "earlywarn" else "-"])
    return _table(["hopeless: method", "n", "halted (median step)", "finished non-finite",
                   "finished finite (median kept)", "warned"], rows)


def show(config_id: str, configs, results, methods) -> None:
    cfg = next((c for c in configs if c["id"] == config_id), None)
    if cfg is None:
        raise SystemExit(f"no config {config_id!r} among the selected families (ids look like domain_switch-0-003)")
    print(json.dumps(cfg, indent=None, sort_keys=True))
    twin = results.get((config_id + "~twin", "bare")) or results.get((config_id, "bare"))
    for m in methods + (["bare (twin)"] if cfg.get("fault") else []):
        res = results.get((config_id + "~twin", "bare")) if m == "bare (twin)" else results.get((config_id, m))
        if res is None:
            continue
        if res.get("error"):
            print(f"\n== {m}: ERROR\n{res['error']}")
            continue
        k = kept(res["E0"], res["E"], twin["E"]) if twin else math.nan
        at = f" at {res['halt_step']}" if res["halted"] else ""
        print(f"\n== {m}: E0 {res['E0']:.4f}  E {res['E']:.4f}  kept {k:.3f}  steps run {res['steps_run']}"
              f"  halted {res['halted']}{at}  skips {res.get('skips', 0)}  wall {res['wall_s']} s")
        for i, curve in enumerate(res["loss_curve"]):
            print(f"   train loss (opt {i}, {len(curve)} bins): " + " ".join("nan" if v is None else f"{v:.3g}" for v in curve))
        st = skip_stats(res)
        if st["streak"]:
            print(f"   skipped: {100 * st['fraction']:.1f}% of steps, streak {st['streak']}, streak@level "
                  f"{st['streak_at_level']}; steps {[s for sk in res['skipped_steps'] for s in sk][:40]}")
        if res.get("halt_message"):
            print(f"   halt: {res['halt_message'][:600]}")
        if res.get("counters"):
            print(f"   counters: {res['counters']}")
        for e in res.get("events", [])[:60]:
            print(f"   [{e['opt']}] step {e['step']:4d} {e['kind']}/{e['level']}: {e['message'][:300]}")
        if len(res.get("events", [])) > 60:
            print(f"   ... {len(res['events']) - 60} more events")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="two configs per family")
    ap.add_argument("--per-family", type=int, default=None, help="configs per family (default: each family's own)")
    ap.add_argument("--seed-base", type=int, default=0)
    ap.add_argument("--families", default=None, help=f"comma-separated, of: {', '.join(FAMILIES)}")
    ap.add_argument("--methods", default=None, help=f"comma-separated, of: {', '.join(METHODS)}")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--show", default=None, metavar="CONFIG_ID")
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--soak", action="store_true", help="the 20,000-step soak (benchmarks/rescue_soak.py)")
    ap.add_argument("--soak-steps", type=int, default=20_000)
    ap.add_argument("--burst-length", type=int, default=None, metavar="STEPS",
                    help="every burst this many steps long (default: each config's own, 10-40): a burst that "
                         "outlasts the outlier skip budget")
    args = ap.parse_args(argv)
    if args.soak:
        from rescue_soak import main as soak_main
        soak_main(["--soak-steps", str(args.soak_steps)])
        return
    families = args.families.split(",") if args.families else None
    methods = args.methods.split(",") if args.methods else list(METHODS)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}: choose from {', '.join(METHODS)}")
    if "bare" not in methods:
        methods = ["bare"] + methods  # every score is relative to bare
    n = 2 if args.quick else args.per_family
    configs = all_configs(args.seed_base, families, n)
    if args.burst_length is not None:
        if args.burst_length < 1:
            raise SystemExit(f"--burst-length {args.burst_length}: use a number of steps >= 1")
        for c in configs:
            if (c.get("fault") or {}).get("kind") == "burst":
                c["fault"]["length"] = args.burst_length
                c["id"] += f"-L{args.burst_length}"
    if args.show:
        configs = [c for c in configs if c["id"] == args.show] or configs
    t0 = time.monotonic()
    results = run_all(jobs_for(configs if not args.show else [c for c in configs if c["id"] == args.show], methods),
                      args.jobs, not args.no_cache)
    wall = time.monotonic() - t0
    if args.show:
        show(args.show, configs, results, methods)
        return
    errors = [r for r in results.values() if r.get("error")]
    print(DEFINITIONS)
    healthy = [c for c in configs if c["family"] in HEALTHY]
    faulted = [c for c in configs if c["family"] in FAULT_FAMILIES]
    print(f"\n{len(healthy)} healthy + {len([c for c in faulted if c['family'] != 'hopeless'])} faulted + "
          f"{len([c for c in faulted if c['family'] == 'hopeless'])} hopeless configs (seed base {args.seed_base}), "
          f"methods: {', '.join(methods)}; wall {wall:.0f} s on {args.jobs} process(es)\n")
    if healthy:
        table, notes = harm_table(healthy, results, methods)
        print(table)
        print("\n" + skip_table(healthy, results, methods))
        spikes = spike_table(healthy, results)
        if spikes:
            print("\n" + spikes)
        if notes:
            print("\nearlywarn on healthy configs (and configs left out):")
            for line in notes:
                print("  " + line)
    if faulted:
        table, _ = rescue_table(faulted, results, methods)
        print("\n" + table + "\n\n" + kept_table(faulted, results, methods))
        if any(c["family"] == "hopeless" for c in faulted):
            print("\n" + hopeless_table(faulted, results, methods))
    if errors:
        print(f"\n{len(errors)} run(s) failed:")
        for r in errors[:10]:
            print(f"  {r['id']} {r['method']}: {r['error'].strip().splitlines()[-1]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"configs": configs, "results": [r for r in results.values()]}, fh)


if __name__ == "__main__":
    main()
