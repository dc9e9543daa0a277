"""The conformance harness: one fault injected into training code earlywarn did not write, and the
invariants every cell of the matrix must satisfy.

Faults go in through hooks that any model and optimizer accept, so the loop under test stays exactly
as its authors wrote it (a Hugging Face ``Trainer``, a Lightning ``Trainer``, a nanoGPT loop):

* ``inf_grad``     one gradient coordinate of one weight set to +inf during backward (a tensor hook)
* ``nan_sample``   one sample of one batch turned to NaN at the model's input layer (a forward hook):
                   its loss and gradients are NaN, and BatchNorm's running stats see it too
* ``poison_state`` one coordinate of the optimizer's state set to NaN right after a real step
                   (a step post-hook): the next update writes NaN into the weights (for Adam;
                   some optimizers overwrite that state and heal on their own)
* ``huge_grad``    one gradient coordinate set to 1e20: finite, and its fp32 square overflows
* ``none``         a healthy run

Steps are counted in training forwards of the input layer (micro-batches), so the harness does not
depend on how the loop counts its own steps.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

import earlywarn
from earlywarn.events import Event, Kind, Level

FAULTS = ("none", "inf_grad", "nan_sample", "poison_state", "huge_grad")
# State keys poisoned first (the ones whose corruption survives: Adam's second moment first;
# bitsandbytes' 8-bit moments are uint8 codes, a block's NaN is its absmax)
_STATE_PREFERENCE = ("exp_avg_sq", "exp_avg", "momentum_buffer", "square_avg", "sum", "acc_delta",
                     "exp_inf", "ax", "prev", "row_var", "col_var", "variance", "absmax1")


def values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as a plain tensor: a tensor subclass's own ``dequantize()`` (torchao's
    quantized moments implement little else: no ``isfinite``, no ``clone``), else the tensor."""
    own = getattr(type(t), "dequantize", torch.Tensor.dequantize) is not torch.Tensor.dequantize
    return t.dequantize() if own else t


@dataclass
class Fault:
    kind: str = "none"
    step: int = 25
    """Optimizer step (0-based) whose micro-batch carries the fault."""

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"fault kind {self.kind!r}: use one of {FAULTS}")


def state_leaves(tree: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a per-parameter optimizer state, nested to any depth (heavyball keeps
    ``state[p][0]["update_by_adam_exp_avg_0"]``, lists of factors): the harness's own walk, so that
    it does not share a bug with earlywarn's."""
    if isinstance(tree, torch.Tensor):
        return [(path, tree)]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out = []
    for k, v in items:
        out += state_leaves(v, f"{path}.{k}" if path else str(k))
    return out


def _states(opt: torch.optim.Optimizer) -> list[Any]:
    """``opt.state`` and that of every optimizer it wraps (timm's Lookahead keeps the moments in
    its base optimizer's ``state``, its own stays empty)."""
    out, todo, seen = [], [opt], set()
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        out.append(o.state)
        todo += [v for v in vars(o).values() if isinstance(v, torch.optim.Optimizer)]
    return out


def _floating_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    found = [(k, v) for state in _states(opt) for k, v in state_leaves(state.get(p, {}))
             if v.is_floating_point() and v.numel() > 1]
    for key in _STATE_PREFERENCE:
        for k, v in found:
            if k.rsplit(".", 1)[-1] == key:
                return k, v
    for key in _STATE_PREFERENCE:  # nested names that carry the moment's name (update_by_adam_exp_avg_sq_0)
        for k, v in found:
            if key in k.rsplit(".", 1)[-1]:
                return k, v
    return found[0] if found else None


def _plain_copy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return values(x.detach()).clone()
    if isinstance(x, dict):
        return {k: _plain_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain_copy(v) for v in x]
    return copy.deepcopy(x)


def _clone_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[Any]]:
    params = [p.detach().clone() for p in model.parameters()]
    return params, [[_plain_copy(state.get(p, {})) for state in _states(opt)] for p in model.parameters()]


def _diff(a: Any, b: Any, where: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return None if same else f"state {where!r} changed"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"state keys at {where!r} changed: {sorted(map(str, a))} -> {sorted(map(str, b))}"
        return next((d for k in a if (d := _diff(a[k], b[k], f"{where}.{k}" if where else str(k)))), None)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _diff(x, y, f"{where}[{i}]"))), None)
    return None if a == b else f"state {where!r} changed"


def _bit_identical(a: tuple[list[torch.Tensor], list[Any]], b: tuple[list[torch.Tensor], list[Any]]) -> str | None:
    """None when identical, else what differs."""
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        if not torch.equal(x, y):
            return f"parameter #{i} changed"
    for i, (sa, sb) in enumerate(zip(a[1], b[1])):
        d = _diff(sa, sb, "")
        if d is not None:
            return f"{d} (parameter #{i})"
    return None


