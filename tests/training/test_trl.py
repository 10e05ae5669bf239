"""TRL's trainers with the callback: SFT (full and LoRA), DPO and GRPO, each a real run of two
steps on the CPU with a tiny Llama built from a config, a character-level tokenizer built here and
a dataset of a few strings. Every figure of every training entry is checked against a count made
here without the library: the optimizer state walked by `reference_walker`, the parameters,
gradients and the reference model summed tensor by tensor, AdamW's state from its definition."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from helpers import entries_with
from reference_walker import held_bytes
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.activations_probe import ACTIVATION_KEYS, ACTIVATIONS_SUPPORTED
from trainer_memcb.training.figures import PHASE_KEYS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

trl = pytest.importorskip("trl", reason="TRL is in the test extra; without it its trainers cannot be tried")
from datasets import Dataset  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,!?"
SPECIAL = ["<pad>", "<eos>", "<unk>"]
VOCAB = {token: index for index, token in enumerate(SPECIAL + list(CHARACTERS))}
TEXTS = ["the cat sat on the mat.", "a dog ran far away!", "hello there, friend.", "good day to you."]
PROMPTS = ["the cat", "a dog", "hello", "good"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, built in memory (nothing downloaded)."""
    tokenizer = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=None,
    ))


def saved_tiny_llama(folder: str) -> str:
    """The tiny model and tokenizer in a folder: DPO and GRPO then build their reference model from
    it themselves, as they do from a hub name."""
    tiny_llama().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def config_kwargs(output_dir: str) -> Dict[str, Any]:
    return dict(output_dir=output_dir, use_cpu=True, max_steps=2, logging_steps=1, report_to=[],
                save_strategy="no", disable_tqdm=True, per_device_train_batch_size=2, seed=0)


def callback() -> OptimizerMemoryCallback:
    return OptimizerMemoryCallback(what_if=())


def param_bytes(params: List[torch.Tensor]) -> int:
    return sum(param.numel() * param.element_size() for param in params)


def truth(trainer: Any) -> Dict[str, int]:
    """Every figure, counted here: the inner torch AdamW walked for its state, the parameters and
    gradients summed (every trainable parameter has one before the step), AdamW's definition
    (exp_avg and exp_avg_sq in the parameter's dtype, a 0-dim fp32 step per tensor) for the
    estimate. The reference model's parameters are summed too, after checking that they share
    no storage with the policy's."""
    model = trainer.model
    optimizer = trainer.optimizer.optimizer
    assert type(optimizer) is torch.optim.AdamW
    trainable = [param for param in model.parameters() if param.requires_grad]
    held = held_bytes(optimizer, model)
    expected = {
        "optimizer_state_bytes": held,
        "optimizer_state_estimate_bytes": 2 * param_bytes(trainable) + 4 * len(trainable),
        "optimizer_state_elements": 2 * sum(param.numel() for param in trainable) + len(trainable),
        "optimizer_trainable_params": sum(param.numel() for param in trainable),
        "optimizer_state_unexpected_bytes": 0,
        "model_params_bytes": param_bytes(list(model.parameters())),
        "model_grads_bytes": param_bytes(trainable),
    }
    reference = getattr(trainer, "ref_model", None)
    reference_bytes = 0
    if reference is not None:
        policy_storages = {param.untyped_storage().data_ptr() for param in model.parameters()}
        assert not any(param.untyped_storage().data_ptr() in policy_storages for param in reference.parameters())
        reference_bytes = expected["reference_model_params_bytes"] = param_bytes(list(reference.parameters()))
    expected["model_states_bytes"] = (expected["model_params_bytes"] + expected["model_grads_bytes"] + held
                                      + reference_bytes)
    expected["model_states_estimate_bytes"] = (expected["model_params_bytes"] + expected["model_grads_bytes"]
                                               + expected["optimizer_state_estimate_bytes"] + reference_bytes)
    return expected


# The activations are checked to the byte against an independent count in test_activations.py;
# here each training entry must carry them (where this torch measures them), the rest exactly. The
# phases of a trainer that generates (GRPO) are checked in test_generation_phases.py; the other
# trainers never carry them.
FIGURE_KEYS = set(OptimizerMemoryCallback.KEYS) - set(ACTIVATION_KEYS) - set(PHASE_KEYS)


def logged_figures(trainer: Any) -> List[Dict[str, int]]:
    entries = entries_with(trainer.state.log_history, "loss")
    assert [entry["step"] for entry in entries] == [1, 2]
    for entry in entries:
        if ACTIVATIONS_SUPPORTED:
            assert 0 < entry["activations_bytes"] <= entry["activations_peak_bytes"]
        else:
            assert not set(ACTIVATION_KEYS) & set(entry)
        assert set(PHASE_KEYS) <= set(entry) if "reward" in entry else not set(PHASE_KEYS) & set(entry)
    return [{key: value for key, value in entry.items() if key in FIGURE_KEYS} for entry in entries]


