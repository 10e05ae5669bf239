"""TRL's RLOO step planned (`trainer_memcb.plan.step.rloo`, `.rloo_generation`) against a real
`RLOOTrainer` step on the CPU, as `tests/plan/test_grpo_step.py` checks GRPO's: the same tiny Llama,
prompts of 10 tokens, a reward function in Python, transformers' generation made to run every
completion to `max_completion_length`. One step is run to make the optimizer state; then the
generation phase (`_prepare_inputs` on a step that generates) and the training phase
(`training_step` on the buffered micro-batch, clipping, AdamW's step, zero_grad) are each profiled
above what was alive before it."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import pytest
import torch

from helpers import profiled_run_peak, requires_version, storage_bytes

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "RLOOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

BATCH, GENERATIONS, PROMPT, COMPLETION = 4, 4, 10, 8


def _rloo_config(tmp: str, beta: float, **extra: Any) -> Any:
    from trl import RLOOConfig

    completion = extra.pop("max_completion_length", COMPLETION)
    return RLOOConfig(tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                      per_device_train_batch_size=BATCH, num_generations=GENERATIONS,
                      max_completion_length=completion, beta=beta, generation_kwargs={"min_new_tokens": completion},
                      gradient_checkpointing=False,  # the Trainer enables it in train(), which the test does not run
                      **extra)


def _real_phase_peaks(folder: str, tmp: str, beta: float, peft: bool = False,
                      **extra: Any) -> Dict[str, Tuple[int, int]]:
    """Each phase's start (parameters, buffers, optimizer state, the reference's parameters, and
    for training the buffered generation batch) and the most the profiler records alive above it."""
    from datasets import Dataset
    from trl import RLOOTrainer

    import training.test_trl as trl_tests
    from plan.test_grpo_step import _distinct_characters

    prompts = ["the cat sa", "a dog ran ", "hello ther", "good day t"]
    more: Dict[str, Any] = {}
    if peft:
        from peft import LoraConfig

        more["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = RLOOTrainer(model=folder, reward_funcs=_distinct_characters, args=_rloo_config(tmp, beta, **extra),
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=trl_tests.char_tokenizer(), **more)
    model = trainer.model
    model.train()
    raw = next(iter(trainer.get_train_dataloader()))
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # as train() sets it for each step
    optimizer, generate_inputs, prepared = trainer.optimizer, trainer._prepare_inputs, {}

    def generation() -> None:
        trainer._buffered_inputs, trainer._step = None, 0  # a step that generates
        prepared["inputs"] = generate_inputs(raw)

    def training() -> None:
        trainer._prepare_inputs = lambda inputs: inputs  # the buffered micro-batch, no new generation
        try:
            trainer.training_step(model, prepared["inputs"], None)
        finally:
            trainer._prepare_inputs = generate_inputs
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    generation()
    training()
    resident = list(model.parameters()) + list(model.buffers())
    resident += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    if trainer.ref_model is not None:
        resident += list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())
    prepared.clear()
    start = storage_bytes(resident)
    peaks = {"generation": (start, profiled_run_peak(generation))}
    assert prepared["inputs"]["completion_ids"].shape == (BATCH, trainer.args.max_completion_length)
    assert sorted(prepared["inputs"]) == ["advantages", "completion_ids", "completion_mask", "old_logps",
                                          "prompt_ids", "prompt_mask"]
    buffered = [v for batch in trainer._buffered_inputs for v in batch.values() if isinstance(v, torch.Tensor)]
    start = storage_bytes(resident + buffered)
    peaks["training"] = (start, profiled_run_peak(training))
    return peaks


def _planned(beta: float, tmp: str, peft: bool = False, **extra: Any) -> Any:
    from transformers import LlamaForCausalLM

    from plan.test_grpo_step import _config
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.step.rloo import rloo_step_from_config

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            meta = LlamaForCausalLM(_config())
        return add_lora_adapters(meta, 4, "q_proj,v_proj") if peft else meta

    step = rloo_step_from_config(_rloo_config(tmp, beta, **extra), peft=peft)
    # RLOOConfig's bf16 (True by default) is the Trainer's CPU autocast in bf16.
    plan, _ = plan_step_memory(build, batch_size=BATCH, seq_len=PROMPT, optimizer="adamw_torch",
                               precision="autocast-bf16", device_type="cpu", attn_implementation="sdpa",
                               preference=step, model_states=False)
    return plan


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> str:
    import training.test_trl as trl_tests

    return trl_tests.saved_tiny_llama(str(tmp_path_factory.mktemp("rloo-llama")))


# Measured (torch 2.13, transformers 5.25, TRL 1.16), per case and phase: the planned peak, the real
# phase's start and the most alive above it, and how many bytes the real peak is above the plan:
# the residues of GRPO's step (`tests/plan/test_grpo_step.py`), which this generation and training share:
# - generation: exact without a reference and with PEFT's; 64 bytes with the frozen reference model
#   (scalars made in C++ in its forward); exact with steps_per_generation 2 too;
# - training: 4 bytes (the loss `Trainer.training_step` divides by the accumulation steps), 68 with
#   the reference model (its forward's 64 bytes, still alive), 36 with PEFT's adapters.
# RLOO's old log-probs are always computed after generation, each chunk's forward in its own
# `accelerator.autocast()`: traced in one autocast around both models' forwards, the policy's cast
# bf16 weights (40,768 bytes here) would stay cached through the reference's forward, which the
# "beta 0.1" case would show.
CASES = {
    "beta 0": (dict(beta=0.0), {"generation": (4_828_120, 273_940, 4_554_180, 0),
                                "training": (5_123_540, 275_124, 4_848_420, 4)}),
    "beta 0.1": (dict(beta=0.1), {"generation": (4_919_384, 365_268, 4_554_180, 64),
                                  "training": (5_214_804, 366_452, 4_848_420, 68)}),
    "PEFT, beta 0.1": (dict(beta=0.1, peft=True), {"generation": (4_618_916, 103_648, 4_515_268, 0),
                                                   "training": (4_844_352, 104_832, 4_739_556, 36)}),
    # Advantages normalized over the generation batch of 8 completions, the old log-probs in two chunks of 4.
    "normalized, steps_per_generation 2": (dict(beta=0.0, normalize_advantages=True, steps_per_generation=2), {
        "generation": (4_831_040, 273_940, 4_557_100, 0), "training": (5_124_724, 276_308, 4_848_420, 4)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_planned_rloo_phase_peak_is_the_real_one(folder: str, tmp_path: Any, case: str) -> None:
    options, expected = CASES[case]
    plan = _planned(tmp=str(tmp_path), **options)
    real = _real_phase_peaks(folder, str(tmp_path), **options)
    phases = {entry["phase"]: entry["peak_bytes"] for entry in plan.step.phases}
    for phase, (planned, real_start, real_above, difference) in expected.items():
        start, above = real[phase]
        assert (phases[phase], start, above) == (planned, real_start, real_above), phase
        assert start + above - phases[phase] == difference, phase
    assert plan.step.peak_bytes == max(phases.values()) == phases["training"]
    assert plan.step.peak_phase == "backward"
    frozen_copy = options["beta"] and not options.get("peft")
    assert plan.step.peak_parts.get("reference_model", 0) == (91_264 if frozen_copy else 0)
    # The buffered batch: ids and masks of 10 + 8 tokens (int64), old_logps and advantages (fp32), a row each.
    rows = 4 * options.get("steps_per_generation", 1)
    assert plan.step.peak_parts["batch_and_buffers"] - 64 == rows * (2 * (10 + 8) * 8 + 2 * 4)
    preference = plan.settings.preference
    assert (preference.trainer, preference.loss_type) == ("rloo", ["rloo"])
    assert preference.reference == ("none" if not options["beta"] else "adapters-disabled" if options.get("peft")
                                    else "model")
    assert preference.generation.generation_rows == rows
    assert preference.generation.old_log_probs is True


def test_the_rloo_step_is_a_grpo_step_of_its_own_loss() -> None:
    """RLOO's settings reuse GRPO's generation fields; its loss type is its own."""
    from trainer_memcb.plan.step.rloo import RlooStep

    step = RlooStep(beta=0.1, reference="model", num_generations=4)
    assert (step.trainer, step.loss_type, step.old_log_probs, step.generation_rows(4)) == ("rloo", "rloo", True, 4)
    with pytest.raises(ValueError, match="loss_type 'dapo': the RLOO step is planned for rloo"):
        RlooStep(loss_type="dapo")
