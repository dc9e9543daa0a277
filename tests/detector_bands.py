"""The calm steps' two paths on the same observations: every step observed at once, and the
guard's way -- steps inside the detector's bands kept unobserved and folded in later, in order
(``StreamingDetector.bands`` / ``Bands.take`` / ``observe_calm``). They must give the same alerts
at the same steps, the same score after every step and the same state; and no step kept may
be one the detector alerts on or that lifts a run-level signal to ``spike_z`` (the episode's
test). ``random_runs`` generates runs that make every rule fire, so that a rule added without a
band fails here."""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np

from earlywarn.detect import DetectorConfig, Observation, StepColumns, StreamingDetector


def _columns(rows: list[Observation], users: Sequence[str]) -> StepColumns:
    extras = {}
    for key in ("lr", "loss_scale", *users):
        if key in rows[0].extras:
            extras[key] = (np.array([o.extras[key] for o in rows], dtype=np.float64), None)
    return StepColumns(step=np.array([o.step for o in rows]),
                       grad_norm=None if rows[0].grad_norm is None else np.array([o.grad_norm for o in rows]),
                       loss=None if rows[0].loss is None else np.array([o.loss for o in rows]),
                       layer_norms=None if rows[0].layer_norms is None else np.stack([o.layer_norms for o in rows]),
                       extras=extras)


def _take(b, o: Observation) -> bool:
    """What the guard asks of a step before its values: the same user signals as the bands (it
    compares the step's reported ones, ``StepTag.users``), nothing known non-finite or skipped."""
    if {k for k in o.extras if k.startswith("user/")} != set(b.users) or o.layer_nonfinite is not None or o.skipped:
        return False
    ln = o.layer_norms
    return b.take(None if ln is None else (ln * ln).tolist(), None if o.grad_norm is None else o.grad_norm ** 2,
                  o.loss, [o.extras[u] for u in b.users], o.extras.get("lr"), o.extras.get("loss_scale"))


def replay_both(obs: Sequence[Observation], names: Sequence[str] = (), *, window: int = 16,
                cfg: DetectorConfig | None = None, baseline=None) -> dict:
    """Both paths over ``obs``; asserts what the module docstring says and returns counts."""
    ref = StreamingDetector(cfg, names, baseline=baseline)
    kept_det = StreamingDetector(cfg, names, baseline=baseline)
    spike_z = ref.cfg.spike_z
    want: list = []  # (row, message) of every alert, and the score after every row
    got: list = []
    want_scores: list[float] = []
    got_scores: list[float] = []
    kept: list[tuple[int, Observation]] = []
    bands = None
    folds = n_kept = 0

    def fold() -> None:
        nonlocal bands, folds
        if kept:
            scores: list[float] = []
            users = [k for k in kept[0][1].extras if k.startswith("user/")]
            late = kept_det.observe_calm(_columns([o for _, o in kept], users), scores)
            got.extend((kept[r][0], e.message) for r, e in late)
            got_scores.extend(scores)
            kept.clear()
            folds += 1
        bands = None

    for i, o in enumerate(obs):
        want.extend((i, e.message) for e in ref.observe(o))
        want_scores.append(ref.score)
        if bands is not None and _take(bands, o):
            kept.append((i, o))
        else:
            if bands is None or bands.taken:
                fold()
                bands = kept_det.bands(window)
            if bands is not None and _take(bands, o):
                kept.append((i, o))
            else:
                got.extend((i, e.message) for e in kept_det.observe(o))
                got_scores.append(kept_det.score)
                bands = None
        if kept and kept[-1][0] == i:  # kept unobserved: it must be calm
            n_kept += 1
            assert not want or want[-1][0] != i, f"row {i} kept, but observed it alerts: {want[-1][1]}"
            assert ref.run_score < spike_z, f"row {i} kept, but observed it lifts a run-level signal"
    fold()
    assert got == want
    assert got_scores == want_scores
    s1, s2 = ref.state, kept_det.state
    np.testing.assert_array_equal(s1.stats, s2.stats)
    np.testing.assert_array_equal(s1.dev, s2.dev)
    assert s1._replace(stats=None, dev=None) == s2._replace(stats=None, dev=None)
    return {"rows": len(obs), "kept": n_kept, "folds": folds}


