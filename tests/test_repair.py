"""Repair of poisoned parameters / optimizer state, with real training before and after."""

from __future__ import annotations

import math

import pytest
import torch

from earlywarn.events import Kind, Level
from earlywarn.recover import Recovery, RecoveryConfig, repair_optimizer_state, scan_state

torch.set_num_threads(1)

STEPS, BAD_STEP, SNAP_EVERY = 80, 30, 10


def make_data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, 16, 6, generator=g)
    w = torch.randn(6, 1, generator=g)
    y = torch.sin(x @ w) + 0.05 * torch.randn(STEPS, 16, 1, generator=g)
    return x, y


def make_model(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def eval_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x.reshape(-1, 6)), y.reshape(-1, 1)))


def train(mode: str, opt_name: str = "adam"):
    """mode: "clean" (no corruption), "clean_skip" (the bad step is not applied), "unguarded"
    (the inf gradient coordinate goes through the optimizer), "repaired" (unguarded, then
    Recovery.repair)."""
    x, y = make_data()
    model = make_model()
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if opt_name == "adam"
           else torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9))
    events = []
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=SNAP_EVERY), emit=events.append)
    losses, report = [], None
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[step - 1]), y[step - 1])
        loss.backward()
        losses.append(loss.item())
        if step == BAD_STEP and mode != "clean":
            if mode == "clean_skip":
                rec.after_step(step, clean=False)
                continue
            model[0].weight.grad[3, 2] = math.inf  # one corrupted gradient coordinate
        opt.step()
        if step == BAD_STEP and mode == "repaired":
            report = rec.repair(step)
        rec.after_step(step, clean=step < BAD_STEP or step > BAD_STEP + 20)
    return model, opt, losses, eval_loss(model, x, y), report, events


def all_finite(model, opt) -> bool:
    return scan_state(model, opt).clean


def test_unguarded_inf_step_poisons_adam_and_repair_recovers_close_to_a_clean_run():
    _, _, _, clean_final, _, _ = train("clean_skip")
    _, _, _, uncorrupted_final, _, _ = train("clean")
    m_u, o_u, losses_u, final_u, _, _ = train("unguarded")
    # the control: without repair the poison spreads and training is lost
    assert not math.isfinite(final_u) and not all_finite(m_u, o_u)

    model, opt, losses, final, report, events = train("repaired")
    assert report is not None and report.ok and not report.needs_rewind
    found = {(f.name, f.key): f.nonfinite for f in report.scan.flags}
    assert found == {("0.weight", None): 1, ("0.weight", "exp_avg"): 1, ("0.weight", "exp_avg_sq"): 1}
    done = {(a.name, a.key): a.action for a in report.repaired}
    assert done == {("0.weight", None): "snapshot", ("0.weight", "exp_avg"): "zero",
                    ("0.weight", "exp_avg_sq"): "finite_max"}
    assert all(math.isfinite(v) for v in losses)
    assert all_finite(model, opt)
    assert abs(final - clean_final) / clean_final < 0.02
    assert abs(final - uncorrupted_final) / uncorrupted_final < 0.005
    assert [e.kind for e in events].count(Kind.REPAIR) == 1


def test_sgd_momentum_is_repaired_too():
    # vs the run without the corrupted coordinate (skipping the whole step costs SGD ~4% here)
    _, _, _, clean_final, _, _ = train("clean", "sgd")
    model, opt, losses, final, report, _ = train("repaired", "sgd")
    assert {(a.key, a.action) for a in report.repaired} == {(None, "snapshot"), ("momentum_buffer", "zero")}
    assert all(math.isfinite(v) for v in losses) and all_finite(model, opt)
    assert abs(final - clean_final) / clean_final < 0.005


