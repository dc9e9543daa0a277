"""The methods the rescue benchmark compares, each behind one loop interface (``Method``).

* ``bare``: nothing.
* ``gradscaler_skip``: skip ``optimizer.step()`` when any gradient is non-finite -- the check
  ``torch.amp.GradScaler`` runs (``torch._amp_foreach_non_finite_check_and_unscale_``), at scale 1.
* ``torchtitan_stop``: stop the run at the first non-finite loss or gradient norm, before the step.
* ``olmo_skipstep``: OLMo-core's SkipStep (``src/olmo_core/optim/skip_step_optimizer.py`` and
  ``adamw.py``, read at commit fa6c501): the batch loss and the total gradient norm of the step
  join rolling windows of the last 128 + 1 values; from the 64th loss on
  (``max(2, 128 // 2)``), the step's factor is 1.0 when ``latest - mean <= 6 * std`` of the
  window before it for both (one-sided; a NaN compares False, and once in a window its mean is
  NaN until it leaves, 128 steps later), else 0.0; the AdamW update, the moment updates and the
  step count are multiplied by that factor, so ``0 * NaN = NaN``: a non-finite gradient still
  writes NaN into the moments. It ships for AdamW (and Lion/Muon); Adam here has no weight decay,
  so AdamW's math with ``weight_decay=0`` is Adam's. For SGD, RMSprop and Adagrad the same factor
  gates the step from outside: parameters and state move by ``factor * (new - old)``, which keeps
  the ``0 * NaN`` hole. OLMo-core feeds it the pre-clip norm that ``clip_grad_norm_`` returns; a
  loop that does not clip gets the same total norm computed without clipping.
* ``zclip``: the ``zclip`` package (1.0.0) with its defaults (``ZClip()``: EMA z-score 2.5,
  adaptive scaling, ``max_grad_norm=1.0``, 25 warm-up steps), ``zclip.step(model)`` after
  backward; it takes the place of the loop's own ``clip_grad_norm_`` where the loop clips.
* ``earlywarn``: ``earlywarn.watch(model, optimizer, sinks=[], scheduler=<the loop's torch
  scheduler>)`` per optimizer, ``ew.report_loss(loss)`` per micro-batch, ``earlywarn.Halt`` ends
  the run. Trackers are off only because they change no decision and cost process spawns.
"""

from __future__ import annotations

import math

import torch

METHODS = ("bare", "gradscaler_skip", "torchtitan_stop", "olmo_skipstep", "zclip", "earlywarn")


def make_optimizer(spec: dict, params: list) -> torch.optim.Optimizer:
    name, lr = spec["name"], spec["lr"]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=tuple(spec["betas"]), weight_decay=spec["wd"])
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=tuple(spec["betas"]), weight_decay=spec["wd"])
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=spec["momentum"], weight_decay=spec["wd"])
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=spec["wd"])
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=spec["wd"])
    raise ValueError(f"unknown optimizer {name!r}")


def grads_of(params) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def total_norm(params) -> torch.Tensor:
    grads = grads_of(params)
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class Method:
    """The loop calls, per optimizer ``k`` and step: ``report_loss`` per micro-batch, ``clip``
    (the loop's own clipping), ``before_step`` ("step", "skip" or "stop"), ``step``."""

    name = "bare"

    def __init__(self) -> None:
        self.skips = 0

    def optimizer(self, spec: dict, params: list) -> torch.optim.Optimizer:
        return make_optimizer(spec, params)

    def attach(self, task, opts: list, scheds: list) -> None:
        self.task, self.opts, self.scheds = task, opts, scheds

    def report_loss(self, k: int, loss: torch.Tensor) -> None:
        pass

    def clip(self, k: int) -> torch.Tensor | None:
        """The loop's ``clip_grad_norm_`` (when it clips); returns the pre-clip norm."""
        if self.task.clip is None:
            return None
        return torch.nn.utils.clip_grad_norm_(self.task.params(k), self.task.clip)

    def before_step(self, k: int, loss: torch.Tensor, norm: torch.Tensor | None) -> str:
        return "step"

    def step(self, k: int) -> None:
        self.opts[k].step()

    def skip_total(self) -> int:
        """Updates skipped so far, all optimizers together (the loop reads it around each step)."""
        return self.skips

    def close(self) -> dict:
        return {"skips": self.skips}


class GradScalerSkip(Method):
    name = "gradscaler_skip"

    def before_step(self, k, loss, norm):
        grads = grads_of(self.task.params(k))
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones(1))
        if found_inf.item():
            self.skips += 1
            return "skip"
        return "step"


class TorchtitanStop(Method):
    name = "torchtitan_stop"

    def before_step(self, k, loss, norm):
        norm = total_norm(self.task.params(k)) if norm is None else norm
        return "step" if math.isfinite(float(loss)) and math.isfinite(float(norm)) else "stop"


