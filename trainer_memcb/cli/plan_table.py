"""`trainer-memcb estimate MODEL --world-size W --sharding ...`: the model-states plan, as tables.

The figures come from `trainer_memcb.plan.answers.model_states.plan_model_states`; this module only formats them.
"""

from __future__ import annotations

from typing import Any, List, Optional

from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell
from trainer_memcb.cli.step_answer import StepAnswer
from trainer_memcb.plan.answers.max_batch import LargestBatch
from trainer_memcb.plan.answers.model_states import ModelStatesPlan
from trainer_memcb.plan.answers.step_plan import DeviceFigures, PlannedSettings, StepMemoryPlan, StepPeak

__all__ = ["plan_tables", "step_tables"]


def _fits(plan: ModelStatesPlan, entry) -> str:
    if entry.fits is None:
        return "-"
    margin = bytes_cell(abs(entry.margin_bytes))
    return f"fits, {margin} to spare" if entry.fits else f"does not fit, {margin} short"


def _memory_rows(device_memory: Optional[int], reserve: Optional[int], context: int = 0) -> List[List[str]]:
    rows = [["device memory", bytes_cell(device_memory)]]
    if device_memory is not None and reserve is not None:
        if context:
            rows.append(["CUDA context", bytes_cell(context)])
        rows += [["reserve (--reserve)", bytes_cell(reserve)],
                 ["fits? against", bytes_cell(device_memory - context - reserve)]]
    return rows


def _sharding_cell(sharding: str, plan: ModelStatesPlan) -> str:
    """The setup's sharding, and tensor parallelism where the step was traced under it (the rows'
    engine `tp`, or `tp-fsdp2` beside FSDP2's shards)."""
    if not any(entry.engine in ("tp", "tp-fsdp2") for entry in plan.optimizers):
        return sharding
    return "tensor parallel" if sharding == "none" else f"{sharding} x tensor parallel"


def plan_tables(plan: ModelStatesPlan, device_memory: Optional[int] = None,
                reserve: Optional[int] = None, verdict: bool = True, context: int = 0) -> List[TextTable]:
    """The setup, then one row per optimizer: the four states of the fullest process and where they live.

    Args:
        plan: the model-states plan (its fits? answered against `device_memory - reserve`).
        device_memory, reserve, context: the device's memory, the reserve and the CUDA context,
            shown; None shows the plan's own `device_memory_bytes`.
        verdict: False beside a step plan that answers fits?: no memory rows and no fits? column,
            so that the output holds one verdict, the step's.
    """
    setup = plan.setup
    if device_memory is None:
        device_memory, reserve = plan.device_memory_bytes, None
    offload = [name for name, on in (("optimizer", setup.offload_optimizer), ("parameters", setup.offload_params)) if on]
    about = TextTable(f"Model states plan for {plan.model}", ["", "value"], [
        ["parameters", count_cell(plan.total_params)],
        ["trainable parameters", count_cell(plan.trainable_params)],
        ["processes", f"{setup.world_size} on {setup.nodes} node{'s' if setup.nodes > 1 else ''}"],
        ["sharding", _sharding_cell(setup.sharding, plan)],
        ["precision", setup.precision],
        ["offload to CPU", ", ".join(offload) or "none"],
    ] + (_memory_rows(device_memory, reserve, context) if verdict else []) + ([["reference model (frozen copy)", plan.reference_model_note
           or bytes_cell(plan.optimizers[0].reference_model_bytes if plan.optimizers else None)]]
         if plan.reference_model else []))
    rows = []
    for entry in plan.optimizers:
        if entry.model_states_bytes is None:
            rows.append([entry.name, bytes_cell(entry.params_bytes), bytes_cell(entry.grads_bytes), "-",
                         bytes_cell(entry.master_weights_bytes), "-", "-", "-", entry.problem or "-"])
            continue
        at = entry.at_optimizer_step_bytes
        rows.append([entry.name, _state_cell(entry.params_bytes, at.get("parameters")),
                     _state_cell(entry.grads_bytes, at.get("gradients")),
                     _state_cell(entry.optimizer_state_bytes, at.get("optimizer_state")),
                     _state_cell(entry.master_weights_bytes, at.get("master_weights")),
                     bytes_cell(entry.model_states_bytes), bytes_cell(entry.device_bytes),
                     bytes_cell(entry.cpu_bytes_per_node), _fits(plan, entry)])
    engines = sorted({entry.engine for entry in plan.optimizers if entry.engine is not None})
    if engines:
        title = (f"Per process, the most each state holds during the step ({_ENGINE_NAMES.get(engines[0], engines[0])}, "
                 "its buffers included; where the optimizer step holds less, its figure after ';')"
                 + (" (model states include the reference model)" if plan.reference_model else "")
                 + ". The activations and temporaries are in the step's peak above")
    else:
        title = ("Per process (the fullest): parameters, gradients, optimizer state, master weights"
                 + (" (model states include the reference model)" if plan.reference_model else "")
                 + ". Not counted: activations, temporary buffers, CUDA context, fragmentation")
    columns = ["optimizer", "parameters", "gradients", "optimizer state", "master weights", "model states",
               "on the device", "CPU per node", "fits?"]
    if not verdict:  # the last column holds fits? or, in a row without figures, the problem
        problems = [entry.problem if entry.model_states_bytes is None else None for entry in plan.optimizers]
        if any(problems):
            columns[-1], rows = "problem", [row[:-1] + [problem or "-"] for row, problem in zip(rows, problems)]
        else:
            columns, rows = columns[:-1], [row[:-1] for row in rows]
    states = TextTable(title, columns, rows, text_columns=(0, 8) if verdict else (0,),
                       note="\n".join(f"Note, {note}." for note in plan.notes))
    return [about, states]


