"""Calm steps (issue 47): a step inside the detector's bands is applied on a test of its vector;
the detector, the policy and the trackers get it later, in order, exactly as at once."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys

import numpy as np
import pytest
import torch
from torch import nn

import earlywarn
from earlywarn.detect import StreamingDetector
from earlywarn.guard import calmstep
from earlywarn.sinks.base import Sink

from detector_bands import random_runs, replay_both
from detector_golden import GOLDEN, cases

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
torch.set_num_threads(1)


# -- the detector: bands are conservative --------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _golden() -> dict:
    return cases()


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_the_golden_replays_keep_their_calm_steps_and_nothing_else(name):
    cols, names, baseline = _golden()[name]
    got = replay_both([cols.observation(i) for i in range(len(cols))], names, baseline=baseline)
    if got["rows"] > 1000:
        assert got["kept"] > 0.9 * got["rows"], got  # the long runs are calm almost throughout


@pytest.mark.parametrize("seed", range(4))
def test_random_runs_where_every_rule_fires_keep_only_calm_steps(seed):
    # spikes, escalations, the together rise, divergences, non-finite steps, LR warm-ups, pulses
    # and climbs, layers at 0, an expert on and off, steps far below, negative losses, user
    # signals, a loss scale that drops, under three detector configurations (more rules on in
    # one): a rule that can fire inside the bands -- a new rule without a band -- fails here
    kept = rows = 0
    for name, obs, names, cfg in random_runs(15, seed):
        got = replay_both(obs, names, cfg=cfg)
        kept, rows = kept + got["kept"], rows + got["rows"]
    assert kept > 0.5 * rows, (kept, rows)


def test_a_value_far_below_its_baseline_is_kept_and_ends_the_bands():
    sd = StreamingDetector(layer_names=["a", "b"])
    rng = np.random.default_rng(0)
    for t in range(200):
        sd.observe(earlywarn.detect.Observation(step=t, grad_norm=float(np.exp(rng.normal(0, 0.1))),
                                                layer_norms=np.exp(rng.normal(0, 0.1, 2)), loss=1.0,
                                                extras={"lr": 1e-3}))
    b = sd.bands(16)
    assert b is not None and b.window == 16
    assert b.take([1.0, 1.0], 1.0, 1.0, (), 1e-3, None) and b.window == 16
    assert b.take([1e-8, 1.0], 1.0, 1.0, (), 1e-3, None)  # nothing fires on a low value
    assert b.window == b.taken == 2  # ... but the bands assumed a floor for the steps after it
    assert not b.take([1.0, 1.0], 1.0, 1.0, (), 1e-3, None)
    b = sd.bands(16)
    assert not b.take([0.0, 1.0], 1.0, 1.0, (), 1e-3, None)  # a layer present before, at 0: judged
    assert not b.take([1.0, 1.0], 1.0, 1.0, (), 1e-2, None)  # an LR jump: judged
    assert not b.take([1e4, 1.0], 1.0, 1.0, (), 1e-3, None)  # a spike: judged
    assert not b.take([1.0, 1.0], math.nan, 1.0, (), 1e-3, None)
    assert b.taken == 0


# -- the guard: the same run, calm steps on or off --------------------------------------------------

class _Rows(Sink):
    name = "rows"

    def __init__(self) -> None:
        self.rows: list = []
        self.events: list = []
        self.order: list = []

    def log_metrics(self, step, metrics):
        self.rows.append((step, dict(metrics)))
        self.order.append(("row", step))

    def alert(self, event):
        self.events.append((event.step, str(event.kind), event.message))
        self.order.append(("event", event.step))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def _train(window: int, steps: int = 200, *, fault_at: int | None = 160, spike_at: int | None = 120,
           save_at: int | None = None, monkeypatch=None, **options):
    monkeypatch.setattr(calmstep, "WINDOW", window)
    torch.manual_seed(0)
    model = _MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sink = _Rows()
    ew = earlywarn.watch(model, opt, sinks=[sink], **options)
    g = torch.Generator().manual_seed(1)
    saved = None
    for i in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True)
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - y).pow(2).mean()
        if i == spike_at:
            loss = loss * 1e4  # an outlier gradient: taken bounded
        ew.report_loss(loss)
        loss.backward()
        if i == fault_at:
            model.hidden.weight.grad[0, 0] = float("nan")  # a bad batch: skipped, quarantined
        opt.step()
        if i == save_at:
            saved = ew.state_dict()
    state = ew.state_dict()
    ew.close()
    norm = lambda m: re.sub(r"\S*quarantine\.jsonl", "<quarantine>", m)  # noqa: E731
    return {"events": [(s, k, norm(m)) for s, k, m in sink.events], "rows": sink.rows, "order": sink.order,
            "params": [p.detach().clone() for p in model.parameters()], "state": state, "saved": saved,
            "counters": dict(ew.counters)}


def _same_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_tree(x, y)
    else:
        assert a == b or (a != a and b != b), (a, b)


def test_a_watched_run_is_the_same_with_calm_steps_kept_or_observed_at_once(monkeypatch):
    kept = []
    real = calmstep.CalmSteps.take
    monkeypatch.setattr(calmstep.CalmSteps, "take", lambda self, *a: kept.append(real(self, *a)) or kept[-1])
    on = _train(calmstep.WINDOW, save_at=90, monkeypatch=monkeypatch)
    assert sum(kept) > 100  # most steps were calm
    kept.clear()
    off = _train(0, save_at=90, monkeypatch=monkeypatch)
    assert not any(kept)
    assert on["events"] == off["events"] and any(k == "skip" for _, k, _ in on["events"])
    assert any(k == "clip" for _, k, _ in on["events"])
    assert on["counters"] == off["counters"] and on["counters"]["skipped_steps"] == 1
    for a, b in zip(on["params"], off["params"]):
        assert torch.equal(a, b)
    _same_tree(on["state"], off["state"])
    _same_tree(on["saved"], off["saved"])  # state_dict() mid-run: every calm step folded in first
    # every row, each with its own step, in order; an event never comes before the rows of the steps before it
    assert [s for s, _ in on["rows"]] == [s for s, _ in off["rows"]] == list(range(200))
    for (s, a), (_, b) in zip(on["rows"], off["rows"]):
        assert a.keys() == b.keys() and all(a[k] == b[k] or a[k] != a[k] and b[k] != b[k] for k in a), s
    assert on["order"] == off["order"]


def test_a_dry_run_is_the_same_with_calm_steps_kept_or_observed_at_once(monkeypatch):
    on = _train(calmstep.WINDOW, monkeypatch=monkeypatch, dry_run=True)
    off = _train(0, monkeypatch=monkeypatch, dry_run=True)
    assert on["events"] == off["events"] and any("dry run" in m for _, _, m in on["events"])
    assert on["counters"] == off["counters"] and on["order"] == off["order"]
    _same_tree(on["params"], off["params"])  # (the NaN of step 160 applied: a dry run acts on nothing)
    _same_tree(on["state"], off["state"])


def test_a_policy_a_calm_step_leaves_watching_has_the_next_step_judged(monkeypatch):
    # a policy can start watching after a calm step with no alert (the LR creeping up past the
    # rates the run trained at): the next step must reach Policy.decide exactly as when every
    # step is observed at once, even in the middle of a window of kept steps
    from earlywarn.policy import Policy

    watching = Policy.watching.fget
    ticks = {37, 38, 70, 101, 150, 151, 152, 190}
    monkeypatch.setattr(Policy, "watching", property(lambda self: watching(self) or self.tick in ticks))
    decided: list[int] = []
    decide = Policy.decide

    def spy(self, *a, **k):
        decided.append(self.tick)
        return decide(self, *a, **k)

    monkeypatch.setattr(Policy, "decide", spy)
    runs = []
    for window in (calmstep.WINDOW, 0):
        decided.clear()
        runs.append((_train(window, monkeypatch=monkeypatch), list(decided)))
    (on, on_ticks), (off, off_ticks) = runs
    assert on_ticks == off_ticks and ticks <= set(on_ticks)
    assert on["events"] == off["events"] and on["order"] == off["order"]
    _same_tree(on["state"], off["state"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nonfinite_grad", "bad_batch", "poisoned_state", "huge_grad", "burst",
                                    "bad_shard", "lr_pulse", "lr_climb", "loss_scale", "pool_switch",
                                    "heavy_reward", "gauss_nll"])
def test_a_rescue_family_run_is_the_same_with_calm_steps_kept_or_observed_at_once(family, monkeypatch):
    # the families where earlywarn acts (skips, repairs, rewinds, holds the LR): the run,
    # its events and its result as with every step observed at once
    from rescue_families import FAMILIES
    from rescue_harness import run_one

    cfg = min(FAMILIES[family].configs(0, 4),
              key=lambda c: c["steps"] * (4 if c["task"]["name"] == "chargpt" else 1) * c["accum"])
    got = {}
    for window in (calmstep.WINDOW, 0):
        monkeypatch.setattr(calmstep, "WINDOW", window)
        res = run_one(cfg, "earlywarn")
        assert res["error"] is None, res["error"]
        res.pop("wall_s")
        for e in res["events"]:
            e["message"] = re.sub(r"\S*quarantine\.jsonl", "<quarantine>", e["message"])
        got[window] = res
    assert got[calmstep.WINDOW] == got[0]
