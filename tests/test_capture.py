"""Capture on the device: grouped norms, exact huge values, a deterministic per-layer sum, layer
names under wrappers, the late reader's ring, and the device skip flag handed to fused kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import earlywarn
from earlywarn.capture import gradstats
from earlywarn.capture.gradstats import GradStats, gather_device
from earlywarn.capture.grouping import build_layer_map
from earlywarn.capture.hostread import HOST_WAITS, LateReader
from earlywarn.events import Kind, Level
from earlywarn.recover import Recovery, RecoveryConfig, ResumableLoader
from earlywarn.recover.hostcopy import to_host
from earlywarn.recover.snapshot import capture_state
from fixtures_models import MLP

torch.set_num_threads(1)


class Ops(TorchDispatchMode):
    """Counts the aten ops a block of code runs, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def backward(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()


def reference_sq(layer_map, params) -> np.ndarray:
    out = np.zeros(layer_map.num_layers)
    for p, layer in zip(layer_map.params, layer_map.layer_of):
        if p.grad is not None:
            out[layer] += float(p.grad.double().norm()) ** 2
    return out


# -- grouped norms ------------------------------------------------------------------------------

def test_mixed_dtypes_take_one_fused_norm_per_dtype_and_no_atomics():
    model = MLP()
    model.hidden.to(torch.bfloat16)  # a mixed-precision model: fp32 and bf16 gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm = build_layer_map(model, opt)
    stats = GradStats(lm)
    model.hidden.register_forward_pre_hook(lambda m, a: (a[0].to(torch.bfloat16),))
    model.hidden.register_forward_hook(lambda m, a, out: out.float())
    backward(model)
    with Ops() as ops:
        sq = stats.layer_sq_norms()
    assert ops.names.count("_foreach_norm") == 2  # one per (device, dtype) group: the fused path kept
    # the per-layer sums on the CPU: one np.bincount, a sequential float64 loop (a fixed order), so
    # after the norms only their stacking is a torch op (on CUDA, where index_add_ would use
    # atomics, a padded gather and row sums)
    assert not {"index_add_", "index_add", "square", "mul", "sum"} & set(ops.names), ops.names
    np.testing.assert_allclose(sq.numpy(), reference_sq(lm, lm.params), rtol=1e-5)


def test_per_layer_sum_is_exact_and_repeatable_and_follows_unused_parameters():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm = build_layer_map(model, opt, group_by="depth:1")  # several tensors per layer
    stats = GradStats(lm, exact=True)
    backward(model)
    a, b = stats.layer_sq_norms(), stats.layer_sq_norms()
    assert torch.equal(a, b)
    np.testing.assert_allclose(a.numpy(), reference_sq(lm, lm.params), rtol=1e-12)
    model.hidden.weight.grad = None  # an unused branch this step: the plan changes with the key
    c = stats.layer_sq_norms()
    np.testing.assert_allclose(c.numpy(), reference_sq(lm, lm.params), rtol=1e-12)
    counts = stats.layer_nonfinite_counts()
    assert counts.tolist() == [0.0] * lm.num_layers


def test_gradients_that_carry_a_graph_are_read_without_it():
    # backward(create_graph=True) (a gradient penalty, MAML's inner step): the gradients require
    # grad themselves; their statistics are plain numbers (on the CPU they pass through numpy)
    model = MLP()
    lm = build_layer_map(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stats = GradStats(lm)
    x = torch.randn(16, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).square().mean(), x, create_graph=True)
    gx.square().sum().backward(create_graph=True)
    assert all(p.grad.requires_grad for p in lm.params)
    sq = stats.layer_sq_norms(torch.tensor(0.5, dtype=torch.float64))
    assert not sq.requires_grad
    np.testing.assert_allclose(sq.numpy(), reference_sq(lm, lm.params) * 0.25, rtol=1e-5)
    for p in lm.params:
        p.grad = None  # the reference cycle create_graph makes


def test_the_host_vector_is_the_device_vector_entry_for_entry():
    # the CPU builds the step's vector from Python floats; a CUDA run concatenates it with torch. CI has no
    # GPU, so the torch path is run here on the CPU on the same step: the same layout, the same bits
    # (loss, scale, user signals reported and not, the state flag on a check step and off it)
    from earlywarn.guard.statistics import StepStatistics

    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    lm = build_layer_map(model, opt)
    scaler = type("Scaler", (), {"_scale": torch.tensor([1024.0])})()
    backward(model)
    opt.step()  # optimizer state for the flag to read
    backward(model, seed=1)  # one set of gradients for every vector below
    for step, users in ((3, ("a", "b")), (4, ("b",)), (6, ())):
        vecs, tags = [], []
        for host in (True, False):
            st = StepStatistics(lm, opt, scaler, late=False, world_size=1, state_check_every=3)
            st._host = host
            for name in ("a", "b"):
                st.report(name, 0.0)  # both slots exist, in this order
            st._reported.clear()
            st.report_loss(torch.tensor(2.5, dtype=torch.float32))
            st.report_loss(3.5)
            for name in users:
                st.report(name, torch.tensor(float(len(name)) + 0.25))
            vec, tag = st.vector(step, None)
            vecs.append(vec)
            tags.append(tag.users)
            st.close()
        host_vec, dev_vec = vecs
        assert isinstance(host_vec, list)  # the host's copy already: read as it is
        host_vec = torch.tensor(host_vec, dtype=torch.float64)
        assert host_vec.dtype == dev_vec.dtype and host_vec.shape == dev_vec.shape
        assert host_vec.numpy().tobytes() == dev_vec.numpy().tobytes(), (step, host_vec, dev_vec)
        assert tags[0] == tags[1]
        L = lm.num_layers
        assert host_vec[L] == 3.0 and host_vec[L + 1] == 1024.0
        assert [math.isnan(host_vec[L + 2 + j]) for j in range(2)] == [n not in users for n in ("a", "b")]
        assert (host_vec[-1] > 0.0) == (step % 3 == 0)  # the state's norms summed, or "not checked"


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_cpus_per_layer_loop_is_numpys_square_and_bincount_bit_for_bit(scaled, weighted):
    # the CPU squares and sums the per-tensor norms per layer in a Python loop (a torch or numpy
    # call costs more on the caches backward leaves): the float64 operations of numpy's multiply,
    # square and bincount, in their order -- the same bits, overflow, NaN and inf included
    model = MLP()
    lm = build_layer_map(model, torch.optim.SGD(model.parameters(), lr=0.1), group_by="depth:1")
    stats = GradStats(lm)
    backward(model)
    stats._grads()  # the plan
    g = torch.Generator().manual_seed(0)
    n = len(stats._plan.present)
    norms = (torch.rand(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g)).float()
    norms[0], norms[-1] = 3e19, math.nan  # a square that overflows float32 (not float64), a NaN
    inv = torch.tensor(0.37, dtype=torch.float64) if scaled else None
    weight = torch.rand(n, generator=g, dtype=torch.float64) if weighted else None
    # in pieces, as a norm plan computes them (a stack's, the others'), of two precisions: read in order
    got = stats._host_layer_sq([norms[:3], norms[3:].double()], inv, weight, as_present=False)
    x = norms.numpy().astype(np.float64)
    if inv is not None:
        x = x * float(inv)
    x = np.square(x)
    if weight is not None:
        x *= weight.numpy()
    want = np.bincount(np.asarray(stats._layer_index(False)), weights=x, minlength=lm.num_layers)
    assert np.asarray(got).tobytes() == want.tobytes()


def _norms_of_one_backward(model: nn.Module):
    """(layer map, GradStats, the calls its layer_sq_norms made, what it returned) after one backward
    of ``model`` (8 inputs)."""
    lm = build_layer_map(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stats = GradStats(lm)
    model(torch.randn(4, 8)).square().mean().backward()
    with Ops() as ops:
        sq = stats.layer_sq_norms()
    return lm, stats, ops, sq


def test_many_small_cpu_tensors_are_stacked_by_shape_bit_for_bit_and_counted_in_place():
    # 40 residual blocks of Linear(8, 8): 80 small tensors in 2 shapes, plus one larger weight
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)], nn.Linear(8, 600, bias=False))
    lm, stats, ops, sq = _norms_of_one_backward(model)
    # per shape one stack and one row-wise norm; only the tensor alone of its shape takes _foreach_norm
    assert ops.names.count("stack") >= 2 and ops.names.count("linalg_vector_norm") == 2
    grads = [p.grad for p in lm.params]
    exact = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double().square()
    per_layer = torch.zeros(lm.num_layers, dtype=torch.float64).index_add_(0, torch.tensor(lm.layer_of), exact)
    assert torch.equal(sq, per_layer)  # the same values as one _foreach_norm, bit for bit
    bad = next(i for i, p in enumerate(lm.params) if p is model[17].bias)
    lm.params[bad].grad[3] = math.nan
    counts = stats.layer_nonfinite_counts()
    assert counts.nonzero().flatten().tolist() == [lm.layer_of[bad]] and counts.sum().item() == 1


