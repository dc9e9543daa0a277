"""Data hygiene: what a logged number really means before the detector sees it.

Logs lie in known ways (see ``shared/data/realruns``):

- **stale values**: an fp16 run that skips a step on overflow keeps printing the previous grad
  norm (BLOOM tr8b-104B 17062-17068); the repeat is not a measurement, the step was skipped;
- **"not computed"**: ``grad norm: 0.000`` (BLOOM tr1-13B) means the norm was not computed, not a
  zero gradient; such values become missing;
- **blanks**: JSON ``null``, an empty CSV cell or an absent key. In a column the run logs on (nearly)
  every step, a blank on a row that logged the other core signal is a non-finite value the
  logger could not write (JSON has no NaN); elsewhere it means "not logged";
- **gaps**: the log interval changes or lines are missing;
- **resumes**: the step goes back (or repeats): the job restarted from a checkpoint and re-ran
  the overlapping steps. A resume is reported in its own right and the replay restores the
  detector to its state at the resume step.

Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from earlywarn.analyze.rawrun import AnalyzeError, RawRun

# canonical name -> keys tried in order when the key map does not name one
CANDIDATES: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "train_loss", "train/loss", "lm_loss", "lm loss", "training_loss", "loss/train",
             "train/lm_loss", "earlywarn/loss"),
    "grad_norm": ("grad_norm", "train/grad_norm", "grad-norm", "gradient_norm", "grad_norm/total",
                  "total_grad_norm", "grad norm", "optim/total_grad_norm", "norm", "earlywarn/grad_norm"),
    "loss_scale": ("loss_scale", "loss scale", "scaler/scale", "grad_scale", "train/loss_scale"),
    "lr": ("lr", "learning_rate", "learning rate", "train/learning_rate", "train/lr"),
    "skipped": ("skipped", "skipped_iters", "skipped_iterations", "skipped_step"),
    "skipped_total": ("skipped_steps", "earlywarn/skipped_steps"),
    "nan_iters": ("nan_iters", "nan_iterations"),
    "update_norm": ("update_norm", "train/update_norm", "earlywarn/update_norm"),
    "param_norm": ("param_norm", "params_norm", "train/param_norm", "earlywarn/param_norm"),
}
LAYER_PREFIXES = ("grad_norm/", "grad_norms/", "layer_grad_norm/", "l2_norm/grad/", "earlywarn/layer_grad_norm/",
                  "earlywarn/grad_norm/")
KEY_MAP_NAMES = ("step", "run", "loss", "grad_norm", "layer_prefix", "loss_scale", "lr", "skipped",
                 "skipped_total", "nan_iters", "update_norm", "param_norm")
EXTRAS = ("lr", "loss_scale", "update_norm", "param_norm")
USER_PREFIXES = ("earlywarn/user/", "user/")
"""Columns of a user's own signals (``Watcher.report``): ``earlywarn/user/<name>`` -> ``user/<name>``."""

DENSE = 0.9
"""A column present on at least this share of the rows that logged the other core signal is
"logged every step": a blank there is a value the logger could not write."""
STALE_SIGNIFICANT_DIGITS = 4
"""An exact repeat of a value printed with at least this many significant digits is stale..."""
STALE_MAX_REPEAT_RATE = 0.02
"""...unless exact repeats are common in the run (a logger that rounds, e.g. llm.c's 2 decimals)."""


def check_key_map(key_map: Mapping[str, str] | None) -> dict[str, str]:
    """Validate a key map ``{canonical: column}``; unknown canonical names raise AnalyzeError."""
    if key_map is None:
        return {}
    if not isinstance(key_map, Mapping):
        raise AnalyzeError(f"key_map must be a mapping like {{'loss': 'train/loss'}}, got {type(key_map).__name__}")
    out = {}
    for k, v in key_map.items():
        if k not in KEY_MAP_NAMES:
            raise AnalyzeError(f"unknown key-map name {k!r}: use one of {', '.join(KEY_MAP_NAMES)}")
        if not isinstance(v, str) or not v:
            raise AnalyzeError(f"key-map value for {k!r} must be a non-empty column name, got {v!r}")
        out[k] = v
    return out


