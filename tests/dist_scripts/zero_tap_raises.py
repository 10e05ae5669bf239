"""A DeepSpeed ZeRO-2 Trainer run whose `train()` raises at step 2: the ZeRO-1/2 step tap
(`trainer_memcb/training/zero_gradients.py`) must be gone from DeepSpeed's optimizer afterwards.

Usage: torchrun --nproc_per_node 1 zero_tap_raises.py OUT_DIR

One process is enough: the tap is per process. DeepSpeed's CPU shared-memory all-reduce is switched
off as in `deepspeed_zero.py` (gloo instead); everything else is DeepSpeed's own engine.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import _common
from transformers import Trainer, TrainerCallback

from helpers import TinyDataset, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.state.rules.deepspeed_zero import find_zero_optimizer

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class Failure(RuntimeError):
    pass


class RaiseAtStep2(TrainerCallback):
    """Records whether DeepSpeed's `step` is wrapped after step 1, then raises as step 2 begins."""

    def __init__(self) -> None:
        self.zero: Any = None
        self.wrapped_during_training = None

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.zero = find_zero_optimizer(optimizer)[0]
        self.wrapped_during_training = "step" in vars(self.zero)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            raise Failure("a callback failed (on purpose)")


def main(out_dir: str) -> None:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    raiser = RaiseAtStep2()
    trainer = Trainer(model=tiny_classifier(), args=training_args(out_dir, max_steps=3, deepspeed=config),
                      train_dataset=TinyDataset(16), callbacks=[OptimizerMemoryCallback(what_if=()), raiser])
    try:
        trainer.train()
        error = None
    except Failure as failure:
        error = str(failure)
    _common.write_result(out_dir, {
        "error": error, "global_step": trainer.state.global_step, "zero": type(raiser.zero).__name__,
        "wrapped_during_training": raiser.wrapped_during_training,
        "wrapped_after": "step" in vars(raiser.zero) if raiser.zero is not None else None,
    })


if __name__ == "__main__":
    main(sys.argv[1])
