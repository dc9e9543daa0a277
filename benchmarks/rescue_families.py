"""The rescue benchmark's generator: families of small CPU training runs, healthy and faulted.

A family is ``configs(seed_base, n) -> list[dict]``: plain JSON-able configs, each with an
``id``, the same list for the same arguments. A config says everything a run is:

    {"id", "family", "seed", "steps", "task": {...}, "opt": {...}, "sched": {...},
     "accum": int, "events": {...}, "fault": None | {...}}

Healthy families each contain events that a naive rule mistakes for trouble (a noisy plateau,
an LR that jumps back up, a loss that moves to a new level and trains down, a loss below zero,
a gradient that grows when a backbone is unfrozen, an outlier batch that heals, a discriminator
that spikes, heavy-tailed noise, a batch size that changes, an LR that jumps to a level the run
never had, a loss whose scale changes 1/32-64x, a gradient that shrinks by orders of magnitude
as a small training set is memorized, a rarely sampled auxiliary task whose steps are outliers,
batches masked out whole, a small GPT with no or a short warm-up whose gradient may spike on its
own, a policy gradient whose rare large rewards are its signal). A fault family draws a base
config from a healthy family where the fault makes sense, and a fault at a random step (20%-70%
of the run; a bad shard: from a step at 20%-50% on, 2-12% of the batches corrupt, each alone
among good ones; a climbing LR: from a step at 30%-60% of a 400-600-step run on, the loop's LR
multiplied by 1.01-1.03 once more every step). ``hopeless`` runs at an LR 30-300x too high from
step 0. Nothing here is tuned to any method: ranges are what such runs use.
"""

from __future__ import annotations

import copy
import hashlib
import math
import random
from dataclasses import dataclass
from typing import Callable


def loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def pick(rng: random.Random, weighted: dict):
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


