"""The detector's output on long replays as recorded (alerts exactly, values to ~1e-9; tests/detector_golden.py):
a refactor must not move an alert or a bit of state; a rule change records new figures."""

from __future__ import annotations

import json

import pytest

from detector_golden import GOLDEN, cases, replay

_WANT = json.loads(GOLDEN.read_text())
_CASES = cases()


@pytest.mark.parametrize("name", sorted(_WANT))
def test_long_replays_give_the_recorded_alerts_and_state(name):
    got, want = replay(*_CASES[name]), _WANT[name]
    moved = [a for a in got["alerts"] if a not in want["alerts"]] + [a for a in want["alerts"] if a not in got["alerts"]]
    assert got["alerts"] == want["alerts"], (
        f"{name}: alerts (row, kind, level) moved: {moved[:10]}; if a rule changed on purpose, record the new "
        "figures: PYTHONPATH=. python tests/detector_golden.py --update")
    assert got["digest"] == want["digest"], (
        f"{name}: the same alerts, but their values, messages or the final state differ in some bit; if a rule "
        "changed on purpose: PYTHONPATH=. python tests/detector_golden.py --update")
