"""Find and repair non-finite values in parameters, buffers and optimizer state.

Skipping a bad step is not enough once the moments were written: a non-finite ``exp_avg_sq``
makes every later Adam update at that coordinate NaN (inf/inf) or zero, whatever the gradient.

What a repair writes, per kind of state (only at the poisoned coordinates; all others and
``step`` are left untouched). For one parameter the poisoned coordinates are the union over
the parameter and all its same-shaped state tensors, so ``m`` and ``v`` are reset together:

==========================================================  =================================
state key (optimizer)                                       repaired value
==========================================================  =================================
``exp_avg`` (Adam/AdamW/NAdam/RAdam/Adamax),                0: a first moment that starts again,
``momentum_buffer`` (SGD/RMSprop), ``grad_avg``,            as at step 0
``prev`` (Rprop)
``exp_avg_sq``, ``max_exp_avg_sq`` (Adam family),           the largest finite value of that
``square_avg``, ``acc_delta`` (RMSprop/Adadelta),           tensor: a conservative denominator,
``sum`` (Adagrad), ``exp_inf`` (Adamax)                     so the coordinate takes small steps
                                                            until its statistics recover. If
                                                            the whole tensor is non-finite: the
                                                            largest finite value of that key
                                                            over all parameters, else 0 (noted)
``step``, ``mu_product`` and other scalars, unknown keys,   copied from the snapshot when one is
parameters and buffers                                      given, else left as they are and
                                                            reported unrepaired
==========================================================  =================================

State nested to any depth (heavyball: ``state[p][0]["update_by_adam_exp_avg_sq_0"]``, lists of
preconditioner factors) is scanned and repaired tensor by tensor; a tensor's rule comes from its
innermost key, by name or by the moment it names (``..._exp_avg_sq_...``: a second moment,
``..._exp_avg_...`` / ``...momentum...``: a first one); anything else is copied from the snapshot.

With a snapshot (the last clean in-memory copy), parameter and buffer coordinates are copied back
from it, and with ``reset_state=False`` the optimizer state coordinates too. Repairing
parameters coordinate-wise is only done while the poisoned share of all parameter elements stays
below ``max_param_fraction``; beyond that the report asks for a rewind.

Which values are poisoned, and how scans agree under torch.distributed: :mod:`earlywarn.recover.scan`
(every rank must call these functions together, in the same order, on the same structure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .forms import local, state_leaves, write_back
from .forms import values as values_of
from ._tree import at, leaf_name, path_name
from .holders import _checkable, agreed_state, state_view
from .scan import (  # noqa: F401 - re-exported: the scan's types are part of this module's API
    FiniteBaseline,
    Flag,
    StateScan,
    _Agree,
    _finite_abs_max,
    _same_shape,
    scan_state,
)

ZERO_KEYS = frozenset({"exp_avg", "momentum_buffer", "grad_avg", "prev"})
SECOND_MOMENT_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf"})
# other libraries name the same moments inside longer keys (heavyball: "update_by_adam_exp_avg_sq_0")
_SECOND_WORDS = ("exp_avg_sq", "square_avg", "exp_inf", "acc_delta")
_ZERO_WORDS = ("exp_avg", "momentum")


def reset_rule(path: tuple) -> str | None:
    """``"zero"`` (a first moment), ``"second"`` (a second moment) or None (no rule: the snapshot's
    value) for the state tensor at ``path`` (its innermost key names it; nested state included)."""
    name = leaf_name(path)
    if name in SECOND_MOMENT_KEYS:
        return "second"
    if name in ZERO_KEYS:
        return "zero"
    if any(w in name for w in _SECOND_WORDS):
        return "second"
    if any(w in name for w in _ZERO_WORDS):
        return "zero"
    return None


@dataclass(frozen=True)
class RepairAction:
    """What was done to one tensor: ``count`` coordinates set by ``action`` (``"zero"``,
    ``"finite_max"``, ``"snapshot"``, ``"zero (no finite value)"``), or left with ``reason``."""

    name: str
    key: str | None
    count: int
    action: str
    value: float | None = None
    reason: str | None = None

    @property
    def where(self) -> str:
        return self.name if self.key is None else f"{self.name}[{self.key}]"

    def __str__(self) -> str:
        if self.reason:
            return f"{self.where}: {self.count} left non-finite ({self.reason})"
        v = f" = {self.value:.3g}" if self.value is not None else ""
        return f"{self.where}: {self.count} set by {self.action}{v}"


@dataclass
class RepairReport:
    """What :func:`repair_optimizer_state` changed. ``ok``: a re-scan found everything finite.
    ``needs_rewind``: parameters stayed non-finite (no snapshot, or too many to patch)."""

    scan: StateScan
    repaired: list[RepairAction]
    unrepaired: list[RepairAction]
    after: StateScan | None
    step: int | None = None

    @property
    def ok(self) -> bool:
        return self.after is not None and self.after.clean

    @property
    def needs_rewind(self) -> bool:
        return not self.ok and self.after is not None and bool(self.after.params or self.after.buffers)

    @property
    def first_layer(self) -> str | None:
        return self.scan.first_layer

    def summary(self) -> str:
        if self.scan.clean:
            return "nothing to repair: " + self.scan.summary()
        text = "repaired " + "; ".join(str(a) for a in self.repaired) if self.repaired else "repaired nothing"
        if self.unrepaired:
            text += "; NOT repaired: " + "; ".join(str(a) for a in self.unrepaired)
        if self.needs_rewind:
            text += "; parameters are still non-finite: rewind to a clean snapshot"
        return text

    def to_dict(self) -> dict[str, Any]:
        def row(a: RepairAction) -> dict[str, Any]:
            return {"name": a.name, "key": a.key, "count": a.count, "action": a.action, "value": a.value, "reason": a.reason}

        return {
            "step": self.step,
            "ok": self.ok,
            "needs_rewind": self.needs_rewind,
            "found": self.scan.to_dict(),
            "repaired": [row(a) for a in self.repaired],
            "unrepaired": [row(a) for a in self.unrepaired],
        }


def _snapshot_trees(snapshot: Any) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    if snapshot is None:
        return None, None
    state = getattr(snapshot, "state", snapshot)
    if hasattr(snapshot, "wait"):
        snapshot.wait()
    return state.get("model"), state.get("optimizer")


def _snap_tensor(t: Any) -> torch.Tensor | None:
    return values_of(t) if isinstance(t, torch.Tensor) else None  # this rank's shard of it, plain


def _layout(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, tuple]]:
    """Where each live state tensor sits in the optimizer's own ``state_dict()`` -- what a
    snapshot holds -- by identity: ``id -> (parameter index, path)``. Its layout need not be
    the live one (bitsandbytes nests its quantization state under a key of its own)."""
    sd = state_view(optimizer).state_dict()
    return {id(t): (i, path) for i, st in sd.get("state", {}).items() for path, t in state_leaves(st)}


def repair_optimizer_state(
    optimizer: torch.optim.Optimizer,
    scan: StateScan,
    *,
    snapshot: Any = None,
    reset_state: bool = True,
    max_param_fraction: float = 0.01,
    model: torch.nn.Module | None = None,
    step: int | None = None,
    baseline: FiniteBaseline | None = None,
) -> RepairReport:
    """Repair what ``scan`` found (see the module docstring for the values written).

    Args:
        optimizer: the optimizer whose state was scanned.
        scan: from :func:`scan_state` (same model and optimizer).
        snapshot: a :class:`~earlywarn.recover.snapshot.Snapshot` or a mapping with ``"model"``
            (a ``model.state_dict()`` copy) and ``"optimizer"`` (an ``optimizer.state_dict()``
            copy). Parameters and buffers are only repaired from it.
        reset_state: optimizer state coordinates get the per-key reset even when a snapshot is
            given; ``False`` copies them from the snapshot instead (rule as fallback).
        max_param_fraction: patch parameters coordinate-wise only while the poisoned share of
            all parameter elements is at most this; above it, leave them and ask for a rewind.
        model: re-scanned together with the optimizer to verify the repair (defaults to the
            parameters the optimizer holds).
        baseline: the :class:`FiniteBaseline` the scan used (the verifying scan uses it too).
    """
    snap_model, snap_opt = _snapshot_trees(snapshot)
    agree = _Agree()
    # 1. plan on the local shards; every number a decision depends on goes into `counts`, agreed
    # by one SUM over ranks (parameters in model order, the state in one layout: every rank
    # builds the same list; ZeRO-1 stands in empty tensors for the state other ranks hold)
    state, once = agreed_state(optimizer)
    plans, counts, device = _plan(optimizer, state, once, scan, snap_model, snap_opt, reset_state)
    agreed = agree.sum(counts, device) if device is not None else []
    # 2. the values a second moment is reset to: the largest finite one (one MAX over ranks)
    values = _reset_values(state, once, plans, agreed, agree, device)
    # 3. write, each rank into its own shards
    poisoned = sum(f.nonfinite for f in scan.params)
    too_many = None if poisoned <= max_param_fraction * max(1, scan._param_numel) else (
        f"{poisoned} poisoned parameter elements exceed max_param_fraction={max_param_fraction}")
    repaired: list[RepairAction] = []
    unrepaired: list[RepairAction] = []
    with torch.no_grad():
        for plan in plans:
            _write_param(plan, agreed, too_many, repaired, unrepaired)
            _write_state(plan, values, repaired, unrepaired)
        _write_buffers(scan, snap_model, repaired, unrepaired)
    # verify: a second scan (rare path) so that `ok` is measured, not assumed
    after = scan_state(model, optimizer, baseline) if not scan.clean else scan
    return RepairReport(scan, repaired, unrepaired, after, step)


def _plan(optimizer: torch.optim.Optimizer, state_map: Any, once: dict[int, int], scan: StateScan, snap_model: Any,
          snap_opt: Any, reset_state: bool) -> tuple[list[dict[str, Any]], list[torch.Tensor | int], torch.device | None]:
    """Per poisoned parameter: its mask (the union over it and its same-shaped state), where each
    tensor would be repaired from, and the device counts the decisions need."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    layout = _layout(optimizer) if snap_opt is not None else {}
    counts: list[torch.Tensor | int] = []
    plans: list[dict[str, Any]] = []
    device: torch.device | None = None
    with torch.no_grad():
        for name in dict.fromkeys(f.name for f in scan.flags):
            if (name, None) not in scan._refs:
                continue
            p, _, raw = scan._refs[(name, None)]
            pl = local(p)
            device = device if device is not None else pl.device
            state = [(path, v, values_of(v)) for path, v in state_leaves(state_map.get(p, {}))
                     if _checkable(v) or id(v) in once]
            mask = ~torch.isfinite(pl)
            for _, v, vl in state:
                if _same_shape(v, p):
                    mask |= ~torch.isfinite(vl)
            pflag = next((f for f in scan.params if f.name == name), None)
            psrc = _snap_tensor(snap_model.get(raw)) if snap_model is not None else None
            psrc = psrc if psrc is not None and psrc.shape == pl.shape else None
            plan: dict[str, Any] = {"name": name, "p": pl, "pflag": pflag, "psrc": psrc, "at": len(counts), "keys": []}
            counts.append(int(pflag is not None and psrc is None))  # no snapshot of the parameter
            saved = snap_opt.get("state", {}) if snap_opt is not None else None
            for path, v, vl in state:
                src = None
                if saved is not None:  # the snapshot's copy, found where the optimizer's state_dict() put it
                    i, spath = layout.get(id(v), (index.get(id(p)), path))
                    src = _snap_tensor(at(saved.get(i), spath))
                plan["keys"].append(_plan_tensor(path, v, vl, mask if _same_shape(v, p) else None, src,
                                                 reset_state, counts))
            plans.append(plan)
    return plans, counts, device


