"""earlywarn's response to trouble on generated runs (issue 20): one config of every family of
benchmarks/rescue.py. Healthy runs are never halted, rewound, given a CRITICAL or left worse;
dying runs of every fault family are brought back (the benchmark measures the rates)."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import rescue  # noqa: E402
from rescue_families import FAULT_FAMILIES, HEALTHY, twin_of  # noqa: E402
from rescue_harness import run_one  # noqa: E402
from test_rescue_families import _smallest, _strong  # noqa: E402

pytestmark = pytest.mark.slow


def _levels(res: dict) -> list[str]:
    return [e["level"] for e in res["events"]] if isinstance(res["events"], list) else []


# A known harm, not fixed (the closing note of issue 48 gives the numbers): the smallest
# heavy_reward run's first payout is a 1.1e4x gradient with the loss at its level, and a first
# outlier so is told from a gradient scaled after the loss (the huge_grad family) by nothing
# measured -- its loss (0.70x, z -4.9 against huge_grad's 0.70x, z -3.6) and its layers (all
# up alike) look the same. Taken at its typical norm as a whole, the run ended at 0.72706
# against the bare run's 0.72539 (E0 0.72680: bare's progress is 0.19% of E0, so 0.23% of E
# read as kept -0.18); bare with that step clipped to 3x or 30x its typical norm ends at
# 0.72706-0.72707 too. Held element by element to its running RMS (earlywarn.guard.bound) it
# kept 0.10; to 3x that RMS (outlier_clip_ratio: a first outlier whose loss is at its level), 0.87.
# strict: the day it passes, this mark goes.
_ACTS = ("skip", "clip", "lr_hold")  # the event kinds of an action that changes a healthy run's updates
_KNOWN_WORSE = {"heavy_reward": "first heavy-tail outlier bounded: kept 0.87 on a run whose bare progress is 0.19% of E0"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_WORSE[n]))
                                  if n in _KNOWN_WORSE else n for n in sorted(HEALTHY)])
def test_a_healthy_run_of_every_family_is_left_alone(name):
    """No halt, rewind or CRITICAL; where earlywarn acted at all (a skip, a clip, an LR held), the
    run ends no worse than bare."""
    cfg = _smallest(HEALTHY[name])
    ew = run_one(cfg, "earlywarn")
    assert ew["error"] is None, ew["error"]
    assert not ew["halted"], ew["halt_message"]
    assert ew["counters"]["rewinds"] == 0 and "critical" not in _levels(ew), ew["events"]
    if ew["counters"]["skipped_steps"] or any(e["kind"] in _ACTS for e in ew["events"]):  # it acted: no worse than bare
        bare = run_one(cfg, "bare")
        assert rescue.kept(bare["E0"], ew["E"], bare["E"]) >= 1.0 - rescue.WORSE_MARGIN


@pytest.mark.parametrize("name", sorted(n for n, f in FAULT_FAMILIES.items() if f.kind == "fault"))
def test_a_dying_run_of_every_fault_family_is_rescued(name):
    cfg = _strong(name)
    ew, twin = run_one(cfg, "earlywarn"), run_one(twin_of(cfg), "bare")
    assert ew["error"] is None, ew["error"]
    assert not ew["halted"], ew["halt_message"]
    kept = rescue.kept(twin["E0"], ew["E"], twin["E"])
    assert kept >= rescue.RESCUED_AT, (name, kept, [e for e in ew["events"] if e["level"] != "info"][:6])
    assert math.isfinite(ew["E"]) and ew["params_finite"]
