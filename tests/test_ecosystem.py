"""earlywarn inside the ecosystem (issue 22): what a user of these libraries now gets.

Nested optimizer state (heavyball), Lion's hidden NaN moment, Fabric's clip that raised, frozen
LoRA bases in snapshots, EMA copies, wrapper prefixes in layer names, one LR rule, and the
refusals that name their fix.
"""

from __future__ import annotations

import gc
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import earlywarn
from earlywarn.capture.grouping import build_layer_map
from earlywarn.events import Kind
from earlywarn.recover import RecoveryConfig
from earlywarn.recover.hostcopy import optimizer_tensors, to_host
from earlywarn.recover.restore import restore_optimizer
from earlywarn.recover.repair import repair_optimizer_state, scan_state
from earlywarn.recover.snapshot import capture_state
from fixtures_models import MLP

torch.set_num_threads(1)


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=g)
        out.append((x, torch.sin(x @ w)))
    return out


def train(model: nn.Module, opt: torch.optim.Optimizer, ew: earlywarn.Watcher, data, after=None) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if after is not None:
            after(i)
    return losses


def finite_state(opt: torch.optim.Optimizer) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in optimizer_tensors(opt) if t.is_floating_point())


# -- 1. nested optimizer state --------------------------------------------------------------------

@pytest.fixture
def heavyball():
    hb = pytest.importorskip("heavyball")
    before = hb.utils.compile_mode
    hb.utils.compile_mode = None  # eager: compiling on a CPU test machine takes a minute per optimizer
    yield hb
    hb.utils.compile_mode = before