def test_a_few_tensors_of_one_shape_take_the_fused_loop_not_a_stack():
    # 4 blocks: 4 tensors of each shape, fewer than STACK_MIN: a stack would cost more (in place)
    lm, _, ops, sq = _norms_of_one_backward(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]))
    assert ops.names.count("_foreach_norm") == 1 and "linalg_vector_norm" not in ops.names
    np.testing.assert_allclose(sq.numpy(), reference_sq(lm, lm.params), rtol=1e-6)


def test_the_plan_follows_which_parameters_lack_a_gradient_not_only_how_many():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm = build_layer_map(model, opt)
    stats = GradStats(lm)
    model(torch.randn(2, 4)).sum().backward()
    for drop in ([model[0].weight], [model[1].weight], [], [model[2].bias, model[0].bias]):
        for p in lm.params:  # as many gradients missing as the step before, but others
            p.grad = None if any(p is d for d in drop) else torch.randn_like(p)
        np.testing.assert_allclose(stats.layer_sq_norms().numpy(), reference_sq(lm, lm.params), rtol=1e-6)


def test_sets_of_parameters_with_a_gradient_seen_lately_are_not_planned_again(monkeypatch):
    # a mixture of experts: which experts got a token (and so a gradient) changes every step
    experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
    lm = build_layer_map(experts, torch.optim.SGD(experts.parameters(), lr=0.1))
    stats = GradStats(lm)
    made = []
    make = GradStats._make_plan
    monkeypatch.setattr(GradStats, "_make_plan", lambda self, *a: (self is stats and made.append(a[0])) or make(self, *a))
    read, ours = [], 0
    monkeypatch.setattr(gradstats, "_layout", lambda g, _f=gradstats._layout: (read.append(g), _f(g))[1])
    routed = [(0, 1), (2,), (0, 1), (1, 2, 3), (2,), (0, 1), (1, 2, 3)]
    for used in routed:
        for e, ex in enumerate(experts):
            for p in ex.parameters():
                p.grad = torch.randn_like(p) if e in used else None
        before = len(read)
        np.testing.assert_allclose(stats.layer_sq_norms().numpy(), reference_sq(lm, lm.params), rtol=1e-6)
        ours += len(read) - before
        fresh = GradStats(lm).layer_sq_norms()  # planned from scratch: the same bits
        assert torch.equal(stats.layer_sq_norms(), fresh)
    assert len(made) == 3  # one plan per set of experts, made the first time it was met
    assert ours == 4 * 2  # ... from each expert's gradients as first read: a new set reads only what is new


