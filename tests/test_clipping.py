"""The loop's own clip_grad_norm_: earlywarn reads the gradients as they were before the clip."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_  # bound before any watch(): must be seen all the same

import earlywarn
from earlywarn.capture import clipping
from earlywarn.events import Kind

torch.set_num_threads(1)


def model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def layer_norms(model: nn.Module) -> list[float]:
    out = []
    for m in model:
        ps = [p for p in m.parameters() if p.grad is not None]
        if ps:
            out.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps]))))
    return out


def watched(model, opt):
    ew = earlywarn.watch(model, opt, sinks=[])
    seen = []
    observe = ew.detector.observe
    ew.detector.observe = lambda obs: (seen.append(obs), observe(obs))[1]
    return ew, seen


def by_layer(ew, obs) -> dict[str, float]:
    return dict(zip(ew.layer_names, obs.layer_norms.tolist()))


@pytest.mark.parametrize("how", ["clip_grad_norm_", "imported_by_name", "two_step_api"])
def test_the_statistics_are_the_raw_gradients_whatever_way_the_loop_clips(how):
    model, opt = model_and_opt()
    ew, seen = watched(model, opt)
    raw_total, raw_layers = [], []
    for x, y in batches(5):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        raw_layers.append(dict(zip(["0", "2", "4"], layer_norms(model))))
        raw_total.append(math.sqrt(sum(v * v for v in raw_layers[-1].values())))
        if how == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        elif how == "imported_by_name":
            clip_grad_norm_(model.parameters(), 1e-3)
        else:
            grads = [p.grad for p in model.parameters()]
            total = torch.nn.utils.get_total_norm(grads)
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1e-3, total)
        assert math.sqrt(sum(v * v for v in layer_norms(model))) == pytest.approx(1e-3, rel=1e-3)  # clipped
        opt.step()
    assert [o.grad_norm for o in seen] == pytest.approx(raw_total, rel=1e-5)
    for obs, want in zip(seen, raw_layers):
        assert by_layer(ew, obs) == pytest.approx(want, rel=1e-5)
    ew.close()


def test_a_clip_of_an_earlier_step_or_of_some_parameters_only_is_not_undone():
    model, opt = model_and_opt()
    ew, seen = watched(model, opt)
    data = batches(3)
    expected = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 0:
            clip_grad_norm_(model.parameters(), 1e-3)  # undone at step 0 ...
            expected.append(None)
        elif i == 1:
            pass  # ... never at step 1, which did not clip (the record is stale: new gradients)
        else:
            clip_grad_norm_(model[0].parameters(), 1e-3)  # one layer: not the watcher's factor
        norms = layer_norms(model)
        if i:
            expected.append(math.sqrt(sum(v * v for v in norms)))
        opt.step()
    assert seen[1].grad_norm == pytest.approx(expected[1], rel=1e-6)
    assert seen[2].grad_norm == pytest.approx(expected[2], rel=1e-6)  # as clipped: what the step reads
    ew.close()


def test_a_clip_after_the_statistics_were_taken_is_never_applied_to_the_next_step():
    # decide_step() before the clip (what the Lightning callback does): the clip that follows must
    # not be carried into the next step's statistics
    model, opt = model_and_opt()
    ew, seen = watched(model, opt)
    raw = []
    for x, y in batches(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        raw.append(math.sqrt(sum(v * v for v in layer_norms(model))))
        pending = ew.decide_step()
        clip_grad_norm_(model.parameters(), 1e-3)
        ew.apply_step(pending)
    assert [o.grad_norm for o in seen] == pytest.approx(raw, rel=1e-5)
    ew.close()


def test_an_inf_gradient_under_a_clip_names_its_own_layer_only():
    # the clip's factor is 0 (total norm inf): finite gradients become 0, the inf becomes NaN
    model, opt = model_and_opt()
    ew, _ = watched(model, opt)
    for i, (x, y) in enumerate(batches(4)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 2:
            model[2].weight.grad[0, 0] = math.inf
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert ew.counters["skipped_steps"] == 1 and ew.counters["nonfinite_steps"] == 1
    grad_events = [e for e in ew.events if e.kind is Kind.NONFINITE_GRAD]
    assert len(grad_events) == 1 and "first in 2;" in grad_events[0].message
    assert grad_events[0].values["nonfinite_layers"] == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ew.close()


def run_with_a_spike_under_a_tight_clip(undo: bool, monkeypatch) -> list:
    if not undo:
        monkeypatch.setattr(clipping.ClipObserver, "take", lambda self, device, dtype: None)
    model, opt = model_and_opt(seed=1)
    ew = earlywarn.watch(model, opt, sinks=[])
    for i, (x, y) in enumerate(batches(90, seed=1)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 80:
            for p in model[2].parameters():
                p.grad.mul_(200.0)  # one layer's gradient spikes 200x
        clip_grad_norm_(model.parameters(), 0.01)  # below every step's norm: each one is clipped to 0.01
        opt.step()
    # (an isolated spike is reported the step after, once it is known to be back to normal)
    events = [e for e in ew.events if e.kind is Kind.GRAD_OUTLIER and e.message.startswith("Outlier gradient at step 80")]
    ew.close()
    return events


def test_a_spike_that_the_clip_flattens_is_seen_as_it_was(monkeypatch):
    seen = run_with_a_spike_under_a_tight_clip(True, monkeypatch)
    assert seen, "the spike under the clip was not seen"
    assert "is 123x its typical" in seen[0].message and seen[0].layers[0] == "2"
    # the control: read clipped, every step's total norm is 0.01 and the total shows no spike (the
    # spiking layer's share of it still does: the per-layer signals see the shape, not the size)
    assert run_with_a_spike_under_a_tight_clip(False, monkeypatch) == []


def test_a_closed_watcher_no_longer_follows_the_clip():
    model, opt = model_and_opt()
    ew = earlywarn.watch(model, opt, sinks=[])
    obs = ew.statistics.clipping
    ew.close()
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    clip_grad_norm_(model.parameters(), 1e-3)
    assert obs._record is None and obs not in clipping._observers


def test_the_clip_and_the_watcher_share_one_norm_pass_and_the_clip_stays_torchs_bit_for_bit():
    model, opt = model_and_opt()
    twin, twin_opt = model_and_opt()  # the same run, read by no watcher: torch's own clip
    ew, seen = watched(model, opt)
    stats = ew.statistics.stats
    raw = []
    for x, y in batches(4):
        for m in (model, twin):
            m.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        raw.append(math.sqrt(sum(v * v for v in layer_norms(model))))
        assert torch.equal(clip_grad_norm_(model.parameters(), 1e-3), clip_grad_norm_(twin.parameters(), 1e-3))
        opt.step()
        twin_opt.step()
        assert stats.last_shared  # the statistics took the clip's per-tensor norms: no pass of their own
    assert [o.grad_norm for o in seen] == pytest.approx(raw, rel=1e-6)
    # a gradient written after the clip: its norms are stale, the statistics take their own
    x, y = batches(1, seed=3)[0]
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    total = float(clip_grad_norm_(model.parameters(), 1e-3))
    model[2].weight.grad.mul_(1e6)
    coef = min(1.0, 1e-3 / (total + 1e-6))
    want = math.sqrt(sum(v * v for v in layer_norms(model))) / coef  # as written, unclipped
    opt.step()
    assert not stats.last_shared and seen[-1].grad_norm == pytest.approx(want, rel=1e-4)
    ew.close()


def test_the_shared_norm_pass_is_torchs_own_computation():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g, dtype=torch.float64),
               torch.randn(4, 4, generator=g).bfloat16(), torch.randn(2, generator=g), torch.randn(0)]
    total, norms = clipping._norms_as_torch_takes_them(tensors, 2.0, None)
    assert torch.equal(total, clipping._original_norm(tensors, 2.0))
    for t, n in zip(tensors, norms):
        assert torch.equal(n, torch.linalg.vector_norm(t))
    assert clipping._norms_as_torch_takes_them(tensors, 1.0, None) is None  # other norms: torch's path