def seed_of(*keys) -> int:
    return int.from_bytes(hashlib.blake2b(repr(keys).encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


# ---------------------------------------------------------------- optimizers and schedules
def healthy_lr_range(task: str, opt: str) -> tuple[float, float]:
    """The LR range a healthy config of ``task`` with optimizer ``opt`` draws from."""
    if task == "gan":
        return (2e-4, 1e-3)
    if task == "chargpt":
        return (1e-3, 3e-3)
    if task == "lstm":
        return (1e-3, 5e-3) if opt != "rmsprop" else (5e-4, 2e-3)
    if task == "cnn" and opt == "sgd":
        return (0.02, 0.1)
    return {"adam": (3e-4, 3e-3), "adamw": (3e-4, 3e-3), "sgd": (0.01, 0.05), "rmsprop": (1e-4, 1e-3),
            "adagrad": (0.01, 0.05)}[opt]


def opt_for(rng: random.Random, task: str) -> dict:
    """An optimizer in its healthy range for ``task`` (Adam/AdamW mostly)."""
    if task == "gan":
        return {"name": "adam", "lr": loguniform(rng, *healthy_lr_range(task, "adam")), "betas": [0.5, 0.999], "wd": 0.0}
    if task in ("chargpt", "bandit"):
        name = pick(rng, {"adamw": 0.7, "adam": 0.3})
        return {"name": name, "lr": loguniform(rng, *healthy_lr_range(task, name)), "betas": [0.9, rng.choice([0.95, 0.99])],
                "wd": rng.choice([0.01, 0.1]) if name == "adamw" else 0.0}
    choices = {"adam": 0.4, "adamw": 0.35, "sgd": 0.12, "rmsprop": 0.08, "adagrad": 0.05}
    if task == "lstm":
        choices = {"adam": 0.6, "adamw": 0.2, "rmsprop": 0.2}
    name = pick(rng, choices)
    lr = healthy_lr_range(task, name)
    spec = {"name": name, "lr": loguniform(rng, *lr), "wd": 0.0}
    if name in ("adam", "adamw"):
        spec["betas"] = [0.9, rng.choice([0.99, 0.999])]
    if name == "adamw":
        spec["wd"] = rng.choice([0.01, 0.05, 0.1])
    if name == "sgd":
        spec["momentum"] = 0.9
    return spec


def const() -> dict:
    return {"kind": "const"}


def cosine(rng: random.Random, warm_lo: float = 0.0, warm_hi: float = 0.1) -> dict:
    return {"kind": "cosine", "warmup": rng.uniform(warm_lo, warm_hi), "floor": rng.choice([0.0, 0.1])}


LOOP_SCHEDULES = ("const", "cosine", "two_phase", "cyclic", "rewarm")
"""Schedules the loop computes from its own step counter and writes into the param groups
(an LR fault can ride on these); the others are torch schedulers passed to ``watch()``."""


# ---------------------------------------------------------------- base tasks
def base(rng: random.Random, task: str, steps: tuple[int, int] = (200, 450)) -> dict:
    """A healthy config of ``task`` (no family-specific event yet)."""
    if task in ("regression", "gauss_nll"):
        spec = {"name": task, "d_in": rng.choice([8, 16, 24]), "width": rng.choice([32, 64, 96]),
                "depth": rng.choice([2, 3]), "act": rng.choice(["relu", "gelu", "tanh", "silu"]),
                "batch": rng.choice([16, 32, 64]),
                "noise": rng.uniform(0.1, 0.5) if task == "regression" else rng.uniform(0.05, 0.3)}
    elif task == "classify":
        spec = {"name": task, "d_in": rng.choice([8, 16, 32]), "classes": rng.choice([4, 6, 8, 10]),
                "spread": rng.uniform(1.5, 3.0), "label_noise": rng.uniform(0.05, 0.3),
                "width": rng.choice([32, 64, 128]), "depth": rng.choice([1, 2]),
                "act": rng.choice(["relu", "gelu"]), "batch": rng.choice([8, 16, 32])}
    elif task == "chargpt":
        spec = {"name": task, "layers": rng.choice([1, 2]), "heads": 2, "embd": 32, "block": 24,
                "batch": rng.choice([8, 12])}
        steps = (150, 220)
    elif task == "cnn":
        spec = {"name": task, "classes": rng.choice([4, 6, 8]), "channels": rng.choice([6, 8, 12]),
                "noise": rng.uniform(0.8, 2.0), "label_noise": rng.uniform(0.0, 0.15),
                "batch": rng.choice([16, 32])}
        steps = (150, 350)
    elif task == "lstm":
        spec = {"name": task, "hidden": rng.choice([24, 32, 48]), "seq": rng.choice([12, 16, 20]),
                "lag": rng.randint(1, 4), "lag2": rng.randint(2, 6), "clip": rng.choice([0.5, 1.0, 2.0, 5.0]),
                "batch": rng.choice([16, 32])}
        steps = (150, 350)
    elif task == "bandit":
        spec = {"name": task, "d_in": rng.choice([8, 16]), "actions": rng.choice([3, 4, 6]),
                "width": rng.choice([32, 64]), "depth": rng.choice([1, 2]), "act": rng.choice(["relu", "tanh"]),
                "batch": rng.choice([16, 32]), "p": loguniform(rng, 0.005, 0.05), "reward": loguniform(rng, 10, 1000),
                "others": rng.uniform(0.0, 0.2), "baseline": rng.choice(["none", "mean"]),
                "entropy": rng.choice([0.0, 0.01])}
        steps = (300, 600)
    elif task == "gan":
        spec = {"name": task, "z": rng.choice([2, 4, 8]), "width": rng.choice([32, 64]),
                "bend": rng.uniform(0.2, 0.6), "std": rng.uniform(0.1, 0.3), "batch": rng.choice([64, 128])}
        steps = (300, 600)
    else:
        raise ValueError(f"unknown task {task!r}")
    n = rng.randint(*steps)
    return {"seed": 0, "steps": n, "task": spec, "opt": opt_for(rng, task), "accum": 1,
            "sched": rng.choice([const(), cosine(rng)]), "events": {}, "fault": None}


def frac_step(rng: random.Random, n: int, lo: float, hi: float) -> int:
    return int(round(rng.uniform(lo, hi) * n))


# ---------------------------------------------------------------- healthy families
def regression_floor(rng):
    cfg = base(rng, "regression", (250, 600))
    cfg["sched"] = rng.choice([const(), const(), cosine(rng)])
    return cfg


def classify_noisy(rng):
    cfg = base(rng, "classify", (200, 500))
    cfg["task"]["batch"] = rng.choice([8, 12, 16])
    cfg["task"]["label_noise"] = rng.uniform(0.1, 0.35)
    return cfg


def chargpt(rng):
    cfg = base(rng, "chargpt")
    cfg["sched"] = cosine(rng, 0.03, 0.15)
    return cfg


def warm_restarts(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "chargpt"]))
    n = cfg["steps"]
    cfg["sched"] = {"kind": "warm_restarts", "T_0": n // rng.randint(3, 6), "T_mult": rng.choice([1, 2]),
                    "eta_min_frac": rng.choice([0.0, 0.01, 0.05])}
    return cfg


