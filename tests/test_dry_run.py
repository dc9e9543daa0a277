"""``watch(dry_run=True)``: everything judged and reported, nothing done. With a fault injected,
the watched run's tensors are bit for bit those of the run without earlywarn, and every action the
guard would have taken is an event marked as not done (and counted as ``would_<kind>``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import earlywarn
from earlywarn.events import DRY_RUN, Kind
from earlywarn.recover import RecoveryConfig

torch.set_num_threads(1)

STEPS, FAULT_AT = 40, 20
ACTIONS = {Kind.SKIP, Kind.CLIP, Kind.REPAIR, Kind.REWIND, Kind.NO_REWIND, Kind.LR_HOLD, Kind.QUARANTINE, Kind.HALT}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN compares equal to the same NaN)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for p in model.parameters()]
    for p in model.parameters():
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def _run(fault: str, watched: bool, tmp_path) -> tuple[list[torch.Tensor], list[float], "earlywarn.Watcher | None"]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(STEPS)]
    step = {"n": 0}
    if fault == "poison_state":
        def poison(o, args, kwargs):
            if step["n"] == FAULT_AT:
                with torch.no_grad():
                    o.state[model[0].weight]["exp_avg_sq"][3, 2] = math.nan
        opt.register_step_post_hook(poison)
    if fault in ("inf_grad", "huge_grad"):
        value = math.inf if fault == "inf_grad" else 1e20

        def grad_hook(grad):
            if step["n"] != FAULT_AT:
                return None
            grad = grad.clone()
            grad[1, 1] = value
            return grad
        model[0].weight.register_hook(grad_hook)
    ew = earlywarn.watch(model, opt, sinks=[], dry_run=True,
                         recovery=RecoveryConfig(state_check_every=1, quarantine_path=str(tmp_path / "q.jsonl"))) \
        if watched else None
    losses = []
    try:
        for i, (x, y) in enumerate(data):
            step["n"] = i
            if fault == "nan_sample" and i == FAULT_AT:
                x = x.clone()
                x[0] = math.nan
            if fault == "lr_spike" and i == FAULT_AT:
                for grp in opt.param_groups:
                    grp["lr"] = 30.0  # a schedule gone wrong: the run diverges from here
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            if ew is not None:
                ew.report_loss(loss)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        if ew is not None:
            ew.close()
    return [t.detach().clone() for t in _tensors(model, opt)], losses, ew


@pytest.mark.parametrize("fault", ["inf_grad", "nan_sample", "poison_state", "huge_grad", "lr_spike"])
def test_a_dry_run_leaves_the_run_bit_for_bit_as_without_earlywarn_and_says_what_it_would_have_done(fault, tmp_path):
    bare, bare_losses, _ = _run(fault, False, tmp_path)
    dry, dry_losses, ew = _run(fault, True, tmp_path)
    assert len(bare) == len(dry)
    for i, (a, b) in enumerate(zip(bare, dry)):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), f"tensor #{i} differs from the bare run's"
    assert [_bits(torch.tensor(v)).tolist() for v in bare_losses] == [_bits(torch.tensor(v)).tolist() for v in dry_losses]
    acted = [e for e in ew.events if e.kind in ACTIONS]
    assert acted, f"{fault}: a dry run said nothing it would have done"
    for e in acted:  # each says it was not done, and carries the mark the trackers see
        assert e.message.startswith(DRY_RUN) and e.values.get("dry_run") == 1.0, str(e)
    c = ew.counters
    assert c["skipped_steps"] == c["rewinds"] == c["repaired_steps"] == 0, c
    for kind in {e.kind for e in acted}:
        assert c[f"would_{kind}"] == sum(e.kind is kind for e in acted), (kind, c)
    if fault in ("inf_grad", "nan_sample"):
        assert c["would_skip"] >= 1
    if fault == "poison_state":
        assert c["would_repair"] >= 1


def test_dry_run_is_validated():
    with pytest.raises(ValueError, match="dry_run='yes'"):
        earlywarn.watch(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), sinks=[], dry_run="yes")
