"""A lone outlier bounded element by element against the optimizer's own second moment
(earlywarn.guard.bound): the limits, the fallback, which outliers, a rare large gradient whose
elements still move, and the arithmetic its bound of 3 rests on."""

from __future__ import annotations

import math

import pytest
import torch

from earlywarn.guard.bound import Rest, bound_gradients


def _stepped(opt_cls, **kw):
    """A parameter whose optimizer has taken 3 steps on unit-scale gradients (its state exists)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = opt_cls([p], **kw)
    for _ in range(3):
        p.grad = torch.randn(1000)
        opt.step()
    return p, opt


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.Adam, {}), (torch.optim.AdamW, {"foreach": False}),
                                        (torch.optim.Adam, {"fused": True}), (torch.optim.RMSprop, {})])
def test_each_element_is_held_to_its_running_rms_and_never_under_the_whole_factor(opt_cls, kw):
    p, opt = _stepped(opt_cls, lr=1e-3, **kw)
    st = opt.state[p]
    if "exp_avg_sq" in st:
        beta2 = opt.param_groups[0]["betas"][1]
        rms = (st["exp_avg_sq"] / (1 - beta2 ** float(st["step"]))).sqrt()
    else:
        rms = st["square_avg"].sqrt()
    g = torch.randn(1000)
    g[:10] *= 1e4  # ten elements far beyond their running RMS
    p.grad = g.clone()
    bound, factor = 3.0, 1e-6
    bound_gradients([p], opt, factor, bound)
    out = p.grad
    limit = torch.maximum(bound * rms, factor * g.abs())
    assert torch.allclose(out.abs(), torch.minimum(g.abs(), limit), rtol=1e-5)
    assert torch.equal(out.sign(), g.sign())
    assert (out[:10].abs() <= bound * rms[:10] * (1 + 1e-5)).all()  # the outliers held
    within = g.abs() <= bound * rms
    assert torch.equal(out[within], g[within])  # the rest as they were
    # never under the whole's factor: a bound of 0 leaves factor x the gradient
    p.grad = g.clone()
    bound_gradients([p], opt, 0.5, 0.0)
    assert torch.allclose(p.grad, 0.5 * g)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # no second moment
    lambda ps: torch.optim.Adam(ps, lr=1e-3),  # no state yet: its first step
])
def test_without_a_running_second_moment_the_whole_is_scaled_by_its_factor(make):
    p = torch.nn.Parameter(torch.zeros(100))
    opt = make([p])
    if isinstance(opt, torch.optim.SGD):
        p.grad = torch.randn(100)
        opt.step()
    g = torch.randn(100) * 1e3
    p.grad = g.clone()
    bound_gradients([p], opt, 0.01, 3.0)
    assert torch.allclose(p.grad, 0.01 * g)


def test_gradients_that_still_carry_a_loss_scale_are_limited_at_that_scale():
    p, opt = _stepped(torch.optim.Adam, lr=1e-3)
    g = torch.randn(1000)
    g[:10] *= 1e4
    p.grad = g.clone()
    bound_gradients([p], opt, 1e-6, 3.0)
    unscaled = p.grad.clone()
    p.grad = 1024.0 * g  # a fused optimizer's: unscaled inside its step
    bound_gradients([p], opt, 1e-6, 3.0, inv_scale=torch.tensor(1 / 1024.0))
    assert torch.allclose(p.grad / 1024.0, unscaled, rtol=1e-5)


def test_a_second_moment_without_adams_betas_is_not_read():
    """An ``exp_avg_sq`` in a group with no ``betas`` (another library's form: its bias correction
    unknown) is not guessed at: the whole's factor."""
    p, opt = _stepped(torch.optim.Adam, lr=1e-3)
    del opt.param_groups[0]["betas"]
    g = torch.randn(1000) * 1e3
    p.grad = g.clone()
    bound_gradients([p], opt, 0.01, 3.0)
    assert torch.allclose(p.grad, 0.01 * g)


