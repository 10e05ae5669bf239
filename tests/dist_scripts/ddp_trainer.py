"""Trainers with DDP on the CPU (gloo), the callback attached, 3 logged steps and an evaluation.

Usage: torchrun --nproc_per_node 2 ddp_trainer.py OUT_DIR

Two runs, one after the other in the same processes (one launch, since starting the processes costs
more than training): `OUT_DIR/replicas`, plain AdamW everywhere; then `OUT_DIR/failing_rank`, where
the last process trains with an AdamW that also keeps a tensor subclass whose storage cannot be
found, so that measuring its state raises there and only there.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Optional

import _common  # noqa: F401  (sets up the import path)
import torch
from transformers import Trainer

from helpers import TinyDataset, tiny_classifier, training_args
from test_callback_faults import AdamWWithWrappedBuffer  # keeps a tensor subclass measuring cannot size
from trainer_memcb import OptimizerMemoryCallback, estimate_optimizer_state, measure_optimizer_state


def train_and_record(out_dir: str, failing: bool) -> None:
    model = tiny_classifier()
    optimizer_class = AdamWWithWrappedBuffer if failing else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    args = training_args(out_dir, max_steps=3, logging_steps=1)
    # Every key in the evaluation entry too (the default keeps two there): the test checks them all.
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1),
                      optimizers=(optimizer, None), callbacks=[OptimizerMemoryCallback(eval_keys="all")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        metrics = trainer.evaluate()

    own_estimate = estimate_optimizer_state(optimizer)
    try:
        own_bytes: Optional[int] = measure_optimizer_state(optimizer).num_bytes
    except Exception:
        own_bytes = None
    _common.write_result(out_dir, {
        "world_size": _common.world_size(),
        "is_world_process_zero": trainer.state.is_world_process_zero,
        "model_is_ddp": type(trainer.model_wrapped).__name__,
        "global_step": trainer.state.global_step,
        "log_history": trainer.state.log_history,
        "evaluate_returned": metrics,
        "own_measured_bytes": own_bytes,
        "own_estimate_bytes": own_estimate.num_bytes,
        "warnings": _common.memcb_warnings(caught),
    })


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    out_dir = parser.parse_args().out_dir
    train_and_record(os.path.join(out_dir, "replicas"), failing=False)
    train_and_record(os.path.join(out_dir, "failing_rank"), failing=_common.rank() == _common.world_size() - 1)


if __name__ == "__main__":
    main()
