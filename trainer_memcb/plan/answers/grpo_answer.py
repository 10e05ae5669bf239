"""What the step plan says of TRL's GRPO step (`trainer_memcb.plan.step.grpo`): its generation
phase as planned (`PlannedGeneration`) and the notes that say how each phase was traced, and the
rule for vLLM, which cannot run here."""

from __future__ import annotations

import dataclasses
from typing import Any, List

from trainer_memcb.plan.answers.step_plan import PlannedGeneration

__all__ = ["grpo_notes", "planned_generation", "vllm_reserved_bytes", "with_vllm_share"]


def _engine(step: Any) -> str:
    return f"vllm-{step.vllm_mode}" if step.use_vllm else "transformers"


def vllm_reserved_bytes(step: Any, device_memory: int) -> int:
    """The device's bytes vLLM takes from training: colocated, `vllm_gpu_memory_utilization` of the
    device's memory (vLLM's `gpu_memory_utilization`: the share of the GPU's total memory its engine
    may hold, weights, activations and KV cache together); in server mode none (vLLM runs on other
    GPUs); none without vLLM."""
    if not step.use_vllm or step.vllm_mode == "server":
        return 0
    return int(step.vllm_gpu_memory_utilization * device_memory)


def with_vllm_share(settings: Any) -> Any:
    """The settings with colocated vLLM's share of the device (`vllm_reserved_bytes`) added to the
    reserve, where the device's memory is known: what training may use is the rest. Unchanged for
    any other step."""
    step = settings.preference
    memory = settings.device_memory_bytes
    if step is None or not step.generates or memory is None:  # GRPO's step, and RLOO's, generate
        return settings
    share = vllm_reserved_bytes(step, memory)
    if not share:
        return settings
    source = settings.sources.get("reserve_bytes", "default")
    return dataclasses.replace(settings, reserve_bytes=settings.reserve_bytes + share,
                               sources=dict(settings.sources, reserve_bytes=f"{source} + colocated vLLM's {share:,}"))


def planned_generation(step: Any, settings: Any) -> PlannedGeneration:
    """The generation phase of `step` (a `GrpoStep`) for the settings' micro-batch."""
    colocated = step.use_vllm and step.vllm_mode == "colocate"
    return PlannedGeneration(
        num_generations=step.num_generations, generation_rows=step.generation_rows(settings.batch_size),
        prompts=step.generation_rows(settings.batch_size) // step.num_generations,
        steps_per_generation=step.steps_per_generation, prompt_tokens=settings.seq_len,
        completion_tokens=step.max_completion_length, engine=_engine(step),
        vllm_gpu_memory_utilization=step.vllm_gpu_memory_utilization if colocated else None,
        old_log_probs=step.old_log_probs)


def grpo_notes(step: Any, settings: Any) -> List[str]:
    """How the GRPO (or RLOO) step was traced, and vLLM's rule where it generates."""
    rows = step.generation_rows(settings.batch_size)
    reference = {"none": "no reference (beta 0)",
                 "model": "the frozen reference model's per-token log-probs under torch.no_grad() after generation",
                 "adapters-disabled": "the reference's per-token log-probs as the same model with its adapters "
                                      "disabled, under torch.no_grad() after generation"}[step.reference]
    prompts = rows // step.num_generations
    notes = [f"TRL's {step.trainer.upper()} step traced in two phases: generation ({rows} completions, "
             f"{step.num_generations} for each of {prompts} prompt{'s' if prompts != 1 else ''} of {settings.seq_len} tokens, each completed to "
             f"{step.max_completion_length} tokens, the most) and training (compute_loss over "
             f"{settings.batch_size} completions, loss {step.loss_type}, backward, optimizer step); {reference}; "
             "the step's peak is the larger phase's"]
    if step.use_vllm and step.vllm_mode == "colocate":
        memory = settings.device_memory_bytes
        held = (f" ({vllm_reserved_bytes(step, memory):,} bytes of {memory:,}, in the reserve)" if memory is not None
                else " (give the device's memory to count it)")
        notes.append(f"vLLM colocated (not traced; it cannot run here): by vLLM's rule its engine holds "
                     f"gpu_memory_utilization ({step.vllm_gpu_memory_utilization:g}) x the device's total memory"
                     f"{held}, taken from what training may use; transformers' generate is not traced")
    elif step.use_vllm:
        notes.append("vLLM in server mode: generation runs on the server's GPUs, nothing of it on the training GPU; "
                     "transformers' generate is not traced")
    return notes