def check(trainer: Any) -> Dict[str, int]:
    expected = truth(trainer)
    for figures in logged_figures(trainer):
        assert figures == expected  # every key logged, each exactly, and no other
    return expected


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return saved_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def test_sft_full_fine_tune(tmp_path):
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=tiny_llama(), args=SFTConfig(max_length=32, **config_kwargs(str(tmp_path))),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=char_tokenizer(),
                         callbacks=[callback()])
    trainer.train()
    expected = check(trainer)
    assert expected == {
        "optimizer_state_bytes": 182_612, "optimizer_state_estimate_bytes": 182_612,
        "optimizer_state_elements": 45_653, "optimizer_trainable_params": 22_816,
        "optimizer_state_unexpected_bytes": 0, "model_params_bytes": 91_264, "model_grads_bytes": 91_264,
        "model_states_bytes": 365_140, "model_states_estimate_bytes": 365_140,
    }


def test_sft_with_lora(tmp_path):
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=tiny_llama(), args=SFTConfig(max_length=32, **config_kwargs(str(tmp_path))),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=char_tokenizer(),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                         callbacks=[callback()])
    trainer.train()
    expected = check(trainer)
    # 2 layers x (q_proj, v_proj) x (A 4x32 + B 32x4) = 1,024 adapter values; the base stays frozen.
    assert expected["optimizer_trainable_params"] == 1_024
    assert expected == {
        "optimizer_state_bytes": 8_224, "optimizer_state_estimate_bytes": 8_224,
        "optimizer_state_elements": 2_056, "optimizer_trainable_params": 1_024,
        "optimizer_state_unexpected_bytes": 0, "model_params_bytes": 95_360, "model_grads_bytes": 4_096,
        "model_states_bytes": 107_680, "model_states_estimate_bytes": 107_680,
    }


def test_dpo_counts_its_reference_model(tmp_path, folder):
    from trl import DPOConfig, DPOTrainer

    dataset = Dataset.from_dict({"prompt": PROMPTS, "chosen": [" sat.", " ran.", " there.", " day."],
                                 "rejected": [" ran.", " sat.", " day.", " there."]})
    trainer = DPOTrainer(model=folder, args=DPOConfig(max_length=32, **config_kwargs(str(tmp_path))),
                         train_dataset=dataset, processing_class=char_tokenizer(), callbacks=[callback()])
    assert isinstance(trainer.ref_model, LlamaForCausalLM)  # TRL built a frozen copy
    trainer.train()
    expected = check(trainer)
    assert expected["reference_model_params_bytes"] == expected["model_params_bytes"] == 91_264
    assert expected["model_states_bytes"] == expected["model_states_estimate_bytes"] == 365_140 + 91_264


def test_dpo_with_lora_has_no_reference_model(tmp_path, folder):
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    dataset = Dataset.from_dict({"prompt": PROMPTS, "chosen": [" sat.", " ran.", " there.", " day."],
                                 "rejected": [" ran.", " sat.", " day.", " there."]})
    trainer = DPOTrainer(model=folder, args=DPOConfig(max_length=32, **config_kwargs(str(tmp_path))),
                         train_dataset=dataset, processing_class=char_tokenizer(), callbacks=[callback()],
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert trainer.ref_model is None  # the adapters are disabled to get the reference
    trainer.train()
    expected = check(trainer)
    assert "reference_model_params_bytes" not in expected
    assert expected["model_states_bytes"] == 107_680


def test_grpo_with_a_kl_term_counts_its_reference_model(tmp_path, folder):
    from trl import GRPOConfig, GRPOTrainer

    def distinct_characters(completions: List[str], **_: Any) -> List[float]:
        return [float(len(set(completion))) for completion in completions]

    trainer = GRPOTrainer(
        model=folder, reward_funcs=distinct_characters,
        args=GRPOConfig(max_completion_length=4, num_generations=2, beta=0.1, **config_kwargs(str(tmp_path))),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=char_tokenizer(),
        callbacks=[callback()],
    )
    assert isinstance(trainer.ref_model, LlamaForCausalLM)  # beta > 0: a frozen copy for the KL term
    trainer.train()
    expected = check(trainer)
    assert expected["reference_model_params_bytes"] == 91_264
    assert expected["model_states_bytes"] == expected["model_states_estimate_bytes"] == 456_404
