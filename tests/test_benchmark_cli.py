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
