"""The conformance matrix: every cell records its outcome; the terminal summary prints the table
(rows: codebases, columns: faults), so `pytest tests/conformance` shows what a user gets."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

from harness import FAULTS

_CELLS: dict[str, tuple[str, str]] = {}  # nodeid -> (codebase, fault)
_OUTCOME: dict[tuple[str, str], str] = {}


@pytest.fixture
def cell(request: pytest.FixtureRequest, tmp_path, monkeypatch):
    """Register the running test as the matrix cell (codebase, fault); run it in its own folder
    (earlywarn's quarantine file and checkpoints land there)."""
    monkeypatch.chdir(tmp_path)

    def register(codebase: str, fault: str) -> None:
        _CELLS[request.node.nodeid] = (codebase, fault)

    return register


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    key = _CELLS.get(report.nodeid)
    if key is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        outcome = {"passed": "pass", "failed": "FAIL", "skipped": "n/a"}[report.outcome]
        if report.outcome == "passed" and hasattr(report, "wasxfail"):
            outcome = "XPASS"
        elif report.outcome == "skipped" and hasattr(report, "wasxfail"):
            outcome = "xfail"
        _OUTCOME[key] = outcome


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _OUTCOME:
        return
    rows: dict[str, dict[str, str]] = defaultdict(dict)
    for (codebase, fault), outcome in _OUTCOME.items():
        rows[codebase][fault] = outcome
    cols = [f for f in FAULTS if any(f in r for r in rows.values())]
    width = max(len(r) for r in rows) + 2
    tr = terminalreporter
    tr.section("earlywarn conformance matrix (rows: codebases, columns: faults)")
    tr.write_line("".ljust(width) + "".join(c.ljust(14) for c in cols))
    for codebase in sorted(rows):
        tr.write_line(codebase.ljust(width) + "".join(rows[codebase].get(c, "-").ljust(14) for c in cols))
    failed = sum(v == "FAIL" for v in _OUTCOME.values())
    tr.write_line(f"{len(_OUTCOME)} cells, {failed} failed")
    path = os.environ.get("EARLYWARN_MATRIX_OUT")
    if path:
        with open(path, "w") as f:
            f.write("codebase," + ",".join(cols) + "\n")
            for codebase in sorted(rows):
                f.write(codebase + "," + ",".join(rows[codebase].get(c, "-") for c in cols) + "\n")
