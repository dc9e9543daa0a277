"""The gradient guard: statistics on the device, skip before the moments are written, one line."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import earlywarn
from earlywarn.guard import _is_watched_step
from earlywarn.events import Kind
from fixtures_models import MLP

torch.set_num_threads(1)


OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]


def inject_inf(model: MLP) -> None:
    # One inf in one coordinate of one gradient: the seed's fault.
    model.hidden.weight.grad[3, 5] = float("inf")


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[dict]]:
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in model.parameters()]
    return params, state


def assert_bit_identical(a, b) -> None:
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for sa, sb in zip(a[1], b[1]):
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert torch.equal(sa[k], sb[k]), k
            else:
                assert sa[k] == sb[k], k


def all_finite(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_without_earlywarn_one_inf_poisons_the_run():
    # The failure we exist for: loss fine at t, NaN at t+1, every parameter NaN soon after.
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i, (x, y) in enumerate(batches(6)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        if i == 2:
            inject_inf(model)
        opt.step()
    assert all(math.isfinite(v) for v in losses[:3])
    assert math.isnan(losses[3])
    assert all(bool(torch.isnan(p).all()) for p in model.parameters())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skip_leaves_params_and_state_bit_identical(name):
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS[name](model.parameters())
    ew = earlywarn.watch(model, opt, sinks=[])
    for i, (x, y) in enumerate(batches(8)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == 4:
            inject_inf(model)
            before = snapshot(model, opt)
            opt.step()
            assert_bit_identical(before, snapshot(model, opt))
        else:
            opt.step()
        assert all_finite(model, opt)
    skips = [e for e in ew.events if e.kind is Kind.SKIP]
    assert len(skips) == 1 and skips[0].step == 4
    assert skips[0].layers[0] == "hidden"  # first non-finite layer in backward order
    assert _is_watched_step(opt.__dict__["step"])
    ew.close()


def test_gradscaler_run_skips_and_still_observes_overflow_steps():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ew = earlywarn.watch(model, opt, scaler=scaler, sinks=[])
    for i, (x, y) in enumerate(batches(6)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        scaler.scale(loss).backward()
        if i == 3:
            inject_inf(model)
            before = snapshot(model, opt)
        scaler.step(opt)
        scaler.update()
        if i == 3:
            assert_bit_identical(before, snapshot(model, opt))
    # The scaler never called optimizer.step() at step 3, yet every step was observed.
    assert ew.step == 6
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [3]
    assert all_finite(model, opt)
    ew.close()


def test_gradscaler_with_fused_adamw_sees_unscaled_norms():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ew = earlywarn.watch(model, opt, scaler=scaler, sinks=[])
    seen = []
    orig = ew.detector.observe
    ew.detector.observe = lambda obs: (seen.append(obs), orig(obs))[1]
    x, y = batches(1)[0]
    nn.functional.mse_loss(ref(x), y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert seen[0].grad_norm == pytest.approx(expected, rel=1e-5)
    assert seen[0].extras["loss_scale"] == 2.0**12
    ew.close()


def test_per_layer_norms_match_reference_and_layers_follow_modules():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ew = earlywarn.watch(model, opt, sinks=[])
    seen = []
    orig = ew.detector.observe
    ew.detector.observe = lambda obs: (seen.append(obs), orig(obs))[1]
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    ref = {name: torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in mod.parameters()])).item()
           for name, mod in (("inp", model.inp), ("hidden", model.hidden), ("out", model.out))}
    opt.step()
    got = dict(zip(ew.layer_names, seen[0].layer_norms))
    assert set(got) == {"inp", "hidden", "out"}
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-6)
    assert seen[0].grad_norm == pytest.approx(math.sqrt(sum(v * v for v in ref.values())), rel=1e-6)
    ew.close()


def test_grouping_by_depth_and_by_function():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ew = earlywarn.watch(model, opt, group_by="depth:1", sinks=[])
    assert sorted(ew.layer_names) == ["0", "1"]
    ew.detach()
    ew = earlywarn.watch(model, opt, group_by=lambda n: "bias" if n.endswith("bias") else "weight", sinks=[])
    assert sorted(ew.layer_names) == ["bias", "weight"]
    ew.detach()
    with pytest.raises(ValueError, match="group_by"):
        earlywarn.watch(model, opt, group_by="depth:x", sinks=[])


def test_gradient_accumulation_observes_each_optimizer_step_once():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[])
    data = batches(12)
    for i in range(0, 12, 4):
        opt.zero_grad()
        for x, y in data[i : i + 4]:
            (nn.functional.mse_loss(model(x), y) / 4).backward()
        opt.step()
    assert ew.step == 3
    ew.close()


class HostReads(TorchDispatchMode):
    """Counts the operations that make the host wait for a value."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "is_nonzero", "equal", "item"):
            self.count += 1
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_cpu = (kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu") if name == "_to_copy" else args[0].device.type == "cpu"
            if torch.is_tensor(src) and src.device.type != "cpu" and dst_cpu:
                self.count += 1
        return func(*args, **kwargs)


def _host_reads_per_step(watched: bool, per_param_item: bool = False) -> int:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ew = earlywarn.watch(model, opt, sinks=[]) if watched else None
    x, y = batches(1)[0]
    for _ in range(2):  # warm: the first step builds optimizer state
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with HostReads() as reads:
        if ew is not None:
            ew.report_loss(loss)
        if per_param_item:  # what Composer's OptimizerMonitor does: one sync per parameter
            _ = [p.grad.norm().item() for p in model.parameters()]
        opt.step()
    if ew is not None:
        ew.close()
    return reads.count


def test_host_read_budget_one_batched_read_per_step():
    bare = _host_reads_per_step(watched=False)
    guarded = _host_reads_per_step(watched=True)
    assert guarded - bare <= 1
    # The counter is real: a per-parameter .item() loop blows the budget.
    naive = _host_reads_per_step(watched=True, per_param_item=True)
    assert naive - bare > 1


def test_async_mode_skips_on_device_and_reports_one_step_late():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ew = earlywarn.watch(model, opt, mode="async", sinks=[])
    assert ew.mode == "async"
    for i, (x, y) in enumerate(batches(5)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == 2:
            inject_inf(model)
            before = snapshot(model, opt)
        opt.step()
        if i == 2:
            assert_bit_identical(before, snapshot(model, opt))
            assert not [e for e in ew.events if e.kind is Kind.SKIP]  # not read yet: one step late
        if i == 3:
            assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [2]
    assert all_finite(model, opt)
    ew.close()


def test_async_mode_needs_a_fused_optimizer():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="fused=True"):
        earlywarn.watch(model, opt, mode="async", sinks=[])


def test_detach_restores_the_optimizer_exactly():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = dict(opt.__dict__)
    ew = earlywarn.watch(model, opt, sinks=[])
    assert _is_watched_step(opt.step) and opt.step.__self__ is opt
    ew.detach()
    ew.detach()  # idempotent
    assert opt.__dict__.keys() == before.keys()
    assert opt.step.__func__ is type(opt).step
    # and it can be watched again
    earlywarn.watch(model, opt, sinks=[]).detach()


def test_bad_input_errors_name_the_fix():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[])
    with pytest.raises(RuntimeError, match="already watched.*detach"):
        earlywarn.watch(model, opt, sinks=[])
    ew.detach()
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not in the model"):
        earlywarn.watch(model, torch.optim.SGD(other.parameters(), lr=0.1), sinks=[])
    frozen = MLP().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        earlywarn.watch(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1), sinks=[])
    with pytest.raises(TypeError, match="unknown option.*valid options"):
        earlywarn.watch(model, opt, sinkz=[])
    with pytest.raises(ValueError, match="mode="):
        earlywarn.watch(model, opt, mode="fast", sinks=[])
    with pytest.raises(ValueError, match="scalar loss"):
        w = earlywarn.watch(model, opt, sinks=[])
        try:
            w.report_loss(torch.ones(3))
        finally:
            w.detach()


