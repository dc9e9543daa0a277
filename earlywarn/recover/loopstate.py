"""State the training loop owns, saved and restored with the run (rewinds and resumes).

A rewind restores the model, the optimizer, the scheduler -- and nothing the loop keeps in its own
variables. nanoGPT computes its learning rate from its own ``iter_num``: after a rewind to step
100 from step 152 the schedule would carry on from 153. Keep such values in a :class:`LoopState`
given to ``watch(..., extra_state={"loop": state})`` and they go back with the model.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping


class LoopState:
    """A namespace of the loop's own values that follows rewinds and resumes::

        loop = earlywarn.LoopState(iter_num=0, tokens_seen=0)
        ew = earlywarn.watch(model, optimizer, extra_state={"loop": loop})
        while loop.iter_num < max_iters:
            lr = get_lr(loop.iter_num)
            ...
            optimizer.step()          # a rewind in here puts loop.iter_num back too
            loop.iter_num += 1

    Values are saved as they are: keep them plain (numbers, strings, lists, dicts, tensors),
    which is what ``torch.load(weights_only=True)`` accepts.
    """

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(f"LoopState has no value {name!r} (it has {', '.join(values) or 'none'})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __delattr__(self, name: str) -> None:
        del self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._values)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._values.clear()
        self._values.update(copy.deepcopy(dict(state)))

    def __repr__(self) -> str:
        return "LoopState(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"
