"""The CPU generator's states that activation checkpointing keeps, as storages the trace counts.

`torch.utils.checkpoint` (`preserve_rng_state=True`, its default) saves the CPU generator's state,
`torch.get_rng_state()` (5,056 bytes: mt19937's), when a checkpointed block runs forward: the
reentrant variant in the block's autograd context (`ctx.fwd_cpu_state`), the non-reentrant one in
its recomputation closure. Each is freed when the block's recomputation has run (reentrant: with
the context, after the block's backward). The recomputation also stashes the state around itself
(`torch.random.fork_rng`). These are real CPU tensors that `default_generator.get_state()` makes
without the dispatcher, so a fake trace never sees them, while a real CPU step holds them in the
same memory as everything else.

`rng_states_counted()` makes them visible: within it, under a fake mode, `torch.get_rng_state()`
returns a fake uint8 tensor of the state's size, made by `torch.empty` (so the trace counts its
storage from the moment checkpoint takes it until checkpoint drops it), and `torch.set_rng_state`
passes over such a fake state (there is no generator to restore in a fake step). With no fake mode
active on the calling thread (the dispatch modes are per thread), both are torch's own. On a CUDA run these states are host
memory, and the trace leaves them out.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["rng_states_counted", "cpu_rng_state_bytes"]

_LOCK = threading.RLock()  # a trace inside a trace (same thread) restores what it found


def cpu_rng_state_bytes() -> int:
    """The bytes of the CPU generator's state, as `torch.get_rng_state()` returns it here."""
    return int(torch.random.default_generator.get_state().numel())


@contextlib.contextmanager
def rng_states_counted() -> Iterator[None]:
    """Within: `torch.get_rng_state()` makes its tensor through the dispatcher (a fake one under a
    fake mode), and `torch.set_rng_state` skips fake states (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    size = cpu_rng_state_bytes()
    original_get, original_set = torch.get_rng_state, torch.set_rng_state

    def get_rng_state() -> torch.Tensor:
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
            return original_get()  # not inside a fake trace: the real generator's state
        return torch.empty(size, dtype=torch.uint8, device="cpu")

    def set_rng_state(new_state: torch.Tensor) -> None:
        if not isinstance(new_state, FakeTensor):
            original_set(new_state)

    with _LOCK:
        torch.get_rng_state, torch.set_rng_state = get_rng_state, set_rng_state
        try:
            yield
        finally:
            torch.get_rng_state, torch.set_rng_state = original_get, original_set
