"""Bounding a lone outlier gradient element by element, against the optimizer's own second moment.

A lone outlier (the first of a run) is taken at its typical norm: a bad batch then does one step
of ordinary size. One factor for the whole does that for the whole's norm; under Adam it does
much less: the factor (1/5000 for a policy gradient's first rare reward) shrinks every element,
and each element's update is divided by its own running RMS, so all but the largest elements
hardly move -- the rare reward is as good as lost. Held to ``bound`` times its own running RMS
instead, each element moves about ``bound`` ordinary steps along the outlier (its momentum takes
``(1 - beta1) * bound`` and decays over ``1 / (1 - beta1)`` steps) and the second moment grows
little. Taken whole, an outlier ``R >> 1`` times an element's RMS moves it
``(1 - beta1) / sqrt(1 - beta2) / (1 - beta1 / sqrt(beta2))`` ordinary steps whatever ``R`` (5.8
at betas 0.9/0.95, 32 at 0.9/0.999), and stalls the element's ordinary steps after it for hundreds
to thousands of steps (its second moment ``R**2`` up).

The policy picks ``bound``: 1, or ``outlier_clip_ratio`` (3) where the batch's loss is at its
level (not a batch the model finds wrong: a rare reward, a gradient scaled after the loss) -- a
rare reward keeps a tenth to a half of what bare Adam takes from it. Measured on
``benchmarks/rescue.py`` (seed bases 0 and 137) with the same bound for every first outlier: 1, 2,
3, 6, 10 RMS kept a policy gradient's runs 0.10 / 0.18 / 0.84 / 0.92 / 0.96 of bare's progress at
the worst, the huge finite gradients bare dies of 0.999 / 0.992 / 0.981 / 0.930 / 0.855 (3 is the
largest that rescues them all), and at 3 a bad shard's corrupt batches (their loss far up) one run
fewer (0.979 -> 0.941): hence 1 there. What the bound of 3 takes off such a first outlier is
kept (:class:`Rest`) and added to the next one the policy takes as the run's heavy tail
(``outlier_rules.TAIL_RECALL``): a rare reward that recurs is then not lost, and a corrupted
gradient, which does not, is let go.

Where the optimizer keeps a running second moment of the gradient (Adam and its kin:
``exp_avg_sq``; RMSprop: ``square_avg``), a lone outlier's elements are held to ``bound`` times
their running RMS, never under the whole's factor; other optimizers (plain SGD, Lion, a quantized,
nested or sharded state) and sparse gradients take the whole's factor. The rest of a run keeps one
factor for the whole, ``outlier_clip_ratio`` typical norms, as the floor, and each element may
take up to half an ordinary step (``outlier_rules.RUN_ELEMENT_RMS``): one factor alone left the
elements a new regime moves less than its largest all but frozen; element by element at 3 RMS, a
burst of corrupt batches trains the model on them three times as fast (every outlier so rescued
4 bursts where one factor rescues 7).
"""

from __future__ import annotations

from typing import Iterable

import torch

from earlywarn.recover.budget import available_memory

REST_ROOM = 4
"""A rest is kept where its copy takes at most 1/this of the memory free where the gradients
live (the device's, the host's available RAM): a safety net never runs a run out of memory."""


