"""The main demo end to end, as `bash scripts/demo.sh` runs it (piped, as CI and `| tee` see it):
one line per incident, no MLflow chatter, no terminal control codes, everything under one folder,
and it ends by saying how to look at what it logged -- a command that opens its data, the paths,
and a PNG of the run."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a valid PNG (signature, IHDR chunk and its CRC checked)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:29]
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(kind + body)
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    return struct.unpack(">II", body[:8])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EARLYWARN_"))}
    proc = subprocess.run([sys.executable, str(DEMO)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=800)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    folder = tmp_path / "earlywarn_demo"

    # plain lines when not on a terminal, and nothing from MLflow's loggers
    assert "\r" not in out and "\x1b" not in out and "\r" not in err and "\x1b" not in err
    assert "mlflow" not in err.lower() and "Creating initial MLflow database tables" not in out + err
    # one line per incident: the skip of fault 1, the rewind after fault 2
    incidents = [ln for ln in out.splitlines() if ln.startswith("[earlywarn ")]
    assert len(incidents) == 2, incidents
    skip, rewind = incidents
    assert skip.startswith("[earlywarn CRITICAL] step 60: non-finite gradient in 'blocks.2.fc' (first in backward "
                           "order; 1 layer(s), 1 element(s)) from batch 60 of epoch 0 (samples ")
    # the bad batch: one skip, and it is quarantined (never trained)
    assert "): optimizer step skipped, params and optimizer state untouched; quarantined batch 60 of epoch 0" in skip
    assert skip.endswith(f"it is never trained -> {folder / 'quarantine.jsonl'}")
    m = re.fullmatch(r"\[earlywarn CRITICAL\] step 151: non-finite gradient \(first in \S+\), loss nan\. Done: "
                     r"rewound to the clean state of step (\d+) \(memory:\1\), (\d+) steps? lost; \d+ batch(?:es)? "
                     r"never trained again: .*the batch responsible was batch 150 of epoch 0 .*; quarantine list: (.+)",
                     rewind)
    assert m, rewind
    assert int(m.group(2)) <= 50 and m.group(3) == str(folder / "quarantine.jsonl")
    lines = out.splitlines()
    assert lines.index(skip) == lines.index(
        "[demo] step 60: fault 1 injected: inf in one gradient coordinate of blocks.2.fc.weight") + 1
    assert "finished 240 steps in " in out and "all parameters finite: True" in out

    # how to look at it: the exact command, the paths, the picture
    tail = out[out.index("What it logged, and how to look at it:"):].splitlines()
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    shown = dict(re.match(r"  (\S.*?)\s{2,}(\S.*)", ln).groups() for ln in tail[1:] if re.match(r"  \S", ln))
    assert shown["picture of this run"] == str(folder / "run.png")
    exe, _, rest = shown["MLflow UI"].partition(" ")
    assert rest == f"ui --backend-store-uri {uri}"
    assert os.access(exe, os.X_OK) and Path(exe).resolve() == (Path(sys.executable).parent / "mlflow").resolve()
    assert shown["event log (JSONL)"] == str(folder / "events.jsonl")
    assert shown["quarantine list"] == str(folder / "quarantine.jsonl")
    assert shown["checkpoints"] == f"{folder / 'checkpoints'}{os.sep}"
    width, height = png_size(folder / "run.png")
    assert width >= 800 and height >= 400
    import matplotlib.image

    assert matplotlib.image.imread(folder / "run.png").shape[:2] == (height, width)  # it decodes

    # everything under the one folder, and the printed URI holds the run
    assert [p.name for p in tmp_path.iterdir()] == ["earlywarn_demo"]
    assert {"events.jsonl", "quarantine.jsonl", "checkpoints", "mlflow.db", "mlruns", "run.png"} <= {
        p.name for p in folder.iterdir()}
    assert list((folder / "checkpoints").glob("step-*.pt"))
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("earlywarn-demo").experiment_id])
    assert run.data.metrics["earlywarn/rewinds"] == 1 and run.data.metrics["earlywarn/skipped_steps"] >= 1
    assert run.info.artifact_uri.startswith((folder / "mlruns").as_uri())
