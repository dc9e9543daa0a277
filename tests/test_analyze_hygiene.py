"""Data hygiene: stale repeats, "not computed" zeros, blanks, gaps, resumes and overlapping steps."""

from __future__ import annotations

import numpy as np

from earlywarn.analyze import analyze
from earlywarn.analyze.hygiene import clean
from earlywarn.analyze.readers import RawRun, read_source
from earlywarn.events import Kind, Level

from pathlib import Path

REAL = Path(__file__).parent / "data" / "realruns"
BLOOM_TXT = REAL / "bloom_chronicles" / "megatron_iteration_lines_verbatim.txt"
BLOOM_CSV = REAL / "bloom_chronicles" / "megatron_iteration_lines.csv"
LLMC = REAL / "llmc_gpt2_124m" / "main.csv"


def bloom(name: str, path=BLOOM_TXT):
    runs = [r for r in read_source(str(path)) if r.name.endswith(name)]
    assert len(runs) == 1, [r.name for r in read_source(str(path))]
    return clean(runs[0])


def raw(steps, **cols):
    n = len(steps)
    columns = {k: np.asarray(v, dtype=float) for k, v in cols.items()}
    missing = {k: np.isnan(v) & False for k, v in columns.items()}
    return RawRun("mem", "", "csv", np.asarray(steps, dtype=np.int64), columns, missing)


def test_bloom_fp16_skips_repeat_the_grad_norm_and_are_marked_stale():
    # tr8b-104B 17060-17068: the logged grad norm repeats exactly on overflow-skipped steps
    for path in (BLOOM_TXT, BLOOM_CSV):
        run = bloom("tr8b-104B/chronicles.md", path)
        steps = run.step.tolist()
        stale = {s for s, k, sk in zip(steps, run.grad_known, run.skipped) if sk and not k}
        assert {17062, 17063, 17064, 17065, 17067, 17068} <= stale
        assert 17061 not in stale and 17066 not in stale  # new values, not repeats
        assert run.counts["stale"] >= 6


def test_bloom_zero_grad_norm_is_not_computed():
    run = bloom("tr1-13B-base/chronicles.md")
    i = run.step.tolist().index(29020)
    assert not run.grad_known[i]  # "grad norm: 0.000" is missing, not a zero gradient
    assert run.counts["not_computed"] == 9
    assert run.grad_known[run.step.tolist().index(43680)]


def test_megatron_missing_lm_loss_is_a_skip_not_a_nonfinite_loss():
    # tr8-104B 9027 prints no lm loss (the scaler skipped every iteration of the interval)
    for path in (BLOOM_TXT, BLOOM_CSV):
        run = bloom("tr8-104B-wide/chronicles.md", path)
        i = run.step.tolist().index(9027)
        assert run.skipped[i] and not run.loss_known[i]
        report = analyze([str(path)], select="tr8-104B-wide")
        assert not any(a.kind == Kind.LOSS_NONFINITE for a in report.runs[0].alerts)


def test_rounding_logger_repeats_are_not_stale():
    # llm.c prints the norm with 2 decimals: exact repeats are everywhere and mean nothing
    run = clean(read_source(str(LLMC))[0])
    assert run.counts["stale"] == 0 and not run.skipped.any()


def test_high_precision_repeat_is_stale_even_without_scaler_info():
    g = 0.2 + 0.01 * np.sin(np.arange(100))
    g[50] = g[49]  # 0.2xxxxxxx repeated exactly: a stale value
    run = clean(raw(np.arange(100), loss=np.full(100, 2.0), grad_norm=g))
    assert run.skipped.tolist().count(True) == 1 and run.skipped[50] and not run.grad_known[50]


def test_gaps_and_stride():
    steps = np.concatenate([np.arange(0, 100, 10), np.arange(500, 600, 10)])
    run = clean(raw(steps, loss=np.full(20, 2.0)))
    assert run.stride == 10 and run.gaps == [(90, 500)]


def test_resume_with_overlap_restores_the_detector_and_reports_collapse_after_resume():
    # a run calm for 300 steps, resumed at 250 (50 steps ran twice); right after the resume the
    # grad norm escalates and the loss collapses: a collapse after a resume is reported as such
    rng = np.random.default_rng(1)
    s1 = np.arange(0, 300)
    s2 = np.arange(250, 330)
    steps = np.concatenate([s1, s2])
    n = len(steps)
    g = 0.2 * np.exp(rng.normal(0, 0.04, n))
    loss = 2.5 + rng.normal(0, 0.01, n)
    j = len(s1) + 10  # step 260 in the second segment
    for k in range(5):
        g[j + k] = 0.2 * 3.0 ** (k + 1)
    loss[j + 5:] = 7.0
    run = clean(raw(steps, loss=loss, grad_norm=g))
    assert [(r.step, r.previous_step, r.overlap) for r in run.resumes] == [(250, 299, 50)]
    report = analyze([run.raw])
    r = report.runs[0]
    assert r.resumes == [{"step": 250, "previous_step": 299, "overlap_steps": 50,
                          "detector_restored_from_step": r.resumes[0]["detector_restored_from_step"]}]
    assert r.resumes[0]["detector_restored_from_step"] == 249  # the state as of the resume step
    (inc,) = r.incidents
    assert inc.collapse_step == 265 and inc.after_resume and inc.resume_step == 250
    assert inc.first_warning_step is not None and 260 <= inc.first_warning_step < 265
    assert "after the resume at step 250" in inc.message
    # no alert was raised by the overlap itself (steps going back are not an anomaly)
    assert all(a.level < Level.WARNING for a in r.alerts if a.step < 260)


