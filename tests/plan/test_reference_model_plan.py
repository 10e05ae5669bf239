"""The plan's reference model (`reference_model=True`, `--reference-model`): a frozen copy of the
parameters, laid out as the parameters are, in the model states; none with LoRA adapters."""

from __future__ import annotations

import json
import os

import pytest
from torch import nn

from trainer_memcb.cli import main
from trainer_memcb.plan.answers.model_states import PEFT_REFERENCE_NOTE, plan_model_states
from trainer_memcb.plan.settings.setup import Setup

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")
LLAMA_PARAMS = 6_738_415_616


def two_layers() -> nn.Module:
    # Weights 7x4 and 3x7, biases 7 and 3: 28 + 7 + 21 + 3 = 59 values in 4 tensors.
    return nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))


def test_without_the_option_there_is_no_reference_model():
    plan = plan_model_states(two_layers(), "adamw")
    assert plan.reference_model is False and plan.optimizers[0].reference_model_bytes == 0
    assert plan.optimizers[0].model_states_bytes == 236 + 236 + 488


def test_one_process_a_whole_frozen_copy_in_the_model_states():
    plan = plan_model_states(two_layers(), "adamw", reference_model=True)
    (entry,) = plan.optimizers
    assert plan.reference_model is True and plan.reference_model_note is None
    assert entry.reference_model_bytes == 59 * 4
    # No gradients and no optimizer state for it: only its parameters join the sum.
    assert (entry.params_bytes, entry.grads_bytes, entry.optimizer_state_bytes) == (236, 236, 488)
    assert entry.model_states_bytes == entry.device_bytes == 236 + 236 + 488 + 236


@pytest.mark.parametrize("sharding, values", [
    ("ddp", 59),  # whole on every process
    ("zero1", 59),  # TRL prepares the reference as a stage-0 model under ZeRO-1/2: whole
    ("zero2", 59),
    ("zero3", 7 + 2 + 6 + 1),  # ceil(numel / 4) of 28, 7, 21, 3
    ("fsdp-full-shard", 2 * 4 + 2 + 1 * 7 + 1),  # ceil(rows / 4) rows of 7x4, 7, 3x7, 3
])
def test_the_reference_is_laid_out_as_the_parameters(sharding, values):
    (entry,) = plan_model_states(two_layers(), "adamw", Setup(world_size=4, sharding=sharding),
                                 reference_model=True).optimizers
    assert entry.reference_model_bytes == 4 * values


def test_in_the_policys_precision_and_offloaded_with_the_parameters():
    setup = Setup(world_size=2, sharding="zero3", precision="deepspeed-bf16", offload_params=True)
    (entry,) = plan_model_states(two_layers(), "adamw", setup, reference_model=True).optimizers
    assert entry.reference_model_bytes == 2 * (14 + 4 + 11 + 2)  # bf16, ceil(numel / 2) of each
    assert entry.cpu_bytes == entry.params_bytes + entry.reference_model_bytes


def test_a_raw_parameter_count():
    (entry,) = plan_model_states(1_000, "adamw", reference_model=True).optimizers
    assert entry.reference_model_bytes == 4_000 and entry.model_states_bytes == 4_000 * 2 + 8_004 + 4_000


def test_cli_reference_model_for_llama_2_7b(capsys):
    assert main(["estimate", LLAMA, "--reference-model", "--optimizers", "adamw", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (entry,) = plan["optimizers"]
    assert plan["reference_model"] is True and plan["reference_model_note"] is None
    assert entry["reference_model_bytes"] == entry["params_bytes"] == 4 * LLAMA_PARAMS
    assert entry["model_states_bytes"] == 3 * 4 * LLAMA_PARAMS + entry["optimizer_state_bytes"]
    assert main(["estimate", LLAMA, "--reference-model", "--optimizers", "adamw"]) == 0
    text = capsys.readouterr().out
    assert "reference model (frozen copy)" in text and "model states include the reference model" in text


def test_cli_reference_model_with_lora_is_none(capsys):
    pytest.importorskip("peft", reason="LoRA adapters need peft")
    assert main(["estimate", LLAMA, "--reference-model", "--lora-r", "16", "--optimizers", "adamw", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (entry,) = plan["optimizers"]
    assert plan["reference_model_note"] == PEFT_REFERENCE_NOTE
    assert entry["reference_model_bytes"] == 0
    assert entry["model_states_bytes"] == entry["params_bytes"] + entry["grads_bytes"] + entry["optimizer_state_bytes"]