def test_a_sparse_gradient_takes_the_whole_factor():
    emb = torch.nn.Embedding(100, 8, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        emb(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
    opt.zero_grad()
    (1e4 * emb(torch.tensor([1, 5])).sum()).backward()
    g = emb.weight.grad.clone()
    bound_gradients([emb.weight], opt, 0.01, 3.0)
    assert emb.weight.grad.is_sparse
    assert torch.allclose(emb.weight.grad.to_dense(), 0.01 * g.to_dense())


def test_a_nan_bound_takes_the_whole_factor():
    p, opt = _stepped(torch.optim.Adam, lr=1e-3)
    g = torch.randn(1000)
    p.grad = g.clone()
    bound_gradients([p], opt, 0.25, math.nan)
    assert torch.allclose(p.grad, 0.25 * g)


def test_the_first_outlier_of_a_run_is_bounded_element_by_element_the_rest_to_a_factor_and_half_a_step():
    from earlywarn.events import Event, Kind, Level
    from earlywarn.outlier_rules import RUN_ELEMENT_RMS
    from earlywarn.policy import Evidence, Policy

    def out(s, ratio):
        return Event(step=s, kind=Kind.GRAD_OUTLIER, level=Level.WARNING, signal="grad_norm", message="",
                     values={"ratio": ratio, "loss_ratio": 50.0, "steps": 1.0})

    p = Policy()
    d = [p.decide(s, [out(s, 40.0)], Evidence(40.0, 50.0)) for s in range(100, 104)]
    assert [x.clip_rms for x in d] == [1.0, RUN_ELEMENT_RMS, RUN_ELEMENT_RMS, RUN_ELEMENT_RMS]
    assert [round(x.clip_factor * 40.0, 6) for x in d] == [1.0, 3.0, 3.0, 3.0]
    sgd = Policy(scale_free=False)  # plain SGD keeps no second moment: its bound is the whole's
    assert [sgd.decide(s, [out(s, 40.0)], Evidence(40.0, 50.0)).clip_rms for s in range(100, 103)] == [1.0, None, None]


def test_a_rare_large_gradient_moves_the_elements_it_carries_under_adam():
    """A rare batch whose gradient is ~700x the typical norm: five elements at 1e4x their running
    RMS (whatever dominates the norm) and the rest at 30x (the signal, spread). One factor for the
    whole shrinks the spread elements to a twentieth of their RMS, and Adam, dividing by that RMS,
    hardly moves them; held to their running RMS, each moves as far as an ordinary step moves it."""
    lr = 1e-2

    def moved(element_wise: bool, ordinary: bool = False) -> float:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.zeros(1000))
        opt = torch.optim.Adam([p], lr=lr)
        for _ in range(50):
            p.grad = 1e-3 * torch.randn(1000).sign()
            opt.step()
        before = p.detach().clone()
        g = torch.full((1000,), 1e-3 if ordinary else 30e-3)
        if not ordinary:
            g[:5] = 10.0
        typical = 1e-3 * math.sqrt(1000)
        factor = typical / float(g.norm())
        p.grad = g
        if ordinary:
            pass
        elif element_wise:
            bound_gradients([p], opt, factor, 1.0)
        else:
            p.grad.mul_(factor)
        opt.step()
        return -float((p.detach() - before)[5:].mean())  # along the gradient (the history's momentum averages out)

    ordinary = moved(False, ordinary=True)  # an ordinary gradient of the same direction
    assert moved(True) == pytest.approx(ordinary, rel=1e-3)
    assert moved(False) < 0.2 * ordinary


@pytest.mark.parametrize("betas, whole", [((0.9, 0.95), 5.8), ((0.9, 0.999), 31.8)])
def test_held_to_k_rms_an_element_moves_k_ordinary_steps_taken_whole_many_and_then_stalls(betas, whole):
    """The arithmetic the bound of 3 rests on (guard.bound's docstring): against a twin that never
    saw the outlier, an element held to 3x its RMS ends about 3 ordinary steps along it; taken
    whole (1e4x), (1 - b1) / sqrt(1 - b2) / (1 - b1 / sqrt(b2)) steps whatever its size, and its
    ordinary steps after it shrink a hundredfold (its second moment 1e8x up)."""
    lr, n, s = 1e-3, 1000, 1e-3

    def run(kind: str) -> tuple[float, float]:
        p = torch.nn.Parameter(torch.zeros(n))
        opt = torch.optim.Adam([p], lr=lr, betas=betas)
        gen = torch.Generator().manual_seed(1)
        noise = lambda: s * (2.0 * torch.randint(0, 2, (n,), generator=gen).float() - 1.0)
        p.grad = torch.zeros(n)
        opt.step()  # a run's steady state: its moments at the noise's scale, bias correction done
        state = opt.state[p]
        state["step"].fill_(1e5), state["exp_avg"].zero_(), state["exp_avg_sq"].fill_(s * s)
        p.grad = noise() + (0.0 if kind == "twin" else 1e4 * s)
        if kind == "bounded":
            bound_gradients([p], opt, 3.0 * s * math.sqrt(n) / float(p.grad.norm()), 3.0)
        opt.step()
        moves = []
        for _ in range(200):
            p.grad = noise()
            before = p.detach().clone()
            opt.step()
            step = p.detach() - before
            moves.append(float((step - step.mean()).abs().mean()))  # the noise's steps, the outlier's drift left out
        return -float(p.detach().mean()) / lr, sum(moves[:20]) / 20 / lr

    twin, twin_moves = run("twin")
    bounded, bounded_moves = run("bounded")
    taken, taken_moves = run("whole")
    assert bounded - twin == pytest.approx(3.0, rel=0.15)
    assert taken - twin == pytest.approx(whole, rel=0.15)
    assert bounded_moves > 0.8 * twin_moves and taken_moves < 0.01 * twin_moves


@pytest.mark.parametrize("betas, steps, whole_over_held", [((0.9, 0.95), 100, (0.95, 1.1)),
                                                           ((0.9, 0.999), 20, (3.0, 4.5)),
                                                           ((0.9, 0.999), 100, (1.6, 2.3))])
def test_a_new_regime_held_at_3x_moves_as_far_as_taken_whole_only_where_the_second_moment_follows_fast(
        betas, steps, whole_over_held):
    """What the run of outliers' bound costs a new regime (outlier_rules.OUTLIER_GROWTH): a
    gradient 300x its old RMS from one step on, in one direction. Held to 3x, Adam moves it
    about one to three ordinary steps a step. Taken whole, its second moment trails the new
    scale for ~1 / (1 - b2) steps, and each step is larger while it does: at b2 0.95 the two
    travel as far over 100 steps; at b2 0.999, 3-4.5x as far in the first 20 and ~2x in 100.
    (The best case for the bound: every element the same multiple of its own RMS.)"""
    lr, n = 1e-3, 256

    def travelled(held: bool) -> float:
        p = torch.nn.Parameter(torch.zeros(n))
        opt = torch.optim.Adam([p], lr=lr, betas=betas)
        gen = torch.Generator().manual_seed(2)
        for _ in range(2000):  # the old regime: unit RMS, no direction
            p.grad = 2.0 * torch.randint(0, 2, (n,), generator=gen).float() - 1.0
            opt.step()
        start = p.detach().clone()
        for _ in range(steps):
            p.grad = torch.full((n,), 300.0)
            if held:
                p.grad.mul_(3.0 * math.sqrt(n) / float(p.grad.norm()))  # the whole, to 3x the typical norm
            opt.step()
        return -float((p.detach() - start).mean()) / lr

    ratio = travelled(False) / travelled(True)
    lo, hi = whole_over_held
    assert lo <= ratio <= hi


def test_the_rest_a_bound_takes_off_is_added_whole_to_a_later_step():
    p, opt = _stepped(torch.optim.Adam, lr=1e-3)
    g = torch.randn(1000)
    g[:10] *= 1e4
    p.grad = g.clone()
    rest = Rest([p])
    bound_gradients([p], opt, 1e-6, 3.0)
    bounded = p.grad.clone()
    rest.taken()
    g2 = torch.randn(1000)
    p.grad = g2.clone()
    rest.add_to_gradients()
    assert torch.allclose(p.grad, g2 + (g - bounded))
    p.grad = None
    rest.add_to_gradients()  # a parameter without a gradient now: left out
    assert p.grad is None


def test_a_rest_taken_under_one_loss_scale_is_added_under_another():
    """A fused optimizer under GradScaler sees its gradients still scaled (it unscales them itself);
    the scale may change between the two steps: the rest is kept unscaled."""
    p, opt = _stepped(torch.optim.Adam, lr=1e-3)
    g = torch.randn(1000)
    g[:10] *= 1e4
    p.grad = g * 1024.0
    rest = Rest([p])
    inv = torch.tensor(1 / 1024.0, dtype=torch.float64)
    bound_gradients([p], opt, 1e-6, 3.0, inv_scale=inv)
    taken_off = (g * 1024.0 - p.grad) / 1024.0
    rest.taken(inv)
    p.grad = torch.zeros(1000)
    rest.add_to_gradients(torch.tensor(1 / 512.0, dtype=torch.float64))
    assert torch.allclose(p.grad, taken_off * 512.0, rtol=1e-5)


def test_a_watched_run_adds_its_first_rare_large_gradient_s_rest_to_the_next():
    """End to end under ``watch()``: isolated outliers with the loss at its level (a policy
    gradient's rare rewards). The first is bounded; the second, taken as the run's heavy tail,
    reaches the optimizer with the first's rest added: the two together as bare Adam got them."""
    import earlywarn

    torch.manual_seed(0)
    n = 1000
    model = torch.nn.Module()
    model.p = p = torch.nn.Parameter(torch.zeros(n))
    opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.95))
    applied, at = {}, [0]
    opt.register_step_pre_hook(lambda o, a, k: applied.__setitem__(at[0], p.grad.detach().clone()))
    ew = earlywarn.watch(model, opt, sinks=[])
    gen = torch.Generator().manual_seed(1)
    grads = {}
    for s in range(120):
        at[0] = s
        x = 1e-3 * torch.randn(n, generator=gen)
        if s in (100, 110):
            x = x + 0.5 * torch.randn(n, generator=gen)
        grads[s] = x
        opt.zero_grad(set_to_none=True)
        (p * x).sum().backward()
        ew.report_loss(torch.tensor(1.0))  # the loss at its level
        opt.step()
    ew.close()
    clips = [e for e in ew.events if str(e.kind) == "clip"]
    assert [e.step for e in clips] == [100] and "kept" in clips[0].message
    rest = grads[100] - applied[100]
    assert rest.norm() > 0.5 * grads[100].norm()  # the bound took most of it
    assert torch.allclose(applied[110], grads[110] + rest)
    assert all(torch.equal(applied[s], grads[s]) for s in range(101, 110))