def test_repeated_step_rows_are_merged_unless_they_disagree():
    steps = [0, 1, 1, 2, 2]
    loss = [2.0, 2.0, np.nan, 2.0, 2.5]
    rr = raw(steps, loss=loss, eval_loss=[np.nan, np.nan, 1.5, np.nan, np.nan])
    rr.missing = {"loss": np.array([0, 0, 1, 0, 0], bool), "eval_loss": np.array([1, 1, 0, 1, 1], bool)}
    from earlywarn.analyze.rawrun import finish_run as _finish

    merged = _finish(rr)
    # step 1: a train row and an eval row -> one row; step 2 twice with different losses -> two rows
    assert merged.step.tolist() == [0, 1, 2, 2]
    run = clean(merged)
    assert [(r.step, r.previous_step) for r in run.resumes] == [(2, 2)]


def test_replay_across_resumes_is_the_detector_of_the_kept_history():
    # two resumes (rolled back 80 and 35 steps) with spikes and an escalation on either side:
    # after each resume the replay's alerts are those of a detector that saw only the history the
    # resumed run kept, i.e. as if the live detector had loaded the checkpoint of the resume step
    from earlywarn.analyze.replay import replay
    from earlywarn.detect import Observation, StreamingDetector

    rng = np.random.default_rng(7)
    segs = [np.arange(0, 700), np.arange(620, 900), np.arange(865, 1300)]
    steps = np.concatenate(segs)
    n = len(steps)
    g = 0.3 * np.exp(rng.normal(0, 0.1, n))
    lay = 0.1 * np.exp(rng.normal(0, 0.1, (n, 4)))
    loss = 3.0 * np.exp(rng.normal(0, 0.01, n))
    g[560:620] *= 1.4  # kept history just before the first resume step moves the baseline
    for row in (300, 650, 760, 1100):  # spikes, in kept and in abandoned stretches
        g[row] *= 6.0
        lay[row, 2] *= 8.0
    for k in range(4):  # an escalation in the last segment
        g[1200 + k] *= 3.0 ** (k + 1)
    cols = {"loss": loss, "grad_norm": g, **{f"grad_norm/l{j}": lay[:, j] for j in range(4)}}
    run = clean(raw(steps, **cols))
    assert [r.step for r in run.resumes] == [620, 865]
    rep = replay(run)
    assert [r["restored_from_step"] for r in rep.restored] == [619, 864]

    def obs(i):
        return Observation(step=int(steps[i]), grad_norm=float(g[i]), loss=float(loss[i]), layer_norms=lay[i])

    starts = [0, len(segs[0]), len(segs[0]) + len(segs[1])]
    for s, start in enumerate(starts):
        kept = []  # rows of the history the run had when segment s started
        for t in range(s):
            nxt_step = int(steps[starts[t + 1]])
            kept += [i for i in range(starts[t], starts[t + 1]) if steps[i] < nxt_step]
        sd = StreamingDetector(layer_names=run.layer_names)
        for i in kept:
            sd.observe(obs(i))
        end = starts[s + 1] if s + 1 < len(starts) else n
        expected = [(i, e.step, e.kind, e.level, e.message) for i in range(start, end) for e in sd.observe(obs(i))]
        got = [(i, e.step, e.kind, e.level, e.message) for i, e in zip(rep.alert_rows, rep.alerts) if start <= i < end]
        assert got == expected, f"segment {s}"
        assert any(e[3] >= Level.INFO for e in expected)


def test_incident_screen_is_the_window_minimum_and_never_above_the_median():
    # find_incidents skips a chunk when no loss there jumps over this floor; the floor must be
    # a true lower bound of the median reference, or a collapse could be skipped
    from earlywarn.analyze import report as R

    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        loss = np.exp(rng.normal(1, 0.3, n))
        loss[rng.random(n) < 0.05] = np.nan
        admit = (rng.random(n) > 0.2) & np.isfinite(loss)
        prior = None if trial % 2 else 2.0
        for a, b in ((0, n), (n // 3, n), (n - 1, n)):
            floor = R._refs(loss, admit, a, b, prior, floor=True)
            median = R._refs(loss, admit, a, b, prior)
            vals = loss[np.flatnonzero(admit[:b])]
            ks = np.searchsorted(np.flatnonzero(admit[:b]), np.arange(a, b))
            expected = [(np.nan if prior is None else prior) if k < 3 else vals[max(0, k - R.LOSS_WINDOW):k].min()
                         for k in ks]
            np.testing.assert_array_equal(floor, expected)
            both = np.isfinite(median)
            assert (floor[both] <= median[both]).all()
