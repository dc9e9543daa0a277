"""The run's clock: one timeline for events and tracker rows, across rewinds, saves and resumes
(a training step is on the clock of the segment of the trajectory it was trained in); and watchers
that say which they are when a process has several."""

from __future__ import annotations

import io

import torch

import earlywarn
from earlywarn.events import Kind
from earlywarn.guard.telemetry import RunClock
from earlywarn.sinks import Sink
from earlywarn.sinks.console import ConsoleSink

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
