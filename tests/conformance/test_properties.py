"""Property-based conformance: random small models x optimizers x faults x fault steps x options, the
same invariants as the matrix (harness.check_invariants).

Derandomized (the same examples on every CI run: a failure reproduces), bounded in examples and
steps so the whole file takes well under a minute on two cores.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import earlywarn
from harness import FAULTS, CellResult, Fault, Injector, check_invariants, guarded_run

torch.set_num_threads(1)

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.03),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=3e-3, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=3e-3, foreach=True, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=3e-3),
}


@st.composite
def cells(draw):
    depth = draw(st.integers(1, 3))
    width = draw(st.sampled_from([4, 16, 33]))
    return {
        "depth": depth,
        "width": width,
        "norm": draw(st.booleans()),
        "batch": draw(st.sampled_from([2, 8, 64])),
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "fault": draw(st.sampled_from(FAULTS)),
        "fault_step": draw(st.integers(0, 30)),
        "group_by": draw(st.sampled_from(["module", "depth:1", 1])),
        "snapshot_every": draw(st.sampled_from([None, 1, 7, 1000])),
        "report_loss": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(c: dict) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(6, c["width"])]
    for _ in range(c["depth"] - 1):
        if c["norm"]:
            layers.append(nn.LayerNorm(c["width"]))
        layers += [nn.Tanh(), nn.Linear(c["width"], c["width"])]
    layers += [nn.Tanh(), nn.Linear(c["width"], 1)]
    return nn.Sequential(*layers)


def run_cell(c: dict, steps: int = 36) -> CellResult:
    torch.manual_seed(c["seed"])
    model = build(c)
    opt = OPTIMIZERS[c["optimizer"]](model.parameters())
    g = torch.Generator().manual_seed(c["seed"] + 1)
    w_true = torch.randn(6, 1, generator=g)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    fault = Fault(c["fault"], step=c["fault_step"])
    inj = Injector(fault, model=model, param=linears[len(linears) // 2].weight, input_module=linears[0],
                   optimizer=lambda: opt)
    options: dict = {"sinks": [], "group_by": c["group_by"]}
    if c["snapshot_every"] is not None:
        options["recovery"] = earlywarn.RecoveryConfig(snapshot_every=c["snapshot_every"])

    def one_step(w: earlywarn.Watcher, _: int) -> float:
        x = torch.randn(c["batch"], 6, generator=g)
        y = torch.tanh(x @ w_true) + 0.1 * torch.randn(c["batch"], 1, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        if c["report_loss"]:
            w.report_loss(loss)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return guarded_run(f"random_{c['optimizer']}", fault, model, opt, inj, range(steps), one_step, **options)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(c=cells())
def test_random_cells_keep_the_invariants(c, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cell(c)
    if c["fault"] == "poison_state" and not r.injector.fired:
        return  # plain SGD keeps no state to poison
    check_invariants(r)


@pytest.mark.parametrize("fault", ["inf_grad", "nan_sample"])
def test_a_fault_at_the_very_first_step_costs_one_skip(fault, tmp_path, monkeypatch):
    # before: a NaN loss at step 0 halted the run (nothing to rewind to)
    monkeypatch.chdir(tmp_path)
    c = {"depth": 2, "width": 16, "norm": False, "batch": 8, "optimizer": "adam", "fault": fault, "fault_step": 0,
         "group_by": "module", "snapshot_every": None, "report_loss": True, "seed": 3}
    check_invariants(run_cell(c))