def random_runs(n: int, seed: int = 0) -> Iterator[tuple[str, list[Observation], list[str], DetectorConfig | None]]:
    """``n`` runs of 300-700 steps, each with a few of: spikes, an escalation, the gradient and
    the loss rising together, a divergence, a non-finite step, a learning-rate warm-up, pulse or
    climb, a layer at 0 for a while (and an expert-like one on and off), a step far below,
    a loss that goes negative, a user signal (from the start, or from mid-run), a loss scale that
    drops; under the default detector or one with more rules on."""
    rng = np.random.default_rng(seed)
    configs = [None, DetectorConfig(drift_alone_h=12.0, layers_at_once=2, user_alone_h=8.0),
               DetectorConfig(warmup_steps=10, alpha=0.1, scale_alpha=0.02, spike_ratio=1.2)]
    for r in range(n):
        T = int(rng.integers(300, 700))
        L = int(rng.integers(1, 9))
        noise = float(rng.uniform(0.02, 0.4))
        g = np.exp(rng.normal(0.0, noise, T)) * float(rng.uniform(0.1, 10.0))
        loss = np.exp(rng.normal(0.0, noise / 2, T)) * np.linspace(3.0, 1.0, T)
        layers = np.exp(rng.normal(0.0, noise, (T, L))) * rng.uniform(0.01, 3.0, L)
        lr = np.full(T, 1e-3)
        user = None
        scale = None
        what = []
        for _ in range(int(rng.integers(1, 5))):
            at = int(rng.integers(60, T - 30))
            kind = rng.choice(["spike", "escalate", "together", "diverge", "nan", "warmup", "pulse", "climb",
                               "zero", "expert", "low", "negative", "user", "user_late", "scale", "drift"])
            what.append(f"{kind}@{at}")
            if kind == "spike":
                f = float(rng.uniform(2.0, 100.0))
                g[at] *= f
                layers[at, rng.integers(0, L)] *= f
            elif kind == "escalate":
                for k in range(5):
                    g[at + k] *= 1.6 ** (k + 1)
            elif kind == "together":
                ramp = np.linspace(1.0, float(rng.uniform(1.5, 4.0)), 25)
                g[at:at + 25] *= ramp
                loss[at:at + 25] *= ramp ** 0.5
            elif kind == "diverge":
                loss[at:] *= float(rng.uniform(1.5, 10.0))
            elif kind == "nan":
                (g if rng.random() < 0.5 else loss)[at] = math.nan
            elif kind == "warmup":
                lr[:at] = np.linspace(1e-5, 1e-3, at)
            elif kind == "pulse":
                lr[at:at + 3] *= float(rng.uniform(5.0, 40.0))
            elif kind == "climb":
                lr[at:] *= 1.03 ** np.arange(T - at)
            elif kind == "zero":
                layers[at:at + 20, rng.integers(0, L)] = 0.0
            elif kind == "expert":
                j = int(rng.integers(0, L))
                layers[at:, j] *= rng.random(T - at) < 0.5
            elif kind == "low":
                layers[at] *= 1e-3
                g[at] *= 1e-2
            elif kind == "negative":
                loss -= float(rng.uniform(1.0, 5.0))
            elif kind in ("user", "user_late"):
                user = np.exp(rng.normal(0.0, noise, T))
                user[at:at + 15] *= np.linspace(1.0, 6.0, 15)
                if kind == "user_late":
                    user[:at] = math.nan
            elif kind == "scale":
                scale = np.full(T, 65536.0)
                scale[at:] /= 2.0
                g[at] = math.inf
            elif kind == "drift":
                g[at:] *= np.linspace(1.0, float(rng.uniform(2.0, 20.0)), T - at)
        names = [f"l{j}" for j in range(L)]
        obs = []
        for t in range(T):
            ex = {"lr": float(lr[t])}
            if user is not None and user[t] == user[t]:
                ex["user/u"] = float(user[t])
            if scale is not None:
                ex["loss_scale"] = float(scale[t])
            ln = layers[t].copy()
            obs.append(Observation(step=t, grad_norm=float(g[t]), layer_norms=ln, loss=float(loss[t]), extras=ex,
                                   skipped=not math.isfinite(g[t])))
        yield f"run {r} ({', '.join(what)})", obs, names, configs[r % len(configs)]
