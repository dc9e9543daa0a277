"""Optimizer state in forms earlywarn does not know, built here (recover/forms.py): a tensor
subclass of our own that implements none of the ops earlywarn's reads use (``_foreach_norm``,
``isfinite``, ``.to``), one that is not even flattenable, and an optimizer whose ``state_dict()``
lays its state out differently from ``optimizer.state`` (as bitsandbytes' does). The real ones
(torchao's quantized moments, bitsandbytes' 8-bit state) are rows of the conformance matrix."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import earlywarn
from earlywarn.events import Kind, Level
from earlywarn.recover import RecoveryConfig, capture_state, restore_state

torch.set_num_threads(1)
aten = torch.ops.aten


class _Packed(torch.Tensor):
    """A toy quantized moment: float16 codes and one float32 scale behind a float32 appearance.
    Only torch's traceable-subclass protocol and a ``copy_`` / ``detach``: every other op raises
    (as torchao's ``OptimState8bit`` does for ``_foreach_norm``)."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        self.codes, self.scale = codes, scale

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["codes"], inner["scale"])

    def set_values(self, values: torch.Tensor) -> None:
        s = values.abs().amax().clamp_min(1e-30) / 1000.0
        self.scale.copy_(s.reshape(1))
        self.codes.copy_(values / s)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.copy_.default:
            dst, src = args
            if isinstance(src, _Packed):
                dst.codes.copy_(src.codes)
                dst.scale.copy_(src.scale)
            else:
                dst.set_values(src)
            return dst
        if func is aten.detach.default:
            return cls(args[0].codes, args[0].scale)
        raise NotImplementedError(f"{cls.__name__} does not implement {func}")


class Packed(_Packed):
    """The toy moment with a ``dequantize()``: scans and repairs read its values."""

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale


class Opaque(torch.Tensor):
    """A subclass with its own dispatch and no traceable protocol: nothing can read it."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        self.codes, self.scale = codes, scale

    def set_values(self, values: torch.Tensor) -> None:
        _Packed.set_values(self, values)  # type: ignore[arg-type]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Opaque does not implement {func}")


class PackedSGD(torch.optim.Optimizer):
    """SGD with momentum whose buffer is stored in ``form`` (read and written through its parts)."""

    def __init__(self, params, form: type = Packed, lr: float = 0.05, beta: float = 0.9):
        super().__init__(params, {"lr": lr, "beta": beta})
        self.form = form

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = self.form(torch.zeros_like(p, dtype=torch.float16), torch.ones(1))
                buf = st["momentum_buffer"]
                m = buf.codes.float() * buf.scale * g["beta"] + p.grad
                buf.set_values(m)
                p.add_(m, alpha=-g["lr"])


class RepackedSGD(torch.optim.Optimizer):
    """SGD with a velocity under a key no repair rule knows, and a ``state_dict()`` that nests
    it under a key of its own (bitsandbytes nests its quantization state so). ``copies``: its
    ``state_dict()`` clones the tensors, so no live tensor can be found in it."""

    def __init__(self, params, lr: float = 0.05, copies: bool = False):
        super().__init__(params, {"lr": lr})
        self.copies = copies

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "velocity_q" not in st:
                    st["step"] = 0
                    st["velocity_q"] = torch.zeros_like(p)
                st["step"] += 1
                st["velocity_q"].mul_(0.9).add_(p.grad)
                p.add_(st["velocity_q"], alpha=-g["lr"])

    def state_dict(self):
        sd = super().state_dict()
        grab = (lambda t: t.clone()) if self.copies else (lambda t: t)
        sd["state"] = {i: {"step": st["step"], "packed": {"velocity_q": grab(st["velocity_q"])}}
                       for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict):
        sd = copy.deepcopy(state_dict)
        sd["state"] = {i: {"step": st["step"], **st["packed"]} for i, st in sd["state"].items()}
        super().load_state_dict(sd)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _train(model, opt, steps: int, *, options=None, poison=None, before=None):
    """``steps`` steps under ``watch()``; ``poison(opt, step)`` runs after each update; ``before``:
    steps taken before ``watch()``. Returns the watcher and whether a parameter was ever
    non-finite after an update."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps)]
    for x, y in data[:before or 0]:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    ew = earlywarn.watch(model, opt, sinks=[], **(options or {}))
    bad = []
    for i, (x, y) in enumerate(data[before or 0:]):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        opt.step()
        bad.append(not all(bool(torch.isfinite(p).all()) for p in model.parameters()))
        if poison is not None:
            poison(opt, i)
    ew.close()
    return ew, any(bad)


