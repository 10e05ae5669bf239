"""Tiny real models and data for tests: built from configs, offline, a few steps on the CPU."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification, TrainingArguments

VOCAB_SIZE = 64
SEQUENCE_LENGTH = 8


def tiny_classifier(seed: int = 0) -> DistilBertForSequenceClassification:
    """A 2-label DistilBERT small enough to train in milliseconds."""
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=VOCAB_SIZE, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
        max_position_embeddings=SEQUENCE_LENGTH, num_labels=2,
    )
    return DistilBertForSequenceClassification(config)


class TinyDataset(torch.utils.data.Dataset):
    """Label = whether token 1 appears in the first half: learnable, deterministic."""

    def __init__(self, size: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(2, VOCAB_SIZE, (size, SEQUENCE_LENGTH), generator=generator)
        self.labels = torch.randint(0, 2, (size,), generator=generator)
        self.input_ids[self.labels == 1, 0] = 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def accuracy_and_f1(eval_prediction: Any) -> Dict[str, float]:
    predictions = np.argmax(eval_prediction.predictions, axis=-1)
    labels = eval_prediction.label_ids
    true_positive = int(((predictions == 1) & (labels == 1)).sum())
    predicted = int((predictions == 1).sum())
    actual = int((labels == 1).sum())
    f1 = 2 * true_positive / (predicted + actual) if predicted + actual else 0.0
    return {"accuracy": float((predictions == labels).mean()), "f1": f1}


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    settings: Dict[str, Any] = dict(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        max_steps=4, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def entries_with(log_history: List[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    return [entry for entry in log_history if key in entry]
