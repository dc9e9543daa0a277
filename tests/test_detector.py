"""The streaming detector: pure pair, robust baselines, escalation levels, real runs, round trips."""

from __future__ import annotations

import copy
import csv
import json
import math
import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from earlywarn.detect import (Detector, DetectorConfig, DetectorState, Observation,
                              StreamingDetector, replay)
from earlywarn.detect.observation import StepColumns
from earlywarn.detect.replay import observations_from_arrays
from earlywarn.events import Event, Kind, Level

DATA = Path(__file__).parent / "data" / "realruns"
LAYERS = [f"h.{i}" for i in range(8)]


def _alerts_key(alerts: list[Event]) -> list[tuple]:
    return [(a.step, a.kind, a.level, a.signal, a.layers, a.message,
             tuple(sorted((k, round(v, 9) if math.isfinite(v) else str(v)) for k, v in a.values.items())))
            for a in alerts]


def _calm_run(n: int, seed: int = 0, layers: int = 8, noise: float = 0.1):
    rng = np.random.default_rng(seed)
    lay = 0.05 * np.exp(rng.normal(0, noise, (n, layers)))
    g = np.sqrt((lay ** 2).sum(1))
    loss = 2.5 * np.exp(rng.normal(0, 0.01, n))
    return lay, g, loss


def _obs(step, g, loss, lay=None, **kw):
    return Observation(step=step, grad_norm=float(g), loss=float(loss),
                       layer_norms=None if lay is None else np.asarray(lay, dtype=np.float64), **kw)


def _escalating_run(n_calm: int = 200, seed: int = 1):
    """Calm, then layer h.3 starts growing x2 per step, the others follow a step later."""
    lay, g, loss = _calm_run(n_calm, seed)
    obs = [_obs(i, g[i], loss[i], lay[i]) for i in range(n_calm)]
    base = lay[-1].copy()
    for j in range(1, 7):
        cur = base.copy()
        cur[3] *= 2.0 ** j
        cur[[2, 4]] *= 2.0 ** max(0, j - 1)
        obs.append(_obs(n_calm + j - 1, np.sqrt((cur ** 2).sum()), loss[-1] * (1 + 0.02 * j), cur))
    obs.append(_obs(n_calm + 6, float("nan"), float("nan"), np.full(8, np.nan)))
    return obs


# -- config -------------------------------------------------------------------------------------


def test_config_validation_names_field_value_and_fix():
    with pytest.raises(ValueError, match=r"DetectorConfig\.alpha=0 .*\(0, 1\]"):
        DetectorConfig(alpha=0)
    with pytest.raises(ValueError, match=r"spike_ratio=0\.5.*>= 1"):
        DetectorConfig(spike_ratio=0.5)
    with pytest.raises(ValueError, match=r"warmup_steps=2\.5.*int"):
        DetectorConfig(warmup_steps=2.5)
    with pytest.raises(ValueError, match=r"admit_z=5.*spike_z"):
        DetectorConfig(admit_z=5.0, spike_z=4.0)
    with pytest.raises(ValueError, match=r"min_scale=nan"):
        DetectorConfig(min_scale=float("nan"))
    with pytest.raises(ValueError, match=r"readapt_steps"):
        DetectorConfig(readapt_steps=2)


def test_config_dict_and_file_round_trip(tmp_path):
    cfg = DetectorConfig(spike_z=5.0, jump_ratio=float("inf"), layers_at_once=3)
    assert DetectorConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    path = tmp_path / "det.json"
    cfg.to_file(path)
    assert DetectorConfig.from_file(path) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        DetectorConfig.from_dict({"spike_zz": 3})
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        DetectorConfig.from_file(path)


def test_config_fields_all_have_docstrings():
    import ast
    import inspect

    import earlywarn.detect.config as mod

    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DetectorConfig")
    body = cls.body
    documented = {body[i].target.id for i in range(len(body) - 1)
                  if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)
                  and isinstance(body[i + 1].value, ast.Constant)}
    fields = {f for f in DetectorConfig.__dataclass_fields__}
    assert fields == documented


# -- the pure pair ------------------------------------------------------------------------------


def test_update_never_mutates_its_input_state_and_is_deterministic():
    det = Detector()
    obs = _escalating_run()
    state = det.init(LAYERS)
    snapshots = []
    for o in obs:
        before = copy.deepcopy(state)
        alerts, new = det.update(state, o)
        np.testing.assert_array_equal(state.stats, before.stats)
        assert state._replace(stats=None, dev=None) == before._replace(stats=None, dev=None)
        snapshots.append(alerts)
        state = new
    again = Detector()
    st2 = again.init(LAYERS)
    for o, expected in zip(obs, snapshots):
        alerts, st2 = again.update(st2, o)
        assert _alerts_key(alerts) == _alerts_key(expected)


def test_same_state_replayed_twice_gives_the_same_alerts():
    det = Detector()
    obs = _escalating_run()
    state = det.init(LAYERS)
    for o in obs[:190]:
        _, state = det.update(state, o)
    outs = []
    for _ in range(2):
        s, alerts = state, []
        for o in obs[190:]:
            a, s = det.update(s, o)
            alerts += a
        outs.append(_alerts_key(alerts))
    assert outs[0] == outs[1] and outs[0]


