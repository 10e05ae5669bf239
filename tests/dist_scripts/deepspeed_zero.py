"""DeepSpeed ZeRO engines on the CPU (gloo): one launch, several runs, in a custom loop with
`OptimizerMemoryLogger` and through the Trainer with `OptimizerMemoryCallback`.

Usage: torchrun --nproc_per_node 2 deepspeed_zero.py OUT_DIR

DeepSpeed picks its CPU accelerator when no GPU is found. Its CPU shared-memory all-reduce kernel
is compiled from C++ on first use (minutes); it is switched off here, so that DeepSpeed falls back
to torch.distributed's gloo, the one thing replaced. Everything else is DeepSpeed's own engine,
partitioning and ZeRO optimizers, stepping torch's AdamW as the client optimizer.

The loop's model has 66 values in two param groups, weights (35 + 21) and biases (7 + 3), so that
the flat partitions need padding; the Trainer's is the tests' tiny DistilBERT, in the Trainer's two
groups. Each run writes `OUT_DIR/<run>/rank<N>.json`, with an independent walk of DeepSpeed's own
buffers (`walk_*` below: parameters, gradients right after backward, master weights, optimizer
state) that the tests hold the logged figures and the plan against.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
import warnings
from typing import Any, Dict, Iterable, List

import _common  # noqa: F401  (sets up the import path)
import deepspeed
import torch
from transformers import Trainer, TrainerCallback

from helpers import TinyDataset, tiny_classifier, training_args
from trainer_memcb import (
    OptimizerMemoryCallback, OptimizerMemoryLogger, estimate_optimizer_state, measure_optimizer_state,
)
from trainer_memcb.state.rules.deepspeed_zero import find_zero_optimizer, with_zero3_partitions

# See the module docstring. `deepspeed.comm.torch` as an attribute is the torch package itself
# (deepspeed/comm/__init__.py imports torch), so the module is taken from the import system.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

# name -> (zero_optimization, model dtype, more config). bf16 parameters with fp32 gradient
# accumulation under ZeRO-1 get DeepSpeed's BF16_Optimizer instead of DeepSpeedZeroOptimizer.
RUNS = {
    "zero1": ({"stage": 1}, torch.float32, {}),
    "zero2": ({"stage": 2}, torch.float32, {}),
    "zero3": ({"stage": 3}, torch.float32, {}),
    "zero2_bf16": ({"stage": 2}, torch.bfloat16, {}),
    "zero1_bf16_fp32_accumulation": ({"stage": 1}, torch.bfloat16, {"data_types": {"grad_accum_dtype": "fp32"}}),
}


# -- the independent walk: DeepSpeed's own buffers, each storage once -------------------------------


def storage_bytes(tensors: Iterable[Any]) -> int:
    seen: Dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def walk_gradients(zero: Any, stage: int) -> int:
    """The gradients DeepSpeed holds after backward: ZeRO-3's flat buffer; ZeRO-1/2's reduced
    partitions (`averaged_gradients`, views of `grads_in_partition`) and any gradient left on a
    parameter; BF16_Optimizer's gradients on the parameters."""
    if stage == 3:
        return storage_bytes([zero.grad_partitions_flat_buffer])
    tensors: List[Any] = []
    for group in (getattr(zero, "averaged_gradients", None) or {}).values():
        tensors.extend(group or [])
    groups = getattr(zero, "bit16_groups", None) or getattr(zero, "bf16_groups")
    tensors.extend(getattr(param, name, None) for group in groups for param in group for name in ("grad", "grad_accum"))
    return storage_bytes(tensors)


def walk_params(zero: Any, stage: int) -> int:
    if stage == 3:
        return storage_bytes(zero.fp16_partitioned_groups_flat)
    return storage_bytes(getattr(zero, "bit16_groups_flat", None) or getattr(zero, "bf16_groups_flat"))


def walk_masters(zero: Any, stage: int) -> int:
    name = {3: "fp32_partitioned_groups_flat"}.get(stage, "single_partition_of_fp32_groups")
    return storage_bytes(getattr(zero, name, None) or getattr(zero, "fp32_groups_flat_partition"))


def walk_optimizer_state(zero: Any) -> int:
    return storage_bytes(value for state in zero.optimizer.state.values() for value in state.values())


def walk_fp32_grad_partitions(zero: Any, stage: int) -> int:
    """At an inner step: the fp32 gradient partitions made for it (ZeRO-1/2, one group at a time)."""
    name = {3: "fp32_partitioned_groups_flat"}.get(stage, "single_partition_of_fp32_groups")
    return storage_bytes(master.grad for master in getattr(zero, name, None) or getattr(zero, "fp32_groups_flat_partition"))


def walk(zero: Any, stage: int, grads: int) -> Dict[str, int]:
    figures = {"params": walk_params(zero, stage), "grads": grads, "masters": walk_masters(zero, stage),
               "optimizer_state": walk_optimizer_state(zero)}
    figures["model_states"] = sum(figures.values())
    return figures


def watch_inner_steps(zero: Any, stage: int, record: List[int]) -> Any:
    """torch's step pre-hook on the inner optimizer: the fp32 gradient partitions alive there."""
    return zero.optimizer.register_step_pre_hook(lambda *_: record.append(walk_fp32_grad_partitions(zero, stage)))


# -- the custom loop --------------------------------------------------------------------------------


