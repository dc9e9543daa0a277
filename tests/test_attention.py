"""Attention-logit growth (issue 48): a transformer's user reports its largest attention logit
(``ew.report("attn_logit_max/<layer>", ...)``); past ``LOGIT_BOUND`` for ``LOGIT_STEPS`` steps
it is a warning naming the layer, the mechanism and the fixes, and each doubling another; the
policy lowers the learning rate at each (``PolicyConfig.logit_lr_factor``)."""

from __future__ import annotations

import json
import math

import pytest

from earlywarn.attention import LOGIT_BOUND, LOGIT_STEPS, LogitWatch
from earlywarn.events import Event, Kind, Level
from earlywarn.policy import Evidence, Policy
from earlywarn.policy_config import PolicyConfig


def _push(w: LogitWatch, values, layer="blocks.1"):
    return [w.push(s, {"lr": 1e-3, f"user/attn_logit_max/{layer}": v, "user/other": 1e9})
            for s, v in enumerate(values)]


def test_logits_under_the_bound_and_a_short_excursion_raise_nothing():
    w = LogitWatch()
    assert not any(_push(w, [10.0] * 50 + [LOGIT_BOUND * 3] * (LOGIT_STEPS - 1) + [10.0] * 10 + [math.nan, None]))
    assert w.push(0, {"lr": 1.0}) is None  # not reported: nothing read


def test_growth_past_the_bound_warns_once_per_doubling_naming_layer_mechanism_and_fixes():
    w = LogitWatch()
    out = _push(w, [10.0] * 20 + [60.0] * 10 + [120.0] * 10 + [1000.0] * 10)
    events = [e for e in out if e is not None]
    assert [e.step for e in events] == [20 + LOGIT_STEPS - 1, 30 + LOGIT_STEPS - 1, 40 + LOGIT_STEPS - 1]
    first = events[0]
    assert first.kind is Kind.LOGIT_GROWTH and first.level is Level.WARNING and first.layers == ("blocks.1",)
    for word in ("attention-logit growth", "qk-layernorm", "lower learning rate", "z-loss", "blocks.1"):
        assert word in first.message, word
    assert first.values == {"value": 60.0, "bound": LOGIT_BOUND}
    assert events[1].values["bound"] == 2 * LOGIT_BOUND
    assert events[2].values["bound"] == 4 * LOGIT_BOUND and w.next_bound > 1000.0  # one warning for the jump
    q = LogitWatch()
    q.load_state_dict(json.loads(json.dumps(w.state_dict())))
    assert q.state_dict() == w.state_dict()


def _grown(step, value):
    return Event(step=step, kind=Kind.LOGIT_GROWTH, level=Level.WARNING, message="", values={"value": value})


def test_the_policy_lowers_the_learning_rate_at_each_warning_and_stops_at_none():
    p = Policy()
    d = p.decide(5, [_grown(5, 60.0)], Evidence(1.0, 1.0, 4e-3, 2.0))
    assert d.lr_hold == pytest.approx(2e-3) and not d.actions
    assert any("attention-logit growth" in r for r in d.reasons)
    d = p.decide(9, [_grown(9, 120.0)], Evidence(1.0, 1.0, 5e-3, 2.0))  # the loop's rate rose meanwhile
    assert d.lr_hold == pytest.approx(1e-3)  # half the rate it was lowered to, not of the loop's
    q = Policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.logit_lr == pytest.approx(1e-3) and q.logits.state_dict() == p.logits.state_dict()
    warn_only = Policy(PolicyConfig(logit_lr_factor=1.0))
    assert warn_only.decide(5, [_grown(5, 60.0)], Evidence(1.0, 1.0, 4e-3, 2.0)).lr_hold is None
    with pytest.raises(ValueError, match="logit_lr_factor"):
        PolicyConfig(logit_lr_factor=0.0)


def test_watch_warns_and_steps_at_the_lowered_rate_while_the_loops_stays_above_it():
    torch = pytest.importorskip("torch")
    import earlywarn

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ew = earlywarn.watch(model, opt, sinks=[])
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    steps_taken = []
    for step in range(40):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ew.report_loss(loss)
        ew.report("attn_logit_max/blocks.0", torch.tensor(10.0 if step < 20 else 80.0))
        before = model.weight.detach().clone()
        grad = model.weight.grad.detach().clone()
        opt.step()
        steps_taken.append(float(((before - model.weight.detach()).norm() / grad.norm()).item()))
    ew.close()
    kinds = [e.kind for e in ew.events]
    assert kinds.count(Kind.LOGIT_GROWTH) == 1 and kinds.count(Kind.LR_HOLD) == 1
    grown = next(e for e in ew.events if e.kind is Kind.LOGIT_GROWTH)
    assert grown.step == 20 + LOGIT_STEPS - 1 and grown.layers == ("blocks.0",)
    hold = next(e for e in ew.events if e.kind is Kind.LR_HOLD)
    assert "attention-logit growth" in hold.message and hold.values["lr_ceiling"] == pytest.approx(0.05)
    assert steps_taken[5] == pytest.approx(0.1, rel=1e-4) and steps_taken[-1] == pytest.approx(0.05, rel=1e-4)
    assert opt.param_groups[0]["lr"] == 0.1  # the loop's own rate is left as it set it


def test_the_attention_logits_get_no_detector_channel_the_rule_is_their_own():
    """Attention logits grow through a warm-up by design: a relative rule on them (the detector's
    user-signal channel) warned on healthy runs, so they have only their own absolute one."""
    from earlywarn.attention import SIGNAL
    from earlywarn.detect import Observation, StreamingDetector
    from earlywarn.detect.state import OWN_RULE, tracked_user

    assert OWN_RULE == ("user/" + SIGNAL,)
    assert not tracked_user("user/attn_logit_max") and not tracked_user("user/attn_logit_max/blocks.0")
    assert tracked_user("user/attn_entropy") and not tracked_user("loss")
    sd = StreamingDetector()
    alerts = []
    for s in range(300):  # logits growing 2% a step, as in a warm-up; a user signal of the same shape warns
        alerts += sd.observe(Observation(step=s, grad_norm=1.0, loss=2.0,
                                         extras={"user/attn_logit_max/blocks.0": 2.0 * 1.02 ** s}))
    assert sd.user_names == () and not alerts