def test_a_gradient_that_turns_sparse_and_back_is_normed_as_it_is():
    # the same parameters have a gradient, but one changed layout: planned again, not a crash
    emb, lin = nn.Embedding(10, 4), nn.Linear(4, 4)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    lm = build_layer_map(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stats = GradStats(lm)
    for p in lm.params:
        p.grad = torch.ones_like(p)
    for grad in (torch.sparse_coo_tensor([[1, 3]], torch.full((2, 4), 2.0), (10, 4)), torch.ones(10, 4)):
        stats.layer_sq_norms()
        emb.weight.grad = grad
        np.testing.assert_allclose(stats.layer_sq_norms().numpy(), reference_sq(lm, lm.params), rtol=1e-6)
    emb.weight.grad = emb.weight.grad.to_sparse()
    lin.weight.grad[0, 0] = math.nan
    assert stats.layer_nonfinite_counts()[lm.layer_names.index("lin")].item() == 1


def test_a_gradient_resized_or_recast_since_first_read_is_normed_as_it_is():
    # ten biases of one shape are stacked in one call (capture/norms.py): one of them resized
    # breaks the stack, one recast changes the group; both are planned again, not a crash
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(10)])
    lm = build_layer_map(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stats = GradStats(lm)
    for p in lm.params:
        p.grad = torch.ones_like(p)
    stats.layer_sq_norms()
    model[4].bias.data = torch.zeros(5)
    model[4].bias.grad = torch.full((5,), 2.0)
    np.testing.assert_allclose(stats.layer_sq_norms().numpy(), reference_sq(lm, lm.params), rtol=1e-6)
    model[6].bias.grad = None  # a set not met before, planned from what was read
    model[7].weight.data = model[7].weight.data.double()
    model[7].weight.grad = torch.full((3, 3), 3.0, dtype=torch.float64)
    np.testing.assert_allclose(stats.layer_sq_norms().numpy(), reference_sq(lm, lm.params), rtol=1e-6)
    with pytest.raises(RuntimeError):  # an error that planning again does not mend is raised
        stats._planned(lambda gs: torch.ones(2) + torch.ones(3), stats._grads())


def test_sparse_and_complex_gradients_are_measured_and_counted():
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 4).to(torch.complex64)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm = build_layer_map(model, opt)
    stats = GradStats(lm)
    out = lin(emb(torch.tensor([1, 2, 2])).to(torch.complex64))
    out.abs().sum().backward()
    emb.weight.grad = emb.weight.grad.coalesce()
    ref = {n: 0.0 for n in lm.layer_names}
    ref["emb"] = float(emb.weight.grad._values().norm()) ** 2
    ref["lin"] = float(lin.weight.grad.abs().norm()) ** 2 + float(lin.bias.grad.abs().norm()) ** 2
    sq = stats.layer_sq_norms()
    np.testing.assert_allclose(sq.numpy(), [ref[n] for n in lm.layer_names], rtol=1e-5)
    emb.weight.grad._values()[0, 0] = math.nan
    counts = stats.layer_nonfinite_counts()  # no "ne.Scalar on SparseCPU"
    assert counts[lm.layer_names.index("emb")].item() == 1


