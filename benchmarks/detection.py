"""Detection benchmark: how early, how often right, how often wrong, on runs no one tuned on.

Data
- The corpus of ``benchmarks/corpus.py``: small models really trained on CPU, in scenario
  *families* (LR sweeps with and without warm-up, re-warm-ups, short LR pulses, bad batches,
  gradual LR ramps; healthy language models, small batches, classification against a teacher,
  regression to the noise floor, a negative loss, fine-tunes), char-level GPT and MLP LMs and
  MLP students, Adam / AdamW / SGD, fp32 / fp16. A GRU language model under the same recipes is
  the *unseen family*: no choice below ever looks at it.
- The real logs in ``tests/data/realruns``: the healthy llm.c GPT-2 124M run (19,560 steps; it
  logs the LR too) and the Megatron lines quoted in the BigScience chronicles (BLOOM-176B's
  31214-31222 spike, scored with the run's typical grad norm 0.2 as a prior).

Labels (one rule for every run)
  The collapse step is the first step ``t`` whose loss is non-finite, or at least 1.5x the
  median of the (up to) 50 finite losses before it, and that does not recover: every loss in the
  next 20 steps stays at least 1.2x that median (or is non-finite), and there are such steps (a
  run cut at ``t`` counts only when the run itself stopped there). A collapse is *scored* when at
  least 50 steps precede it (or the run has a prior baseline); a run identical to an earlier one
  up to its collapse counts once. A run with no collapse is *healthy*.

Scoring
  An *alarm* is an earlywarn alert at ``warning`` or above, or any firing of a peer's rule. The
  first alarm in ``[t - 25, t - 1]`` detects the collapse with lead ``t - alarm``. Every alarm of
  a healthy run, and every alarm before ``t - 25``, is false; false alarms are counted as onsets
  (no alarm in the 10 steps before) per 1,000 healthy steps. *Healthy runs alarmed*: the share of
  healthy runs with any alarm. *False criticals* (earlywarn's ``critical`` alerts on healthy
  steps: what triggers rewinds) are counted separately; the target is 0.
  Two readings of "healthy" (``READINGS``), both printed: *strict* (every step above) and
  *hazard* (less the window after a hazard handed to the run on purpose: an LR pulse, a re-warm
  past the old peak, a bad batch; alarms there are counted apart). Recall is printed over all
  scored collapses and over the *leadable* ones (less the collapses at a bad batch's own step,
  which no signal precedes). The choice of defaults reads the targets in ``CHOICE_READING`` with
  the leadable recall.

Sections
- per-signal lead (item 1 of issue 14): each candidate signal alone, as a trailing-median z-score
  whose threshold is set to 0.5 false alarms / 1k healthy steps on the tuning families.
- leave-one-family-out (item 2): for each family, earlywarn's settings are chosen on all the
  other families (the llm.c and BLOOM checks are part of every choice) from a fixed candidate
  set, then scored on the family left out; beside it the in-sample numbers of the defaults.
- the frontier and Pareto check against every baseline at the baseline's own false-alarm rate
  (item 3); the input views (what is logged: everything, the guard's gradient + loss, the loss
  alone: item 4).

Usage: ``python benchmarks/detection.py [--verbose] [--no-lofo] [--no-signals] [--view V]``
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from earlywarn.detect import DetectorConfig, StreamingDetector  # noqa: E402
from earlywarn.detect.observation import StepColumns  # noqa: E402
from earlywarn.detect.peers import (KillLossSpike, LightningSpikeDetection, NanLossCheck,  # noqa: E402
                                    NonfiniteGradCheck, OlmoSkipStep, ZClipRule)
from earlywarn.events import Level  # noqa: E402

REALRUNS = ROOT / "tests" / "data" / "realruns"
HORIZON = 25
ONSET_GAP = 10
MIN_HISTORY = 50
BLOOM_PRIOR = {"grad_norm": 0.2}
UNSEEN = ("gru",)
"""Families no choice is made on (the held-out architecture)."""

TARGETS = {"recall": 0.90, "median_lead": 3.0, "fa_per_1k": 0.5, "healthy_alarmed": 0.10}

VIEWS: dict[str, tuple[str, ...]] = {
    "logged": ("grad", "layers", "loss", "loss_scale", "lr", "update_norm", "param_norm"),
    "guard": ("grad", "layers", "loss", "loss_scale", "lr"),
    "grad+loss": ("grad", "layers", "loss", "loss_scale"),
    "loss+lr": ("loss", "lr"),
    "loss": ("loss",),
}
"""What the detector is fed. ``logged``: everything a full log has (the update norm of row t is
the change applied at step t). ``guard``: what ``watch()`` hands the detector (gradient
statistics, the reported loss, the loss scale, the LR of the step). ``grad+loss``: the guard
before issue 14. ``loss+lr`` / ``loss``: loss-only logs (issue 14 item 4)."""


@dataclass
class BenchRun:
    name: str
    family: str
    source: str  # "corpus" | "real"
    steps: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray | None  # NaN: a real NaN gradient (corpus) or not logged (real logs)
    layer_norms: np.ndarray | None = None
    layer_nonfinite: np.ndarray | None = None
    layer_names: tuple[str, ...] = ()
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    baseline: dict | None = None
    bad_steps: tuple[int, ...] = ()  # corpus: the steps fed a bad batch
    hazards: tuple[tuple[int, int], ...] = ()
    """Corpus: row ranges ``[a, b)`` from an injected hazard (an LR pulse, a re-warm above the old
    peak, a bad batch) to ``HORIZON`` rows after it ended (see :func:`hazard_windows`)."""
    ended_early: bool = True
    collapse: int | None = None
    scored: bool = False
    duplicate_of: str | None = None

    @property
    def healthy(self) -> bool:
        return self.collapse is None

    def columns(self, view: str) -> StepColumns:
        want = VIEWS[view]
        ex = {}
        for k in ("loss_scale", "lr", "update_norm", "param_norm"):
            if k in want and k in self.extras:
                v = self.extras[k]
                ex[k] = (v, np.isfinite(v))
        g = gk = None
        if "grad" in want and self.grad_norm is not None:
            g = self.grad_norm
            gk = None if self.source == "corpus" else ~np.isnan(g)
        lay = self.layer_norms if "layers" in want else None
        return StepColumns(step=self.steps, grad_norm=g, grad_known=gk, loss=self.loss,
                           layer_norms=lay, layer_nonfinite=self.layer_nonfinite if lay is not None else None,
                           extras=ex)

    def layer_names_for(self, view: str) -> tuple[str, ...]:
        return self.layer_names if "layers" in VIEWS[view] else ()


def label(steps: np.ndarray, loss: np.ndarray, ended_early: bool = True, window: int = 50,
          ratio: float = 1.5, stay: float = 1.2, horizon: int = 20) -> int | None:
    """Index of the collapse step by the documented rule, or None for a healthy run."""
    n = len(loss)
    for i in range(n):
        if not math.isfinite(loss[i]):
            return i
        prev = [v for v in loss[max(0, i - window):i] if math.isfinite(v)]
        if len(prev) < 2:
            continue
        ref = float(np.median(prev))
        if ref > 0 and loss[i] >= ratio * ref:
            after = [loss[j] for j in range(i + 1, n) if steps[j] - steps[i] <= horizon]
            if not after and not ended_early:
                continue  # the run simply ended here
            if all((not math.isfinite(v)) or v >= stay * ref for v in after):
                return i
    return None


def hazard_windows(spec, n: int) -> tuple[tuple[int, int], ...]:
    """Where a run was handed a hazard on purpose: from its first step to ``HORIZON`` steps after
    its last. An LR pulse (x > 1) from its first step; a re-warm-up from the first step above the
    old peak to the step it reaches its new top; each bad batch. Read from the run's recipe, not
    from anything a detector sees."""
    from corpus import lr_at

    out = []
    if spec.pulse_at >= 0 and spec.pulse_mult > 1.0:
        out.append((spec.pulse_at, spec.pulse_at + spec.pulse_len + HORIZON))
    if spec.rewarm_at >= 0 and spec.rewarm_mult > 1.0:
        above = [t for t in range(spec.rewarm_at, spec.steps) if lr_at(spec, t) > spec.lr * (1 + 1e-9)]
        if above:
            out.append((above[0], spec.rewarm_at + spec.rewarm_len + HORIZON))
    for b in spec.bad_steps:
        out.append((b, b + 1 + HORIZON))
    return tuple((a, min(b, n)) for a, b in out if a < n)


def corpus_runs() -> list[BenchRun]:
    from corpus import load_corpus

    runs = []
    for r in load_corpus(verbose=True):
        c = r.cols
        steps = np.arange(len(c["loss"]))
        ex = {k: np.asarray(c[k], dtype=np.float64) for k in ("lr", "update_norm", "param_norm", "gv", "gv_max")}
        if r.spec.fp16:
            ex["loss_scale"] = np.asarray(c["loss_scale"], dtype=np.float64)
        b = BenchRun(r.name, r.spec.family, "corpus", steps, np.asarray(c["loss"], dtype=np.float64),
                     np.asarray(c["grad_norm"], dtype=np.float64), np.asarray(c["layer_norms"], dtype=np.float64),
                     np.asarray(c["layer_nonfinite"], dtype=np.float64), r.layer_names_tuple, ex,
                     bad_steps=tuple(r.spec.bad_steps), hazards=hazard_windows(r.spec, len(steps)),
                     ended_early=len(steps) < r.spec.steps)
        b.collapse = label(steps, b.loss, b.ended_early)
        b.scored = b.collapse is not None and b.collapse >= MIN_HISTORY
        runs.append(b)
    mark_duplicates(runs)
    return runs


def mark_duplicates(runs: list[BenchRun]) -> None:
    """A generated run identical to an earlier one up to its collapse (or end) is the same event."""
    seen: list[BenchRun] = []
    for r in runs:
        end = r.collapse + 1 if r.collapse is not None else len(r.steps)
        for q in seen:
            qend = q.collapse + 1 if q.collapse is not None else len(q.steps)
            if end == qend and np.array_equal(r.loss[:end], q.loss[:end], equal_nan=True):
                r.duplicate_of = q.name
                break
        else:
            seen.append(r)


def real_runs() -> list[BenchRun]:
    runs = []
    rows = list(csv.DictReader(open(REALRUNS / "llmc_gpt2_124m" / "main.csv")))
    rows = [r for r in rows if r["train_loss"] and r["grad_norm"]]
    steps = np.array([int(r["step"]) for r in rows])
    b = BenchRun("llmc_gpt2_124m", "real", "real", steps, np.array([float(r["train_loss"]) for r in rows]),
                 np.array([float(r["grad_norm"]) for r in rows]),
                 extras={"lr": np.array([float(r["lr"]) if r["lr"] else np.nan for r in rows])})
    b.collapse = label(steps, b.loss)
    runs.append(b)
    lines = list(csv.DictReader(open(REALRUNS / "bloom_chronicles" / "megatron_iteration_lines.csv")))
    by: dict[str, list[dict]] = {}
    for r in lines:
        by.setdefault(r["snippet"], []).append(r)
    for snip, rs in by.items():
        rs = sorted(rs, key=lambda r: int(r["iteration"]))
        rs = [r for r in rs if r["lm_loss"]]
        if len(rs) < 3 or len({r["iteration"] for r in rs}) < len(rs):
            continue  # single quoted lines, or the same iteration re-run: not a sequence
        steps = np.array([int(r["iteration"]) for r in rs])
        gn = np.array([float(r["grad_norm"]) if r["grad_norm"] and float(r["grad_norm"]) > 0 else np.nan
                       for r in rs])  # "0.000" = not computed
        ls = np.array([float(r["loss_scale"]) if r["loss_scale"] else np.nan for r in rs])
        name = snip.replace("/chronicles.md#", ":").replace("tr11-176B-ml:", "bloom176b:")
        b = BenchRun(name, "real", "real", steps, np.array([float(r["lm_loss"]) for r in rs]), gn,
                     extras={"loss_scale": ls} if np.isfinite(ls).any() else {},
                     baseline=BLOOM_PRIOR if snip.startswith("tr11-176B-ml/chronicles.md#block7") else None)
        b.collapse = label(steps, b.loss)
        b.scored = b.collapse is not None and (b.collapse >= MIN_HISTORY or b.baseline is not None)
        runs.append(b)
    return runs


def counted(run: BenchRun) -> bool:
    return run.duplicate_of is None and not (run.collapse is not None and not run.scored)


# ----------------------------------------------------------------------------------------------
# what a detector said on one run


@dataclass
class Alarms:
    alarm: list[int]  # rows with an alarm (warning or worse; any firing of a peer)
    critical: list[int] = field(default_factory=list)  # rows with a critical (earlywarn only)
    first_warning: int | None = None  # step of the first warning or worse (real-run checks)


def earlywarn_alarms(run: BenchRun, cfg: DetectorConfig | None, view: str = "logged") -> Alarms:
    sd = StreamingDetector(cfg, run.layer_names_for(view), run.baseline)
    alarm, crit = [], []
    for row, e in sd.observe_columns(run.columns(view)):
        if e.level >= Level.WARNING and (not alarm or alarm[-1] != row):
            alarm.append(row)
        if e.level >= Level.CRITICAL and (not crit or crit[-1] != row):
            crit.append(row)
    return Alarms(alarm, crit, int(run.steps[alarm[0]]) if alarm else None)


PEER_FACTORIES: dict[str, Callable[[BenchRun], object]] = {
    "NaN-loss check": lambda r: NanLossCheck(),
    "non-finite grad": lambda r: NonfiniteGradCheck(),
    "OLMo-core SkipStep": lambda r: OlmoSkipStep(),
    "ZClip": lambda r: ZClipRule(),
    "KillLossSpike": lambda r: KillLossSpike(max_steps=len(r.steps)),
    "Lightning Spike": lambda r: LightningSpikeDetection(),
}
"""The baselines at their published defaults (OLMo-core 6 sigma / 128, ZClip z > 2.5, ...)."""


def peer_alarms(run: BenchRun, make: Callable[[BenchRun], object]) -> Alarms:
    det = make(run)
    cols = run.columns("grad+loss")
    out = [i for i in range(len(run.steps)) if det.observe(cols.observation(i))]
    return Alarms(out, [], int(run.steps[out[0]]) if out else None)


# ----------------------------------------------------------------------------------------------
# scores


READINGS = ("hazard", "strict")
"""What counts as a healthy step for the false-alarm targets. ``strict``: every step of a run
that did not collapse (and of a collapsed run, before its horizon). ``hazard``: the same, less the
hazard windows of :func:`hazard_windows`: an alarm there warns of a hazard that was really handed
to the run (an LR pulse, a re-warm past the old peak, a bad batch), whether or not the run
survived it, so it is counted apart (``hazard_warned``), not as a false alarm. Criticals are
counted strictly in both. The targets are read in ``CHOICE_READING``; every table prints both."""

CHOICE_READING = "hazard"


@dataclass
class Score:
    events: int = 0
    detected: int = 0
    leads: list[int] = field(default_factory=list)
    false_alarms: int = 0  # strict reading
    healthy_steps: int = 0
    healthy_alarmed: int = 0
    hz_false_alarms: int = 0  # hazard reading
    hz_healthy_steps: int = 0
    hz_alarmed: int = 0
    hazard_runs: int = 0  # runs that survived a hazard handed to them ...
    hazard_warned: int = 0  # ... and had an alarm inside its window
    false_criticals: int = 0
    healthy_runs: int = 0
    healthy_run_criticals: int = 0  # criticals on runs that never collapse
    instant_events: int = 0  # collapses at a bad batch's own step (see instant())
    instant_detected: int = 0
    per_event: dict[str, int | None] = field(default_factory=dict)
    fa_runs: dict[str, int] = field(default_factory=dict)  # strict false alarms per run
    hz_fa_runs: dict[str, int] = field(default_factory=dict)

    def __iadd__(self, o: "Score") -> "Score":
        for k in ("events", "detected", "false_alarms", "healthy_steps", "healthy_alarmed", "hz_false_alarms",
                  "hz_healthy_steps", "hz_alarmed", "hazard_runs", "hazard_warned", "false_criticals",
                  "healthy_runs", "healthy_run_criticals", "instant_events", "instant_detected"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.leads = self.leads + o.leads
        self.per_event = {**self.per_event, **o.per_event}
        self.fa_runs = {**self.fa_runs, **o.fa_runs}
        self.hz_fa_runs = {**self.hz_fa_runs, **o.hz_fa_runs}
        return self

    @property
    def recall(self) -> float:
        return self.detected / self.events if self.events else float("nan")

    @property
    def leadable_recall(self) -> float:
        """Recall over the collapses some signal can precede (instant ones left out)."""
        n = self.events - self.instant_events
        return (self.detected - self.instant_detected) / n if n else float("nan")

    @property
    def median_lead(self) -> float:
        return float(np.median(self.leads)) if self.leads else float("nan")

    def fa(self, reading: str = "strict") -> float:
        n, steps = ((self.false_alarms, self.healthy_steps) if reading == "strict" else
                    (self.hz_false_alarms, self.hz_healthy_steps))
        return 1e3 * n / steps if steps else float("nan")

    def alarmed(self, reading: str = "strict") -> float:
        n = self.healthy_alarmed if reading == "strict" else self.hz_alarmed
        return n / self.healthy_runs if self.healthy_runs else 0.0

    @property
    def fa_rate(self) -> float:
        return self.fa("strict")

    @property
    def alarmed_share(self) -> float:
        return self.alarmed("strict")

    @property
    def crit_rate(self) -> float:
        return 1e3 * self.false_criticals / self.healthy_steps if self.healthy_steps else float("nan")

    def meets(self, reading: str = CHOICE_READING, leadable: bool = True) -> bool:
        rec = self.leadable_recall if leadable else self.recall
        return (rec >= TARGETS["recall"] and self.median_lead >= TARGETS["median_lead"]
                and self.fa(reading) <= TARGETS["fa_per_1k"] and self.alarmed(reading) <= TARGETS["healthy_alarmed"]
                and self.false_criticals == 0)


def _onsets(steps: np.ndarray, rows: list[int], end: int) -> int:
    n, prev = 0, None
    for i in rows:
        if i >= end:
            break
        if prev is None or steps[i] - steps[prev] > ONSET_GAP:
            n += 1
        prev = i
    return n


def score_run(run: BenchRun, al: Alarms) -> Score:
    sc = Score()
    if not counted(run):
        return sc  # not scorable or a duplicate: listed, not counted
    steps = run.steps
    if run.collapse is None:
        end = len(steps)
        sc.healthy_runs = 1
    else:
        t = run.collapse
        first = next((i for i in al.alarm if steps[t] - HORIZON <= steps[i] < steps[t]), None)
        sc.events = 1
        lead = None if first is None else int(steps[t] - steps[first])
        sc.per_event[run.name] = lead
        if lead is not None:
            sc.detected, sc.leads = 1, [lead]
        if instant(run):
            sc.instant_events, sc.instant_detected = 1, sc.detected
        end = int(np.searchsorted(steps, steps[t] - HORIZON))
    sc.healthy_steps = sc.hz_healthy_steps = end
    sc.false_alarms = sc.hz_false_alarms = _onsets(steps, al.alarm, end)
    if run.hazards:
        inside = np.zeros(len(steps), dtype=bool)
        for a, b in run.hazards:
            inside[a:b] = True
        if run.collapse is None:
            sc.hazard_runs = 1
            sc.hazard_warned = int(any(inside[i] for i in al.alarm))
        sc.hz_false_alarms = _onsets(steps, [i for i in al.alarm if not inside[i]], end)
        sc.hz_healthy_steps = end - int(inside[:end].sum())
    sc.false_criticals = _onsets(steps, al.critical, end)
    if run.collapse is None:
        sc.healthy_alarmed = int(sc.false_alarms > 0)
        sc.hz_alarmed = int(sc.hz_false_alarms > 0)
        sc.healthy_run_criticals = sc.false_criticals
    if sc.false_alarms:
        sc.fa_runs[run.name] = sc.false_alarms
    if sc.hz_false_alarms:
        sc.hz_fa_runs[run.name] = sc.hz_false_alarms
    return sc


def total(runs: list[BenchRun], results: dict[str, Alarms], keep: Callable[[BenchRun], bool] = lambda r: True) -> Score:
    sc = Score()
    for r in runs:
        if keep(r):
            sc += score_run(r, results[r.name])
    return sc


def instant(run: BenchRun) -> bool:
    """A collapse at a bad batch's own step: its loss is the first sign; nothing can lead it."""
    return run.collapse is not None and int(run.steps[run.collapse]) in run.bad_steps


