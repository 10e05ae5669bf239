"""Padding-free packing (`--packing TOKENS`): the batch `DataCollatorWithFlattening` makes, planned
with the attentions that keep its sequences apart, and equal to a real CPU step of that batch."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import pytest
import torch

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.model.step_inputs import packed_lengths, step_inputs

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_step_memory import meta_builder, profiled_peak, real_activations, real_model  # noqa: E402

SEQ, TOKENS = 16, 40  # two sequences of 16 and one of 8


def collated(seq_len: int, tokens: int, **options: Any) -> Dict[str, Any]:
    """The real collator's batch of sequences of the plan's lengths."""
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": list(range(1, length + 1))} for length in packed_lengths(seq_len, tokens)]
    return DataCollatorWithFlattening(**options)(features)


def meta_llama(attn: str) -> torch.nn.Module:
    # Built with sdpa, then switched as the plan switches it (flash-attn is not installed here).
    model = meta_builder("llama", "sdpa", False)()
    model.config._attn_implementation = attn
    return model


def described(batch: Dict[str, Any]) -> Dict[str, Any]:
    return {key: (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()}


def test_the_packed_batch_is_the_collators() -> None:
    assert packed_lengths(SEQ, TOKENS) == [16, 16, 8] and packed_lengths(SEQ, 32) == [16, 16]
    planned = step_inputs(meta_llama("sdpa"), 1, SEQ, packing=TOKENS)
    real = collated(SEQ, TOKENS)
    assert described(planned.forward) == described(real)
    assert torch.equal(planned.forward["position_ids"], real["position_ids"])  # restarting at each sequence
    assert planned.labels is planned.forward["labels"] and not planned.held  # no attention mask
    # flash_attention_2 takes the collator's boundaries, as return_flash_attn_kwargs=True gives them.
    flash = step_inputs(meta_llama("flash_attention_2"), 1, SEQ, packing=TOKENS).forward
    real = collated(SEQ, TOKENS, return_flash_attn_kwargs=True)
    assert described(flash) == described(real)
    assert torch.equal(flash["cu_seq_lens_q"], real["cu_seq_lens_q"]) and flash["max_length_q"] == real["max_length_q"] == SEQ
    assert flash["cu_seq_lens_q"] is not flash["cu_seq_lens_k"]


@pytest.mark.parametrize("build,options,line", [
    (lambda: meta_llama("sdpa"), dict(batch_size=2), "--packing makes the micro-batch one row"),
    (lambda: meta_llama("sdpa"), dict(packing=8), "--packing 8 is fewer tokens than one sequence"),
    (lambda: meta_llama("flex_attention"), {}, "--packing with attention 'flex_attention': packed rows are planned"),
])
def test_a_packed_row_that_cannot_be_planned_is_refused_naming_what_would(build, options, line) -> None:
    arguments = dict(dict(batch_size=1, packing=TOKENS), **options)
    with pytest.raises(ValueError, match=line):
        step_inputs(build(), arguments.pop("batch_size"), SEQ, **arguments)


def test_a_model_whose_mask_ignores_positions_is_refused_under_sdpa() -> None:
    from trainer_memcb.plan.model.packed_mask import _calls_with_position_ids

    assert _calls_with_position_ids("m = create_causal_mask(config=c, position_ids=p)\n")
    assert not _calls_with_position_ids("m = create_causal_mask(config=c, mask=f(x))\np = position_ids\n")
    bert = meta_builder("bert", "sdpa", False)()
    with pytest.raises(ValueError, match="is not a causal LM"):
        step_inputs(bert, 1, SEQ, packing=TOKENS)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_packed_plan_is_a_real_step_of_the_collators_batch(attn: str) -> None:
    from transformers import TrainingArguments

    plan, _ = plan_step_memory(meta_builder("llama", attn, False), batch_size=1, seq_len=SEQ, packing=TOKENS,
                               attn_implementation=attn, args=TrainingArguments("unused", report_to=[]),
                               optimizer="adamw_torch", model_states=False, device_type="cpu")
    assert plan.step.problem is None
    packed = plan.settings.packing
    assert (packed.tokens, packed.sequences, packed.padded_batch_size, packed.padded_tokens) == (40, 3, 2, 32)
    batch = collated(SEQ, TOKENS)
    # As the Trainer passes it (transformers 5: a 0-dim float32 count of the labels it learns from).
    batch["num_items_in_batch"] = torch.tensor(float((batch["labels"] != -100).sum()))
    assert real_activations(real_model("llama", attn, torch.float32, False, False), batch) == plan.step.activations_bytes
    start, above = profiled_peak(real_model("llama", attn, torch.float32, False, False), batch)
    # Measured here (torch 2.13, transformers 5.25): sdpa 1,690,080 planned and profiled; eager
    # 1,727,200 planned, 1,727,216 profiled (-16: 0-dim scalars made without the dispatcher, as for
    # the unpacked batch in test_step_memory). Without the packed mask (the positions read as one
    # sequence) sdpa would save no mask and run is_causal.
    assert abs(plan.step.peak_bytes - (start + above)) <= 16
    if attn == "sdpa" and int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 4.57 with torch 2.6: 12 bytes under (4.x counts num_items_in_batch as an
        # int64, this batch passes 5's float32; the 0-dim scalars as above).
        assert plan.step.peak_bytes == start + above
