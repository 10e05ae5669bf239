"""Put figures into the Trainer's own log entries.

Why a hook on `Trainer.log`, and not `on_log`: `Trainer.log(logs)` appends a copy of `logs` to
`state.log_history` and only then calls every callback's `on_log`, and the user's callbacks run
after the `report_to` reporters. Keys a callback adds in `on_log` therefore reach neither
`log_history` (so neither `trainer_state.json`) nor TensorBoard, W&B and the rest.

A callback is never handed the Trainer, so the hook is on the class: `Trainer.log` is wrapped once,
idempotently, and before each call the wrapper asks every callback in that Trainer's own
`callback_handler` that is a `LogContributor` to add its keys to `logs`, handing it the Trainer
(so that it can tell whose figures to add). Only instances of our own base class are asked: a
method name alone could be shared by any other library's callback, which would then be called
with arguments it does not take. A Trainer without such a callback is untouched: the same `logs`
object reaches the original `log` unchanged. Subclasses that extend `log` and call `super().log`
are covered, and the wrapper only relies on `Trainer.log(self, logs, ...)` and
`self.callback_handler.callbacks`, both stable across transformers 4.x and 5.x.
"""

from __future__ import annotations

import functools
from typing import Any, Dict

from trainer_memcb.training.trainer_method_hook import TrainerMethodHook, callbacks_of

__all__ = ["LogContributor", "install_log_hook", "is_log_hook_installed"]

_MARK = "__trainer_memcb_log_hook__"


class LogContributor:
    """The base class of the callbacks that the hook on `Trainer.log` asks for keys.

    Subclasses implement `contribute_to_trainer_log`; it must never raise.
    """

    __slots__ = ()

    def contribute_to_trainer_log(self, trainer: Any, logs: Dict[str, Any]) -> None:
        """Add keys to `logs`, which `trainer` is about to store and report."""
        raise NotImplementedError


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def log(self: Any, logs: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(logs, dict):
            for callback in callbacks_of(self, LogContributor):
                callback.contribute_to_trainer_log(self, logs)  # fail-soft by contract: it never raises
        return original(self, logs, *args, **kwargs)

    return log


_HOOK = TrainerMethodHook("log", _MARK, _wrap)
# Whether `transformers.Trainer.log` is wrapped; wrap it once (later calls do nothing).
is_log_hook_installed = _HOOK.is_installed
install_log_hook = _HOOK.install