@pytest.mark.parametrize("cut", [5, 60, 199, 202, 204])
def test_state_dict_round_trip_mid_run_gives_the_same_alerts(cut):
    obs = _escalating_run()
    whole = StreamingDetector(layer_names=LAYERS)
    expected = [a for o in obs for a in whole.observe(o)]
    assert any(a.level >= Level.WARNING for a in expected)

    first = StreamingDetector(layer_names=LAYERS)
    got = [a for o in obs[:cut] for a in first.observe(o)]
    sd = first.state_dict()
    # torch.save / JSON friendly: pickle as is, and JSON once arrays become lists
    blob = pickle.loads(pickle.dumps(sd))
    as_json = json.loads(json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                     for k, v in sd.items()}))
    for restored in (blob, as_json):
        second = StreamingDetector(layer_names=LAYERS)
        second.load_state_dict(restored)
        rest = [a for o in obs[cut:] for a in second.observe(o)]
        assert _alerts_key(got + rest) == _alerts_key(expected)


def _mixed_run(n: int = 400, seed: int = 12):
    """Every path at once: warm-up, calm stretches, spikes, an escalation, a skipped step, a
    non-finite step, a frozen (zero) layer, an update norm that appears, loss-scale readings."""
    lay, g, loss = _calm_run(n, seed)
    rng = np.random.default_rng(seed)
    obs = []
    for i in range(n):
        cur = lay[i].copy()
        gi, li, kw = g[i], loss[i], {}
        if i % 97 == 50:
            cur *= 6.0
            gi *= 6.0
        if 300 <= i < 306:
            cur[3] *= 2.0 ** (i - 299)
            gi *= 1.5 ** (i - 299)
            li *= 1.0 + 0.05 * (i - 299)
        if 120 <= i < 200:
            cur[5] = 0.0
        extras = {"loss_scale": 65536.0 if i != 250 else 32768.0}
        if i >= 150:
            extras["update_norm"] = float(0.01 * np.exp(rng.normal(0, 0.05)))
        if i == 220:
            kw["skipped"] = True
        if i == 330:
            cur[2] = np.nan
            gi = float("nan")
        obs.append(_obs(i, gi, li, cur, extras=extras, **kw))
    return obs


def test_calm_and_general_paths_compute_the_same():
    # the calm path is an optimisation: forcing every step through the general path must give
    # bit-identical state and the same alerts
    obs = _mixed_run()
    out = []
    for force in (False, True):
        sd = StreamingDetector(layer_names=LAYERS)
        sd.detector._force_full = force
        alerts = [a for o in obs for a in sd.observe(o)]
        out.append((_alerts_key(alerts), sd.state))
    (a1, s1), (a2, s2) = out
    assert a1 == a2 and any(k[2] >= Level.WARNING for k in a1)
    np.testing.assert_array_equal(s1.stats, s2.stats)
    # an absent channel's deviation reads 0 after a calm step and NaN after a general one
    np.testing.assert_array_equal(np.nan_to_num(s1.dev), np.nan_to_num(s2.dev))
    assert s1.joint == s2.joint and s1._replace(stats=None, dev=None) == s2._replace(stats=None, dev=None)


def test_calm_steps_take_the_calm_path_even_with_a_frozen_layer():
    lay, g, loss = _calm_run(600, seed=13)
    lay[:, 5] = 0.0  # a frozen layer reports 0 on every step: absent, not a reason to slow down
    sd = StreamingDetector(layer_names=LAYERS)
    calls = []
    general = sd.detector._general
    sd.detector._general = lambda *a: (calls.append(1), general(*a))[1]
    for i in range(600):
        assert not sd.observe(_obs(i, g[i], loss[i], lay[i]))
    assert len(calls) < 60  # warm-up and the odd outlier; ~600 would mean every step
    assert "grad_norm/h.5" not in sd.baselines()


def _experts_run(T: int = 3000, seed: int = 5) -> StepColumns:
    """A mixture of experts: after warm-up each step a random set of layers (experts no token
    was routed to) reports 0; spikes, an escalation in one expert, a NaN, a layer that reports
    for the first time late, and stretches where the set stays put."""
    rng = np.random.default_rng(seed)
    nl = len(LAYERS)
    lay = 0.05 * np.exp(rng.normal(0, 0.1, (T, nl)))
    idle = rng.random((T, nl)) < 0.35
    idle[:400] = False  # every expert warms up first
    idle[1500:1700] = idle[1500]  # the same idle set for a while
    idle[:, 7] = np.arange(T) < 2200  # one expert nobody used until step 2200: warms up then
    lay[idle] = 0.0
    lay[900:906, 3] *= np.array([2, 4, 8, 16, 32, 64])  # an escalation in one expert
    lay[1200] *= 8.0
    lay[2500, 1] = np.nan
    g = np.sqrt((np.nan_to_num(lay) ** 2).sum(1))
    loss = 2.5 * np.exp(rng.normal(0, 0.01, T))
    return StepColumns(step=np.arange(T), grad_norm=g, grad_known=np.ones(T, bool), loss=loss,
                       layer_norms=lay, layers_known=np.ones(T, bool))


@pytest.mark.parametrize("cuts", [(0, 3000), (0, 901, 1600, 2201, 3000)])
def test_experts_idle_in_turn_stay_on_the_calm_path_with_the_same_bits(cuts):
    from detector_paths import replay_three_ways

    cols = _experts_run()
    calls = []
    general = Detector._general
    try:
        Detector._general = lambda self, *a: (calls.append(id(self)), general(self, *a))[1]
        rows, alerts = replay_three_ways(cols, LAYERS, cuts)  # calm, general only, columns: the same bits
    finally:
        Detector._general = general
    assert any("h.3" in m for _, m in alerts)  # the escalation was seen through the churn
    # the row-by-row detector went general on warm-up and the trouble only, not on every new idle set
    assert calls.count(id(rows.detector)) < 700, calls.count(id(rows.detector))