def real_checks(runs: list[BenchRun], results: dict[str, Alarms]) -> tuple[bool, list[str]]:
    """llm.c: no warning; BLOOM-176B: a warning by iteration 31217, >= 2 steps before the jump."""
    ok, lines = True, []
    for r in runs:
        if r.name == "llmc_gpt2_124m":
            a = results[r.name]
            good = not a.alarm
            ok &= good
            lines.append(f"llm.c GPT-2 124M ({len(r.steps)} steps, healthy): {len(a.alarm)} steps with a warning "
                         f"or worse: {'OK' if good else 'FAILED'} (target: none)")
        if r.name.startswith("bloom176b:block7"):
            a = results[r.name]
            jump = int(r.steps[r.collapse]) if r.collapse is not None else None
            good = a.first_warning is not None and a.first_warning <= 31217 and jump is not None
            ok &= good
            lines.append(f"BLOOM-176B 31214-31222: first warning at iteration {a.first_warning}, loss jump at {jump}: "
                         f"{'OK' if good else 'MISSED'} (target: by 31217)")
    return ok, lines


# ----------------------------------------------------------------------------------------------
# per-signal lead (issue 14 item 1): each candidate alone, at one false-alarm rate


SIGNALS: dict[str, Callable[[BenchRun], np.ndarray | None]] = {
    "grad_norm": lambda r: r.grad_norm,
    "loss": lambda r: r.loss,
    "update_norm (logged at its step)": lambda r: r.extras.get("update_norm"),
    "update_norm (live: one step late)": lambda r: None if "update_norm" not in r.extras else
    np.concatenate([[np.nan], r.extras["update_norm"][:-1]]),
    "update / param": lambda r: None if "update_norm" not in r.extras else r.extras["update_norm"] / r.extras["param_norm"],
    "param_norm": lambda r: r.extras.get("param_norm"),
    "lr": lambda r: r.extras.get("lr"),
    "g^2/v (global)": lambda r: r.extras.get("gv"),
    "g^2/v (max layer)": lambda r: r.extras.get("gv_max"),
    "max layer grad z": None,  # computed from the layer matrix below
}


