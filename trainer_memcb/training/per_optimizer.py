"""One record per optimizer, kept without keeping the optimizer.

One callback instance may serve several Trainers, in turn or interleaved (a Trainer evaluating
inside another one's training). What it knows about a run (the measurements cached by step, the
estimate, the what-if) must then be looked up by the optimizer it describes, never taken from
whichever run came last. The records are found by the optimizer's identity and hold it by a weak
reference: once its Trainer lets go of it, the optimizer and its state are freed, and its record
goes with it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Generic, Optional, Tuple, TypeVar

__all__ = ["PerOptimizer"]

Record = TypeVar("Record")


class PerOptimizer(Generic[Record]):
    """Records by optimizer identity, each dropped when its optimizer is collected.

    Args:
        make: builds the record of an optimizer seen for the first time.

    Examples:
        >>> import gc, torch
        >>> from trainer_memcb.training.per_optimizer import PerOptimizer
        >>> records = PerOptimizer(lambda optimizer: {"class": type(optimizer).__name__})
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> records.setdefault(optimizer)
        {'class': 'SGD'}
        >>> del optimizer; _ = gc.collect()
        >>> len(records)
        0
    """

    def __init__(self, make: Callable[[Any], Record]) -> None:
        self._make = make
        # id(optimizer) -> (a reference to it, its record). An id is reused only after its object
        # is gone, and then the reference tells (it no longer returns the new object).
        self._records: Dict[int, Tuple[Callable[[], Any], Record]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, optimizer: Any) -> Optional[Record]:
        found = self._records.get(id(optimizer))
        if found is None or found[0]() is not optimizer:
            return None
        return found[1]

    def setdefault(self, optimizer: Any) -> Record:
        """The record of `optimizer`, made on first sight."""
        record = self.get(optimizer)
        if record is not None:
            return record
        record = self._make(optimizer)
        key, records = id(optimizer), self._records

        def forget(reference: Any) -> None:
            held = records.get(key)
            if held is not None and held[0] is reference:
                del records[key]

        try:
            reference: Callable[[], Any] = weakref.ref(optimizer, forget)
        except TypeError:  # no weak references to this class: held until `release`
            reference = _Strong(optimizer)
        records[key] = (reference, record)
        return record

    def release(self, optimizer: Any) -> None:
        """Drop the record of an optimizer that could only be held strongly (the others go by
        themselves once their optimizer is collected)."""
        held = self._records.get(id(optimizer))
        if held is not None and isinstance(held[0], _Strong) and held[0]() is optimizer:
            del self._records[id(optimizer)]


class _Strong:
    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        self._target = target

    def __call__(self) -> Any:
        return self._target
