"""`earlywarn analyze` / `earlywarn calibrate` on the command line: output, exit codes, one-line
errors (never a traceback), the plot, calibration, and importing without torch or tracker SDKs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from earlywarn.cli import main

REAL = Path(__file__).parent / "data" / "realruns"
LLMC = REAL / "llmc_gpt2_124m" / "main.csv"
BLOOM_TXT = REAL / "bloom_chronicles" / "megatron_iteration_lines_verbatim.txt"
ROOT = Path(__file__).resolve().parents[1]


def write_run(path: Path, n=150, start=100, seed=0, escalate=True):
    rng = np.random.default_rng(seed)
    g = 0.2 * np.exp(rng.normal(0, 0.04, n))
    loss = 2.5 + rng.normal(0, 0.01, n)
    if escalate:
        for k in range(5):
            g[start + k] = 0.2 * 3.0 ** (k + 1)
        loss[start + 5:] = 6.0
    lines = ["step,loss,grad_norm"] + [f"{s},{loss[s]:.5f},{g[s]:.5f}" for s in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_text_report(capsys, tmp_path):
    p = write_run(tmp_path / "run.csv")
    code, out, err = run_cli(capsys, "analyze", str(p))
    assert code == 0 and err == ""
    assert "INCIDENT collapse (loss jump) at step 105; first warning at step" in out
    assert "run" in out and "first warning" in out and "1 run(s)" in out


def test_analyze_json_schema(capsys, tmp_path):
    p = write_run(tmp_path / "run.csv")
    code, out, _ = run_cli(capsys, "analyze", "--json", str(p), str(BLOOM_TXT),
                           "--baseline", "grad_norm=0.2", "--baseline", "loss=2.3")
    assert code == 0
    d = json.loads(out)
    assert [r["source"] for r in d["runs"]][:2] == [str(p), str(BLOOM_TXT)]
    r0 = d["runs"][0]
    assert r0["steps"] == 150 and r0["incidents"][0]["collapse_step"] == 105
    a = r0["alerts"][0]
    assert set(a) >= {"step", "level", "signal", "layer", "message"}
    assert d["baseline"] == {"grad_norm": 0.2, "loss": 2.3}


def test_fail_on_and_run_filter(capsys, tmp_path):
    p = write_run(tmp_path / "run.csv")
    calm = write_run(tmp_path / "calm.csv", escalate=False)
    assert run_cli(capsys, "analyze", str(calm), "--fail-on", "warning")[0] == 0
    assert run_cli(capsys, "analyze", str(p), "--fail-on", "warning")[0] == 1
    code, out, _ = run_cli(capsys, "analyze", "--json", str(BLOOM_TXT), "--run", "tr8b")
    assert code == 0 and [r["run"] for r in json.loads(out)["runs"]] == ["train/tr8b-104B/chronicles.md"]


@pytest.mark.parametrize(
    "setup, argv, message",
    [
        (lambda d: (d / "a.csv").write_text("epoch,loss\n0,1\n"), ["analyze", "{d}/a.csv"], "no step column"),
        (lambda d: (d / "a.csv").write_text("step,loss\n"), ["analyze", "{d}/a.csv"], "empty run"),
        (lambda d: (d / "a.jsonl").write_text("{oops\n{\"step\": 1}\n"), ["analyze", "{d}/a.jsonl"], "not valid JSON"),
        (lambda d: (d / "a.bin").write_bytes(bytes(range(256)) * 4), ["analyze", "{d}/a.bin"], "unknown format"),
        (lambda d: None, ["analyze", "{d}/none.csv"], "no such file or directory"),
        (lambda d: (d / "a.csv").write_text(""), ["analyze", "{d}/a.csv"], "empty file"),
        (lambda d: None, ["analyze"], "the following arguments are required: SOURCE"),
        (lambda d: None, ["frobnicate"], "invalid choice"),
        (lambda d: None, [], "choose a command"),
        (lambda d: write_run(d / "r.csv"), ["analyze", "{d}/r.csv", "--key", "loss"], "use NAME=VALUE"),
        (lambda d: write_run(d / "r.csv"), ["analyze", "{d}/r.csv", "--key", "los=x"], "unknown key-map name"),
        (lambda d: write_run(d / "r.csv"), ["analyze", "{d}/r.csv", "--baseline", "grad_norm=-1"], "positive"),
        (lambda d: write_run(d / "r.csv"), ["analyze", "{d}/r.csv", "--baseline", "speed=1"], "baseline 'speed'"),
        (lambda d: (d / "c.json").write_text('{"spike_z": -1}'), ["analyze", str(LLMC), "--config", "{d}/c.json"],
         "bad detector config"),
        (lambda d: (d / "c.json").write_text("{nope"), ["analyze", str(LLMC), "--config", "{d}/c.json"],
         "not a JSON detector config"),
        (lambda d: None, ["analyze", str(LLMC), "--config", "{d}/missing.json"], "no such config file"),
        (lambda d: write_run(d / "r.csv"), ["analyze", "{d}/r.csv", "--plot", "{d}/no/such/dir/x.png"], "does not exist"),
        (lambda d: None, ["analyze", str(LLMC), "--run", "nothing-matches"], "no run matches"),
        (lambda d: None, ["calibrate", str(BLOOM_TXT), "--run-nothing"], "unrecognized arguments"),
        (lambda d: None, ["calibrate", str(LLMC), "--target-rate", "-1"], "target rate"),
        (lambda d: (d / "events.out.tfevents.1.host").write_bytes(b"garbage" * 9), ["analyze", "{d}/events.out.tfevents.1.host"],
         "unparsable TensorBoard event file|needs the 'tensorboard' package"),
        (lambda d: (d / "run-x.wandb").write_bytes(b"garbage"), ["analyze", "{d}/run-x.wandb"],
         "unparsable W&B run file|needs the 'wandb' package"),
        (lambda d: (d / "trainer_state.json").write_text('{"log_history": []}'), ["analyze", "{d}"], "empty run"),
    ],
)
def test_bad_inputs_give_one_line_and_exit_2(capsys, tmp_path, setup, argv, message):
    setup(tmp_path)
    code, out, err = run_cli(capsys, *[a.format(d=tmp_path) for a in argv])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("earlywarn: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err and out == ""


def test_console_script_never_prints_a_traceback(tmp_path):
    """Through a real process (the installed entry point's module), including an unreadable file."""
    bad = tmp_path / "bad.csv"
    bad.write_text("step,loss\n0,1\n1,2,3\n2,3\n")
    proc = subprocess.run([sys.executable, "-m", "earlywarn.cli", "analyze", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "line 3 has 3 cells" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plot_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "plot.png"
    # a run with gaps and resumes (drawn against log rows)
    code, _, err = run_cli(capsys, "analyze", str(BLOOM_TXT), "--run", "tr8-104B-wide", "--plot", str(out_png),
                           "--baseline", "grad_norm=0.2")
    assert code == 0 and "plot written" in err
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_plot_without_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    p = write_run(tmp_path / "run.csv")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = run_cli(capsys, "analyze", str(p), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and err.strip() == (
        "earlywarn: error: --plot needs matplotlib, which is not installed (pip install matplotlib)")
    assert not (tmp_path / "x.png").exists()


def test_calibrate_writes_a_config_that_analyze_loads(capsys, tmp_path):
    healthy = [write_run(tmp_path / f"h{i}.csv", n=400, seed=i, escalate=False) for i in range(3)]
    # one healthy run with isolated single-step spikes (2.5x) that recover: not a collapse
    spiky = tmp_path / "spiky.csv"
    rng = np.random.default_rng(7)
    g = 0.2 * np.exp(rng.normal(0, 0.04, 400))
    g[[100, 220, 330]] *= 2.5
    spiky.write_text("step,loss,grad_norm\n" + "\n".join(f"{s},2.5,{g[s]:.5f}" for s in range(400)) + "\n")
    cfg_path = tmp_path / "detector.json"
    code, out, err = run_cli(capsys, "calibrate", *map(str, healthy), str(spiky), "--out", str(cfg_path), "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["met"] and res["false_alarms"] == 0 and res["steps"] == 1600
    assert res["tried"] and cfg_path.exists()
    from earlywarn.detect import DetectorConfig

    cfg = DetectorConfig.from_file(cfg_path)
    assert cfg.to_dict() == res["config"]
    # the calibrated config still catches a real escalation
    bad = write_run(tmp_path / "bad.csv")
    code, out, _ = run_cli(capsys, "analyze", "--json", str(bad), "--config", str(cfg_path))
    d = json.loads(out)
    assert code == 0 and d["detector"] == cfg.to_dict()
    assert d["runs"][0]["incidents"][0]["first_warning_step"] is not None


def test_calibrate_on_an_unhealthy_run_is_a_clear_error(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("step,loss,grad_norm\n" + "\n".join(f"{s},{'nan' if s == 50 else 2.5},0.2" for s in range(100)))
    code, out, err = run_cli(capsys, "calibrate", str(bad), "--out", str(tmp_path / "c.json"))
    assert code == 2 and "are these runs healthy" in err and not (tmp_path / "c.json").exists()


def test_analyze_and_cli_import_without_torch_or_tracker_sdks(tmp_path):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'wandb', 'mlflow', 'tensorboard', 'matplotlib', 'rich'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import earlywarn.analyze, earlywarn.cli\n"
        "from earlywarn.cli import main\n"
        f"rc = main(['analyze', '--json', {str(LLMC)!r}])\n"
        "assert rc == 0, rc\n"
        f"rc = main(['analyze', 'mlflow:sqlite:///{tmp_path}/x.db#abc'])\n"
        "assert rc == 2, rc\n"
        "assert not any(m.split('.')[0] in ('torch', 'wandb', 'mlflow') for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs the 'mlflow' package" in proc.stderr


# ------------------------------------------------------------------ bad input: said plainly, never invented
def _rows(n=200, bad_row=120, cell=None, step=None):
    out = []
    for i in range(n):
        loss = cell if (cell is not None and i == bad_row) else f"{2.0 - i * 0.001:.4f}"
        s = step if (step is not None and i == bad_row) else str(i)
        out.append(f"{s},{loss},0.5")
    return "step,loss,grad_norm\n" + "\n".join(out) + "\n"


FIX = "write the number (nan and inf are fine) or leave the cell empty if nothing was logged"
JSON_FIX = "write the number (NaN and Infinity are fine) or null if nothing was logged"


@pytest.mark.parametrize(
    "name, body, message",
    [
        ("oops.csv", _rows(cell="oops"), "line 122, column 'loss': cannot read 'oops' as a number; " + FIX),
        ("quoted.csv", _rows(cell='"abc"'), "line 122, column 'loss': cannot read 'abc' as a number; " + FIX),
        ("list.csv", _rows(cell='"[1,2]"'), "line 122, column 'loss': cannot read '[1,2]' as a number; " + FIX),
        ("big_step.csv", _rows(bad_row=150, step="1e30"),
         "line 152, column 'step': '1e30' is beyond the largest step number (9223372036854775807); "
         "fix that row or name the step column with --key step=<column>"),
        ("text.jsonl", "".join(json.dumps({"step": i, "loss": "abc" if i == 120 else 2.0, "grad_norm": 0.5}) + "\n"
                               for i in range(200)),
         "line 121, key 'loss': cannot read \"abc\" as a number; " + JSON_FIX),
        ("list.jsonl", "".join(json.dumps({"step": i, "loss": [1, 2] if i == 120 else 2.0}) + "\n" for i in range(200)),
         "line 121, key 'loss': cannot read [1, 2] as a number; " + JSON_FIX),
        ("big_step.jsonl", "".join(json.dumps({"step": 2**70 if i == 150 else i, "loss": 2.0}) + "\n" for i in range(200)),
         "line 151, key 'step': 1180591620717411303424 is beyond the largest step number (9223372036854775807); "
         "fix that row or name the step column with --key step=<key>"),
    ],
)
def test_a_bad_cell_is_named_with_its_row_and_the_fix_not_read_as_nan(capsys, tmp_path, name, body, message):
    p = tmp_path / name
    p.write_text(body)
    code, out, err = run_cli(capsys, "analyze", str(p))
    assert (code, out, err) == (2, "", f"earlywarn: error: {p}: {message}\n")


def test_a_text_cell_is_not_a_collapse_but_a_text_column_is_still_ignored(capsys, tmp_path):
    # the cell that once became a critical "collapse (non-finite loss)" at step 120
    p = tmp_path / "oops.csv"
    p.write_text(_rows(cell="oops"))
    code, out, err = run_cli(capsys, "analyze", "--json", str(p))
    assert code == 2 and "collapse" not in err and out == ""
    notes = tmp_path / "notes.csv"  # mostly text: a label column, not a metric
    notes.write_text("step,loss,note\n" + "".join(f"{i},2.0,{'7' if i == 3 else 'warmup'}\n" for i in range(50)))
    code, out, _ = run_cli(capsys, "analyze", "--json", str(notes))
    assert code == 0 and json.loads(out)["runs"][0]["alerts"] == []


def test_an_object_npz_is_refused_without_unpickling(capsys, tmp_path):
    p = tmp_path / "run.npz"
    np.savez(p, step=np.arange(200), loss=np.array([1.0] * 199 + ["x"], dtype=object))
    code, out, err = run_cli(capsys, "analyze", str(p))
    assert (code, out) == (2, "")
    assert err == (f"earlywarn: error: {p}: array 'loss' holds Python objects (dtype=object), which earlywarn does not "
                   "unpickle (loading a pickle can run code); save it as numbers, e.g. "
                   "np.savez(..., loss=np.asarray(values, dtype=np.float64))\n")
    q = tmp_path / "steps.npz"
    np.savez(q, step=np.array([0.0, 1.0, 1e30]), loss=np.ones(3))
    code, out, err = run_cli(capsys, "analyze", str(q))
    assert (code, err) == (2, f"earlywarn: error: {q}: step[2] = 1e+30 is beyond the largest step number "
                              "(9223372036854775807); save the steps as int64\n")


def test_an_unreachable_mlflow_server_is_named_within_seconds_without_credentials():
    import time

    from fixtures_trackers import free_port

    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "earlywarn.cli", "analyze", f"mlflow:http://bob:s3cret@127.0.0.1:{port}#0123abcd"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    took = time.monotonic() - t0
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"earlywarn: error: mlflow:http://127.0.0.1:{port}: cannot reach the MLflow tracking server "
                           f"at 127.0.0.1:{port} (connection refused); start the server or fix the address\n")
    assert took < 30, took


def test_a_missing_run_on_a_live_server_is_still_no_such_run(capsys, mlflow_server):
    code, out, err = run_cli(capsys, "analyze", f"mlflow:{mlflow_server.uri}#{'0' * 32}")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"earlywarn: error: mlflow:{mlflow_server.uri}#{'0' * 32}: no such MLflow run ("), err


def _legend(tmp_path, body: str, name="run.csv") -> list[str]:
    pytest.importorskip("matplotlib")
    from earlywarn.analyze import analyze, plot

    p = tmp_path / name
    p.write_text(body)
    return plot(analyze([str(p)]), str(tmp_path / "plot.png"))[0]


def test_plot_legend_lists_only_what_is_drawn(tmp_path):
    calm = "step,loss,grad_norm\n" + "".join(f"{s},2.5,{0.2 + 0.001 * (s % 3):.4f}\n" for s in range(300))
    assert _legend(tmp_path, calm) == ["grad norm", "loss"]
    # one isolated spike that recovers: an info alert, and it has an entry
    rng = np.random.default_rng(0)
    g = 0.2 * np.exp(rng.normal(0, 0.04, 300))
    g[150] *= 8
    spike = "step,loss,grad_norm\n" + "".join(f"{s},2.5,{g[s]:.5f}\n" for s in range(300))
    assert _legend(tmp_path, spike) == ["grad norm", "loss", "info alert"]
    # a collapse with a warning ahead of it (the diverged loss is a warning too: a rewind, live, is
    # the guard's critical event)
    assert _legend(tmp_path, write_run(tmp_path / "x.csv").read_text()) == [
        "grad norm", "loss", "warning", "collapse", "first warning to collapse"]


def test_help_texts_match_the_api(tmp_path):
    """Every watch(...) keyword, --key name and --baseline name in the help is one the code takes."""
    import dataclasses
    import io
    from contextlib import redirect_stdout

    from earlywarn.analyze import BASELINE_KEYS
    from earlywarn.analyze.hygiene import KEY_MAP_NAMES
    from earlywarn.guard import WatchConfig

    texts = []
    for argv in ([], ["analyze"], ["calibrate"]):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main([*argv, "--help"]) == 0
        texts.append(" ".join(buf.getvalue().split()))
    helptext = " ".join(texts)
    fields = {f.name for f in dataclasses.fields(WatchConfig)}
    calls = re.findall(r"watch\(([^)]*)\)", helptext)
    assert calls, "the help says how to use a calibrated config"
    for call in calls:
        for kw in re.findall(r"(\w+)=", call):
            assert kw in fields, f"help says watch({call}) but WatchConfig has no {kw!r}"
    assert "detector=FILE" in helptext
    assert "config=" not in " ".join(calls)
    assert f"(NAME: {', '.join(KEY_MAP_NAMES)})" in helptext
    assert f"(NAME: {', '.join(BASELINE_KEYS)} or grad_norm/<layer>)" in helptext
    # and what it promises works: calibrate writes FILE, watch(..., detector=FILE) takes it
    healthy = write_run(tmp_path / "h.csv", n=400, escalate=False)
    cfg = tmp_path / "detector.json"
    with redirect_stdout(io.StringIO()):
        assert main(["calibrate", str(healthy), "--out", str(cfg)]) == 0
    import torch

    import earlywarn

    model = torch.nn.Linear(2, 1)
    ew = earlywarn.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), detector=str(cfg), sinks=[])
    ew.close()
