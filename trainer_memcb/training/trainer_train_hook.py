"""Remove what a step installed when `Trainer.train` ends, however it ends.

The Trainer calls `on_train_end` only when training finishes. A step that raises (an out-of-memory
error in backward, a failing optimizer step, an interrupt) leaves `train()` without any callback
event, so what a callback installed for that step would stay on the user's objects: the
activations probe's wrapper of `model.forward` and the counter that watches checkpoint's
recomputation (`activations_probe.py`), the ZeRO-1/2 tap on DeepSpeed's `step`
(`zero_gradients.py`). A callback is never handed the Trainer, so, as for `Trainer.log`
(`trainer_log_hook.py`), the hook is on the class: `Trainer.train` is wrapped once, idempotently,
and when a call returns or raises, every callback in that Trainer's own `callback_handler` that is
a `TrainExitListener` is told, with the exception `train()` raised, if any (an out-of-memory error
gets its report there: `trainer_memcb.training.oom_report`). The exception propagates unchanged:
the same object, re-raised as it came, nothing chained to it, and a Trainer without such a callback
runs exactly as before. Subclasses whose `train` calls
`super().train` (TRL's trainers) are covered.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

__all__ = ["TrainExitListener", "install_train_hook", "is_train_hook_installed"]

_MARK = "__trainer_memcb_train_hook__"


class TrainExitListener:
    """The base class of the callbacks that the hook on `Trainer.train` tells when it ends.

    Subclasses implement `after_train`; it must never raise.
    """

    __slots__ = ()

    def after_train(self, trainer: Any, error: Optional[BaseException] = None) -> None:
        """`trainer.train()` returned (`error` None) or raised `error`: remove anything still
        installed for its steps. `error` is only read: it propagates as it is once this returns."""
        raise NotImplementedError


def _tell(trainer: Any, error: Optional[BaseException]) -> None:
    handler = getattr(trainer, "callback_handler", None)
    for callback in list(getattr(handler, "callbacks", ())):
        if isinstance(callback, TrainExitListener):
            callback.after_train(trainer, error)  # fail-soft by contract: it never raises


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            _tell(self, error)
            raise  # the same object, its traceback and context as they came
        _tell(self, None)
        return result

    setattr(train, _MARK, True)
    return train


def is_train_hook_installed() -> bool:
    from transformers import Trainer

    return getattr(Trainer.train, _MARK, False)


def install_train_hook() -> None:
    """Wrap `transformers.Trainer.train` once; later calls do nothing."""
    from transformers import Trainer

    if not is_train_hook_installed():
        Trainer.train = _wrap(Trainer.train)
