"""Before the first step: will the run's own step fit, and if not, what would?

`OptimizerMemoryCallback(preflight=True)` calls `preflight` at `on_train_begin`: the step of the
model as loaded (a meta-device stand-in of it, `trainer_memcb.plan.model.stand_ins`: the model
itself is untouched), with `trainer.args` (batch, accumulation, optimizer, checkpointing,
precision, the DeepSpeed or FSDP config, the processes), planned by the traced step
(`plan_step_memory`). The sequence is the longest the run can make: the arguments' `max_length`
(TRL's configs) when set, else the tokenizer's `model_max_length`, else the model's
`max_position_embeddings`.

On CUDA the peak is compared with what the process can use: the device's free memory plus what
this process's allocator holds already (the loaded model among it). When the step will not fit,
the settings that fit are searched (`trainer_memcb.plan.answers.fit.search_fits`) and one warning
names the best. Nothing of the run is changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from trainer_memcb.plan.answers.fit import FitSearch, search_fits, step_planner, training_args_of
from trainer_memcb.plan.answers.step_memory import StepMemoryPlan
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.training.run_plan import plan_for_trainer, run_world_size, stand_in_builder
from trainer_memcb.utils.units import format_bytes

__all__ = ["Preflight", "longest_batch_len", "preflight", "run_seq_len", "usable_device_memory"]

# A tokenizer without a limit reports this sentinel (transformers' VERY_LARGE_INTEGER, int(1e30)).
_NO_LIMIT = 10**12


@dataclass(frozen=True)
class Preflight:
    """What the preflight found.

    Attributes:
        plan: the run's own step, planned.
        seq_len: the sequence length planned.
        usable_bytes: what the step may use on the device (None: not compared, off CUDA).
        search: the settings searched when the step does not fit, or None.
        warning: the warning given, or None.
    """

    plan: StepMemoryPlan
    seq_len: int
    usable_bytes: Optional[int]
    search: Optional[FitSearch]
    warning: Optional[str]


def _example_lengths(dataset: Any) -> Optional[List[int]]:
    """The lengths of the examples' `input_ids`, from lengths alone: a `datasets.Dataset`'s Arrow
    column (`pyarrow.compute.list_value_length`, through its indices after `select`/`shuffle`), or
    `len` of each example of a list; None for any other dataset (its items would have to be made)."""
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list) and "input_ids" in column_names and hasattr(dataset, "data"):
        import pyarrow.compute as pc

        lengths = pc.list_value_length(dataset.data.column("input_ids"))
        indices = getattr(dataset, "_indices", None)  # datasets.Dataset's mapping after select/shuffle
        if indices is not None:
            lengths = pc.take(lengths, indices.column(0))
        return [length for length in lengths.to_pylist() if length is not None]
    if isinstance(dataset, (list, tuple)) and dataset and all(
            isinstance(example, dict) and "input_ids" in example for example in dataset):
        return [len(example["input_ids"]) for example in dataset]
    return None


def longest_batch_len(dataset: Any, collator: Any = None) -> Optional[int]:
    """The longest sequence the collator can make of `dataset`: its longest `input_ids`, padded up
    to the collator's `pad_to_multiple_of` (transformers' `DataCollatorWithPadding`,
    `DataCollatorForSeq2Seq`, `DataCollatorForLanguageModeling`: `tokenizer.pad`), or the
    collator's `max_length` where it pads to it (`padding="max_length"`). None when the dataset
    does not say its lengths (`_example_lengths`)."""
    collator = getattr(collator, "data_collator", collator)  # the Trainer's RemoveColumnsCollator
    if getattr(collator, "padding", None) == "max_length" and isinstance(getattr(collator, "max_length", None), int):
        return collator.max_length
    lengths = _example_lengths(dataset)
    if not lengths:
        return None
    longest = max(lengths)
    multiple = getattr(collator, "pad_to_multiple_of", None)
    if isinstance(multiple, int) and multiple > 1:
        longest = -(-longest // multiple) * multiple
    return longest


def run_seq_len(args: Any, model: Any, processing_class: Any = None, train_dataloader: Any = None) -> Optional[int]:
    """The longest sequence the run can make: the longest batch its train dataloader's collator can
    make (`longest_batch_len`), `args.max_length` (or `max_seq_length`), the tokenizer's
    `model_max_length`, the model's `max_position_embeddings`, the first known."""
    if train_dataloader is not None:
        longest = longest_batch_len(getattr(train_dataloader, "dataset", None),
                                    getattr(train_dataloader, "collate_fn", None))
        if longest is not None:
            return longest
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < _NO_LIMIT:
        return value
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    value = getattr(text, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def usable_device_memory(device: torch.device) -> Optional[int]:
    """On CUDA: the device's free memory plus what this process's caching allocator holds (the
    loaded model is in it, and the plan counts it); None elsewhere. One driver query, no sync."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + int(torch.cuda.memory_reserved(device))


def preflight(model: Any, args: Any, *, processing_class: Any = None, device_memory: Optional[int] = None,
              seq_len: Optional[int] = None, train_dataloader: Any = None) -> Optional[Preflight]:
    """Plan the run's own step and, where it will not fit, the settings that would.

    Args:
        model: the model as loaded (unwrapped); args: the Trainer's `TrainingArguments`.
        processing_class: the tokenizer, for its `model_max_length`.
        device_memory: bytes the step may use; None: the CUDA device's (`usable_device_memory`),
            or no comparison off CUDA.
        seq_len: the sequence planned; None: `run_seq_len`.
        train_dataloader: the run's train dataloader, for its dataset's longest example.

    Returns:
        None when no sequence length is known.
    """
    seq_len = seq_len or run_seq_len(args, model, processing_class, train_dataloader)
    if seq_len is None:
        return None
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    device_type = "cuda" if device.type == "cuda" else "cpu"
    usable = device_memory if device_memory is not None else usable_device_memory(device)
    world_size = run_world_size(args)
    settings = resolve_settings(args, world_size=world_size)
    # The engine's own arguments, as the Trainer reads them: `fsdp_config` only with `fsdp` set
    # (transformers 4.x fills `fsdp_config` with its defaults in every run, sharded or not).
    engine_keys = ("deepspeed", "fsdp", "fsdp_config") if getattr(args, "fsdp", None) else ("deepspeed",)
    own = training_args_of(settings, {key: getattr(args, key) for key in engine_keys if getattr(args, key, None)})
    plan = plan_for_trainer(model, args, seq_len=seq_len, device_type=device_type, world_size=world_size)
    if usable is None or plan.step.peak_bytes is None or plan.step.peak_bytes <= usable:
        return Preflight(plan, seq_len, usable, None, None)
    # The model's own dtypes (a model loaded in bf16 stays so under bf16=True); the run's own
    # arguments for the optimizers' hyperparameters (a TrainingArguments made anew would reset
    # accelerate's state under the running Trainer).
    planner = step_planner(stand_in_builder(model), seq_len, device_type=device_type, world_size=world_size,
                           keep_dtypes=True, args=args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    search = search_fits(planner, own, usable, own_deepspeed=_deepspeed_of(args) if settings.zero_stage else None,
                         world_size=world_size, device_type=device_type, trainable_values=trainable,
                         value_bytes=param.element_size() if param is not None else 2)
    return Preflight(plan, seq_len, usable, search, _warning(plan, usable, search, device))


def _deepspeed_of(args: Any) -> Optional[dict]:
    config = getattr(args, "hf_deepspeed_config", None)
    config = getattr(config, "config", None) or getattr(args, "deepspeed", None)
    return config if isinstance(config, dict) else None


def _warning(plan: StepMemoryPlan, usable: int, search: FitSearch, device: torch.device) -> str:
    head = (f"the planned training step needs {format_bytes(plan.step.peak_bytes)} per process and {device} has "
            f"{format_bytes(usable)} for it: it will not fit")
    best = search.best
    if best is not None:
        changes = {key: value for key, value in best.training_args.items() if search.own.training_args.get(key) != value}
        return (f"{head}; the best proposal, {best.label}, plans {format_bytes(best.peak_bytes)} at "
                f"{best.relative_step_time or 1.0:.2f}x the step time: TrainingArguments {changes}")
    nearest = search.nearest_miss()
    return head + (f"; nothing searched fits, the nearest is {nearest.label} at {format_bytes(nearest.peak_bytes)}"
                   if nearest is not None else "")