@pytest.mark.parametrize("name", ["adamw_foreach", "adamw_fused"])
def test_decide_now_apply_later_for_trainers_that_clip_in_between(name):
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS[name](model.parameters())
    ew = earlywarn.watch(model, opt, sinks=[])
    for i, (x, y) in enumerate(batches(4)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 2:
            inject_inf(model)
        pending = ew.decide_step()  # statistics on the raw gradients...
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # ...before the trainer clips them
        before = snapshot(model, opt)
        ew.apply_step(pending)
        changed = any(not torch.equal(a, b) for a, b in zip(before[0], snapshot(model, opt)[0]))
        assert changed == (i != 2)
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [2]
    assert all_finite(model, opt)
    ew.close()


def test_resume_from_disk_restores_the_watchers_counters_and_never_lowers_its_step(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = earlywarn.RecoveryConfig(checkpoint_dir=str(tmp_path), checkpoint_every=5)
    ew = earlywarn.watch(model, opt, recovery=cfg, sinks=[])
    for i, (x, y) in enumerate(batches(30)):  # clean checkpoints come clean_window (20) steps after the skip
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 2:
            inject_inf(model)
        opt.step()
    ew.close()
    assert ew.counters["skipped_steps"] == 1

    # A new process: fresh model, optimizer and watcher, resumed from the last clean checkpoint.
    model2 = MLP()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ew2 = earlywarn.watch(model2, opt2, recovery=earlywarn.RecoveryConfig(checkpoint_dir=str(tmp_path)), sinks=[])
    saved_step = ew2.recovery.resume(restore_data=False)  # no loader: no data position to restore
    assert ew2.counters["skipped_steps"] == 1
    assert ew2.step >= saved_step > 0
    ew2.close()


def test_prepared_gpu_check_runs_in_its_cpu_smoke_mode():
    # benchmarks/gpu_check.py is run once when a GPU is lent; keep it working in between
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script), "--cpu-smoke"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "weight unchanged by that step: True" in out.stdout and out.stdout.rstrip().endswith("OK")


class _Experts(nn.Module):
    """Top-1 routing of 6 tokens over 4 experts in 2 layers: the experts that get no token (and
    so no gradient) change from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.ModuleList(nn.Linear(8, 4) for _ in range(2))
        self.experts = nn.ModuleList(nn.ModuleList(nn.Linear(8, 8) for _ in range(4)) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for gate, experts in zip(self.gate, self.experts):
            choice = gate(h).argmax(-1)
            out = torch.zeros_like(h)
            for e, expert in enumerate(experts):
                if (choice == e).any():
                    out[choice == e] = expert(h[choice == e])
            h = h + out
        return h


def test_a_mixture_of_experts_with_idle_experts_changing_stays_calm_and_planned(monkeypatch):
    from earlywarn.capture.gradstats import PLANS_KEPT, GradStats
    from earlywarn.detect.detector import Detector

    torch.manual_seed(0)
    model = _Experts()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ew = earlywarn.watch(model, opt, sinks=[])
    general, plans, idle_sets = [], [], set()
    step, make = Detector._general, GradStats._make_plan
    monkeypatch.setattr(Detector, "_general", lambda self, *a: (general.append(ew.step), step(self, *a))[1])
    monkeypatch.setattr(GradStats, "_make_plan", lambda self, *a: (plans.append(a[0]), make(self, *a))[1])
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        x = torch.randn(6, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        idle_sets.add(tuple(p.grad is None for p in model.parameters()))
        ew.report_loss(loss)
        opt.step()
    ew.close()
    assert 10 < len(idle_sets) <= PLANS_KEPT  # the experts really went idle in turn
    assert sum(s > 200 for s in general) < 10, general  # the calm path, once every expert had matured
    assert len(plans) == len(idle_sets)  # a set met again reuses its plan
    assert not ew.events  # a healthy run: nothing to say


def test_isolated_spikes_that_came_back_keep_the_periodic_snapshot_cadence(monkeypatch):
    # A noisy healthy run: one batch in 40 gives a 3x gradient for one step. Each is reported as
    # an isolated spike once over; only the spike's own steps (elevated) take the faster cadence,
    # not the clean window after it (which costs a snapshot every 5 steps for nothing).
    from earlywarn.guard.episode import Episode

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ew = earlywarn.watch(model, opt, sinks=[])
    building, ask = [], Episode.building
    monkeypatch.setattr(Episode, "building", lambda self, step: (building.append(ask(self, step)), building[-1])[1])
    data = batches(400)
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - y).square().mean() * (3.0 if i % 40 == 39 and i > 100 else 1.0)
        loss.backward()
        ew.report_loss(loss)
        opt.step()
    ew.close()
    spikes = [e for e in ew.events if e.kind == Kind.GRAD_SPIKE]
    assert len(spikes) >= 4 and all(e.level == earlywarn.Level.INFO for e in spikes)
    assert not [e for e in ew.events if e.level >= earlywarn.Level.WARNING]
    # building: the spike steps themselves (a step or two each), never the 20-step window after
    assert sum(building) <= 3 * len(spikes), (sum(building), len(spikes))


def test_an_episode_builds_after_a_warning_or_while_elevated_not_after_an_isolated_spike():
    from earlywarn.events import Event, Level
    from earlywarn.guard.episode import Episode

    ep = Episode(20)
    spike = Event(step=10, kind=Kind.GRAD_SPIKE, level=Level.INFO, message="isolated spike, over")
    assert not ep.after(10, [spike], elevated=False).building(15)
    assert ep.after(10, [spike], elevated=True).building(10)  # still elevated: it may grow
    outlier = Event(step=10, kind=Kind.GRAD_OUTLIER, level=Level.WARNING, message="outlier")
    after = ep.after(10, [outlier], elevated=False)
    assert after.building(29) and not after.building(31) and not after.clean(25)
    overflow = Event(step=10, kind=Kind.SCALER_OVERFLOW, level=Level.INFO, message="scale collapsing")
    assert ep.after(10, [overflow], elevated=False).building(25)  # other info alerts still count


class _Wide(nn.Module):
    # 200 small layers side by side, each fed its own heavy-tailed inputs: per-layer norms are noisy
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(4, 1, bias=False) for _ in range(200))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 200, 4)
        return (x * torch.stack([p.weight[0] for p in self.parts])).sum(-1)


def test_a_model_of_many_noisy_layers_keeps_the_periodic_snapshot_cadence(monkeypatch):
    # Among 200 layers one is above spike_z by chance at many a calm step: the snapshot cadence
    # follows the run's own signals (its gradient norm, its loss), so it stays at every 25 steps.
    from earlywarn.guard.episode import Episode

    torch.manual_seed(0)
    model = _Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ew = earlywarn.watch(model, opt, sinks=[])
    building, elevated_layer, ask = [], [], Episode.building
    monkeypatch.setattr(Episode, "building", lambda self, step: (building.append(ask(self, step)), building[-1])[1])
    g = torch.Generator().manual_seed(0)
    for i in range(400):
        x = torch.randn(4, 200, 4, generator=g) ** 3
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        ew.report_loss(loss)
        opt.step()
        if i >= 100:
            elevated_layer.append(ew.detector.score >= ew.detector.cfg.spike_z)
    ew.close()
    assert sum(elevated_layer) >= 15  # the multiple comparisons are real: some layer is often up
    assert sum(building[100:]) <= 5, sum(building[100:])
    assert not [e for e in ew.events if e.level >= earlywarn.Level.WARNING]
