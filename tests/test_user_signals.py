"""A user's own per-step scalar (``ew.report(name, value)``, issue 14 item 1): a run-level signal of
the detector (its spikes info, its escalation, sustained rise or NaN a warning naming it), the same
in the calm, general and column paths, carried in the guard's one statistics vector, logged as
``earlywarn/user/<name>`` and read back offline under that name."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest

from earlywarn.detect import Detector, DetectorConfig, Observation, StreamingDetector
from earlywarn.detect.observation import StepColumns
from earlywarn.events import Kind, Level

from detector_paths import replay_three_ways


def _run(T: int = 1200, seed: int = 0, user: np.ndarray | None = None, known: np.ndarray | None = None):
    rng = np.random.default_rng(seed)
    g = np.exp(rng.normal(0, 0.1, T))
    loss = 2.0 * np.exp(rng.normal(0, 0.02, T))
    a = 10.0 * np.exp(rng.normal(0, 0.03, T)) if user is None else user
    return StepColumns(step=np.arange(T), grad_norm=g, loss=loss, extras={"user/attn": (a, known)})


def _alerts(cols: StepColumns, cfg: DetectorConfig | None = None):
    sd = StreamingDetector(cfg)
    return [(i, e) for i, e in sd.observe_columns(cols)], sd


def test_a_calm_user_signal_raises_nothing_and_gets_a_channel_and_a_baseline():
    alerts, sd = _alerts(_run())
    assert not alerts
    assert sd.user_names == ("user/attn",) and sd.layer_names == ()
    assert sd.baselines()["user/attn"] == pytest.approx(10.0, rel=0.05)


def test_an_escalating_user_signal_warns_naming_it_and_an_isolated_spike_is_info():
    cols = _run()
    a = cols.extras["user/attn"][0]
    a[400] *= 6.0  # one step, back at once
    a[800:806] *= np.array([2, 4, 8, 16, 32, 64])
    alerts, _ = _alerts(cols)
    spike = [(i, e) for i, e in alerts if e.kind == Kind.GRAD_SPIKE]
    assert [(i, e.level, e.signal) for i, e in spike] == [(401, Level.INFO, "user/attn")]
    assert "Isolated user/attn spike at step 400" in spike[0][1].message
    warn = [(i, e) for i, e in alerts if e.level == Level.WARNING]
    assert warn and warn[0][0] == 802 and warn[0][1].signal == "user/attn"
    assert "user/attn is escalating" in warn[0][1].message and warn[0][1].kind == Kind.COLLAPSE_RISK


@pytest.mark.parametrize("rate,warned", [(0.005, False), (0.05, True)])
def test_a_sustained_rise_of_a_user_signal_warns_once_it_is_fast_enough(rate, warned):
    cols = _run()
    a = cols.extras["user/attn"][0]
    a[600:] *= np.exp(rate * np.arange(600))
    alerts, _ = _alerts(cols)
    warn = [(i, e) for i, e in alerts if e.level >= Level.WARNING]
    assert bool(warn) == warned
    if warned:
        i, e = warn[0]
        assert 600 < i < 640 and e.signal == "user/attn" and "has been rising for several steps" in e.message
        assert e.values["cusum"] >= DetectorConfig().user_alone_h
    alerts, _ = _alerts(cols, DetectorConfig(user_alone_h=float("inf")))  # the rule off: no warning
    assert not [e for _, e in alerts if e.level >= Level.WARNING and "rising" in e.message]


def test_a_non_finite_user_value_warns_and_values_at_or_below_zero_are_not_tracked():
    cols = _run()
    a = cols.extras["user/attn"][0]
    a[500] = np.nan
    a[700:720] = 0.0
    a[900] = -3.0
    alerts, sd = _alerts(cols)
    assert [(i, e.level, e.signal) for i, e in alerts] == [(500, Level.WARNING, "user/attn")]
    assert "user/attn is NaN at step 500" in alerts[0][1].message
    assert not [e for _, e in alerts if e.level == Level.CRITICAL]  # the run itself is fine
    assert sd.baselines()["user/attn"] == pytest.approx(10.0, rel=0.05)


def test_a_prior_baseline_makes_a_user_signal_warm_at_once():
    sd = StreamingDetector(baseline={"user/attn": 10.0, "grad_norm": 1.0, "loss": 2.0})
    assert sd.user_names == ("user/attn",)
    seen = []
    for i, v in enumerate([10.0, 21.0, 43.0, 90.0]):
        seen += sd.observe(Observation(step=i, grad_norm=1.0, loss=2.0, extras={"user/attn": v}))
    assert [e.signal for e in seen if e.level == Level.WARNING] == ["user/attn"]


def _mixed_user_columns(T: int = 5200, seed: int = 4) -> StepColumns:
    """User signals that appear mid-run (one inside a chunk of observe_columns), come and go, are
    NaN, 0 and negative, spike and escalate, next to layers, an LR and a spiky gradient."""
    rng = np.random.default_rng(seed)
    t = np.arange(T)
    lay = np.exp(rng.normal(-2, 0.1, (T, 3)))
    lay[3100:3106] *= np.array([2, 4, 8, 16, 32, 64])[:, None]
    g = np.sqrt((lay ** 2).sum(1))
    loss = 2.0 * np.exp(rng.normal(0, 0.02, T))
    a = 10.0 * np.exp(rng.normal(0, 0.03, T))
    a[2000], a[2500], a[2600] = np.nan, 0.0, -1.0
    a[3000] *= 5
    a[3300:3306] *= np.array([2, 4, 8, 16, 32, 64])
    a[4000:4300] *= np.exp(np.linspace(0, 6, 300))
    ak = t >= 300
    ak[1500:1700] = False  # absent for a while
    ak[::13] = False
    b = np.exp(rng.normal(0, 0.05, T))
    bk = (t >= 1000) & (t < 1500)
    c = np.exp(rng.normal(1, 0.05, T))
    ck = t >= 4500  # first known inside a chunk (4096 + 404)
    lr = np.where(t < 200, 1e-3 * (t + 1) / 200, 1e-3)
    return StepColumns(step=t, grad_norm=g, loss=loss, layer_norms=lay,
                       extras={"lr": (lr, None), "user/attn": (a, ak), "user/b": (b, bk), "user/c": (c, ck)})


@pytest.mark.parametrize("cuts", [(0, 5200), (0, 999, 2001, 4100, 4501, 5200)])
def test_calm_general_and_columns_paths_agree_bit_for_bit_with_user_signals(cuts):
    names = ["x", "y", "z"]
    rows, alerts = replay_three_ways(_mixed_user_columns(), names, cuts)
    assert rows.user_names == ("user/attn", "user/b", "user/c") and rows.layer_names == tuple(names)
    msgs = " | ".join(m for _, m in alerts)
    for what in ("user/attn is NaN", "Isolated user/attn spike", "user/attn is escalating",
                 "user/attn has been rising", "grad_norm is escalating"):
        assert what in msgs, what


@pytest.mark.parametrize("cut", [700, 1200, 3302, 4600])
def test_state_round_trip_and_the_pure_update_keep_user_signals(cut):
    cols = _mixed_user_columns(T=4800)
    names = ["x", "y", "z"]
    whole = StreamingDetector(layer_names=names)
    expected = [(i, e.message) for i, e in whole.observe_columns(cols)]
    first = StreamingDetector(layer_names=names)
    got = [(i, e.message) for i, e in first.observe_columns(cols, 0, cut)]
    second = StreamingDetector(layer_names=names)
    second.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    got += [(i, e.message) for i, e in second.observe_columns(cols, cut)]
    assert got == expected
    np.testing.assert_array_equal(second.state.stats, whole.state.stats)
    # the pure pair gives a user signal its channel the same way
    det = Detector()
    state = det.init(names)
    pure = []
    for i in range(cut):
        alerts, state = det.update(state, cols.observation(i))
        pure += [(i, e.message) for e in alerts]
    assert pure == [x for x in expected if x[0] < cut]
    np.testing.assert_array_equal(state.stats, first.state.stats)


# -- live: the guard ---------------------------------------------------------------------------


def _train(ew, model, opt, steps: int, user=None, every: int = 1):
    import torch

    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for i in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        ew.report_loss(loss)
        if user is not None and i % every == 0:
            ew.report("out/max", user(i, out))
        loss.backward()
        opt.step()


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_report_warns_live_logs_earlywarn_user_and_analyze_reads_it_back(tmp_path):
    torch = pytest.importorskip("torch")
    import earlywarn
    from earlywarn.analyze import analyze
    from fixtures_models import MLP

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = tmp_path / "run.jsonl"
    ew = earlywarn.watch(model, opt, sinks=["jsonl"], sink_options={"jsonl": {"path": str(log), "metrics": True}})

    def signal(i, out):  # a device tensor that explodes from step 150 on (a float at step 10)
        v = out.detach().abs().amax()
        return 3.0 if i == 10 else v * 2.0 ** max(0, i - 149)

    _train(ew, model, opt, 170, signal)
    ew.close()
    live = [(e.step, e.signal, e.message) for e in ew.events if e.kind == Kind.COLLAPSE_RISK]
    assert live and live[0][1] == "user/out/max" and live[0][0] == 152
    assert "user/out/max is escalating" in live[0][2]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    metric_rows = [r for r in rows if r.get("type") == "metrics"]
    assert len(metric_rows) == 170 and all("earlywarn/user/out/max" in r for r in metric_rows)
    assert metric_rows[10]["earlywarn/user/out/max"] == 3.0
    # offline: the logged column is the same signal, and the replay raises the same warnings
    report = analyze([str(log)])
    off = [(a.step, a.signal, a.message) for a in report.runs[0].alerts if a.kind == Kind.COLLAPSE_RISK]
    assert off == live


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_report_keeps_the_tensor_on_the_device_and_averages_micro_batches():
    torch = pytest.importorskip("torch")
    import earlywarn
    from fixtures_models import MLP
    from test_guard import HostReads

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    seen = []
    ew = earlywarn.watch(model, opt, sinks=[])
    observe = ew.detector.observe
    ew.detector.observe = lambda o: (seen.append(o), observe(o))[1]
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        with HostReads() as reads:
            ew.report_loss(loss)
            ew.report("a", torch.tensor(2.0 + step))
            ew.report("a", torch.tensor(4.0 + step))  # two micro-batches: their mean
            if step != 2:
                ew.report("b", 7.0)
            opt.step()
        assert reads.count <= 1  # the step's one batched read, user signals included
    ew.close()
    assert [o.extras.get("user/a") for o in seen] == [3.0, 4.0, 5.0, 6.0]
    assert [o.extras.get("user/b") for o in seen] == [7.0, 7.0, None, 7.0]  # not reported: absent
    assert ew.detector.user_names == ("user/a", "user/b")


def test_report_bad_input_names_the_problem():
    torch = pytest.importorskip("torch")
    import earlywarn
    from fixtures_models import MLP

    model = MLP()
    ew = earlywarn.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), sinks=[])
    try:
        with pytest.raises(ValueError, match="non-empty name"):
            ew.report("  ", 1.0)
        with pytest.raises(ValueError, match="scalar value.*reduce it first"):
            ew.report("x", torch.ones(3))
        with pytest.raises(TypeError, match="scalar tensor or a float"):
            ew.report("x", "1.0")
    finally:
        ew.close()


def test_the_metric_key_is_earlywarn_user_name():
    from earlywarn.metrics import build_metrics

    m = build_metrics(3, grad_norm=1.0, loss=2.0, layer_names=None, layer_norms=None, score=0.0, level=0,
                      counters={}, user={"attn max": 4.0, "a/b": float("nan")})
    assert m["earlywarn/user/attn max"] == 4.0 and math.isnan(m["earlywarn/user/a/b"])


# -- torch.distributed: the user signal rides in the one all-reduce ----------------------------


def _ddp_worker(rank: int, port: int, tmp: str) -> None:
    import datetime
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import earlywarn
    from earlywarn.recover import RecoveryConfig
    from fixtures_models import MLP
    from test_distributed import Collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        torch.manual_seed(0)
        ddp = DDP(MLP())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ew = earlywarn.watch(ddp, opt, sinks=[],
                             recovery=RecoveryConfig(quarantine_path=f"{tmp}/q{rank}.jsonl"))
        seen = []
        observe = ew.detector.observe
        ew.detector.observe = lambda o: (seen.append(o), observe(o))[1]
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        collectives = []
        for step in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            ew.report_loss(loss)
            ew.report("rank_value", torch.tensor(1.0 + 2.0 * rank + step))  # 1, 3 -> mean 2 (+ step)
            with Collectives() as c:
                opt.step()
            collectives.append(len(c.ops))
        out = {"user": [o.extras.get("user/rank_value") for o in seen], "collectives": collectives}
        ew.close()
    except Exception:
        import traceback

        out = {"error": traceback.format_exc()}
    finally:
        torch.save(out, f"{tmp}/rank{rank}.pt")
        dist.barrier()  # neither rank tears the group down while the other still talks to it
        dist.destroy_process_group()


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_under_ddp_a_user_signal_is_averaged_over_ranks_in_the_one_all_reduce(tmp_path):
    torch = pytest.importorskip("torch")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        assert "error" not in r, r.get("error")
        assert r["user"] == [2.0, 3.0, 4.0]  # the same mean on both ranks
        # still one all-reduce of the statistics vector per step (step 0's default snapshot
        # agrees its state scan over ranks in one more, as without user signals)
        assert r["collectives"] == [2, 1, 1]
