"""The conformance matrix grown by the ecosystems of issue 22 (rows: ecosystem.py), against every
fault, with the same invariants (harness.check_invariants).

Cells that run a whole trainer (the HF Trainer, trl's SFTTrainer) or build a heavier model are
marked slow; every cell still runs in CI.
"""

from __future__ import annotations

import pytest
import torch

import ecosystem as eco
import stacks
from harness import FAULTS, Fault, check_invariants, quiet_options

torch.set_num_threads(1)

LOOPS = {
    "peft_lora_loop": lambda fault, opts, tmp: eco.peft_lora_loop(fault, opts),
    "timm_vit_lamb": lambda fault, opts, tmp: eco.timm_vit("lamb", fault, opts),
    "timm_vit_adamp": lambda fault, opts, tmp: eco.timm_vit("adamp", fault, opts),
    "timm_vit_lion": lambda fault, opts, tmp: eco.timm_vit("lion", fault, opts),
    "gan_two_watchers": lambda fault, opts, tmp: eco.gan_two_watchers(fault, opts),
    **{name: (lambda n: lambda fault, opts, tmp: eco.optimizer_lib(n, fault, opts))(name) for name in eco.OPTIMIZER_LIBS},
    **{name: (lambda n: lambda fault, opts, tmp: eco.torch_feature(n, fault, opts))(name)
       for name in eco.TORCH_FEATURES if name != "torch_compile"},
}
SLOW = {
    "peft_lora_hf_trainer": lambda fault, opts, tmp: eco.peft_lora_hf_trainer(fault, opts, tmp),
    "trl_sft": lambda fault, opts, tmp: eco.trl_sft(fault, opts, tmp),
    "diffusers_unet_ema": lambda fault, opts, tmp: eco.diffusers_unet_ema(fault, opts),
    "litgpt_fabric": lambda fault, opts, tmp: eco.litgpt_fabric(fault, opts),
    "torch_compile": lambda fault, opts, tmp: eco.torch_feature("torch_compile", fault, opts),  # dynamo tracing
}
# issue 46: what a new user brings (stacks.py); the low-bit optimizers' poisoned state is repaired in place
STACKS = {
    **{name: (lambda n: lambda fault, opts, tmp: stacks.low_bit(n, fault, opts))(name) for name in stacks.LOW_BIT},
    "mixtral_lm": lambda fault, opts, tmp: stacks.hf_lm("mixtral", fault, opts),
    "mamba_lm": lambda fault, opts, tmp: stacks.hf_lm("mamba", fault, opts),
    "accelerate_accumulation": lambda fault, opts, tmp: stacks.accelerate_accumulation(fault, opts),
    "bf16_autocast": lambda fault, opts, tmp: stacks.bf16("bf16_autocast", fault, opts),
    "bf16_weights": lambda fault, opts, tmp: stacks.bf16("bf16_weights", fault, opts),
    "sparse_adam": lambda fault, opts, tmp: stacks.sparse_adam(fault, opts),
    "compile_checkpoint_tied": lambda fault, opts, tmp: stacks.compiled_checkpointed_tied(fault, opts),
}
PACKAGES = {"peft": "peft", "timm": "timm", "trl": "trl", "diffusers": "diffusers", "litgpt": "litgpt",
            "heavyball": "heavyball", "schedulefree": "schedulefree", "lion": "lion_pytorch", "torchao": "torchao",
            "bnb": "bitsandbytes", "adafactor": "transformers", "mixtral": "transformers", "mamba": "transformers",
            "accelerate": "accelerate"}


def _needs(codebase: str) -> None:
    for prefix, module in PACKAGES.items():
        if codebase.startswith(prefix) or (prefix == "timm" and codebase.startswith("timm")):
            pytest.importorskip(module, reason=f"{module} is not installed (scripts/setup.sh installs it)")
    if codebase.startswith("peft_lora_hf"):
        pytest.importorskip("transformers")


try:
    TIMM_OPTIMIZERS = eco.timm_optimizers()
except ImportError:  # timm not installed: one cell that says so
    TIMM_OPTIMIZERS = ["timm_not_installed"]


def _run(table, codebase, fault, cell, tmp_path):
    cell(codebase, fault)
    _needs(codebase)
    result = table[codebase](Fault(fault), quiet_options(tmp_path), tmp_path)
    check_invariants(result)
    return result


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("codebase", sorted(LOOPS))
def test_ecosystem_loops(codebase, fault, cell, tmp_path):
    _run(LOOPS, codebase, fault, cell, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("codebase", sorted(SLOW))
def test_ecosystem_frameworks(codebase, fault, cell, tmp_path):
    _run(SLOW, codebase, fault, cell, tmp_path)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("codebase", sorted(STACKS))
def test_new_user_stacks(codebase, fault, cell, tmp_path):
    result = _run(STACKS, codebase, fault, cell, tmp_path)
    if fault == "poison_state" and codebase in stacks.LOW_BIT:
        # the quantized or factored moment (torchao's block scale, bitsandbytes' absmax1) repaired in place
        c = result.counters
        assert c["repaired_steps"] == 1 and c["rewinds"] == 0 and c["skipped_steps"] == 0, c


# Every optimizer timm's factory makes, beyond the three rows above: a run that would have trained
# fine is left alone, and a poisoned moment of whatever kind each keeps (factored second moments,
# Kron's preconditioners, Muon's momentum, MADGRAD's dual averages...) is repaired, not rewound.
# (All five faults pass on every one of them; these two are the ones the optimizer's own state decides.)
@pytest.mark.parametrize("fault", ["none", "poison_state"])
@pytest.mark.parametrize("opt_name", TIMM_OPTIMIZERS)
def test_every_timm_optimizer(opt_name, fault, tmp_path, monkeypatch):
    pytest.importorskip("timm", reason="timm is not installed (scripts/setup.sh installs it)")
    monkeypatch.chdir(tmp_path)
    result = eco.timm_vit(opt_name, Fault(fault), quiet_options(tmp_path))
    check_invariants(result)
    if fault == "poison_state":  # repaired in place, progress kept: no rewind
        assert result.counters["repaired_steps"] == 1 and result.counters["rewinds"] == 0, result.counters
