"""Per-layer gradient norms and non-finite flags computed on the device, without host syncs.

One ``torch._foreach_norm`` pass per (device, dtype) group of gradients -- the memory-bandwidth
floor of any norm check; torch's fused multi-tensor kernel needs one device and one dtype, so a
mixed-dtype or multi-device model keeps it by being split -- then the per-tensor norms are
gathered on one device and summed per layer in a fixed order into one small vector. Nothing here
reads a value on the host: the watcher moves the whole vector in one transfer.

Accumulation is float64 where it is free: on CUDA the norm kernel accumulates in the output
dtype in registers, so one huge finite element (float32 squares overflow above ~1.8e19) stays
a finite spike instead of a false "non-finite". On CPU a float64 norm first copies the tensor
(~30x slower), so it accumulates in float32 and the watcher recounts a layer whose norm
overflowed on the rare path (``layer_sq_norms(exact=True)``), unless the whole run needs
exact norms up front (``GradStats(exact=True)``: async mode, where that rare path cannot run).

Where the gradients live decides where the vector lives: on a CUDA device whenever any gradient
is on CUDA (a model with CPU-offloaded parts included), and copies go ``non_blocking`` only
toward CUDA (from pinned memory): a non-blocking copy *to* the CPU returns before the data has
landed, and reading it at once is a race. When the vector lives on the CPU there is no device to
keep busy, so the per-tensor norms are read once (``tolist``) and squared and summed per layer in
a Python loop: on the caches a backward pass leaves, each small torch or numpy call costs ~10-40
us, far more than the loop (six torch ops gave way to four numpy calls, 60-145 us a step, and
those to the loop, another 15-40: ``benchmarks/overhead.py --against``, issue 23); the same
float64 operations in the same order as numpy's ``square`` and ``bincount``, the same bits.

Sharded gradients (FSDP2 ``fully_shard``, tensor parallel: DTensors) are read through their
local shards -- a norm of the DTensor itself would issue one collective per tensor -- and each
shard's squared norm is weighted by the share of the world that holds a copy of it, so that
summing the vector over ranks (``capture.distributed``, one all-reduce) gives exact global norms.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable

import numpy as np
import torch

from earlywarn.capture.grouping import LayerMap
from earlywarn.capture.norms import NormPlan

try:  # torch builds without distributed support have no DTensor (and no sharded gradients)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def stat_dtype(device: torch.device) -> torch.dtype:
    # float64 so that squaring a large-but-finite norm cannot overflow into a false "non-finite";
    # it is a vector of a few dozen numbers, so the precision is free. MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def is_sharded(params: "tuple[torch.Tensor, ...] | list[torch.Tensor]") -> bool:
    """True when any parameter is a DTensor (FSDP2, tensor parallel)."""
    return DTensor is not None and any(isinstance(p, DTensor) for p in params)


def _local(t: torch.Tensor) -> torch.Tensor:
    # The rank's own shard, without a collective (to_local() would add an autograd wrapper per tensor).
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def _copy_weight(t: torch.Tensor, world_size: int) -> float:
    """1 / (number of ranks holding a copy of each element of ``t``) in a world-wide sum."""
    if DTensor is None or not isinstance(t, DTensor):
        return 1.0 / world_size  # a plain tensor beside sharded ones: replicated on every rank
    mesh, placements = t.device_mesh, t.placements
    if any(p.is_partial() for p in placements):
        raise ValueError(
            f"a gradient has placements {placements}: its local values are partial sums, so their "
            "norms cannot be combined; reduce the gradients first (FSDP2 does so before the "
            "optimizer step) or redistribute them to Shard/Replicate"
        )
    copies = 1
    for dim, p in enumerate(placements):
        if p.is_replicate():
            copies *= mesh.size(dim)
    if world_size % mesh.size() != 0:
        raise ValueError(
            f"a gradient lives on a device mesh of {mesh.size()} ranks but the world has {world_size}: "
            "earlywarn sums its statistics over the whole world, which needs the mesh size to divide "
            "the world size (pipeline parallelism with per-stage meshes is not supported)"
        )
    return 1.0 / (copies * (world_size // mesh.size()))


def gather_device(devices: "list[torch.device] | tuple[torch.device, ...]") -> torch.device:
    """Where per-tensor results from ``devices`` are combined: the first CUDA device if any."""
    return next((d for d in devices if d.type == "cuda"), devices[0])


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait: non-blocking only toward CUDA, and from
    pinned memory (a pageable source may make the copy synchronous)."""
    dtype = t.dtype if dtype is None else dtype
    if t.device == device:
        return t.to(dtype)
    if device.type == "cuda":
        if t.device.type == "cpu":
            t = t.to(dtype).pin_memory()  # the host allocator keeps it alive until the copy lands
        return t.to(device, dtype, non_blocking=True)
    return t.to(device, dtype)  # toward the host: blocking, so the values are there when read