def _poison_scale(at: int):
    def poison(opt, step):
        if step == at:
            with torch.no_grad():
                next(iter(opt.state.values()))["momentum_buffer"].scale[0] = math.nan
    return poison


@pytest.mark.parametrize("form", [Packed, _Packed], ids=["dequantizes", "flattens_only"])
def test_a_subclass_moment_without_foreach_norm_trains_and_its_poison_is_repaired_in_place(form):
    model = _model()
    ew, ever_bad = _train(model, PackedSGD(model.parameters(), form=form), 30, poison=_poison_scale(12))
    repairs = [e for e in ew.events if e.kind is Kind.REPAIR]
    assert len(repairs) == 1 and repairs[0].level is Level.WARNING and repairs[0].values["ok"] == 1.0, repairs
    # read through dequantize(): its rule (a first moment: 0); else its parts, from the snapshot
    assert ("set by zero" if form is Packed else "[momentum_buffer.scale]: 1 set by snapshot") in repairs[0].message
    assert not ever_bad and ew.counters["rewinds"] == 0 and ew.counters["skipped_steps"] == 0
    assert not [e for e in ew.events if e.level >= Level.CRITICAL]


def test_a_subclass_moment_is_snapshotted_and_restored_in_place_through_its_parts():
    model = _model()
    opt = PackedSGD(model.parameters())
    _train(model, opt, 3)
    host = capture_state(3, model=model, optimizer=opt)
    buf = opt.state[model[0].weight]["momentum_buffer"]
    saved = host.wait()["optimizer"]["state"][0]["momentum_buffer"]
    assert type(saved) is Packed and saved.codes.data_ptr() != buf.codes.data_ptr()  # a copy, not an alias
    want = (buf.codes.clone(), buf.scale.clone())
    with torch.no_grad():
        buf.codes.fill_(7)
        buf.scale.fill_(math.nan)
    restore_state(host.wait(), model=model, optimizer=opt)
    assert opt.state[model[0].weight]["momentum_buffer"] is buf  # in place
    assert torch.equal(buf.codes, want[0]) and torch.equal(buf.scale, want[1])


def test_unreadable_state_is_refused_at_watch_with_the_options_that_switch_its_copies_off():
    model = _model()
    opt = PackedSGD(model.parameters(), form=Opaque)
    with pytest.raises(ValueError, match=r"RecoveryConfig\(snapshot_every=0, rewind=False\)") as err:
        _train(model, opt, 4, before=1)
    assert "Opaque" in str(err.value) and "__tensor_flatten__" in str(err.value)
    # with copies off it is watched: the state check and the scans leave it out
    ew, _ = _train(model, opt, 6, before=1, options={"recovery": RecoveryConfig(snapshot_every=0, rewind=False)})
    assert ew.counters["steps"] == 5


def test_unreadable_state_that_appears_after_watch_turns_copies_off_and_never_raises_in_a_step():
    model = _model()
    opt = PackedSGD(model.parameters(), form=Opaque)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ew, ever_bad = _train(model, opt, 20)  # its state is made by the first step, inside watch()
    off = [e for e in ew.events if e.kind is Kind.CHECKPOINT_FAILED]
    assert len(off) == 1 and off[0].signal == "unreadable_state" and "snapshot_every=0" in off[0].message
    assert any("snapshots and disk checkpoints are off" in str(w.message) for w in caught)
    assert ew.counters["steps"] == 20 and not ever_bad and ew.recovery.ring is None


