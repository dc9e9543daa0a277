"""The detector rules of issue 14: a loss divergence judged against the loss's own noise, losses
<= 0, the learning-rate rule, loss-only logs, non-finite values in messages; the calm, general and
column paths bit-identical on all of it; the guard hands the detector the LR of each step."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import numpy as np
import pytest

from earlywarn.detect import DetectorConfig, Observation, StreamingDetector, replay
from earlywarn.detect.detector import _fmt, _times
from earlywarn.detect.observation import StepColumns

from detector_paths import replay_three_ways
from earlywarn.detect.replay import observations_from_arrays
from earlywarn.events import Kind, Level

DATA = Path(__file__).parent / "data" / "realruns"


def _run(loss, g=None, lr=None):
    """Observations of a run with only a loss (and optionally a grad norm and an LR)."""
    out = []
    for i, v in enumerate(loss):
        ex = {} if lr is None else {"lr": float(lr[i])}
        out.append(Observation(step=i, loss=float(v), grad_norm=None if g is None else float(g[i]), extras=ex))
    return out


def _noisy(kind: str, n: int = 3000, seed: int = 0):
    """Healthy runs whose per-batch loss is noisy in relative terms (issue 11 item 0): the loss and
    a grad norm that moves with it (a hard batch lifts both)."""
    rng = np.random.default_rng(seed)
    e = rng.normal(0, 1, n)
    t = np.arange(n)
    if kind == "cls_b8":  # classification against a teacher, batch 8, SGD momentum
        loss = 1.3 * np.exp(0.35 * e) * np.where(rng.random(n) < 0.05, 2.2, 1.0)
    elif kind == "mse_floor":  # MSE near convergence, wobbling 0.06-0.18, bursts at Adam's floor
        burst = np.zeros(n)
        for s in rng.integers(100, n - 10, n // 60):
            burst[s:s + rng.integers(2, 5)] = rng.uniform(0.4, 0.7)
        loss = 0.1 * np.exp(0.22 * e + burst)
    elif kind == "finetune_b4":  # cosine-decayed fine-tune at batch 4
        loss = (1.8 + 0.7 * np.exp(-t / 800)) * np.exp(0.25 * e)
    elif kind == "nll":  # a Gaussian NLL that falls through 0 and stays negative
        loss = 2.0 * np.exp(-t / 300) - 1.5 + 0.15 * e
    else:
        raise ValueError(kind)
    g = 2.0 * np.exp(0.5 * e + rng.normal(0, 0.2, n))
    return loss, g


@pytest.mark.parametrize("kind", ["cls_b8", "mse_floor", "finetune_b4", "nll"])
def test_healthy_noisy_loss_runs_raise_no_critical_and_real_divergences_are_seen(kind):
    loss, g = _noisy(kind)
    res = replay(_run(loss, g))
    assert not [a for a in res.alerts if a.level == Level.CRITICAL], [str(a) for a in res.alerts][:3]
    n = DetectorConfig().loss_diverge_steps
    for mult in (2.0, 5.0, 10.0):  # sustained x2-x10 (of the loss, or of its distance to the floor)
        bad = np.concatenate([loss, (np.abs(loss[-1]) + 1.0) * mult * np.ones(30)])
        res = replay(_run(bad, np.concatenate([g, g[-30:]])))
        div = [a for a in res.alerts if a.kind == Kind.LOSS_DIVERGED]
        # a warning: whether it is a collapse or a change in the data is the guard's to read
        assert div and div[0].level == Level.WARNING and div[0].step == len(loss) + n - 1, (mult, kind)
    res = replay(_run(np.append(loss, np.nan), np.append(g, g[-1])))
    assert res.alerts[-1].kind == Kind.LOSS_NONFINITE and res.alerts[-1].step == len(loss)


def test_a_two_step_loss_excursion_is_not_a_divergence():
    # issue 11: "Loss has stayed at 2.99x its baseline (0.284 -> 0.85) for 2 steps" rewound a
    # healthy run; excursions of up to loss_diverge_steps - 1 steps are not one, however high
    rng = np.random.default_rng(3)
    loss = 0.284 * np.exp(rng.normal(0, 0.1, 400))
    n = DetectorConfig().loss_diverge_steps
    for at in (200, 300):
        loss[at:at + n - 1] = 0.85
    res = replay(_run(loss))
    assert not [a for a in res.alerts if a.level == Level.CRITICAL]


def test_a_loss_at_or_below_zero_keeps_its_channel_and_its_rules():
    sd = StreamingDetector()
    for i, v in enumerate(np.linspace(2.0, -3.0, 200)):
        assert not [a for a in sd.observe(Observation(step=i, loss=float(v))) if a.level >= Level.WARNING]
    assert sd.baselines()["loss"] < 0 < sd.state.loss_shift
    assert sd.observe(Observation(step=200, loss=0.0)) == []  # exactly 0 is a loss like any other
    shift = sd.state.loss_shift
    for i in range(201, 260):  # far below every offset so far: the offset grows, nothing breaks
        sd.observe(Observation(step=i, loss=-3.0 - 0.1 * (i - 200)))
    assert sd.state.loss_shift > shift and math.isfinite(sd.score)
    base = sd.baselines()["loss"]
    assert -9.0 < base < -6.0
    alerts = [a for i in range(260, 280) for a in sd.observe(Observation(step=i, loss=5.0))]
    div = [a for a in alerts if a.kind == Kind.LOSS_DIVERGED]
    assert div and div[0].level == Level.WARNING and "far above its baseline" in div[0].message
    assert div[0].values["value"] == 5.0 and div[0].values["baseline"] < -6.0
    (a,) = sd.observe(Observation(step=280, loss=float("-inf")))
    assert a.kind == Kind.LOSS_NONFINITE and a.message.startswith("Loss is -inf")


def test_the_learning_rate_rule_sees_a_pulse_before_its_update_and_nothing_else():
    n = 900
    rng = np.random.default_rng(5)
    loss = 2.5 * np.exp(rng.normal(0, 0.02, n))
    g = 0.5 * np.exp(rng.normal(0, 0.1, n))
    t = np.arange(n)
    lr = np.where(t < 100, 3e-3 * (t + 1) / 100, 3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi * (t - 100) / 300)))
    lr[400:] = 3e-3 * 0.5 * (1 + np.cos(np.pi * (t[400:] - 400) / 500))  # a warm restart to the old peak
    lr[0] = 0.0  # a warm-up that starts at 0
    res = replay(_run(loss, g, lr))
    assert not res.at_least(Level.WARNING), [str(a) for a in res.alerts]
    pulsed = lr.copy()
    pulsed[700:703] *= 30.0  # a short pulse: the update it scales comes after this step's statistics
    res = replay(_run(loss, g, pulsed))
    (w,) = res.at_least(Level.WARNING)
    assert w.step == 700 and w.signal == "lr" and w.kind == Kind.COLLAPSE_RISK
    assert w.values["ratio"] == pytest.approx(pulsed[700] / 3e-3)
    assert "learning rate jumped to" in w.message and "nan" not in w.message
    ramp = 1e-4 * 1.02 ** t  # a geometric ramp (an LR range test) is no jump
    assert not replay(_run(loss, g, ramp)).at_least(Level.WARNING)
    off = DetectorConfig(lr_jump_ratio=math.inf)
    assert not replay(_run(loss, g, pulsed), cfg=off).at_least(Level.WARNING)


def test_a_loss_only_log_warns_when_the_loss_keeps_rising_and_not_on_its_noise():
    rng = np.random.default_rng(8)
    loss = 3.0 * np.exp(-np.arange(3000) / 4000) * np.exp(rng.normal(0, 0.03, 3000))
    assert not replay(_run(loss)).at_least(Level.WARNING)
    rise = loss.copy()
    rise[2000:2030] *= 1.03 ** np.arange(1, 31)  # +3% a step, while it should be falling
    w = replay(_run(rise)).first(Level.WARNING)
    assert w is not None and w.signal == "loss" and 2000 < w.step < 2014  # before the loss is at 1.5x
    assert "rising for several steps" in w.message


def _llmc():
    rows = [r for r in csv.DictReader(open(DATA / "llmc_gpt2_124m" / "main.csv")) if r["train_loss"]]
    return (np.array([int(r["step"]) for r in rows]), np.array([float(r["train_loss"]) for r in rows]),
            np.array([float(r["lr"]) for r in rows]))


def test_llmc_as_a_loss_only_log_and_with_its_lr_stays_quiet():
    steps, loss, lr = _llmc()
    assert not replay(observations_from_arrays(steps, loss=loss)).at_least(Level.WARNING)
    assert not replay(observations_from_arrays(steps, loss=loss, extras={"lr": lr})).at_least(Level.WARNING)


def test_messages_write_non_finite_values_as_words():
    assert (_fmt(float("nan")), _fmt(math.inf), _fmt(-math.inf), _fmt(0.25)) == ("NaN", "inf", "-inf", "0.25")
    assert (_times(float("nan")), _times(math.inf), _times(422.0)) == ("NaN", "inf", "422x")
    cols = _mixed_columns()
    msgs = [e.message for _, e in StreamingDetector(layer_names=[f"l{i}" for i in range(4)]).observe_columns(cols)]
    assert msgs and not [m for m in msgs if re.search(r"\bnan|nanx|infx", m)], msgs


def _mixed_columns(T: int = 5000, seed: int = 21) -> StepColumns:
    """Everything the rules of issue 14 touch, across chunk boundaries (2048): an LR warm-up, a
    decay, a restart and a pulse; a loss that crosses 0 (twice moving its offset inside a chunk),
    is exactly 0, NaN, and diverges; rows without a grad norm (loss-only stretches); layers."""
    rng = np.random.default_rng(seed)
    nl = 4
    t = np.arange(T)
    lay = np.exp(rng.normal(-2, 0.1, (T, nl)))
    lay[3300:3306] *= np.array([2, 4, 8, 16, 32, 64])[:, None]
    g = np.sqrt((lay ** 2).sum(1))
    loss = 2.0 * np.exp(rng.normal(0, 0.03, T))
    loss[1500:2600] = np.linspace(2.0, -4.0, 1100) + rng.normal(0, 0.05, 1100)  # through 0, offset 8
    loss[2600:2700] = -7.0 + rng.normal(0, 0.05, 100)  # offset 16, at 2600 (inside the 2nd chunk)
    loss[2700:4000] = -7.0 + rng.normal(0, 0.05, 1300)
    loss[2800] = 0.0
    loss[3000:3012] = 6.0  # a divergence from below 0
    loss[3500] = np.nan
    loss[4100:4130] *= np.linspace(1.0, 3.0, 30)
    gk = np.ones(T, bool)
    gk[3700:3900] = False  # loss-only rows (and no layers there)
    lk = gk.copy()
    lr = np.where(t < 100, 1e-3 * (t + 1) / 100, 1e-3)
    lr[2000:2003] = 3e-2
    lr[3100:] = 2e-4
    lr[3200:] = 1e-3  # back to the old peak: no jump
    lr[4500:4502] = 5e-2
    return StepColumns(step=t, grad_norm=g, grad_known=gk, loss=loss, layer_norms=lay, layers_known=lk,
                       extras={"lr": (lr, None)})


@pytest.mark.parametrize("cuts", [(0, 5000), (0, 1999, 2601, 3705, 5000)])
def test_calm_general_and_columns_paths_agree_bit_for_bit_on_the_new_rules(cuts):
    rows, alerts = replay_three_ways(_mixed_columns(), [f"l{i}" for i in range(4)], cuts)
    kinds = {m.split(" ")[0] for _, m in alerts}
    assert {"The", "Loss"} <= kinds  # the LR rule and the loss rules fired
    assert rows.state.loss_shift == 8.0 and rows.state.lr_n == 5000  # offsets 1 or 2, then 8


def test_loss_only_rows_use_the_loss_alone_threshold_in_both_paths():
    cfg = DetectorConfig()
    obs = _run(2.0 * np.exp(np.random.default_rng(2).normal(0, 0.02, 400)))
    sd = StreamingDetector(cfg)
    for o in obs:
        sd.observe(o)
    assert sd.state.fast  # a mature loss-only run is calm


# -- the guard hands the detector the LR of each step --------------------------------------------


def test_learning_rate_reads_the_largest_group_lr_without_syncing():
    torch = pytest.importorskip("torch")
    from earlywarn.capture.updates import learning_rate

    p1, p2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.3}])
    assert learning_rate(opt) == pytest.approx(0.3)
    opt.param_groups[1]["lr"] = torch.tensor(0.5)  # a CPU tensor: read as it is
    assert learning_rate(opt) == pytest.approx(0.5)
    opt.param_groups[1]["lr"] = float("nan")
    assert learning_rate(opt) == pytest.approx(0.1)
    opt.param_groups[0]["lr"] = "x"
    assert learning_rate(opt) is None


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_watch_feeds_the_step_lr_and_warns_on_a_pulse_before_its_update():
    torch = pytest.importorskip("torch")
    import earlywarn
    from fixtures_models import MLP

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 30.0 if s == 80 else 1.0)
    ew = earlywarn.watch(model, opt, sinks=[])
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    try:
        for _ in range(100):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            ew.report_loss(loss)
            loss.backward()
            opt.step()
            sched.step()
        lr_events = [e for e in ew.events if e.signal == "lr"]
        assert [e.step for e in lr_events] == [80] and lr_events[0].level == Level.WARNING
        assert ew.detector.state.lr_n == 100 and not ew.statistics._step_lr
    finally:
        ew.close()


# -- the together rule while the learning rate climbs ------------------------------------------


def _rise_run(lr_kind: str, g_rise: float, loss_rise: float, steps: int, seed: int = 5):
    """Calm for 300 steps, then the grad norm and the loss rise together for ``steps`` steps, under
    an LR that climbs (a warm-up still going), stays flat, decays, or is not logged."""
    rng = np.random.default_rng(seed)
    n = 300 + steps + 20
    g = np.exp(rng.normal(0, 0.1, n))
    loss = 2.0 * np.exp(rng.normal(0, 0.02, n))
    g[300:300 + steps] *= g_rise ** np.arange(1, steps + 1)
    loss[300:300 + steps] *= loss_rise ** np.arange(1, steps + 1)
    t = np.arange(n)
    lr = {"climbs": 1e-4 * (t + 1), "flat": np.full(n, 1e-3), "decays": 1e-3 * np.exp(-t / 500)}.get(lr_kind)
    return _run(loss, g, lr)


def test_the_together_rule_is_more_sensitive_while_the_lr_climbs_than_when_it_is_flat_or_unknown():
    cfg = DetectorConfig()
    assert cfg.lr_rise_factor < cfg.no_lr_factor < 1.0
    first = {}
    for kind in ("climbs", "flat", "decays", None):
        res = replay(_rise_run(kind, 1.15, 1.03, 12))
        w = [a for a in res.alerts if a.level >= Level.WARNING]
        first[kind] = w[0].step if w else None
        if w:
            assert "rising together" in w[0].message
            h = {"climbs": cfg.lr_rise_factor, None: cfg.no_lr_factor}.get(kind, 1.0) * cfg.drift_h
            assert w[0].values["cusum"] >= h
    assert first["climbs"] is not None and first["climbs"] < 312
    assert first[None] is not None and first["climbs"] <= first[None]
    assert first["flat"] is None or first["flat"] > first[None]
    assert first["decays"] == first["flat"]


def test_one_bad_batch_warns_only_while_the_lr_climbs():
    # both the gradient and the loss far up for one step, then back: a bad batch. Under a flat or
    # decaying LR that is an info spike; while the LR climbs (lr_rise_factor) one such step warns
    for kind, warned in (("flat", False), ("decays", False), (None, False), ("climbs", True)):
        res = replay(_rise_run(kind, 1.0, 1.0, 0)[:300] + [
            Observation(step=300, grad_norm=20.0, loss=2.9, extras={} if kind is None else {"lr": {
                "climbs": 3.01e-2, "flat": 1e-3, "decays": 1e-3 * math.exp(-300 / 500)}[kind]})])
        collapse = [a for a in res.alerts if a.kind == Kind.COLLAPSE_RISK]
        assert bool(collapse) == warned, kind
        # the 20.0 gradient is an outlier (20x its typical norm and more) whatever the LR does
        assert [a.step for a in res.alerts if a.kind == Kind.GRAD_OUTLIER] == [300], kind
        assert not [a for a in res.alerts if a.level == Level.CRITICAL]


# -- the rule functions both paths call (earlywarn.detect.rules) --------------------------------


def test_a_cusum_step_is_winsorised_less_its_allowance_and_never_negative():
    from earlywarn.detect.rules import cusum

    assert cusum(2.0, 1.5, 4.0, 1.0) == 2.5  # + z - k
    assert cusum(2.0, 50.0, 4.0, 1.0) == 5.0  # one enormous z counts as cap
    assert cusum(0.5, -3.0, 4.0, 1.0) == 0.0  # evidence never goes below 0
    c = 0.0
    for _ in range(6):  # z steadily 2 above an allowance of 1: +1 a step
        c = cusum(c, 2.0, 4.0, 1.0)
    assert c == 6.0


def test_the_together_term_is_the_smaller_side_and_needs_both():
    from earlywarn.detect.rules import Thresholds, together

    t = Thresholds.of(DetectorConfig())  # together_k 0.75, cap admit_z = 3
    assert together(1.0, 2.0, None, 0.5, t) == (1.0 + 0.5 - 0.75, 0.5)  # the loss is the smaller side
    assert together(1.0, 9.0, None, 8.0, t) == (1.0 + 3.0 - 0.75, 8.0)  # winsorised at admit_z
    assert together(1.0, None, None, 2.0, t) == (1.0, None)  # no gradient signal: unchanged
    assert together(1.0, None, 2.0, 2.0, t)[1] == 2.0  # the update norm stands in for a missing grad norm
    assert together(1.0, 1.0, 2.0, 2.0, t)[1] == 1.0  # ... not for a lower one unless update_warns
    assert together(1.0, 1.0, 2.0, 2.0, Thresholds.of(DetectorConfig(update_warns=True)))[1] == 2.0


def test_a_divergence_step_needs_the_ratio_and_the_loss_own_noise():
    from earlywarn.detect.rules import Thresholds, loss_diverging

    t = Thresholds.of(DetectorConfig())  # loss_diverge_ratio 1.5, loss_diverge_z 2
    assert loss_diverging(math.log(1.6), 2.5, t)
    assert not loss_diverging(math.log(1.4), 9.0, t)  # far in its noise, not by the ratio
    assert not loss_diverging(math.log(3.0), 1.5, t)  # by the ratio, within its (wide) noise


def test_the_lr_ring_remembers_what_the_run_survived_and_flags_new_highs_and_jumps():
    from earlywarn.detect.rules import LR_JUMPED, LR_RISING, Thresholds, lr_push, lr_signals

    t = Thresholds.of(DetectorConfig(lr_ref_steps=3, warmup_steps=3, lr_jump_ratio=10.0))
    ring, pos, seen, ref = [0.0] * 3, 0, 0, 0.0
    said = []
    for lr in (1.0, 2.0, 3.0, 4.0, 4.0, 2.0, 5.0, 45.0):
        said.append(lr_signals(lr, ring, pos, seen, ref, t))
        pos, seen, ref = lr_push(lr, ring, pos, seen, ref, t)
    # a new high once the ring is full (above the LR 3 steps back and the highest before it); a
    # jump: 10x the highest LR at least 3 steps back (4.0 when 45.0 comes)
    assert said == [0, 0, 0, LR_RISING, LR_RISING, 0, LR_RISING, LR_RISING | LR_JUMPED]
    assert ref == 4.0 and seen == 8 and sorted(ring) == [2.0, 5.0, 45.0]
