"""The run's clock: one timeline for events and tracker rows, across rewinds, saves and resumes
(a training step is on the clock of the segment of the trajectory it was trained in), and for
every step a message names; and watchers that say which they are when a process has several."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
import torch.nn as nn

import earlywarn
from earlywarn.events import Event, Kind
from earlywarn.guard.telemetry import RunClock
from earlywarn.recover import Halt, RecoveryConfig
from earlywarn.recover.records import QuarantineRecord, _ranges
from earlywarn.sinks import Sink
from earlywarn.sinks.console import ConsoleSink
from fixtures_models import MLP

torch.set_num_threads(1)


# -- the clock ---------------------------------------------------------------------------------
def test_a_training_step_is_on_the_run_clock_of_the_segment_it_was_trained_in():
    clock = RunClock()
    clock.step = 153
    clock.rewound(152, 126)  # 152 -> state of 125: 126 is trained again at 153
    assert (clock.step, clock.offset) == (126, 27)
    assert [clock.run(s) for s in (0, 125, 126, 140)] == [0, 125, 153, 167]
    clock.rewound(140, 131)  # 140 (run 167) -> state of 130 (run 157)
    assert clock.segments == [(126, 27), (131, 37)]
    assert [clock.run(s) for s in (125, 130, 131)] == [125, 157, 168]
    clock.rewound(150, 101)  # back past both segments: they are trained again under the new offset
    assert clock.segments == [(101, 87)] and [clock.run(s) for s in (100, 101)] == [100, 188]


def test_the_clock_saves_its_segments_and_reads_the_old_form():
    clock = RunClock()
    clock.rewound(152, 126)
    clock.rewound(140, 131)
    saved = clock.state_dict()
    assert saved == {"step": 131, "log_offset": 37, "segments": [[126, 27], [131, 37]]}
    again = RunClock()
    again.load_state_dict(saved)
    assert again == clock
    old = RunClock()
    old.load_state_dict({"step": 80, "log_offset": 12})  # saved before segments existed
    assert (old.step, old.offset, old.run(80), old.run(3)) == (80, 12, 92, 15)
    old.load_state_dict({"step": 5})
    assert (old.offset, old.run(5)) == (0, 5)
    live = RunClock(step=10)
    live.merge(saved)  # a checkpoint loaded into a live watcher: neither clock goes back
    assert (live.step, live.segments) == (131, clock.segments)


def test_quarantined_steps_are_named_on_the_run_clock_split_where_it_jumps():
    clock = RunClock()
    clock.rewound(152, 126)
    records = [QuarantineRecord(160, "loss_diverged", None, None, None, s) for s in range(120, 131)]
    assert _ranges(records) == "11 batches, drawn for steps 120-130"
    assert _ranges(records, clock.run) == "11 batches, drawn for steps 120-125, 153-157"
    assert _ranges(records[:1], clock.run) == "1 batch, drawn for step 120"


# -- runs --------------------------------------------------------------------------------------
class Rows(Sink):
    """Records every metric row's step: a tracker drops or overlays a row whose step is not new."""

    name = "rows"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, step, metrics) -> None:
        self.steps.append(step)


