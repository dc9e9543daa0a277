"""Per-layer gradient norms and non-finite flags computed on the device, without host syncs.

One ``torch._foreach_norm`` pass over the gradients (the memory-bandwidth floor of any norm
check), then an ``index_add_`` of the squared norms into one small per-layer vector. Nothing here
reads a value on the host: the watcher moves the whole vector in one transfer.

Sharded gradients (FSDP2 ``fully_shard``, tensor parallel: DTensors) are read through their
local shards -- a norm of the DTensor itself would issue one collective per tensor -- and each
shard's squared norm is weighted by the share of the world that holds a copy of it, so that
summing the vector over ranks (``capture.distributed``, one all-reduce) gives exact global norms.
"""

from __future__ import annotations

import torch

from earlywarn.capture.grouping import LayerMap

try:  # torch builds without distributed support have no DTensor (and no sharded gradients)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def _stat_dtype(device: torch.device) -> torch.dtype:
    # float64 so that squaring a large-but-finite fp32 norm cannot overflow into a false "non-finite";
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


class GradStats:
    """Turns the current ``.grad`` of a :class:`LayerMap`'s parameters into device statistics."""

    def __init__(self, layer_map: LayerMap):
        self.layer_map = layer_map
        self._key: tuple[bool, ...] | None = None
        self._present: list[int] = []
        self._index: torch.Tensor | None = None
        # Sharded model: per-tensor weights that make the sum over ranks exact (see _copy_weight).
        self.sharded = is_sharded(layer_map.params)
        self._world = torch.distributed.get_world_size() if self.sharded else 1
        self._weights: torch.Tensor | None = None

    def _grads(self) -> list[torch.Tensor]:
        params = self.layer_map.params
        key = tuple(p.grad is not None for p in params)
        if key != self._key:
            # Parameters without a gradient this step (unused branches) drop out; re-index once.
            self._key = key
            self._present = [i for i, has in enumerate(key) if has]
            self._index = None
            self._weights = None
        return [params[i].grad for i in self._present]  # type: ignore[misc]

    def _weight(self, grads: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.sharded:
            return None
        if self._weights is None or self._weights.device != device or self._weights.dtype != dtype:
            self._weights = torch.tensor([_copy_weight(g, self._world) for g in grads], dtype=dtype, device=device)
        return self._weights

    def _layer_index(self, device: torch.device) -> torch.Tensor:
        if self._index is None or self._index.device != device:
            layer_of = self.layer_map.layer_of
            self._index = torch.tensor([layer_of[i] for i in self._present], dtype=torch.long, device=device)
        return self._index

    def layer_sq_norms(self, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Squared L2 norm of each layer's gradient, shape ``(num_layers,)``, on the grads' device.

        ``inv_scale`` (a device scalar) unscales gradients that a fused optimizer will unscale
        itself inside its kernel (GradScaler + fused Adam leaves them scaled).
        """
        dgrads = self._grads()
        grads = [_local(g) for g in dgrads]
        num_layers = self.layer_map.num_layers
        if not grads:
            device = self.layer_map.params[0].device
            return torch.zeros(num_layers, dtype=_stat_dtype(device), device=device)
        device = grads[0].device
        dtype = _stat_dtype(device)
        if any(g.is_sparse for g in grads):
            norms = [torch.linalg.vector_norm(g.coalesce()._values()) if g.is_sparse else torch.linalg.vector_norm(g) for g in grads]
        else:
            # float32 accumulation for low-precision grads; float64 grads cannot be narrowed to it.
            wide = any(g.dtype == torch.float64 for g in grads)
            norms = torch._foreach_norm(grads, 2, dtype=torch.float64 if wide else torch.float32)
        if all(n.device == device for n in norms):
            per_tensor = torch.stack(norms).to(dtype)
        else:  # a model spread over several devices: bring the norms together (non-blocking)
            per_tensor = torch.stack([n.to(device, dtype, non_blocking=True) for n in norms])
        if inv_scale is not None:
            per_tensor = per_tensor * inv_scale.to(device, dtype, non_blocking=True)
        sq = per_tensor.square()
        weight = self._weight(dgrads, device, dtype)
        if weight is not None:
            sq = sq * weight
        out = torch.zeros(num_layers, dtype=dtype, device=device)
        return out.index_add_(0, self._layer_index(device), sq)

    def layer_nonfinite_counts(self) -> torch.Tensor:
        """Count of non-finite gradient elements per layer (a second pass: only on a bad step).

        Sharded: counts of this rank's shards, weighted like the norms (sum over ranks = global)."""
        dgrads = self._grads()
        grads = [_local(g) for g in dgrads]
        device = grads[0].device if grads else self.layer_map.params[0].device
        out = torch.zeros(self.layer_map.num_layers, dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
        if not grads:
            return out
        counts = torch.stack([(~torch.isfinite(g)).sum().to(device, out.dtype) for g in grads])
        weight = self._weight(dgrads, device, out.dtype)
        if weight is not None:
            counts = counts * weight
        return out.index_add_(0, self._layer_index(device), counts)