def _trailing_z(x: np.ndarray, window: int = 50, floor: float = 0.05) -> np.ndarray:
    """z of log x against the median / MAD of the previous ``window`` finite values."""
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(x > 0, np.log(np.where(x > 0, x, 1.0)), np.nan)
    y = np.where(np.isfinite(y), y, np.nan)
    n = len(y)
    z = np.full(n, np.nan)
    pad = np.concatenate([np.full(window, np.nan), y])
    win = np.lib.stride_tricks.sliding_window_view(pad[:-1], window)[:n]  # the window before row i
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows
        med = np.nanmedian(win, axis=1)
        mad = np.nanmedian(np.abs(win - med[:, None]), axis=1) * 1.4826
        cnt = np.sum(np.isfinite(win), axis=1)
    z = (y - med) / np.maximum(mad, floor)
    z[cnt < 20] = np.nan
    # a non-finite value of a signal that has one is as alarming as it gets
    z[~np.isfinite(x) & ~np.isnan(x)] = np.inf
    return z


def signal_leads(runs: list[BenchRun], fa_target: float = 0.5) -> list[str]:
    tune = [r for r in runs if r.source == "corpus" and r.family not in UNSEEN and counted(r)]
    ladder = (1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16, 20, 30, 50, 100)
    lines = [f"{'signal':36s} {'threshold z':>11s} {'recall@lead>=1':>15s} {'median lead':>12s} "
             f"{'FA/1k':>7s} {'events with the signal':>23s}"]
    for name, get in SIGNALS.items():
        zs = {}
        for r in tune:
            if get is None:
                if r.layer_norms is None:
                    continue
                zl = np.stack([_trailing_z(r.layer_norms[:, j]) for j in range(r.layer_norms.shape[1])], 1)
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    zs[r.name] = np.nanmax(np.where(np.isnan(zl), -np.inf, zl), axis=1)
                continue
            x = get(r)
            if x is not None and np.isfinite(x).any():
                zs[r.name] = _trailing_z(np.asarray(x, dtype=np.float64))
        if not zs:
            continue
        pick = None
        for th in ladder:
            res = {n: Alarms([int(i) for i in np.flatnonzero(z >= th)]) for n, z in zs.items()}
            sc = total([r for r in tune if r.name in zs], res)
            if sc.fa_rate <= fa_target:
                pick = (th, sc)
                break
        ev = sum(1 for r in tune if r.name in zs and r.collapse is not None)
        if pick is None:
            lines.append(f"{name:36s} {'-':>11s} (no threshold on the ladder meets {fa_target} FA/1k)")
            continue
        th, sc = pick
        lines.append(f"{name:36s} {th:>11g} {sc.recall:>15.1%} {sc.median_lead:>12.1f} {sc.fa_rate:>7.2f} "
                     f"{f'{ev}':>23s}")
    return lines


