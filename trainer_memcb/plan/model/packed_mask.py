"""Whether transformers keeps a packed row's sequences apart under `sdpa` and `eager`.

A padding-free row (`DataCollatorWithFlattening`) has no attention mask: only its `position_ids`,
restarting at each sequence, say where one ends. transformers' `create_causal_mask`
(`masking_utils`) finds the sequences from them (`find_packed_sequence_indices`) when it is given
no mask and no cache, and masks attention across them (`packed_sequence_mask_function`);
transformers 4.x does so only on torch 2.6 or newer (`_is_torch_greater_or_equal_than_2_6`). A
model keeps its sequences apart only if its modeling module passes `position_ids` to
`create_causal_mask`; one that builds its mask otherwise lets every token attend across them.
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

from torch import nn

__all__ = ["packed_mask_missing"]


def _calls_with_position_ids(source: str, function: str = "create_causal_mask(") -> bool:
    """Whether a call of `function` in `source` passes `position_ids` (read up to its closing parenthesis)."""
    start = source.find(function)
    while start >= 0:
        depth, end = 0, start + len(function) - 1
        for end in range(start + len(function) - 1, len(source)):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            if depth == 0:
                break
        if "position_ids" in source[start:end]:
            return True
        start = source.find(function, end)
    return False


def packed_mask_missing(model: nn.Module) -> Optional[str]:
    """What keeps transformers from masking a packed row of `model`'s sequences apart under sdpa
    and eager (the module docstring), or None where nothing does."""
    try:
        from transformers import masking_utils
    except ImportError:
        return "this transformers has no masking_utils (the packed mask came with transformers 4.53)"
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return "this transformers does not find packed sequences in position_ids (masking_utils)"
    if getattr(masking_utils, "_is_torch_greater_or_equal_than_2_6", True) is False:
        return "this transformers masks packed sequences only on torch 2.6 or newer"
    module = sys.modules.get(type(model).__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    if not _calls_with_position_ids(source):
        return (f"{type(model).__name__}'s attention mask is not built from position_ids "
                f"(its module {type(model).__module__} passes none to create_causal_mask)")
    return None