def domain_switch(rng):
    task = pick(rng, {"regression": 0.45, "classify": 0.35, "chargpt": 0.2})
    cfg = base(rng, task, (250, 500))
    at = frac_step(rng, cfg["steps"], 0.3, 0.85)
    if task == "regression":
        kind = pick(rng, {"targets": 0.4, "harder": 0.3, "inputs": 0.3})
        size = loguniform(rng, 0.3, 3.0) if kind != "inputs" else loguniform(rng, 0.5, 3.0)
    elif task == "classify":
        kind = rng.choice(["relabel", "inputs"])
        size = rng.uniform(0.3, 1.0) if kind == "relabel" else loguniform(rng, 1.0, 4.0)
    else:
        kind, size = rng.choice(["upper", "reversed"]), 1.0
    cfg["task"]["stages"] = [at]
    cfg["task"]["stage_kinds"] = [{"kind": kind, "size": size}]
    return cfg


def curriculum(rng):
    task = rng.choice(["classify", "chargpt"])
    cfg = base(rng, task, (250, 500))
    n = cfg["steps"]
    two = rng.random() < 0.5
    cuts = sorted(frac_step(rng, n, 0.2, 0.6) for _ in range(2 if two else 1))
    if task == "classify":
        cfg["task"]["classes"] = 8
        factors = [4, 2] if two else [rng.choice([2, 4])]
        cfg["task"]["stage_kinds"] = [{"kind": "coarse", "factor": f} for f in factors]
    else:
        lens = [8, 16] if two else [rng.choice([8, 12])]
        cfg["task"]["stage_kinds"] = [{"kind": "seqlen", "block": b} for b in lens]
    cfg["task"]["stages"] = cuts
    return cfg


def finetune(rng):
    task = rng.choice(["regression", "classify"])
    cfg = base(rng, task, (200, 450))
    kind = {"regression": rng.choice(["targets", "inputs"]), "classify": "relabel"}[task]
    size = rng.uniform(0.5, 1.5) if task == "regression" else rng.uniform(0.3, 0.7)
    cfg["task"]["stages"] = [0]  # the fine-tuning task is stage 1 from the first step; stage 0 pretrains
    cfg["task"]["stage_kinds"] = [{"kind": kind, "size": size}]
    cfg["task"]["finetune"] = {"pretrain": rng.randint(100, 200), "unfreeze": frac_step(rng, cfg["steps"], 0.3, 0.7)}
    cfg["task"]["depth"] = max(cfg["task"]["depth"], 2)
    return cfg


def gauss_nll(rng):
    return base(rng, "gauss_nll", (250, 500))


def cnn_bn(rng):
    return base(rng, "cnn")


def lstm_clip(rng):
    return base(rng, "lstm")


def onecycle(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "cnn"]))
    cfg["sched"] = {"kind": "onecycle", "max_lr_factor": rng.uniform(2.0, 5.0), "pct_start": rng.uniform(0.2, 0.4)}
    return cfg


def grad_accum(rng):
    task = rng.choice(["regression", "classify", "chargpt"])
    cfg = base(rng, task)
    cfg["accum"] = rng.choice([2, 4, 8])
    cfg["task"]["batch"] = rng.choice([4, 8]) if task != "chargpt" else 4
    if task == "chargpt":
        cfg["steps"], cfg["accum"] = 150, 2
    return cfg


def transient_heal(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "chargpt"]))
    cfg["events"]["outlier"] = {"at": frac_step(rng, cfg["steps"], 0.3, 0.8), "factor": rng.uniform(5, 20)}
    return cfg


def gan(rng):
    cfg = base(rng, "gan")
    cfg["sched"] = const()
    return cfg


def lr_warmup(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "cnn", "chargpt"]))
    cfg["opt"]["lr"] *= rng.uniform(1.0, 2.0)
    cfg["sched"] = {"kind": "cosine", "warmup": rng.uniform(0.05, 0.25), "floor": rng.choice([0.1, 1.0])}
    return cfg