def test_another_set_of_idle_experts_moves_only_the_layers_slice_of_what_refresh_derives(monkeypatch):
    # (Work.refresh_layers relies on it: the pattern and every count are the last full refresh's)
    from earlywarn.detect.work import Work

    checked = []
    layers_only = Work.refresh_layers

    def both(w, t):
        layers_only(w, t)
        got = [a.copy() for a in (w.rates, w.keep, w.logv)] + [w.h_alone, w.h_together, w.consts]
        w.refresh(t)
        for a, b in zip(got[:3], (w.rates, w.keep, w.logv)):
            assert a.tobytes() == b.tobytes()
        assert got[3:5] == [w.h_alone, w.h_together] and got[5] is w.consts
        checked.append(1)

    monkeypatch.setattr(Work, "refresh_layers", both)
    cols = _experts_run()
    sd = StreamingDetector(layer_names=LAYERS)
    for i in range(len(cols)):
        sd.observe(cols.observation(i))
    assert len(checked) > 1000, len(checked)


def test_state_from_dict_rejects_a_mismatched_layout_or_an_older_version():
    sd = StreamingDetector(layer_names=LAYERS).state_dict()
    with pytest.raises(ValueError, match="version 1"):
        DetectorState.from_dict({**sd, "version": 1})
    sd["stats"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match="stats shape"):
        DetectorState.from_dict(sd)


def test_a_checkpoint_from_an_older_version_starts_the_detector_afresh_with_a_warning():
    obs = _escalating_run()
    sd = StreamingDetector(layer_names=LAYERS)
    for o in obs[:100]:
        sd.observe(o)
    old = {**sd.state_dict(), "version": 1}
    fresh = StreamingDetector(layer_names=LAYERS)
    with pytest.warns(UserWarning, match="starts afresh"):
        fresh.load_state_dict(old)
    assert fresh.layer_names == tuple(LAYERS) and fresh.state.step == -1


@pytest.mark.parametrize("cut", [130, 180, 260, 303])
def test_state_dict_round_trip_with_absent_layers_and_extras(cut):
    obs = _mixed_run()
    whole = StreamingDetector(layer_names=LAYERS)
    expected = [a for o in obs for a in whole.observe(o)]
    first = StreamingDetector(layer_names=LAYERS)
    got = [a for o in obs[:cut] for a in first.observe(o)]
    second = StreamingDetector(layer_names=LAYERS)
    second.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    got += [a for o in obs[cut:] for a in second.observe(o)]
    assert _alerts_key(got) == _alerts_key(expected)
    np.testing.assert_array_equal(second.state.stats, whole.state.stats)


def test_layer_norms_must_match_the_layer_names():
    sd = StreamingDetector(layer_names=LAYERS)
    with pytest.raises(ValueError, match="same layers in the same order"):
        sd.observe(_obs(0, 1.0, 2.0, np.ones(3)))


def test_lazy_layer_names_from_the_first_observation():
    sd = StreamingDetector()
    sd.observe(_obs(0, 1.0, 2.0, np.ones(3)))
    assert sd.layer_names == ("layer0", "layer1", "layer2")


def test_replay_is_the_live_code_path():
    obs = _escalating_run()
    live = StreamingDetector(layer_names=LAYERS)
    alerts = [a for o in obs for a in live.observe(o)]
    res = replay(obs, layer_names=LAYERS, scores=True)
    assert _alerts_key(res.alerts) == _alerts_key(alerts)
    assert res.first(Level.WARNING) is not None
    assert len(res.scores) == len(obs) and res.scores[-1] == 1000.0


def _columns_run(T: int = 6000, seed: int = 3) -> StepColumns:
    """Long enough to mature, with everything that leaves the calm path: spikes, an escalation,
    NaN / inf values, a frozen layer, rows without layers or grad norm, skipped rows, an update
    norm that comes and goes, loss-scale readings with a drop, a loss that diverges."""
    rng = np.random.default_rng(seed)
    nl = len(LAYERS)
    lay = np.exp(rng.normal(-2, 0.12, (T, nl)))
    lay[1900:2300, 2] = 0.0  # a frozen layer across a chunk boundary (2048)
    lay[2000, 3] = np.nan
    lay[2100, 1] = np.inf
    lay[2500:2506] *= np.array([3, 9, 30, 90, 300, 900])[:, None]
    lay[4000:4080, 5] *= 1.8  # a long plateau in one layer
    g = np.sqrt((lay ** 2).sum(1))
    g[2700] = np.nan
    loss = 3 * np.exp(rng.normal(0, 0.02, T))
    loss[3000:3030] *= np.linspace(1, 3, 30)
    loss[3500] = np.inf
    gk = np.ones(T, bool)
    gk[1000:1040] = False
    lk = np.ones(T, bool)
    lk[1200:1220] = False
    lk[4000:4200] = False  # no layer norms for a while, across a chunk boundary (4096)
    lk[::997] = False
    skipped = np.zeros(T, bool)
    skipped[1800:1803] = True
    un = np.exp(rng.normal(-5, 0.1, T))
    uk = np.zeros(T, bool)
    uk[3200:4000] = True  # present, then absent again across a chunk boundary (4096)
    ls = np.full(T, 65536.0)
    ls[5200:] = 32768.0
    lsk = np.zeros(T, bool)
    lsk[5190:5300] = True
    return StepColumns(step=np.arange(T) * 2, grad_norm=g, grad_known=gk, loss=loss, layer_norms=lay,
                       layers_known=lk, skipped=skipped,
                       extras={"update_norm": (un, uk), "loss_scale": (ls, lsk), "lr": (np.full(T, 1e-3), None)})