def test_reset_values_per_state_kind_and_nothing_else_touched():
    x, y = make_data()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    for step in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
    p = model[2].weight
    st = opt.state[p]
    st["exp_avg_sq"][0, 4] = math.nan      # state-only poisoning: the parameter is still finite
    st["max_exp_avg_sq"][0, 7] = math.inf
    before = {k: v.clone() for k, v in st.items()}
    params_before = [q.clone() for q in model.parameters()]

    scan = scan_state(model, opt)
    assert scan.state_poisoned and not scan.params_poisoned and scan.first_layer == "2.weight"
    report = repair_optimizer_state(opt, scan, model=model)
    assert report.ok
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask[0, 4] = mask[0, 7] = True  # the union over m, v, max_v of this parameter
    fin_v = before["exp_avg_sq"][torch.isfinite(before["exp_avg_sq"]) & ~mask]
    fin_mv = before["max_exp_avg_sq"][torch.isfinite(before["max_exp_avg_sq"]) & ~mask]
    assert torch.all(st["exp_avg"][mask] == 0)
    assert torch.all(st["exp_avg_sq"][mask] == fin_v.max())
    assert torch.all(st["max_exp_avg_sq"][mask] == fin_mv.max())
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(st[k][~mask], before[k][~mask])
    assert torch.equal(st["step"], before["step"])  # step unchanged
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params_before))

    # training goes on finite (without the repair the next step writes NaN into the parameter)
    for step in range(5, 15):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
    assert all_finite(model, opt)


def test_params_without_snapshot_ask_for_rewind_and_unknown_keys_are_reported():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = make_data()
    torch.nn.functional.mse_loss(model(x[0]), y[0]).backward()
    opt.step()
    with torch.no_grad():
        model[0].bias[1] = math.nan
    opt.state[model[0].bias]["custom_trace"] = torch.tensor([math.inf, 1.0])
    report = repair_optimizer_state(opt, scan_state(model, opt), model=model)
    assert not report.ok and report.needs_rewind
    reasons = {(a.name, a.key): a.reason for a in report.unrepaired}
    assert "no clean snapshot" in reasons[("0.bias", None)]
    assert "custom_trace" in reasons[("0.bias", "custom_trace")]
    assert "rewind" in report.summary()


def test_too_many_poisoned_parameters_are_not_patched_from_an_old_snapshot():
    x, y = make_data()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=1, repair_max_param_fraction=0.01))
    torch.nn.functional.mse_loss(model(x[0]), y[0]).backward()
    opt.step()
    rec.after_step(1, clean=True)
    with torch.no_grad():
        model[0].weight.fill_(math.nan)  # 192 of 257 elements: a rewind, not a patch
    report = rec.repair(2)
    assert report.needs_rewind and any("max_param_fraction" in (a.reason or "") for a in report.unrepaired)


def test_reset_state_false_copies_state_from_the_snapshot():
    x, y = make_data()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=1, repair_reset_state=False))
    for step in range(1, 4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
        rec.after_step(step, clean=True)
    snap_v = rec.ring.latest().state["optimizer"]["state"][0]["exp_avg_sq"][1, 1].item()
    opt.state[model[0].weight]["exp_avg_sq"][1, 1] = math.inf
    report = rec.repair(4)
    assert report.ok
    assert {(a.key, a.action) for a in report.repaired} == {("exp_avg_sq", "snapshot"), ("exp_avg", "snapshot")}
    assert opt.state[model[0].weight]["exp_avg_sq"][1, 1].item() == snap_v


def test_poisoned_state_is_never_snapshotted_as_clean():
    x, y = make_data()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    events = []
    rec = Recovery(model, opt, RecoveryConfig(snapshot_every=2), emit=events.append)
    for step in range(1, 4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        opt.step()
        rec.after_step(step, clean=True)
    assert [s.step for s in rec.ring.entries] == [1, 3]
    opt.state[model[2].weight]["exp_avg"][0, 0] = math.nan  # nobody noticed
    rec.after_step(5, clean=True)
    assert [s.step for s in rec.ring.entries] == [1, 3]  # no snapshot of poisoned state
    assert [e.kind for e in events] == [Kind.REPAIR] and all_finite(model, opt)


@pytest.mark.parametrize("fused", [False, True])
def test_watch_one_inf_coordinate_keeps_everything_finite_and_matches_a_clean_skip(fused):
    import earlywarn

    def run(watched: bool):
        x, y = make_data()
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        ew = earlywarn.watch(model, opt, sinks=[]) if watched else None
        finite_always = True
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[step - 1]), y[step - 1])
            loss.backward()
            if ew is not None:
                ew.report_loss(loss)
            if step == BAD_STEP:
                if not watched:
                    continue  # the clean run skips the same batch
                model[0].weight.grad[3, 2] = math.inf
            opt.step()
            finite_always &= scan_state(model, opt).clean
        return eval_loss(model, x, y), finite_always, ew

    clean_final, _, _ = run(watched=False)
    final, finite_always, ew = run(watched=True)
    assert finite_always
    assert abs(final - clean_final) / clean_final < 0.02
    assert ew.counters["skipped_steps"] == 1 and ew.counters["rewinds"] == 0
    skips = [e for e in ew.events if e.kind == Kind.SKIP]
    assert len(skips) == 1 and skips[0].layers == ("0",)  # the first Linear (grouped per module)