def smallbatch(rng):
    cfg = base(rng, rng.choice(["regression", "classify"]), (400, 600))
    cfg["task"]["batch"] = rng.choice([4, 6, 8])
    cfg["sched"] = const()
    return cfg


# Four more, added once the rules above were settled (none was tuned on them): heavy-tailed noise
# or sample weights, a batch size that changes, a low-LR phase and then the real LR, and a loss
# whose scale changes (the reduction, a loss weight): its gradient scales with it.
def heavy_tail(rng):
    if rng.random() < 0.5:
        cfg = base(rng, "regression", (250, 500))
        cfg["task"]["noise_df"] = rng.choice([1.5, 2.0, 3.0])
    else:
        cfg = base(rng, rng.choice(["classify", "regression"]), (250, 500))
        cfg["events"]["weights"] = {"sigma": rng.uniform(0.8, 1.6)}
    return cfg


def batch_change(rng):
    task = rng.choice(["regression", "classify", "chargpt"])
    cfg = base(rng, task, (250, 500))
    b = cfg["task"]["batch"]
    cfg["task"]["batch_at"] = [frac_step(rng, cfg["steps"], 0.3, 0.7), max(4, b // 4) if rng.random() < 0.5 else b * 4]
    return cfg


def lr_jump(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "cnn", "chargpt"]))
    cfg["sched"] = {"kind": "two_phase", "low": rng.uniform(0.03, 0.2), "at": frac_step(rng, cfg["steps"], 0.15, 0.5)}
    return cfg


def loss_scale(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "chargpt"]))
    # Adam/AdamW: their update does not depend on the loss's scale, so the run stays healthy
    if cfg["opt"]["name"] not in ("adam", "adamw"):
        cfg["opt"] = opt_for(rng, "chargpt")
    cfg["events"]["loss_scale"] = {"at": frac_step(rng, cfg["steps"], 0.3, 0.7),
                                   "factor": rng.choice([1 / 32, 1 / 8, 8.0, 32.0, 64.0])}
    return cfg


# Three more, added after those (none was tuned on them): a run that memorizes a small fixed
# training set (its gradient shrinks by orders of magnitude, so a hard sample is a large relative
# spike), a rarely sampled auxiliary task (the loss jumps on its steps and its head, idle
# otherwise, gets a gradient), and batches whose samples are all masked out (a zero loss, zero
# gradients), as a padded or filtered data stream produces.
def memorize(rng):
    task = rng.choice(["regression", "classify"])
    cfg = base(rng, task, (300, 600))
    cfg["task"]["pool"] = rng.choice([32, 64, 128, 256])
    cfg["task"]["width"] = rng.choice([64, 128])
    if task == "regression":
        cfg["task"]["noise"] = rng.uniform(0.0, 0.2)
    else:
        cfg["task"]["label_noise"] = rng.uniform(0.0, 0.2)
    return cfg


def rare_task(rng):
    cfg = base(rng, "regression", (250, 500))
    cfg["task"]["name"] = "multitask"
    if cfg["opt"]["name"] in ("sgd", "adagrad"):  # a plain SGD step on the rare task's loss jump diverges
        cfg["opt"] = opt_for(rng, "chargpt")
    cfg["task"]["aux"] = {"p": loguniform(rng, 0.02, 0.15), "weight": loguniform(rng, 0.3, 3.0),
                          "scale": loguniform(rng, 0.5, 3.0)}
    return cfg


def empty_batches(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "chargpt", "cnn"]))
    cfg["events"]["empty"] = {"p": loguniform(rng, 0.01, 0.1)}
    return cfg


# One more, added after those (no rule was tuned on it): a loss weight ramped up or down over part
# of the run, as KL annealing or a consistency loss's ramp-up does -- the loss and the gradient move
# together, steadily, by 4-100x; Adam/AdamW, whose update does not mind the scale.
def loss_ramp(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "chargpt", "cnn"]))
    if cfg["opt"]["name"] not in ("adam", "adamw"):
        cfg["opt"] = opt_for(rng, "chargpt")
    n = cfg["steps"]
    factor = loguniform(rng, 4.0, 100.0)
    cfg["events"]["loss_ramp"] = {"at": frac_step(rng, n, 0.1, 0.5), "length": max(2, int(rng.uniform(0.05, 0.4) * n)),
                                  "factor": factor if rng.random() < 0.75 else 1.0 / factor,
                                  "shape": rng.choice(["linear", "geometric", "sigmoid"])}
    return cfg