def test_gather_device_prefers_cuda_when_any_gradient_is_there():
    cpu, c1 = torch.device("cpu"), torch.device("cuda", 1)
    assert gather_device([cpu, c1]) == c1  # CPU-offloaded part first: still gathered on CUDA
    assert gather_device([cpu]) == cpu


# -- a huge finite gradient is a spike, not a non-finite one ---------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_huge_finite_gradient_is_a_spike_not_nonfinite(mode):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ew = earlywarn.watch(model, opt, mode=mode, sinks=[])
    seen = []
    observe = ew.detector.observe
    ew.detector.observe = lambda obs: (seen.append(obs), observe(obs))[1]
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i == 2:
            model.hidden.weight.grad[1, 1] = 1e20  # float32 squares overflow above ~1.8e19
            before = model.hidden.weight.detach().clone()
        opt.step()
        if i == 2:
            # skipped, as a spike: its square would make Adam's exp_avg_sq inf (then NaN updates)
            assert torch.equal(before, model.hidden.weight)
    ew.flush()
    obs = next(o for o in seen if o.step == 2)
    assert obs.grad_finite and math.isclose(obs.grad_norm, 1e20, rel_tol=1e-6)
    assert not np.any(obs.layer_nonfinite)
    assert ew.counters["nonfinite_steps"] == 0 and ew.counters["skipped_steps"] == 1
    assert not [e for e in ew.events if e.kind is Kind.NONFINITE_GRAD]
    skips = [e for e in ew.events if e.kind is Kind.SKIP]
    assert len(skips) == 1 and skips[0].level == Level.WARNING and skips[0].step == 2
    assert "huge finite gradient in 'hidden' (norm 1e+20: its square overflows float32" in skips[0].message
    assert all(bool(torch.isfinite(v).all()) for st in opt.state.values() for v in st.values())
    ew.close()


