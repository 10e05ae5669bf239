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

The hook also keeps which `train()` calls are under way, innermost last (`current_train_call`,
`is_running`; the Trainer of the innermost, held weakly: `current_trainer`, whose logged steps the
phases probe wraps, `generation_phases.py`): a Trainer may train or evaluate another inside its own
step (a `training_step` that trains a second Trainer). What the outer step installed stays, and
measures only while its own call is the innermost one (`activations_probe.py`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, List, Optional

from trainer_memcb.training.trainer_method_hook import TrainerMethodHook, callbacks_of

__all__ = ["TrainExitListener", "current_train_call", "current_trainer", "install_train_hook", "is_running",
           "is_train_hook_installed"]

_MARK = "__trainer_memcb_train_hook__"
# One token per `Trainer.train` call under way, innermost last.
_RUNNING: List["_TrainCall"] = []


class _TrainCall:
    """A `Trainer.train` call, as a token compared by identity, and its Trainer, held weakly."""

    __slots__ = ("__weakref__", "trainer")

    def __init__(self, trainer: Any) -> None:
        try:
            self.trainer: Any = weakref.ref(trainer)
        except TypeError:  # a Trainer that cannot be held weakly is not told to the callbacks
            self.trainer = _no_trainer


def _no_trainer() -> None:
    return None


def current_train_call() -> Optional[object]:
    """The innermost `Trainer.train` call under way (of any Trainer), or None outside any."""
    return _RUNNING[-1] if _RUNNING else None


def current_trainer() -> Any:
    """The Trainer whose `train()` is the innermost call under way, or None (outside any; a Trainer
    that cannot be held weakly)."""
    return _RUNNING[-1].trainer() if _RUNNING else None


def is_running(call: object) -> bool:
    """Whether `call` (from `current_train_call`) has not returned or raised yet."""
    return any(running is call for running in _RUNNING)


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
    for callback in callbacks_of(trainer, TrainExitListener):
        callback.after_train(trainer, error)  # fail-soft by contract: it never raises


def _forget(call: object) -> None:
    for index in range(len(_RUNNING) - 1, -1, -1):
        if _RUNNING[index] is call:
            del _RUNNING[index]
            break


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _TrainCall(self)
        _RUNNING.append(call)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as error:
            _forget(call)
            _tell(self, error)
            raise  # the same object, its traceback and context as they came
        _forget(call)
        _tell(self, None)
        return result

    return train


_HOOK = TrainerMethodHook("train", _MARK, _wrap)
# Whether `transformers.Trainer.train` is wrapped; wrap it once (later calls do nothing).
is_train_hook_installed = _HOOK.is_installed
install_train_hook = _HOOK.install