# And one more (no rule tuned on it either): a small training set memorized -- the gradient down by
# orders of magnitude -- then a new one from a step on (a second fine-tuning task, a new data stage
# in the same loop): the gradient jumps back up 10-1000x its converged norm, and stays.
def pool_switch(rng):
    task = rng.choice(["regression", "classify"])
    cfg = base(rng, task, (300, 600))
    cfg["task"]["pool"] = rng.choice([32, 64, 128])
    cfg["task"]["width"] = rng.choice([64, 128])
    cfg["task"]["stages"] = [frac_step(rng, cfg["steps"], 0.4, 0.7)]
    if task == "regression":
        kind = rng.choice(["targets", "inputs"])
        cfg["task"]["stage_kinds"] = [{"kind": kind, "size": loguniform(rng, 0.5, 2.0)}]
    else:
        cfg["task"]["stage_kinds"] = [{"kind": "relabel", "size": rng.uniform(0.3, 1.0)}]
    return cfg


# And one more (written and measured before the rule it checks was kept): a phase of the run whose
# gradients are outliers for 45-95 steps and that ends as abruptly as it began -- a loss weight
# raised 20-100x for the phase (an auxiliary objective's phase; Adam/AdamW, whose update does not
# mind the scale), or a new memorized training set for the phase and then the first one again
# (a task phase in the middle of a run; the eval is the first set's).
def phase(rng):
    if rng.random() < 0.5:
        cfg = base(rng, rng.choice(["regression", "classify", "chargpt"]))
        if cfg["opt"]["name"] not in ("adam", "adamw"):
            cfg["opt"] = opt_for(rng, "chargpt")
        cfg["events"]["loss_phase"] = {"at": frac_step(rng, cfg["steps"], 0.2, 0.5), "length": rng.randint(45, 95),
                                       "factor": loguniform(rng, 20.0, 100.0)}
        return cfg
    cfg = pool_switch(rng)
    at = frac_step(rng, cfg["steps"], 0.25, 0.5)
    cfg["task"]["stages"] = [at]
    cfg["task"]["phase_end"] = at + rng.randint(45, 95)
    return cfg


# Three more for issue 48 (written and measured before any rule was changed for them): trouble the
# run makes itself. A small char GPT at its usual rate with a short or no warm-up and no clipping,
# whose gradient may spike on its own in warm-up (measured on seed base 0: 3 of its first 14 bare
# runs past 20x the median of the 20 steps before, at steps 8-35; rescue.py's spike table); a
# policy-gradient objective whose rewards are rare and large, so the rare batches with a reward
# carry huge gradients that are its whole signal. (The third is the fault ``lr_climb``, below.)
def self_spike(rng):
    cfg = base(rng, "chargpt")
    cfg["task"].update(layers=rng.choice([3, 4]), heads=4, embd=rng.choice([64, 96]), block=32,
                       batch=rng.choice([8, 12, 16]))
    # a small GPT's best rate is higher than a large one's (Wortsman et al. 2023, Fig. 1: ~1e-2 at this width)
    cfg["opt"]["lr"] = loguniform(rng, 2e-3, 1.2e-2)
    cfg["sched"] = const() if rng.random() < 0.5 else cosine(rng, 0.0, 0.03)
    return cfg


def heavy_reward(rng):
    return base(rng, "bandit")


# Two more for issue 48 (written before the rule they check was measured on them): learning rates
# that rise step after step, long after the run's first steps, on purpose -- the healthy side of a
# schedule bug's climb. A cyclic schedule (triangular, Smith 2017) that starts after a flat stretch
# at its low rate, and a re-warm-up (a second stage, continued training: the run at a low rate,
# then a linear warm-up 3-10x back up to a rate in the healthy range, then cosine down), both
# peaking inside the task's healthy range.
def lr_cycle(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "cnn", "chargpt"]), (300, 600))
    lo, hi = healthy_lr_range(cfg["task"]["name"], cfg["opt"]["name"])
    cfg["opt"]["lr"] = loguniform(rng, (lo * hi) ** 0.5, hi)
    cfg["sched"] = {"kind": "cyclic", "ratio": rng.uniform(3.0, 8.0), "at": rng.randint(50, 150),
                    "half": rng.randint(30, 120)}
    return cfg


