"""The benchmarks' command lines: what a user who asks for a measurement they cannot have is told."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

OVERHEAD = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def test_overhead_against_refuses_a_clipping_loop_and_says_why():
    # both packages would wrap torch's clip functions: the pair could not be compared
    proc = subprocess.run([sys.executable, str(OVERHEAD), "--against", "HEAD", "--shapes", "gpt,gpt+clip"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--against cannot measure a clipping loop: both packages wrap torch's clip functions" in proc.stderr
    assert "compare +clip shapes with the table" in proc.stderr


def test_overhead_least_prints_the_least_guard_at_each_cadence():
    proc = subprocess.run([sys.executable, str(OVERHEAD), "--least", "cnn", "--rounds", "1", "--block", "2",
                           "--warm", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and " us | " in line]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        "the defaults' cadences (a copy every 25 steps, a state check every 10)", "no state check (a copy every 25)",
        "a copy every 100, no state check", "the norms, their read and the decision only"]
    assert "the goal <= 1.03x" in proc.stdout


NATURAL = Path(__file__).resolve().parents[1] / "benchmarks" / "natural.py"


@pytest.mark.slow
def test_natural_quick_prints_every_table_and_computes_its_numbers(tmp_path):
    png, out = tmp_path / "natural.png", tmp_path / "natural.json"
    proc = subprocess.run([sys.executable, str(NATURAL), "--quick", "--jobs", "2", "--signals", "--cache", str(tmp_path / "cache"),
                           "--png", str(png), "--json", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=str(NATURAL.parents[1]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    methods = ("bare", "earlywarn", "zclip", "spam", "stable_spam", "adagc", "olmo_skipstep", "qk_layernorm", "z_loss")
    for model in ("chargpt", "vit"):
        assert f"== {model}: E0 " in text
        table = text.split(f"{model}: median E")[1].split("\n\n")[0].splitlines()[2:]
        assert [row.split()[0] for row in table] == list(methods)
        for row in table:  # three rates and the LR sensitivity, all numbers
            assert len([float(x) for x in row.split()[1:]]) == 4
        bare = [float(x) for x in table[0].split()[1:4]]
        assert len(set(bare)) == 3, bare  # the rates differ: the numbers are computed, not constant
    checks = text.split("The issue's checks")[1].split("\n\n")[0]
    assert sum(line.lstrip().startswith(("[met]", "[NOT MET]")) for line in checks.splitlines()) == 4
    assert "attention logit max" in text and "update/weight (per layer)" in text  # the signal study
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert len(data["results"]) == len(data["configs"]) * len(methods)
    for res in data["results"]:
        assert res["error"] is None, res["error"]
        sig = res["signals"]
        assert len(sig["loss"]) == len(sig["grad_norm"]) == res["steps_run"] == 40
        assert any(k.startswith("attn_max/") for k in sig) and any(k.startswith("update/") for k in sig)
    ew = [r for r in data["results"] if r["method"] == "earlywarn"]
    assert all(set(e) >= {"step", "kind", "level", "signal", "layers"} for r in ew for e in r["events"])


def test_the_jitter_control_is_bare_but_for_the_one_step_it_scales():
    """``benchmarks/rescue_jitter.py``: the control behind "a run earlywarn leaves worse was harmed"
    (docs/benchmarks.md) -- bare at eps 0, and a touch at step ``at`` that moves the result."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import rescue_harness
    import rescue_jitter
    from rescue_families import all_configs

    config = all_configs(0, ["heavy_reward"], n=1)[0]
    config["steps"] = 60
    bare = rescue_harness.run_one(config, "bare")
    rescue_jitter._register(at=5, eps=0.0)
    assert rescue_harness.run_one(config, "jitter")["E"] == bare["E"]
    rescue_jitter._register(at=5, eps=10.0)
    assert rescue_harness.run_one(config, "jitter")["E"] != bare["E"]