def _model_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(ew, model, opt, steps: int, poison_at: set[int], g: torch.Generator) -> None:
    for _ in range(steps):
        if ew.step in poison_at:
            poison_at.discard(ew.step)
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")  # poisoned weights: the next loss is NaN -> a rewind
        x = torch.randn(16, 4, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_rewound_run_saved_and_resumed_never_logs_a_step_it_already_logged(tmp_path):
    g = torch.Generator().manual_seed(1)
    model, opt = _model_opt()
    rows = Rows()
    cfg = earlywarn.RecoveryConfig(snapshot_every=10, quarantine_path=str(tmp_path / "q.jsonl"))
    ew = earlywarn.watch(model, opt, sinks=[rows], recovery=cfg)
    _train(ew, model, opt, 60, {42}, g)
    assert ew.counters["rewinds"] == 1 and ew.step < 60  # the training step went back
    saved, resumed_at = ew.state_dict(), ew.step
    path = tmp_path / "watcher.pt"
    torch.save(saved, path)
    ew.close()

    rows2 = Rows()
    ew2 = earlywarn.watch(model, opt, sinks=[rows2], recovery=cfg)
    ew2.load_state_dict(torch.load(path, weights_only=True))
    assert ew2.step == resumed_at
    _train(ew2, model, opt, 20, set(), g)
    ew2.close()
    logged = rows.steps + rows2.steps
    assert logged == sorted(set(logged)), "a step logged twice or out of order"
    assert rows2.steps[0] == rows.steps[-1] + 1


def test_events_of_a_rewound_run_are_on_the_run_clock(tmp_path):
    g = torch.Generator().manual_seed(2)
    model, opt = _model_opt()
    rows = Rows()
    ew = earlywarn.watch(model, opt, sinks=[rows], recovery=earlywarn.RecoveryConfig(
        snapshot_every=10, quarantine_path=str(tmp_path / "q.jsonl")))
    _train(ew, model, opt, 70, {30, 55}, g)
    ew.close()
    assert ew.counters["rewinds"] == 2
    steps = [e.step for e in ew.events]
    assert steps == sorted(steps)  # events never go back in time
    rewinds = [e for e in ew.events if e.kind is Kind.REWIND]
    assert all(e.step in rows.steps for e in rewinds)  # the rewind's row is the incident's own


def test_two_watchers_in_one_process_say_which_they_are():
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 1))
    out = io.StringIO()
    g_opt, d_opt = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    ew_g = earlywarn.watch(gen, g_opt, sinks=[ConsoleSink(stream=out)])
    assert ew_g.name is None  # alone: nothing to tell apart
    ew_d = earlywarn.watch(disc, d_opt, sinks=[ConsoleSink(stream=out)], name="discriminator")
    assert (ew_g.name, ew_d.name) == ("Linear", "discriminator")
    for ew, model, opt in ((ew_g, gen, g_opt), (ew_d, disc, d_opt)):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        next(model.parameters()).grad[0, 0] = float("inf")  # a skipped step: one console line each
        opt.step()
    ew_g.close()
    ew_d.close()
    lines = out.getvalue().splitlines()
    assert any(line.startswith("[earlywarn CRITICAL Linear] step 0") for line in lines), lines
    assert any(line.startswith("[earlywarn CRITICAL discriminator] step 0") for line in lines), lines
    assert {e.source for e in ew_d.events} == {"discriminator"}
    # a third watcher of the same class as the first gets a number
    third = torch.nn.Linear(4, 4)
    ew3 = earlywarn.watch(third, torch.optim.Adam(third.parameters()), sinks=[])
    ew4 = earlywarn.watch(gen, torch.optim.Adam(gen.parameters()), sinks=[])
    assert {ew3.name, ew4.name} == {"Linear", "Linear#2"}
    ew3.close()
    ew4.close()