class SkipStepWindow:
    """OLMo-core's SkipStep statistic: rolling loss and grad-norm windows, a 0/1 factor."""

    def __init__(self, rolling_interval_length: int = 128, sigma_factor: int = 6):
        self.length, self.sigma = rolling_interval_length, sigma_factor
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []

    def push(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        for window, value in ((self.losses, loss), (self.norms, norm)):
            window.append(value.detach().float().reshape(()))
            del window[:-(self.length + 1)]

    def factor(self) -> torch.Tensor:
        if len(self.losses) < max(2, self.length // 2):
            return torch.tensor(1.0)
        ok = torch.tensor(True)
        for window in (self.losses, self.norms):
            std, mean = torch.std_mean(torch.stack(window[:-1]))
            ok = ok & ((window[-1] - mean) <= self.sigma * std)  # NaN anywhere: False
        return ok.float()


class SkipStepAdamW(torch.optim.Optimizer):
    """AdamW whose whole update is multiplied by a 0/1 step factor (OLMo-core's SkipStepAdamW)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.window = SkipStepWindow()
        self.last_factor = torch.tensor(1.0)

    @torch.no_grad()
    def step(self, closure=None):
        f = self.last_factor = self.window.factor()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros(())
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                g, m, v, t = p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"]
                p.mul_(1 - f * (lr * wd))
                m.lerp_(g, f * (1 - b1))  # weight 0 still computes m + 0 * (g - m): NaN stays NaN
                v.mul_(1 - f * (1 - b2)).add_(f * g * g, alpha=1 - b2)
                denom = (v.sqrt() / (1 - b2 ** (t + 1)).sqrt()).add_(eps)
                p.add_(-(lr / (1 - b1 ** (t + 1))) * m / denom * f)
                t.add_(f)


class OlmoSkipStep(Method):
    name = "olmo_skipstep"

    def optimizer(self, spec, params):
        if spec["name"] in ("adam", "adamw"):
            return SkipStepAdamW(params, lr=spec["lr"], betas=spec["betas"], weight_decay=spec["wd"])
        opt = make_optimizer(spec, params)
        opt._skipstep_window = SkipStepWindow()  # gated from outside (see step)
        return opt

    def attach(self, task, opts, scheds):
        super().attach(task, opts, scheds)
        self.pending = [[] for _ in opts]

    def report_loss(self, k, loss):
        self.pending[k].append(loss.detach())

    def before_step(self, k, loss, norm):
        norm = total_norm(self.task.params(k)) if norm is None else norm
        opt = self.opts[k]
        window = opt.window if isinstance(opt, SkipStepAdamW) else opt._skipstep_window
        window.push(torch.stack(self.pending[k]).mean(), norm)  # the batch loss: mean over micro-batches
        self.pending[k] = []
        return "step"

    @torch.no_grad()
    def step(self, k):
        opt = self.opts[k]
        if isinstance(opt, SkipStepAdamW):
            opt.step()
            f = opt.last_factor
        else:
            f = opt._skipstep_window.factor()
            tensors = [p for g in opt.param_groups for p in g["params"]]
            tensors += [v for st in opt.state.values() for v in st.values()
                        if torch.is_tensor(v) and v.is_floating_point()]
            old = [t.clone() for t in tensors]
            opt.step()
            for t, o in zip(tensors, old):
                t.copy_(o + f * (t - o))
        self.skips += int(f.item() == 0.0)


class ZClipMethod(Method):
    name = "zclip"

    def attach(self, task, opts, scheds):
        from zclip import ZClip

        super().attach(task, opts, scheds)
        self.zclips = [ZClip() for _ in opts]

    def clip(self, k):
        return torch.tensor(self.zclips[k].step(self.task.models[k]))


class Earlywarn(Method):
    name = "earlywarn"

    def attach(self, task, opts, scheds):
        import earlywarn

        super().attach(task, opts, scheds)
        self.ews = [earlywarn.watch(task.models[k], opt, sinks=[], scheduler=scheds[k]) for k, opt in enumerate(opts)]

    def report_loss(self, k, loss):
        self.ews[k].report_loss(loss)

    def skip_total(self):
        return sum(int(ew.counters.get("skipped_steps", 0)) for ew in self.ews)

    def close(self):
        for ew in self.ews:
            ew.close()
        counters: dict[str, int] = {}
        for ew in self.ews:
            for key, v in ew.counters.items():
                counters[key] = counters.get(key, 0) + int(v)
        events = [{"opt": k, "step": int(e.step), "kind": str(e.kind), "level": str(e.level), "message": e.message}
                  for k, ew in enumerate(self.ews) for e in ew.events]
        return {"skips": counters.get("skipped_steps", 0), "counters": counters, "events": events}


_CLASSES = {c.name: c for c in (Method, GradScalerSkip, TorchtitanStop, OlmoSkipStep, ZClipMethod, Earlywarn)}


def make_method(name: str) -> Method:
    try:
        return _CLASSES[name]()
    except KeyError:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}") from None
