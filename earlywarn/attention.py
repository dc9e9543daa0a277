"""Attention-logit growth, from the signal a transformer's user reports: the largest attention
logit, ``ew.report("attn_logit_max/<layer>", ...)`` (or ``"attn_logit_max"`` for the model).
Pure Python.

At a learning rate too high for the model the query and key weights grow until the attention
logits do: the softmax saturates to one-hot, its gradients vanish and the loss degrades or
diverges (Dehghani et al. 2023, ViT-22B; Wortsman et al. 2023, small-scale proxies, where it is
the first of the instabilities that qk-layernorm removes). The loss does not show it until late.
On ``benchmarks/natural.py``'s char GPT (no qk-norm) the largest attention logit stays at 12-17
at the best rate and under qk-layernorm at every rate, and goes past 50 before the loss degrades
in 11 of 12 runs at 4-32x the best rate (a median 37 steps ahead); one run at 2x reaches 57 and
trains (its loss 16% behind the best's).

So a logit above ``LOGIT_BOUND`` for ``LOGIT_STEPS`` steps in a row is a warning that names the
layer, the mechanism and the fixes, and each doubling past it (100, 200, ...) another; the policy
answers each by lowering the learning rate (``PolicyConfig.logit_lr_factor``). It reads the value
as reported: the scaled logit ``q.k / sqrt(d)`` before the softmax.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .events import Event, Kind, Level

SIGNAL = "attn_logit_max"
"""The name (or the prefix, before ``/<layer>``) of the user signal this module reads."""

LOGIT_BOUND = 50.0
"""The largest attention logit a run is warned at (see the module's docstring for the measure)."""

LOGIT_STEPS = 3
"""Steps in a row above the bound before it counts (a single batch's outlier is not growth)."""

MECHANISM = ("attention-logit growth: the query and key weights have grown until the softmax saturates "
             "(Dehghani et al. 2023, Wortsman et al. 2023); the loss degrades or diverges next")
FIXES = "the fixes: a lower learning rate, qk-layernorm (normalize queries and keys), z-loss on the output logits"


class LogitWatch:
    """``watch.push(step, extras) -> Event | None`` every step the user reports the signal.
    State: the level reached (the bound crossed doubles each time: 0 none yet), the steps in a
    row above the next level."""

    def __init__(self) -> None:
        self.level = 0
        self.above = 0

    @property
    def next_bound(self) -> float:
        return LOGIT_BOUND * 2.0 ** self.level

    def push(self, step: int, extras: Mapping[str, float]) -> Event | None:
        """``extras``: the observation's extras (``"user/attn_logit_max..."`` read; others ignored)."""
        top, layer = -math.inf, ""
        for key, value in extras.items():
            if key.startswith("user/" + SIGNAL) and value is not None and value > top:  # (False on NaN)
                top, layer = value, key[len("user/" + SIGNAL):].lstrip("/")
        if top == -math.inf:
            return None
        bound = self.next_bound
        self.above = self.above + 1 if top > bound else 0
        if self.above < LOGIT_STEPS:
            return None
        self.level += 1
        while top > self.next_bound:  # a jump past several doublings is one warning
            self.level += 1
        self.above = 0
        where = f" in {layer}" if layer else ""
        return Event(step=step, kind=Kind.LOGIT_GROWTH, level=Level.WARNING, signal="user/" + SIGNAL,
                     layers=(layer,) if layer else (),
                     message=(f"the largest attention logit{where} is {top:.3g}, above {bound:.3g} for "
                              f"{LOGIT_STEPS} steps: {MECHANISM}. The learning rate is too high for this "
                              f"model; {FIXES}."),
                     values={"value": top, "bound": bound})

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "above": self.above}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.level = int(d.get("level", 0))
        self.above = int(d.get("above", 0))