def _plan_tensor(path: tuple, v: torch.Tensor, vl: torch.Tensor, mask: torch.Tensor | None,
                 src: torch.Tensor | None, reset_state: bool, counts: list[torch.Tensor | int]) -> dict[str, Any]:
    """``vl``: ``v``'s values (``forms.values``: ``v``, its shard, a subclass dequantized); ``src``: the snapshot's (None: it holds none)."""
    rule = reset_rule(path)
    kmask = mask if mask is not None else ~torch.isfinite(vl)
    want_snap = src is not None and (not reset_state or rule is None)
    if want_snap and src.shape == vl.shape:
        src = src.to(vl.device, vl.dtype)
        snap_bad: torch.Tensor | int = (~torch.isfinite(src) & kmask).sum()
    else:
        src, snap_bad = None, int(want_snap)  # wanted but unusable: not from the snapshot
    entry = {"key": path_name(path), "path": path, "rule": rule, "v": v, "vl": vl, "kmask": kmask, "src": src,
             "at": len(counts), "max": _finite_abs_max(vl, ~kmask) if rule == "second" else None}
    # poisoned coordinates, finite values left outside them, snapshot unusable there, snapshot
    # wanted (a rank that holds none of the tensor wants nothing)
    counts += [kmask.sum(), (torch.isfinite(vl) & ~kmask).sum() if rule == "second" else 0, snap_bad, int(want_snap)]
    return entry


