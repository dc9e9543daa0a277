"""Golden replays of the detector: alerts and final states of long runs, recorded in
``tests/data/detector_golden.json`` and checked by ``tests/test_detector_golden.py``.

A refactor must leave them as they are (alerts exactly, values on a grid no CPU's rounding crosses: see _quantized). A change of a rule changes them on purpose:
then look at which alerts moved (the test prints them), and record the new figures with

    PYTHONPATH=. python tests/detector_golden.py --update

saying so in the commit.
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "detector_golden.json"
REALRUNS = ROOT / "tests" / "data" / "realruns"


def _quantized(v: np.ndarray) -> np.ndarray:
    """Float64 values to a grid no CPU's rounding crosses: 1e-9 apart under 1 in size (values a
    subtraction left near zero carry the absolute error of what was subtracted), float32's 24
    bits above. numpy's float64 log differs in its last bits between CPUs (AVX-512 machines take
    SVML's); a change that moves a value moves it far more than that."""
    small = np.abs(v) < 1.0
    return np.where(small, np.round(np.where(small, v, 0.0), 9), v.astype(np.float32).astype(np.float64))


def _exact(v):
    """A value in a form that compares (and hashes) exactly, floats on :func:`_quantized`'s grid."""
    if isinstance(v, float):
        return float(_quantized(np.array([v]))[0]).hex()
    if isinstance(v, np.ndarray):
        if v.dtype.kind == "f":
            v = _quantized(v.astype(np.float64))
        return [str(v.dtype), list(v.shape), hashlib.sha256(v.tobytes()).hexdigest()]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_exact(x) for x in v]]
    if isinstance(v, dict):
        return [[k, _exact(x)] for k, x in v.items()]
    return [type(v).__name__, repr(v)]


def _llmc_columns(view: str):
    from earlywarn.detect import StepColumns

    rows = [r for r in csv.DictReader(open(REALRUNS / "llmc_gpt2_124m" / "main.csv")) if r["train_loss"]]
    g = np.array([float(r["grad_norm"]) if r["grad_norm"] else np.nan for r in rows])
    lr = np.array([float(r["lr"]) if r["lr"] else np.nan for r in rows])
    ex = {"lr": (lr, np.isfinite(lr))} if view == "logged" else {}
    return StepColumns(step=np.array([int(r["step"]) for r in rows]), grad_norm=g if view == "logged" else None,
                       grad_known=np.isfinite(g), loss=np.array([float(r["train_loss"]) for r in rows]), extras=ex)


def _bloom_columns():
    from earlywarn.detect import StepColumns

    rows = list(csv.DictReader(open(REALRUNS / "bloom_chronicles" / "megatron_iteration_lines.csv")))
    rows = sorted((r for r in rows if r["snippet"].startswith("tr11-176B-ml/chronicles.md#block7") and r["lm_loss"]),
                  key=lambda r: int(r["iteration"]))
    g = np.array([float(r["grad_norm"]) if r["grad_norm"] and float(r["grad_norm"]) > 0 else np.nan for r in rows])
    return StepColumns(step=np.array([int(r["iteration"]) for r in rows]), grad_norm=g, grad_known=np.isfinite(g),
                       loss=np.array([float(r["lm_loss"]) for r in rows]))


def _synthetic_columns(steps: int = 20_000, layers: int = 50):
    """``benchmarks/detector_speed.py``'s run: spikes, an escalation, a non-finite step, a zero
    layer, an LR warm-up and cosine."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from detector_speed import synthetic_columns

    return synthetic_columns(steps, layers)


def cases() -> dict:
    """name -> (columns, layer names, prior baseline)."""
    return {
        "llmc_gpt2_124m (grad norm, loss, lr)": (_llmc_columns("logged"), (), None),
        "llmc_gpt2_124m (loss only)": (_llmc_columns("loss"), (), None),
        "bloom176b block7 (prior grad norm 0.2)": (_bloom_columns(), (), {"grad_norm": 0.2}),
        "synthetic 20k steps x 50 layers": (_synthetic_columns(), tuple(f"layer{i}" for i in range(50)), None),
    }


def replay(cols, names, baseline) -> dict:
    """The alerts (row, kind, level) and a digest of every alert's fields and the final state."""
    from earlywarn.detect import StreamingDetector

    sd = StreamingDetector(layer_names=names, baseline=baseline)
    alerts = sd.observe_columns(cols)
    full = [[row, e.step, e.kind.value, int(e.level), e.message, e.signal, list(e.layers), _exact(dict(e.values))]
            for row, e in alerts]
    blob = json.dumps([full, _exact(sd.state_dict())], sort_keys=True).encode()
    return {"alerts": [[row, e.kind.value, int(e.level)] for row, e in alerts],
            "digest": hashlib.sha256(blob).hexdigest()}


def _dumps(got: dict) -> str:
    """JSON with one alert per line (a rule change shows as a readable diff)."""
    cases = []
    for name, v in got.items():
        alerts = ",\n".join(f"   {json.dumps(a)}" for a in v["alerts"])
        cases.append(f' {json.dumps(name)}: {{\n  "digest": {json.dumps(v["digest"])},\n'
                     f'  "alerts": [{chr(10) + alerts + chr(10) + "  " if alerts else ""}]\n }}')
    return "{\n" + ",\n".join(cases) + "\n}\n"


def main(argv: list[str]) -> int:
    got = {name: replay(*case) for name, case in cases().items()}
    if "--update" in argv:
        GOLDEN.write_text(_dumps(got))
        print(f"wrote {GOLDEN}: " + ", ".join(f"{k}: {len(v['alerts'])} alerts" for k, v in got.items()))
        return 0
    want = json.loads(GOLDEN.read_text())
    bad = [k for k in want if want[k] != got.get(k)]
    print("identical" if not bad else f"differ: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
