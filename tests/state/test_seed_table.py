"""The acceptance table: distilbert-base-cased fine-tuned for 2 labels with AdamW holds 65,783,042
trainable parameters in 104 tensors, and its AdamW state holds 526,264,752 bytes (502 MiB):
two fp32 moments per parameter value and a 4-byte `step` per tensor. Measured through a real
Trainer on the full-size architecture, built offline from the shipped config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, Trainer

from helpers import TinyDataset, entries_with, installed_version, training_args
from trainer_memcb import OptimizerMemoryCallback, estimate_optimizer_state, measure_optimizer_state
from trainer_memcb.training.figures import ESTIMATE_BYTES, MEASURED_BYTES, MEASURED_ELEMENTS, TRAINABLE_PARAMS
from trainer_memcb.training.summary import SUMMARY_FILE_NAME
from trainer_memcb.utils.units import MiB

CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "models" / "distilbert-base-cased"

TRAINABLE_PARAMS_COUNT = 65_783_042
PARAM_TENSORS = 104
STATE_ELEMENTS = 2 * TRAINABLE_PARAMS_COUNT + PARAM_TENSORS  # exp_avg + exp_avg_sq + one step each
STATE_BYTES = 4 * STATE_ELEMENTS  # everything fp32
EXPECTED_FIGURES = {
    MEASURED_BYTES: STATE_BYTES,
    ESTIMATE_BYTES: STATE_BYTES,
    MEASURED_ELEMENTS: STATE_ELEMENTS,
    TRAINABLE_PARAMS: TRAINABLE_PARAMS_COUNT,
}


def test_table_arithmetic() -> None:
    assert STATE_ELEMENTS == 131_566_188
    assert STATE_BYTES == 526_264_752
    assert round(STATE_BYTES / MiB) == 502


@pytest.fixture(scope="module")
def config() -> Any:
    return AutoConfig.from_pretrained(str(CONFIG_DIR), num_labels=2)


def distilbert(config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def train_with_callback(model: torch.nn.Module, output_dir: str, max_steps: int, **trainer_kwargs: Any) -> Trainer:
    args = training_args(output_dir, per_device_train_batch_size=2, max_steps=max_steps)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TinyDataset(size=2 * max_steps),  # batches of 2 x 8 tokens
        callbacks=[OptimizerMemoryCallback()],
        **trainer_kwargs,
    )
    trainer.train()
    return trainer


def read_summary(output_dir: str) -> Dict[str, Any]:
    with open(os.path.join(output_dir, SUMMARY_FILE_NAME), encoding="utf-8") as handle:
        return json.load(handle)


def assert_logged_and_summarised(trainer: Trainer, output_dir: str, steps: int) -> None:
    logged = entries_with(trainer.state.log_history, MEASURED_BYTES)
    assert [entry["step"] for entry in logged] == list(range(1, steps + 1))
    for entry in logged:
        assert {key: entry[key] for key in EXPECTED_FIGURES} == EXPECTED_FIGURES
        assert "loss" in entry  # the figures ride in the Trainer's own training entries

    summary = read_summary(output_dir)
    assert summary["global_step"] == steps
    assert summary["optimizer_class"] == "AdamW"
    assert summary["measured"]["num_bytes"] == STATE_BYTES
    assert summary["measured"]["num_elements"] == STATE_ELEMENTS
    assert summary["measured"]["num_params_with_state"] == PARAM_TENSORS
    assert summary["estimate"]["num_bytes"] == STATE_BYTES
    assert summary["estimate"]["num_params"] == TRAINABLE_PARAMS_COUNT
    assert summary["estimate"]["num_param_tensors"] == PARAM_TENSORS
    assert summary["measured_minus_estimate_bytes"] == 0


def test_distilbert_adamw_table(config: Any, tmp_path: Path) -> None:
    model = distilbert(config)
    trainable = [param for param in model.parameters() if param.requires_grad]
    assert sum(param.numel() for param in trainable) == TRAINABLE_PARAMS_COUNT
    assert len(trainable) == PARAM_TENSORS
    optimizer = torch.optim.AdamW(model.parameters())

    estimate = estimate_optimizer_state(optimizer)  # before any step: from shapes alone
    assert estimate.num_params == TRAINABLE_PARAMS_COUNT
    assert estimate.num_param_tensors == PARAM_TENSORS
    assert estimate.num_bytes == STATE_BYTES
    assert round(estimate.num_bytes / MiB) == 502
    assert measure_optimizer_state(optimizer).is_empty

    output_dir = str(tmp_path)
    trainer = train_with_callback(model, output_dir, max_steps=1, optimizers=(optimizer, None))

    measured = measure_optimizer_state(trainer.optimizer)
    assert measured.num_elements == STATE_ELEMENTS
    assert measured.num_bytes == STATE_BYTES
    assert measured.bytes_by_key == {
        "step": 4 * PARAM_TENSORS,
        "exp_avg": 4 * TRAINABLE_PARAMS_COUNT,
        "exp_avg_sq": 4 * TRAINABLE_PARAMS_COUNT,
    }
    assert measured.num_params_with_state == PARAM_TENSORS
    assert_logged_and_summarised(trainer, output_dir, steps=1)


def test_trainer_default_optimizer_same_table(config: Any, tmp_path: Path) -> None:
    output_dir = str(tmp_path)
    trainer = train_with_callback(distilbert(config), output_dir, max_steps=1)

    # transformers' default is the fused AdamW from torch 2.8 on, the plain one before (its
    # training_args.py, `default_optim`); the state is the same.
    fused = installed_version("torch") >= (2, 8)
    assert trainer.args.optim == ("adamw_torch_fused" if fused else "adamw_torch")
    inner = trainer.optimizer.optimizer
    assert type(inner) is torch.optim.AdamW and bool(inner.defaults["fused"]) is fused
    assert len(inner.param_groups) == 2  # weight decay and no weight decay
    measured = measure_optimizer_state(trainer.optimizer)
    assert measured.num_bytes == STATE_BYTES
    assert measured.num_elements == STATE_ELEMENTS
    assert estimate_optimizer_state(trainer.optimizer).num_bytes == STATE_BYTES
    assert_logged_and_summarised(trainer, output_dir, steps=1)
