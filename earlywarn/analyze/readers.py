"""Readers: turn a logged run (a file, a directory, a tracker address) into columns of numbers.

Every reader returns :class:`~earlywarn.analyze.rawrun.RawRun` objects: the run's steps *in the
order they were logged* (a resume shows up as a step that goes back) and one float column per
logged key, with a mask of the rows where the key was absent, ``null`` or an empty cell. Deciding
what those gaps mean (not logged, non-finite, stale, "not computed") is
:mod:`earlywarn.analyze.hygiene`'s job.

This module recognises a source by its form and hands it to its reader: :mod:`.csv_reader`,
:mod:`.json_reader` (JSONL, earlywarn's own log, JSON rows, HF ``trainer_state.json``),
:mod:`.npz_reader`, :mod:`.text_logs` (Megatron, llm.c). Pure numpy. Tracker and TensorBoard
sources live in ``earlywarn.integrations`` (``mlflow_source``, ``wandb_source``,
``tensorboard_source``) and are imported only when a source needs them.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Mapping

from earlywarn.analyze.csv_reader import numeric_csv_columns, read_csv
from earlywarn.analyze.json_reader import is_earlywarn_jsonl, read_earlywarn_rows, read_hf_state, read_json, read_jsonl
from earlywarn.analyze.npz_reader import read_npz
from earlywarn.analyze.rawrun import (
    AnalyzeError, RawRun, bad_steps, columns_from_rows, merge_adjacent_same_step, parse_number, rows_to_runs,
    step_problem,
)
from earlywarn.analyze.text_logs import read_llmc, read_megatron, sniff_text

__all__ = [  # the readers, and what they share (kept importable from here)
    "SOURCE_FORMS", "AnalyzeError", "RawRun", "bad_steps", "columns_from_rows", "is_earlywarn_jsonl",
    "merge_adjacent_same_step", "numeric_csv_columns", "parse_number", "read_csv", "read_earlywarn_rows",
    "read_hf_state", "read_json", "read_jsonl", "read_llmc", "read_megatron", "read_npz", "read_source",
    "rows_to_runs", "sniff_text", "step_problem",
]


SOURCE_FORMS = """\
  mlflow:<tracking_uri>#<run_id>           one MLflow run (e.g. mlflow:sqlite:///mlflow.db#3f2a...)
  mlflow:<tracking_uri>#experiment=<name>  every run of an MLflow experiment
  wandb:<entity>/<project>/<run_id>        a hosted W&B run (full history via scan_history)
  wandb:<entity>/<project>                 every run of a hosted W&B project
  <dir with a .wandb file>, <file>.wandb   an offline W&B run (wandb/offline-run-*/)
  <tfevents file or dir>                   TensorBoard event files (one run per directory)
  trainer_state.json, <checkpoint dir>     Hugging Face Trainer log_history
  *.csv, *.tsv                             a step column and metric columns
  *.jsonl, *.ndjson                        one JSON object per line, or earlywarn's own JSONL log
  *.npz                                    one array per key
  other text logs                          Megatron 'iteration N/ M | ... lm loss: ...' lines or
                                           llm.c 'step N/M | train loss ... | norm ...' lines"""


def _integration(module: str, what: str, extra: str):
    import importlib

    try:
        return importlib.import_module(f"earlywarn.integrations.{module}")
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing and not missing.startswith("earlywarn"):
            raise AnalyzeError(f"reading {what} needs the {missing!r} package: pip install 'earlywarn[{extra}]'") from None
        try:  # running from a source tree where integrations/ is not installed as earlywarn.integrations
            return importlib.import_module(f"integrations.{module}")
        except ImportError as e2:
            missing2 = getattr(e2, "name", None) or ""
            if missing2 and not missing2.startswith("integrations"):
                raise AnalyzeError(f"reading {what} needs the {missing2!r} package: pip install 'earlywarn[{extra}]'") from None
            raise AnalyzeError(f"reading {what} needs earlywarn.integrations.{module}, which is not installed") from None


def _find_files(root: str, pred: Callable[[str], bool], max_depth: int = 4) -> list[str]:
    found = []
    base_depth = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath.count(os.sep) - base_depth >= max_depth:
            dirnames[:] = []
        dirnames.sort()
        for f in sorted(filenames):
            if pred(f):
                found.append(os.path.join(dirpath, f))
    return found


def _hf_state_in(directory: str) -> str | None:
    direct = os.path.join(directory, "trainer_state.json")
    if os.path.isfile(direct):
        return direct
    best, best_step = None, -1
    for f in _find_files(directory, lambda n: n == "trainer_state.json", max_depth=2):
        m = re.search(r"checkpoint-(\d+)", f)
        s = int(m.group(1)) if m else 0
        if s > best_step:
            best, best_step = f, s
    return best


def read_source(spec: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """Recognise ``spec`` by its form and read it. Raises :class:`AnalyzeError` with one line."""
    key_map = dict(key_map or {})
    if not isinstance(spec, str) or not spec.strip():
        raise AnalyzeError(f"empty source {spec!r}")
    if spec.startswith("mlflow:"):
        return _integration("mlflow_source", "MLflow runs", "mlflow").read_mlflow(spec, key_map=key_map)
    if spec.startswith("wandb:"):
        return _integration("wandb_source", "W&B runs", "wandb").read_wandb_api(spec, key_map=key_map)
    path = spec
    if not os.path.exists(path):
        raise AnalyzeError(f"{path}: no such file or directory (sources: a file, a directory, mlflow:..., wandb:...)")
    if os.path.isdir(path):
        wandb_files = _find_files(path, lambda n: n.endswith(".wandb"), max_depth=3)
        if wandb_files:
            return _integration("wandb_source", "offline W&B runs", "wandb").read_wandb_offline(path, key_map=key_map)
        tf = _find_files(path, lambda n: "tfevents" in n, max_depth=4)
        if tf:
            return _integration("tensorboard_source", "TensorBoard event files", "tensorboard").read_tensorboard(
                path, key_map=key_map
            )
        hf = _hf_state_in(path)
        if hf:
            return read_json(hf, key_map)
        raise AnalyzeError(
            f"{path}: unknown format: a directory without a .wandb file, TensorBoard event files or trainer_state.json"
        )
    name = os.path.basename(path).lower()
    if "tfevents" in name:
        return _integration("tensorboard_source", "TensorBoard event files", "tensorboard").read_tensorboard(
            path, key_map=key_map
        )
    if name.endswith(".wandb"):
        return _integration("wandb_source", "offline W&B runs", "wandb").read_wandb_offline(path, key_map=key_map)
    if os.path.getsize(path) == 0:
        raise AnalyzeError(f"{path}: empty file")
    if name.endswith((".csv", ".tsv")):
        return read_csv(path, key_map)
    if name.endswith((".jsonl", ".ndjson")):
        return read_jsonl(path, key_map)
    if name.endswith(".json"):
        return read_json(path, key_map)
    if name.endswith(".npz"):
        return read_npz(path, key_map)
    kind = sniff_text(path)
    if kind == "megatron":
        return read_megatron(path, key_map)
    if kind == "llmc":
        return read_llmc(path, key_map)
    raise AnalyzeError(
        f"{path}: unknown format: not .csv/.jsonl/.json/.npz/tfevents/.wandb, and no Megatron "
        "'iteration N/ M | ...' or llm.c 'step N/M | ...' lines found"
    )
