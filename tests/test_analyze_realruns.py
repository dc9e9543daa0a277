"""`earlywarn analyze` on real logs (tests/data/realruns, see PROVENANCE.md there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from earlywarn.analyze import analyze
from earlywarn.events import Level

REAL = Path(__file__).parent / "data" / "realruns"
LLMC = REAL / "llmc_gpt2_124m" / "main.csv"
BLOOM_TXT = REAL / "bloom_chronicles" / "megatron_iteration_lines_verbatim.txt"
BLOOM_CSV = REAL / "bloom_chronicles" / "megatron_iteration_lines.csv"
BLOOM_BASELINE = {"grad_norm": 0.2, "loss": 2.3}  # typical values of tr11-176B (README: 0.13-0.27)


@pytest.fixture(scope="module")
def llmc_report():
    return analyze([str(LLMC)])


def test_llmc_healthy_run_gets_no_warning(llmc_report):
    r = llmc_report.runs[0]
    assert r.steps == 19561 and r.first_step == 0 and r.last_step == 19560
    assert r.keys["loss"] == "train_loss" and r.keys["grad_norm"] == "grad_norm"
    assert r.max_level <= Level.INFO, [str(a) for a in r.alerts if a.level > Level.INFO][:5]
    assert r.incidents == [] and r.saved_steps == 0
    # the transient 7.5x spikes are seen, as info
    info_steps = {int(a.values.get("peak_step", a.step)) for a in r.alerts}
    assert {4233, 4582, 7435} & info_steps


@pytest.mark.parametrize("path", [BLOOM_TXT, BLOOM_CSV], ids=["verbatim", "csv"])
def test_bloom_176b_warns_before_the_loss_jump(path):
    report = analyze([str(path)], baseline=BLOOM_BASELINE, select="tr11-176B-ml/chronicles.md")
    (r,) = report.runs
    fw = r.first_warning
    assert fw is not None and 31214 <= fw.step < 31219, [str(a) for a in r.alerts]
    assert fw.signal == "grad_norm"
    (inc,) = r.incidents
    assert inc.collapse_step == 31219 and inc.first_warning_step == fw.step
    assert inc.lead_steps == 31219 - fw.step >= 1
    assert inc.recovered_step == 31250 and inc.saved_steps == 31250 - fw.step
    assert not inc.after_resume


def test_bloom_file_splits_into_one_run_per_chronicle():
    report = analyze([str(BLOOM_TXT)], baseline=BLOOM_BASELINE)
    names = [r.run for r in report.runs]
    assert names == ["train/tr1-13B-base/chronicles.md", "train/tr8-104B-wide/chronicles.md",
                     "train/tr8b-104B/chronicles.md", "train/tr11-176B-ml/chronicles-prequel.md",
                     "train/tr11-176B-ml/chronicles.md"]
    wide = report.run("tr8-104B-wide")
    # the chronicle quotes a restart from 6900 after 7220: a resume, with the collapse after it
    assert wide.resumes[0]["step"] == 6900 and wide.resumes[0]["overlap_steps"] == 321
    assert any(i.after_resume and i.resume_step == 6900 for i in wide.incidents)


def test_json_schema_on_real_runs():
    report = analyze([str(LLMC), str(BLOOM_TXT)], baseline=BLOOM_BASELINE)
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert d["version"] == 1 and len(d["runs"]) == 6
    for run in d["runs"]:
        assert isinstance(run["source"], str) and isinstance(run["steps"], int)
        for a in run["alerts"]:
            assert isinstance(a["step"], int) and a["level"] in ("info", "warning", "critical")
            assert isinstance(a["signal"], str) and isinstance(a["message"], str)
            assert a["layer"] is None or isinstance(a["layer"], str)
        for i in run["incidents"]:
            assert {"collapse_step", "first_warning_step", "lead_steps", "first_layer", "saved_steps",
                    "after_resume", "resume_step"} <= set(i)
    s = d["summary"]
    assert s["runs"] == 6 and s["incidents"] >= 1 and s["saved_steps"] >= 31250 - 31218


def test_calibrate_on_llmc_keeps_it_quiet_and_still_catches_bloom(tmp_path):
    from earlywarn.analyze import calibrate
    from earlywarn.detect import DetectorConfig

    out = tmp_path / "detector.json"
    res = calibrate([str(LLMC)], target_rate=0.0, out=str(out))
    assert res.met and res.false_alarms == 0 and res.steps == 19561
    cfg = DetectorConfig.from_file(out)
    assert cfg == res.config
    assert analyze([str(LLMC)], config=str(out)).runs[0].max_level <= Level.INFO
    r = analyze([str(BLOOM_TXT)], config=cfg, baseline=BLOOM_BASELINE, select="tr11-176B-ml/chronicles.md").runs[0]
    assert r.incidents[0].first_warning_step is not None and r.incidents[0].first_warning_step < 31219
