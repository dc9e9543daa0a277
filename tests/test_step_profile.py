"""``overhead.py --knockout``'s contract: each copy runs without exactly the part it is named for.

The knock-out table says what removing a part saves; if a rename left a neutraliser patching an
attribute the watcher no longer calls, the copy would run intact and the table would say the part
costs nothing. Each part is counted on its class, beneath the instance attribute a knock-out sets
(or one call below it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import earlywarn
from earlywarn.capture.gradstats import GradStats
from earlywarn.detect.detector import Detector
from earlywarn.guard.telemetry import Telemetry
from earlywarn.recover.batches import BatchFingerprints
from earlywarn.recover.snapshots import LiveState
from earlywarn.recover.statecheck import StateCheck

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import step_profile  # noqa: E402

# the function whose calls show the part at work, per knock-out
WORK = {
    "norms": (GradStats, "layer_sq_norms"),
    "snapshots": (LiveState, "capture"),
    "detector": (Detector, "step"),
    "state check": (StateCheck, "tensors"),
    "fingerprint": (BatchFingerprints, "_hash"),
    "metric row": (Telemetry, "log_rows"),  # every row: a judged step's, calm steps' folded in
}


def _steps(neutralise, monkeypatch, steps: int = 40) -> dict[str, int]:
    # (40 steps: batch fingerprints are hashed 32 steps at a time)
    calls = dict.fromkeys(WORK, 0)
    for part, (owner, attr) in WORK.items():
        real = owner.__dict__[attr]

        def counted(*args, _real=real, _part=part, **kwargs):
            calls[_part] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, attr, counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ew = earlywarn.watch(model, opt, sinks=[])
    if neutralise is not None:
        neutralise(ew)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        opt.step()
    ew.close()
    monkeypatch.undo()
    return calls


def test_every_part_is_at_work_in_an_intact_run(monkeypatch):
    calls = _steps(None, monkeypatch)
    assert all(n > 0 for n in calls.values()), calls


@pytest.mark.parametrize("part", list(step_profile.KNOCKOUTS))
def test_a_knockout_removes_its_part_and_nothing_else(part, monkeypatch):
    calls = _steps(step_profile.KNOCKOUTS[part][1], monkeypatch)
    # the norm pass runs once: its first values stand for every later step
    assert calls[part] == (1 if part == "norms" else 0), calls
    others = {k: n for k, n in calls.items() if k != part}
    assert all(n > 0 for n in others.values()), others


def test_profile_and_knockout_take_one_shape_and_say_so():
    proc = subprocess.run([sys.executable, str(BENCH / "overhead.py"), "--profile", "gpt", "--knockout", "gpt"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "give one of --profile SHAPE, --knockout SHAPE and --cold SHAPE" in proc.stderr


def test_cold_prints_every_call_in_every_condition():
    # each kind of call is timed on every 4th step, first or behind another call on alternate
    # rounds: 16 steps give each cell two values
    proc = subprocess.run([sys.executable, str(BENCH / "overhead.py"), "--cold", "small", "--steps", "16",
                           "--warm", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    calls, _, passes = proc.stdout.partition("| pass | over 291 tensors | over one tensor | the price per tensor |")
    assert passes, proc.stdout
    rows = [line for line in calls.splitlines() if line.startswith("| ") and " us |" in line]
    assert len(rows) == 4, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert len(cells) == 4 and all(float(c.removesuffix(" us")) > 0 for c in cells), row
    # the same bytes passed over as 291 tensors and as one: both timed, the difference per tensor
    rows = [line for line in passes.splitlines() if line.startswith("| ") and " us |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["per-tensor norms (one tensor: np.square, np.add.reduceat)", "total norm (one tensor: vector_norm)",
                                                   "a copy, as a snapshot's (one tensor: copy_)"]
    for row in rows:
        many, one, each = (float(c.strip().removesuffix(" us")) for c in row.strip("|").split("|")[1:])
        assert many > 0 and one > 0 and abs(each - (many - one) / 291) <= 0.06, row
    # the update's share of the gradients' first read, paired: the read timed, the update's change signed
    m = re.search(r"the read itself (\d+) us; the update after it is (-?\d+) us cheaper", proc.stdout)
    assert m is not None, proc.stdout
    assert int(m.group(1)) > 0


def test_the_least_guard_does_the_work_it_stands_for():
    # The table's "least guard" row is a floor only if it really reads, decides, checks and copies:
    # a row that skipped its work would make every goal look within reach.
    import overhead

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    least = overhead.LeastGuard(model, opt, copy_every=3, state_every=2)

    def step(bad_grad: bool = False) -> None:
        opt.zero_grad(set_to_none=True)
        model(torch.randn(5, 4)).pow(2).mean().backward()
        if bad_grad:
            model[0].weight.grad[0, 0] = float("nan")
        least()
        opt.step()

    for _ in range(4):  # copies at calls 0 and 3: the latter holds the weights as the 4th update found them
        before = [p.detach().clone() for p in model.parameters()]
        step()
    assert len(least.copies) == 4 + 3 * 4  # 4 parameters, then AdamW's step, exp_avg, exp_avg_sq of each
    assert all(torch.equal(c, b) for c, b in zip(least.copies, before))
    assert least.copies[4].item() == 3.0  # the state as of the copy: 3 updates taken

    before = [p.detach().clone() for p in model.parameters()]
    step(bad_grad=True)  # call 4: a non-finite gradient is skipped, the update never sees it
    assert least.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    assert least.state_finite
    next(iter(opt.state.values()))["exp_avg_sq"].view(-1)[0] = float("inf")
    step()  # call 5: no state check (every 2nd call)
    assert least.state_finite
    step()  # call 6: checked
    assert not least.state_finite
