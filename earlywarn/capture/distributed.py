"""Making the per-step statistics vector identical on every rank, with at most one collective.

The watcher's vector is ``[layer_sq..., loss, loss_scale]``. Every rank feeds it to the same
deterministic detector and policy, so every rank takes the same decision (skip, repair, rewind,
halt) if and only if every rank holds the same vector. A rank-local decision hangs or poisons
the run: one rank skips while the others step (mmf#1073), or one rank's spike goes unnoticed
and the next all-reduce spreads it (WeatherGenerator#2724).

Two layouts of the gradients:

* **Replicated (DDP).** After ``backward()`` DDP has already averaged the gradients, so every
  rank *should* hold the same values -- but not always: silent data corruption on one GPU, or a
  rank-local bug between the all-reduce and the step (clipping, an in-place op), makes one rank's
  gradient non-finite alone, and a rank-local skip then lets the replicas drift apart for good.
  So the whole vector goes through **one** SUM all-reduce every step (a few dozen numbers,
  issued on the device without a host sync) and is divided by the world size: the layer norms
  are unchanged when the replicas agree, a non-finite value on any rank makes the entry
  non-finite on every rank (all of them skip), and the detector sees the mean loss over ranks
  (the global-batch loss for equal per-rank batches).
* **Sharded (FSDP2 ``fully_shard``, DTensor gradients).** Each rank computes squared norms of its
  *local* shards (``GradStats`` weights every tensor by the share of the world that holds a copy
  of it, so that the sum over ranks is exact), and **one** SUM all-reduce of the whole vector per
  step gives the global per-layer squared norms. A non-finite value in any rank's shard makes the
  summed entry non-finite on every rank. No per-parameter collective is ever issued.

The rule that follows: call ``report_loss`` on every rank or on none (as with ``backward()``,
a collective that only some ranks enter waits until the process group's timeout).

Assumed: every rank of the default process group trains the same model (data parallel, FSDP2,
HSDP, tensor parallel with DTensors). Not supported: FSDP1 (its gradients are plain-tensor
shards, indistinguishable from replicated ones), pipeline stages with different layers (the
vectors differ in length), ranks that train unrelated models.
"""

from __future__ import annotations

import torch

from earlywarn.capture.gradstats import is_sharded
from earlywarn.capture.grouping import LayerMap


class StatsReducer:
    """Turns one rank's statistics vector into the vector every rank agrees on.

    Build once per watcher (the layout of the gradients does not change during a run); call
    :meth:`reduce` once per optimizer step on every rank.
    """

    def __init__(self, layer_map: LayerMap, world_size: int, group: "torch.distributed.ProcessGroup | None" = None):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        self.layer_map = layer_map
        self.world_size = int(world_size)
        self.group = group
        self.sharded = is_sharded(layer_map.params)
        self.collectives = 0  # issued so far (tests and benchmarks read it)
        self._post: torch.Tensor | None = None

    def _post_scale(self, vec: torch.Tensor) -> torch.Tensor:
        # After the SUM: sharded layer entries are already exact sums; replicated entries (DDP
        # layers, the loss, the loss scale, the user's own signals) are means over ranks.
        if (self._post is None or self._post.device != vec.device or self._post.dtype != vec.dtype
                or self._post.shape != vec.shape):
            # Filled on the device (fill kernels take the value as an argument): a host-built
            # tensor copied over would be a blocking host-to-device copy.
            post = torch.full(vec.shape, 1.0 / self.world_size, dtype=vec.dtype, device=vec.device)
            if self.sharded:
                post[: self.layer_map.num_layers].fill_(1.0)
            self._post = post
        return self._post

    def reduce(self, vec: torch.Tensor) -> torch.Tensor:
        """``[layer_sq..., loss, loss_scale, user signals...]`` of this rank -> the same vector on
        every rank.

        One all-reduce, issued on the vector's device without a host sync: every step, with more
        than one rank (see the module docstring: replicas that should agree are exactly where a
        rank-local fault hides).
        """
        expected = self.layer_map.num_layers + 2
        if vec.dim() != 1 or vec.shape[0] < expected:
            raise ValueError(f"statistics vector has shape {tuple(vec.shape)}, expected ({expected} + user signals,): "
                             "[layer_sq..., loss, loss_scale, user signals...]")
        out = vec.clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        return out.mul_(self._post_scale(out))

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-layer non-finite element counts (the rare second pass on a bad step) made global.

        Every rank takes that pass together (it follows from the agreed vector), so this extra
        collective is matched on every rank; it happens only on non-finite steps.
        """
        out = counts.clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        if not self.sharded:
            out.div_(self.world_size)
        # Whole counts; a fraction means the replicas disagree (one rank's copy was corrupted
        # after the reduction): that element still counts.
        nearest = out.round()
        return torch.where((out - nearest).abs() < 1e-6, nearest, out.ceil())
