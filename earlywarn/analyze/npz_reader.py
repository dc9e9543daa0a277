"""``.npz`` logs: one array per key, or a (steps x layers) ``layer_norms`` matrix with its names."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from earlywarn.analyze.rawrun import AnalyzeError, RawRun, bad_steps, pick_step_key, split_by_run, step_problem


def read_npz(path: str, key_map: Mapping[str, str] | None = None) -> list[RawRun]:
    """``.npz`` with one array per key (``step``, ``loss``, ``grad_norm``, ``grad_norm/<layer>``), or
    ``layer_norms`` (steps x layers) with ``layer_names``."""
    key_map = key_map or {}
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # zipfile/pickle errors vary by numpy version
        raise AnalyzeError(f"{path}: not a readable .npz file ({type(e).__name__})") from None
    def array(k: str) -> np.ndarray:
        try:
            return np.asarray(z[k])
        except ValueError as e:  # numpy refuses object arrays without allow_pickle
            if "allow_pickle" not in str(e):
                raise AnalyzeError(f"{path}: array {k!r} cannot be read ({' '.join(str(e).split())[:200]})") from None
            raise AnalyzeError(f"{path}: array {k!r} holds Python objects (dtype=object), which earlywarn does "
                               "not unpickle (loading a pickle can run code); save it as numbers, e.g. "
                               f"np.savez(..., {k}=np.asarray(values, dtype=np.{'int64' if k == step_key else 'float64'}))"
                               ) from None

    with z:
        keys = list(z.files)
        step_key = pick_step_key(keys, key_map, path)
        steps = array(step_key)
        if steps.ndim != 1 or steps.size == 0:
            raise AnalyzeError(f"{path}: {step_key!r} must be a non-empty 1-D array (empty run?)")
        if steps.dtype.kind not in "fiu":
            raise AnalyzeError(f"{path}: {step_key!r} holds {steps.dtype} values, not numbers; save the steps as "
                               f"integers, e.g. np.savez(..., {step_key}=np.arange(n))")
        n = steps.shape[0]
        cols: dict[str, np.ndarray] = {}
        prefix = key_map.get("layer_prefix", "grad_norm/")
        for k in keys:
            if k in (step_key, "layer_norms", "layer_names"):
                continue
            a = array(k)
            if a.ndim == 1 and a.shape[0] == n and a.dtype.kind in "fiub":
                cols[k] = a.astype(np.float64)
        if "layer_norms" in keys:
            ln = array("layer_norms")
            if ln.dtype.kind not in "fiub":
                raise AnalyzeError(f"{path}: 'layer_norms' holds {ln.dtype} values, not numbers")
            ln = ln.astype(np.float64)
            names = [str(x) for x in array("layer_names")] if "layer_names" in keys else [f"layer{i}" for i in range(ln.shape[1])]
            if ln.ndim != 2 or ln.shape[0] != n or ln.shape[1] != len(names):
                raise AnalyzeError(f"{path}: layer_norms must be (steps x layers) matching step and layer_names")
            for j, name in enumerate(names):
                cols[prefix + name] = ln[:, j]
    if not np.all(np.isfinite(steps)):
        raise AnalyzeError(f"{path}: {step_key!r} holds non-finite values")
    if steps.dtype.kind == "f" or (steps.dtype.kind == "u" and steps.dtype.itemsize == 8):
        bad = bad_steps(steps.astype(np.float64))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise AnalyzeError(f"{path}: {step_key}[{i}] = {steps[i].item()!r} {step_problem(float(steps[i]))}; "
                               "save the steps as int64")
    miss = {k: np.zeros(n, dtype=bool) for k in cols}  # NaN in an array is a logged NaN
    return split_by_run(path, "npz", steps.astype(np.int64), cols, miss, None, [])