@pytest.mark.parametrize("cuts", [(0, 6000), (0, 1210, 2100, 4100, 6000)])
def test_observe_columns_is_observe_row_by_row_bit_for_bit(cuts):
    # cuts inside the stretches without layer norms or with a frozen layer: the state there (the
    # deviations included) must be the row-by-row state too, not only at the end
    cols = _columns_run()
    same = lambda s: s._replace(stats=None, dev=None, loss_scale=str(s.loss_scale))  # noqa: E731
    row_by_row = StreamingDetector(layer_names=LAYERS)
    by_columns = StreamingDetector(layer_names=LAYERS)
    per_row = []  # rows the columns path handed to the per-row step (not calm, or not eligible)
    step = by_columns.detector._step
    by_columns.detector._step = lambda w, o: (per_row.append(o.step), step(w, o))[1]
    expected, got = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        expected += [(i, e) for i in range(a, b) for e in row_by_row.observe(cols.observation(i))]
        got += by_columns.observe_columns(cols, a, b)
        s1, s2 = row_by_row.state, by_columns.state
        np.testing.assert_array_equal(s1.stats, s2.stats)
        np.testing.assert_array_equal(s1.dev, s2.dev)
        assert same(s1) == same(s2)
    assert {e.kind for _, e in expected} >= {Kind.COLLAPSE_RISK, Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE,
                                            Kind.GRAD_SPIKE, Kind.SCALER_OVERFLOW}
    assert [i for i, _ in got] == [i for i, _ in expected]
    assert _alerts_key([e for _, e in got]) == _alerts_key([e for _, e in expected])
    assert len(per_row) < 600  # warm-up and the rows above; the rest of the 6000 rows ran calm


def test_observe_columns_takes_the_calm_path_and_names_layers_lazily():
    lay, g, loss = _calm_run(3000, seed=21)
    cols = StepColumns(step=np.arange(3000), grad_norm=g, loss=loss, layer_norms=lay)
    sd = StreamingDetector()  # no layer names: taken from the first row, as observe() does
    calls = []
    general = sd.detector._general
    sd.detector._general = lambda *a: (calls.append(1), general(*a))[1]
    assert all(a.level <= Level.INFO for _, a in sd.observe_columns(cols))
    assert sd.layer_names == tuple(f"layer{i}" for i in range(8))
    assert len(calls) < 100  # warm-up; ~3000 would mean the columns path never ran calm
    with pytest.raises(ValueError, match="layer_norms has shape"):
        StreamingDetector(layer_names=LAYERS[:5]).observe_columns(cols)


# -- robust baselines ---------------------------------------------------------------------------


def test_calm_noise_raises_nothing_and_scores_stay_low():
    lay, g, loss = _calm_run(3000, seed=3)
    sd = StreamingDetector(layer_names=LAYERS)
    alerts = [a for i in range(3000) for a in sd.observe(_obs(i, g[i], loss[i], lay[i]))]
    assert not [a for a in alerts if a.level >= Level.WARNING]
    assert sd.score < 4.0


def test_the_run_score_reads_the_runs_own_signals_not_one_of_many_layers():
    # 300 layers: one of them 4x its norm is a spike in the score (the metric) but not in the
    # run's own signals; the whole gradient 4x is both. The guard snapshots faster on the latter.
    names = [f"h.{i}" for i in range(300)]
    lay, g, loss = _calm_run(400, seed=5, layers=300)
    sd = StreamingDetector(layer_names=names)
    for i in range(400):
        sd.observe(_obs(i, g[i], loss[i], lay[i]))
    assert sd.run_score <= sd.score < 4.0
    one = lay[-1].copy()
    one[7] *= 4.0
    sd.observe(_obs(400, np.sqrt((one ** 2).sum()), loss[-1], one))
    spike_z = sd.detector.cfg.spike_z
    assert sd.score >= spike_z > sd.run_score
    every = lay[-1] * 4.0
    sd.observe(_obs(401, np.sqrt((every ** 2).sum()), loss[-1], every))
    assert sd.run_score >= spike_z
    sd.observe(_obs(402, float("nan"), float("nan"), np.full(300, np.nan)))
    assert sd.run_score == sd.score == 1000.0


def test_the_run_scores_python_maximum_is_numpys_fmax_of_the_ratios():
    # run_score takes the run's few channels in Python (numpy's reduction is dear on a step's cold
    # caches): the same divisions and maximum as np.fmax.reduce, NaN (absent) ignored
    from earlywarn.detect.work import _largest_ratio

    rng = np.random.default_rng(11)
    devs = [math.nan, 0.0, -0.0, math.inf, -math.inf, 1e-300, -3.5, 2.25]
    widths = [0.35, 1e-300, math.inf, 7.0, math.nan, 0.0]
    with np.errstate(all="ignore"):
        for _ in range(5000):
            n = int(rng.integers(1, 7))
            dev = [float(rng.normal(0, 3)) if rng.random() < 0.5 else devs[rng.integers(len(devs))] for _ in range(n)]
            width = [float(rng.uniform(0.05, 3)) if rng.random() < 0.7 else widths[rng.integers(len(widths))]
                     for _ in range(n)]
            want = float(np.fmax.reduce(np.divide(np.array(dev), np.array(width))))
            got = _largest_ratio(dev, width)
            assert got == want or (math.isnan(got) and math.isnan(want)), (dev, width)


