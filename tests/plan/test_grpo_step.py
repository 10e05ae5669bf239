"""TRL's GRPO step planned (`trainer_memcb.plan.step.grpo`, `.grpo_generation`) against a real
`GRPOTrainer` step on the CPU: a tiny Llama, the character tokenizer of `tests/training/test_trl.py`,
prompts of 10 characters (10 tokens, so no padding), a reward function in Python, transformers'
generation (no vLLM) made to run every completion to `max_completion_length` (`min_new_tokens`: the
most, which the plan plans). One step is run to make the optimizer state; then the generation phase
(`GRPOTrainer._prepare_inputs` on a step that generates) and the training phase (`training_step`
on the buffered micro-batch, clipping, AdamW's step, zero_grad) are each profiled
(`profiled_run_peak`) above what was alive before it. `training_step` is called directly, so
checkpointing is off unless a case turns it on as `Trainer.train()` does."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from helpers import profiled_run_peak, requires_version, storage_bytes, trl_llama_config

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "GRPOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

BATCH, GENERATIONS, PROMPT, COMPLETION = 4, 4, 10, 8


def _config() -> Any:
    import training.test_trl as trl_tests

    return trl_llama_config(vocab_size=len(trl_tests.VOCAB))


def _grpo_config(tmp: str, beta: float, **extra: Any) -> Any:
    from trl import GRPOConfig

    completion = extra.pop("max_completion_length", COMPLETION)
    return GRPOConfig(tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                      per_device_train_batch_size=BATCH, num_generations=GENERATIONS,
                      max_completion_length=completion, beta=beta, generation_kwargs={"min_new_tokens": completion},
                      gradient_checkpointing=False,  # the Trainer enables it in train(), which the test does not run
                      **extra)


def _distinct_characters(completions: List[str], **_: Any) -> List[float]:
    return [float(len(set(completion))) for completion in completions]


def _grpo_trainer(folder: str, tmp: str, beta: float, peft: bool = False, **extra: Any) -> Any:
    from datasets import Dataset
    from trl import GRPOTrainer

    import training.test_trl as trl_tests

    prompts = ["the cat sa", "a dog ran ", "hello ther", "good day t"]
    more: Dict[str, Any] = {}
    if peft:
        from peft import LoraConfig

        more["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return GRPOTrainer(model=folder, reward_funcs=_distinct_characters, args=_grpo_config(tmp, beta, **extra),
                       train_dataset=Dataset.from_dict({"prompt": prompts}),
                       processing_class=trl_tests.char_tokenizer(), **more)


def _real_phase_peaks(folder: str, tmp: str, beta: float, peft: bool = False, checkpointing: bool = False,
                      **extra: Any) -> Dict[str, Tuple[int, int]]:
    """Each phase's start (parameters, buffers, optimizer state, the reference's parameters, and
    for training the buffered generation batch) and the most the profiler records alive above it."""
    trainer = _grpo_trainer(folder, tmp, beta, peft, **extra)
    model = trainer.model
    model.train()
    if checkpointing:  # as Trainer.train() turns it on (GRPOConfig's default)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
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
    completion = trainer.args.max_completion_length
    assert prepared["inputs"]["completion_ids"].shape == (BATCH, completion)  # every completion at its most
    buffered = [v for batch in trainer._buffered_inputs for v in batch.values() if isinstance(v, torch.Tensor)]
    start = storage_bytes(resident + buffered)
    peaks["training"] = (start, profiled_run_peak(training))
    return peaks


def _planned(beta: float, tmp: str, peft: bool = False, checkpointing: bool = False, accumulation: int = 1,
             **extra: Any) -> Any:
    from transformers import LlamaForCausalLM

    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.step.grpo import grpo_step_from_config

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            meta = LlamaForCausalLM(_config())
        return add_lora_adapters(meta, 4, "q_proj,v_proj") if peft else meta

    step = grpo_step_from_config(_grpo_config(tmp, beta, gradient_accumulation_steps=accumulation, **extra), peft=peft)
    # GRPOConfig's bf16 (True by default) is the Trainer's CPU autocast in bf16.
    plan, _ = plan_step_memory(build, batch_size=BATCH, seq_len=PROMPT, optimizer="adamw_torch",
                               precision="autocast-bf16", device_type="cpu", attn_implementation="sdpa",
                               preference=step, model_states=False, gradient_checkpointing=checkpointing,
                               gradient_accumulation_steps=accumulation)
    return plan


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> str:
    import training.test_trl as trl_tests

    return trl_tests.saved_tiny_llama(str(tmp_path_factory.mktemp("grpo-llama")))


# Measured (torch 2.13, transformers 5.25, TRL 1.16), per case and phase: the planned peak, the real
# phase's start and the most alive above it, and how many bytes the real peak is above the plan.
# - The generation phase is exact where generate holds its peak (beta 0) and with PEFT's reference
#   (the same model, adapters disabled). With a frozen reference model (beta 0.1) the real phase holds
#   64 bytes more: small scalars made in C++ during the reference's forward that the fake trace does
#   not see, as in DPO's step. With steps_per_generation 2 (8 completions, the old policy's log-probs
#   computed in two chunks of 4) exact too: each chunk's outputs live until the next chunk's are made.
# - The training phase is 4 bytes more in the real step: the 0-dim fp32 loss `Trainer.training_step`
#   makes (`loss / self.current_gradient_accumulation_steps`) and holds through backward, which the
#   plan does not make; 68 with the reference model (the same 64 bytes of its forward, still
#   alive); 36 with PEFT's adapters, not identified further. Asserted as measured, so that a change shows.
CASES = {
    "beta 0": (dict(beta=0.0), {"generation": (352_388, 273_940, 78_448, 0),
                                "training": (5_123_532, 275_116, 4_848_420, 4)}),
    "beta 0.1": (dict(beta=0.1), {"generation": (4_919_120, 365_268, 4_553_916, 64),
                                  "training": (5_214_924, 366_572, 4_848_420, 68)}),
    "steps_per_generation 2": (dict(beta=0.0, steps_per_generation=2), {
        "generation": (4_831_048, 273_940, 4_557_108, 0), "training": (5_124_956, 276_540, 4_848_420, 4)}),
    "PEFT, beta 0.1": (dict(beta=0.1, peft=True), {"generation": (4_616_876, 103_648, 4_513_228, 0),
                                                   "training": (4_844_472, 104_952, 4_739_556, 36)}),
    "PEFT, beta 0": (dict(beta=0.0, peft=True), {"generation": (182_096, 103_648, 78_448, 0),
                                                 "training": (4_844_344, 104_824, 4_739_556, 36)}),
    # Completions of 40 tokens: the decode steps' DynamicCache, grown by torch.cat at each token, holds more.
    "40-token completions": (dict(beta=0.0, max_completion_length=40), {
        "generation": (408_644, 273_940, 134_704, 0), "training": (14_136_012, 277_164, 13_858_852, 4)}),
    # Every sampling option GRPOConfig passes to generate, each logits processor on.
    "sampling options": (dict(beta=0.0, top_k=10, top_p=0.9, temperature=0.7, min_p=0.05, repetition_penalty=1.1),
                         {"generation": (352_388, 273_940, 78_448, 0), "training": (5_123_532, 275_116, 4_848_420, 4)}),
    # Checkpointing on (GRPOConfig's default, which Trainer.train() turns on): generate runs with it
    # off, as TRL's unwrap_model_for_generation turns it off around generate.
    "checkpointing, beta 0.1": (dict(beta=0.1, checkpointing=True), {
        "generation": (4_919_120, 365_268, 4_553_916, 64), "training": (4_969_948, 366_572, 4_603_444, 68)}),
}


# The real generation of 40-token completions read less above its start in some runs of the whole
# suite here (2 processes, test files shared out by pytest-xdist): 256 bytes less (134,448) in one
# of three, 320 less (134,384) in another, and the figure above in the others and in every run of it
# alone (the RNG's seed, the cycle collector's timing and the profiler's record order each ruled
# out): a state an earlier test leaves in the process, not found. Never more than the plan: held
# to at most that many bytes below it, so that any other figure shows.
BELOW_IN_SOME_SESSIONS = {("40-token completions", "generation"): 320}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_planned_grpo_phase_peak_is_the_real_one(folder: str, tmp_path: Any, case: str) -> None:
    options, expected = CASES[case]
    plan = _planned(tmp=str(tmp_path), **options)
    real = _real_phase_peaks(folder, str(tmp_path), **options)
    phases = {entry["phase"]: entry["peak_bytes"] for entry in plan.step.phases}
    for phase, (planned, real_start, real_above, difference) in expected.items():
        start, above = real[phase]
        if 0 < real_above - above <= BELOW_IN_SOME_SESSIONS.get((case, phase), 0):
            difference -= real_above - above
            real_above = above
        assert (phases[phase], start, above) == (planned, real_start, real_above), phase
        assert start + above - phases[phase] == difference, phase
    assert plan.step.peak_bytes == max(phases.values()) == phases["training"]
    assert plan.step.peak_phase == "backward"
    frozen_copy = options["beta"] and not options.get("peft")
    assert plan.step.peak_parts.get("reference_model", 0) == (91_264 if frozen_copy else 0)
    preference = plan.settings.preference
    assert preference.trainer == "grpo"
    assert preference.reference == ("none" if not options["beta"] else "adapters-disabled" if options.get("peft")
                                    else "model")
    assert preference.generation.generation_rows == 4 * options.get("steps_per_generation", 1)
    assert preference.generation.old_log_probs == ("steps_per_generation" in options)


def test_a_generation_phase_that_holds_the_peak_is_named(tmp_path: Any) -> None:
    """Thirty-two completions of 48 tokens generated for micro-batches of one (steps_per_generation
    32): generate's KV cache of the thirty-two outgrows the training phase of one, and the step's
    peak is the generation's (planned only: its real counterpart is the test above's kind)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.step.grpo import grpo_step_from_config

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(vocab_size=34, hidden_size=128, intermediate_size=256,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                                tie_word_embeddings=False, pad_token_id=0, eos_token_id=1))

    config = _grpo_config(str(tmp_path), 0.0)
    config.per_device_train_batch_size, config.num_generations, config.steps_per_generation = 1, 2, 32
    config.generation_batch_size, config.max_completion_length = None, 48
    step = grpo_step_from_config(config, peft=False)
    plan, _ = plan_step_memory(build, batch_size=1, seq_len=10, optimizer="adamw_torch", precision="autocast-bf16",
                               device_type="cpu", attn_implementation="sdpa", preference=step, model_states=False)
    phases = {entry["phase"]: entry["peak_bytes"] for entry in plan.step.phases}
    assert phases == {"generation": 16_531_508, "training": 14_787_362}
    assert (plan.step.peak_phase, plan.step.peak_bytes) == ("generation", 16_531_508)
    # No gradient is alive while generating; the optimizer state of the step before is.
    assert (plan.step.peak_parts["gradients"], plan.step.peak_parts["optimizer_state"]) == (0, 5_321_884)





