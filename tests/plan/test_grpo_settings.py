"""The GRPO step's settings (`trainer_memcb.plan.step.grpo.grpo_step_from_config`) from real
`trl.GRPOConfig`s, each refusal as TRL's, and colocated vLLM's share of the device (a rule: vLLM
cannot run here) taken from what training may use."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers import requires_version

pytestmark = [requires_version("trl", "1.16", "GRPOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")


def _config(tmp_path: Any, **values: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, **values)


def _fields(tmp_path: Any, **values: Any) -> Any:
    """A namespace of a made GRPOConfig's fields, some changed as a hand-written file could."""
    return SimpleNamespace(**dict(vars(_config(tmp_path)), **values))


def test_a_grpoconfig_gives_its_step(tmp_path: Any) -> None:
    from trainer_memcb.plan.step.grpo import GrpoStep, grpo_step_from_config

    step = grpo_step_from_config(_config(tmp_path, beta=0.04, steps_per_generation=2), peft=False)
    assert (step.beta, step.reference, step.num_generations, step.steps_per_generation, step.loss_type,
            step.max_completion_length, step.old_log_probs) == (0.04, "model", 4, 2, "dapo", 8, True)
    assert step.generation_rows(4) == 8
    assert dict(step.generation_kwargs)["max_new_tokens"] == 8
    peft = grpo_step_from_config(_config(tmp_path, beta=0.04), peft=True)
    assert (peft.reference, peft.old_log_probs, peft.steps_per_generation) == ("adapters-disabled", False, 1)
    assert grpo_step_from_config(_config(tmp_path), peft=True).reference == "none"  # beta 0: TRL's default
    assert isinstance(step, GrpoStep) and step.trainer == "grpo"


@pytest.mark.parametrize("values,message", [
    ({"num_generations": 3}, "generation_batch_size 4: TRL requires a multiple of num_generations (3)"),
    ({"num_generations": 1}, "num_generations 1: GRPO requires at least 2 generations per prompt"),
    ({"generation_batch_size": 6, "steps_per_generation": None}, "generation_batch_size 6: TRL requires a multiple "
                                                                 "of the global batch size (4 x 1 processes)"),
    ({"generation_batch_size": 8, "steps_per_generation": 1}, "generation_batch_size 8 and steps_per_generation 1: "
                                                              "TRL refuses both at once"),
    ({"loss_type": "nope"}, "loss_type 'nope': TRL takes one of grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile 0.5: the GRPO step is planned with its default so far"),
    ({"beta": -0.1}, "beta -0.1: expected a number of at least 0"),
    ({"sync_ref_model": True}, "sync_ref_model with beta 0: TRL makes no reference model"),
    ({"max_completion_length": 0}, "max_completion_length 0: expected a whole number of at least 1"),
    ({"importance_sampling_level": "word"}, "importance_sampling_level 'word': TRL takes one of token, sequence"),
    ({"use_vllm": True, "vllm_mode": "remote"}, "vllm_mode 'remote': expected one of colocate, server"),
    ({"use_vllm": True, "vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization 1.5: expected a share"),
])
def test_each_refusal_names_the_field_its_value_and_what_is_allowed(tmp_path: Any, values: Any, message: str) -> None:
    from trainer_memcb.plan.step.grpo import grpo_step_from_config

    with pytest.raises(ValueError) as refused:
        grpo_step_from_config(_fields(tmp_path, **values), peft=False)
    assert str(refused.value).startswith(message), str(refused.value)


def _plan(tmp_path: Any, **values: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.step.grpo import grpo_step_from_config

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(vocab_size=34, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                                tie_word_embeddings=False, pad_token_id=0, eos_token_id=1))

    step = grpo_step_from_config(_config(tmp_path, **values), peft=False)
    plan, _ = plan_step_memory(build, batch_size=4, seq_len=10, optimizer="adamw_torch", device_type="cpu",
                               attn_implementation="sdpa", preference=step, model_states=False,
                               device_memory=80 * 1024**3, reserve_bytes=1024**3)
    return plan


def test_colocated_vllm_takes_its_share_of_the_device_from_training(tmp_path: Any) -> None:
    alone = _plan(tmp_path)
    colocated = _plan(tmp_path, use_vllm=True, vllm_gpu_memory_utilization=0.3)
    server = _plan(tmp_path, use_vllm=True, vllm_mode="server")
    # vLLM's gpu_memory_utilization: the share of the device's total memory its engine holds.
    share = int(0.3 * 80 * 1024**3)
    assert (alone.device.reserve_bytes, colocated.device.reserve_bytes, server.device.reserve_bytes) == (
        1024**3, 1024**3 + share, 1024**3)
    for plan in (alone, colocated, server):
        assert plan.verdict.margin_bytes == 80 * 1024**3 - plan.device.reserve_bytes - plan.step.peak_bytes
    # With vLLM TRL computes the old policy's log-probs after generation (its importance sampling).
    assert colocated.settings.preference.generation.old_log_probs and not alone.settings.preference.generation.old_log_probs
    assert colocated.settings.preference.generation.engine == "vllm-colocate"
    assert colocated.settings.preference.generation.vllm_gpu_memory_utilization == 0.3
    assert server.settings.preference.generation.vllm_gpu_memory_utilization is None
    assert any(note.startswith("vLLM colocated") and f"{share:,} bytes" in note for note in colocated.step.notes)
    assert any(note.startswith("vLLM in server mode") for note in server.step.notes)