def test_lr_warmup_that_lowers_the_norm_does_not_alarm():
    # the norm falls 30x over 600 steps (as in llm.c's first steps), noisy
    rng = np.random.default_rng(4)
    n = 600
    g = 15.0 * np.exp(-np.linspace(0, math.log(30), n) + rng.normal(0, 0.08, n))
    loss = 10.0 * np.exp(-np.linspace(0, 1.0, n) + rng.normal(0, 0.01, n))
    res = replay(observations_from_arrays(np.arange(n), g, loss))
    assert not res.at_least(Level.INFO)


def test_rounded_logger_mad_zero_does_not_make_every_blip_an_alarm():
    # a norm printed with two decimals: 0.27 for 300 steps (every deviation 0), then one quantum up
    g = np.r_[np.full(300, 0.27), 0.28, 0.27, 0.28, 0.28, 0.27, np.full(50, 0.27)]
    res = replay(observations_from_arrays(np.arange(len(g)), g, np.full(len(g), 3.0)))
    assert not res.alerts
    sd = StreamingDetector()
    for o in observations_from_arrays(np.arange(300), np.full(300, 0.27), np.full(300, 3.0)):
        sd.observe(o)
    assert sd.state.stats[1, 0] >= DetectorConfig().min_scale  # the scale floor holds


def test_spikes_skipped_and_nonfinite_steps_never_enter_the_baseline():
    lay, g, loss = _calm_run(300, seed=5)
    sd = StreamingDetector(layer_names=LAYERS)
    for i in range(300):
        sd.observe(_obs(i, g[i], loss[i], lay[i]))
    before = sd.baselines()
    sd.observe(_obs(300, g[0] * 50, loss[0], lay[0] * 50))  # a spike
    sd.observe(_obs(301, g[0] * 80, loss[0], lay[0] * 80, skipped=True))  # a skipped step
    bad = lay[0].copy()
    bad[2] = np.inf
    sd.observe(_obs(302, float("inf"), loss[0], bad))  # a non-finite gradient
    after = sd.baselines()
    for key in ("grad_norm", "grad_norm/h.0", "grad_norm/h.2"):
        assert after[key] == pytest.approx(before[key], rel=1e-12), key


def test_zero_norm_means_absent_not_a_collapse_of_the_baseline():
    lay, g, loss = _calm_run(200, seed=6)
    sd = StreamingDetector(layer_names=LAYERS)
    for i in range(200):
        sd.observe(_obs(i, g[i], loss[i], lay[i]))
    before = sd.baselines()["grad_norm/h.5"]
    frozen = lay[-1].copy()
    frozen[5] = 0.0  # a frozen layer / "not computed"
    for i in range(200, 260):
        alerts = sd.observe(_obs(i, g[-1], loss[-1], frozen))
        assert not [a for a in alerts if a.level >= Level.WARNING]
    assert sd.baselines()["grad_norm/h.5"] == pytest.approx(before)


# -- levels -------------------------------------------------------------------------------------


def test_isolated_spike_is_info_after_it_recovered():
    lay, g, loss = _calm_run(300, seed=7)
    sd = StreamingDetector(layer_names=LAYERS)
    alerts = []
    for i in range(300):
        spike = 7.0 if i == 250 else 1.0
        cur = lay[i].copy()
        if i == 250:
            cur[6] *= 10.0
            cur[1] *= 7.0
        alerts += sd.observe(_obs(i, g[i] * spike, loss[i], cur))
    assert [a.kind for a in alerts] == [Kind.GRAD_SPIKE]
    a = alerts[0]
    assert a.level == Level.INFO and a.step == 251 and a.values["peak_step"] == 250
    assert a.signal == "grad_norm" and a.layers[0] == "h.6"
    assert a.values["ratio"] == pytest.approx(7.0, rel=0.2)
    assert {"ratio", "value", "baseline"} <= set(a.values)


def test_escalation_is_a_warning_naming_the_layer_that_moved_first():
    obs = _escalating_run()
    res = replay(obs, layer_names=LAYERS)
    warn = res.first(Level.WARNING)
    assert warn.kind == Kind.COLLAPSE_RISK and warn.level == Level.WARNING
    assert warn.step <= 203  # third growing step
    assert warn.layers[0] == "h.3"
    assert {"ratio", "value", "baseline"} <= set(warn.values) and warn.values["ratio"] > 2
    assert warn.message.endswith(".") and "checkpoint" in warn.message
    # one warning per episode, then the criticals at the non-finite step
    assert len([a for a in res.alerts if a.kind == Kind.COLLAPSE_RISK]) == 1
    last = [a for a in res.alerts if a.step == 206]
    assert {a.kind for a in last} == {Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE}
    assert all(a.level == Level.CRITICAL for a in last)


