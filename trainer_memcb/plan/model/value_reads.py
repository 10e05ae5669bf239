"""transformers' value-dependent mask checks, answered as a real unpadded batch answers them.

A few of transformers' mask helpers (`masking_utils`) read the batch's values to take a cheaper
path, and take the general path when the tensor is being traced (`is_tracing`, which a fake
tensor counts as). Under fake tensors the plan would then follow a path a real run never takes,
and save what the real run never saves:

- `_ignore_causal_mask_sdpa` and `_ignore_bidirectional_mask_sdpa` read whether the padding mask
  is all ones (a collator's mask without padding; BART's decoder makes one when given none); a
  real all-ones mask lets SDPA run with `is_causal` and no mask, a fake one builds a float mask
  per attention (tried on a tiny BART: 2,304 bytes more saved);
- `find_packed_sequence_indices(position_ids)`, reached with no attention mask and no cache (the
  Trainer's `use_cache=False`), reads whether the positions restart inside a row (packed
  sequences); a real batch of one sequence per row says no, a fake one builds a mask per layer
  and SDPA repeats K and V for grouped-query attention (tried on a tiny Qwen2: 21,504 bytes more).

- `flash_attention_mask` (the mask function of `flash_attention_2`, `_3`, `_4`) returns no mask
  when the padding mask is all ones (`attention_mask.all()`), a value read a fake tensor cannot
  answer at all (`aten._local_scalar_dense`): a fake mask is passed on as none, as the real
  unpadded batch's is.

- `_is_packed_sequence(position_ids, batch_size)` (`modeling_flash_attention_utils`, the flash
  paths' own check, made at batch size 1 only) reads whether the positions restart inside the
  row: a fake row is answered as the real unpacked row, one sequence (at batch 1 flash_attention_2
  could not be planned: `aten._local_scalar_dense`).

- a vision-language model's `get_placeholder_mask` (Llava's and its kin's) checks, through
  `torch_compilable_check`, that the text's image tokens are as many as the image features: a
  value read. The plan's ids hold the placeholders where the processor puts them
  (`trainer_memcb.plan.model.step_inputs`), so the real batch passes the check: a check of a fake
  tensor is answered as passed (`passed_checks()`, entered with padding or without).

transformers 4.x reads the same in `modeling_attn_mask_utils`: `_prepare_4d_attention_mask_for_sdpa`
(and its causal twin) return None for an all-ones mask, after `torch.all(mask == 1)`, a value read
a fake tensor cannot answer at all (`aten._local_scalar_dense`: BERT could not be planned). Models
import these functions by name, so each module holding the original is patched.

`unpadded_batch()` answers them, while it is active and for fake tensors only, as the real
batch the step plan stands for answers them: one unpadded sequence per row (an all-ones mask is
passed on as no mask, which both functions treat alike; positions are not packed). The step plan
enters it only for a batch without padding (`padding=0`); with padding the general path is the
real run's path too. For a packed row (`packed=True`, `DataCollatorWithFlattening`'s batch) the
positions are left to `find_packed_sequence_indices`, which finds the sequences in a traced tensor
as in the real row, whose positions do restart.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

__all__ = ["unpadded_batch", "passed_checks"]


def _is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _mask_as_all_ones(original: Any) -> Any:
    def check(padding_mask: Any, *args: Any, **kwargs: Any) -> Any:
        return original(None if _is_fake(padding_mask) else padding_mask, *args, **kwargs)

    return check


def _flash_mask_as_all_ones(original: Any) -> Any:
    def flash_attention_mask(*args: Any, **kwargs: Any) -> Any:
        if _is_fake(kwargs.get("attention_mask")):
            kwargs["attention_mask"] = None
        return original(*args, **kwargs)

    return flash_attention_mask


def _unpacked(original: Any) -> Any:
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        return None if _is_fake(position_ids) else original(position_ids)

    return find_packed_sequence_indices


_PATCHES = (("_ignore_causal_mask_sdpa", _mask_as_all_ones), ("_ignore_bidirectional_mask_sdpa", _mask_as_all_ones),
            ("find_packed_sequence_indices", _unpacked))


def _one_sequence_a_row(original: Any) -> Any:
    def _is_packed_sequence(position_ids: Any, batch_size: Any) -> Any:
        return False if _is_fake(position_ids) else original(position_ids, batch_size)

    return _is_packed_sequence


@contextlib.contextmanager
def unpadded_batch(packed: bool = False) -> Iterator[None]:
    """While active, transformers' mask helpers see fake masks as all ones and fake positions as
    one sequence per row, or as packed sequences with `packed` (see the module docstring)."""
    try:
        from transformers import masking_utils
    except ImportError:  # an older transformers without the module: nothing to answer
        yield
        return
    saved: List[Tuple[str, Any]] = []
    for name, wrap in _PATCHES:
        if packed and wrap is _unpacked:
            continue
        original = getattr(masking_utils, name, None)
        if original is not None:
            saved.append((name, original))
            setattr(masking_utils, name, wrap(original))
    patched = _patch_4x_mask_helpers()
    if not packed:
        patched += _patch_flash_packed_check()
    registry = getattr(getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None), "_global_mapping", {})
    flash = {key: function for key, function in registry.items() if key.startswith("flash_attention")}
    registry.update({key: _flash_mask_as_all_ones(function) for key, function in flash.items()})
    try:
        yield
    finally:
        registry.update(flash)
        for name, original in saved:
            setattr(masking_utils, name, original)
        for module, name, original in patched:
            setattr(module, name, original)


@contextlib.contextmanager
def passed_checks() -> Iterator[None]:
    """While active, transformers' `torch_compilable_check` passes a fake condition (module docstring)."""
    patched = _patch_checks()
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _patch_checks() -> List[Tuple[Any, str, Any]]:
    """`torch_compilable_check(cond, ...)` passes a fake tensor condition (module docstring), in
    every loaded transformers module that imported it."""
    import sys

    try:
        from transformers.utils import import_utils
    except ImportError:
        return []
    original = getattr(import_utils, "torch_compilable_check", None)
    if original is None:
        return []

    def check(cond: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_fake(cond):
            return None
        return original(cond, *args, **kwargs)

    patched: List[Tuple[Any, str, Any]] = []
    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.startswith("transformers") and \
                getattr(module, "torch_compilable_check", None) is original:
            setattr(module, "torch_compilable_check", check)
            patched.append((module, "torch_compilable_check", original))
    return patched


def _patch_flash_packed_check() -> List[Tuple[Any, str, Any]]:
    """`_is_packed_sequence` answers a fake row as one sequence (module docstring)."""
    try:
        from transformers import modeling_flash_attention_utils as flash_utils
    except ImportError:
        return []
    original = getattr(flash_utils, "_is_packed_sequence", None)
    if original is None:
        return []
    flash_utils._is_packed_sequence = _one_sequence_a_row(original)
    return [(flash_utils, "_is_packed_sequence", original)]


def _patch_4x_mask_helpers() -> List[Tuple[Any, str, Any]]:
    """transformers 4.x: `_prepare_4d_attention_mask_for_sdpa(mask, ...)` and
    `_prepare_4d_causal_attention_mask_for_sdpa(mask, ...)` return None for a fake (all-ones) mask,
    in every loaded transformers module that imported them."""
    import sys

    try:
        from transformers import modeling_attn_mask_utils as utils
    except ImportError:
        return []
    wrappers = {}
    for name in ("_prepare_4d_attention_mask_for_sdpa",):
        original = getattr(utils, name, None)
        if original is None or getattr(original, "_answers_fake_masks", False):
            continue

        def answer(mask: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return None if _is_fake(mask) else _original(mask, *args, **kwargs)

        answer._answers_fake_masks = True  # type: ignore[attr-defined]
        wrappers[name] = (original, answer)
    patched: List[Tuple[Any, str, Any]] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("transformers"):
            continue
        for name, (original, answer) in wrappers.items():
            if getattr(module, name, None) is original:
                setattr(module, name, answer)
                patched.append((module, name, original))
    return patched
