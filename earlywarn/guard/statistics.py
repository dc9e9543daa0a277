"""The step's statistics vector: what goes into it, how the host reads it, the Observation it becomes.

One small device vector per optimizer step, ``[layer_sq..., loss, loss_scale, user signals...,
state]`` (per-layer squared gradient norms, the reported loss, the GradScaler's scale, one slot per
user signal ever reported, the optimizer state's finiteness), moved to the host once: now (sync
mode) or a step or more late (async).
Under ``torch.distributed`` it goes through one all-reduce first, so every rank decides alike.
A bad step (non-finite) takes a second, rare pass for exact per-layer element counts.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from earlywarn.capture.clipping import observe_clipping, unclip
from earlywarn.capture.gradstats import GradStats, stat_dtype
from earlywarn.capture.grouping import LayerMap
from earlywarn.capture.hostread import LateReader, SyncReader
from earlywarn.capture.updates import learning_rate
from earlywarn.detect import Observation
from earlywarn.metrics import sanitize_key
from earlywarn.recover.hostcopy import fence_copies
from earlywarn.recover.statecheck import StateCheck

# A finite gradient whose square overflows float32 poisons every second-moment state (Adam's v,
# Adagrad's sum, Adafactor's row/col variances become inf, then NaN): it is skipped like a
# non-finite one, and reported as the huge finite spike it is.
SQ_OVERFLOW = float(np.finfo(np.float32).max)


class StepTag:
    """What the host needs to know about a step whose vector may arrive a step late."""

    __slots__ = ("step", "run_step", "batch", "loss_reported", "counts", "inv_scale", "gen", "users", "clip", "sq_sum")

    def __init__(self, step: int, run_step: int, batch: Any, loss_reported: bool):
        self.step = step  # on the training trajectory (a rewind sets it back)
        self.run_step = run_step  # on the run's clock (never goes back): what events and trackers show
        self.batch = batch  # drawn for this step: what blame and quarantine name, however late it is read
        self.loss_reported = loss_reported
        self.users: tuple[tuple[str, int], ...] = ()  # (user signal, its index in the vector) reported this step
        self.counts: np.ndarray | None = None  # exact per-layer non-finite counts (the rare recount)
        self.inv_scale: torch.Tensor | None = None  # for the rare-path recount (sync mode)
        self.gen = 0  # the watcher's rewind generation when the step ran (async mode)
        self.clip: torch.Tensor | None = None  # the loop's clip factor, undone in the statistics (and the recount)
        self.sq_sum: float | None = None  # the layers' squared norms summed (a CPU vector: as it is made)


def as_scalar(value: Any, fn: str, what: str) -> torch.Tensor:
    """A reported scalar as a 0-d tensor: a tensor stays where it is (no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:  # (a loss: the usual case, one call fewer)
            return value.detach()
        if value.numel() != 1:
            raise ValueError(f"{fn} takes a scalar {what}, got a tensor of shape {tuple(value.shape)}: "
                             "reduce it first (e.g. .mean())")
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"{fn} takes a scalar tensor or a float, got {type(value).__name__}")


def _onto(t: torch.Tensor, dev: torch.device, dt: torch.dtype) -> torch.Tensor:
    """A scalar onto the statistics vector's device without making the host wait (in its own
    dtype when it is there already: ``torch.cat`` promotes it, one call fewer)."""
    if t.device == dev:
        return t.reshape(1) if dt == torch.float64 and not t.is_complex() else t.to(dt).reshape(1)
    if t.device.type == "cpu" and dev.type == "cuda":
        # A host value (report_loss(float)): a fill kernel takes it as an argument. Copying a
        # pageable tensor with non_blocking=True may be synchronous after all.
        return torch.full((1,), float(t), dtype=dt, device=dev)
    return t.to(dev, dt, non_blocking=dev.type == "cuda").reshape(1)  # non-blocking only toward CUDA


_NUMPY_FLOATS = (torch.float64, torch.float32, torch.float16)


def _host_value(t: torch.Tensor) -> float:
    """A CPU scalar (0-d or 1-element) as the host's float64 vector holds it, read through numpy
    as the vector itself is read (``SyncReader``), not as a torch scalar read per value. Other
    dtypes are converted as ``_onto`` and ``torch.cat`` convert them (a complex value: its real part)."""
    if not t.is_cpu or t.dtype not in _NUMPY_FLOATS:
        t = t.to("cpu", torch.float64)
    return t.numpy().item()