def test_nonfinite_gradient_is_critical_and_names_the_first_layer_in_backward_order():
    lay, g, loss = _calm_run(50, seed=8)
    sd = StreamingDetector(layer_names=LAYERS)
    for i in range(50):
        sd.observe(_obs(i, g[i], loss[i], lay[i]))
    bad = lay[0].copy()
    bad[[2, 6]] = [np.nan, np.inf]
    flags = np.zeros(8)
    flags[[2, 6]] = 1
    alerts = sd.observe(_obs(50, float("nan"), loss[0], bad, layer_nonfinite=flags, skipped=True))
    (a,) = alerts
    assert a.kind == Kind.NONFINITE_GRAD and a.level == Level.CRITICAL and a.signal == "nonfinite"
    assert a.layers == ("h.2", "h.6") and a.values["steps"] == 1
    assert sd.score == 1000.0 and sd.level == Level.CRITICAL
    # flags alone (norms finite) are enough; the count of consecutive steps goes on
    (b,) = sd.observe(_obs(51, g[1], loss[1], lay[1], layer_nonfinite=flags))
    assert b.kind == Kind.NONFINITE_GRAD and b.values["steps"] == 2
    assert sd.observe(_obs(52, g[2], loss[2], lay[2])) == []
    assert sd.level == Level.NONE


def test_loss_nonfinite_and_diverged_are_critical_once_per_divergence():
    lay, g, loss = _calm_run(100, seed=9)
    sd = StreamingDetector(layer_names=LAYERS)
    for i in range(100):
        sd.observe(_obs(i, g[i], loss[i], lay[i]))
    n = DetectorConfig().loss_diverge_steps
    kinds = []
    factors = [2.0] * (n + 2) + [1.0, 1.0] + [2.0] * n + [1.0] + [2.0] * (n - 1)
    for i, factor in enumerate(factors):
        kinds += [(i, a.kind) for a in sd.observe(_obs(100 + i, g[0], loss[0] * factor, lay[0]))]
    # critical once per divergence, on its n-th step; a divergence one step short is not one
    assert [k for k in kinds if k[1] == Kind.LOSS_DIVERGED] == [(n - 1, Kind.LOSS_DIVERGED),
                                                               (n + 4 + n - 1, Kind.LOSS_DIVERGED)]
    (a,) = sd.observe(_obs(200, g[0], float("inf"), lay[0]))
    assert a.kind == Kind.LOSS_NONFINITE and a.level == Level.CRITICAL


def test_scaler_overflow_is_info_and_its_stale_values_stay_out():
    sd = StreamingDetector()
    rng = np.random.default_rng(10)
    for i in range(100):
        sd.observe(Observation(step=i, grad_norm=float(np.exp(rng.normal(0, 0.1))), loss=2.0,
                               extras={"loss_scale": 65536.0}))
    base = sd.baselines()["grad_norm"]
    # the tr8b-104B pattern: scale halves every step, the logged norm repeats (stale, and high)
    alerts = []
    scale = 65536.0
    for i in range(100, 108):
        scale /= 2
        alerts += sd.observe(Observation(step=i, grad_norm=5.0, loss=2.0, extras={"loss_scale": scale}))
    kinds = [a.kind for a in alerts]
    assert kinds[:7] == [Kind.SCALER_OVERFLOW] * 7
    assert all(a.level == Level.INFO for a in alerts if a.kind == Kind.SCALER_OVERFLOW)
    # eight overflows in a row: the scale is collapsing, that is critical
    crit = [a for a in alerts if a.level == Level.CRITICAL]
    assert len(crit) == 1 and crit[0].kind == Kind.NONFINITE_GRAD and crit[0].step == 107
    assert sd.baselines()["grad_norm"] == pytest.approx(base)
    # the live guard's pattern: non-finite grads with a scaler, the scale read drops a step later
    out = sd.observe(Observation(step=108, grad_norm=float("inf"), loss=2.0, skipped=True,
                                 extras={"loss_scale": scale}))
    assert [a.kind for a in out] == [Kind.SCALER_OVERFLOW]
    assert sd.observe(Observation(step=109, grad_norm=1.0, loss=2.0, extras={"loss_scale": scale / 2})) == []


def _together_run(rise_steps: int, g_rise: float, loss_rise: float, seed: int = 14, n_calm: int = 300,
                  tail: int = 0):
    """Calm, then ``rise_steps`` steps with the grad norm and the loss multiplied by growing
    factors, then (``tail`` steps) back to calm."""
    lay, g, loss = _calm_run(n_calm + rise_steps + tail, seed)
    obs = [_obs(i, g[i], loss[i], lay[i]) for i in range(n_calm)]
    for j in range(1, rise_steps + 1):
        i = n_calm + j - 1
        obs.append(_obs(i, g[i] * g_rise ** j, loss[i] * loss_rise ** j, lay[i] * g_rise ** j))
    for i in range(n_calm + rise_steps, n_calm + rise_steps + tail):
        obs.append(_obs(i, g[i], loss[i], lay[i]))
    return obs


def test_grad_norm_and_loss_rising_together_warn_before_the_loss_jumps():
    # grad norm +20% and loss +5% per step (both ~2 scales above baseline after two steps):
    # no single step is a spike, together they are the lead-up to a divergence
    obs = _together_run(6, 1.2, 1.05)
    res = replay(obs, layer_names=LAYERS)
    warn = res.first(Level.WARNING)
    assert warn is not None and warn.kind == Kind.COLLAPSE_RISK and warn.step <= 304
    assert "rising together" in warn.message and warn.signal == "grad_norm"
    cfg = DetectorConfig()
    assert warn.values["cusum"] >= cfg.no_lr_factor * cfg.drift_h  # no LR known: that threshold
    assert not [a for a in res.alerts if a.step < 300]


