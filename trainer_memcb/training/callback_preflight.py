"""The callback's preflight: the run's own step planned at `on_train_begin`, one warning if it will
not fit (`trainer_memcb.training.preflight`). Moved out of `callback.py`."""

from __future__ import annotations

from typing import Any


class _PreflightPart:
    """The callback's preflight, run once at train begin."""

    def _preflight(self, args: Any, model: Any, processing_class: Any, train_dataloader: Any = None) -> None:
        # The run's own step planned before the first step: one warning if it will not fit. The run
        # is never changed, and a plan that fails only warns.
        from trainer_memcb.training.preflight import preflight

        if model is None:
            return
        try:
            memory = None if self.preflight is True else int(self.preflight)
            self.preflight_result = preflight(model, args, processing_class=processing_class, device_memory=memory,
                                              train_dataloader=train_dataloader)
        except Exception as error:  # never break training over a plan
            self._warn_once("preflight", f"the preflight plan failed ({error!r}); it is left out")
            return
        if self.preflight_result is not None and self.preflight_result.warning:
            self._warn_once("preflight", self.preflight_result.warning)
