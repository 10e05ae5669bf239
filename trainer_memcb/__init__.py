"""trainer_memcb: what your optimizer really holds in memory while you train, against the estimate."""

from trainer_memcb.accelerate_loop import OptimizerMemoryLogger
from trainer_memcb.callback import OptimizerMemoryCallback
from trainer_memcb.estimate import (
    ParamInfo,
    StateEstimate,
    estimate_optimizer_state,
    register_estimate_rule,
)
from trainer_memcb.measure import StateMeasurement, measure_optimizer_state

__version__ = "0.1.0"

__all__ = [
    "OptimizerMemoryCallback",
    "OptimizerMemoryLogger",
    "ParamInfo",
    "StateEstimate",
    "StateMeasurement",
    "estimate_optimizer_state",
    "measure_optimizer_state",
    "register_estimate_rule",
    "__version__",
]