class Injector:
    """Puts one :class:`Fault` into a run through hooks, and watches the skipped step.

    ``param``: the weight whose gradient or state is corrupted; ``input_module``: the layer whose
    output carries the NaN sample (and whose training forwards count micro-batches);
    ``accum``: micro-batches per optimizer step; ``optimizer``: a callable giving the torch optimizer
    (it may not exist yet when the hooks are installed, e.g. inside a Trainer).
    """

    def __init__(self, fault: Fault, *, model: nn.Module, param: torch.Tensor, input_module: nn.Module,
                 optimizer: Callable[[], torch.optim.Optimizer | None], accum: int = 1):
        self.fault = fault
        self.model = model
        self.param = param
        self.accum = accum
        self._optimizer = optimizer
        self.micro = -1  # index of the current training micro-batch
        self.fired = False
        self.before: tuple[list[torch.Tensor], list[Any]] | None = None
        self.skip_diff: str | None = None  # what changed across the skipped step (None: nothing)
        self.skip_checked = False
        self.nonfinite_at_start: dict[str, torch.Tensor] = {}
        # never traced into a compiled model: the harness counts and injects eagerly, as on any model
        self._hooks = [input_module.register_forward_pre_hook(torch.compiler.disable(self._pre)),
                       input_module.register_forward_hook(torch.compiler.disable(self._post))]
        if fault.kind in ("inf_grad", "huge_grad"):
            self._hooks.append(param.register_hook(self._grad))
        self._post_hook = None
        with torch.no_grad():
            for name, b in model.named_buffers():
                if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                    self.nonfinite_at_start[name] = ~torch.isfinite(b)

    # -- hooks ---------------------------------------------------------------------------------
    @property
    def target_micro(self) -> int:
        return self.fault.step * self.accum + self.accum - 1  # the last micro-batch of that step

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        self.micro += 1
        opt = self._optimizer()
        if self.fault.kind == "poison_state" and self._post_hook is None and opt is not None:
            self._post_hook = opt.register_step_post_hook(self._poison)
        if self.fault.kind in ("inf_grad", "nan_sample") and opt is not None:
            if self.micro == self.fault.step * self.accum:
                self.before = _clone_state(self.model, opt)  # parameters don't move until the step
            elif self.before is not None and not self.skip_checked and self.micro == (self.fault.step + 1) * self.accum:
                self.skip_diff = _bit_identical(self.before, _clone_state(self.model, opt))
                self.skip_checked = True

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.fault.kind != "nan_sample" or self.fired or self.micro != self.target_micro:
            return None
        if not (module.training and torch.is_grad_enabled()):
            return None
        self.fired = True
        out = output.clone()
        out[0] = float("nan")
        return out

    def _grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.fired or self.micro != self.target_micro:
            return None
        self.fired = True
        value = math.inf if self.fault.kind == "inf_grad" else 1e20
        if grad.is_sparse:  # nn.Embedding(sparse=True): corrupt one stored value
            grad = grad.coalesce()
            values = grad._values().clone()
            values.view(-1)[values.numel() // 3] = value
            return torch.sparse_coo_tensor(grad._indices(), values, grad.shape)
        grad = grad.clone()
        grad.view(-1)[grad.numel() // 3] = value
        return grad

    def _poison(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.fired or self.micro < self.target_micro:
            return
        found = _floating_state(opt, self.param)
        if found is None:
            return
        self.fired = True
        with torch.no_grad():
            v = values(found[1])
            v.view(-1)[v.numel() // 3] = math.nan
            if v is not found[1]:
                found[1].copy_(v)  # a quantized moment: its own copy_ re-quantizes (a NaN block scale)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        if self._post_hook is not None:
            self._post_hook.remove()


@dataclass
class CellResult:
    codebase: str
    fault: Fault
    events: list[Event]
    counters: dict[str, int]
    exception: BaseException | None
    injector: Injector
    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    applicable: bool = True
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """More training state that must end finite (an EMA of the weights passed in extra_state)."""


def nonfinite_tensors(model: nn.Module, opt: torch.optim.Optimizer,
                      allowed: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Parameters, optimizer state and buffers holding NaN/Inf (buffer coordinates that were
    already non-finite when the run started, such as a causal mask's -inf, are the model's own)."""
    bad = []
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not bool(torch.isfinite(p).all()):
                bad.append(n)
            for k, v in (kv for state in _states(opt) for kv in state_leaves(state.get(p, {}))):
                if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(values(v)).all()):
                    bad.append(f"{n}[{k}]")
        for n, b in model.named_buffers():
            if not b.is_floating_point():
                continue
            nf = ~torch.isfinite(b)
            if allowed and n in allowed and allowed[n].shape == nf.shape:
                nf = nf & ~allowed[n]
            if bool(nf.any()):
                bad.append(f"{n}[buffer]")
    return bad


def check_invariants(r: CellResult) -> None:
    """What every cell must satisfy; raises AssertionError naming the broken one."""
    kinds = [e.kind for e in r.events]
    desc = f"{r.codebase} / {r.fault.kind}@{r.fault.step}"
    event_lines = "\n".join(str(e) for e in r.events if e.level >= Level.WARNING)
    assert r.exception is None, f"{desc}: {type(r.exception).__name__}: {r.exception}\n{event_lines}"
    bad = nonfinite_tensors(r.model, r.optimizer, r.injector.nonfinite_at_start)
    bad += [k for k, t in r.extra_tensors.items() if not bool(torch.isfinite(t).all())]
    assert not bad, f"{desc}: non-finite at the end: {bad[:6]}\n{event_lines}"
    c = r.counters
    # counters and events agree
    assert c.get("skipped_steps", 0) == kinds.count(Kind.SKIP), f"{desc}: skipped_steps={c.get('skipped_steps')} but {kinds.count(Kind.SKIP)} skip events"
    assert c.get("rewinds", 0) == kinds.count(Kind.REWIND), f"{desc}: rewinds={c.get('rewinds')} but {kinds.count(Kind.REWIND)} rewind events"
    assert Kind.HALT not in kinds, f"{desc}: halted\n{event_lines}"
    fault = r.fault.kind
    if fault == "none":
        crit = [e for e in r.events if e.level >= Level.CRITICAL]
        assert not crit, f"{desc}: a healthy run raised CRITICAL:\n" + "\n".join(map(str, crit))
        assert c.get("rewinds", 0) == 0, f"{desc}: a healthy run was rewound\n{event_lines}"
        # the only skips a healthy run may have are the loss scaler's own overflow steps (info)
        loud = [e for e in r.events if e.kind is Kind.SKIP and e.level > Level.INFO]
        assert not loud, f"{desc}: a healthy run skipped steps:\n" + "\n".join(map(str, loud))
        return
    assert r.injector.fired, f"{desc}: the fault was never injected (the run is shorter than the fault step?)"
    if fault in ("inf_grad", "nan_sample"):
        assert c.get("rewinds", 0) == 0, f"{desc}: a bad batch was answered with a rewind\n{event_lines}"
        # one skip at the fault's step; under a GradScaler other skips are its own overflow steps (info)
        at_fault = [e for e in r.events if e.kind is Kind.SKIP and (e.step == r.fault.step or e.level > Level.INFO)]
        assert len(at_fault) == 1, f"{desc}: a bad batch must cost exactly one skip, got {len(at_fault)}\n{event_lines}"
        assert r.injector.skip_checked, f"{desc}: the run ended before the step after the fault"
        assert r.injector.skip_diff is None, f"{desc}: the skipped step was not a no-op: {r.injector.skip_diff}"
    if fault == "huge_grad":
        assert Kind.NONFINITE_GRAD not in kinds, f"{desc}: a huge finite gradient was reported as non-finite\n{event_lines}"


def guarded_run(codebase: str, fault: Fault, model: nn.Module, opt: torch.optim.Optimizer, injector: Injector,
                batches: Iterable[Any], one_step: Callable[[Any, Any], float | None], **watch_options: Any) -> CellResult:
    """``earlywarn.watch(model, opt, **watch_options)``, then ``one_step(watcher, batch)`` (one
    optimizer step of the loop under test; it returns the loss, or None) for every batch. An
    exception (a ``Halt`` included) ends the run and is kept for the invariants to report."""
    w, exc, losses = None, None, []
    try:
        w = earlywarn.watch(model, opt, **watch_options)
        for b in batches:
            loss = one_step(w, b)
            if loss is not None:
                losses.append(loss)
    except Exception as e:  # noqa: BLE001 - Halt included: the invariants report it
        exc = e
    finally:
        if w is not None:
            w.close()
    injector.remove()
    return CellResult(codebase, fault, list(w.events) if w else [], dict(w.counters) if w else {}, exc, injector,
                      model, opt, losses)


def watcher_events(w: Any) -> tuple[list[Event], dict[str, int]]:
    return list(w.events), dict(w.counters)


def quiet_options(tmp_path: Any, **extra: Any) -> dict[str, Any]:
    """Default protection; no tracker, quarantine and checkpoints under the test's folder."""
    opts: dict[str, Any] = {"sinks": []}
    opts.update(extra)
    return opts


def finite_losses(losses: Iterable[float]) -> bool:
    return all(math.isfinite(v) for v in losses)


__all__ = ["FAULTS", "Fault", "Injector", "CellResult", "check_invariants", "guarded_run", "nonfinite_tensors",
           "watcher_events", "quiet_options", "earlywarn"]