# ----------------------------------------------------------------------------------------------
# earlywarn's candidate settings, leave-one-family-out, frontier


def candidates(base: DetectorConfig | None = None) -> dict[str, DetectorConfig]:
    """The fixed set of settings every choice below is made from (the defaults among them)."""
    base = base or DetectorConfig()
    out = {"defaults": base}
    for knob, values in CANDIDATE_GRID:
        for v in values:
            cfg = replace(base, **{knob: v})
            if cfg != base:
                out[f"{knob}={v:g}" if not isinstance(v, bool) else f"{knob}={v}"] = cfg
    return out


CANDIDATE_GRID: tuple[tuple[str, tuple], ...] = (
    ("drift_h", (4.0, 6.0, 8.0, 10.0, 12.0)),
    ("lr_rise_factor", (0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0)),
    ("together_k", (0.25, 0.5, 0.75, 1.0)),
    ("update_warns", (True,)),
    ("drift_alone_h", (20.0, 40.0)),
    ("lr_jump_ratio", (3.0, 5.0, 10.0, 30.0, float("inf"))),
    ("loss_diverge_steps", (4, 8)),
    ("loss_min_scale", (0.05, 0.07, 0.1)),
)
"""One knob at a time away from the defaults: the candidate settings of every choice."""


def merit(sc: Score, real_ok: bool, reading: str = CHOICE_READING) -> tuple:
    """How a choice ranks settings (higher is better): the summed shortfalls against the targets,
    each in units of its own target (false alarms over 0.5 / 1k, healthy runs alarmed over 10%,
    recall of the leadable collapses under 90%, median lead under 3; a false critical or a
    failed llm.c / BLOOM check rules a setting out); then recall, fewer false alarms (in the
    reading the choice is made by, then counted strictly: every alarm of a run that did not
    collapse), then lead. Recall is taken over the collapses some signal precedes: instant ones
    (a bad batch's own step) count against every setting alike and would only push the choice
    toward alarms."""
    lead = sc.median_lead if sc.leads else 0.0
    rec = sc.leadable_recall
    fa, alarmed = sc.fa(reading), sc.alarmed(reading)
    viol = (max(0.0, fa - TARGETS["fa_per_1k"]) / TARGETS["fa_per_1k"]
            + max(0.0, alarmed - TARGETS["healthy_alarmed"]) / TARGETS["healthy_alarmed"]
            + (max(0.0, TARGETS["recall"] - rec) / (1.0 - TARGETS["recall"]) if rec == rec else 0.0)
            + (max(0.0, TARGETS["median_lead"] - lead) / TARGETS["median_lead"] if sc.events else 0.0)
            + 10.0 * (sc.false_criticals > 0) + 10.0 * (not real_ok))
    return (-viol, round(rec, 6) if rec == rec else 0.0, -round(fa, 6), -round(sc.fa("strict"), 6), lead)