@dataclass
class Resume:
    row: int
    """First row of the new segment."""
    step: int
    """Step the run resumed at."""
    previous_step: int
    """Last step logged before the resume."""

    @property
    def overlap(self) -> int:
        """Steps that ran twice (0 when the run resumed after its last logged step)."""
        return max(0, self.previous_step - self.step + 1)

    def to_dict(self) -> dict:
        return {"step": self.step, "previous_step": self.previous_step, "overlap_steps": self.overlap}


@dataclass
class CleanRun:
    """One run ready for replay: each row is one :class:`Observation`, in logging order."""

    raw: RawRun
    step: np.ndarray
    loss: np.ndarray
    """float64; meaningful only where ``loss_known`` (a NaN there is a logged non-finite loss)."""
    loss_known: np.ndarray
    grad_norm: np.ndarray
    grad_known: np.ndarray
    layer_names: tuple[str, ...]
    layers: np.ndarray | None
    """(rows x layers) float64 or None; rows where ``layers_known`` is False carry no layer data."""
    layers_known: np.ndarray
    skipped: np.ndarray
    extras: dict[str, tuple[np.ndarray, np.ndarray]]
    """name -> (values, known)."""
    resumes: list[Resume]
    segment_starts: np.ndarray
    """Row index where each segment starts (0 first)."""
    stride: int
    gaps: list[tuple[int, int]]
    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)
    """canonical name -> the column it was read from."""

    def __len__(self) -> int:
        return int(self.step.shape[0])


def _resolve(raw: RawRun, key_map: Mapping[str, str]) -> tuple[dict[str, str], str | None, list[str]]:
    cols = raw.columns
    chosen: dict[str, str] = {}
    for name, cands in CANDIDATES.items():
        wanted = key_map.get(name)
        if wanted:
            if wanted not in cols:
                raise AnalyzeError(
                    f"{raw.label}: column {wanted!r} (key map {name}={wanted}) not found; columns: "
                    + ", ".join(sorted(cols)[:12]) + (" ..." if len(cols) > 12 else "")
                )
            chosen[name] = wanted
            continue
        for c in cands:
            if c in cols:
                chosen[name] = c
                break
    prefix = key_map.get("layer_prefix")
    used = set(chosen.values())
    prefixes = (prefix,) if prefix else LAYER_PREFIXES
    layer_keys: list[str] = []
    chosen_prefix = None
    for p in prefixes:
        layer_keys = [k for k in cols if k.startswith(p) and len(k) > len(p) and k not in used]
        if layer_keys:
            chosen_prefix = p
            break
    if "loss" not in chosen and "grad_norm" not in chosen:
        raise AnalyzeError(
            f"{raw.label}: no loss or grad-norm column (columns: "
            + (", ".join(sorted(cols)[:12]) or "none") + (" ..." if len(cols) > 12 else "")
            + "); name them with --key loss=<column> --key grad_norm=<column>"
        )
    return chosen, chosen_prefix, layer_keys


def _sig_digits(x: float) -> int:
    text = repr(abs(float(x))).lower()
    mant = text.split("e")[0].replace(".", "").lstrip("0").rstrip("0")
    return max(1, len(mant))


