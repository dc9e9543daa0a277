"""The console sink: one line per incident (what happened, where, what was done), every event kept
elsewhere. Real watchers on real faults first, then the merging rules one by one."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import earlywarn
from earlywarn.events import Event, Kind, Level
from earlywarn.sinks import ConsoleSink
from fixtures_models import MLP

torch.set_num_threads(1)


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]


def lines_of(stream: io.StringIO) -> list[str]:
    # incident lines only: notes said once at watch() ("[earlywarn] in-memory snapshots ...") are not
    return [ln for ln in stream.getvalue().splitlines() if ln.strip() and not ln.startswith("[earlywarn] ")]


def jsonl_kinds(path) -> list[tuple[int, str]]:
    return [(r["step"], r["kind"]) for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "event"]


def test_a_skipped_inf_gradient_is_one_line_naming_layer_batch_and_action(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = io.StringIO()
    ew = earlywarn.watch(model, opt, sinks=[ConsoleSink(stream=out), "jsonl"],
                         sink_options={"jsonl": {"path": str(tmp_path / "events.jsonl")}})
    for i, (x, y) in enumerate(batches(8)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == 3:
            model.hidden.weight.grad[3, 5] = float("inf")
        opt.step()
        if i == 3:  # printed when the step ends, not at close()
            assert len(lines_of(out)) == 1
    ew.close()
    (line,) = lines_of(out)
    # no loader: the batch is named by its step and the fingerprint of the model's inputs
    assert re.fullmatch(
        r"\[earlywarn CRITICAL\] step 3: non-finite gradient in 'hidden' \(first in backward order; 1 layer\(s\), "
        r"1 element\(s\)\) from the batch drawn for step 3 \(fingerprint [0-9a-f]{16}\): optimizer step skipped, "
        r"params and optimizer state untouched; quarantined the batch drawn for step 3 \(fingerprint [0-9a-f]{16}\): "
        r"non-finite gradient: bad batch \(parameters and optimizer state finite: the step was skipped before "
        r"anything was written, nothing rewound\); it is never trained -> .*quarantine.jsonl", line)
    # the event log keeps the detector's alert and the guard's actions apart
    assert jsonl_kinds(tmp_path / "events.jsonl") == [(3, "nonfinite_grad"), (3, "skip"), (3, "quarantine")]


def test_a_rewind_is_one_line_with_the_cause_the_blame_and_the_quarantine_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    loader = earlywarn.ResumableLoader(data, batch_size=8, seed=0)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = io.StringIO()
    quarantine = tmp_path / "quarantine.jsonl"
    ew = earlywarn.watch(model, opt, loader=loader, sinks=[ConsoleSink(stream=out), "jsonl"],
                         sink_options={"jsonl": {"path": str(tmp_path / "events.jsonl")}},
                         recovery=earlywarn.RecoveryConfig(snapshot_every=5, quarantine_path=str(quarantine)))
    for i, (x, y) in enumerate(loader):
        if i == 20:
            break
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        ew.report_loss(loss)
        loss.backward()
        if i == 12:  # NaN weights (what an update from poisoned state writes): the next loss is NaN
            model.hidden.weight.detach().fill_(float("nan"))
        opt.step()
    ew.close()
    (line,) = lines_of(out)
    assert line.startswith("[earlywarn CRITICAL] step 13: non-finite gradient (first in ")
    assert ", loss nan. Done: rewound to the clean state of step 10 (memory:10), 3 steps lost; 3 batches never " \
           "trained again: epoch 0 batches 11-13" in line
    assert "the batch responsible was batch 12 of epoch 0" in line
    assert line.endswith(f"; quarantine list: {quarantine}")
    assert re.search(r"\(samples \d+, \d+, \d+, \.\.\.\)", line)  # sample lists shortened on the console
    kinds = [k for s, k in jsonl_kinds(tmp_path / "events.jsonl") if s == 13]
    assert kinds == ["nonfinite_grad", "loss_nonfinite", "rewind", "quarantine"]
    full = [json.loads(r) for r in (tmp_path / "events.jsonl").read_text().splitlines()]
    rewind = next(r for r in full if r.get("kind") == "rewind")
    assert rewind["message"].startswith("nonfinite_grad: rewound")  # the log keeps every word


def test_halt_prints_its_line_before_the_exception_leaves_the_step(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = io.StringIO()
    ew = earlywarn.watch(model, opt, sinks=[ConsoleSink(stream=out)],
                         recovery=earlywarn.RecoveryConfig(rewind=False))
    with pytest.raises(earlywarn.Halt):
        for i, (x, y) in enumerate(batches(10)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            ew.report_loss(loss)
            loss.backward()
            if i == 4:
                model.hidden.weight.detach().fill_(float("nan"))
            opt.step()
    lines = lines_of(out)
    assert len(lines) == 1
    assert lines[0].startswith("[earlywarn CRITICAL] step 5: non-finite gradient")
    assert "Done: " in lines[0] and "rewinding is disabled (RecoveryConfig.rewind=False): halting" in lines[0]
    ew.close()


# ---------------------------------------------------------------------------------------- rules
def ev(step, kind, level, message, **kw) -> Event:
    return Event(step=step, kind=kind, level=level, message=message, **kw)


def sink_and_stream(**kw) -> tuple[ConsoleSink, io.StringIO]:
    out = io.StringIO()
    kw.setdefault("min_level", "info")  # these tests read the info lines too (the default is warning)
    return ConsoleSink(stream=out, **kw), out


def test_a_steps_events_wait_for_the_end_of_the_step():
    sink, out = sink_and_stream()
    sink.alert(ev(7, Kind.NONFINITE_GRAD, Level.CRITICAL, "Non-finite gradient at step 7, first in fc; skip it.",
                  layers=("fc",)))
    assert out.getvalue() == ""
    sink.alert(ev(7, Kind.SKIP, Level.CRITICAL, "non-finite gradient in 'fc' from batch #7: optimizer step skipped",
                  layers=("fc",)))
    assert out.getvalue() == ""
    sink.log_metrics(6, {})  # an older step's metrics do not end step 7
    assert out.getvalue() == ""
    sink.log_metrics(7, {})
    assert lines_of(out) == ["[earlywarn CRITICAL] step 7: non-finite gradient in 'fc' from batch #7: optimizer step skipped"]


def test_a_later_steps_event_flush_and_finish_end_a_step():
    sink, out = sink_and_stream()
    sink.alert(ev(3, Kind.GRAD_SPIKE, Level.INFO, "Isolated grad_norm spike at step 2: 4x its baseline; nothing to do."))
    sink.alert(ev(9, Kind.CHECKPOINT, Level.INFO, "checkpoint (periodic, clean) -> /c/step-9.pt"))
    assert lines_of(out) == ["[earlywarn INFO] step 3: Isolated grad_norm spike at step 2: 4x its baseline; nothing to do"]
    sink.flush()
    assert lines_of(out)[1:] == ["[earlywarn INFO] step 9: checkpoint (periodic, clean) -> /c/step-9.pt"]
    sink.alert(ev(10, Kind.HALT, Level.CRITICAL, "policy halted the run at step 10 after 4 rewinds"))
    sink.finish()
    assert lines_of(out)[2:] == ["[earlywarn CRITICAL] step 10: policy halted the run at step 10 after 4 rewinds"]


def test_a_warning_and_its_checkpoint_are_one_line_and_the_checkpoint_call_is_not_repeated():
    sink, out = sink_and_stream()
    sink.alert(ev(40, Kind.COLLAPSE_RISK, Level.WARNING,
                  "grad_norm jumped to 9x its baseline (0.2 -> 1.8) in one step, led by fc; collapse risk, save a "
                  "checkpoint now.", signal="grad_norm", layers=("fc",), values={"ratio": 9.0}))
    sink.alert(ev(40, Kind.CHECKPOINT, Level.INFO, "checkpoint (warning) -> /c/step-39.unclean.pt", signal="warning"))
    sink.checkpoint(40, "/c/step-39.unclean.pt", "warning")  # the guard reports it this way too
    sink.log_metrics(40, {})
    assert lines_of(out) == [
        "[earlywarn WARNING] step 40: grad_norm jumped to 9x its baseline (0.2 -> 1.8) in one step, led by fc; "
        "collapse risk, save a checkpoint now. Done: checkpoint (warning) -> /c/step-39.unclean.pt"
    ]
    sink.checkpoint(50, "/c/step-50.pt", "manual")  # a checkpoint reported only through the call
    sink.log_metrics(50, {})
    assert lines_of(out)[1:] == ["[earlywarn INFO] step 50: checkpoint (manual) -> /c/step-50.pt"]


def test_min_level_applies_to_the_whole_incident():
    sink, out = sink_and_stream(min_level="warning")
    sink.alert(ev(1, Kind.GRAD_SPIKE, Level.INFO, "spike"))
    sink.log_metrics(1, {})
    sink.alert(ev(2, Kind.LOSS_NONFINITE, Level.CRITICAL, "Loss is nan at step 2; rewind.", values={"value": float("nan")}))
    sink.alert(ev(2, Kind.REWIND, Level.CRITICAL, "loss_nonfinite: rewound to clean state of step 0 (memory:0)",
                  signal="loss_nonfinite", values={"restored_step": 0.0}))
    sink.alert(ev(2, Kind.QUARANTINE, Level.WARNING, "quarantined epoch 0 batches 1-2 -> /q.jsonl"))
    sink.log_metrics(2, {})
    assert lines_of(out) == [
        "[earlywarn CRITICAL] step 2: loss nan. Done: rewound to clean state of step 0 (memory:0); quarantine list: /q.jsonl"
    ]


def test_the_default_console_prints_warnings_and_worse_only():
    # info incidents (an isolated spike that recovered, the loss scaler's own overflow step) go
    # to the event log and the trackers; on the console they would be noise in a healthy run
    out = io.StringIO()
    sink = ConsoleSink(stream=out)
    sink.alert(ev(1, Kind.GRAD_SPIKE, Level.INFO, "spike"))
    sink.log_metrics(1, {})
    sink.alert(ev(2, Kind.GRAD_SPIKE, Level.WARNING, "spike again"))
    sink.finish()
    assert lines_of(out) == ["[earlywarn WARNING] step 2: spike again"]


def test_tracker_status_is_printed_at_once_without_a_step():
    sink, out = sink_and_stream()
    sink.alert(ev(5, Kind.GRAD_SPIKE, Level.INFO, "spike"))
    sink.alert(ev(-1, Kind.SINK, Level.WARNING, "sink 'mlflow' is down; buffering", signal="mlflow"))
    assert lines_of(out) == ["[earlywarn INFO] step 5: spike", "[earlywarn WARNING] sink 'mlflow' is down; buffering"]


def test_a_repair_and_its_skip_are_one_line():
    sink, out = sink_and_stream()
    sink.alert(ev(8, Kind.NONFINITE_GRAD, Level.CRITICAL, "Non-finite gradient at step 8.", layers=("fc",)))
    sink.alert(ev(8, Kind.REPAIR, Level.WARNING, "repaired fc.weight[exp_avg]: 3 -> 0"))
    sink.alert(ev(8, Kind.SKIP, Level.CRITICAL, "non-finite gradient in 'fc' from batch #8: optimizer step skipped"))
    sink.flush()
    assert lines_of(out) == ["[earlywarn CRITICAL] step 8: repaired fc.weight[exp_avg]: 3 -> 0; "
                             "non-finite gradient in 'fc' from batch #8: optimizer step skipped"]


def test_write_is_the_one_place_lines_leave(capsys):
    got: list[str] = []

    class Collect(ConsoleSink):
        def write(self, line: str) -> None:
            got.append(line)

    sink = Collect(min_level="info")
    sink.alert(ev(1, Kind.GRAD_SPIKE, Level.INFO, "spike"))
    sink.finish()
    assert got == ["[earlywarn INFO] step 1: spike"] and capsys.readouterr().err == ""
