"""trainer_memcb: what your optimizer really holds in memory while you train, against the estimate.

Every public name is imported on first use. `OptimizerMemoryCallback` and `OptimizerMemoryLogger`
need transformers' Trainer machinery (and through it peft, bitsandbytes, ...), seconds of start-up
that `import trainer_memcb`, the estimate functions and the `trainer-memcb` command do not need;
the estimate functions need torch, which the command's console script imports only once it can
answer a Ctrl-C with one line (`trainer_memcb.cli`).
"""


__version__ = "0.1.0"

__all__ = [
    "AllocatorReplay",
    "FitBatch",
    "OptimizerMemoryCallback",
    "OptimizerMemoryLogger",
    "ParamInfo",
    "StateEstimate",
    "StateMeasurement",
    "estimate_optimizer_state",
    "fit_batch_size",
    "measure_optimizer_state",
    "plan_snapshot",
    "read_snapshot",
    "register_estimate_rule",
    "replay_allocations",
    "replay_snapshot",
    "__version__",
]

# Public name -> the module that defines it, imported when the name is first asked for.
_LAZY = {
    "AllocatorReplay": "trainer_memcb.plan.device.caching_allocator",
    "OptimizerMemoryCallback": "trainer_memcb.training.callback",
    "OptimizerMemoryLogger": "trainer_memcb.training.accelerate_loop",
    "ParamInfo": "trainer_memcb.state.estimate",
    "StateEstimate": "trainer_memcb.state.estimate",
    "estimate_optimizer_state": "trainer_memcb.state.estimate",
    "fit_batch_size": "trainer_memcb.plan.answers.fit",
    "FitBatch": "trainer_memcb.plan.answers.fit",
    "register_estimate_rule": "trainer_memcb.state.estimate",
    "StateMeasurement": "trainer_memcb.state.measure",
    "measure_optimizer_state": "trainer_memcb.state.measure",
    "replay_allocations": "trainer_memcb.plan.device.caching_allocator",
    "plan_snapshot": "trainer_memcb.plan.answers.plan_snapshot",
    "read_snapshot": "trainer_memcb.plan.device.snapshot_file",
    "replay_snapshot": "trainer_memcb.plan.device.snapshot_replay",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'trainer_memcb' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