@dataclass
class Evaluated:
    name: str
    cfg: DetectorConfig
    results: dict[str, Alarms]
    real_ok: bool
    real_lines: list[str]


def evaluate(runs: list[BenchRun], cands: dict[str, DetectorConfig], view: str,
             real_view: str = "logged") -> list[Evaluated]:
    out = []
    for name, cfg in cands.items():
        res = {r.name: earlywarn_alarms(r, cfg, view if r.source == "corpus" else real_view) for r in runs}
        ok, lines = real_checks(runs, res)
        out.append(Evaluated(name, cfg, res, ok, lines))
    return out


def tuning_families(runs: list[BenchRun]) -> list[str]:
    fams = []
    for r in runs:
        if r.source == "corpus" and r.family not in UNSEEN and r.family not in fams:
            fams.append(r.family)
    return fams


def lofo(runs: list[BenchRun], ev: list[Evaluated],
         reading: str = CHOICE_READING) -> tuple[dict[str, tuple[str, Score]], Score]:
    """For each tuning family: the setting chosen on the others (targets read in ``reading``),
    and its score on that family."""
    fams = tuning_families(runs)
    per = {e.name: {f: total(runs, e.results, lambda r, f=f: r.source == "corpus" and r.family == f)
                    for f in fams} for e in ev}
    folds: dict[str, tuple[str, Score]] = {}
    pooled = Score()
    for f in fams:
        best = None
        for e in ev:
            sc = Score()
            for g in fams:
                if g != f:
                    sc += per[e.name][g]
            m = merit(sc, e.real_ok, reading)
            if best is None or m > best[0]:
                best = (m, e.name)
        folds[f] = (best[1], per[best[1]][f])
        pooled += per[best[1]][f]
    return folds, pooled