def _nested_run(hb, name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    opt = getattr(hb, name)(model.parameters(), lr=1e-3)
    for x, y in batches(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name", ["AdamW", "SOAP"])
def test_nested_state_is_scanned_repaired_snapshotted_and_restored(heavyball, name):
    model, opt = _nested_run(heavyball, name)
    p = model.hidden.weight
    # heavyball nests: state[p][0]["update_by_adam_exp_avg_sq_0"], SOAP lists of factors
    leaf = next(k for k in opt.state[p][0] if "exp_avg_sq" in k)
    assert isinstance(opt.state[p][0][leaf], torch.Tensor)
    clean = capture_state(3, model=model, optimizer=opt, check_finite=True)
    assert clean.finite()
    v = opt.state[p][0][leaf]
    v.view(-1)[5] = math.nan
    scan = scan_state(model, opt)
    assert [f.where for f in scan.flags] == [f"hidden.weight[0.{leaf}]"]  # was "all 30 tensors finite"
    dirty = capture_state(4, model=model, optimizer=opt, check_finite=True)
    assert not dirty.finite()  # a snapshot taken now is not kept as clean
    report = repair_optimizer_state(opt, scan, snapshot=clean.wait(), model=model)
    assert report.ok and "finite_max" in report.summary()
    assert opt.state[p][0][leaf] is v and bool(torch.isfinite(v).all())
    # restore in place: the same tensor objects get the snapshot's values
    ids = [id(t) for t in optimizer_tensors(opt)]
    v.fill_(7.0)
    restore_optimizer(opt, clean.wait()["optimizer"])
    assert [id(t) for t in optimizer_tensors(opt)] == ids
    assert torch.equal(v, clean.wait()["optimizer"]["state"][2][0][leaf])


def test_nested_state_without_a_rule_is_copied_from_the_snapshot(heavyball):
    model, opt = _nested_run(heavyball, "SOAP")
    p = model.hidden.weight
    q_key = next(k for k in opt.state[p][0] if "_Q_" in k)
    clean = to_host(opt.state_dict())
    q = opt.state[p][0][q_key][0]
    q.view(-1)[0] = math.inf
    scan = scan_state(model, opt)
    report = repair_optimizer_state(opt, scan, snapshot={"model": None, "optimizer": clean.wait()}, model=model)
    assert report.ok and report.repaired[0].action == "snapshot"
    assert torch.equal(q, clean.wait()["state"][2][0][q_key][0])


def test_a_watched_heavyball_run_repairs_nested_state_at_once(heavyball):
    torch.manual_seed(0)
    model = MLP()
    opt = heavyball.AdamW(model.parameters(), lr=3e-3)
    ew = earlywarn.watch(model, opt, sinks=[])

    def poison(i: int) -> None:
        if i == 10:
            st = opt.state[model.hidden.weight][0]
            st[next(k for k in st if "exp_avg_sq" in k)].view(-1)[3] = math.nan

    losses = train(model, opt, ew, batches(40), after=poison)
    ew.close()
    repairs = [e for e in ew.events if e.kind is Kind.REPAIR]
    assert len(repairs) == 1 and repairs[0].step == 11 and "exp_avg_sq" in repairs[0].message
    assert ew.counters["rewinds"] == 0 and finite_state(opt) and all(map(math.isfinite, losses))


# -- 2. Lion: sign(NaN) = 0 hides a NaN moment ----------------------------------------------------

def _lion(kind: str, params):
    if kind == "timm":
        from timm.optim import Lion
    else:
        from lion_pytorch import Lion
    return Lion(params, lr=1e-3)


@pytest.mark.parametrize("kind", ["timm", "lion_pytorch"])
def test_lion_nan_moment_is_repaired_before_the_next_update(kind):
    pytest.importorskip("timm" if kind == "timm" else "lion_pytorch")
    torch.manual_seed(0)
    model = MLP()
    opt = _lion(kind, model.parameters())
    ew = earlywarn.watch(model, opt, sinks=[])
    w = model.hidden.weight

    def poison(i: int) -> None:
        if i == 5:
            opt.state[w]["exp_avg"].view(-1)[7] = math.nan

    frozen_at: list[float] = []
    train(model, opt, ew, batches(8), after=lambda i: (poison(i), frozen_at.append(float(w.view(-1)[7]))))
    ew.close()
    # without the check: the coordinate stops at step 6 and stays (sign(NaN) = 0), nothing alerts
    assert frozen_at[6] != frozen_at[5] and frozen_at[7] != frozen_at[6]
    repairs = [e for e in ew.events if e.kind is Kind.REPAIR]
    assert [e.step for e in repairs] == [6] and "exp_avg" in repairs[0].message
    assert finite_state(opt) and ew.counters["rewinds"] == 0


# -- 3. Fabric's clip with error_if_nonfinite=True ------------------------------------------------

def test_fabric_clip_gradients_error_if_nonfinite_ends_in_a_skip():
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = fabric.setup(model, opt)
    ew = earlywarn.watch(model, opt, sinks=[])
    for i, (x, y) in enumerate(batches(6)):
        loss = F.mse_loss(model(x), y)
        ew.report_loss(loss)
        fabric.backward(loss)
        if i == 3:
            model.hidden.weight.grad[0, 0] = math.inf
        fabric.clip_gradients(model, opt, max_norm=1.0)  # error_if_nonfinite=True by default
        opt.step()
        opt.zero_grad()
    ew.close()
    skips = [e for e in ew.events if e.kind is Kind.SKIP]
    assert [e.step for e in skips] == [3] and ew.counters["skipped_steps"] == 1
    assert finite_state(opt) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # layer names without Fabric's _forward_module. prefix
    assert set(ew.layer_names) == {"inp", "hidden", "out"}
    # gradients no watcher reads still raise, as torch says
    other = nn.Linear(2, 2)
    other.weight.grad = torch.full((2, 2), math.inf)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0, error_if_nonfinite=True)


# -- 4. frozen weights (LoRA) in snapshots ------------------------------------------------------

def _tiny_lora():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def _host_bytes(ring, model: nn.Module) -> int:
    """Unique host bytes the ring's snapshots hold (shared storage counted once; the model's own
    tensors not at all)."""
    live = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    seen, total = set(), 0
    from earlywarn.recover._tree import leaves
    for snap in ring.entries:
        for _, t in leaves(snap.state):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in live and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


def test_lora_snapshots_do_not_copy_the_frozen_base(tmp_path):
    model = _tiny_lora()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    plan: list[str] = []
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(snapshot_every=5, snapshot_keep=3))
    ew.recovery.report_plan(0, write=plan.append)
    g = torch.Generator().manual_seed(0)
    for _ in range(22):
        ids = torch.randint(0, 128, (4, 33), generator=g)
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ew.recovery.settle()
    ring = ew.recovery.ring
    assert len(ring) >= 3
    held = _host_bytes(ring, model)
    assert held <= 0.25 * frozen, f"snapshots hold {held / 1e6:.2f} MB for a {frozen / 1e6:.2f} MB frozen base"
    assert "frozen weights" in plan[0] and "are not copied" in plan[0]
    from earlywarn.recover.frozen import frozen_refs
    refs = frozen_refs(model, opt)
    assert refs._refs and not refs._stepped  # the optimizer holds the adapters only: its steps check no frozen weight
    ew.close()