def _reset_values(state_map: Any, once: dict[int, int], plans: list[dict[str, Any]], agreed: list[int],
                  agree: "_Agree", device: torch.device | None) -> dict[str, float]:
    """The value each poisoned second moment is reset to (keyed by its entry's ``max_at`` or its
    key), agreed over ranks in one MAX; decides ``count`` and ``use_snap`` per entry as well."""
    maxima: list[torch.Tensor] = []
    fallback: dict[str, tuple] = {}  # key -> path: non-finite everywhere, the key's largest over all parameters
    for plan in plans:
        for e in plan["keys"]:
            a = e["at"]
            e["count"] = agreed[a] if id(e["v"]) in once else -(-agreed[a] // agree.holders(e["v"]))
            e["use_snap"] = agreed[a + 3] > 0 and agreed[a + 2] == 0
            if e["count"] and e["max"] is not None and not e["use_snap"]:
                if agreed[a + 1]:
                    e["max_at"] = len(maxima)
                    maxima.append(e["max"])
                else:
                    fallback.setdefault(e["key"], e["path"])
    with torch.no_grad():
        for path in fallback.values():
            wide = torch.float32 if device.type == "mps" else torch.float64
            best = [_finite_abs_max(values_of(at(st, path))).to(device, wide)
                    for st in state_map.values() if _checkable(at(st, path))]
            maxima.append(torch.stack(best).amax() if best else torch.full((), -math.inf, dtype=wide, device=device))
    got = agree.max(maxima, device) if device is not None else []
    values = {f"#{j}": v for j, v in enumerate(got[: len(got) - len(fallback)])}
    values.update({k: got[len(got) - len(fallback) + j] for j, k in enumerate(fallback)})
    return values


def _write_param(plan: dict[str, Any], agreed: list[int], too_many: str | None,
                 repaired: list[RepairAction], unrepaired: list[RepairAction]) -> None:
    name, pl, pflag = plan["name"], plan["p"], plan["pflag"]
    if pflag is None:
        return
    if agreed[plan["at"]]:
        unrepaired.append(RepairAction(name, None, pflag.nonfinite, "none", reason="no clean snapshot to copy the parameter from"))
    elif too_many is not None:
        unrepaired.append(RepairAction(name, None, pflag.nonfinite, "none", reason=too_many))
    else:
        src = plan["psrc"].to(pl.device, pl.dtype)
        pl.copy_(torch.where(~torch.isfinite(pl), src, pl))
        repaired.append(RepairAction(name, None, pflag.nonfinite, "snapshot"))


def _write_state(plan: dict[str, Any], values: dict[str, float], repaired: list[RepairAction],
                 unrepaired: list[RepairAction]) -> None:
    name = plan["name"]
    for e in plan["keys"]:
        k, vl, kmask, count = e["key"], e["vl"], e["kmask"], e["count"]
        if count == 0:
            continue
        if e["use_snap"]:
            if e["src"] is not None:  # (ZeRO-1: the rank that holds the tensor writes it)
                vl.copy_(torch.where(kmask, e["src"], vl))
            repaired.append(RepairAction(name, k, count, "snapshot"))
        elif e["rule"] == "zero":
            vl.masked_fill_(kmask, 0)
            repaired.append(RepairAction(name, k, count, "zero"))
        elif e["rule"] == "second":
            value = values[f"#{e['max_at']}"] if "max_at" in e else values[k]
            if not math.isfinite(value):  # no finite value of this key anywhere
                vl.masked_fill_(kmask, 0)
                repaired.append(RepairAction(name, k, count, "zero (no finite value)", 0.0))
            else:
                vl.masked_fill_(kmask, value)
                repaired.append(RepairAction(name, k, count, "finite_max", value))
        else:
            unrepaired.append(RepairAction(name, k, count, "none", reason=f"no reset rule for state {k!r} and no snapshot holding it"))
            continue
        try:
            write_back(e["v"], vl)  # a subclass's values were a copy (forms.py): its own copy_ takes them
        except (NotImplementedError, RuntimeError, TypeError) as exc:
            done = repaired.pop()
            unrepaired.append(RepairAction(name, k, count, "none", reason=f"its {type(e['v']).__name__} takes no "
                                           f"copy_ of repaired values ({type(exc).__name__}); {done.action} not written"))


def _write_buffers(scan: StateScan, snap_model: Any, repaired: list[RepairAction],
                   unrepaired: list[RepairAction]) -> None:
    """Buffers (replicated, not sharded) are copied back from the snapshot as they are."""
    for f in scan.buffers:
        _, b, raw = scan._refs[(f.name, "buffer")]
        b = local(b)
        src = _snap_tensor(snap_model.get(raw)) if snap_model is not None else None
        if src is None or src.shape != b.shape:
            unrepaired.append(RepairAction(f.name, "buffer", f.nonfinite, "none", reason="no clean snapshot to copy the buffer from"))
            continue
        bmask = ~torch.isfinite(b)
        own = scan._legit.get((f.name, "buffer"))
        if own is not None:
            bmask &= ~own  # the buffer's own -inf (a causal mask) stays as it is
        b.copy_(torch.where(bmask, src.to(b.device, b.dtype), b))
        repaired.append(RepairAction(f.name, "buffer", f.nonfinite, "snapshot"))