@pytest.mark.slow  # a real GRPOTrainer's two generations and a training step, and the plan
def test_a_generation_inside_the_accumulation_holds_the_first_micro_batchs_gradients(folder: str, tmp_path: Any) -> None:
    """A generation batch of 4 for micro-batches of 4 accumulated twice (steps_per_generation 1, as
    --fit proposes a smaller generation_batch_size): TRL generates again before the second
    micro-batch, with the first's gradients and its buffered batch alive. The planned generation
    phase is that one; the real one is profiled after a first micro-batch's `training_step`
    (its gradients kept, no optimizer step)."""
    from helpers import profiled_run_peak

    options = dict(beta=0.1, generation_batch_size=4)
    plan = _planned(0.1, str(tmp_path), accumulation=2, generation_batch_size=4)
    phases = {entry["phase"]: entry["peak_bytes"] for entry in plan.step.phases}
    trainer = _grpo_trainer(folder, str(tmp_path), gradient_accumulation_steps=2, **options)
    model = trainer.model
    model.train()
    raw = next(iter(trainer.get_train_dataloader()))
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 2
    optimizer, generate_inputs = trainer.optimizer, trainer._prepare_inputs

    def generation() -> None:
        trainer._step = 0  # a step that generates
        generate_inputs(raw)

    def micro_batch() -> None:
        trainer._prepare_inputs = lambda inputs: trainer._buffered_inputs[0]
        try:
            trainer.training_step(model, raw, None)
        finally:
            trainer._prepare_inputs = generate_inputs

    trainer._buffered_inputs = None
    generation(), micro_batch()
    optimizer.step()  # the optimizer state a later step holds
    optimizer.zero_grad(set_to_none=True)
    generation(), micro_batch()  # the first micro-batch of that step: its gradients stay
    resident = list(model.parameters()) + list(model.buffers()) + [p.grad for p in model.parameters()]
    resident += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    resident += list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())
    resident += [v for batch in trainer._buffered_inputs for v in batch.values() if isinstance(v, torch.Tensor)]
    start = storage_bytes(resident)
    above = profiled_run_peak(generation)
    # Above the generation at a step's start (4,919,120 planned for the same 4 completions, the
    # "beta 0.1" case): the 91,264 bytes of fp32 gradients and 1,304 of the first generation's
    # buffered batch, alive until the new one replaces it; the real one 64 bytes more, the reference
    # forward's C++ scalars as in that case.
    assert (phases["generation"], start, above) == (5_011_688, 457_836, 4_553_916)
    assert start + above - phases["generation"] == 64
    assert phases["generation"] - 4_919_120 == 91_264 + 1_304
    assert plan.settings.preference.generation.steps_per_generation == 1