def test_a_late_unfreeze_is_copied_before_the_optimizer_writes_it():
    torch.manual_seed(0)
    model = MLP()
    model.inp.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ew = earlywarn.watch(model, opt, sinks=[], recovery=RecoveryConfig(snapshot_every=4))
    data = batches(30)
    train(model, opt, ew, data[:6])
    ew.recovery.settle()
    snap = ew.recovery.ring.latest()
    assert snap.state["model"]["inp.weight"].data_ptr() == model.inp.weight.data_ptr()  # referenced
    before = model.inp.weight.detach().clone()
    model.inp.requires_grad_(True)  # a late unfreeze: trained from now on
    opt.add_param_group({"params": list(model.inp.parameters())})
    train(model, opt, ew, data[6:9])
    assert not torch.equal(model.inp.weight, before)  # trained
    held = snap.state["model"]["inp.weight"]
    assert held.data_ptr() != model.inp.weight.data_ptr() and torch.equal(held, before)  # copied in time
    ew.close()


# -- 5. EMA copies ------------------------------------------------------------------------------

def _ema(kind: str, model: nn.Module):
    if kind == "diffusers":
        from diffusers.training_utils import EMAModel
        ema = EMAModel(model.parameters(), decay=0.9)
        return ema, lambda: ema.step(model.parameters())
    if kind == "timm":
        from timm.utils import ModelEmaV3
        ema = ModelEmaV3(model, decay=0.9)
        return ema, lambda: ema.update(model)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    return ema, lambda: ema.update_parameters(model)


def _ema_tensors(ema) -> list[torch.Tensor]:
    return list(ema.shadow_params) if hasattr(ema, "shadow_params") else list(ema.parameters())


@pytest.mark.parametrize("kind", ["diffusers", "timm", "torch"])
def test_an_ema_in_extra_state_is_restored_by_a_rewind(kind):
    pytest.importorskip({"diffusers": "diffusers", "timm": "timm", "torch": "torch"}[kind])
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ema, update = _ema(kind, model)
    ids = [id(t) for t in _ema_tensors(ema)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # passed in extra_state: no warning about it
        ew = earlywarn.watch(model, opt, sinks=[], extra_state={"ema": ema},
                             recovery=RecoveryConfig(snapshot_every=5))

    def after(i: int) -> None:
        if i == 12:  # a NaN reaches the weights (as a bad update would), and the EMA averages it in
            with torch.no_grad():
                model.hidden.weight.view(-1)[0] = math.nan
        update()

    train(model, opt, ew, batches(30), after=after)
    ew.close()
    assert ew.counters["rewinds"] >= 1
    assert all(bool(torch.isfinite(t).all()) for t in _ema_tensors(ema)), "the EMA stayed NaN after the rewind"
    assert len(_ema_tensors(ema)) == len(ids)


def test_an_object_that_adopts_the_tensors_it_is_given_keeps_its_own():
    """diffusers' EMAModel.load_state_dict adopts (a deep copy of) the tensors it is handed: given
    host copies, its shadow weights would move to the host. restore_object hands it its own
    tensors, filled in place, so they stay on their device."""
    from earlywarn.recover.snapshot import restore_object

    class Adopter:
        def __init__(self) -> None:
            self.shadow = [torch.zeros(3), torch.zeros(2)]
            self.count = 0

        def state_dict(self):
            return {"count": self.count, "shadow": self.shadow}

        def load_state_dict(self, sd):
            self.count, self.shadow = sd["count"], sd["shadow"]

    obj = Adopter()
    saved = to_host(obj.state_dict()).wait()
    saved["shadow"][0].fill_(5.0)
    saved["count"] = 7
    ids = [id(t) for t in obj.shadow]
    restore_object(obj, saved)
    assert [id(t) for t in obj.shadow] == ids and obj.count == 7 and float(obj.shadow[0][0]) == 5.0


@pytest.mark.parametrize("kind", ["diffusers", "timm", "torch"])
def test_watch_says_when_an_ema_is_not_in_extra_state(kind):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    my_ema, _ = _ema(kind, model)
    with pytest.warns(RuntimeWarning, match=r"averaged copy of this model's weights .* extra_state=\{'ema': ema\}"):
        ew = earlywarn.watch(model, opt, sinks=[])
    ew.close()
    frozen_ref = MLP()  # a copy that averages nothing (a DPO reference model): no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        del my_ema
        gc.collect()
        ew = earlywarn.watch(model, opt, sinks=[])
    ew.close()
    assert frozen_ref is not None


# -- 6. names and the LR rule -------------------------------------------------------------------

class Rooted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(8))
        self.body = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.pos)