# How the model-states table names the engine whose step it read.
_ENGINE_NAMES = {"none": "one process", "ddp": "DDP", "fsdp2": "FSDP2", "zero": "DeepSpeed ZeRO"}


def _state_cell(most: Optional[int], at_step: Optional[int]) -> str:
    """A state's most during the step, and its figure at the optimizer step after it where that differs."""
    if at_step is None or at_step == most:
        return bytes_cell(most)
    return f"{bytes_cell(most)}; {bytes_cell(at_step)} at the optimizer step"


_PART_NAMES = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
               "master_weights": "master weights", "activations": "activations (saved for backward)",
               "batch_and_buffers": "batch and buffers", "other": "temporaries (logits, attention scores, ...)",
               "reference_model": "reference model (frozen)",
               "unsharded_parameters": "unsharded parameters (gathered)",
               "unsharded_gradients": "unsharded gradients (before the reduce-scatter)",
               "engine_buffers": "engine buffers (all-gather, reduce-scatter, DDP/ZeRO buckets)",
               "fp32_gradients": "fp32 gradient partition (optimizer step only, kept with ZeRO-1/2 offload)",
               "offload_buffers": "offload buffers (16-bit host copy, gradient staging)",
               "host_temporaries": "the offloaded optimizer step's temporaries (host)"}


def _checkpointing_words(settings: PlannedSettings) -> str:
    """"off", or "on (non-reentrant)" with the keywords that change what is held."""
    if not settings.gradient_checkpointing:
        return "off"
    kwargs = settings.checkpointing_kwargs
    words = ["reentrant" if kwargs.get("use_reentrant") else "non-reentrant"]
    if kwargs.get("every_n_layers", 1) != 1:
        words.append(f"every {kwargs['every_n_layers']} layers")
    if kwargs.get("offload"):
        words.append("saved tensors offloaded to the host")
    if kwargs.get("preserve_rng_state") is False:
        words.append("no RNG state kept")
    return f"on ({', '.join(words)})"


def step_tables(found: StepAnswer) -> List[TextTable]:
    """The step plan: what was traced, the activations, the peak by part, fits?; the search."""
    tables = _plan_tables(found.step) if found.step is not None else []
    if found.largest_batch is not None:
        tables.append(_largest_batch_table(found.largest_batch))
    return tables