def run(out_dir: str, zero: Dict[str, Any], dtype: torch.dtype, more_config: Dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    groups = [
        {"params": [model[0].weight, model[2].weight], "weight_decay": 0.01},
        {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
    ]
    client_optimizer = torch.optim.AdamW(groups, lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
        **more_config,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer, config=config)
    memory = OptimizerMemoryLogger(optimizer)
    # A second logger measures the four model states too (parameters and gradients before the step).
    with_model = OptimizerMemoryLogger(optimizer, model=engine.module)
    zero_optimizer, masters_name, _, stage = find_zero_optimizer(optimizer)
    fp32_grad_partitions: List[int] = []
    watch = watch_inner_steps(zero_optimizer, stage, fp32_grad_partitions)
    walks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = memory.monitor.figures()
        for _ in range(2):
            loss = engine(torch.randn(2, 5, dtype=dtype)).float().square().sum()
            engine.backward(loss)
            grads = walk_gradients(zero_optimizer, stage)
            engine.step()
            walks.append(walk(zero_optimizer, stage, grads))
            figures = memory()
            model_states = {key: value for key, value in with_model().items() if key.startswith("model_")}
    watch.remove()
    wrapped_during_training = "step" in vars(zero_optimizer)
    with_model.close()
    _common.write_result(out_dir, {
        "zero_class": type(zero_optimizer).__name__,
        "inner_class": type(zero_optimizer.optimizer).__name__,
        "stage": stage,
        "model_dtype": str(next(engine.module.parameters()).dtype),
        "master_partition_numels": [int(t.numel()) for t in getattr(zero_optimizer, masters_name)],
        "master_partition_dtypes": [str(t.dtype) for t in getattr(zero_optimizer, masters_name)],
        "inner_group_param_numels": [[int(p.numel()) for p in g["params"]] for g in zero_optimizer.optimizer.param_groups],
        "own_measured_bytes": measure_optimizer_state(optimizer).num_bytes,
        "own_estimate_bytes": estimate_optimizer_state(with_zero3_partitions(optimizer)).num_bytes,
        "inner_groups_untouched": [len(g["params"]) for g in zero_optimizer.optimizer.param_groups],
        "figures_before_a_step": before,
        "figures": figures,
        "model_states": model_states,
        "walks": walks,
        "fp32_grad_partitions": fp32_grad_partitions,
        "step_wrapped_during_training": wrapped_during_training,
        "step_wrapped_after_close": "step" in vars(zero_optimizer),
        "warnings": _common.memcb_warnings(caught),
    })
    engine.destroy()


# -- the Trainer -----------------------------------------------------------------------------------

# name -> (ZeRO stage, bf16). The Trainer's default AdamW, in its two groups.
TRAINER_RUNS = {f"trainer_zero{stage}{'_bf16' if bf16 else ''}": (stage, bf16) for stage in (1, 2, 3) for bf16 in (False, True)}


class WalkAfterBackward(TrainerCallback):
    """Walks DeepSpeed's buffers at each step: the gradients right after backward (accelerate runs
    `engine.backward` and `engine.step` together, so `engine.backward` is wrapped for the run), the
    rest after the step. Independent of trainer_memcb's own hooks."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.walks: List[Dict[str, int]] = []
        self.fp32_grad_partitions: List[int] = []
        self.wrapped_during_training = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine = self.trainer.model_wrapped
        self.zero, _, _, self.stage = find_zero_optimizer(engine.optimizer)
        self.watch = watch_inner_steps(self.zero, self.stage, self.fp32_grad_partitions)
        backward = engine.backward

        def backward_and_walk(*args: Any, **kwargs: Any) -> Any:
            result = backward(*args, **kwargs)
            self.grads = walk_gradients(self.zero, self.stage)
            return result

        engine.backward = backward_and_walk

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.walks.append(walk(self.zero, self.stage, self.grads))
        self.wrapped_during_training = "step" in vars(self.zero)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.remove()
        del self.trainer.model_wrapped.backward


def train(out_dir: str, stage: int, bf16: bool) -> None:
    model = tiny_classifier()
    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": "auto"},
    }
    args = training_args(out_dir, max_steps=2, logging_steps=1, deepspeed=config, bf16=bf16)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1),
                      callbacks=[OptimizerMemoryCallback(what_if=(), eval_keys="all")])
    walker = WalkAfterBackward(trainer)
    trainer.add_callback(walker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        metrics = trainer.evaluate()
    zero = walker.zero
    _common.write_result(out_dir, {
        "zero_class": type(zero).__name__,
        "stage": walker.stage,
        "model_dtype": str(next(trainer.model.parameters()).dtype),
        "group_param_numels": [[int(getattr(param, "ds_numel", param.numel())) for param in group]
                               for group in getattr(zero, "bit16_groups", None) or zero.fp16_groups],
        "log_history": trainer.state.log_history,
        "evaluate_returned": metrics,
        "walks": walker.walks,
        "fp32_grad_partitions": walker.fp32_grad_partitions,
        "step_wrapped_during_training": walker.wrapped_during_training,
        "step_wrapped_after_training": "step" in vars(zero),
        "warnings": _common.memcb_warnings(caught),
    })
    trainer.model_wrapped.destroy()


def main() -> None:
    out_dir = argparse.ArgumentParser().parse_known_args()[1][0]
    deepspeed.init_distributed(dist_backend="gloo")
    timings = {}
    for name, (zero, dtype, more_config) in RUNS.items():
        started = time.perf_counter()
        run(os.path.join(out_dir, name), zero, dtype, more_config)
        timings[name] = round(time.perf_counter() - started, 1)
    for name, (stage, bf16) in TRAINER_RUNS.items():
        started = time.perf_counter()
        train(os.path.join(out_dir, name), stage, bf16)
        timings[name] = round(time.perf_counter() - started, 1)
    if _common.rank() == 0:
        print("seconds per run:", timings, flush=True)


if __name__ == "__main__":
    main()
