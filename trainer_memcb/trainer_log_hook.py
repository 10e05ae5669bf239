"""Put figures into the Trainer's own log entries.

Why a hook on `Trainer.log`, and not `on_log`: `Trainer.log(logs)` appends a copy of `logs` to
`state.log_history` and only then calls every callback's `on_log`, and the user's callbacks run
after the `report_to` reporters. Keys a callback adds in `on_log` therefore reach neither
`log_history` (so neither `trainer_state.json`) nor TensorBoard, W&B and the rest.

A callback is never handed the Trainer, so the hook is on the class: `Trainer.log` is wrapped once,
idempotently, and before each call the wrapper asks every callback in that Trainer's own
`callback_handler` that offers `contribute_to_log(logs, state)` to add its keys to `logs`. The
Trainer then stores and reports one entry holding everything. A Trainer without such a callback is
untouched, subclasses that extend `log` and call `super().log` are covered, and the wrapper only
relies on `Trainer.log(self, logs, ...)` and `self.callback_handler.callbacks`, both stable across
transformers 4.x and 5.x.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Dict

__all__ = ["install_log_hook", "is_log_hook_installed", "trainer_logging", "CONTRIBUTE_METHOD"]

CONTRIBUTE_METHOD = "contribute_to_log"
_MARK = "__trainer_memcb_log_hook__"
# The Trainer whose `log` the hook is running, while it asks the callbacks: a callback is never
# handed its Trainer, and some need what the Trainer holds (its reporters' folders).
_LOGGING: contextvars.ContextVar = contextvars.ContextVar("trainer_memcb_trainer_logging", default=None)


def trainer_logging() -> Any:
    """The Trainer whose `log` call is asking for keys right now, or None outside one."""
    return _LOGGING.get()


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def log(self: Any, logs: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        handler = getattr(self, "callback_handler", None)
        token = _LOGGING.set(self)
        try:
            for callback in getattr(handler, "callbacks", ()):
                contribute = getattr(callback, CONTRIBUTE_METHOD, None)
                if contribute is not None and isinstance(logs, dict):
                    contribute(logs, self.state)  # fail-soft by contract: it never raises
        finally:
            _LOGGING.reset(token)
        return original(self, logs, *args, **kwargs)

    setattr(log, _MARK, True)
    return log


def is_log_hook_installed() -> bool:
    from transformers import Trainer

    return getattr(Trainer.log, _MARK, False)


def install_log_hook() -> None:
    """Wrap `transformers.Trainer.log` once; later calls do nothing."""
    from transformers import Trainer

    if not is_log_hook_installed():
        Trainer.log = _wrap(Trainer.log)