def test_a_state_dict_that_nests_the_state_is_where_the_repair_finds_the_snapshot():
    # velocity_q: no reset rule; the snapshot holds it under "packed" (its state_dict's layout)
    model = _model()

    def poison(opt, step):
        if step == 12:
            with torch.no_grad():
                opt.state[model[0].weight]["velocity_q"][2, 3] = math.nan

    ew, ever_bad = _train(model, RepackedSGD(model.parameters()), 30, poison=poison)
    repairs = [e for e in ew.events if e.kind is Kind.REPAIR]
    assert len(repairs) == 1 and "[velocity_q]: 1 set by snapshot" in repairs[0].message and repairs[0].values["ok"] == 1
    assert not ever_bad and ew.counters["rewinds"] == 0 and ew.counters["repaired_steps"] == 1


def test_a_repair_that_leaves_the_state_non_finite_is_followed_by_no_update():
    # the state_dict holds copies: no snapshot tensor is the live one's, and velocity_q has no rule,
    # so the repair cannot make it finite -- no update may read it: rewound before one does
    model = _model()
    opt = RepackedSGD(model.parameters(), copies=True)
    read = []  # per update applied: was the state it read finite (a pre-hook runs only when step() really runs)
    opt.register_step_pre_hook(lambda o, a, k: read.append(all(bool(torch.isfinite(st["velocity_q"]).all())
                                                               for st in o.state.values())))

    def poison(opt, step):
        if step == 12:
            with torch.no_grad():
                opt.state[model[0].weight]["velocity_q"][2, 3] = math.nan

    ew, ever_bad = _train(model, opt, 30, poison=poison)
    repair = next(e for e in ew.events if e.kind is Kind.REPAIR)
    assert repair.level is Level.CRITICAL and "[velocity_q]: 1 left non-finite (no reset rule" in repair.message
    rewind = next(e for e in ew.events if e.kind is Kind.REWIND)
    assert rewind.step == repair.step and "a repair left non-finite" in rewind.message, rewind.message
    assert "velocity_q" in rewind.message  # what was left, and why
    assert len(read) >= 25 and all(read) and not ever_bad  # no update ever read the NaN
    assert not [e for e in ew.events if e.kind in (Kind.NONFINITE_GRAD, Kind.LOSS_NONFINITE)]


def test_while_no_rewind_is_allowed_state_a_repair_left_non_finite_skips_every_update():
    # a second poisoning within the rewind cooldown: the rewind is not granted, so each step is
    # skipped (said so), and the NaN never reaches the weights
    from earlywarn.policy import PolicyConfig

    model = _model()
    opt = RepackedSGD(model.parameters(), copies=True)
    read = []
    opt.register_step_pre_hook(lambda o, a, k: read.append(all(bool(torch.isfinite(st["velocity_q"]).all())
                                                               for st in o.state.values())))

    def poison(opt, step):
        if step in (8, 14):
            with torch.no_grad():
                opt.state[model[0].weight]["velocity_q"][2, 3] = math.nan

    ew, ever_bad = _train(model, opt, 24, poison=poison, options={"policy": PolicyConfig(rewind_cooldown=100)})
    assert ew.counters["rewinds"] == 1 and all(read) and not ever_bad
    held = [e for e in ew.events if e.kind is Kind.NO_REWIND]
    assert held and "cooldown" in held[0].message and held[0].values["skipped"] == 1.0
    skips = [e for e in ew.events if e.kind is Kind.SKIP]
    assert skips and all("a repair left non-finite" in e.message for e in skips), [e.message for e in skips]


@pytest.mark.parametrize("copies", [False, True], ids=["state_dict_holds_the_live_tensors", "state_dict_copies"])
def test_a_restore_follows_the_optimizers_own_state_dict_layout(copies):
    # in place through the nested layout when it holds the live tensors; else the optimizer's own load
    model = _model()
    opt = RepackedSGD(model.parameters(), copies=copies)
    _train(model, opt, 3)
    host = capture_state(3, model=model, optimizer=opt)
    live = opt.state[model[0].weight]["velocity_q"]
    want = live.clone()
    with torch.no_grad():
        live.fill_(math.nan)
    opt.state[model[0].weight]["step"] = 99
    restore_state(host.wait(), model=model, optimizer=opt)
    now = opt.state[model[0].weight]
    assert torch.equal(now["velocity_q"], want) and now["step"] == 3
    assert (now["velocity_q"] is live) == (not copies)  # in place only where the layout holds the live tensor