def _allocations(run: Any) -> List[int]:
    """The sizes the profiler records allocated (+) and freed (-) while `run()` runs, in time order."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # no earlier test's garbage freed in the middle

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    return [record.nbytes() for record in records]


def _returned(allocations: List[int]) -> Tuple[List[int], List[int]]:
    """The allocations and frees up to the last allocation, in order, and the frees after it sorted:
    those are the function's locals released as it returns, in the order its frame lists them."""
    last = max(index for index, size in enumerate(allocations) if size > 0)
    return allocations[:last + 1], sorted(allocations[last + 1:])


# Every loss type TRL takes, and the sequence-level weights. Their tensors are small beside the
# step's (the peak is in the backward of the LM head), so the step's peak cannot tell them apart:
# each is held instead by the allocations of TRL's own `_compute_loss` on a real generated batch,
# which the plan's `grpo_loss` must make in the same order and sizes.
LOSS_CASES = [(loss_type, "token") for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo",
                                                      "vespo")] + [("grpo", "sequence"), ("luspo", "sequence")]


def test_each_loss_type_allocates_as_trls_compute_loss(folder: str, tmp_path: Any) -> None:
    from trainer_memcb.plan.step.grpo import GrpoBatch, grpo_loss, grpo_step_from_config

    # The configs first: a TrainingArguments made resets the accelerator's state the trainer uses.
    steps = [grpo_step_from_config(_grpo_config(str(tmp_path), 0.1, loss_type=loss_type,
                                                importance_sampling_level=level), peft=False)
             for loss_type, level in LOSS_CASES]
    trainer = _grpo_trainer(folder, str(tmp_path), beta=0.1)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer._buffered_inputs, trainer._step = None, 0
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    compared = 0
    for (loss_type, level), step in zip(LOSS_CASES, steps):
        trainer.loss_type, trainer.importance_sampling_level = loss_type, level
        with torch.no_grad():  # the forward's allocations; the graph's own are not compared
            real = _allocations(lambda: trainer._compute_loss(model, inputs))
            # GRPOConfig's bf16: each log-prob forward in accelerate's autocast, as the plan traces it.
            autocast = torch.autocast("cpu", dtype=torch.bfloat16)
            planned = _allocations(lambda: grpo_loss(model, GrpoBatch(dict(inputs)), step, autocast=autocast))
        assert _returned(planned) == _returned(real), (loss_type, level)
        compared += 1
    assert compared == len(LOSS_CASES) == 10