def clean(raw: RawRun, key_map: Mapping[str, str] | None = None) -> CleanRun:
    """Resolve the keys of ``raw`` and apply the hygiene rules above."""
    key_map = check_key_map(key_map)
    n = len(raw)
    if n == 0:
        raise AnalyzeError(f"{raw.label}: no rows (empty run)")
    chosen, prefix, layer_keys = _resolve(raw, key_map)
    notes = list(raw.notes)
    counts = {"rows": n, "stale": 0, "not_computed": 0, "blank_as_nonfinite": 0, "skipped": 0,
              "overflow": 0, "resumes": 0, "overlap_steps": 0, "gaps": 0}
    step = raw.step.astype(np.int64, copy=False)
    seg = _segments(step, raw.resume_rows)
    counts.update(resumes=len(seg.resumes), overlap_steps=int(sum(r.overlap for r in seg.resumes)),
                  gaps=len(seg.gaps))

    # loss and grad norm: (values, known), changed in place by the phases below
    loss, loss_known = _column(raw, chosen, "loss")
    grad, grad_known = _column(raw, chosen, "grad_norm")
    core = {"loss": (loss, loss_known), "grad_norm": (grad, grad_known)}
    blanks = _dense_blanks(chosen, loss_known, grad_known) if raw.tabular else {}
    for label, blank in blanks.items():  # non-finite for now; a skipped step makes it "not logged" below
        values, known = core[label]
        values[blank] = np.nan
        known[blank] = True
    layer_names, layers, layers_known = _layer_norms(raw, layer_keys, prefix, counts, notes)
    _zeros_not_computed(core, chosen, counts, notes)
    extras = _extras(raw, chosen)

    skipped, overflow = _logged_skips(raw, chosen, seg, core, extras, counts, notes)
    stale = _stale_grad_norms(grad, grad_known, seg.contiguous, evidence=overflow | skipped)
    if stale.any():
        counts["stale"] = int(stale.sum())
        grad_known[stale] = False
        skipped |= stale
        notes.append(f"{counts['stale']} grad-norm value(s) repeat the previous step exactly (stale, a skipped step)")
    stale_layers = _stale_layer_rows(layers, layers_known, seg.contiguous)
    if stale_layers.any():
        layers_known = layers_known & ~stale_layers
        skipped |= stale_layers
        counts["stale"] += int(stale_layers.sum())
    _settle_blanks(blanks, core, skipped, chosen, counts, notes)
    counts["skipped"] = int(skipped.sum())
    notes += _summary_notes(counts, seg)
    if not (loss_known.any() or grad_known.any() or layers_known.any()):
        raise AnalyzeError(f"{raw.label}: no usable loss or grad-norm value in {n} row(s) (empty run)")

    keys = dict(chosen)
    if prefix:
        keys["layer_prefix"] = prefix
    return CleanRun(
        raw=raw, step=step, loss=loss, loss_known=loss_known, grad_norm=grad, grad_known=grad_known,
        layer_names=layer_names, layers=layers, layers_known=layers_known, skipped=skipped, extras=extras,
        resumes=seg.resumes, segment_starts=seg.starts, stride=seg.stride, gaps=seg.gaps, counts=counts, notes=notes,
        keys=keys,
    )


# The phases of clean(). Those given ``counts`` and ``notes`` add what they found to them.


@dataclass
class _Segments:
    """The run cut where its step goes back or repeats (a resume), and how steps advance within."""

    starts: np.ndarray
    """Row index where each segment starts (0 first)."""
    resumes: list[Resume]
    contiguous: np.ndarray
    """Row i continues row i-1 in the same segment."""
    diffs: np.ndarray
    """``step[i] - step[i-1]`` (0 for the first row)."""
    stride: int
    """The usual step difference within a segment (the median, at least 1)."""
    gaps: list[tuple[int, int]]
    """(step before, step after) where the steps jump by more than twice the stride."""


def _segments(step: np.ndarray, resume_rows: list[int]) -> _Segments:
    n = len(step)
    back = np.zeros(n, dtype=bool)  # a step that does not move forward starts a new segment
    back[1:] = step[1:] <= step[:-1]
    for r in resume_rows:
        if 0 < r < n:
            back[r] = True
    starts = np.concatenate([[0], np.flatnonzero(back)]).astype(np.int64)
    resumes = [Resume(row=r, step=int(step[r]), previous_step=int(step[r - 1])) for r in np.flatnonzero(back).tolist()]
    contiguous = np.zeros(n, dtype=bool)
    contiguous[1:] = ~back[1:]
    diffs = np.zeros(n, dtype=np.int64)
    diffs[1:] = step[1:] - step[:-1]
    fwd = diffs[contiguous]
    stride = max(int(np.median(fwd)) if fwd.size else 1, 1)
    gap_rows = np.flatnonzero(contiguous & (diffs > max(2 * stride, stride + 1)))
    gaps = [(int(step[i - 1]), int(step[i])) for i in gap_rows.tolist()]
    return _Segments(starts, resumes, contiguous, diffs, stride, gaps)


