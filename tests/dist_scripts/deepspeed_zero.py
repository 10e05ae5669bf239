"""DeepSpeed ZeRO engines on the CPU (gloo), with `OptimizerMemoryLogger`: one launch, several runs.

Usage: torchrun --nproc_per_node 2 deepspeed_zero.py OUT_DIR

DeepSpeed picks its CPU accelerator when no GPU is found. Its CPU shared-memory all-reduce kernel
is compiled from C++ on first use (minutes); it is switched off here, so that DeepSpeed falls back
to torch.distributed's gloo, the one thing replaced. Everything else is DeepSpeed's own engine,
partitioning and ZeRO optimizers, stepping torch's AdamW as the client optimizer.

The model has 66 values in two param groups, weights (35 + 21) and biases (7 + 3), so that the
flat partitions need padding. Each run writes `OUT_DIR/<run>/rank<N>.json`.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Dict

import _common  # noqa: F401  (sets up the import path)
import deepspeed
import deepspeed.comm.torch
import torch

from trainer_memcb import OptimizerMemoryLogger, estimate_optimizer_state, measure_optimizer_state
from trainer_memcb.state.rules.deepspeed_zero import find_zero_optimizer, with_zero3_partitions

deepspeed.comm.torch.build_shm_op = lambda: None  # see the module docstring

# name -> (zero_optimization, model dtype, more config). bf16 parameters with fp32 gradient
# accumulation under ZeRO-1 get DeepSpeed's BF16_Optimizer instead of DeepSpeedZeroOptimizer.
RUNS = {
    "zero1": ({"stage": 1}, torch.float32, {}),
    "zero2": ({"stage": 2}, torch.float32, {}),
    "zero3": ({"stage": 3}, torch.float32, {}),
    "zero2_bf16": ({"stage": 2}, torch.bfloat16, {}),
    "zero1_bf16_fp32_accumulation": ({"stage": 1}, torch.bfloat16, {"data_types": {"grad_accum_dtype": "fp32"}}),
}


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = memory.monitor.figures()
        for _ in range(2):
            loss = engine(torch.randn(2, 5, dtype=dtype)).float().square().sum()
            engine.backward(loss)
            engine.step()
            figures = memory()
            model_states = {key: value for key, value in with_model().items() if key.startswith("model_")}
    zero_optimizer, masters_name, _, stage = find_zero_optimizer(optimizer)
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
        "warnings": _common.memcb_warnings(caught),
    })
    engine.destroy()


def main() -> None:
    out_dir = argparse.ArgumentParser().parse_known_args()[1][0]
    deepspeed.init_distributed(dist_backend="gloo")
    for name, (zero, dtype, more_config) in RUNS.items():
        run(os.path.join(out_dir, name), zero, dtype, more_config)


if __name__ == "__main__":
    main()