# ---------------------------------------------------------------------------------------------
# Non-finite values that belong to the model (issue 11, item 1)


class MaskedLM(torch.nn.Module):
    """Written the way many models are: a float causal mask buffer with -inf above the diagonal
    (``nn.Transformer.generate_square_subsequent_mask``), a -inf padding bias buffer, BatchNorm
    (running statistics and an int counter) and a frozen table holding an inf."""

    def __init__(self, T: int = 8, d: int = 16, vocab: int = 20):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(T))
        pad = torch.zeros(vocab)
        pad[0] = -math.inf  # token 0 is padding: never predicted
        self.register_buffer("pad_bias", pad)
        self.norm = torch.nn.BatchNorm1d(d)
        self.frozen = torch.nn.Parameter(torch.tensor([1.0, math.inf]), requires_grad=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.attn(x, x, x, attn_mask=self.mask, need_weights=False)[0]
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x) + self.pad_bias


def lm_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(1, 20, (8, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def test_a_causal_mask_padding_bias_and_frozen_inf_are_the_models_own_not_poison(tmp_path):
    import earlywarn

    torch.manual_seed(0)
    model = MaskedLM()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    ew = earlywarn.watch(model, opt, sinks=[],
                         recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    g = torch.Generator().manual_seed(1)
    for _ in range(80):
        x, y = lm_batch(g)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1))
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not [e for e in ew.events if e.kind is Kind.REPAIR or e.level >= Level.WARNING]
    assert [(s.step, s.clean) for s in ew.recovery.ring.entries] == [(25, True), (50, True), (75, True)]
    scan = ew.recovery.scan()
    assert scan.clean and {f.where: f.nonfinite for f in scan.owned} == {
        "frozen": 1, "mask[buffer]": 28, "pad_bias[buffer]": 1}
    assert "the model's own non-finite values are not poison" in scan.summary()
    def steps(n: int) -> None:
        for _ in range(n):
            x, y = lm_batch(g)
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1))
            ew.report_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()

    # poisoned state is repaired before the next update reads it (the per-step state check)
    opt.state[model.head.weight]["exp_avg"].fill_(math.nan)
    steps(1)
    assert ew.counters["repaired_steps"] == 1 and ew.counters["rewinds"] == 0 and ew.recovery.scan().clean
    # poisoned weights still rewind (before: "no snapshot or checkpoint to rewind to")
    with torch.no_grad():
        model.head.weight.fill_(math.nan)
    steps(3)
    assert ew.counters["rewinds"] == 1 and ew.recovery.scan().clean
    assert int((~torch.isfinite(model.mask)).sum()) == 28  # the mask is as it was
    ew.close()


def test_a_buffer_poisoned_where_it_was_finite_is_poison_and_only_those_coordinates():
    from earlywarn.recover import FiniteBaseline

    model = MaskedLM()
    base = FiniteBaseline.capture(model)
    with torch.no_grad():
        model.mask[5, 0] = math.nan  # below the diagonal: it was 0
        model.mask[0, 5] = math.nan  # above it: it was -inf, now NaN -- still the mask's own non-finite place
        model.norm.running_var[3] = math.inf
    scan = scan_state(model, None, base)
    assert {f.where: f.nonfinite for f in scan.flags} == {"mask[buffer]": 1, "norm.running_var[buffer]": 1}
    # a buffer re-created with another shape is taken as it is until the next refresh
    model.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(12))
    model.norm.running_var.fill_(1.0)
    assert scan_state(model, None, base).clean
    base.refresh(model)
    with torch.no_grad():
        model.mask[11, 0] = math.nan
    assert [f.where for f in scan_state(model, None, base).flags] == ["mask[buffer]"]