class Rest:
    """What a bound takes off one step's gradients, kept to be added to a later step's: made
    before the bound (a copy of each gradient, on its device), :meth:`taken` after it. Kept
    unscaled: gradients a fused optimizer will unscale itself carry the step's loss scale, which
    may differ between the two steps (``inv_scale``: 1 / that scale, a device scalar)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = [p for p in params if p.grad is not None]
        self.rest = [p.grad.clone() for p in self.params]  # type: ignore[union-attr]

    @staticmethod
    def fits(params: Iterable[torch.nn.Parameter]) -> bool:
        """Room for a copy of the gradients where they live (``REST_ROOM``): on the CPU and CUDA,
        read once on the rare step that keeps one; elsewhere (memory unknown) none is kept."""
        size: dict[torch.device, int] = {}
        for p in params:
            g = p.grad
            if g is not None:
                size[g.device] = size.get(g.device, 0) + g.numel() * g.element_size()
        for device, n in size.items():
            if device.type == "cuda":
                free = torch.cuda.mem_get_info(device)[0]
            elif device.type == "cpu":
                free = available_memory()
            else:
                return False
            if free is None or n * REST_ROOM > free:
                return False
        return True

    def taken(self, inv_scale: torch.Tensor | None = None) -> "Rest":
        """The bound is done: what it took off each gradient (no host read)."""
        if self.rest:
            torch._foreach_sub_(self.rest, [p.grad for p in self.params])
            if inv_scale is not None:
                torch._foreach_mul_(self.rest, inv_scale)
        return self

    def add_to_gradients(self, inv_scale: torch.Tensor | None = None) -> None:
        """Add it to the gradients about to be applied (a parameter without one now: left out)."""
        pairs = [(p.grad, r) for p, r in zip(self.params, self.rest) if p.grad is not None and p.grad.shape == r.shape]
        if not pairs:
            return
        rest = [r for _, r in pairs]
        if inv_scale is not None:
            rest = torch._foreach_div(rest, inv_scale)
        torch._foreach_add_([g for g, _ in pairs], rest)


def bound_gradients(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, factor: float,
                    bound: float, inv_scale: torch.Tensor | None = None) -> None:
    """Scale the gradients about to be applied: each element to at most ``bound`` times its running
    RMS in ``optimizer``'s state, and at least by ``factor`` (the whole's: ``bound`` typical norms
    over the whole's norm); where no such moment is kept, by ``factor``. ``inv_scale``: the
    gradients still carry a loss scale (a fused optimizer unscales them itself), the limits too.
    On the device, no host read."""
    opt = getattr(optimizer, "optimizer", optimizer)  # a wrapper (accelerate's, Lightning's) holds the real one
    # the decay its bias correction needs (a group without ``betas``: not Adam's form, not read)
    beta2 = {id(p): group["betas"][1] for group in opt.param_groups if "betas" in group for p in group["params"]}
    whole = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        rms = _running_rms(opt.state.get(p), g, beta2.get(id(p)))
        if rms is None or not bound == bound:
            whole.append(g)
            continue
        rms.mul_(bound)
        if inv_scale is not None:
            rms.div_(inv_scale.to(rms.device))
        limit = torch.maximum(rms.to(g.dtype), g.abs().mul_(factor))
        torch.clamp(g, min=-limit, max=limit, out=g)
    if whole:
        torch._foreach_mul_(whole, factor)


def _running_rms(state: dict | None, grad: torch.Tensor, beta2: float | None) -> torch.Tensor | None:
    """The element-wise running RMS of ``grad`` the optimizer keeps (bias-corrected where it is), a
    new tensor; None where it keeps none of ``grad``'s shape."""
    if not state:
        return None
    v = state.get("exp_avg_sq")
    if _like(v, grad) and beta2 is not None and "step" in state:
        step = state["step"]
        # 1 - beta2**step, on the step's own device when it is a tensor (capturable Adam): no host read
        correction = 1.0 - (torch.pow(torch.as_tensor(beta2, dtype=torch.float32, device=step.device), step)
                            if isinstance(step, torch.Tensor) else beta2 ** float(step))
        return v.float().div(correction).sqrt_()
    v = state.get("square_avg")  # RMSprop (no bias correction of its own)
    if _like(v, grad):
        return v.float().sqrt()
    return None


def _like(v: object, grad: torch.Tensor) -> bool:
    """``v`` is a plain dense tensor of one float per element of a dense ``grad``. Not a sparse
    gradient (SparseAdam's), nor a tensor subclass (torchao's quantized moments, a DTensor's
    shards): those take the whole's factor."""
    return (type(v) is torch.Tensor and type(grad) is torch.Tensor and v.shape == grad.shape
            and v.is_floating_point() and v.layout is torch.strided and grad.layout is torch.strided)