def test_the_sync_recount_runs_only_on_the_rare_path():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[])
    backward(model)
    opt.step()  # the first step also takes the first snapshot (its flag is one more norm pass)
    backward(model, 2)
    with Ops() as ops:
        opt.step()
    # healthy step: one pass over the gradients, float32 on CPU (the optimizer state's own pass,
    # recover/statecheck.py, comes every 10th step for torch.optim's optimizers: not this one)
    assert ops.names.count("_foreach_norm") == 1
    backward(model, 1)
    model.out.weight.grad[0, 0] = math.inf
    with Ops() as ops:
        opt.step()
    # a real inf: counted, not recounted -- the one more pass is the state check that tells a bad
    # batch from poisoned state (parameters and optimizer state finite: nothing was written)
    assert ops.names.count("_foreach_norm") == 2
    ew.close()


# -- the device skip flag handed to fused kernels -------------------------------------------------

@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, fused=True)])
def test_a_gradscaler_found_inf_summed_over_two_devices_still_skips(make):
    # GradScaler hands fused optimizers found_inf = sum over devices: 2.0 with two devices. The
    # kernels skip only on == 1 (and fused Adam then subtracts found_inf from `step`).
    torch.manual_seed(0)
    model = MLP()
    opt = make(model.parameters())
    ew = earlywarn.watch(model, opt, sinks=[])
    backward(model)
    opt.step()
    backward(model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    steps = [st["step"].clone() for st in opt.state.values() if "step" in st]
    opt.found_inf = torch.tensor(2.0)  # as GradScaler.step sets it for a fused optimizer
    opt.step()
    del opt.found_inf
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert [st["step"] for st in opt.state.values() if "step" in st] == steps
    ew.close()


# -- layer names under wrappers -------------------------------------------------------------------

class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2)])
        self.module = nn.Linear(4, 4)  # a user's own submodule called "module"


@pytest.mark.parametrize("wrap", ["none", "compile", "dataparallel", "compile+dataparallel"])
def test_wrapper_prefixes_do_not_shift_depth_grouping(wrap):
    model = Blocks()
    wrapped: nn.Module = model
    if "dataparallel" in wrap:
        wrapped = nn.DataParallel(wrapped)
    if "compile" in wrap:
        wrapped = torch.compile(wrapped)  # lazily: nothing is compiled until it is called
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    lm = build_layer_map(wrapped, opt, group_by="depth:2")
    assert set(lm.layer_names) == {"blocks.0", "blocks.1", "module"}
    assert build_layer_map(wrapped, opt).num_layers == 5  # per module: as the parameters are named


# -- the late reader ------------------------------------------------------------------------------

class Slow:
    """Events that complete only when waited for."""

    def __init__(self):
        self.events = []

    def __call__(self, device):
        ev = type("Ev", (), {"done": False, "query": lambda s: s.done,
                             "synchronize": lambda s: setattr(s, "done", True)})()
        self.events.append(ev)
        return ev


def test_late_reader_polls_in_order_and_waits_only_when_drained_or_full():
    slow = Slow()
    r = LateReader(depth=3, max_depth=4, event_factory=slow)
    w0 = HOST_WAITS.snapshot()[0]
    got = []
    for i in range(4):
        got += r.push(torch.full((3,), float(i)), i)
    assert got == [] and r.in_flight == 4 and HOST_WAITS.snapshot()[0] == w0  # nothing landed, no wait
    slow.events[1].done = True  # a later copy landed first? the reader still hands them in order
    assert r.push(torch.full((3,), 4.0), 4)[0][1] == 0  # full ring: the oldest is waited for
    assert HOST_WAITS.snapshot()[0] == w0 + 1
    slow.events[2].done = True
    ready = r.push(torch.full((3,), 5.0), 5)
    assert [t for _, t in ready] == [1, 2]
    drained = r.drain()
    assert [t for _, t in drained] == [3, 4, 5] and drained[0][0].tolist() == [3.0] * 3
    assert HOST_WAITS.snapshot()[0] == w0 + 1 + 3


# -- snapshots: a finiteness flag beside the copy ------------------------------------------------

def _adam_model():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    backward(model)
    opt.step()
    return model, opt