def _column(raw: RawRun, chosen: Mapping[str, str], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, known) of the canonical column ``name``, a copy; all unknown when the run has none."""
    key = chosen.get(name)
    if key is None:
        return np.full(len(raw), np.nan), np.zeros(len(raw), dtype=bool)
    return raw.columns[key].astype(np.float64, copy=True), ~raw.missing[key]


def _dense_blanks(chosen: Mapping[str, str], loss_known: np.ndarray, grad_known: np.ndarray) -> dict[str, np.ndarray]:
    """Per core signal, the rows where it is blank although the other signal was logged, when it is
    logged on nearly every such row (``DENSE``): values the logger could not write."""
    blanks = {}
    for label, known, other in (("loss", loss_known, grad_known), ("grad_norm", grad_known, loss_known)):
        if label in chosen and int(other.sum()) >= 10 and known[other].mean() >= DENSE:
            blank = other & ~known
            if blank.any():
                blanks[label] = blank
    return blanks


def _layer_norms(raw: RawRun, layer_keys: list[str], prefix: str | None, counts: dict[str, int],
                 notes: list[str]) -> tuple[tuple[str, ...], np.ndarray | None, np.ndarray]:
    """(layer names, (rows x layers) norms or None, rows that carry them). A blank in a densely
    logged layer is non-finite, an exact 0 "not computed", a layer never computed is left out and
    a layer missing from a row that has others carries its last value."""
    n = len(raw)
    if not layer_keys:
        return (), None, np.zeros(n, dtype=bool)
    # (rows, layers) as the transpose of one contiguous row per layer: a plain copy per
    # column instead of column_stack's strided writes
    mat = np.array([raw.columns[k] for k in layer_keys], dtype=np.float64).T
    known_m = None  # the common case: a full matrix, no masks to carry
    if any(raw.missing[k].any() for k in layer_keys):
        known_m = ~np.column_stack([raw.missing[k] for k in layer_keys])
        if raw.tabular and len(layer_keys) > 1:
            _layer_blanks_as_nonfinite(mat, known_m, counts, notes)
    zero = mat == 0.0
    if zero.any():
        if known_m is None:
            known_m = np.ones(mat.shape, dtype=bool)
        zero &= known_m
        counts["not_computed"] += int(zero.sum())
        known_m &= ~zero
    keep = np.ones(len(layer_keys), dtype=bool) if known_m is None else known_m.any(axis=0)
    if not keep.all():
        notes.append(f"{int((~keep).sum())} per-layer column(s) never hold a computed value and were left out")
        mat = mat[:, keep]
        known_m = known_m[:, keep]
    names = tuple(k[len(prefix):] for k, ok in zip(layer_keys, keep.tolist()) if ok)
    if not names:
        return (), None, np.zeros(n, dtype=bool)
    if known_m is None:
        return names, mat, np.ones(n, dtype=bool)
    rows_known = known_m.any(axis=1)
    if (rows_known & ~known_m.all(axis=1)).any():
        mat = _carry_layer_values(mat, known_m)
    return names, mat, rows_known


def _layer_blanks_as_nonfinite(mat: np.ndarray, known_m: np.ndarray, counts: dict[str, int], notes: list[str]) -> None:
    """A blank in a layer logged on nearly every row that logged most layers: NaN, known (in place)."""
    rows_ok = known_m.mean(axis=1) >= 0.5
    if rows_ok.sum() < 10:
        return
    dense_cols = known_m[rows_ok].mean(axis=0) >= DENSE
    blank = rows_ok[:, None] & dense_cols[None, :] & ~known_m
    k = int(blank.sum())
    if k:
        mat[blank] = np.nan
        known_m[blank] = True
        counts["blank_as_nonfinite"] += k
        notes.append(f"{k} blank per-layer value(s) in densely logged layers were read as non-finite")


def _carry_layer_values(mat: np.ndarray, known_m: np.ndarray) -> np.ndarray:
    """A layer not computed on a row that has others carries its last value (forward, then backward
    for the first rows), so the row keeps its per-layer information."""
    idx = np.where(known_m, np.arange(mat.shape[0])[:, None], -1)
    np.maximum.accumulate(idx, axis=0, out=idx)
    first = np.argmax(known_m, axis=0)
    idx = np.where(idx < 0, first[None, :], idx)
    filled = np.take_along_axis(mat, idx, axis=0)
    return np.where(known_m, mat, filled)


def _zeros_not_computed(core: dict[str, tuple[np.ndarray, np.ndarray]], chosen: Mapping[str, str],
                        counts: dict[str, int], notes: list[str]) -> None:
    """A loss or grad norm of exactly 0 means "not computed": unknown (in place)."""
    for label in ("grad_norm", "loss"):
        values, known = core[label]
        z = known & (values == 0.0)
        k = int(z.sum())
        if k:
            known[z] = False
            counts["not_computed"] += k
            notes.append(f"{k} {chosen.get(label, label)!r} value(s) of exactly 0 read as 'not computed'")


def _extras(raw: RawRun, chosen: Mapping[str, str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The other signals (``EXTRAS``, finite values only; a loss scale of 0 is unknown) and the
    user's own (``user/<name>``: NaN / inf kept, the detector warns on them): name -> (values, known)."""
    extras: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in EXTRAS:
        if name in chosen:
            v, kn = _column(raw, chosen, name)
            kn = kn & np.isfinite(v)
            if name == "loss_scale":
                kn &= v != 0.0
            extras[name] = (v, kn)
    for key in raw.columns:
        for pre in USER_PREFIXES:
            if key.startswith(pre) and len(key) > len(pre) and f"user/{key[len(pre):]}" not in extras:
                extras[f"user/{key[len(pre):]}"] = (raw.columns[key].astype(np.float64, copy=True), ~raw.missing[key])
                break
    return extras


