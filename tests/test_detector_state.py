"""The detector's state: declared once (``STATE_FIELDS``), carried whole by every path, saved and
loaded in format 3."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from earlywarn.detect import Detector, DetectorConfig, DetectorState, StreamingDetector
from earlywarn.detect.state import CUSUM, N_FIXED, SCALE, STATE_FIELDS, STATE_VERSION, WIDTH
from test_user_signals import _mixed_user_columns

DATA = Path(__file__).resolve().parent / "data"


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_nan=True)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return a == b and type(a) is type(b)


def _unusual(field, base: DetectorState, cfg: DetectorConfig):
    """A value of ``field`` that is not its default (and makes sense for ``base``'s layout)."""
    n = len(base.channels)
    return {
        "int": 7, "float": 0.375, "bool": not field.default,
        "names": base.channels,
        "stats": np.arange(8.0 * n).reshape(8, n) + 1.0,
        "dev": np.linspace(-1.0, 1.0, n),
        "ring": tuple(1e-3 * (i + 1) for i in range(cfg.lr_ref_steps)),
        "positions": (1,),
    }[field.kind]


def test_every_field_of_the_table_is_loaded_snapshot_and_saved_as_it_was():
    cfg = DetectorConfig()
    det = Detector(cfg)
    base = det.init(["a", "b", "c"], user_names=["u"])
    state = base._replace(**{f.name: _unusual(f, base, cfg) for f in STATE_FIELDS if f.name != "step"}, step=41)
    # the working state keeps the width (admit_z * scale) and CUSUMs of the run-level channels only
    state.stats[SCALE] = state.stats[WIDTH] / cfg.admit_z
    state.stats[CUSUM, N_FIXED:N_FIXED + 3] = 0.0
    back = det.snapshot(det.working(state))
    again = DetectorState.from_dict(pickle.loads(pickle.dumps(back.to_dict())))
    for f in STATE_FIELDS:
        assert _same(getattr(state, f.name), getattr(back, f.name)), f.name
        assert _same(getattr(state, f.name), getattr(again, f.name)), f.name


def _plain(v):
    """``v`` as JSON has it (arrays and tuples as lists)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def test_a_state_saved_in_format_3_loads_as_saved_and_runs_on():
    # saved by the detector before its state was declared in one table (see the file's _made_by)
    saved = json.loads((DATA / "detector_state_v3.json").read_text())
    assert saved["version"] == STATE_VERSION == 3
    sd = StreamingDetector(layer_names=["x", "y", "z"])
    sd.load_state_dict(saved)
    now = sd.state_dict()
    for f in STATE_FIELDS:
        if f.name in saved:  # fields added since (with their defaults) load from a state without them
            assert _same(_plain(now[f.name]), saved[f.name]), f.name
    sd.observe_columns(_mixed_user_columns(), saved["step"] + 1, 3400)
    assert sd.state.step == 3399 and sd.user_names == ("user/attn", "user/b")


def test_a_malformed_state_is_refused_with_the_reason():
    d = StreamingDetector(layer_names=["a"]).state_dict()
    with pytest.raises(ValueError, match="no step"):
        DetectorState.from_dict({k: v for k, v in d.items() if k != "step"})
    with pytest.raises(ValueError, match="dev shape"):
        DetectorState.from_dict({**d, "dev": np.zeros(2)})