def test_snapshot_flag_tells_poisoned_state_from_a_huge_finite_value():
    model, opt = _adam_model()
    assert capture_state(1, model=model, optimizer=opt, check_finite=True).finite()
    v = opt.state[model.hidden.weight]["exp_avg_sq"]
    v[0, 0] = 3e38  # finite, but its float32 L2 norm (the CPU flag) overflows
    host = capture_state(2, model=model, optimizer=opt, check_finite=True)
    assert not host.finite() and host.owned_finite()  # a false alarm, settled exactly on the host
    v[0, 0] = math.nan
    host = capture_state(3, model=model, optimizer=opt, check_finite=True)
    assert not host.finite() and not host.owned_finite()
    assert not to_host({"a": torch.ones(2)}).checked


def test_recovery_keeps_a_snapshot_with_a_huge_finite_value_and_repairs_a_nan():
    model, opt = _adam_model()
    events = []
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=1), emit=events.append)
    opt.state[model.hidden.weight]["exp_avg_sq"][0, 0] = 3e38
    rec.after_step(1, clean=True)
    assert [s.step for s in rec.ring.entries] == [1] and not events
    opt.state[model.hidden.weight]["exp_avg"][0, 0] = math.nan
    rec.after_step(2, clean=True)
    assert [s.step for s in rec.ring.entries] == [1] and [e.kind for e in events] == [Kind.REPAIR]


def test_a_provisional_snapshot_is_kept_only_when_its_step_is_judged_clean():
    model, opt = _adam_model()
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=1, clean_window=0))
    rec.record_step(1)  # async mode: the update is queued, the statistics not read yet
    assert len(rec.ring) == 0
    rec.record_step(2)  # one in flight at a time
    rec.after_step(1, clean=False)  # step 1 turned out unclean: dropped, and due again
    rec.after_step(2, clean=True)  # step 2 had no snapshot of its own (one was in flight)
    assert len(rec.ring) == 0
    rec.record_step(3)
    rec.after_step(3, clean=True)
    assert [s.step for s in rec.ring.entries] == [3]


def test_warning_checkpoint_is_labelled_with_the_state_it_holds():
    model, opt = _adam_model()
    loader = ResumableLoader(torch.utils.data.TensorDataset(torch.arange(40.0)), 4, shuffle=False)
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=100), loader=loader)
    it = iter(loader)
    for step in range(4):
        next(it)
        rec.record_step(step)  # updates 0..3 applied
    assert rec.checkpoint(2, reason="warning") == "memory:3"  # a warning about step 2, read at step 3
    snap = [s for s in rec.ring.entries if not s.clean][-1]
    assert snap.step == 3 and snap.state["data"]["batch_index"] == 4  # batches 0..3 trained
    next(it)  # sync mode: the batch for step 4 drawn, its update not applied yet
    assert rec.checkpoint(4, reason="warning") == "memory:3"
    assert [s for s in rec.ring.entries if not s.clean][-1].state["data"]["batch_index"] == 4


def test_rewind_with_steps_in_flight_quarantines_as_sync_mode_would():
    # Async mode: steps 6 and 7 were applied before the incident at step 5 was read.
    def setup(loader):
        model, opt = _adam_model()
        rec = Recovery(model, opt, RecoveryConfig(snapshot_every=3, clean_window=0), loader=loader)
        it = iter(loader) if loader is not None else None
        for step in range(8):
            if it is not None:
                next(it)
            rec.record_step(step)
            if step <= 4:
                rec.after_step(step, clean=True)
        return rec

    loader = ResumableLoader(torch.utils.data.TensorDataset(torch.arange(80.0)), 4, shuffle=False)
    rec = setup(loader)
    report = rec.rewind(5, "loss_nonfinite")
    assert report.restored_step == 3
    assert [q.batch_index for q in report.quarantined] == [4, 5]  # the incident's batches only
    assert loader.position.batch_index == 6  # batches 6 and 7 are trained again
    rec = setup(None)  # no loader: identities unknown, nothing can be replayed
    report = rec.rewind(5, "loss_nonfinite")
    assert [q.step for q in report.quarantined] == [4, 5, 6, 7]  # the in-flight ones are not lost