def _logged_skips(raw: RawRun, chosen: Mapping[str, str], seg: _Segments,
                  core: dict[str, tuple[np.ndarray, np.ndarray]], extras: dict[str, tuple[np.ndarray, np.ndarray]],
                  counts: dict[str, int], notes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(skipped, overflow): the rows the log itself shows as skipped (its skip counter, a rise of a
    cumulative one, NaN iterations, a loss-scale drop over one step) and the loss-scale drops. NaN
    iterations also make the row's grad norm non-finite (in place)."""
    n = len(raw)
    skipped = np.zeros(n, dtype=bool)
    if "skipped" in chosen:
        counter, counter_known = _column(raw, chosen, "skipped")
        per_row = np.where(counter_known, np.nan_to_num(counter), 0.0)
        step_span = np.where(seg.contiguous, np.maximum(seg.diffs, 1), seg.stride)
        skipped |= per_row >= np.maximum(step_span, 1)  # every iteration of the interval skipped
    if "skipped_total" in chosen:
        # a cumulative counter (earlywarn's own earlywarn/skipped_steps): a rise is a skipped step
        total, total_known = _column(raw, chosen, "skipped_total")
        prev = np.full(n, np.nan)
        last = np.nan
        for i in np.flatnonzero(total_known).tolist():
            prev[i] = last if seg.contiguous[i] or i == 0 else np.nan
            last = total[i]
        skipped |= total_known & np.isfinite(prev) & (total > prev)
    if "nan_iters" in chosen:
        nan_it, nan_known = _column(raw, chosen, "nan_iters")
        had_nan = nan_known & (np.nan_to_num(nan_it) > 0)
        if had_nan.any():
            grad, grad_known = core["grad_norm"]
            grad[had_nan] = np.nan
            grad_known[had_nan] = True
            skipped |= had_nan
            notes.append(f"{int(had_nan.sum())} row(s) report NaN iterations: read as non-finite gradients")
    overflow = np.zeros(n, dtype=bool)
    if "loss_scale" in extras:
        ls, ls_known = extras["loss_scale"]
        prev_ok = np.zeros(n, dtype=bool)
        prev_ok[1:] = ls_known[1:] & ls_known[:-1] & seg.contiguous[1:]
        overflow[1:] = prev_ok[1:] & (ls[1:] < ls[:-1])
        counts["overflow"] = int(overflow.sum())
        skipped |= overflow & (seg.diffs == 1)
    return skipped, overflow


def _stale_grad_norms(grad: np.ndarray, grad_known: np.ndarray, contiguous: np.ndarray, *,
                      evidence: np.ndarray) -> np.ndarray:
    """Rows whose grad norm repeats the previous row's exactly and is stale: the log says the step
    did not apply (``evidence``), or the value has many digits in a run where repeats are rare."""
    n = len(grad)
    g_ok = grad_known & np.isfinite(grad)
    pair = np.zeros(n, dtype=bool)
    pair[1:] = g_ok[1:] & g_ok[:-1] & contiguous[1:]
    rep = np.zeros(n, dtype=bool)
    rep[1:] = pair[1:] & (grad[1:] == grad[:-1])
    # too few pairs to tell a rounding logger from real repeats: trust the digits alone
    repeat_rate = rep.sum() / pair.sum() if pair.sum() >= 50 else 0.0
    stale = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(rep).tolist():
        if evidence[i] or (repeat_rate < STALE_MAX_REPEAT_RATE and _sig_digits(grad[i]) >= STALE_SIGNIFICANT_DIGITS):
            stale[i] = True
    return stale


def _stale_layer_rows(layers: np.ndarray | None, layers_known: np.ndarray, contiguous: np.ndarray) -> np.ndarray:
    """Rows where every layer (two or more) equals the previous row's: stale rows."""
    lrep = np.zeros(len(layers_known), dtype=bool)
    if layers is None or layers.shape[1] < 2:
        return lrep
    # checked on the first column first
    lrep[1:] = layers_known[1:] & layers_known[:-1] & contiguous[1:] & (layers[1:, 0] == layers[:-1, 0])
    cand = np.flatnonzero(lrep)
    if cand.size:
        same = np.all(layers[cand] == layers[cand - 1], axis=1) & np.all(np.isfinite(layers[cand]), axis=1)
        lrep[cand] = same
    return lrep


def _settle_blanks(blanks: dict[str, np.ndarray], core: dict[str, tuple[np.ndarray, np.ndarray]],
                   skipped: np.ndarray, chosen: Mapping[str, str], counts: dict[str, int], notes: list[str]) -> None:
    """A blank on a step the log shows as skipped is "not logged" (Megatron prints no loss for
    skipped iterations), not a non-finite value: unknown again (in place)."""
    for label, blank in blanks.items():
        _, known = core[label]
        known[blank & skipped] = False
        k = int((blank & ~skipped).sum())
        if k:
            counts["blank_as_nonfinite"] += k
            notes.append(f"{k} blank {chosen[label]!r} value(s) in a column logged on every step were read as non-finite")


def _summary_notes(counts: dict[str, int], seg: _Segments) -> list[str]:
    notes = []
    if counts["overflow"]:
        notes.append(f"{counts['overflow']} loss-scale drop(s) (fp16 overflow)")
    if seg.resumes:
        notes.append(
            f"{len(seg.resumes)} resume(s): " + ", ".join(f"at {r.step} after {r.previous_step}" for r in seg.resumes[:5])
            + (" ..." if len(seg.resumes) > 5 else "")
        )
    if seg.gaps:
        notes.append(f"{len(seg.gaps)} gap(s) in the logged steps (stride {seg.stride}), largest "
                     f"{max(b - a for a, b in seg.gaps)} steps")
    return notes


def typical(values: np.ndarray, known: np.ndarray, skipped: np.ndarray | None = None) -> float | None:
    """Median of the known finite values (skipped rows excluded): a run's typical magnitude."""
    ok = known & np.isfinite(values)
    if skipped is not None:
        ok &= ~skipped
    if not ok.any():
        return None
    return float(np.median(values[ok]))


def segment_of(run: CleanRun, row: int) -> int:
    return int(np.searchsorted(run.segment_starts, row, side="right") - 1)


def segment_bounds(run: CleanRun, seg: int) -> tuple[int, int]:
    """[start, end) rows of segment ``seg``."""
    starts = run.segment_starts
    end = int(starts[seg + 1]) if seg + 1 < len(starts) else len(run)
    return int(starts[seg]), end
