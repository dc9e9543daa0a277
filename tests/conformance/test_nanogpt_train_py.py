"""nanoGPT's own ``train.py`` (vendored unchanged, see vendor/nanogpt/README.md) with the docs'
earlywarn lines added, run as a user runs it: a subprocess, its configurator's ``--key=value``
overrides, default earlywarn options and default sinks (console + JSONL + embedded MLflow).

The faults are put in by text substitution at the places a real fault would strike: an inf or a
1e20 in one gradient coordinate after the micro-batches' backward, a NaN sample at the token
embedding's output (its micro-batch loss and gradients are NaN), NaN in Adam's ``exp_avg_sq``
before the step (the update poisons the weights)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

VENDOR = Path(__file__).parent / "vendor" / "nanogpt"
FAULT_AT = 30
MAX_ITERS = 60

# What docs/loops.md tells a nanoGPT user to add (after the optimizer is made; top of the loop).
EARLYWARN_LINES = {
    "optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)\n":
        "import earlywarn\n"
        "ew = earlywarn.watch(model, optimizer, scaler=scaler)   # after the optimizer is made\n",
    "while True:\n":
        "    iter_num = ew.step                                   # top of the loop: get_lr(iter_num) follows a rewind\n",
}

# The test's own additions, (anchor, code, "before" or "after" it): fault injection, a bit-exactness
# probe around the skipped step, a result file.
FAULT_CODE = [
    ("raw_model = model.module if ddp else model # unwrap DDP container if needed\n", """import json as _json, os as _os
_FAULT, _AT = _os.environ["EW_FAULT"], int(_os.environ["EW_FAULT_AT"])
_fired = {"done": False, "same": None}
def _nan_sample(module, args, out):
    if _FAULT == "nan_sample" and iter_num == _AT and not _fired["done"] and torch.is_grad_enabled():
        _fired["done"] = True
        out = out.clone(); out[0] = float("nan")
        return out
raw_model.transformer.wte.register_forward_hook(_nan_sample)
def _digest():
    ts = [p.detach().flatten() for p in raw_model.parameters()]
    ts += [t.detach().flatten().float() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return torch.cat(ts).clone()
""", "after"),
    ("    # clip the gradient\n", """    if iter_num == _AT and not _fired["done"] and _FAULT in ("inf_grad", "huge_grad", "poison_state"):
        _fired["done"] = True
        if _FAULT == "poison_state":
            next(iter(optimizer.state.values()))["exp_avg_sq"].view(-1)[0] = float("nan")
        else:
            raw_model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = float("inf") if _FAULT == "inf_grad" else 1e20
    _probe = _fired["done"] and _fired["same"] is None and _FAULT != "poison_state"
    if _probe:
        _before = _digest()
""", "before"),
    ("    scaler.update()\n", """    if _probe:
        _fired["same"] = bool(torch.equal(_before, _digest()))
""", "after"),
    ("if ddp:\n    destroy_process_group()\n", """finite = all(bool(torch.isfinite(p).all()) for p in raw_model.parameters()) and all(
    bool(torch.isfinite(t).all()) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.is_floating_point())
_json.dump({"counters": dict(ew.counters), "step": ew.step, "finite": finite, "fired": _fired["done"],
            "skipped_step_unchanged": _fired["same"],
            "events": [[e.step, e.kind.value, e.level.name, e.message] for e in ew.events]},
           open("earlywarn_result.json", "w"))
ew.close()
""", "before"),
]


def _patched_train_py() -> str:
    src = (VENDOR / "train.py").read_text()
    edits = [(a, code, "after") for a, code in EARLYWARN_LINES.items()] + FAULT_CODE
    for anchor, code, where in edits:
        assert src.count(anchor) == 1, f"nanoGPT's train.py has {src.count(anchor)} of {anchor!r} (want 1): re-anchor"
        src = src.replace(anchor, anchor + code if where == "after" else code + anchor)
    return src


def _write_data(root: Path) -> None:
    # nanoGPT's shakespeare_char layout (uint16 token files + meta.pkl), from the standard library's source
    stdlib = Path(os.__file__).parent
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:25])
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    d = root / "data" / "shakespeare_char"
    d.mkdir(parents=True)
    ids[:n].tofile(d / "train.bin")
    ids[n:].tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)


def run_train_py(tmp_path: Path, fault: str) -> dict:
    for name in ("model.py", "configurator.py"):
        shutil.copy(VENDOR / name, tmp_path / name)
    (tmp_path / "train.py").write_text(_patched_train_py())
    _write_data(tmp_path)
    args = ["--device=cpu", "--compile=False", "--dtype=float32", "--dataset=shakespeare_char",
            "--batch_size=8", "--block_size=64", "--n_layer=2", "--n_head=4", "--n_embd=64",
            f"--max_iters={MAX_ITERS}", f"--lr_decay_iters={MAX_ITERS}", "--warmup_iters=10",
            "--eval_interval=1000", "--eval_iters=2", "--log_interval=10", "--gradient_accumulation_steps=2",
            "--always_save_checkpoint=False", "--out_dir=out"]
    env = {**os.environ, "EW_FAULT": fault, "EW_FAULT_AT": str(FAULT_AT), "OMP_NUM_THREADS": "1",
           "EARLYWARN_OUTPUT_DIR": str(tmp_path / "earlywarn_output")}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, f"train.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "earlywarn_result.json").read_text())
    result["stderr"] = proc.stderr
    return result


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["none", "inf_grad", "nan_sample", "poison_state", "huge_grad"])
def test_nanogpt_train_py(fault, tmp_path, cell):
    cell("nanogpt_train_py", fault)
    r = run_train_py(tmp_path, fault)
    c = r["counters"]
    events = r["events"]
    critical = [e for e in events if e[2] == "CRITICAL"]
    assert r["finite"], "parameters or optimizer state non-finite at the end"
    assert r["step"] >= MAX_ITERS
    assert "Halt" not in r["stderr"] and "Traceback" not in r["stderr"], r["stderr"][-2000:]
    if fault == "none":
        assert critical == [] and c["rewinds"] == 0 and c["skipped_steps"] == 0, events
        assert (tmp_path / "earlywarn_output" / "mlflow.db").exists()  # the default sinks, inside nanoGPT
        return
    assert r["fired"], "the fault was never injected"
    if fault == "poison_state":
        # the state is checked before every update: repaired before the update that would read it
        repairs = [e for e in events if e[1] == "repair"]
        assert c["rewinds"] == 0 and c["skipped_steps"] == 0 and c["repaired_steps"] == 1, (c, events)
        assert [e[0] for e in repairs] == [FAULT_AT] and "exp_avg_sq" in repairs[0][3], repairs
        return
    if fault == "huge_grad":
        # train.py clips (grad_clip=1.0) before optimizer.step. A 1e20 coordinate overflows the
        # clip's own float32 norm (inf), so torch scales every gradient by 0: the step earlywarn
        # sees is an all-zero, finite one (applied as the loop made it). A spike the clip can
        # measure is seen as it was, before the clip (tests/test_clipping.py).
        assert c["nonfinite_steps"] == 0 and c["rewinds"] == 0, (c, events)
        assert not critical, critical
        return
    # a bad batch (an inf gradient, a NaN sample): one skip, nothing rewound, the skipped step a
    # bit-exact no-op on parameters and optimizer state
    assert c["skipped_steps"] == 1 and c["rewinds"] == 0 and c["nonfinite_steps"] == 1, (c, events)
    assert r["skipped_step_unchanged"] is True
    skips = [e for e in events if e[1] == "skip"]
    assert [e[0] for e in skips] == [FAULT_AT], skips
