"""TRL's DPO step planned (`trainer_memcb.plan.step.preference`) against a real `DPOTrainer` step on
the CPU: a tiny Llama, the character tokenizer of `tests/training/test_trl.py`, preference pairs
long enough that every row is cut to `max_length` (an all-ones attention mask, as the plan's batch),
one step run to make the optimizer state, the second profiled (`profiled_run_peak`) above what was
alive before it."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import pytest
import torch

from helpers import requires_version, trl_llama_config, trl_step_peak

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "DPOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

BATCH, MAX_LENGTH = 2, 32


def _build_meta() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_config())


def _config() -> Any:
    import training.test_trl as trl_tests

    return trl_llama_config(vocab_size=len(trl_tests.VOCAB))


def _pairs() -> Any:
    from datasets import Dataset

    # Prompts of 10 characters and answers of 40: every row is cut to MAX_LENGTH tokens.
    prompts = ["the cat sa", "a dog ran ", "hello ther", "good day t"]
    return Dataset.from_dict({"prompt": prompts, "chosen": ["t on the mat and then it slept there all d"] * 4,
                              "rejected": ["o far away and never came back to us agai"] * 4})


def _real_step_peak(folder: str, tmp: str, **config: Any) -> Tuple[int, int]:
    """What was alive before the second step (parameters, buffers, batch, optimizer state, the
    reference's parameters) and the most the profiler records alive above it during that step:
    `Trainer.training_step` (DPO's loss, its backward), clipping at 1.0, AdamW's step, zero_grad."""
    from trl import DPOConfig, DPOTrainer

    import training.test_trl as trl_tests

    peft = config.pop("peft", False)
    args = DPOConfig(tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                     per_device_train_batch_size=BATCH, seed=0, max_length=MAX_LENGTH, **config)
    extra: Dict[str, Any] = {}
    if peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(model=folder, args=args, train_dataset=_pairs(), processing_class=trl_tests.char_tokenizer(),
                         **extra)
    model = trainer.model
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape == (2 * BATCH, MAX_LENGTH) and bool(batch["attention_mask"].all())
    return trl_step_peak(trainer, batch)


def _planned(reference: str) -> Any:
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.step.preference import DpoStep

    def build() -> torch.nn.Module:
        meta = _build_meta()
        return add_lora_adapters(meta, 4, "q_proj,v_proj") if reference == "adapters-disabled" else meta

    plan, _ = plan_step_memory(build, batch_size=BATCH, seq_len=MAX_LENGTH, optimizer="adamw_torch",
                               device_type="cpu", attn_implementation="sdpa", preference=DpoStep(reference=reference),
                               model_states=False)
    return plan


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> str:
    import training.test_trl as trl_tests

    return trl_tests.saved_tiny_llama(str(tmp_path_factory.mktemp("dpo-llama")))


@pytest.mark.parametrize("reference,config", [("model", {}), ("precomputed", {"precompute_ref_log_probs": True}),
                                              ("adapters-disabled", {"peft": True})])
def test_the_planned_dpo_step_peak_is_the_real_one(folder: str, tmp_path: Any, reference: str,
                                                   config: Dict[str, Any]) -> None:
    plan = _planned(reference)
    start, above = _real_step_peak(folder, str(tmp_path), **config)
    # Measured (torch 2.13, transformers 5.25, TRL 1.16): the peak is in the backward, where TRL's
    # chunked log-prob backward holds its chunk's buffers ("other"). The real peak is 4 bytes more
    # without a reference model, 68 with one: 4 are the 0-dim fp32 loss `Trainer.training_step` makes
    # (`loss / self.current_gradient_accumulation_steps`) and holds through backward, which the plan
    # does not make; the other 64 with the reference model are small scalars made in C++ during the
    # reference's forward that the fake trace does not see (not identified further).
    # With PEFT (LoRA r=4 on q_proj and v_proj) and no ref_model the real step holds 16,932 bytes more
    # than the plan: DPOConfig's default gradient_checkpointing=True makes DPOTrainer.__init__ call
    # `model.enable_input_require_grads()`, so the backward makes the embeddings' output gradient,
    # while this test's step, run without `train()`, does not turn checkpointing itself on (with
    # gradient_checkpointing=False the difference is 36 bytes, as in KTO's and GRPO's PEFT steps;
    # tests/plan/test_kto_step.py asserts both). Asserted as measured, so that a change shows.
    expected = {"model": (17_413_348, 368_340, 17_045_076, 68), "precomputed": (17_322_100, 277_028, 17_045_076, 4),
                "adapters-disabled": (16_958_512, 106_720, 16_868_724, 16_932)}
    planned, real_start, real_above, difference = expected[reference]
    assert (plan.step.peak_bytes, start, above) == (planned, real_start, real_above)
    assert start + above - plan.step.peak_bytes == difference
    assert plan.step.peak_phase == "backward"
    assert plan.step.peak_parts.get("reference_model", 0) == (91_264 if reference == "model" else 0)


def test_liger_kernels_under_dpo_are_the_layer_kernels_alone() -> None:
    # trl 1.16's DPOTrainer.__init__ turns liger's fused loss off (`{**liger_kernel_config,
    # "fused_linear_cross_entropy": False}`: its own fused LM head stays); the Trainer then binds the layer kernels
    # to the policy, and liger's RoPE, put in the modeling module, runs in the reference's forward too.
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.step.preference import DpoStep

    plans = {liger: plan_step_memory(_build_meta, batch_size=BATCH, seq_len=MAX_LENGTH, optimizer="adamw_torch",
                                     device_type="cuda", attn_implementation="sdpa", preference=DpoStep(),
                                     model_states=False, use_liger_kernel=liger)[0] for liger in (None, True)}
    [note] = [note for note in plans[True].step.notes if note.startswith("use_liger_kernel")]
    assert note.endswith(": rms_norm (5 calls), rope (4 calls), swiglu (2 calls)")
    assert (plans[None].step.activations_bytes, plans[True].step.activations_bytes) == (650_316, 502_860)
