"""`OptimizerMemoryCallback(preflight=...)`: the run's own step planned at on_train_begin, one
warning naming the best proposal when it will not fit, the run itself unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

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
    assert result.seq_len == SEQ and result.plan.peak_bytes == 14_835_616
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