def rewarm(rng):
    cfg = base(rng, rng.choice(["regression", "classify", "cnn", "chargpt"]), (300, 600))
    lo, hi = healthy_lr_range(cfg["task"]["name"], cfg["opt"]["name"])
    cfg["opt"]["lr"] = loguniform(rng, (lo * hi) ** 0.5, hi)
    cfg["sched"] = {"kind": "rewarm", "ratio": rng.uniform(3.0, 10.0),
                    "at": frac_step(rng, cfg["steps"], 0.3, 0.6), "warmup": rng.randint(30, 150)}
    return cfg


# ---------------------------------------------------------------- faults
FAULT_BASES = ("regression_floor", "classify_noisy", "chargpt", "cnn_bn", "lstm_clip", "gauss_nll",
               "grad_accum", "warm_restarts", "onecycle", "finetune", "domain_switch", "curriculum",
               "smallbatch", "lr_warmup")
"""Healthy families a fault is injected into (not the GAN, whose eval is not a loss, and not
transient_heal, which already has an outlier of its own)."""


def _loop_lr(name: str) -> bool:
    return name not in ("warm_restarts", "onecycle")


def _nonfinite_grad(rng, cfg):
    n = cfg["steps"]
    k = 1 if rng.random() < 0.6 else rng.randint(2, 3)
    return {"steps": sorted({frac_step(rng, n, 0.2, 0.7) for _ in range(k)}),
            "value": rng.choice(["nan", "inf", "-inf"]), "coords": rng.choice([1, 4, 32, "all"])}


def _bad_batch(rng, cfg):
    kinds = ["nan_weight", "inf_weight"] + (["nan_input"] if cfg["task"]["name"] != "chargpt" else [])
    return {"at": frac_step(rng, cfg["steps"], 0.2, 0.7), "how": rng.choice(kinds), "samples": rng.choice([1, 2, "all"])}


def _poisoned_state(rng, cfg):
    return {"at": frac_step(rng, cfg["steps"], 0.2, 0.7), "slot": rng.choice(["second", "first"]),
            "coords": rng.choice([1, 8, "all"])}


def _huge_grad(rng, cfg):
    return {"at": frac_step(rng, cfg["steps"], 0.2, 0.7), "factor": loguniform(rng, 1e4, 1e6)}


def _burst(rng, cfg):
    how = "shuffle" if cfg["task"]["name"] == "chargpt" else rng.choice(["scale", "shuffle", "both"])
    return {"at": frac_step(rng, cfg["steps"], 0.2, 0.7), "length": rng.randint(10, 40), "how": how,
            "scale": loguniform(rng, 20, 200)}


def _bad_shard(rng, cfg):
    """From a step on, a fraction ``p`` of the batches are corrupt (a bad shard mixed into the
    stream): each alone among good ones, corrupt the way a burst's are."""
    how = "shuffle" if cfg["task"]["name"] == "chargpt" else rng.choice(["scale", "shuffle", "both"])
    return {"at": frac_step(rng, cfg["steps"], 0.2, 0.5), "p": loguniform(rng, 0.02, 0.12), "how": how,
            "scale": loguniform(rng, 20, 200)}


def _lr_pulse(rng, cfg):
    return {"at": frac_step(rng, cfg["steps"], 0.2, 0.7), "length": rng.randint(10, 30),
            "factor": loguniform(rng, 30, 100)}


def _lr_climb(rng, cfg):
    """A schedule bug (``lr *= factor`` left in the loop, an ExponentialLR's gamma above 1): from a
    step in the middle of the run on, the loop's own schedule is multiplied by ``factor`` once more
    every step (like an LR pulse). The run is made 400-600 steps long where it was shorter (it
    sets ``cfg["steps"]``; the twin keeps it): over the 60-100 steps a short run has left, a climb
    of 1.01x reaches 2-3x, which no run here dies of."""
    cfg["steps"] = max(cfg["steps"], rng.randint(400, 600))
    return {"at": frac_step(rng, cfg["steps"], 0.3, 0.6), "factor": rng.uniform(1.01, 1.03)}


