"""The benchmarks' command lines: what a user who asks for a measurement they cannot have is told."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