def test_grad_norm_plateau_with_a_flat_loss_does_not_warn():
    # the llm.c pattern: the grad norm at 1.5-2x for eight steps, the loss unmoved
    lay, g, loss = _calm_run(400, seed=15)
    obs = []
    for i in range(400):
        f = 1.8 if 300 <= i < 308 else 1.0
        obs.append(_obs(i, g[i] * f, loss[i], lay[i] * f))
    res = replay(obs, layer_names=LAYERS)
    assert not res.at_least(Level.WARNING)


def test_single_bad_batch_with_loss_and_grad_up_at_once_is_no_collapse_risk():
    lay, g, loss = _calm_run(400, seed=16)
    for f, kinds in ((6.0, [Kind.GRAD_SPIKE]), (40.0, [Kind.GRAD_OUTLIER])):
        obs = []
        for i in range(400):
            fg, fl = (f, 1.4) if i == 300 else (1.0, 1.0)
            obs.append(_obs(i, g[i] * fg, loss[i] * fl, lay[i] * fg))
        res = replay(obs, layer_names=LAYERS)
        # a 6x spike is reported when it is over; a 40x one is an outlier, at its own step (the
        # guard skips that update), and is not reported again when it is over
        assert [a.kind for a in res.alerts] == kinds, f
        if f == 40.0:
            out = res.alerts[0]
            assert out.step == 300 and out.level == Level.WARNING and out.values["steps"] == 1.0
            assert out.values["ratio"] == pytest.approx(40.0, rel=0.15) and out.values["loss_ratio"] < 1.5


def test_warnings_repeat_while_the_rise_goes_on_and_stop_when_it_recovers():
    cfg = DetectorConfig()
    obs = _together_run(40, 1.04, 1.012, tail=200)
    res = replay(obs, layer_names=LAYERS)
    warns = [a.step for a in res.alerts if a.kind == Kind.COLLAPSE_RISK]
    assert len(warns) >= 2
    assert all(b - a >= cfg.rearm_steps for a, b in zip(warns, warns[1:]))
    assert warns[-1] < 340  # nothing once the values are back to normal


# -- real runs ----------------------------------------------------------------------------------


def _llmc():
    rows = [r for r in csv.DictReader(open(DATA / "llmc_gpt2_124m" / "main.csv"))
            if r["grad_norm"] and r["train_loss"]]
    steps = np.array([int(r["step"]) for r in rows])
    return steps, np.array([float(r["grad_norm"]) for r in rows]), np.array([float(r["train_loss"]) for r in rows])


def test_llmc_healthy_run_raises_no_warning_and_reports_its_spikes_as_info():
    steps, g, loss = _llmc()
    assert len(steps) >= 19_560
    res = replay(observations_from_arrays(steps, g, loss))
    assert not res.at_least(Level.WARNING)
    peaks = {int(a.values["peak_step"]) for a in res.alerts if a.kind == Kind.GRAD_SPIKE}
    assert {4233, 4582, 7435, 9025, 9954} <= peaks
    assert all(a.level == Level.INFO for a in res.alerts)


def _bloom_block7():
    rows = [r for r in csv.DictReader(open(DATA / "bloom_chronicles" / "megatron_iteration_lines.csv"))
            if r["snippet"] == "tr11-176B-ml/chronicles.md#block7" and int(r["iteration"]) <= 31222]
    rows.sort(key=lambda r: int(r["iteration"]))
    return ([int(r["iteration"]) for r in rows], [float(r["grad_norm"]) for r in rows],
            [float(r["lm_loss"]) for r in rows])


def test_bloom_176b_warns_at_least_two_steps_before_the_loss_jump():
    steps, g, loss = _bloom_block7()
    assert steps[0] == 31214 and loss[steps.index(31219)] > 5
    res = replay(observations_from_arrays(steps, g, loss), baseline={"grad_norm": 0.2})
    warn = next((a for a in res.alerts if a.kind == Kind.COLLAPSE_RISK), None)
    assert warn is not None and warn.signal == "grad_norm"
    assert warn.step <= 31217 and 31219 - warn.step >= 2
    assert warn.values["ratio"] > 10 and warn.values["baseline"] == pytest.approx(0.2, rel=0.05)
    # the 80x step it warns at is an outlier too: read before its update, which the guard skips
    first = res.first(Level.WARNING)
    assert first.kind == Kind.GRAD_OUTLIER and first.step == 31217 and first.values["ratio"] > 20


def test_bloom_without_a_prior_baseline_stays_quiet_rather_than_guess():
    steps, g, loss = _bloom_block7()
    res = replay(observations_from_arrays(steps, g, loss))
    assert not res.at_least(Level.WARNING)  # five lines are not a baseline


def test_baseline_keys_are_validated():
    with pytest.raises(ValueError, match="not a signal"):
        Detector().init(LAYERS, {"gradnorm": 0.2})
    with pytest.raises(ValueError, match="finite number > 0"):
        Detector().init(LAYERS, {"grad_norm": 0.0})
    with pytest.raises(ValueError, match="finite number > 0"):
        Detector().init(LAYERS, {"loss": "abc"})
    # a loss may be negative by nature (an NLL): its channel takes an offset
    st = Detector().init(LAYERS, {"loss": -1.5})
    assert st.loss_shift > 0 and StreamingDetector(baseline={"loss": -1.5}).baselines()["loss"] == pytest.approx(-1.5)


# -- cost ---------------------------------------------------------------------------------------


