"""The step plan, typed and nested: what was planned (`PlannedSettings`), the step as its timeline
holds it (`StepPeak`), the device it runs on (`DeviceFigures`: the allocator replay and the CUDA
context), and the answer to fits? (`Verdict`). Each is a small frozen dataclass whose JSON form is
its fields; `StepMemoryPlan` holds one of each and the timeline every figure is read from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from trainer_memcb.plan.step.timeline import Timeline

__all__ = ["DeviceFigures", "RankGroup", "PackedBatch", "PlannedGeneration", "PlannedPreference", "PlannedSettings", "StepMemoryPlan", "StepPeak", "Verdict"]


@dataclass(frozen=True)
class PackedBatch:
    """A padding-free micro-batch (`--packing`): one row of `tokens` tokens holding `sequences`
    sequences (`DataCollatorWithFlattening`), beside the padded batch that holds as many whole
    sequences of `seq_len`: `padded_batch_size` rows of `seq_len`, `padded_tokens` in all.

    Attributes:
        tokens: the tokens of the packed row, every one a real token (no padding).
        sequences: the sequences in it (`tokens // seq_len` whole ones, and the rest one shorter).
        padded_batch_size: the rows of the padded equivalent (`tokens // seq_len`).
        padded_tokens: the padded equivalent's tokens (`padded_batch_size x seq_len`).
    """

    tokens: int
    sequences: int
    padded_batch_size: int
    padded_tokens: int


@dataclass(frozen=True)
class PlannedGeneration:
    """GRPO's generation phase as planned (`--trainer grpo`).

    Attributes:
        num_generations: completions per prompt.
        generation_rows: completions generated at once on the process
            (`per_device_train_batch_size x steps_per_generation`).
        prompts: the prompts they complete (`generation_rows / num_generations`: TRL's sampler repeats
            each prompt `num_generations` times, and `per_device_train_batch_size` counts completions).
        steps_per_generation: micro-batches each generation feeds.
        prompt_tokens, completion_tokens: each prompt's tokens (the plan's `seq_len`) and each
            completion's (`max_completion_length`, the most).
        engine: "transformers" (`generate`, traced), or "vllm-colocate" / "vllm-server" (not traced).
        vllm_gpu_memory_utilization: colocated vLLM's share of the device, else None.
        old_log_probs: whether the old policy's log-probs are computed after generation.
    """

    num_generations: int
    generation_rows: int
    prompts: int
    steps_per_generation: int
    prompt_tokens: int
    completion_tokens: int
    engine: str
    vllm_gpu_memory_utilization: Optional[float]
    old_log_probs: bool


@dataclass(frozen=True)
class PlannedPreference:
    """TRL's step planned (`--trainer sft`, `dpo`, `kto`, `grpo`, `rloo`).

    Attributes:
        trainer: "sft" (TRL's `SFTTrainer`), "dpo" (`DPOTrainer`), "kto" (`KTOTrainer`), "grpo"
            (`GRPOTrainer`) or "rloo" (`RLOOTrainer`).
        reference: where the reference log-probs come from: "model" (a frozen copy),
            "adapters-disabled" (PEFT's base model), "precomputed" (read from the batch, DPO, KTO) or
            "none" (GRPO, RLOO with beta 0; SFT, which has no reference).
        beta, loss_type: the config's beta (None for SFT, which has none) and its losses.
        generation: GRPO's (RLOO's) generation phase; None for DPO and KTO.
    """

    trainer: str
    reference: str
    beta: Optional[float]
    loss_type: List[str]
    generation: Optional[PlannedGeneration] = None


@dataclass(frozen=True)
class PlannedSettings:
    """What the step plan planned: the settings as resolved once, and what the trace made of them.

    Attributes:
        model: the model's name; `batch_size`, `seq_len`: the micro-batch.
        attn_implementation: the attention path traced (`config._attn_implementation`).
        device_type: the device type asked for; `traced_on`: the fake tensors' device.
        gradient_checkpointing: activation checkpointing on the model's layers;
            `checkpointing_kwargs`: its keywords as traced, `use_reentrant` always among them
            (`trainer_memcb.plan.model.trainer_model.checkpointing_kwargs`), {} without it.
        precision: the setup's precision; `param_dtype`: the traced parameters' dtype.
        optimizer: the Trainer's `optim` name; `optimizer_implementation`: the class traced.
        engine: none, ddp, fsdp2, deepspeed-zero1/2/3, tp (tensor parallel) or tp-fsdp2 (TP x FSDP2).
        gradient_accumulation_steps: the micro-batches of one optimizer step.
        used: [setting, value, where it came from] for each setting the plan read.
        packing: the packed row and its padded equivalent (`--packing`); None (and left out of the
            JSON form) for a batch of rows.
        preference: TRL's DPO step (`--trainer dpo`); None (and left out of the JSON form) for the
            Trainer's own step.
    """

    model: str
    batch_size: int
    seq_len: int
    attn_implementation: Optional[str]
    device_type: str
    traced_on: str
    gradient_checkpointing: bool
    checkpointing_kwargs: Dict[str, Any]
    precision: str
    param_dtype: Optional[str]
    optimizer: str
    optimizer_implementation: Optional[str] = None
    engine: str = "none"
    gradient_accumulation_steps: int = 1
    used: List[List[Any]] = field(default_factory=list)
    packing: Optional[PackedBatch] = None
    preference: Optional[PlannedPreference] = None

    @property
    def per_device_batch(self) -> int:
        """The `per_device_train_batch_size` planned: the rows that TRL's padding-free SFT collator
        flattened into the one row (`packing`'s `padded_batch_size`), else `batch_size`."""
        if self.packing is not None and self.preference is not None and self.preference.trainer == "sft":
            return self.packing.padded_batch_size
        return self.batch_size

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form: the fields, `packing` only for a packed batch, `preference` only for TRL's step."""
        document = asdict(self)
        if self.packing is None:
            del document["packing"]
        if self.preference is None:
            del document["preference"]
        return document


@dataclass(frozen=True)
class RankGroup:
    """Processes whose steps are the same to the byte, and that step's figures (each process's own
    where they differ: tensor parallelism's uneven shards).

    Attributes:
        ranks: the processes, by rank.
        peak_bytes: their step's peak on the device; `peak_phase`: its phase.
        model_states_at_optimizer_step_bytes: what each model state held at the optimizer phase's peak.
        device_total_bytes: on CUDA, the allocator replay's reserved peak and the CUDA context (None
            without a replay); `fits`, `margin_bytes`: their fits? (None without a device memory).
    """

    ranks: List[int]
    peak_bytes: Optional[int] = None
    peak_phase: Optional[str] = None
    model_states_at_optimizer_step_bytes: Dict[str, int] = field(default_factory=dict)
    device_total_bytes: Optional[int] = None
    fits: Optional[bool] = None
    margin_bytes: Optional[int] = None


@dataclass(frozen=True)
class StepPeak:
    """One training step as its timeline holds it: the activations, the peak, its phase and parts,
    and what each model state held during the step.

    Attributes:
        activations_bytes: saved for backward, alive at the end of forward.
        activations_peak_bytes: the most saved bytes alive during forward and backward.
        peak_bytes: the step's peak on the device; `peak_phase`: forward, backward or optimizer
            step; `peak_parts`: what was alive then, by part (they sum to `peak_bytes`);
            `host_bytes`: by part, what lived on the host then (offload), not in the peak.
        forward_backward_peak_bytes, optimizer_step_peak_bytes: each phase's device peak.
        peak_micro_batch: with gradient accumulation, the micro-batch whose forward and backward
            hold the peak (1 to gradient_accumulation_steps), None when the peak is the optimizer
            step's; `micro_batch_peak_bytes`: [number, peak bytes] of each micro-batch traced (the
            first, the second and the last: those between are the second's).
        model_states_most_bytes: per model state (parameters, gradients, optimizer_state,
            master_weights), the most this process's device held at one moment of the step, the
            engine's buffers for it included (DDP's buckets and ZeRO's reduce buckets as
            gradients, FSDP2's all-gather buffers and gathered parameters as parameters);
            `model_states_host_bytes`: the same, of what lives on the host (offload);
            `model_states_at_optimizer_step_bytes`: what each held at the optimizer phase's peak,
            device and host together ({} without an optimizer step).
        problem: why no step could be traced (then only the model states are known), or None.
        notes: what the reader should know of how a figure was found.
        phases: TRL's GRPO (and RLOO) step: each phase's device peak, `{"phase": "generation" or "training",
            "peak_bytes": ...}` (the step's peak the larger); DPO's and KTO's: their training phase
            alone; empty, and left out of the JSON form, for every other step.
        rank_groups: where processes hold different steps (tensor parallelism's uneven shards), each
            group of processes whose steps are the same to the byte, with their figures (the plan's
            own figures are the fullest group's); empty, and left out of the JSON form, otherwise.
    """

    activations_bytes: Optional[int] = None
    activations_peak_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    peak_phase: Optional[str] = None
    peak_parts: Dict[str, int] = field(default_factory=dict)
    host_bytes: Dict[str, int] = field(default_factory=dict)
    forward_backward_peak_bytes: Optional[int] = None
    optimizer_step_peak_bytes: Optional[int] = None
    peak_micro_batch: Optional[int] = None
    micro_batch_peak_bytes: List[List[int]] = field(default_factory=list)
    model_states_most_bytes: Dict[str, int] = field(default_factory=dict)
    model_states_host_bytes: Dict[str, int] = field(default_factory=dict)
    model_states_at_optimizer_step_bytes: Dict[str, int] = field(default_factory=dict)
    problem: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    phases: List[Dict[str, Any]] = field(default_factory=list)
    rank_groups: List[RankGroup] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceFigures:
    """The device the step runs on: its memory, the reserve, and on CUDA the caching allocator's
    replay of the step and the CUDA context.

    Attributes:
        device_memory_bytes, reserve_bytes: the device's memory and the part of it left out for
            what the plan does not count (`not_counted`); None without a device memory.
        reserved_peak_bytes: on CUDA, the most the caching allocator reserves over two steps
            (`torch.cuda.max_memory_reserved`); with `device_memory_bytes` and a step that fits, as
            a device of that memory holds it (the allocator frees its cache before it fails).
        allocator_allocated_peak_bytes: the replay's allocated peak (`torch.cuda.max_memory_allocated`):
            the peak with every block rounded up to 512 bytes and CUDA's cuBLAS/cuBLASLt
            workspaces (`cuda_workspace_bytes`), which the CPU trace does not make.
        fragmentation_bytes: `reserved_peak_bytes - allocator_allocated_peak_bytes`: cached, not
            allocated, peak against peak (`StepReplay.fragmentation_bytes`).
        cuda_context_bytes: the CUDA context the process holds outside the allocator (the GPU
            preset's, else `DEFAULT_CUDA_CONTEXT_BYTES`).
        device_total_bytes: `reserved_peak_bytes + cuda_context_bytes`: what nvidia-smi shows for
            the process at the step's peak.
        gpu: the GPU preset's name, or None; `alloc_conf`: the `PYTORCH_CUDA_ALLOC_CONF` replayed
            ("" for torch's defaults); `out_of_memory_at`: where the replay ran out ("step 2,
            backward"), or None.
        not_counted: what a real process on the device type holds that the plan does not count.
    """

    device_memory_bytes: Optional[int] = None
    reserve_bytes: Optional[int] = None
    reserved_peak_bytes: Optional[int] = None
    allocator_allocated_peak_bytes: Optional[int] = None
    fragmentation_bytes: Optional[int] = None
    cuda_workspace_bytes: Optional[int] = None
    cuda_context_bytes: Optional[int] = None
    device_total_bytes: Optional[int] = None
    gpu: Optional[str] = None
    alloc_conf: Optional[str] = None
    out_of_memory_at: Optional[str] = None
    not_counted: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    """fits? and by how much: on CUDA from the allocator replay (it does not fit when the replay
    runs out of the device's memory less the CUDA context and the reserve; the margin is that
    memory less the reserved peak), on the CPU from the peak against the memory less the reserve.
    Both None without a device memory or a traced step."""

    fits: Optional[bool] = None
    margin_bytes: Optional[int] = None


@dataclass(frozen=True)
class StepMemoryPlan:
    """One training step's memory on one process: what was planned (`settings`), the step
    (`step`), the device (`device`) and fits? (`verdict`), each read from one `timeline`."""

    settings: PlannedSettings
    step: StepPeak = field(default_factory=StepPeak)
    device: DeviceFigures = field(default_factory=DeviceFigures)
    verdict: Verdict = field(default_factory=Verdict)
    # The traced step every figure above is read from; not serialized.
    timeline: Optional[Timeline] = field(default=None, repr=False, compare=False)
    # On CUDA, the arguments of the allocator replay `device` reports (`ReplayOptions`); not serialized.
    replay_options: Optional[Any] = field(default=None, repr=False, compare=False)

    def to_dict(self) -> Dict[str, Any]:
        """The plan's JSON form: `settings`, `step`, `device` and `verdict`, each its fields."""
        step = asdict(self.step)
        for optional in ("phases", "rank_groups"):
            if not step[optional]:
                del step[optional]
        return {"settings": self.settings.to_dict(), "step": step, "device": asdict(self.device),
                "verdict": asdict(self.verdict)}