def _acc_dtype(device: torch.device, dtype: torch.dtype, exact: bool) -> torch.dtype | None:
    if dtype.is_complex:
        return None  # the norm of a complex tensor is real already
    if dtype == torch.float64 or (device.type != "mps" and (exact or device.type == "cuda")):
        return torch.float64
    return torch.float32


def _host_values(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array whose values widen to float64 exactly (a view when
    they are float32 or float64 already, else a float64 copy)."""
    return (t if t.dtype in _HOST_FLOATS else t.double()).numpy()


_HOST_FLOATS = (torch.float64, torch.float32)


def _layout(grad: torch.Tensor) -> tuple:
    """What a plan needs of a gradient: its group ``(device, dtype, sparse)``, whether it is
    strided, its local shape."""
    g = _local(grad)
    return (g.device, g.dtype, g.is_sparse), g.layout == torch.strided, g.shape


_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


@dataclass
class _Group:
    device: torch.device
    dtype: torch.dtype
    sparse: bool
    members: list[int]  # positions in _Plan.present
    plan: NormPlan | None = None  # dense groups: how their norms are taken (capture/norms.py)
    acc: torch.dtype | None = None  # the norms' accumulation dtype (_acc_dtype), and when exact
    acc_exact: torch.dtype | None = None
    on_host: bool = False  # its norms are CPU tensors already

    def __post_init__(self) -> None:
        self.acc = _acc_dtype(self.device, self.dtype, False)
        self.acc_exact = _acc_dtype(self.device, self.dtype, True)
        self.on_host = self.device.type == "cpu"


class _Plan:
    """How the gradients of one set of parameters (``present``, of ``n`` watched) are read."""

    __slots__ = ("nones", "present", "pick", "groups", "simple", "shareable", "index", "index_present", "weights")

    def __init__(self, n: int, present: list[int], groups: list[_Group], sharded: bool) -> None:
        self.nones = n - len(present)  # parameters without a gradient
        self.present = present
        # the gradients of `present`, in C (operator.itemgetter)
        self.pick: Any = operator.itemgetter(*present) if len(present) > 1 else (
            (lambda xs, i=present[0]: (xs[i],)) if present else (lambda xs: ()))
        self.groups = groups
        # one group, plain tensors: the gradient list goes to the norm plan as it is
        self.simple = len(groups) == 1 and not sharded and not groups[0].sparse
        # ... and the loop's clip, which takes the norms in the gradients' own precision, can lend its own
        self.shareable = self.simple and groups[0].dtype in (torch.float32, torch.float64)
        # per-tensor -> per-layer (GradStats._layer_index: a list on the host), made on first use
        self.index: "list[int] | torch.Tensor | None" = None
        self.index_present: "list[int] | torch.Tensor | None" = None
        self.weights: torch.Tensor | None = None

    def order(self) -> list[int]:
        """Positions in ``present``, in the order the per-tensor results are concatenated."""
        out = []
        for grp in self.groups:
            order = grp.plan.order if grp.plan is not None else range(len(grp.members))
            out += [grp.members[j] for j in order]
        return out


PLANS_KEPT = 64
"""Plans kept, by the set of parameters that had a gradient: a model whose set changes from step
to step (a mixture of experts: an expert no token was routed to gets none) plans only a set it
has not met lately. A plan holds a few lists and one index tensor of the parameters' count: 64 of
them are little memory."""


class GradStats:
    """Turns the current ``.grad`` of a :class:`LayerMap`'s parameters into device statistics.

    ``exact``: accumulate in float64 on every device (else only on CUDA, see the module note).
    """

    def __init__(self, layer_map: LayerMap, *, exact: bool = False):
        self.layer_map = layer_map
        self.exact = exact
        self._plan: _Plan | None = None  # the plan of the last step's set of parameters with a gradient
        self._plans: OrderedDict[tuple[bool, ...], _Plan] = OrderedDict()  # recent ones, newest last
        # each parameter's gradient as first read (``_layout``): a set of parameters not planned
        # lately (a mixture of experts: every step) is planned from these, not from ~1 us of reads
        # per gradient; what a pass finds changed is read anew (``_planned``)
        self._layouts: list[tuple | None] = [None] * len(layer_map.params)
        self._device = gather_device([_local(p).device for p in layer_map.params])
        self._dtype = stat_dtype(self._device)
        self._host = self._device.type == "cpu"  # the per-layer sums are taken in Python (module note)
        self._num_layers = layer_map.num_layers  # (a property: read once)
        self.last_shared = False  # the last layer_sq_norms() used the clip's norms (pre-clip values)
        # Sharded model: per-tensor weights that make the sum over ranks exact (see _copy_weight).
        self.sharded = is_sharded(layer_map.params)
        self._world = torch.distributed.get_world_size() if self.sharded else 1

    @property
    def device(self) -> torch.device:
        """Where the statistics vector lives."""
        return self._device

    def _grads(self) -> "list[torch.Tensor] | tuple[torch.Tensor, ...]":
        """This step's gradients of the planned parameters (identity tests only, in C: ``None in
        grads`` would call ``Tensor.__eq__`` on every gradient)."""
        grads = list(map(_GRAD, self.layer_map.params))
        plan = self._plan
        if plan is not None:
            if plan.nones == 0:
                if not any(map(operator.is_, grads, repeat(None))):
                    return grads  # the common step: every parameter has a gradient, the plan stands
            else:
                present = plan.pick(grads)
                if (not any(map(operator.is_, present, repeat(None)))
                        and sum(map(operator.is_, grads, repeat(None))) == plan.nones):
                    return present  # the same parameters lack a gradient as when the plan was made
        key = tuple(map(operator.is_not, grads, repeat(None)))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(key, grads)
            if len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        self._plan = plan
        return grads if not plan.nones else plan.pick(grads)

    def _make_plan(self, key: tuple[bool, ...], grads: list[torch.Tensor | None]) -> _Plan:
        # Parameters without a gradient this step (unused branches) drop out.
        present = [i for i, has in enumerate(key) if has]
        layouts = self._layouts
        groups: dict[tuple, _Group] = {}
        for pos, i in enumerate(present):
            lay = layouts[i]
            if lay is None:
                lay = layouts[i] = _layout(grads[i])  # type: ignore[arg-type]
            grp = groups.get(lay[0])
            if grp is None:
                grp = groups[lay[0]] = _Group(*lay[0], [])
            grp.members.append(pos)
        for grp in groups.values():
            if not grp.sparse:
                lays = [layouts[present[m]] for m in grp.members]
                stackable = grp.device.type == "cpu" and grp.dtype.is_floating_point and lays[0][1]  # type: ignore[index]
                grp.plan = NormPlan.of_shapes([lay[2] for lay in lays], stackable=stackable)  # type: ignore[index]
        return _Plan(len(key), present, list(groups.values()), self.sharded)

    def _weight(self, grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        if not self.sharded:
            return None
        plan = self._plan
        if plan.weights is None or plan.weights.dtype != dtype:
            w = torch.tensor([_copy_weight(grads[m], self._world) for m in plan.order()], dtype=dtype)
            plan.weights = to_device(w, self._device)
        return plan.weights

    def _per_layer(self, per_tensor: torch.Tensor, *, as_present: bool = False) -> torch.Tensor:
        """Per-tensor values -> per-layer sums, in a fixed order on every run and rank.
        ``as_present``: the values come in the parameters' order, not the norm plan's.

        On the CPU one ``np.bincount`` of float64 values (a sequential loop: a fixed order).
        Elsewhere a gather into a (layers x widest layer) table padded with zeros, then row sums:
        ``index_add_`` uses atomics on CUDA, whose order -- and so the last bits -- can differ
        between runs."""
        index = self._layer_index(as_present)
        if self._host:
            values = _host_values(per_tensor)
            return torch.from_numpy(np.bincount(index, weights=values, minlength=self.layer_map.num_layers))
        padded = torch.cat([per_tensor, per_tensor.new_zeros(1)])
        return padded[index].sum(dim=1)

    def _layer_index(self, as_present: bool) -> "list[int] | torch.Tensor":
        """Each per-tensor value's layer (the host's loop and ``bincount`` index), or the device's
        padded (layers x widest layer) table of value positions; made once per plan."""
        plan = self._plan
        index = plan.index_present if as_present else plan.index
        if index is not None:
            return index
        layer_of, present = self.layer_map.layer_of, plan.present
        cols = range(len(present)) if as_present else plan.order()
        if self._host:
            index = [layer_of[present[pos]] for pos in cols]
        else:
            rows: list[list[int]] = [[] for _ in range(self.layer_map.num_layers)]
            for col, pos in enumerate(cols):
                rows[layer_of[present[pos]]].append(col)
            pad = len(present)  # the appended zero
            width = max(1, max(len(r) for r in rows))
            index = to_device(torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long),
                              self._device)
        if as_present:
            plan.index_present = index
        else:
            plan.index = index
        return index

    def _host_layer_sq(self, parts: list[torch.Tensor], inv_scale: torch.Tensor | None,
                       weight: torch.Tensor | None, as_present: bool) -> list[float]:
        """The CPU's per-layer sums of ``(per_tensor * inv_scale) ** 2 * weight``, as Python floats
        (module note), ``parts``: the per-tensor norms in pieces (``_norms``): each value read
        once as a float64 (exact), then numpy's ``multiply``, ``square`` and ``bincount`` done in
        their order, the same bits."""
        # (the norms read through numpy, as the statistics vector is: no torch scalar read per value;
        # detached: gradients of a backward(create_graph=True) have norms that require grad)
        values: list[float] = []
        for part in parts:  # (_host_values, inline: a call fewer per piece)
            if part.requires_grad:
                part = part.detach()
            values += (part if part.dtype in _HOST_FLOATS else part.double()).numpy().tolist()
        plan = self._plan
        index = plan.index_present if as_present else plan.index
        if index is None:
            index = self._layer_index(as_present)
        sq = [0.0] * self._num_layers
        if inv_scale is None and weight is None:
            for layer, x in zip(index, values):
                sq[layer] += x * x
            return sq
        s = 1.0 if inv_scale is None else float(inv_scale)
        weights = repeat(1.0) if weight is None else weight.numpy().tolist()
        for layer, x, w in zip(index, values, weights):
            x *= s  # (x * 1.0 and y * 1.0 are x and y, bit for bit)
            sq[layer] += x * x * w
        return sq

    def _shared(self, dgrads: Any, shared: "tuple[list[int], list[torch.Tensor], list[int]]") -> torch.Tensor | None:
        """This step's per-tensor norms from the loop's clip (its own norm pass, before it scaled
        the gradients), in the parameters' order; ``None`` when they do not serve: a gradient
        the clip did not cover or that was written since (its version moved), or norms of another
        precision than this plan's (half-precision gradients, exact float64 statistics, several
        devices, sharded or sparse gradients)."""
        if not self._plan.shareable:
            return None
        ids, norms, versions = shared
        mine = list(map(id, dgrads))
        if mine != ids:  # the clip covered other parameters too, or in another order
            where = dict(zip(ids, range(len(ids))))
            idx = list(map(where.get, mine))
            if None in idx:
                return None
            norms, versions = [norms[i] for i in idx], [versions[i] for i in idx]
        if list(map(_VERSION, dgrads)) != versions:
            return None  # a gradient written after the clip (a fault injected, an edit): read it anew
        stacked = torch.stack(norms)
        return stacked if self._host else to_device(stacked, self._device, self._dtype)

    def layer_sq_norms(self, inv_scale: torch.Tensor | None = None, *, exact: bool | None = None,
                       shared: "tuple[list[int], list[torch.Tensor], list[int]] | None" = None,
                       as_list: bool = False) -> "torch.Tensor | list[float]":
        """Squared L2 norm of each layer's gradient, shape ``(num_layers,)``, on :attr:`device`
        (``as_list``, when that is the CPU: as a list of floats, from which the statistics vector
        is built without a torch or numpy call per entry).

        ``inv_scale`` (a device scalar) unscales gradients that a fused optimizer will unscale
        itself inside its kernel (GradScaler + fused Adam leaves them scaled). ``exact``:
        float64 accumulation on every device for this call (the rare-path recount). ``shared``:
        ``(ids, norms, versions)`` the loop's clip took of these gradients (``capture.clipping``):
        used instead of a norm pass of our own where they serve.
        """
        exact = self.exact if exact is None else exact
        dgrads = self._grads()
        dtype = self._dtype
        if not dgrads:
            if as_list and self._host:
                return [0.0] * self.layer_map.num_layers
            return torch.zeros(self.layer_map.num_layers, dtype=dtype, device=self._device)
        per_tensor = self._shared(dgrads, shared) if shared is not None and not exact else None
        as_present = self.last_shared = per_tensor is not None
        if per_tensor is None:
            try:  # (_planned's first try, inline: two calls fewer on every step)
                parts = self._norms(dgrads, exact, dtype)
            except RuntimeError:
                dgrads, parts = self._replanned(lambda gs: self._norms(gs, exact, dtype), dgrads)
        else:
            parts = [per_tensor]
        # (never with shared norms: sharded gradients do not share)
        weight = self._weight(dgrads, dtype) if self.sharded else None
        if self._host:
            sq = self._host_layer_sq(parts, inv_scale, weight, as_present)
            return sq if as_list else torch.tensor(sq, dtype=torch.float64)
        per_tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        if inv_scale is not None:
            per_tensor = per_tensor * to_device(inv_scale, self._device, dtype)
        sq = per_tensor.square()
        if weight is not None:
            sq = sq * weight
        return self._per_layer(sq, as_present=as_present)

    def _norms(self, dgrads: Any, exact: bool, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per-tensor norms of the planned gradients, in the plan's order, on :attr:`device`: the
        1-D pieces they are computed in (the host reads each as it is; a device joins them)."""
        parts: list[torch.Tensor] = []
        plan = self._plan
        for grp in plan.groups:
            grads = dgrads if plan.simple else [_local(dgrads[m]) for m in grp.members]
            acc = grp.acc_exact if exact else grp.acc
            if grp.plan is None:  # sparse
                pieces = [torch.stack([torch.linalg.vector_norm(g.coalesce()._values(), dtype=acc) for g in grads])]
            else:
                pieces = grp.plan.parts(grads, acc)
            if self._host:  # read piece by piece, in their own precision: squared in float64 (_host_layer_sq)
                parts += pieces if grp.on_host else [
                    p if p.is_cpu else to_device(p, self._device, dtype) for p in pieces]
            else:  # a device joins them: one copy per group when the group lives elsewhere
                parts.append(to_device(pieces[0] if len(pieces) == 1 else torch.cat(pieces), self._device, dtype))
        return parts

    def _planned(self, pass_: Callable[[Any], Any], dgrads: Any) -> tuple[Any, Any]:
        """``pass_(dgrads)`` through the current plan, planned again once if it failed because a
        gradient is not what it was when first read -- turned sparse or dense again, resized,
        another dtype. Plans are made from each gradient as first read: checking every gradient
        every step would cost a read per gradient for what almost no run does, so it is checked
        after a failure only. Returns the gradients read and the result."""
        try:
            return dgrads, pass_(dgrads)
        except RuntimeError:
            return self._replanned(pass_, dgrads)

    def _replanned(self, pass_: Callable[[Any], Any], dgrads: Any) -> tuple[Any, Any]:
        """:meth:`_planned` once its pass failed (called while the failure is handled): the
        failure raised again if every gradient is as first read, else planned anew and passed."""
        present, layouts = self._plan.present, self._layouts
        if all(_layout(dgrads[pos]) == layouts[i] for pos, i in enumerate(present)):
            raise  # (the failure being handled: no gradient changed)
        self._plans.clear()
        self._layouts = [None] * len(self._layouts)
        self._plan = None
        dgrads = self._grads()
        return dgrads, pass_(dgrads)

    def layer_nonfinite_counts(self) -> torch.Tensor:
        """Count of non-finite gradient elements per layer (a second pass: only on a bad step).

        Sharded: counts of this rank's shards, weighted like the norms (sum over ranks = global)."""
        dgrads = self._grads()
        dtype = self._dtype
        if not dgrads:
            return torch.zeros(self.layer_map.num_layers, dtype=dtype, device=self._device)
        dgrads, counts = self._planned(lambda gs: self._counts(gs, dtype), dgrads)
        weight = self._weight(dgrads, dtype)
        if weight is not None:
            counts = counts * weight
        return self._per_layer(counts)

    def _counts(self, dgrads: Any, dtype: torch.dtype) -> torch.Tensor:
        parts = []
        for grp in self._plan.groups:
            order = grp.plan.order if grp.plan is not None else range(len(grp.members))
            grads = [_local(dgrads[grp.members[j]]) for j in order]  # the norms' order (see _Plan.order)
            values = [g.coalesce()._values() if grp.sparse else g for g in grads]
            counts = torch.stack([torch.isfinite(v).logical_not_().sum() for v in values])
            parts.append(to_device(counts, self._device, dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