def choose(runs: list[BenchRun], ev: list[Evaluated], reading: str = CHOICE_READING) -> Evaluated:
    """The procedure applied to every tuning family (what the defaults are checked against)."""
    fams = set(tuning_families(runs))
    best = None
    for e in ev:
        sc = total(runs, e.results, lambda r: r.source == "corpus" and r.family in fams)
        m = merit(sc, e.real_ok, reading)
        if best is None or m > best[0]:
            best = (m, e)
    return best[1]


LOSS_ONLY_GRID = (4.0, 6.0, 8.0, 10.0, 15.0, float("inf"))
NO_LR_GRID = (0.2, 0.3, 0.4, 0.5, 0.625, 0.75, 1.0)

FRONTIER: tuple[dict, ...] = (
    {"together_k": 0.0, "drift_h": 1.0, "spike_z": 3.0, "admit_z": 3.0, "escalate_steps": 2, "lr_rise_factor": 1.0},
    {"together_k": 0.0, "drift_h": 1.0, "lr_rise_factor": 1.0},
    {"together_k": 0.1, "drift_h": 1.5, "lr_rise_factor": 1.0},
    {"together_k": 0.15, "drift_h": 1.5, "lr_rise_factor": 1.0},
    {"together_k": 0.25, "drift_h": 1.5, "lr_rise_factor": 1.0},
    {"together_k": 0.25, "drift_h": 2.0, "lr_rise_factor": 1.0},
    {"together_k": 0.5, "drift_h": 3.0, "lr_rise_factor": 0.5},
    {"together_k": 0.5, "drift_h": 4.0, "lr_rise_factor": 0.5},
    {"together_k": 0.5, "drift_h": 8.0},
    {"drift_h": 4.0},
    {"drift_h": 6.0},
    {"lr_rise_factor": 0.15},
    {},
    {"lr_rise_factor": 0.3},
    {"drift_h": 12.0},
    {"together_k": 1.0},
    {"drift_h": 16.0, "lr_rise_factor": 0.15},
    {"lr_rise_factor": 0.5},
    {"lr_rise_factor": 1.0},
    {"drift_h": 16.0, "lr_rise_factor": 1.0},
    {"drift_h": float("inf")},
    {"drift_h": float("inf"), "lr_jump_ratio": float("inf")},
)
"""earlywarn's trade-off curve, most sensitive first (overrides of the defaults; {} is the defaults)."""


def _setting(kw: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in kw.items()) or "defaults"


def frontier_points(runs: list[BenchRun], base: DetectorConfig, view: str,
                    keep: Callable[[BenchRun], bool]) -> list[tuple[str, Score, bool]]:
    pts = []
    for kw in FRONTIER:
        cfg = replace(base, **kw)
        res = {r.name: earlywarn_alarms(r, cfg, view if r.source == "corpus" else "logged") for r in runs}
        ok, _ = real_checks(runs, res)
        pts.append((_setting(kw), total(runs, res, keep), ok))
    return pts


# ----------------------------------------------------------------------------------------------
# printing


def _lead(s: Score) -> str:
    return f"{s.median_lead:.1f}" if s.leads else "-"


HEAD = (f"{'':28s} {'recall@lead>=1':>14s} {'leadable':>8s} {'lead':>5s} {'FA/1k hz':>8s} {'strict':>6s} "
        f"{'crit/1k':>7s} {'alarmed hz':>14s} {'strict':>14s} {'events':>7s} {'steps':>6s}")
"""Columns: recall at lead >= 1 over all scored collapses, and over the leadable ones (instant
collapses left out); median lead; false alarms / 1k healthy steps in the hazard reading and
strictly; false criticals / 1k healthy steps; healthy runs alarmed, hazard reading and strictly;
collapses detected / scored; healthy steps (strict)."""