def _micro_batch_row(settings: Any) -> List[str]:
    """The micro-batch traced; a packed row with its padded equivalent."""
    packed = settings.packing
    if packed is None:
        return ["micro-batch", f"{settings.batch_size} x {settings.seq_len}"]
    return ["micro-batch", f"1 x {packed.tokens:,} packed: {packed.sequences} sequences of at most {settings.seq_len} "
            f"tokens, {packed.tokens:,} tokens per micro-batch (padded: {packed.padded_batch_size} x "
            f"{settings.seq_len}, {packed.padded_tokens:,} tokens)"]


def _plan_tables(plan: StepMemoryPlan) -> List[TextTable]:
    """The step plan's own tables: what was traced and its answer, the peak's parts, the settings."""
    settings, step, device = plan.settings, plan.step, plan.device
    about = [
        _micro_batch_row(settings),
        ["attention traced", settings.attn_implementation or "-"],
        ["device type", f"{settings.device_type} (traced on fake {settings.traced_on} tensors)"],
        ["gradient checkpointing", _checkpointing_words(settings)],
        ["precision", f"{settings.precision} (parameters in {settings.param_dtype})" if settings.param_dtype
         else settings.precision],
        ["optimizer step", settings.optimizer],
    ]
    if settings.preference is not None:
        about.insert(0, _trainer_row(settings.preference, step.peak_parts))
    if device.device_memory_bytes is not None:
        about += _memory_rows(device.device_memory_bytes, device.reserve_bytes, device.cuda_context_bytes or 0)
    tables = []
    if step.problem is not None:
        # Under the table, not in it: a long reason would stretch the value column of every row.
        tables.append(TextTable(f"Step plan for {settings.model}", ["", "value"], about,
                                note=f"Problem: {step.problem}; only the model states are planned."))
    else:
        about += [["activations", bytes_cell(step.activations_bytes)],
                  ["activations peak", bytes_cell(step.activations_peak_bytes)],
                  ["step peak", f"{bytes_cell(step.peak_bytes)}, in the {step.peak_phase}"
                   + _micro_batch_words(settings, step)]]
        if len(step.phases) > 1:  # GRPO, RLOO: the generation phase's peak and the training phase's
            about.append(["phase peaks", ", ".join(f"{entry['phase']} {bytes_cell(entry['peak_bytes'])}"
                                                   for entry in step.phases)])
        about += _allocator_rows(device)
        if plan.verdict.fits is not None:
            margin = bytes_cell(abs(plan.verdict.margin_bytes))
            about.append(["fits?", f"fits, {margin} to spare" if plan.verdict.fits else f"does not fit, {margin} short"])
        tables.append(TextTable(f"Step plan for {settings.model}", ["", "value"], about,
                                note="\n".join(f"Note, {note}." for note in step.notes)))
        parts = [[_PART_NAMES.get(name, name), bytes_cell(value)] for name, value in step.peak_parts.items()]
        tables.append(TextTable("Alive at the step's peak, per process", ["part", "bytes"], parts,
                                note=_not_counted(device)))
    if settings.used:
        rows = [[name, _setting_cell(value), source] for name, value, source in settings.used]
        tables.append(TextTable(f"Settings used (engine: {settings.engine}; optimizer implementation: "
                                f"{settings.optimizer_implementation or '-'})", ["setting", "value", "from"], rows,
                                text_columns=(0, 1, 2)))
    return tables


# How each reference of TRL's DPO and GRPO steps is traced (`PlannedPreference.reference`).
_REFERENCE_WORDS = {"model": "reference a frozen copy of the model",
                    "adapters-disabled": "reference the model with its adapters disabled",
                    "precomputed": "reference log-probs precomputed (no reference forward)",
                    "none": "no reference (beta 0)"}


