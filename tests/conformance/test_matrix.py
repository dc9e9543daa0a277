"""earlywarn's one line inside real third-party training code, against every fault.

Each cell trains a codebase (see codebases.py) with one fault (harness.py) under
``earlywarn.watch`` defaults, and checks the invariants of ``harness.check_invariants``: no
exception escapes, parameters / optimizer state / buffers finite at the end, no CRITICAL on a
healthy run, a bad batch costs exactly one skip and the skipped step is a bit-exact no-op, a huge
finite gradient is not "non-finite", poisoned state is repaired or rewound, counters match events.
"""

from __future__ import annotations

import pytest
import torch

import codebases as cb
from harness import FAULTS, Fault, check_invariants, quiet_options

torch.set_num_threads(1)

MODEL_LOOPS = {
    "hf_gpt2_loop": lambda fault, opts, tmp: cb.hf_loop("gpt2", fault, opts),
    "hf_llama_loop": lambda fault, opts, tmp: cb.hf_loop("llama", fault, opts),
    "torchvision_resnet18": lambda fault, opts, tmp: cb.resnet18(fault, opts),
    "nanogpt_float16": lambda fault, opts, tmp: cb.nanogpt(fault, opts, dtype="float16"),
    "nanogpt_bfloat16": lambda fault, opts, tmp: cb.nanogpt(fault, opts, dtype="bfloat16"),
}
FRAMEWORKS = {
    "hf_trainer": lambda fault, opts, tmp: cb.hf_trainer(fault, opts, tmp),
    "lightning_encoder": lambda fault, opts, tmp: cb.lightning_encoder(fault, opts, tmp),
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("codebase", sorted(MODEL_LOOPS))
def test_model_loops(codebase, fault, cell, tmp_path):
    cell(codebase, fault)
    check_invariants(MODEL_LOOPS[codebase](Fault(fault), quiet_options(tmp_path), tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("codebase", sorted(FRAMEWORKS))
def test_frameworks(codebase, fault, cell, tmp_path):
    cell(codebase, fault)
    check_invariants(FRAMEWORKS[codebase](Fault(fault), quiet_options(tmp_path), tmp_path))


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("name", cb.OPTIMIZERS)
def test_every_torch_optimizer(name, fault, cell, tmp_path):
    cell(f"optim_{name}", fault)
    result = cb.optimizer_loop(name, Fault(fault), quiet_options(tmp_path))
    if fault == "poison_state" and not result.injector.fired and result.exception is None:
        # plain SGD keeps no state to poison
        assert not any(result.optimizer.state.get(p) for p in result.model.parameters()), "state existed but was not poisoned"
        pytest.skip(f"{name} keeps no per-parameter state")
    check_invariants(result)


def test_matrix_covers_every_torch_optimizer():
    classes = {n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
               and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    covered = {n.split("_")[0] for n in cb.OPTIMIZERS} | set(cb.REFUSED)
    assert classes <= covered, f"torch.optim has optimizers the conformance matrix does not train: {sorted(classes - covered)}"