def row(name: str, s: Score) -> str:
    def share(n: int) -> str:
        return f"{n}/{s.healthy_runs} ({n / s.healthy_runs if s.healthy_runs else 0:.0%})"

    lr = s.leadable_recall
    return (f"{name:28s} {s.recall:>14.1%} {(f'{lr:.1%}' if lr == lr else '-'):>8s} {_lead(s):>5s} "
            f"{s.fa('hazard'):>8.2f} {s.fa('strict'):>6.2f} {s.crit_rate:>7.2f} {share(s.hz_alarmed):>14s} "
            f"{share(s.healthy_alarmed):>14s} {f'{s.detected}/{s.events}':>7s} {s.healthy_steps:>6d}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="per-event leads and false-alarm runs")
    ap.add_argument("--no-lofo", action="store_true", help="skip leave-one-family-out (the slow part)")
    ap.add_argument("--no-signals", action="store_true", help="skip the per-signal lead table")
    ap.add_argument("--view", default="logged", choices=sorted(VIEWS), help="what the corpus runs feed earlywarn")
    ap.add_argument("--config", default=None, help="a DetectorConfig JSON file for earlywarn")
    a = ap.parse_args(argv)
    base = DetectorConfig.from_file(a.config) if a.config else DetectorConfig()
    t0 = time.perf_counter()
    runs = corpus_runs() + real_runs()
    t1 = time.perf_counter()
    corpus = [r for r in runs if r.source == "corpus"]
    fams = tuning_families(runs)
    in_tuning = lambda r: r.source == "corpus" and r.family not in UNSEEN  # noqa: E731
    unseen = lambda r: r.source == "corpus" and r.family in UNSEEN  # noqa: E731
    n_ev = sum(r.collapse is not None for r in corpus)
    n_sc = sum(r.scored and r.duplicate_of is None for r in corpus)
    print(f"corpus: {len(corpus)} runs in {len(fams)} tuning families + {len(UNSEEN)} unseen "
          f"({', '.join(UNSEEN)}); collapses {n_ev}, scored {n_sc}; healthy runs "
          f"{sum(r.healthy and counted(r) for r in corpus)}; real logs {len(runs) - len(corpus)}; "
          f"horizon {HORIZON} steps, false alarms per 1,000 healthy steps")

    if not a.no_signals:
        print("\nper-signal lead, each signal alone (trailing 50-step median / MAD z of its log; threshold: the "
              "lowest on a ladder with <= 0.5 FA/1k, strict reading, on the tuning families):")
        print("\n".join(signal_leads(runs)))

    # earlywarn defaults and the baselines, in sample (tuning families) and on the unseen family
    ew = {r.name: earlywarn_alarms(r, base, a.view if r.source == "corpus" else "logged") for r in runs}
    peers = {name: {r.name: peer_alarms(r, mk) for r in runs} for name, mk in PEER_FACTORIES.items()}
    print(f"\ndetectors at their defaults (earlywarn fed the '{a.view}' view):")
    for title, keep in (("tuning families (in sample)", in_tuning), ("unseen family (gru)", unseen)):
        print(f"-- {title}\n{HEAD}")
        print(row("earlywarn", total(runs, ew, keep)))
        for name, res in peers.items():
            print(row(name, total(runs, res, keep)))
    ok, lines = real_checks(runs, ew)
    print("\n".join(lines))
    inst = [r for r in corpus if in_tuning(r) and instant(r) and counted(r)]
    at_bad = sum(r.collapse in ew[r.name].alarm for r in inst)
    print(f"instant collapses: {len(inst)} of the scored tuning collapses start at a bad batch's own step (its "
          "loss is the first sign: no detector can lead them; 'leadable' leaves them out); earlywarn warns at "
          f"that step itself on {at_bad}/{len(inst)} (the guard reads the step's gradient before its update)")
    sc = total(runs, ew, in_tuning)
    print(f"survived hazards: {sc.hazard_warned}/{sc.hazard_runs} runs that survived a hazard handed to them "
          "were warned inside its window (not false alarms in the hazard reading; false in the strict one)")
    lo = {r.name: earlywarn_alarms(r, base, "loss") for r in runs if r.source == "real"}
    _, lines = real_checks([r for r in runs if r.source == "real"], lo)
    print("loss-only view of the real logs (the grad norm dropped): " + "; ".join(lines))

    print("\nearlywarn by input view (defaults; tuning families | unseen family):")
    for view in ("logged", "guard", "grad+loss", "loss+lr", "loss"):
        res = ew if view == a.view else {r.name: earlywarn_alarms(r, base, view if r.source == "corpus" else "logged")
                                         for r in runs}
        print(row(f"{view}: tuning", total(runs, res, in_tuning)))
        print(row(f"{view}: unseen", total(runs, res, unseen)))

    if not a.no_lofo:
        cands = candidates(base)
        ev = evaluate(runs, cands, a.view)
        folds, pooled = lofo(runs, ev, CHOICE_READING)
        print(f"\nthe candidate settings, in sample (tuning families):\n{HEAD}")
        for e in ev:
            print(row(e.name[:28], total(runs, e.results, in_tuning)) + ("" if e.real_ok else "  (llm.c/BLOOM FAIL)"))
        print(f"\nleave-one-family-out ({len(cands)} candidate settings; each family scored with the setting "
              f"chosen on all the others, targets read in the {CHOICE_READING} reading):")
        print(f"{'family (setting chosen)':28s}" + HEAD[28:])
        for f, (pick, sc) in folds.items():
            print(row(f"{f} ({pick})"[:28], sc))
        print(row("pooled (held-out families)", pooled))
        other = "strict" if CHOICE_READING == "hazard" else "hazard"
        ofolds, opooled = lofo(runs, ev, other)
        print(row(f"pooled, chosen {other}", opooled) + "   (the same procedure, targets read "
              f"{other}ly; picks: " + ", ".join(f"{f}: {p}" for f, (p, _) in ofolds.items()) + ")")
        chosen = choose(runs, ev)
        d = next(e for e in ev if e.name == "defaults")
        print(row("in sample, defaults", total(runs, d.results, in_tuning)))
        print(f"the procedure on all tuning families picks: {chosen.name} "
              f"({'= the defaults' if chosen.name == 'defaults' else 'NOT the defaults'}); "
              f"folds that picked the defaults: {sum(p == 'defaults' for p, _ in folds.values())}/{len(folds)}")
        print(row("unseen family, chosen", total(runs, chosen.results, unseen)))
        print("targets (held-out, pooled): recall >= 90% at lead >= 1, median lead >= 3, FA/1k <= 0.5, healthy runs "
              "alarmed <= 10%, false criticals 0:")
        for rd in READINGS:
            for lead_only in (True, False):
                print(f"  {rd} reading, recall over {'leadable' if lead_only else 'all'} collapses: "
                      f"{'MET' if pooled.meets(rd, lead_only) else 'NOT MET'}")
        # loss-only logs (item 4): the loss-alone threshold, chosen the same way in the loss view
        lc = {"defaults": base}
        for v in LOSS_ONLY_GRID:
            if v != base.loss_only_h:
                lc[f"loss_only_h={v:g}"] = replace(base, loss_only_h=v)
        lev = evaluate(runs, lc, "loss", real_view="loss")
        lfolds, lpooled = lofo(runs, lev)
        lch = choose(runs, lev)
        print(f"\nloss-only logs, leave-one-family-out over loss_only_h {LOSS_ONLY_GRID} (llm.c in the loss view "
              "must stay quiet):")
        print(row("pooled (held-out families)", lpooled))
        print(row("in sample, defaults", total(runs, next(e for e in lev if e.name == "defaults").results, in_tuning)))
        print(f"the procedure picks: {lch.name}; per fold: "
              + ", ".join(f"{f}: {p}" for f, (p, _) in lfolds.items()))
        # logs without an LR (the grad+loss view): the together threshold there, chosen the same way
        nc = {"defaults": base}
        for v in NO_LR_GRID:
            if v != base.no_lr_factor:
                nc[f"no_lr_factor={v:g}"] = replace(base, no_lr_factor=v)
        nev = evaluate(runs, nc, "grad+loss", real_view="grad+loss")
        nfolds, npooled = lofo(runs, nev)
        nch = choose(runs, nev)
        print(f"\nlogs without an LR (grad+loss view), leave-one-family-out over no_lr_factor {NO_LR_GRID} (llm.c "
              "without its LR column must stay quiet):")
        print(row("pooled (held-out families)", npooled))
        print(row("in sample, defaults", total(runs, next(e for e in nev if e.name == "defaults").results, in_tuning)))
        print(row("unseen family, defaults", total(runs, next(e for e in nev if e.name == "defaults").results, unseen)))
        print(f"the procedure picks: {nch.name}; per fold: "
              + ", ".join(f"{f}: {p}" for f, (p, _) in nfolds.items()))

    # frontier and Pareto check
    print("\nearlywarn's trade-off (all corpus runs; settings as overrides of the defaults):")
    allc = lambda r: r.source == "corpus"  # noqa: E731
    pts = frontier_points(runs, base, a.view, allc)
    print(f"{'setting':28s}" + HEAD[28:] + "  llm.c/BLOOM")
    for name, sc, ok in pts:
        print(row(name[:28], sc) + f"  {'OK' if ok else 'FAILS'}")
    for rd in READINGS:
        print(f"\nPareto check, {rd} reading: earlywarn's best frontier point at each baseline's own false-alarm "
              "rate (all corpus runs):")
        print(f"{'baseline':20s} {'its recall':>10s} {'its lead':>9s} {'its FA/1k':>10s} | {'earlywarn point':>26s} "
              f"{'recall':>7s} {'lead':>5s} {'FA/1k':>6s}  verdict")
        for name, res in peers.items():
            ps = total(runs, res, allc)
            if ps.detected == 0:
                print(f"{name:20s} {ps.recall:>10.1%} {'-':>9s} {ps.fa(rd):>10.2f} | detects nothing: not a false-alarm "
                      "bound")
                continue
            ok_pts = [(n, s) for n, s, good in pts if s.fa(rd) <= ps.fa(rd) + 1e-12 and good]
            if not ok_pts:
                print(f"{name:20s} {ps.recall:>10.1%} {_lead(ps):>9s} {ps.fa(rd):>10.2f} | no earlywarn point at or "
                      "below this rate: NOT DOMINATED")
                continue

            def dominates(s: Score) -> bool:
                return s.recall >= ps.recall and (s.median_lead if s.leads else 0) >= (ps.median_lead if ps.leads else 0)

            dom_pts = [t for t in ok_pts if dominates(t[1])]
            n, s = max(dom_pts or ok_pts, key=lambda t: (t[1].recall, t[1].median_lead if t[1].leads else 0))
            print(f"{name:20s} {ps.recall:>10.1%} {_lead(ps):>9s} {ps.fa(rd):>10.2f} | {n[:26]:>26s} {s.recall:>7.1%} "
                  f"{_lead(s):>5s} {s.fa(rd):>6.2f}  {'dominates' if dominates(s) else 'DOES NOT DOMINATE'}")

    if a.verbose:
        print("\nper event (lead in steps; - = missed):")
        names = ["earlywarn"] + list(peers)
        allres = {"earlywarn": ew, **peers}
        print(f"{'run':62s} {'collapse':>8s} " + " ".join(f"{n[:9]:>9s}" for n in names))
        for r in corpus:
            if r.scored and r.duplicate_of is None:
                cells = [score_run(r, allres[n][r.name]).per_event.get(r.name) for n in names]
                print(f"{r.name[:62]:62s} {int(r.steps[r.collapse]):>8d} "
                      + " ".join(f"{'-' if c is None else c:>9}" for c in cells))
        sc = total(runs, ew, allc)
        print(f"earlywarn false alarms (strict): {sc.fa_runs}")
        print(f"earlywarn false alarms (hazard reading): {sc.hz_fa_runs}")
        crit = {r.name: ew[r.name].critical for r in corpus if score_run(r, ew[r.name]).false_criticals}
        print(f"earlywarn false criticals (rows): {crit}")
    print(f"(data {t1 - t0:.1f}s, total {time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
