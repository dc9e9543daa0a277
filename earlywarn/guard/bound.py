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
fewer (0.979 -> 0.941): hence 1 there.

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
