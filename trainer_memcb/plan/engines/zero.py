"""DeepSpeed ZeRO (placeholder, filled below)."""
from trainer_memcb.plan.engines.base import StepEngine

__all__ = ["ZeroEngine"]


class ZeroEngine(StepEngine):
    name = "zero"

    def __init__(self, settings):
        super().__init__(settings.max_grad_norm)
        self.settings = settings
