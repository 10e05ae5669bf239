"""A functional collective's result taken as the real process holds it, for every traced engine
that runs torch's functional collectives (tensor parallelism's redistributions, context
parallelism's ring).

Under a fake mode a functional collective's result is waited at once (`_are_we_tracing`), and the
fake `wait_tensor` gives a new tensor: a second storage the real step never holds, since a real
`wait_tensor` returns its input (on gloo and NCCL alike). Within `results_as_returned` (or from
`take_results_as_returned` to the undo it gives) the result is taken as it is. Nested uses undo in
reverse order, so TP x CP's ring inside a TP trace leaves the TP engine's setting as it found it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["results_as_returned", "take_results_as_returned"]


def take_results_as_returned() -> Callable[[], None]:
    """Take each functional collective's result as it is returned; give back the undo (which
    does nothing when called again)."""
    import torch.distributed._functional_collectives as ft_c

    saved = [ft_c._maybe_wrap_tensor]
    ft_c._maybe_wrap_tensor = _as_it_is

    def undo() -> None:
        if saved:
            ft_c._maybe_wrap_tensor = saved.pop()

    return undo


@contextlib.contextmanager
def results_as_returned() -> Iterator[None]:
    """Within: each functional collective's result taken as it is returned."""
    undo = take_results_as_returned()
    try:
        yield
    finally:
        undo()


def _as_it_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
