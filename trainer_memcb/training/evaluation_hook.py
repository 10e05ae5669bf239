"""Tell callbacks when an evaluation loop starts and ends: a hook on `Trainer.evaluation_loop`.

A callback sees `on_prediction_step` after each batch, but nothing before the loop's first batch
nor after its last, and never the loop's containers. `Trainer.evaluate()` and `Trainer.predict()`
both run `self.evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
metric_key_prefix)` (transformers 4.57 to 5.x); `evaluate()` then logs the loop's metrics, so the
figures of a loop are known when its entry reaches `Trainer.log`
(`trainer_memcb.training.trainer_log_hook`).

As with the log hook, the class's method is wrapped once, idempotently, and the wrapper asks only
the callbacks of that Trainer's own `callback_handler` that are `EvaluationWatcher`s; a Trainer
without one runs the original untouched. The watchers are told the loop's end whether it returns
or raises, so that whatever they installed for it is removed on every path.
"""

from __future__ import annotations

import functools
from typing import Any, List

from trainer_memcb.training.trainer_method_hook import TrainerMethodHook, callbacks_of

__all__ = ["EvaluationWatcher", "install_evaluation_hook", "is_evaluation_hook_installed"]

_MARK = "__trainer_memcb_evaluation_hook__"
# `evaluation_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)`.
_PREFIX_POSITION = 4
_DEFAULT_PREFIX = "eval"


class EvaluationWatcher:
    """The base class of the callbacks that the hook on `Trainer.evaluation_loop` tells; both
    methods must never raise."""

    __slots__ = ()

    def evaluation_loop_started(self, trainer: Any, prefix: str) -> None:
        """`trainer`'s evaluation loop, whose metrics take `prefix`, is about to run."""
        raise NotImplementedError

    def evaluation_loop_ended(self, trainer: Any, prefix: str, failed: bool) -> None:
        """That loop returned (`failed=False`) or raised."""
        raise NotImplementedError


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def evaluation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        watchers: List[EvaluationWatcher] = callbacks_of(self, EvaluationWatcher)
        if not watchers:
            return original(self, *args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[_PREFIX_POSITION] if len(args) > _PREFIX_POSITION
                            else _DEFAULT_PREFIX)
        for watcher in watchers:
            watcher.evaluation_loop_started(self, prefix)
        try:
            output = original(self, *args, **kwargs)
        except BaseException:
            for watcher in reversed(watchers):
                watcher.evaluation_loop_ended(self, prefix, failed=True)
            raise
        for watcher in reversed(watchers):
            watcher.evaluation_loop_ended(self, prefix, failed=False)
        return output

    return evaluation_loop


_HOOK = TrainerMethodHook("evaluation_loop", _MARK, _wrap)
# Whether `transformers.Trainer.evaluation_loop` is wrapped; wrap it once (later calls do nothing).
is_evaluation_hook_installed = _HOOK.is_installed
install_evaluation_hook = _HOOK.install
