"""A hook on one method of `transformers.Trainer`: wrapped once per process, marked, never twice.

The callback is never handed the Trainer, so what it needs of a Trainer's own calls (`log`, `train`,
`evaluation_loop`) is a wrapper on the class's method. Each wrapper carries a mark, so that
installing again finds it and does nothing, and asks only the callbacks of that Trainer's own
`callback_handler` that are instances of the hook's base class (`callbacks_of`): a Trainer without
such a callback runs the original untouched. The wrappers stay for the process by design.

`InstanceWrappers` is the same for one object and a shorter time: wrappers set on one Trainer
instance for one logged step (the generation phases' probe), all taken off together.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Tuple

__all__ = ["InstanceWrappers", "TrainerMethodHook", "callbacks_of"]


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


def _class_method_applies() -> None:
    """Stands for "no instance attribute": the class's method applied."""


class InstanceWrappers:
    """Wrappers set on one object's own attributes (a Trainer instance's methods), taken off together.

    Where `TrainerMethodHook` wraps the class for the process, these last one logged step: they
    shadow the class's method (or an instance attribute already there, put back when removed) on
    that object alone, and every other object of the class is untouched. A wrapper asks `owns`
    before doing anything of its own: once removed, one still held elsewhere calls straight through.
    """

    def __init__(self) -> None:
        self._set: List[Tuple[Any, str, Any, Any]] = []  # (the object weakly, name, wrapper, replaced)

    def set(self, target: Any, name: str, wrapper: Any) -> None:
        """Make `wrapper` `target.<name>` until `remove_all`."""
        replaced = target.__dict__.get(name, _class_method_applies)
        target.__dict__[name] = wrapper
        self._set.append((weakref.ref(target), name, wrapper, replaced))

    def owns(self, name: str, wrapper: Any) -> bool:
        """Whether `wrapper` is set as `name` and not yet removed."""
        return any(set_name == name and mine is wrapper for _, set_name, mine, _ in self._set)

    def remove_all(self) -> None:
        """Put back what each wrapper replaced, the last set first; safe to call at any time."""
        wrappers, self._set = self._set, []
        for target_ref, name, wrapper, replaced in reversed(wrappers):
            target = target_ref()
            if target is None or target.__dict__.get(name) is not wrapper:
                continue  # gone, or replaced again by someone else: theirs stays
            if replaced is _class_method_applies:
                del target.__dict__[name]
            else:
                target.__dict__[name] = replaced
