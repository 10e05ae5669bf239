"""What an evaluation loop's containers hold: torch tensors (on the model's device) and numpy arrays (on the host).

transformers' `Trainer.evaluation_loop` gathers every batch's losses, logits (or what
`preprocess_logits_for_metrics` makes of them), labels and, with `include_for_metrics=["inputs"]`,
inputs in `EvalLoopContainer`s (`transformers/trainer_pt_utils.py`). A container keeps its batches
as torch tensors in `.tensors` (concatenated, or in a list with `eval_do_concat_batches=False`)
until `to_cpu_and_numpy` turns them into numpy arrays in `.arrays`, on the host.

The functions here walk such nested values (tensors, arrays, tuples, lists, dicts) and name each
block of memory once, with its bytes, reading metadata only:

- a torch tensor by its storage (`trainer_memcb.state.saved_tensors.storages_of`: the storage's
  full size, a wrapper subclass by its inner tensors);
- a numpy array by the array that owns its memory: an array viewing another numpy array counts
  the owner's `nbytes`; an array on memory numpy does not own (what `Tensor.numpy()` returns on the
  CPU, sharing the tensor's storage) counts its own `nbytes`, keyed by its data address.

Device and host are kept apart: on a CPU run the arrays `to_cpu_and_numpy` makes from fp32 or
int64 tensors share the tensors' memory, and each figure counts it on its own side.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import numpy as np
import torch

from trainer_memcb.state.saved_tensors import storages_of

__all__ = ["device_blocks", "host_blocks", "numpified_bytes", "blocks_bytes"]

# Nesting the walk follows (the Trainer's outputs are a tensor, a tuple of them, or a dict).
_MAX_NESTING = 16


def _leaves(value: Any, depth: int = 0) -> Iterator[Any]:
    if depth > _MAX_NESTING or value is None:
        return
    if isinstance(value, (torch.Tensor, np.ndarray)):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item, depth + 1)


def device_blocks(value: Any) -> Dict[Tuple[str, int], int]:
    """Each torch storage inside `value` once: `("tensor", storage key) -> bytes`.

    Examples:
        >>> import torch
        >>> logits = torch.zeros(2, 3)
        >>> sorted(device_blocks((logits, logits[0], {"labels": torch.zeros(2, dtype=torch.long)})).values())
        [16, 24]
    """
    found: Dict[Tuple[str, int], int] = {}
    for leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor):
            for key, nbytes, _ in storages_of(leaf):
                found[("tensor", key)] = nbytes
    return found


def _owner(array: np.ndarray) -> np.ndarray:
    """The numpy array that owns `array`'s memory, or the last numpy array on the way to it."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def host_blocks(value: Any) -> Dict[Tuple[str, int], int]:
    """Each numpy array's memory inside `value` once: `("array", data address) -> bytes`.

    Examples:
        >>> import numpy as np
        >>> preds = np.zeros((4, 2), dtype=np.int64)
        >>> host_blocks([preds, preds[:2]]) == {("array", preds.__array_interface__["data"][0]): 64}
        True
    """
    found: Dict[Tuple[str, int], int] = {}
    for leaf in _leaves(value):
        if isinstance(leaf, np.ndarray):
            owner = _owner(leaf)
            found[("array", owner.__array_interface__["data"][0])] = int(owner.nbytes)
    return found


def numpified_bytes(value: Any) -> Dict[Tuple[str, int], int]:
    """The host bytes `nested_numpify(value)` will hold, from the tensors' shapes, before it runs:
    each tensor's values in its dtype (bf16 becomes fp32: numpy has no bfloat16, and
    `nested_numpify` converts), keyed by the tensor's storage and view."""
    found: Dict[Tuple[str, int], int] = {}
    for leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor):
            itemsize = 4 if leaf.dtype == torch.bfloat16 else leaf.element_size()
            key = ("numpified", hash((leaf.untyped_storage()._cdata, leaf.storage_offset(), tuple(leaf.shape))))
            found[key] = leaf.numel() * itemsize
    return found


def blocks_bytes(*blocks: Dict[Tuple[str, int], int]) -> int:
    """The bytes of the union of block maps, each block once."""
    merged: Dict[Tuple[str, int], int] = {}
    for found in blocks:
        merged.update(found)
    return sum(merged.values())
