"""FSDP2 (`fully_shard`) in a custom loop on the CPU (gloo), with `OptimizerMemoryLogger`.

Usage: torchrun --nproc_per_node 2 fsdp2_loop.py OUT_DIR

An `accelerate.Accelerator(cpu=True)` sets up the processes and logs to TensorBoard under
`OUT_DIR/fsdp2` (main process only); the model is sharded with `fully_shard` by hand, because
accelerate 1.15 turns an FSDP plugin into FSDP only on accelerators (on the CPU it stays
MULTI_CPU, which wraps the model in DDP: `AcceleratorState.__init__` in accelerate/state.py).

The model's first layer has 7 output rows, so its weight and bias split 4 + 3 over two processes
(Shard(0), the last shard smaller), and the second layer has 3 (2 + 1). Two AdamW steps; every
process calls the logger at each step, as the custom-loop API asks.

Then FSDP2's other modes, with the model-states logger alone (`OUT_DIR/<mode>/rank<N>.json`):
shard-grad-op (`reshard_after_forward=False`: the parameters stay whole from forward to the end of
backward) and CPU offload (`CPUOffloadPolicy`; on this CPU-only machine the offloaded states stay
where they are, and the bytes are what is measured). Each records an independent walk: the local
shards' storages, the gradients before the step, the optimizer state, and the storages behind the
parameters that forward leaves unsharded.
"""

from __future__ import annotations

import argparse
import os
import warnings

import _common  # noqa: F401  (sets up the import path)
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from trainer_memcb import OptimizerMemoryLogger, estimate_optimizer_state, measure_optimizer_state
from trainer_memcb.training.distributed import reduce_across_processes
from trainer_memcb.training.figures import optimizer_figures
from trainer_memcb.training.model_states_probe import measure_grads_bytes, measure_params_bytes


def main() -> None:
    out_dir = argparse.ArgumentParser().parse_known_args()[1][0]
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=out_dir)
    accelerator.init_trackers("fsdp2")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    memory = OptimizerMemoryLogger(optimizer, accelerator)
    # A second logger, given the model, for the four model states; it logs nowhere (accelerator None),
    # so the first one's TensorBoard run keeps the optimizer keys alone. Both exchange in step.
    model_states = OptimizerMemoryLogger(optimizer, model=model)

    figures_per_step = []
    model_states_per_step = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures_per_step.append(memory.monitor.figures())  # before the first step: estimate only
        for _ in range(2):
            model(torch.randn(5, 4)).square().sum().backward()
            grads_before_step = measure_grads_bytes(model)
            optimizer.step()
            optimizer.zero_grad()
            figures_per_step.append(memory())
            model_states_per_step.append(model_states())

    # The guide's recipe (docs/distributed.md) for the job's figures without the Trainer or the logger.
    own = optimizer_figures(measure_optimizer_state(optimizer), estimate_optimizer_state(optimizer))
    job = reduce_across_processes(own)

    state_shapes = {
        name: {key: [list(value.shape), type(value).__name__, list(value.to_local().shape)
                     if hasattr(value, "to_local") else list(value.shape)]
               for key, value in optimizer.state[param].items()}
        for name, param in model.named_parameters()
    }
    _common.write_result(out_dir, {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "param_types": {name: type(param).__name__ for name, param in model.named_parameters()},
        "local_shapes": {name: list(param.to_local().shape) for name, param in model.named_parameters()},
        "state_shapes": state_shapes,
        "own_measured_bytes": measure_optimizer_state(optimizer).num_bytes,
        "own_estimate_bytes": estimate_optimizer_state(optimizer).num_bytes,
        "own_trainable_params": estimate_optimizer_state(optimizer).num_params,
        "figures_per_step": figures_per_step,
        "model_states_per_step": model_states_per_step,
        "own_params_bytes": measure_params_bytes(model),
        "own_grads_bytes_before_step": grads_before_step,
        "readme_recipe": job,
        "warnings": _common.memcb_warnings(caught),
    })
    # Before end_training, which takes the process group down with it.
    for mode, options in MODES.items():
        run_mode(os.path.join(out_dir, mode), options)
    accelerator.end_training()


# mode -> fully_shard options. pin_memory=False: pinning needs an accelerator.
MODES = {
    "shard_grad_op": {"reshard_after_forward": False},
    "cpu_offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
}


def storage_bytes(tensors) -> int:
    seen = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def run_mode(out_dir: str, options) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    layers = (model[0], model[2])
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logger = OptimizerMemoryLogger(optimizer, model=model)
    sharded_bytes = storage_bytes(model.parameters())
    walks, model_states_per_step, unsharded_after_forward = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            output = model(torch.randn(5, 4))
            # Between forward and backward: what the layers' parameters are now (whole, or back in shards).
            unsharded_after_forward.append(storage_bytes(param for layer in layers for param in layer.parameters()))
            output.square().sum().backward()
            grads = storage_bytes(param.grad for param in model.parameters())
            optimizer.step()
            walks.append({"params": storage_bytes(model.parameters()), "grads": grads,
                          "optimizer_state": storage_bytes(value for state in optimizer.state.values()
                                                           for value in state.values())})
            optimizer.zero_grad()
            model_states_per_step.append({key: value for key, value in logger().items() if key.startswith("model_")})
    logger.close()
    _common.write_result(out_dir, {
        "param_types": sorted({type(param).__name__ for param in model.parameters()}),
        "devices": sorted({str(param.device) for param in model.parameters()}),
        "sharded_params_bytes": sharded_bytes,
        "unsharded_after_forward": unsharded_after_forward,
        "walks": walks,
        "model_states_per_step": model_states_per_step,
        "warnings": _common.memcb_warnings(caught),
    })


if __name__ == "__main__":
    main()
