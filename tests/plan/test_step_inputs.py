"""The batch of each task head, and the options a model has no use for."""

from __future__ import annotations

import pytest
import torch

from trainer_memcb.plan.model.step_inputs import head_kind, step_inputs

transformers = pytest.importorskip("transformers")


def meta(class_name: str, config_name: str, **keywords) -> torch.nn.Module:
    # The class first, outside the meta device: its lazy import may be the process's first of
    # torch._dynamo, whose import-time code calls .item(), which torch 2.6 refuses on meta tensors.
    model_class, config = getattr(transformers, class_name), getattr(transformers, config_name)(**keywords)
    with torch.device("meta"):
        return model_class(config)


TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=64)


def shapes(inputs) -> dict:
    return {name: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in inputs.forward.items()}


def test_each_head_gets_its_collators_batch() -> None:
    llama = meta("LlamaForCausalLM", "LlamaConfig", **TEXT)
    assert head_kind(llama) == "causal_lm"
    assert shapes(step_inputs(llama, 2, 8)) == {"input_ids": ((2, 8), "int64"), "attention_mask": ((2, 8), "int64"),
                                                 "labels": ((2, 8), "int64")}
    bert = dict(TEXT, num_labels=1)
    regression = meta("BertForSequenceClassification", "BertConfig", **bert)
    assert shapes(step_inputs(regression, 2, 8))["labels"] == ((2,), "float32")
    qa = meta("BertForQuestionAnswering", "BertConfig", **TEXT)
    assert set(shapes(step_inputs(qa, 2, 8))) == {"input_ids", "attention_mask", "start_positions", "end_positions"}
    tokens = meta("BertForTokenClassification", "BertConfig", **TEXT)
    assert shapes(step_inputs(tokens, 2, 8))["labels"] == ((2, 8), "int64")
    t5 = meta("T5ForConditionalGeneration", "T5Config", d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4,
              vocab_size=64, decoder_start_token_id=0)
    assert shapes(step_inputs(t5, 2, 8, target_len=5)) == {
        "input_ids": ((2, 8), "int64"), "attention_mask": ((2, 8), "int64"), "labels": ((2, 5), "int64"),
        "decoder_input_ids": ((2, 5), "int64")}
    vit = meta("ViTForImageClassification", "ViTConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, image_size=48, patch_size=16)
    assert shapes(step_inputs(vit, 2)) == {"pixel_values": ((2, 3, 48, 48), "float32"), "labels": ((2,), "int64")}
    assert shapes(step_inputs(vit, 2, image_size=64))["pixel_values"] == ((2, 3, 64, 64), "float32")
    whisper = meta("WhisperForConditionalGeneration", "WhisperConfig", d_model=32, encoder_layers=1, decoder_layers=1,
                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   vocab_size=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
                   decoder_start_token_id=1)
    assert shapes(step_inputs(whisper, 2, target_len=6)) == {"labels": ((2, 6), "int64"),
                                                              "input_features": ((2, 8, 32), "float32")}


def test_options_a_model_has_no_use_for_are_refused_in_one_line() -> None:
    vit = meta("ViTForImageClassification", "ViTConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, image_size=32, patch_size=16)
    llama = meta("LlamaForCausalLM", "LlamaConfig", **TEXT)
    with pytest.raises(ValueError, match=r"^ViTForImageClassification takes images, not tokens: --seq-len has no "
                                         r"meaning for it; --image-size \(default: the config's\) applies$"):
        step_inputs(vit, 2, 16)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM is not a sequence-to-sequence model: --target-len has "
                                         r"no meaning for it; --seq-len applies$"):
        step_inputs(llama, 2, 16, target_len=4)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM takes no images: --image-size has no meaning for it$"):
        step_inputs(llama, 2, 16, image_size=32)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM takes tokens: give --seq-len"):
        step_inputs(llama, 2)
    with pytest.raises(ValueError, match=r"^padding=16: expected a whole number from 0 to seq_len - 1 \(15\)$"):
        step_inputs(llama, 2, 16, padding=16)


LLAVA = dict(vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8),
             text_config=dict(model_type="llama", **TEXT), image_token_id=63)


def test_a_vision_language_models_batch_holds_its_image_tokens_where_the_processor_puts_them() -> None:
    llava = meta("LlavaForConditionalGeneration", "LlavaConfig", **LLAVA)
    assert head_kind(llava) == "vision_language"
    inputs = step_inputs(llava, 2, 24)
    assert shapes(inputs) == {"input_ids": ((2, 24), "int64"), "attention_mask": ((2, 24), "int64"),
                              "labels": ((2, 24), "int64"), "pixel_values": ((2, 3, 32, 32), "float32")}
    # (32 / 8)^2 patches: 16 features once the CLS one is dropped ("default"), after a BOS token.
    ids = inputs.forward["input_ids"]
    assert (ids == 63).sum(dim=1).tolist() == [16, 16]
    assert (ids[:, 1:17] == 63).all() and ids[:, 0].ne(63).all()
    # --image-size applies: 48 x 48 makes 36 features; "full" keeps the CLS one.
    assert (step_inputs(llava, 1, 40, image_size=48).forward["input_ids"] == 63).sum() == 36
    full = meta("LlavaForConditionalGeneration", "LlavaConfig", **LLAVA, vision_feature_select_strategy="full")
    assert (step_inputs(full, 1, 24).forward["input_ids"] == 63).sum() == 17


def test_a_vision_language_models_text_must_hold_its_image_tokens() -> None:
    llava = meta("LlavaForConditionalGeneration", "LlavaConfig", **LLAVA)
    with pytest.raises(ValueError, match=r"^seq_len=16: LlavaForConditionalGeneration puts 16 image tokens and a BOS "
                                         r"token in the text of each 32x32 image: give at least 17$"):
        step_inputs(llava, 2, 16)
