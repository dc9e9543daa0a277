"""What a user gets from ``earlywarn.watch`` in everyday setups it did not write: any wrapping order of
``optimizer.step``, closures, complex and sparse parameters, resume in a new process, gradient
accumulation, and bad options -- each with the message the user reads."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import earlywarn
from earlywarn import RecoveryConfig
from earlywarn.events import Kind, Level
from earlywarn.guard import _is_watched_step
from fixtures_models import MLP

torch.set_num_threads(1)


def data(n: int = 12, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def finite(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    ts = [p.detach() for p in model.parameters()]
    ts += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in ts)


def train(model, opt, ew, *, fault_step=4, scheduler=None, steps=8):
    for i, (x, y) in enumerate(data(steps)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == fault_step:
            model.hidden.weight.grad[2, 3] = math.inf
        opt.step()
        if scheduler is not None:
            scheduler.step()


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 3),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
}


@pytest.mark.parametrize("order", ["scheduler_after_watch", "scheduler_before_watch"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_an_lr_scheduler_built_before_or_after_watch_works(name, order):
    # before the fix, a scheduler built after watch() crashed the first step:
    # AttributeError: 'SGD' object has no attribute '_detached' (it rebinds optimizer.step)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if order == "scheduler_before_watch":
        sched = SCHEDULERS[name](opt)
        ew = earlywarn.watch(model, opt, sinks=[], scheduler=sched if name != "ReduceLROnPlateau" else None)
    else:
        ew = earlywarn.watch(model, opt, sinks=[])
        sched = SCHEDULERS[name](opt)
    for i, (x, y) in enumerate(data(8)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i == 4:
            model.hidden.weight.grad[2, 3] = math.inf
        opt.step()
        sched.step(loss.item()) if name == "ReduceLROnPlateau" else sched.step()
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [4]
    assert finite(model, opt) and ew.step == 8
    ew.close()
    # detached under a wrapper: the scheduler's wrapper still steps the optimizer, unguarded
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    nn.functional.mse_loss(model(data(1)[0][0]), data(1)[0][1]).backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert "_earlywarn_watcher" not in opt.__dict__


def test_another_librarys_wrapper_over_the_watched_step_works_and_watch_again():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[])
    calls = []
    inner = opt.step

    @functools.wraps(inner)
    def counting_step(*a, **k):  # e.g. a profiler or a logging library
        calls.append(1)
        return inner(*a, **k)

    opt.step = counting_step
    train(model, opt, ew)
    assert len(calls) == 8 and [e.step for e in ew.events if e.kind is Kind.SKIP] == [4]
    ew.close()
    ew2 = earlywarn.watch(model, opt, sinks=[])  # watch again under the foreign wrapper
    train(model, opt, ew2, fault_step=2)
    assert [e.step for e in ew2.events if e.kind is Kind.SKIP] == [2] and finite(model, opt)
    ew2.close()


@pytest.mark.parametrize("when", ["after_watch", "before_watch"])
def test_a_torch_compiled_optimizer_step_works(when, monkeypatch):
    # dynamo must not trace the host-side guard (numpy detector, Python control flow)
    from earlywarn.guard import install

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if when == "before_watch":
        opt.step = torch.compile(opt.step, backend="eager")
        ew = earlywarn.watch(model, opt, sinks=[])
    else:
        ew = earlywarn.watch(model, opt, sinks=[])
        opt.step = torch.compile(opt.step, backend="eager")
    # the guard is a plain function (an eager step pays no compiler.disable wrapper): dynamo,
    # tracing a compiled step, meets it and runs it eagerly through its disabled twin
    eager, twin = [], install._EAGER_STEP
    monkeypatch.setattr(install, "_EAGER_STEP",
                        torch.compiler.disable(lambda *a, **k: eager.append(1) or twin(*a, **k)))
    train(model, opt, ew)
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [4] and finite(model, opt)
    assert bool(eager) == (when == "after_watch")  # before watch(), dynamo compiled the step below it
    ew.close()


def test_a_closure_that_produces_a_nan_gradient_is_skipped():
    # before: statistics were read before the closure ran, so its NaN gradient was applied
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ew = earlywarn.watch(model, opt, sinks=[])
    returned = []
    for i, (x, y) in enumerate(data(8)):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if i == 3:
                model.hidden.weight.grad[0, 0] = math.nan
            return loss

        returned.append(opt.step(closure))
    assert all(isinstance(r, torch.Tensor) for r in returned)  # step(closure) still returns the loss
    assert ew.counters["skipped_steps"] == 1 and [e.step for e in ew.events if e.kind is Kind.SKIP] == [3]
    assert finite(model, opt)
    ew.close()


def test_lbfgs_is_refused_at_watch_with_the_reason():
    model = MLP()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"cannot guard torch\.optim\.LBFGS: its step\(\) evaluates the closure up to max_iter times"):
        earlywarn.watch(model, opt, sinks=[])
    assert "step" not in opt.__dict__


class ComplexModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4, dtype=torch.cfloat) * 0.3)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.to(torch.cfloat) @ self.w).abs())


def test_complex_parameters_are_guarded():
    # before: the first healthy step crashed in linalg.vector_norm ("dtype should be complex")
    torch.manual_seed(0)
    model = ComplexModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[])
    for i, (x, y) in enumerate(data(8)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 4:
            model.w.grad[1, 1] = complex(math.inf, 0)
        opt.step()
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [4]
    assert finite(model, opt)
    norms = [e for e in ew.events if e.kind is Kind.NONFINITE_GRAD]
    assert norms and norms[0].layers[0] == "<root>"
    ew.close()


def test_sparse_gradients_are_guarded():
    # before: the first bad step crashed ("aten::ne.Scalar" on SparseCPU)
    torch.manual_seed(0)
    emb = nn.Embedding(32, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
    ew = earlywarn.watch(emb, opt, sinks=[])
    g = torch.Generator().manual_seed(1)
    for i in range(8):
        opt.zero_grad()
        idx = torch.randint(0, 32, (16,), generator=g)
        emb(idx).pow(2).sum().backward()
        if i == 4:
            emb.weight.grad = torch.sparse_coo_tensor(emb.weight.grad._indices(),
                                                      emb.weight.grad._values().clone().fill_(math.nan),
                                                      emb.weight.shape)
        opt.step()
    assert [e.step for e in ew.events if e.kind is Kind.SKIP] == [4]
    assert bool(torch.isfinite(emb.weight).all())
    ew.close()


def test_watcher_state_loads_with_weights_only_in_a_new_process(tmp_path):
    # before: torch.load(p) failed under weights_only=True (numpy arrays in the detector state)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[])
    train(model, opt, ew, steps=30)
    path = tmp_path / "ew.pt"
    torch.save(ew.state_dict(), path)
    code = textwrap.dedent(f"""
        import torch, earlywarn, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from fixtures_models import MLP
        state = torch.load({str(path)!r})  # torch's default: weights_only=True
        model = MLP(); opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ew = earlywarn.watch(model, opt, sinks=[])
        ew.load_state_dict(state)
        print(ew.step, ew.counters["skipped_steps"], repr(ew.detector.baselines()["grad_norm"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(ew.step), "1", repr(ew.detector.baselines()["grad_norm"])]
    ew.close()


def test_report_loss_under_gradient_accumulation_is_the_mean_of_the_micro_batches():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    ew = earlywarn.watch(model, opt, sinks=[])
    observe = ew.detector.observe
    ew.detector.observe = lambda obs: (seen.append(obs.loss), observe(obs))[1]
    micro = []
    for x, y in data(4):
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        micro.append(float(loss))
        (loss / 4).backward()
        if len(micro) % 2 == 0:
            opt.step()
            opt.zero_grad()
    assert seen == pytest.approx([(micro[0] + micro[1]) / 2, (micro[2] + micro[3]) / 2])
    ew.report_loss(1.0)
    ew.report_loss(float("nan"))  # one NaN micro-batch makes the step's loss NaN
    opt.step()
    assert math.isnan(seen[-1])
    ew.close()


def test_a_loop_that_clips_decides_on_the_raw_gradients_with_decide_step():
    # clip_grad_norm_ between backward and optimizer.step scales every gradient by the same
    # factor: inside optimizer.step earlywarn would see the clipped norm. decide_step() before
    # the clip takes the step's statistics and decision on the raw gradients; apply_step()
    # applies it (a skipped step leaves everything as it is).
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen, raw = [], []
    ew = earlywarn.watch(model, opt, sinks=[])
    observe = ew.detector.observe
    ew.detector.observe = lambda obs: (seen.append(obs.grad_norm), observe(obs))[1]
    for i, (x, y) in enumerate(data(6)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == 4:
            model.hidden.weight.grad[2, 3] = math.inf
        raw.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        pending = ew.decide_step()
        nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        before = [p.detach().clone() for p in model.parameters()]
        ew.apply_step(pending)
        if i == 4:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert seen[:4] == pytest.approx(raw[:4], rel=1e-5) and min(seen[:4]) > 1e-3  # not the clipped 1e-3
    assert math.isinf(seen[4]) and ew.counters["skipped_steps"] == 1 and ew.step == 6
    assert finite(model, opt)
    ew.close()


BAD_OPTIONS = [
    (dict(sinks="console"), TypeError, r"sinks= takes a list of sink names or Sink instances, got 'console': write sinks=\['console'\]"),
    (dict(sinks=[42]), TypeError, r"sinks\[0\]=42: a sink is a registered name"),
    (dict(sink_options={"mlflow": "x"}), TypeError, r"sink_options= takes \{sink name: \{option: value\}\}"),
    (dict(baseline={"grad_norm": "abc"}), ValueError, r"baseline\['grad_norm'\]='abc': a baseline is a typical value"),
    (dict(baseline={"grad_norm": -1.0}), ValueError, r"baseline\['grad_norm'\]=-1.0"),
    (dict(mode="fast"), ValueError, r"mode='fast' is not one of auto, sync, async"),
    (dict(scheduler="x"), TypeError, r"scheduler= takes an object with state_dict\(\) and load_state_dict\(\).*got str"),
    (dict(extra_state={"counter": 3}), TypeError, r"extra_state\['counter'\]= takes an object with state_dict\(\)"),
    (dict(recovery=RecoveryConfig), TypeError, r"recovery= takes an earlywarn RecoveryConfig, got type"),
    (dict(colour="red"), TypeError, r"unknown option\(s\) colour; valid options: mode, group_by"),
]


@pytest.mark.parametrize("options,error,message", BAD_OPTIONS, ids=[str(o) for o, _, _ in BAD_OPTIONS])
def test_bad_watch_options_name_the_field_and_the_fix(options, error, message):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=message):
        earlywarn.watch(model, opt, **options)
    assert "step" not in opt.__dict__ and "_earlywarn_watcher" not in opt.__dict__


BAD_RECOVERY = [
    (dict(repair="false"), r"RecoveryConfig\.repair='false': must be True or False"),
    (dict(rewind=1), r"RecoveryConfig\.rewind=1: must be True or False"),
    (dict(repair_max_param_fraction="abc"), r"RecoveryConfig\.repair_max_param_fraction='abc': must be a number between 0 and 1"),
    (dict(checkpoint_dir=""), r"RecoveryConfig\.checkpoint_dir='': is empty: give a directory"),
    (dict(checkpoint_dir=123), r"RecoveryConfig\.checkpoint_dir=123: must be a path"),
]


@pytest.mark.parametrize("options,message", BAD_RECOVERY, ids=[str(o) for o, _ in BAD_RECOVERY])
def test_bad_recovery_options_name_the_field_and_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        RecoveryConfig(**options)


def test_the_watched_step_is_the_optimizers_own_bound_method():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ew = earlywarn.watch(model, opt, sinks=[])
    assert _is_watched_step(opt.step) and opt.step.__self__ is opt
    ew.close()
    assert "step" not in opt.__dict__


def test_gradscaler_overflow_steps_are_info_not_critical():
    # the scaler doing its job at start-up and after each growth is not an incident
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=10)
    ew = earlywarn.watch(model, opt, scaler=scaler, sinks=[])
    for x, y in data(60, seed=2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        ew.report_loss(loss)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    skips = [e for e in ew.events if e.kind is Kind.SKIP]
    assert skips, "the test needs overflow steps"
    assert all(e.level == Level.INFO for e in skips)
    assert not [e for e in ew.events if e.level >= Level.CRITICAL]
    assert ew.counters["skipped_steps"] == len(skips)
    ew.close()
