"""One kind per thing: an event's kind means one thing, so counting a kind counts that thing once
-- in the event log, the watcher's counters, the trackers' tags and metrics -- and its ``values``
are the ones docs/trackers.md lists for that kind. (The LR ceiling a rewind sets was a second
event of kind ``rewind``, with no ``restored_step``: every count of rewinds counted it twice.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import earlywarn
from earlywarn.events import Kind
from earlywarn.recover import RecoveryConfig
from earlywarn.sinks import Sink
from earlywarn.sinks.base import EventTally
from fixtures_models import MLP

torch.set_num_threads(1)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "trackers.md"
W = torch.randn(8, 1, generator=torch.Generator().manual_seed(3))


def documented() -> dict[str, set[str]]:
    """``kind -> the values keys`` of the table under "## Event kinds" in docs/trackers.md."""
    text = DOCS.read_text()
    table = text.split("## Event kinds", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = set(re.findall(r"`([a-z_]+)`", cells[3]))
    return out


class Recorder(Sink):
    """What a tracker gets: each event, and the last metric row."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list = []
        self.row: dict = {}
        self.tally = EventTally()

    def alert(self, event) -> None:
        self.events.append(event)
        self.tally.update(event)

    def log_metrics(self, step, metrics) -> None:
        self.row = dict(metrics)


def test_every_kind_is_documented_with_its_values():
    doc = documented()
    assert set(doc) == {str(k) for k in Kind}, set(doc) ^ {str(k) for k in Kind}


def _lr_pulse_run(tmp_path, dry_run: bool = False):
    # an LR pulse the run does not take: a rewind, then the LR held at the rate it had survived
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)
    rec = Recorder()
    ew = earlywarn.watch(model, opt, sinks=[rec], dry_run=dry_run,
                         recovery=RecoveryConfig(quarantine_path=str(tmp_path / "q.jsonl")))
    while ew.step < 120:
        for g in opt.param_groups:
            g["lr"] = 2e-2 * (60.0 if 62 <= ew.step < 80 else 1.0)
        x = torch.randn(32, 8)
        loss = nn.functional.mse_loss(model(x), x @ W)
        ew.report_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dry_run and ew.step >= 90:
            break  # (a dry run goes on diverging: what it would have done is said by then)
    ew.close()
    return ew, rec


@pytest.mark.parametrize("dry_run", [False, True], ids=["acting", "dry_run"])
def test_a_rewind_and_the_lr_ceiling_it_sets_count_once_each_everywhere(tmp_path, dry_run):
    ew, rec = _lr_pulse_run(tmp_path, dry_run)
    rewinds = [e for e in ew.events if e.kind is Kind.REWIND]
    holds = [e for e in ew.events if e.kind is Kind.LR_HOLD]
    assert rewinds and holds, [str(e) for e in ew.events]
    name = "would_rewind" if dry_run else "rewind"
    # the log, the counters, the trackers' tags and the metric row all say the same number
    assert rec.tally.counts.get(name) == len(rewinds) == ew.counters["would_rewind" if dry_run else "rewinds"]
    assert rec.row["earlywarn/" + ("would_rewind" if dry_run else "rewinds")] == len(rewinds)
    assert rec.tally.counts.get("would_lr_hold" if dry_run else "lr_hold") == len(holds)
    if dry_run:
        assert ew.counters["rewinds"] == 0 and "rewind" not in rec.tally.counts
    else:
        assert all("restored_step" in e.values for e in rewinds)  # each one a rewind, nothing else
    doc = documented()
    for e in ew.events:  # every event's values are the ones documented for its kind
        extra = set(e.values) - doc[str(e.kind)] - ({"dry_run"} if dry_run else set())
        assert not extra, f"{e.kind}: {sorted(extra)} not in docs/trackers.md ({e})"
