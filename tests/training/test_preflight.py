"""`OptimizerMemoryCallback(preflight=...)`: the run's own step planned at on_train_begin, one
warning naming the best proposal when it will not fit, the run itself unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from helpers import rotary_buffers_beyond_transformers_5s
from trainer_memcb import OptimizerMemoryCallback

SEQ = 64


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        ids = torch.arange(SEQ) % 100
        return {"input_ids": ids, "labels": ids.clone()}


def _train(tmp_path, preflight):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=256, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    callback = OptimizerMemoryCallback(what_if=(), preflight=preflight)
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=16, optim="adamw_torch",
                             report_to=[], use_cpu=True, logging_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback])
        trainer.train()
    said = [str(w.message) for w in caught if "trainer_memcb: the planned training step" in str(w.message)]
    return callback, trainer, said


def test_a_step_that_will_not_fit_warns_once_naming_the_best_proposal(tmp_path):
    callback, trainer, said = _train(tmp_path, 6 * 2**20)
    result = callback.preflight_result
    # The model's max_position_embeddings (no tokenizer, no max_length): the longest sequence.
    assert result.seq_len == SEQ and result.plan.step.peak_bytes == 14_835_616 + rotary_buffers_beyond_transformers_5s(trainer.model)
    assert len(said) == 1 and "the best proposal, " in said[0] and result.search.best.label in said[0]
    # The run is the user's own: its arguments untouched, its one step taken.
    assert trainer.args.per_device_train_batch_size == 16 and trainer.args.gradient_accumulation_steps == 1
    assert trainer.state.global_step == 1


def test_a_step_that_fits_says_nothing(tmp_path):
    callback, trainer, said = _train(tmp_path, 64 * 2**20)
    assert said == [] and callback.preflight_result.search is None


def test_a_bad_preflight_is_refused():
    with pytest.raises(ValueError, match="preflight=-1"):
        OptimizerMemoryCallback(preflight=-1)


def test_the_sequence_planned_is_the_longest_batch_the_collator_makes(tmp_path):
    from datasets import Dataset
    from tests.training.test_trl import char_tokenizer
    from transformers import DataCollatorForLanguageModeling

    # Lengths 5, 20, 9, 7; the run trains on three of them (select), so 20 is never seen: the
    # longest is 9, padded to a multiple of 8 by the collator: 16 (not the model's 64).
    rows = [{"input_ids": [3] * length} for length in (5, 20, 9, 7)]
    dataset = Dataset.from_list(rows).select([0, 2, 3])
    collator = DataCollatorForLanguageModeling(char_tokenizer(), mlm=False, pad_to_multiple_of=8)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=256, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config)
    callback = OptimizerMemoryCallback(what_if=(), preflight=64 * 2**20)
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=3, optim="adamw_torch",
                             report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[callback])
    trainer.train()
    result = callback.preflight_result
    batch = next(iter(trainer.get_train_dataloader()))
    assert result.seq_len == 16 == batch["input_ids"].shape[1]
    assert (result.plan.settings.batch_size, result.plan.settings.seq_len) == (3, 16)


def test_the_longest_example_is_read_from_lengths_only():
    from trainer_memcb.training.preflight import longest_batch_len

    rows = [{"input_ids": [1] * 5}, {"input_ids": [1] * 11}]
    assert longest_batch_len(rows) == 11
    assert longest_batch_len(rows, type("Pads", (), {"pad_to_multiple_of": 4})()) == 12
    # A dataset that would have to make its items to say their lengths: not read (max_length instead).
    assert longest_batch_len(_Tokens()) is None