@pytest.mark.parametrize("at", [0, 30])
def test_a_nan_batch_through_batchnorm_costs_one_skip_and_its_running_stats_are_repaired(tmp_path, at):
    import earlywarn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    x, y = make_data()
    for step in range(50):
        xb = x[step].clone()
        if step == at:
            xb[2, 1] = math.nan  # one corrupt sample: BatchNorm's forward writes NaN into its statistics
        loss = torch.nn.functional.mse_loss(model(xb), y[step])
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == at:
            assert torch.isfinite(model[1].running_mean).all() and torch.isfinite(model[1].running_var).all()
    assert ew.counters["skipped_steps"] == 1 and ew.counters["rewinds"] == 0
    assert ew.counters["repaired_steps"] == 1
    assert [e.kind for e in ew.events if e.kind in (Kind.SKIP, Kind.REPAIR, Kind.QUARANTINE, Kind.REWIND)] == [
        Kind.SKIP, Kind.REPAIR, Kind.QUARANTINE]
    assert scan_state(model, opt).clean
    ew.close()


def test_every_repair_counts_once_whichever_check_found_the_poison(tmp_path):
    # A moment poisoned by the update of a snapshot step is found by the snapshot's finiteness
    # flag (that step's copy is dropped, the state repaired); one poisoned between snapshots by the
    # next step's state check. Both are repairs: the counter, the metric and the events agree.
    import earlywarn

    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(
        snapshot_every=5, state_check_every=1, quarantine_path=str(tmp_path / "q.jsonl")))
    poison_after = {10, 17}  # a snapshot step's update, and a step between snapshots

    def poison(o, args, kwargs):
        if ew.step - 1 in poison_after:
            o.state[model[0].weight]["exp_avg_sq"][0, 0] = math.nan

    hook = opt.register_step_post_hook(poison)
    x, y = make_data()
    for step in range(24):
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
    hook.remove()
    repairs = [e for e in ew.events if e.kind is Kind.REPAIR]
    assert len(repairs) == 2 and all(e.values["repaired"] > 0 and e.values["ok"] == 1.0 for e in repairs), repairs
    assert ew.counters["repaired_steps"] == 2 and ew.counters["rewinds"] == 0
    assert ew.recovery.scan().clean
    ew.close()


class _Forwarding(torch.optim.Optimizer):
    """The pattern of accelerate's AcceleratedOptimizer: the wrapped optimizer's groups and state
    handed out as its own."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    state = property(lambda self: self.optimizer.state)
    param_groups = property(lambda self: self.optimizer.param_groups)
    defaults = property(lambda self: self.optimizer.defaults)

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_optimizer_state_is_read_where_it_lives():
    # timm's Lookahead keeps AdamW's moments in the wrapped optimizer (its own `state` stays
    # empty): both are holders. A wrapper that hands out the wrapped one's `state` is one holder,
    # and one that wraps a Lookahead still reaches the moments.
    pytest.importorskip("timm")
    from timm.optim import create_optimizer_v2

    from earlywarn.recover.holders import state_holders, state_of

    model = make_model()
    plain = torch.optim.AdamW(model.parameters())
    lookahead = create_optimizer_v2(model, "lookahead_adamw")
    assert state_holders(plain) == [plain] and state_holders(_Forwarding(plain))[1:] == []
    assert state_holders(lookahead) == [lookahead, lookahead._base_optimizer]
    outer = _Forwarding(lookahead)
    assert state_holders(outer)[1:] == [lookahead._base_optimizer]
    x, y = make_data()
    torch.nn.functional.mse_loss(model(x[0]), y[0]).backward()
    outer.step()
    assert not lookahead.state and set(state_of(outer)) == set(model.parameters())
    assert set(state_of(outer)[model[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_zero1_view_copies_and_never_keeps_its_optimizer_alive():
    # The view earlywarn keeps of a ZeroRedundancyOptimizer lives beside it: it deep-copies (a
    # forwarding __getattr__ must not recurse before __init__ ran) and lets the optimizer go.
    import copy
    import gc
    import weakref

    from earlywarn.recover.holders import ZeroState

    opt = torch.optim.AdamW(make_model().parameters())
    view = ZeroState(opt)
    assert view.zero is opt and view.param_groups is opt.param_groups
    assert copy.deepcopy(view).zero is opt
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None and view.zero is None
