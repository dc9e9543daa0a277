"""Text logs: Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | ...`` lines and llm.c's stdout or
``main.log``, recognised from their first lines (:func:`sniff_text`)."""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from earlywarn.analyze.rawrun import AnalyzeError, RawRun, columns_from_rows, finish_run, parse_number


_MEGATRON = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
# grep -n / grep over several files prefixes lines with "path:" or "path:lineno:"
_GREP_PREFIX = re.compile(r"^(?P<path>[^\s:\[\]|]*/[^\s:\[\]|]+|[^\s:\[\]|/]+\.[A-Za-z0-9]+):(?:\d+:)?")
_MEGATRON_KEYS = {
    "lmloss": "loss",
    "loss": "loss",
    "gradnorm": "grad_norm",
    "lossscale": "loss_scale",
    "learningrate": "lr",
    "numberofskippediterations": "skipped",
    "numberofnaniterations": "nan_iters",
    "paramsnorm": "param_norm",
    "numzeros": "num_zeros",
}

_LLMC_STDOUT = re.compile(
    r"^\s*step\s+(\d+)\s*/\s*(\d+)\s*[|:]\s*(?:train\s+)?loss\s+(\S+?)(?:\s*\([^)]*\))?\s*(?:\||$)"
)
_LLMC_NORM = re.compile(r"\|\s*norm\s+(\S+?)(?:\s*\([^)]*\))?\s*(?:\||$)")
_LLMC_LR = re.compile(r"\|\s*lr\s+(\S+?)\s*(?:\||$)")
_LLMC_FILE = re.compile(r"^\s*s:(\d+)\s+(trl|tel|eval):(\S+)(.*)$")
_LLMC_SKIP = re.compile(r"skipping update due to (loss|grad) z-score")


def sniff_text(path: str, max_bytes: int = 4 << 20) -> str | None:
    """'megatron', 'llmc' or None, from the first few MB of a text file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(max_bytes)
    except OSError as e:
        raise AnalyzeError(f"{path}: cannot read ({e.strerror})") from None
    if b"\x00" in head[:8192]:
        return None
    text = head.decode("utf-8", errors="replace")
    mega = llmc = 0
    for line in text.splitlines():
        if "iteration" in line and _MEGATRON.search(line) and "loss" in line:
            mega += 1
        elif _LLMC_STDOUT.match(line) or _LLMC_FILE.match(line):
            llmc += 1
        if mega + llmc >= 50:
            break
    if mega == 0 and llmc == 0:
        return None
    return "megatron" if mega >= llmc else "llmc"


def _num_or_nan(text: str) -> float | None:
    try:
        return parse_number(text)
    except ValueError:
        return None


def read_megatron(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | key: value | ...`` lines.

    Lines prefixed by grep (``file:`` or ``file:line:``) are split into one run per file. An
    iteration line without ``lm loss`` is Megatron's way of saying every iteration of the interval
    was skipped (it prints the loss only when some iteration advanced), so such rows are marked
    skipped rather than non-finite.
    """
    rows_by_run: dict[str, list[dict]] = {}
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = _MEGATRON.search(line)
            if not m or "|" not in line:
                continue
            pm = _GREP_PREFIX.match(line)
            run = pm.group("path") if pm else ""
            row: dict[str, Any] = {"step": int(m.group(1))}
            for part in line[m.end():].split("|"):
                if ":" not in part:
                    continue
                key, _, value = part.rpartition(":")
                canon = re.sub(r"\s+", "", key).lower()
                canon = re.sub(r"\(.*?\)", "", canon)
                name = _MEGATRON_KEYS.get(canon, key.strip())
                x = _num_or_nan(value)
                if x is not None:
                    row[name] = x
            if "loss" not in row:
                row["_no_loss"] = 1.0
            rows_by_run.setdefault(run, []).append(row)
    if not rows_by_run:
        raise AnalyzeError(f"{path}: no Megatron 'iteration N/ M | ...' lines found")
    runs = []
    for name, rows in rows_by_run.items():
        steps, cols, miss, notes = columns_from_rows(rows, "step")
        no_loss = cols.pop("_no_loss", None)
        miss.pop("_no_loss", None)
        if no_loss is not None:
            flagged = np.nan_to_num(no_loss) > 0
            sk = cols.setdefault("skipped", np.zeros(len(steps)))
            sm = miss.setdefault("skipped", np.ones(len(steps), dtype=bool))
            # all iterations of the interval skipped: at least one skip
            sk[flagged] = np.maximum(np.nan_to_num(sk[flagged]), 1.0)
            sm[flagged] = False
            notes.append(f"{int(flagged.sum())} iteration line(s) print no lm loss (every iteration skipped)")
        for col in ("loss", "grad_norm"):
            if col not in cols:
                cols[col] = np.full(len(steps), np.nan)
                miss[col] = np.ones(len(steps), dtype=bool)
        run = RawRun(path, name, "megatron", steps, cols, miss, notes=notes, tabular=False)
        runs.append(finish_run(run))
    return runs


def read_llmc(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """llm.c logs: stdout ``step N/M | (train )loss X | norm Y | lr Z | ...`` (steps as printed)
    or the ``main.log`` it writes with ``-o`` (``s:N trl:X lr:Z norm:Y``, ``s:N tel:V``)."""
    rows: list[dict] = []
    pending_skip = False
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = _LLMC_STDOUT.match(line)
            if m:
                row: dict[str, Any] = {"step": int(m.group(1)), "loss": _num_or_nan(m.group(3))}
                nm = _LLMC_NORM.search(line)
                if nm:
                    row["grad_norm"] = _num_or_nan(nm.group(1))
                lm = _LLMC_LR.search(line)
                if lm:
                    row["lr"] = _num_or_nan(lm.group(1))
                if pending_skip:
                    row["skipped"] = 1.0
                    pending_skip = False
                rows.append(row)
                continue
            f = _LLMC_FILE.match(line)
            if f:
                s, kind, val = int(f.group(1)), f.group(2), f.group(3)
                if kind == "trl":
                    row = {"step": s, "loss": _num_or_nan(val)}
                    for part in f.group(4).split():
                        k, _, v = part.partition(":")
                        if k == "norm":
                            row["grad_norm"] = _num_or_nan(v)
                        elif k == "lr":
                            row["lr"] = _num_or_nan(v)
                    rows.append(row)
                elif kind == "tel":
                    rows.append({"step": s, "val_loss": _num_or_nan(val)})
                continue
            if _LLMC_SKIP.search(line):
                pending_skip = True
    if not rows:
        raise AnalyzeError(f"{path}: no llm.c 'step N/M | train loss ... | norm ...' lines found")
    steps, cols, miss, notes = columns_from_rows(rows, "step")
    return [finish_run(RawRun(path, "", "llmc", steps, cols, miss, notes=notes, tabular=False))]
