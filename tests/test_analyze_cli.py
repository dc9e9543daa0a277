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
