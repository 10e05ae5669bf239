"""The callback's preflight: the run's own step planned at `on_train_begin`, one warning if it will
not fit (`trainer_memcb.training.preflight`). The run itself is never changed."""

from __future__ import annotations

from typing import Any, Callable, Union

__all__ = ["check_preflight", "run_preflight"]


def check_preflight(preflight: Union[bool, int]) -> Union[bool, int]:
    """`preflight` if it is True, False or a positive number of bytes; else a `ValueError`."""
    if not (isinstance(preflight, bool) or (isinstance(preflight, int) and preflight > 0)):
        raise ValueError(f"preflight={preflight!r}: expected True (plan the step against the CUDA device's free "
                         "memory), False, or the bytes the step may use")
    return preflight


def run_preflight(preflight: Union[bool, int], args: Any, model: Any, processing_class: Any,
                  train_dataloader: Any, warn: Callable[[str, str], None]) -> Any:
    """What the preflight found (`trainer_memcb.training.preflight.Preflight`), or None when there
    is no model or the plan failed (which only warns)."""
    # The run's own step planned before the first step: one warning if it will not fit. The run
    # is never changed, and a plan that fails only warns.
    from trainer_memcb.training.preflight import preflight as plan_preflight

    if model is None:
        return None
    try:
        memory = None if preflight is True else int(preflight)
        result = plan_preflight(model, args, processing_class=processing_class, device_memory=memory,
                                train_dataloader=train_dataloader)
    except Exception as error:  # never break training over a plan
        warn("preflight", f"the preflight plan failed ({error!r}); it is left out")
        return None
    if result is not None and result.warning:
        warn("preflight", result.warning)
    return result