def test_layer_names_carry_no_wrapper_prefix():
    model = Rooted()
    compiled = torch.compile(model)  # lazily: nothing is compiled until called
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    names = set(build_layer_map(compiled, opt).layer_names)
    assert names == {"<root>", "body.inp", "body.hidden", "body.out"}  # not "_orig_mod", "_orig_mod.body.inp"
    dp = nn.DataParallel(model)
    assert set(build_layer_map(dp, torch.optim.SGD(dp.parameters(), lr=0.1)).layer_names) == names

    class Holder(nn.Module):  # the user's own single-attribute module: its name is real
        def __init__(self) -> None:
            super().__init__()
            self.module = MLP()

    h = Holder()
    assert set(build_layer_map(h, torch.optim.SGD(h.parameters(), lr=0.1)).layer_names) == {
        "module.inp", "module.hidden", "module.out"}
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
    assert "layers.0.linear1" in build_layer_map(enc, torch.optim.SGD(enc.parameters(), lr=0.1)).layer_names


def test_peft_names_drop_base_model_model():
    model = _tiny_lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    names = build_layer_map(model, opt).layer_names
    assert "model.layers.0.self_attn.q_proj.lora_A.default" in names
    assert not any(n.startswith("base_model") for n in names)


def test_the_recurrence_reads_the_largest_lr_not_group_0():
    from earlywarn.recover.recurrence import Recurrence

    model = MLP()
    opt = torch.optim.AdamW([{"params": model.inp.parameters(), "lr": 0.0},  # a frozen group first
                             {"params": list(model.hidden.parameters()) + list(model.out.parameters()), "lr": 3e-3}])
    from earlywarn.recover.window import CleanWindow

    rec = Recurrence(opt, factor=0.5, lr_steps=10, history=50, window=CleanWindow(5))
    assert rec.live_lr() == 3e-3
    ew = earlywarn.watch(model, opt, sinks=[])  # what a step records: the LR it took, the largest group's
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    rec = ew.recovery.recurrence
    assert rec._lr[-1] == (0, 3e-3)
    assert rec.lr_trend(1) == "learning rate (largest over param groups): 0.003 at step 1"
    ew.close()


# -- 7. refusals that name the fix ----------------------------------------------------------------

def test_one_optimizer_over_two_models_names_module_dict():
    g, d = MLP(), MLP()
    opt = torch.optim.Adam(list(g.parameters()) + list(d.parameters()))
    with pytest.raises(ValueError, match=r"nn.ModuleDict\(\{'generator': G, 'discriminator': D\}\)"):
        earlywarn.watch(g, opt, sinks=[])
    ew = earlywarn.watch(nn.ModuleDict({"generator": g, "discriminator": d}), opt, sinks=[])  # the fix works
    ew.close()


def test_optimizer_in_backward_is_refused_with_the_reason():
    model = MLP()
    optim_dict = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

    class OptimizerInBackwardWrapper:  # torchtune.training.memory's, as its recipes build it
        def __init__(self, optim_map):
            self.optim_map = optim_map

    wrapper = OptimizerInBackwardWrapper({n: optim_dict[p] for n, p in model.named_parameters()})
    for given in (wrapper, optim_dict):
        with pytest.raises(ValueError, match="optimizer_in_bwd=False"):
            earlywarn.watch(model, given, sinks=[])
