"""Readers of `earlywarn analyze`: every file format round-trips into the same observations."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from earlywarn.analyze import AnalyzeError, analyze
from earlywarn.analyze.hygiene import clean
from earlywarn.analyze.readers import read_source
from earlywarn.events import Kind, Level


def one(path, key_map=None):
    runs = read_source(str(path), key_map)
    assert len(runs) == 1
    return clean(runs[0], key_map)


def calm_then_escalation(n=120, start=80):
    """A run that is calm, then its grad norm grows x3 per step for 5 steps, then the loss jumps."""
    rng = np.random.default_rng(0)
    g = 0.2 * np.exp(rng.normal(0, 0.05, n))
    loss = 2.5 + rng.normal(0, 0.01, n)
    for k in range(5):
        g[start + k] = 0.2 * 3.0 ** (k + 1)
    loss[start + 5:] = 6.0
    return np.arange(n), loss, g


# ---------------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------------


def test_csv_default_keys_layers_and_nonfinite_tokens(tmp_path):
    p = tmp_path / "run.csv"
    p.write_text(
        "step,loss,grad_norm,grad_norm/blocks.0,grad_norm/blocks.1\n"
        "0,2.5,0.2,0.1,0.1\n"
        "1,NaN,inf,0.1,Infinity\n"
        "2,nan,-inf,0.1,0.1\n"
    )
    run = one(p)
    assert run.step.tolist() == [0, 1, 2]
    assert run.layer_names == ("blocks.0", "blocks.1")
    assert run.loss_known.all() and math.isnan(run.loss[1]) and math.isnan(run.loss[2])
    assert run.grad_norm[1] == math.inf and run.grad_norm[2] == -math.inf
    assert run.layers[1, 1] == math.inf


_CSV_BODIES = {
    "tokens": "step,loss,g\n1,NaN,inf\n2,nan,Infinity\n3,-inf,-Infinity\n4,1e-310,0.1\n5,+inf,+1.5\n6,INF,NAN\n",
    "big_ints": "step,loss\n1,2\n9007199254740993,3\n",
    "quoted": 'step,loss\n1,"2.5"\n2,3\n',
    "spaces": "step,loss\n1, 2\n2, 3.5\n",
    "crlf_bom": "\ufeffstep,loss\r\n1,2.5\r\n2,3\r\n",
    "exponents": "step,loss\n1,1e5\n2,-2.5E-3\n3,0.1\n",
    "tsv": "step\tloss\n1\t2.5\n2\tnan\n",
    "blanks": "step,loss,grad_norm\n1,2.5,\n2,,0.3\n3,2.4,0.31\n,,\n4,2.3,null\n5,None,NA\n6,2.2,n/a\n",
    "blank_column": "step,loss,grad_norm\n1,2.5,\n2,2.4,\n",
    "blank_step": "step,loss\n1,2.5\n,2.4\n3,2.3\n",
    "text": "step,loss\n1,abc\n2,3\n3,4\n",
    "text_column": "step,loss,note\n1,2,warmup\n2,3,ok\n",
    "ragged": "step,loss\n1,2,3\n2,3\n",
    "cut_mid_write": "step,loss\n1,2\n2,3\n3\n",
    "text_after_the_first_block": "step,loss\n" + "".join(f"{i},{i * 0.37:.7g}\n" for i in range(150_000)) + "9,abc\n",
}


@pytest.mark.parametrize("name", sorted(_CSV_BODIES))
def test_csv_fast_readers_agree_with_the_careful_reader(tmp_path, monkeypatch, name):
    # pyarrow (when installed) and numpy read what they accept exactly as the careful reader
    # would (numbers, missing cells, dropped rows, notes), and leave the rest to it
    pytest.importorskip("pyarrow")
    from earlywarn.analyze import csv_reader as readers

    path = tmp_path / (name + (".tsv" if name == "tsv" else ".csv"))
    path.write_text(_CSV_BODIES[name], encoding="utf-8", newline="")
    fast = readers.numeric_csv_columns

    def read(how):
        if how == "careful":
            monkeypatch.setattr(readers, "numeric_csv_columns", lambda *a, **k: None)
        else:
            monkeypatch.setattr(readers, "numeric_csv_columns", lambda p, d: fast(p, d, arrow=how == "pyarrow"))
        try:
            return read_source(str(path))
        except AnalyzeError as e:
            return str(e)

    runs = {how: read(how) for how in ("careful", "numpy", "pyarrow")}
    if isinstance(runs["careful"], str):  # a bad file: the same one-line error whoever reads it
        assert runs["numpy"] == runs["pyarrow"] == runs["careful"]
        return
    for how in ("numpy", "pyarrow"):
        for a, b in zip(runs[how], runs["careful"], strict=True):
            np.testing.assert_array_equal(a.step, b.step)
            assert a.columns.keys() == b.columns.keys() and a.notes == b.notes
            for k in a.columns:
                np.testing.assert_array_equal(a.columns[k], b.columns[k])
                np.testing.assert_array_equal(a.missing[k], b.missing[k])
    delim = "\t" if name == "tsv" else ","
    took = {how: fast(str(path), delim, arrow=how == "pyarrow") is not None for how in ("numpy", "pyarrow")}
    numbers_only = name not in {"blanks", "blank_column", "blank_step", "text", "text_column", "ragged",
                                "cut_mid_write", "text_after_the_first_block"}
    assert took == {"numpy": numbers_only, "pyarrow": numbers_only or name.startswith("blank")}


def test_csv_key_map_and_aliases(tmp_path):
    p = tmp_path / "run.csv"
    p.write_text("iteration,train/loss,gnorm,lossy\n10,2.0,0.3,9\n20,2.1,0.31,9\n")
    # aliases find step=iteration and loss=train/loss; "gnorm" is nobody's alias
    run = one(p)
    assert run.keys == {"loss": "train/loss"} and not run.grad_known.any()
    run = one(p, {"grad_norm": "gnorm", "loss": "lossy"})
    assert run.keys["grad_norm"] == "gnorm" and run.keys["loss"] == "lossy"
    assert run.grad_norm.tolist() == [0.3, 0.31] and run.step.tolist() == [10, 20]
    with pytest.raises(AnalyzeError, match=r"column 'nope' \(key map grad_norm=nope\) not found"):
        one(p, {"grad_norm": "nope"})
    with pytest.raises(AnalyzeError, match="unknown key-map name 'gradnorm'"):
        one(p, {"gradnorm": "gnorm"})
    only_other = tmp_path / "o.csv"
    only_other.write_text("step,accuracy\n0,0.5\n")
    with pytest.raises(AnalyzeError, match="no loss or grad-norm column"):
        one(only_other)


def test_csv_blank_cells_dense_vs_sparse_columns(tmp_path):
    # loss is logged every step: the one blank (grad norm present) is a NaN the logger could not
    # write; val_loss is sparse: its blanks mean "not logged"
    lines = ["step,loss,grad_norm,val_loss"]
    for s in range(30):
        loss = "" if s == 17 else f"{2.5 - 0.001 * s:.4f}"
        val = "2.4" if s % 10 == 0 else ""
        lines.append(f"{s},{loss},0.2{s % 7},{val}")
    p = tmp_path / "run.csv"
    p.write_text("\n".join(lines) + "\n")
    run = one(p)
    assert run.loss_known[17] and math.isnan(run.loss[17])
    assert run.counts["blank_as_nonfinite"] == 1
    report = analyze([str(p)])
    crit = [a for a in report.runs[0].alerts if a.level == Level.CRITICAL]
    assert [(a.step, a.kind) for a in crit] == [(17, Kind.LOSS_NONFINITE)]


def test_csv_missing_step_column_is_a_clear_error(tmp_path):
    p = tmp_path / "run.csv"
    p.write_text("epoch,loss\n0,2.0\n")
    with pytest.raises(AnalyzeError, match=r"no step column .*--key step="):
        read_source(str(p))


def test_csv_errors(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(AnalyzeError, match="empty file"):
        read_source(str(empty))
    header_only = tmp_path / "h.csv"
    header_only.write_text("step,loss\n")
    with pytest.raises(AnalyzeError, match="empty run"):
        read_source(str(header_only))
    ragged = tmp_path / "r.csv"
    ragged.write_text("step,loss\n0,1\n1,2,3\n2,3\n")
    with pytest.raises(AnalyzeError, match="line 3 has 3 cells"):
        read_source(str(ragged))
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(AnalyzeError, match="not a text file"):
        read_source(str(binary))


def test_csv_cut_mid_write_keeps_complete_rows(tmp_path):
    p = tmp_path / "run.csv"
    p.write_text("step,loss,grad_norm\n0,2.0,0.2\n1,2.0,0.2\n2,2.")
    runs = read_source(str(p))
    assert runs[0].step.tolist() == [0, 1]
    assert any("cut mid-write" in n for n in runs[0].notes)


def test_csv_run_column_splits_runs(tmp_path):
    p = tmp_path / "many.csv"
    p.write_text("run,step,loss\na,0,2.0\na,1,2.1\nb,0,3.0\nb,1,3.1\nb,2,3.2\n")
    runs = read_source(str(p))
    assert [(r.name, len(r)) for r in runs] == [("a", 2), ("b", 3)]


# ---------------------------------------------------------------------------------------------
# JSONL / earlywarn JSONL
# ---------------------------------------------------------------------------------------------


def test_jsonl_null_missing_key_and_bare_nan(tmp_path):
    step, loss, g = calm_then_escalation(40, 30)
    lines = []
    for s in range(40):
        row = {"step": int(s), "loss": float(loss[s]), "grad_norm": float(g[s])}
        if s == 12:
            row["loss"] = None  # JSON has no NaN: a serializer wrote null
        if s == 13:
            del row["grad_norm"]  # a logger that drops non-finite values
        lines.append(json.dumps(row))
    lines.append('{"step": 40, "loss": nan, "grad_norm": inf}')  # not JSON, but loggers write it
    lines.append('{"step": 41, "loss": 2.5, "grad_n')  # cut mid-write
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(lines))
    run = one(p)
    assert run.step[-1] == 40
    assert run.loss_known[12] and math.isnan(run.loss[12])
    assert run.grad_known[13] and math.isnan(run.grad_norm[13])
    assert math.isnan(run.loss[40]) and run.grad_norm[40] == math.inf
    assert any("cut mid-write" in n for n in run.notes)


def test_jsonl_bad_line_is_an_error_with_line_number(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0, "loss": 1}\nnot json at all\n{"step": 2, "loss": 1}\n')
    with pytest.raises(AnalyzeError, match=r"m\.jsonl:2: not valid JSON"):
        read_source(str(p))


def test_earlywarn_jsonl_log_round_trip(tmp_path):
    """Our own JsonlSink(metrics=True) output: metrics rows, events, checkpoints."""
    from earlywarn.events import Event
    from earlywarn.sinks.jsonl import JsonlSink

    sink = JsonlSink(tmp_path / "ew.jsonl", metrics=True)
    step, loss, g = calm_then_escalation(100, 60)
    for s in range(100):
        metrics = {"earlywarn/grad_norm": float(g[s]), "earlywarn/loss": float(loss[s]),
                   "earlywarn/skipped_steps": 1.0 if s >= 50 else 0.0}
        for j in range(3):
            metrics[f"earlywarn/layer_grad_norm/blocks.{j}"] = float(g[s]) / 3
        sink.log_metrics(s, metrics)
        if s == 40:
            sink.checkpoint(40, "/ckpt/40", "periodic")
    sink.alert(Event(step=62, kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message="logged live"))
    sink.finish()
    runs = read_source(str(tmp_path / "ew.jsonl"))
    assert runs[0].format == "earlywarn-jsonl"
    assert runs[0].checkpoints == [40]
    assert [e.step for e in runs[0].events] == [62]
    run = clean(runs[0])
    assert run.layer_names == ("blocks.0", "blocks.1", "blocks.2")
    assert run.skipped.tolist().index(True) == 50 and run.skipped.sum() == 1  # counter rose once
    report = analyze([str(tmp_path / "ew.jsonl")])
    r = report.runs[0]
    assert r.first_warning is not None and 60 <= r.first_warning.step <= 65
    assert r.to_dict()["logged_events"][0]["message"] == "logged live"


def test_earlywarn_jsonl_without_metrics_is_a_clear_error(tmp_path):
    from earlywarn.events import Event
    from earlywarn.sinks.jsonl import JsonlSink

    sink = JsonlSink(tmp_path / "ew.jsonl")
    sink.alert(Event(step=3, kind=Kind.SKIP, level=Level.INFO, message="x"))
    sink.finish()
    with pytest.raises(AnalyzeError, match="metrics=True"):
        read_source(str(tmp_path / "ew.jsonl"))


# ---------------------------------------------------------------------------------------------
# Hugging Face trainer_state.json
# ---------------------------------------------------------------------------------------------


def test_hf_trainer_state(tmp_path):
    step, loss, g = calm_then_escalation(60, 40)
    history = []
    for s in range(1, 60):
        history.append({"epoch": s / 60, "grad_norm": float(g[s]), "learning_rate": 1e-4, "loss": float(loss[s]), "step": s})
        if s % 20 == 0:
            history.append({"epoch": s / 60, "eval_loss": 2.4, "eval_runtime": 1.0, "step": s})
    history.append({"epoch": 1.0, "step": 59, "total_flos": 1.0, "train_loss": 3.0, "train_runtime": 10.0})
    history[5]["grad_norm"] = float("nan")  # HF's json.dump writes NaN
    ckpt = tmp_path / "out" / "checkpoint-59"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 59, "log_history": history}, indent=2))
    (tmp_path / "out" / "checkpoint-20").mkdir()
    (tmp_path / "out" / "checkpoint-20" / "trainer_state.json").write_text(json.dumps({"log_history": history[:20]}))
    # the output dir resolves to the newest checkpoint's state
    runs = read_source(str(tmp_path / "out"))
    assert runs[0].format == "hf" and len(runs[0]) == 59  # eval rows merged into their step
    run = clean(runs[0])
    assert run.keys["loss"] == "loss" and run.keys["lr"] == "learning_rate"
    assert run.grad_known[5] and math.isnan(run.grad_norm[5])
    report = analyze([str(ckpt / "trainer_state.json")])
    kinds = {(a.step, a.kind) for a in report.runs[0].alerts}
    assert (6, Kind.NONFINITE_GRAD) in kinds
    assert report.runs[0].incidents and report.runs[0].incidents[0].collapse_step == 45


# ---------------------------------------------------------------------------------------------
# Megatron and llm.c text logs
# ---------------------------------------------------------------------------------------------

MEGATRON_LINE = (
    " iteration {it:>8}/  100000 | consumed samples:      {cs:>8} | elapsed time per iteration (ms): 1234.5 | "
    "learning rate: 6.000E-05 | global batch size:  2048 | {loss}loss scale: {ls:.1f} | grad norm: {gn} | "
    "num zeros: 0.0 | number of skipped iterations: {sk:>3} | number of nan iterations: {nan:>3} |"
)


def megatron_line(it, loss, gn, ls=65536.0, sk=0, nan=0):
    lt = f"lm loss: {loss:.6E} | " if loss is not None else ""
    return MEGATRON_LINE.format(it=it, cs=it * 2048, loss=lt, ls=ls, gn=gn, sk=sk, nan=nan)


def test_megatron_log_with_noise_stale_skips_and_resume(tmp_path):
    lines = ["using world size: 8", "> building GPT model ...", "[after model, optimizer] datetime: 2022-01-01"]
    for it in range(1, 41):
        lines.append(f"[default0]:{megatron_line(it, 2.5, f'{0.2 + 0.001 * (it % 5):.3f}')}")
    # fp16 overflow: the scale halves and the grad norm repeats exactly, loss not printed
    lines.append(megatron_line(41, None, "0.204", ls=32768.0, sk=1))
    lines.append(megatron_line(42, 2.5, "0.201", ls=32768.0))
    lines.append("saving checkpoint at iteration      42 to checkpoints")
    lines.append(megatron_line(43, 2.5, "0.202", ls=32768.0, nan=1))
    # the job restarted from iteration 30
    lines.append("> loading checkpoint from checkpoints at iteration 30")
    for it in range(31, 50):
        lines.append(megatron_line(it, 2.5, f"{0.2 + 0.001 * (it % 5):.3f}", ls=32768.0))
    p = tmp_path / "train.log"
    p.write_text("\n".join(lines) + "\n")
    runs = read_source(str(p))
    assert runs[0].format == "megatron" and runs[0].name == ""
    run = clean(runs[0])
    assert run.skipped[40] and not run.loss_known[40]  # it 41: skipped, no loss
    assert not run.grad_known[42] or math.isnan(run.grad_norm[42])  # NaN iteration
    assert [(r.step, r.previous_step, r.overlap) for r in run.resumes] == [(31, 43, 13)]
    report = analyze([str(p)])
    r = report.runs[0]
    assert r.resumes[0]["step"] == 31 and r.resumes[0]["detector_restored_from_step"] is not None
    # a NaN iteration of an fp16 run: the detector sees a non-finite gradient under a loss scaler
    assert any(a.step == 43 and a.kind in (Kind.NONFINITE_GRAD, Kind.SCALER_OVERFLOW) for a in r.alerts)


def test_megatron_grep_prefixed_lines_split_into_runs(tmp_path):
    p = tmp_path / "grepped.txt"
    p.write_text(
        "logs/a.log:12: " + megatron_line(1, 2.5, "0.2") + "\n"
        + "logs/a.log:13: " + megatron_line(2, 2.5, "0.2") + "\n"
        + "logs/b.log:7: [default3]: " + megatron_line(5, 3.5, "0.3") + "\n"
    )
    runs = read_source(str(p))
    assert [(r.name, r.step.tolist()) for r in runs] == [("logs/a.log", [1, 2]), ("logs/b.log", [5])]


def test_llmc_stdout_and_main_log(tmp_path):
    step, loss, g = calm_then_escalation(60, 40)
    out = ["+-----------------------+", "| train_num_batches     | 60 |", "val loss 11.0"]
    for s in range(60):
        out.append(f"step {s + 1:4d}/60 | loss {loss[s]:7.6f} (+0.00z)| norm {g[s]:6.4f} (+0.00z)| lr 6.00e-04 | "
                   f"100.00 ms | 40.0% bf16 MFU | 100000 tok/s")
        if s == 30:
            out.append("skipping update due to grad z-score of 5.1")
    stdout = tmp_path / "stdout.txt"
    stdout.write_text("\n".join(out) + "\n")
    run = one(stdout)
    assert run.raw.format == "llmc" and run.step[0] == 1 and len(run) == 60
    assert run.skipped[31]  # the step printed after the "skipping update" line
    main_log = tmp_path / "main.log"
    lines = ["s:0 tel:11.0092"]
    for s in range(60):
        lines.append(f"s:{s} trl:{loss[s]:.4f} lr:0.000600 norm:{g[s]:.2f}")
    main_log.write_text("\n".join(lines) + "\n")
    run2 = one(main_log)
    assert run2.step.tolist() == list(range(60)) and run2.keys["grad_norm"] == "grad_norm"
    for path in (stdout, main_log):
        r = analyze([str(path)]).runs[0]
        assert r.first_warning is not None and 40 <= r.first_warning.step <= 44
        assert r.incidents and r.incidents[0].lead_steps >= 1


def test_npz_and_unknown_formats(tmp_path):
    step, loss, g = calm_then_escalation(50, 30)
    np.savez(tmp_path / "run.npz", step=step, loss=loss, grad_norm=g,
             layer_norms=np.stack([g / 2, g / 3], axis=1), layer_names=np.array(["a", "b"]))
    run = one(tmp_path / "run.npz")
    assert run.layer_names == ("a", "b") and run.layers.shape == (50, 2)
    (tmp_path / "notes.txt").write_text("hello\nworld\n")
    with pytest.raises(AnalyzeError, match="unknown format"):
        read_source(str(tmp_path / "notes.txt"))
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(AnalyzeError, match="unknown JSON layout"):
        read_source(str(tmp_path / "x.json"))
    (tmp_path / "bad.npz").write_text("not a zip")
    with pytest.raises(AnalyzeError, match="not a readable .npz"):
        read_source(str(tmp_path / "bad.npz"))
    with pytest.raises(AnalyzeError, match="no such file"):
        read_source(str(tmp_path / "missing.csv"))
    (tmp_path / "d").mkdir()
    with pytest.raises(AnalyzeError, match="unknown format"):
        read_source(str(tmp_path / "d"))
