"""Per-layer gradient norms and non-finite flags computed on the device, without host syncs.

One ``torch._foreach_norm`` pass over the gradients (the memory-bandwidth floor of any norm
check), then an ``index_add_`` of the squared norms into one small per-layer vector. Nothing here
reads a value on the host: the watcher moves the whole vector in one transfer.
"""

from __future__ import annotations

import torch

from earlywarn.capture.grouping import LayerMap


def _stat_dtype(device: torch.device) -> torch.dtype:
    # float64 so that squaring a large-but-finite fp32 norm cannot overflow into a false "non-finite";
    # it is a vector of a few dozen numbers, so the precision is free. MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


class GradStats:
    """Turns the current ``.grad`` of a :class:`LayerMap`'s parameters into device statistics."""

    def __init__(self, layer_map: LayerMap):
        self.layer_map = layer_map
        self._key: tuple[bool, ...] | None = None
        self._present: list[int] = []
        self._index: torch.Tensor | None = None

    def _grads(self) -> list[torch.Tensor]:
        params = self.layer_map.params
        key = tuple(p.grad is not None for p in params)
        if key != self._key:
            # Parameters without a gradient this step (unused branches) drop out; re-index once.
            self._key = key
            self._present = [i for i, has in enumerate(key) if has]
            self._index = None
        return [params[i].grad for i in self._present]  # type: ignore[misc]

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
        grads = self._grads()
        num_layers = self.layer_map.num_layers
        if not grads:
            device = self.layer_map.params[0].device
            return torch.zeros(num_layers, dtype=_stat_dtype(device), device=device)
        device = grads[0].device
        dtype = _stat_dtype(device)
        if any(g.is_sparse for g in grads):
            norms = [torch.linalg.vector_norm(g.coalesce()._values()) if g.is_sparse else torch.linalg.vector_norm(g) for g in grads]
        else:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        # A model spread over several devices: bring the per-tensor norms together (non-blocking).
        per_tensor = torch.stack([n.to(device, dtype, non_blocking=True) for n in norms])
        if inv_scale is not None:
            per_tensor = per_tensor * inv_scale.to(device, dtype, non_blocking=True)
        out = torch.zeros(num_layers, dtype=dtype, device=device)
        return out.index_add_(0, self._layer_index(device), per_tensor.square())

    def layer_nonfinite_counts(self) -> torch.Tensor:
        """Count of non-finite gradient elements per layer (a second pass: only on a bad step)."""
        grads = self._grads()
        device = grads[0].device if grads else self.layer_map.params[0].device
        out = torch.zeros(self.layer_map.num_layers, dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
        if not grads:
            return out
        counts = torch.stack([(~torch.isfinite(g)).sum().to(device, out.dtype) for g in grads])
        return out.index_add_(0, self._layer_index(device), counts)
