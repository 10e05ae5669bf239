"""The hub's flash kernels (`attn_implementation="kernels-community/flash-attn2"`): the ones that are
flash-attn 2's own kernels planned by its stand-ins (plan/step/flash_attn.py), registered for the
trace as transformers' `load_and_register_attn_kernel` registers them, and the registries restored.

Not run here: the `kernels` package and the hub (offline; the kernels are CUDA builds). What is
checked is that the plan takes transformers' own path for a hub kernel (its `flash_attention_forward`,
its `_pad_input`) with the stand-ins, against a real CPU run of that path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer_memcb.plan.settings.attention import HUB_FLASH_ATTN_2, hub_kernel_repo, is_flash_path, is_planned_hub_flash
from trainer_memcb.plan.step.flash_attn import flash_attention_as_cuda

transformers = pytest.importorskip("transformers")
from helpers import flash_forward_saved_bytes, tiny_bf16_llama  # noqa: E402

HUB = "kernels-community/flash-attn2"


def test_names_are_read_as_transformers_reads_a_hub_kernel():
    # integrations/hub_kernels.py `is_kernel`: "org/repo[@revision][:function]"
    assert hub_kernel_repo("kernels-community/flash-attn2@v4:flash_attn_func") == HUB
    assert hub_kernel_repo("flash_attention_2") is None and hub_kernel_repo("a/b/c") is None
    assert [is_planned_hub_flash(name) for name in HUB_FLASH_ATTN_2 + ("kernels-community/vllm-flash-attn3",)] == [
        True, True, False]
    assert is_flash_path("flash_attention_3") and is_flash_path(HUB) and not is_flash_path("sdpa")


def test_the_registries_are_restored_after_the_trace():
    from transformers import masking_utils, modeling_utils

    attentions = modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping
    masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    before = (dict(attentions), dict(masks))
    with flash_attention_as_cuda((9, 0), "H100", 3, HUB):
        assert HUB in attentions and HUB in masks
    assert (attentions, masks) == before


def _real_saved_bytes(attn: str, padding: int) -> int:
    saved, run = flash_forward_saved_bytes(attn, padding, flash_attention_as_cuda((9, 0), "H100", padding, attn))
    assert run.calls == {"flash_attn_varlen_func" if padding else "flash_attn_func": 1}
    return saved


def _planned(attn: str, padding: int = 0):
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.step.trace import trace_step_once

    with torch.device("meta"):
        meta = tiny_bf16_llama()
    meta.config._attn_implementation = attn
    settings = dataclasses.replace(resolve_settings(batch_size=2, optimizer="adamw_torch", padding=padding,
                                                    attn_implementation=attn),
                                   device_type="cuda", seq_len=256, gpu="H100")
    return trace_step_once(meta, settings, args=None, step_dtype=torch.bfloat16)


def test_a_hub_flash_attn_2_kernel_is_planned_as_flash_attention_2():
    hub, fa2 = _planned(HUB), _planned("flash_attention_2")
    # The same kernels, the same autograd functions: what is saved is FA2's to the byte.
    assert hub.activations_bytes == fa2.activations_bytes
    assert any(note.startswith(f"attention planned as {HUB} runs it, the hub's build of flash-attn 2's kernels")
               and "flash_attn_func (1 calls)" in note for note in hub.notes), hub.notes


def test_a_padded_batch_takes_transformers_own_pad_input():
    # transformers pads a hub kernel's output back with its own _pad_input (an index_put saving the indices), not
    # flash-attn's bert_padding: the plan's padded step over its unpadded one equals a real CPU run of that path.
    real = _real_saved_bytes(HUB, 4) - _real_saved_bytes(HUB, 0)
    planned = _planned(HUB, 4).activations_bytes - _planned(HUB, 0).activations_bytes
    assert planned == real == 66_380