def _sum_of(layer_sq: np.ndarray) -> float:
    """The layers' squared norms summed left to right, in Python: numpy's reduction costs ~60 us
    on caches a training step has emptied, a sum of the host list ~15 (a few hundred layers: ~10
    warm)."""
    return sum(layer_sq.tolist(), 0.0)


class _Mean:
    """Values reported between two optimizer steps, summed on the device; their mean is taken once."""

    __slots__ = ("total", "count")

    def __init__(self, value: torch.Tensor):
        self.total, self.count = value, 1

    def add(self, value: torch.Tensor) -> None:
        if value.device != self.total.device:
            value = value.to(self.total.device)
        self.total, self.count = self.total + value, self.count + 1

    def mean(self) -> torch.Tensor:
        return self.total / self.count if self.count > 1 else self.total


class StepStatistics:
    """Builds, reduces and reads the statistics vector of each optimizer step.

    ``late``: async mode (the vector is read a step or more late, so the norms are exact float64
    from the start: nothing can be recounted after the fact)."""

    def __init__(self, layer_map: LayerMap, optimizer: torch.optim.Optimizer, scaler: Any, *, late: bool,
                 world_size: int, state_check_every: int = 1):
        self.layer_map = layer_map
        self.num_layers = layer_map.num_layers
        self.optimizer = optimizer
        self.scaler = scaler
        self.stats = GradStats(layer_map, exact=late)
        # where the vector lives, its "not reported" and "not checked" entries: made once, not per step
        self._dev, self._dt = self.stats.device, stat_dtype(self.stats.device)
        self._host = self._dev.type == "cpu"  # the vector is built from Python floats (_host_vector)
        self._nan_entry = torch.full((1,), math.nan, dtype=self._dt, device=self._dev)
        self._zero_entry = torch.zeros(1, dtype=self._dt, device=self._dev)
        # the loop's clip_grad_norm_ (between backward and this step): its factor, to read the raw norms
        self.clipping = observe_clipping(layer_map.params)
        # Alone, a step is judged as soon as its vector has landed; under torch.distributed
        # exactly two steps late on every rank (a rewind or a repair issues collectives).
        self.reader = LateReader(fixed_lag=2 if world_size > 1 else None) if late else SyncReader()
        # One all-reduce of the statistics vector per step, so every rank feeds the detector the
        # same vector and takes the same decisions (capture/distributed.py).
        self.reducer = None
        if world_size > 1:
            from earlywarn.capture.distributed import StatsReducer

            self.reducer = StatsReducer(layer_map, world_size)
        # the optimizer state's finiteness every state_check_every steps (0: never), the vector's last
        # entry: a poisoned moment is repaired before the update that would read it
        self.state_check = StateCheck(optimizer)
        self.state_check_every = state_check_every
        self.user_names: list[str] = []  # user signals ("user/<name>"), in the order first reported
        self._reported: dict[str, _Mean] = {}  # "loss" and user signals reported since the last step
        self._step_lr: dict[int, float | None] = {}  # step -> its LR, until its vector is read
        # the LR the step really takes (earlywarn may hold it below the loop's): what the detector judges
        self.effective_lr: Callable[[float | None], float | None] = lambda lr: lr
        # Record the real backward order once (first backward), to name the first bad layer.
        self.backward_rank: np.ndarray | None = None
        self._grad_seq: list[int] = []
        self._order_hooks = [p.register_post_accumulate_grad_hook(self._order_hook(i))
                             for i, p in enumerate(layer_map.params) if p.requires_grad]

    # -- what the loop reports ---------------------------------------------------------------------
    def report_loss(self, loss: Any) -> None:
        reported = self._reported
        if type(loss) is torch.Tensor and "loss" not in reported and loss.dim() == 0:
            reported["loss"] = _Mean(loss.detach())  # the usual call: as_scalar's and _add's work, inline
            return
        self._add("loss", as_scalar(loss, "report_loss", "loss"))

    def report(self, name: str, value: Any) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"report(name, value) needs a non-empty name, got {name!r}")
        key = "user/" + sanitize_key(name.strip())
        value = as_scalar(value, "report", "value")
        if key not in self.user_names:
            self.user_names.append(key)  # a new slot in the statistics vector from this step on
        self._add(key, value)

    def _add(self, key: str, value: torch.Tensor) -> None:
        acc = self._reported.get(key)
        if acc is None:
            self._reported[key] = _Mean(value)
        else:
            acc.add(value)

    # -- the vector ----------------------------------------------------------------------------------
    def vector(self, step: int, inv_scale: torch.Tensor | None) -> "tuple[torch.Tensor | list[float], StepTag]":
        """This step's statistics vector (on the device; reduced over ranks) and its tag (without
        the step's batch and run step, which the watcher fills in). On the CPU, read at once
        (sync mode, one process), it is a list of floats: the host's copy already."""
        if self.backward_rank is None:
            self._settle_backward_order()
        fence_copies()  # a snapshot still copying the optimizer's tensors is done before this step writes them
        dev, dt, nan = self._dev, self._dt, self._nan_entry
        # what the loop's clip_grad_norm_ did: its per-tensor norms (taken before it scaled the
        # gradients) serve as ours, one norm pass for both; else ours, unclipped by its factor
        took = self.clipping.take(dev, dt)
        clip = None if took is None else took.coef
        shared = None if took is None or took.versions is None else (took.ids, took.norms, took.versions)
        layer_sq = self.stats.layer_sq_norms(inv_scale, shared=shared, as_list=self._host)
        if clip is not None and not (shared is not None and self.stats.last_shared):
            layer_sq = unclip(layer_sq, clip)  # the detector reads them as they were
        reported = self._reported
        if reported:
            self._reported = {}
        loss = reported.get("loss")
        scale = self.scaler._scale if self.scaler is not None else None
        # after the layers, one slot each, a stable layout: the loss, the scale, every user signal
        # ever reported (None: not reported now, a NaN in the vector), then the state's flag
        entries = [None if loss is None else loss.mean(), scale]
        users = []
        for j, key in enumerate(self.user_names):
            acc = reported.get(key)
            entries.append(None if acc is None else acc.mean())
            if acc is not None:
                users.append((key, self.num_layers + 2 + j))
        every = self.state_check_every
        flag = self.state_check.flag(dev, dt) if every and step % every == 0 else None
        sq_sum = None
        if self._host:
            vec = self._host_vector(layer_sq, entries, flag)
            if self.reducer is None:  # (summed over ranks, the vector's layers are other numbers)
                sq_sum = sum(layer_sq, 0.0)  # what _sum_of gives of the vector, from the list at hand
            if self.reducer is not None or self.reader.late:
                vec = torch.from_numpy(np.array(vec, dtype=np.float64))  # summed over ranks, or queued: torch's
        else:
            vec = torch.cat([layer_sq, *(nan if e is None else _onto(e, dev, dt) for e in entries),
                             self._zero_entry if flag is None else flag])
        if self.reducer is not None:
            vec = self.reducer.reduce(vec)
        # the LR this step is taken with (a host number: no device work), kept until the step's
        # vector is read (a step later in async mode, when the scheduler has moved on)
        self._step_lr[step] = self.effective_lr(learning_rate(self.optimizer))
        tag = StepTag(step, step, None, loss is not None)
        tag.inv_scale, tag.clip, tag.sq_sum = inv_scale, clip, sq_sum
        if users:
            tag.users = tuple(users)
        return vec, tag

    def _host_vector(self, layer_sq: list[float], entries: "list[torch.Tensor | None]",
                     flag: torch.Tensor | None) -> list[float]:
        """The vector of a run whose statistics live on the CPU, as the host reads it: a list of
        Python floats (float64), the same entries as the device's ``torch.cat``, without its small
        torch ops (see ``capture.gradstats``). A calm step reads it as it is; a step to be judged
        makes it a numpy array (``read_now``'s recount, ``Watcher._judge``): a torch tensor made only
        to be read back costs two more calls, ~40 us on the caches a backward leaves."""
        v = layer_sq + [math.nan if e is None else _host_value(e) for e in entries]
        v.append(0.0 if flag is None else _host_value(flag))
        return v

    def read_now(self, vec: "torch.Tensor | list[float]", tag: StepTag) -> "np.ndarray | list[float]":
        """The step's one batched host read (sync mode); a bad step is recounted exactly. The
        CPU's vector comes back as the list it is (see ``_host_vector``), a device's as an array."""
        host = vec if type(vec) is list else self.reader.push(vec, tag)[0]  # (the CPU's list: the host's copy)
        L = self.num_layers  # host: [layer_sq (L)..., loss, loss scale, user signals...]
        sq_sum = _sum_of(host[:L]) if tag.sq_sum is None else tag.sq_sum
        if math.isfinite(sq_sum):
            tag.sq_sum = sq_sum
            return host
        host = np.asarray(host, dtype=np.float64)
        tag.sq_sum = None  # the recount below may change the layers' values
        # Rare path (a bad step): a second pass for exact per-layer element counts.
        counts = self.stats.layer_nonfinite_counts()
        if self.reducer is not None:  # every rank is on this path (same vector): matched collective
            counts = self.reducer.reduce_counts(counts)
        tag.counts = counts.cpu().numpy()
        overflowed = ~np.isfinite(host[:L]) & (tag.counts == 0)
        if overflowed.any():
            # Every element finite, yet the float32 squared norm overflowed (|g| >~ 1.8e19):
            # a huge finite gradient is a spike, not a non-finite one. Recount in float64.
            exact = self.stats.layer_sq_norms(tag.inv_scale, exact=True)
            if tag.clip is not None:
                exact = unclip(exact, tag.clip)
            if self.reducer is not None:  # every rank is on this path too
                pad = torch.full((2,), math.nan, dtype=exact.dtype, device=exact.device)
                exact = self.reducer.reduce(torch.cat([exact, pad]))[:-2]
            host = host.copy()
            host[:L][overflowed] = exact.cpu().numpy()[overflowed]
        return host

    def take_lr(self, step: int) -> float | None:
        """The learning rate ``step`` was taken with (None: unknown), once its vector is read;
        steps never read (a rewind dropped them) are forgotten with it."""
        pending = self._step_lr
        lr = pending.pop(step, None)
        if pending:
            for k in [k for k in pending if k < step]:
                del pending[k]
        return lr

    def observation(self, host: np.ndarray, tag: StepTag, lr: float | None) -> Observation:
        """What the detector sees of a step, on the run's clock (``tag.run_step``); ``lr``: its
        learning rate (:meth:`take_lr`)."""
        L = self.num_layers
        layer_sq = host[:L]
        total = math.sqrt(tag.sq_sum if tag.sq_sum is not None else _sum_of(layer_sq))
        if tag.counts is not None:
            nonfinite = tag.counts
        elif math.isfinite(total):
            nonfinite = None  # nothing to count on a finite step (the detector then counts nothing either)
        else:
            nonfinite = (~np.isfinite(layer_sq)).astype(np.float64)
        extras = {"loss_scale": float(host[L + 1])} if self.scaler is not None else {}
        for key, j in tag.users:
            extras[key] = float(host[j])
        if lr is not None:
            extras["lr"] = lr
        loss = float(host[L]) if tag.loss_reported else None
        batch = None if tag.batch is None else tag.batch.batch_index
        return Observation(step=tag.run_step, grad_norm=total, layer_norms=np.sqrt(layer_sq), loss=loss,
                           layer_nonfinite=nonfinite, skipped=not math.isfinite(total), batch=batch, extras=extras,
                           layer_rank=self.backward_rank)

    def scale_gradients(self, factor: float) -> None:
        """Scale the gradients about to be applied by ``factor`` (a clipped outlier: one fused
        multiply on the device, no host read)."""
        grads = [p.grad for p in self.layer_map.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def device_skip_flag(self, vec: torch.Tensor) -> torch.Tensor:
        """Async mode: the fused kernel's skip flag, on the device (no host read). The layer norms
        are exact (float64) there, so it is set by NaN/Inf elements only (or a float32 overflow)."""
        layer_sq = vec[:self.num_layers]
        return (~torch.isfinite(layer_sq.sum()) | (layer_sq.amax() > SQ_OVERFLOW)).to(torch.float32)

    # -- naming the layers of a bad step ------------------------------------------------------------
    def in_backward_order(self, layers: np.ndarray) -> list[int]:
        """Layer indices, the first one reached in backward first (registration order until known)."""
        idx = np.asarray(layers)
        if self.backward_rank is not None:
            idx = idx[np.argsort(self.backward_rank[idx], kind="stable")]
        return [int(i) for i in idx]

    def _order_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._grad_seq.append(index)
        return hook

    def _settle_backward_order(self) -> None:
        if self.backward_rank is not None:
            return
        n = self.layer_map.num_layers
        rank = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        for seq, p_index in enumerate(self._grad_seq):
            layer = self.layer_map.layer_of[p_index]
            rank[layer] = min(rank[layer], seq)
        # Layers never seen keep their registration-based position.
        unseen = rank == np.iinfo(np.int64).max
        rank[unseen] = len(self._grad_seq) + np.arange(n)[unseen]
        self.backward_rank = rank
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._order_hooks:
            h.remove()
        self._order_hooks, self._grad_seq = [], []

    def close(self) -> None:
        self.clipping.close()
        self._remove_hooks()
