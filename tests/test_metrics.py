"""earlywarn.metrics: the flat keys, the per-layer cadence / top-k, and key sanitising."""

from __future__ import annotations

import re

import numpy as np
import pytest

from earlywarn.metrics import COUNTERS, MetricsConfig, build_metrics, sanitize_key

MLFLOW_NAME = re.compile(r"^[/\w.\- :]*$")  # mlflow.utils.validation, non-Windows


def call(step, norms=None, names=None, level=0, counters=None, config=None, **kw):
    norms = None if norms is None else np.asarray(norms, dtype=float)
    if names is None and norms is not None:
        names = [f"layer{i}" for i in range(norms.size)]
    args = dict(grad_norm=1.5, loss=2.5, layer_names=names, layer_norms=norms, score=0.25, level=level,
                counters=counters or {}, config=config)
    args.update(kw)
    return build_metrics(step, **args)


def test_aggregate_keys_every_step():
    m = call(3, counters={"skipped_steps": 2, "rewinds": 1})
    assert m == {
        "earlywarn/grad_norm": 1.5, "earlywarn/grad_norm_finite": 1.0, "earlywarn/loss": 2.5,
        "earlywarn/loss_finite": 1.0, "earlywarn/instability_score": 0.25,
        "earlywarn/alert_level": 0.0, "earlywarn/skipped_steps": 2.0, "earlywarn/repaired_steps": 0.0,
        "earlywarn/rewinds": 1.0, "earlywarn/checkpoints": 0.0,
    }
    assert all(isinstance(v, float) for v in m.values())
    assert set(COUNTERS) == {"skipped_steps", "repaired_steps", "rewinds", "checkpoints"}


def test_missing_values_are_left_out_not_zero():
    m = call(1, grad_norm=None, loss=None, score=None)
    assert "earlywarn/grad_norm" not in m and "earlywarn/loss" not in m and "earlywarn/instability_score" not in m
    assert m["earlywarn/alert_level"] == 0.0


def test_layers_every_n_steps_and_on_alert_steps():
    cfg = MetricsConfig(layer_every=10)
    norms = [0.1, 0.2, 0.3]
    assert sum(k.startswith("earlywarn/layer_grad_norm/") for k in call(20, norms, config=cfg)) == 3
    quiet = call(21, norms, config=cfg)
    assert not any(k.startswith("earlywarn/layer_grad_norm/") for k in quiet)
    assert quiet["earlywarn/nonfinite_layers"] == 0.0
    assert sum(k.startswith("earlywarn/layer_grad_norm/") for k in call(21, norms, level=2, config=cfg)) == 3
    off = MetricsConfig(layer_every=10, layer_on_alert=False)
    assert not any(k.startswith("earlywarn/layer_grad_norm/") for k in call(21, norms, level=3, config=off))


def test_nonfinite_layers_always_logged_and_counted():
    m = call(7, [0.1, np.nan, 0.3, np.inf], config=MetricsConfig(layer_every=10))
    assert m["earlywarn/nonfinite_layers"] == 2.0
    layer = {k: v for k, v in m.items() if k.startswith("earlywarn/layer_grad_norm/")}
    assert set(layer) == {"earlywarn/layer_grad_norm/layer1", "earlywarn/layer_grad_norm/layer3"}
    assert np.isnan(layer["earlywarn/layer_grad_norm/layer1"]) and layer["earlywarn/layer_grad_norm/layer3"] == np.inf


def test_top_k_takes_the_largest_with_nonfinite_first():
    norms = np.arange(200, dtype=float)
    norms[5] = np.nan
    m = call(0, norms, config=MetricsConfig(layer_every=1, layer_top_k=4))
    layer = [k.rsplit("/", 1)[1] for k in m if k.startswith("earlywarn/layer_grad_norm/")]
    assert layer == ["layer5", "layer199", "layer198", "layer197"]
    assert len([k for k in call(0, norms[:3], config=MetricsConfig(layer_every=1, layer_top_k=4)) if "layer_grad" in k]) == 3


def test_two_hundred_layers_every_step():
    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(200)]
    m = call(0, np.random.default_rng(0).random(200), names, config=MetricsConfig(layer_every=1))
    assert sum(k.startswith("earlywarn/layer_grad_norm/model.layers.") for k in m) == 200


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("earlywarn/layer_grad_norm/h.0.attn", "earlywarn/layer_grad_norm/h.0.attn"),
        ("earlywarn/layer_grad_norm/blocks[3]", "earlywarn/layer_grad_norm/blocks_3_"),
        ("earlywarn//x/./y/../z/", "earlywarn/x/y/z"),
        ("/abs", "abs"),
        ("", "_"),
        ("emoji🔥key", "emoji_key"),
    ],
)
def test_sanitize_key(raw, clean):
    assert sanitize_key(raw) == clean
    assert MLFLOW_NAME.match(clean)


def test_sanitize_long_and_colliding_names():
    long = "earlywarn/" + "x" * 400
    k = sanitize_key(long)
    assert len(k) == 250 and k == sanitize_key(long)  # deterministic
    m = call(0, [1.0, 2.0], ["a[0]", "a(0)"], config=MetricsConfig(layer_every=1))
    assert m["earlywarn/layer_grad_norm/a_0_"] == 1.0 and m["earlywarn/layer_grad_norm/a_0__2"] == 2.0


def test_mismatched_names_and_bad_config_are_clear_errors():
    with pytest.raises(ValueError, match="layer_names"):
        call(0, [1.0, 2.0], ["only-one"])
    with pytest.raises(ValueError, match="layer_every"):
        MetricsConfig(layer_every=-1)
    with pytest.raises(ValueError, match="layer_top_k"):
        MetricsConfig(layer_top_k=0)
    with pytest.raises(ValueError, match="prefix"):
        MetricsConfig(prefix="early warn[x]/")
    with pytest.raises(ValueError, match="prefix"):
        MetricsConfig(prefix="earlywarn")
    assert "ew/grad_norm" in call(0, config=MetricsConfig(prefix="ew/"))


def test_finite_flags_and_the_step_counter_is_not_a_metric():
    m = call(4, grad_norm=float("inf"), loss=float("nan"), counters={"steps": 5, "alerts_critical": 2})
    assert m["earlywarn/grad_norm_finite"] == 0.0 and m["earlywarn/loss_finite"] == 0.0
    assert "earlywarn/steps" not in m and m["earlywarn/alerts_critical"] == 2.0
    assert "earlywarn/grad_norm_finite" not in call(4, grad_norm=None)


def test_step_levels_are_the_worst_incident_since_the_last_row():
    from earlywarn.events import Kind, Level
    from earlywarn.metrics import StepLevels

    lv = StepLevels()
    assert lv.take() == 0
    lv.note(Kind.GRAD_SPIKE, Level.INFO, 5)
    lv.note(Kind.REWIND, Level.CRITICAL, 5)
    lv.note(Kind.QUARANTINE, Level.WARNING, 5)
    lv.note(Kind.CHECKPOINT, Level.INFO, 5)  # bookkeeping, not an alert
    assert lv.take() == 3 and lv.take() == 0
    lv.note(Kind.CHECKPOINT, Level.INFO, 6)
    assert lv.take() == 0
    lv.note(Kind.HALT, Level.CRITICAL, 7)
    assert lv.halted and lv.step == 7 and lv.take() == 3 and not lv.halted
