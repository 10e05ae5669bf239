"""A hook on one method of `transformers.Trainer`: wrapped once per process, marked, never twice.

The callback is never handed the Trainer, so what it needs of a Trainer's own calls (`log`, `train`,
`evaluation_loop`) is a wrapper on the class's method. Each wrapper carries a mark, so that
installing again finds it and does nothing, and asks only the callbacks of that Trainer's own
`callback_handler` that are instances of the hook's base class (`callbacks_of`): a Trainer without
such a callback runs the original untouched. The wrappers stay for the process by design.
"""

from __future__ import annotations

from typing import Any, Callable, List

__all__ = ["TrainerMethodHook", "callbacks_of"]


def callbacks_of(trainer: Any, kind: type) -> List[Any]:
    """The callbacks of `trainer`'s own `callback_handler` that are instances of `kind`, in order."""
    handler = getattr(trainer, "callback_handler", None)
    return [callback for callback in list(getattr(handler, "callbacks", ())) if isinstance(callback, kind)]


class TrainerMethodHook:
    """The hook on `transformers.Trainer.<method>`: `wrap(original)` makes the wrapper, and `mark`
    is the attribute it carries once installed."""

    __slots__ = ("method", "mark", "wrap")

    def __init__(self, method: str, mark: str, wrap: Callable[[Any], Any]) -> None:
        self.method, self.mark, self.wrap = method, mark, wrap

    def is_installed(self) -> bool:
        """Whether `Trainer.<method>` is this hook's wrapper."""
        from transformers import Trainer

        return getattr(getattr(Trainer, self.method), self.mark, False)

    def install(self) -> None:
        """Wrap `Trainer.<method>` once; later calls do nothing."""
        from transformers import Trainer

        if not self.is_installed():
            wrapper = self.wrap(getattr(Trainer, self.method))
            setattr(wrapper, self.mark, True)
            setattr(Trainer, self.method, wrapper)