def test_observe_updates_in_place_and_allocates_nothing_that_grows():
    lay, g, loss = _calm_run(6000, seed=11, layers=50)
    names = [f"l{i}" for i in range(50)]
    obs = [_obs(i, g[i], loss[i], lay[i]) for i in range(6000)]
    sd = StreamingDetector(layer_names=names)
    for o in obs[:1000]:
        sd.observe(o)
        sd.score
    tracemalloc.start()
    for o in obs[1000:2000]:
        sd.observe(o)
        sd.score
    mid, _ = tracemalloc.get_traced_memory()
    for o in obs[2000:6000]:
        sd.observe(o)
        sd.score
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert end - mid < 4_000  # bytes over 4,000 steps: less than one per step


def test_update_allocates_nothing_that_grows():
    lay, g, loss = _calm_run(3000, seed=11, layers=50)
    names = [f"l{i}" for i in range(50)]
    obs = [_obs(i, g[i], loss[i], lay[i]) for i in range(3000)]
    det = Detector()
    state = det.init(names)
    for o in obs[:500]:
        _, state = det.update(state, o)
    tracemalloc.start()
    for o in obs[500:1000]:
        _, state = det.update(state, o)
    mid, _ = tracemalloc.get_traced_memory()
    for o in obs[1000:3000]:
        _, state = det.update(state, o)
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert end - mid < 20_000  # bytes: one state's worth of slack, not per-step growth


def _rare_head_run(every: int, n: int = 400, seed: int = 3):
    """Layer 7 is a rarely sampled task's head: 0 (no gradient) except every ``every`` steps from
    step 100, where the whole gradient is 30x its typical norm (the task's loss is much larger)."""
    lay, g, loss = _calm_run(n, seed)
    lay[:, 7] = 0.0
    rare = list(range(100, n, every))
    for s in rare:
        lay[s] *= 30.0
        lay[s, 7] = 0.05 * 30.0
    g = np.sqrt((lay ** 2).sum(1))
    return [_obs(i, g[i], loss[i], lay[i]) for i in range(n)], rare


def test_an_outlier_where_an_idle_layer_trains_again_is_the_runs_own():
    """The steps of a rarely sampled task are outliers at which its idle head (absent for 3 steps or
    more) has a gradient again: ``joined``, the guard applies them. A layer back from one step at 0
    (dead units under a corrupt batch) does not count; the idle length survives a state round trip,
    and the calm path taking the step's set of layers first does not hide it."""
    obs, rare = _rare_head_run(every=20)
    sd = StreamingDetector(layer_names=LAYERS)
    out = [a for o in obs for a in sd.observe(o) if a.kind is Kind.GRAD_OUTLIER]
    assert [a.step for a in out] == rare
    assert all(a.values["joined"] == 1.0 and "trains only on some steps" in a.message for a in out)
    # every 6th step: the head matures after 20 of them, and from then on the calm path takes each
    # step's set of layers before the outlier sends the step to the general path
    obs6, rare6 = _rare_head_run(every=6, n=500)
    sd = StreamingDetector(layer_names=LAYERS)
    out = [a for o in obs6 for a in sd.observe(o) if a.kind is Kind.GRAD_OUTLIER]
    assert [a.step for a in out] == rare6 and all(a.values["joined"] == 1.0 for a in out)

    # resumed mid-run from a saved state: the same alerts, bit for bit
    whole = StreamingDetector(layer_names=LAYERS)
    want = _alerts_key([a for o in obs for a in whole.observe(o)])
    first = StreamingDetector(layer_names=LAYERS)
    got = [a for o in obs[:259] for a in first.observe(o)]  # the head idle since 241, back at 260
    second = StreamingDetector(layer_names=LAYERS)
    second.load_state_dict(json.loads(json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                                  for k, v in first.state_dict().items()})))
    got += [a for o in obs[259:] for a in second.observe(o)]
    assert _alerts_key(got) == want

    # the head at 0 for one step only, just before the outlier: not idle, the outlier is not joined
    lay, g, loss = _calm_run(300, seed=4)
    lay[199, 7] = 0.0
    lay[200] *= 30.0
    g = np.sqrt((lay ** 2).sum(1))
    sd = StreamingDetector(layer_names=LAYERS)
    out = [a for i in range(300) for a in sd.observe(_obs(i, g[i], loss[i], lay[i])) if a.kind is Kind.GRAD_OUTLIER]
    assert [a.step for a in out] == [200] and out[0].values["joined"] == 0.0
    assert "inflate the optimizer's moments" in out[0].message

    # inside a burst of corrupt batches (outliers since step 200) the head trains again at 204 (and
    # a frozen layer that never trained, at 208): the step before was already an outlier, so the
    # layers joining explain nothing -- not joined. The burst's first step, where the head is back, is.
    for back, first in ((204, 200), (200, 200)):
        lay, g, loss = _calm_run(300, seed=5)
        lay[:, 7] = 0.0
        lay[150:160, 7] = 0.05  # the head trained once, then went idle
        lay[:, 6] = 0.0  # a frozen layer
        lay[first:first + 10] *= 60.0
        lay[back, 7] = 0.05 * 60.0
        lay[208, 6] = 0.05 * 60.0
        g = np.sqrt((lay ** 2).sum(1))
        sd = StreamingDetector(layer_names=LAYERS)
        out = {a.step: a for i in range(300) for a in sd.observe(_obs(i, g[i], loss[i], lay[i]))
               if a.kind is Kind.GRAD_OUTLIER}
        assert sorted(out)[:10] == list(range(first, first + 10))
        assert {s for s, a in out.items() if a.values["joined"]} == ({200} if back == first else set())