def _hopeless(rng, cfg):
    """An LR 30-300x the top of the healthy range, from step 0 (the twin keeps its own LR)."""
    factor = loguniform(rng, 30, 300)
    return {"factor": factor, "lr": healthy_lr_range(cfg["task"]["name"], cfg["opt"]["name"])[1] * factor}


FAULTS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "nonfinite_grad": (_nonfinite_grad, FAULT_BASES),
    "bad_batch": (_bad_batch, FAULT_BASES),
    "poisoned_state": (_poisoned_state, FAULT_BASES),
    "huge_grad": (_huge_grad, FAULT_BASES),
    "burst": (_burst, FAULT_BASES),
    "bad_shard": (_bad_shard, FAULT_BASES),
    "lr_pulse": (_lr_pulse, tuple(f for f in FAULT_BASES if _loop_lr(f))),
    "lr_climb": (_lr_climb, tuple(f for f in FAULT_BASES if _loop_lr(f))),
    "hopeless": (_hopeless, FAULT_BASES),
}


# ---------------------------------------------------------------- registry
@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "healthy", "fault" or "hopeless"
    make: Callable[[random.Random], dict]
    default_n: int

    def configs(self, seed_base: int, n: int | None = None) -> list[dict]:
        """``n`` configs (default: ``default_n``), the same for the same ``seed_base``."""
        out = []
        for i in range(self.default_n if n is None else n):
            rng = random.Random(seed_of(self.name, seed_base, i))
            cfg = self.make(rng)
            cfg["seed"] = seed_of(self.name, seed_base, i, "seed")
            out.append({"id": f"{self.name}-{seed_base}-{i:03d}", "family": self.name, **cfg})
        return out


def _fault_maker(fault: str) -> Callable[[random.Random], dict]:
    maker, bases = FAULTS[fault]

    def make(rng: random.Random) -> dict:
        base_family = rng.choice(bases)
        cfg = HEALTHY[base_family].make(rng)
        cfg["base_family"] = base_family
        cfg["fault"] = {"kind": fault, **maker(rng, cfg)}
        return cfg
    return make


_HEALTHY_MAKERS = {
    "regression_floor": (regression_floor, 7), "classify_noisy": (classify_noisy, 7), "chargpt": (chargpt, 7),
    "warm_restarts": (warm_restarts, 7), "domain_switch": (domain_switch, 10), "curriculum": (curriculum, 8),
    "finetune": (finetune, 7), "gauss_nll": (gauss_nll, 7), "cnn_bn": (cnn_bn, 7), "lstm_clip": (lstm_clip, 7),
    "onecycle": (onecycle, 7), "grad_accum": (grad_accum, 7), "transient_heal": (transient_heal, 8),
    "gan": (gan, 6), "lr_warmup": (lr_warmup, 7), "smallbatch": (smallbatch, 6),
    "heavy_tail": (heavy_tail, 7), "batch_change": (batch_change, 7), "lr_jump": (lr_jump, 7),
    "loss_scale": (loss_scale, 7), "memorize": (memorize, 7), "rare_task": (rare_task, 7),
    "empty_batches": (empty_batches, 7), "loss_ramp": (loss_ramp, 7),
    "pool_switch": (pool_switch, 7), "phase": (phase, 7),
    "self_spike": (self_spike, 7), "heavy_reward": (heavy_reward, 7),
    "lr_cycle": (lr_cycle, 7), "rewarm": (rewarm, 7),
}
HEALTHY: dict[str, Family] = {name: Family(name, "healthy", make, n) for name, (make, n) in _HEALTHY_MAKERS.items()}
FAULT_FAMILIES: dict[str, Family] = {
    name: Family(name, "hopeless" if name == "hopeless" else "fault", _fault_maker(name), 8 if name == "hopeless" else 11)
    for name in FAULTS}
FAMILIES: dict[str, Family] = {**HEALTHY, **FAULT_FAMILIES}


def twin_of(config: dict) -> dict:
    """The fault-free twin of a faulted config: same run, no fault."""
    twin = copy.deepcopy(config)
    twin["fault"] = None
    twin["id"] = config["id"] + "~twin"
    return twin


def all_configs(seed_base: int = 0, families: list[str] | None = None, n: int | None = None) -> list[dict]:
    names = list(FAMILIES) if families is None else families
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}: choose from {', '.join(FAMILIES)}")
    return [c for name in names for c in FAMILIES[name].configs(seed_base, n)]