# -- what a rewound, saved and resumed run's messages name -------------------------------------
class Recorder(Sink):
    """Every call, in order: ("row", step) for log_metrics, ("event", Event) for alert."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def log_metrics(self, step: int, metrics) -> None:
        self.calls.append(("row", step))

    def alert(self, event: Event) -> None:
        self.calls.append(("event", event))


_ONE = re.compile(r"(?<![\w.])step (-?\d+)")
_MANY = re.compile(r"(?<![\w.])steps (\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)")


def named_steps(message: str) -> list[int]:
    """Every step a message names: 'step N', 'steps A-B, C-D' (both ends of a span)."""
    out = [int(m.group(1)) for m in _ONE.finditer(message)]
    for m in _MANY.finditer(message):
        out += [int(n) for n in re.split(r"[-,] ?", m.group(1))]
    return out


def test_named_steps_reads_what_messages_say():
    assert named_steps("rewound to the clean state of step 25 (memory:25), 6 steps lost; 6 batches never "
                       "trained again: 6 batches, drawn for steps 26-31, 40-41; training goes on from it "
                       "(ew.step = 26). After 200 steps") == [25, 26, 31, 40, 41]


W = torch.randn(8, 1, generator=torch.Generator().manual_seed(5))  # the MLP's target map


def poison(model: nn.Module) -> None:
    with torch.no_grad():
        model.hidden.weight[0, 0] = math.nan  # the next loss is NaN: parameters poisoned, a rewind


def train_mlp(ew, model, opt, iterations: range, poison_at: set[int]) -> None:
    for i in iterations:
        x = torch.randn(32, 8)
        loss = nn.functional.mse_loss(model(x), x @ W)
        ew.report_loss(loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i in poison_at:
            poison(model)


def watched_mlp(recorder: Recorder, tmp_path, state=None):
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    ew = earlywarn.watch(model, opt, sinks=[recorder], recovery=RecoveryConfig(
        quarantine_path=str(tmp_path / "q.jsonl"), on_recurrence="lower_lr", max_rewinds_per_episode=3))
    if state is not None:
        ew.load_state_dict(state["watcher"])
    return ew, model, opt


def test_a_rewound_saved_and_resumed_run_logs_each_step_once_and_names_steps_on_its_clock(tmp_path):
    torch.manual_seed(0)
    recorder = Recorder()
    ew, model, opt = watched_mlp(recorder, tmp_path)
    reports = []
    ew.on_rewind(reports.append)
    train_mlp(ew, model, opt, range(0, 46), poison_at={30, 36})  # a rewind, and its recurrence
    assert [r.recurrence is not None for r in reports] == [False, True]
    assert ew.step < 46 and ew.counters["rewinds"] == 2
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "watcher": ew.state_dict()}
    ew.close()

    # a new process: a fresh model, optimizer and watcher, resumed from what was saved
    torch.manual_seed(1)
    ew, model, opt = watched_mlp(recorder, tmp_path, state)
    ew.on_rewind(reports.append)
    with pytest.raises(Halt) as halt:  # it keeps coming back: a third rewind, then the policy's limit halts
        train_mlp(ew, model, opt, range(46, 80), poison_at={48, 53})
    assert halt.value.reason == "policy"
    assert [r.recurrence is not None for r in reports] == [False, True, True]
    ew.close()

    rows = [s for kind, s in recorder.calls if kind == "row"]
    assert rows == list(range(55)), "a step was logged twice, out of order, or not at all"  # the halted one too

    known: set[int] = set()  # run steps logged or emitted so far
    events = 0
    for kind, item in recorder.calls:
        if kind == "row":
            known.add(item)
            continue
        known.add(item.step)
        events += 1
        for n in named_steps(item.message):
            assert n <= item.step and n in known, (n, item.step, item.message)
        # what a message says happened now happened at the event's own step
        for n in re.findall(r"(?:recurrence: \w+|turned NaN|halted the run) at step (\d+)", item.message):
            assert int(n) == item.step, (n, item.step, item.message)
    assert events > 10
    halts = [e for kind, e in recorder.calls if kind == "event" and e.kind is Kind.HALT]
    assert len(halts) == 1 and halts[0].step == 54
    # what outlived the rewinds and the resume is named on the run's clock: the first incident,
    # the rewinds so far, the snapshot of the watcher resumed into
    rewinds = [e for kind, e in recorder.calls if kind == "event" and e.kind is Kind.REWIND]
    assert [e.step for e in rewinds] == [31, 37, 49]
    assert all(re.search(r"\(the first incident: \w+ at step 31\)", r.recurrence) for r in reports[1:])
    assert "rewinds so far: at step 31 (nonfinite_grad) to step 25, at step 37 (nonfinite_grad) to step 25, " \
           "at step 49 (nonfinite_grad) to step 46" in halts[0].message
    assert "state of step 46 (memory:46)" in rewinds[2].message and reports[2].resume_step == 35
    assert "training goes on from it (ew.step = 35)" in rewinds[2].message


def test_the_alert_and_the_skip_name_the_same_first_layer():
    # registration order (emb, ..., head) differs from backward order (head first): both the
    # detector's alert and the guard's skip name the layer backward reached first
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Linear(4, 8)
            self.mid = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(torch.tanh(self.mid(torch.tanh(self.emb(x)))))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    ew = earlywarn.watch(model, opt, sinks=[])
    for i in range(3):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        loss.backward()
        if i == 2:
            model.emb.weight.grad[0, 0] = float("nan")
            model.head.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    ew.close()
    alert = next(e for e in ew.events if e.kind is Kind.NONFINITE_GRAD)
    skip = next(e for e in ew.events if e.kind is Kind.SKIP)
    assert alert.layers[0] == skip.layers[0] == "head" and "first in head" in alert.message
