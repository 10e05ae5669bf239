"""`PerOptimizer`: records found by the optimizer's identity, held by a weak reference to it.

An `id` is only unique among live objects: once an optimizer is collected, a new one may get the
same `id`. A record is the new optimizer's only if its reference returns that very optimizer.
"""

from __future__ import annotations

import gc
import weakref

import torch

from trainer_memcb.training.per_optimizer import PerOptimizer


def sgd() -> torch.optim.SGD:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def test_a_record_left_under_a_reused_id_is_not_the_new_optimizers():
    numbers = iter(range(1, 10))
    records = PerOptimizer(lambda optimizer: next(numbers))
    first = sgd()
    assert records.setdefault(first) == 1
    gone = weakref.ref(first)  # a reference without a callback, to stand for the first one's own
    del first
    gc.collect()
    assert gone() is None and len(records) == 0  # its record went with it
    # CPython reuses ids of collected objects at will; force the reuse deterministically: a record
    # for the collected optimizer, left under the id of a live one (as if its callback had not run
    # before the id came back).
    second = sgd()
    records._records[id(second)] = (gone, 1)
    assert records.get(second) is None
    assert records.setdefault(second) == 2  # a record of its own, made on first sight
    assert records.get(second) == 2 and len(records) == 1
    del second
    gc.collect()
    assert len(records) == 0


def test_records_are_per_optimizer_and_go_with_it():
    records = PerOptimizer(lambda optimizer: {"class": type(optimizer).__name__})
    first, second = sgd(), torch.optim.AdamW(torch.nn.Linear(2, 1).parameters())
    assert records.setdefault(first) == {"class": "SGD"} and records.setdefault(second) == {"class": "AdamW"}
    assert records.setdefault(first) is records.get(first)
    del first
    gc.collect()
    assert len(records) == 1 and records.get(second) == {"class": "AdamW"}