def _trainer_row(preference: Any, peak_parts: Any) -> List[str]:
    """The trainer traced (`--trainer sft|dpo|kto|grpo|rloo`), how its reference is traced, the reference model's
    share of the step's peak where it holds one, and GRPO's generation."""
    name = {"grpo": "GRPOTrainer", "kto": "KTOTrainer", "rloo": "RLOOTrainer", "sft": "SFTTrainer"}.get(
        preference.trainer, "DPOTrainer")
    if preference.trainer == "sft":  # no reference: its fused LM head and loss
        return ["trainer", f"TRL SFTTrainer, its fused LM head (no full logits), loss {'+'.join(preference.loss_type)}"]
    words = f"TRL {name}, {_REFERENCE_WORDS[preference.reference]}"
    if "reference_model" in peak_parts:
        words += f", {bytes_cell(peak_parts['reference_model'])} of the peak"
    generation = preference.generation
    if generation is not None:
        words += (f"; generation of {generation.generation_rows} completions ({generation.num_generations} a prompt) "
                  f"of {generation.completion_tokens} tokens by {generation.engine}")
    return ["trainer", words]


def _micro_batch_words(settings: PlannedSettings, step: StepPeak) -> str:
    """With accumulation, which micro-batch holds the peak (or that it follows them all)."""
    steps = settings.gradient_accumulation_steps
    if steps == 1:
        return ""
    if step.peak_micro_batch is not None:
        return f" of micro-batch {step.peak_micro_batch} of {steps}"
    return f" (after {steps} micro-batches)"


def _largest_batch_table(largest: LargestBatch) -> TextTable:
    """The batches --max-batch-size planned, under its answer."""
    rows = [[str(batch.batch_size), bytes_cell(batch.peak_bytes), bytes_cell(batch.reserved_peak_bytes),
             "-" if batch.fits is None else ("fits" if batch.fits else "does not fit")] for batch in largest.searched]
    best = largest.max_batch_size
    if largest.problem is not None:
        title = f"No largest batch: {largest.problem}; only the model states are planned"
    elif best is not None and largest.is_search_limit:
        title = (f"Largest per-device batch that fits: at least {best:,}, the search's limit (it fits; no larger "
                 f"batch was tried)")
    elif best is not None:
        title = f"Largest per-device batch that fits: {best}"
    else:
        smallest = largest.searched[0].batch_size if largest.searched else 1
        title = f"No batch fits (not even {smallest}, the smallest the trainer takes)" if smallest > 1 else \
            "No batch fits (not even 1)"
    return TextTable(title, ["batch", "step peak", "reserved peak", "fits?"], rows)


def _setting_cell(value: Any) -> str:
    """A setting as its reader wrote it: a whole number without a decimal point (a DeepSpeed
    config's `5e8` is the JSON float 500000000.0), counts with thousands separators."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _allocator_rows(device: DeviceFigures) -> List[List[str]]:
    """The allocator replay's figures beside the allocated peak (CUDA only)."""
    if device.reserved_peak_bytes is None:
        return []
    rows = [["allocated peak (caching allocator)",
             f"{bytes_cell(device.allocator_allocated_peak_bytes)} (blocks rounded, cuBLAS workspaces "
             f"{bytes_cell(device.cuda_workspace_bytes)})"],
            ["reserved peak (two steps replayed)", f"{bytes_cell(device.reserved_peak_bytes)}, "
             f"{bytes_cell(device.fragmentation_bytes)} of it cached, not allocated (reserved peak less allocated peak)"
             + (f", PYTORCH_CUDA_ALLOC_CONF={device.alloc_conf}" if device.alloc_conf else "")],
            ["device total (nvidia-smi)", f"{bytes_cell(device.device_total_bytes)} (CUDA context "
             f"{bytes_cell(device.cuda_context_bytes)}{', ' + device.gpu if device.gpu else ''})"]]
    return rows


def _not_counted(device: DeviceFigures) -> str:
    if not device.not_counted:
        return ""
    return ("Not counted: " if device.reserve_bytes is None else "Not counted, left to --reserve: ") + \
        "; ".join(device.not_counted)
