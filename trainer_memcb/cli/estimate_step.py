"""The step plan for the options of `trainer-memcb estimate`: the step traced at the batch asked
(each process that differs), the largest batch searched, the model states during the step, and
--fit's search."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from trainer_memcb.cli.collector import freeze_what_the_plan_keeps, freeze_what_was_imported
from trainer_memcb.cli.device_options import usable_memory
from trainer_memcb.cli.estimate_checks import NEEDS_SEQ_LEN, check_search_options
from trainer_memcb.cli.estimate_model import estimate_model, first_then_new, quantization_of
from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.estimate_settings import autocast_keeps_dtype, precision_from_dtype, step_settings
from trainer_memcb.cli.progress import say_progress
from trainer_memcb.cli.step_answer import StepAnswer
from trainer_memcb.utils.units import format_bytes

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan
    from trainer_memcb.plan.answers.step_memory import StepMemoryPlan
    from trainer_memcb.plan.model.quantized import Quantization

__all__ = ["estimate_step", "fullest_process", "ranks_to_plan", "tp_groups_to_plan", "with_rank_groups"]


def estimate_step(args: EstimateRequest) -> Dict[str, Any]:
    """The step plan (and the model-states plan) for the options: a dict of plans and the search.

    Raises:
        ValueError: --seq-len or --device-memory missing where needed, a bad setup.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.step.trace import counting_flops, sharing_traces

    # Each distinct step traced once: the search, the own step and --fit's, which reads the FLOPs.
    with sharing_traces(), counting_flops() if getattr(args, "fit", False) else contextlib.nullcontext():
        return _estimate_step(args)


@dataclass(frozen=True)
class _StepTraces:
    """What every trace of the command's step shares.

    Attributes:
        args: the options.
        build_model: gives each trace its model (`first_then_new`).
        quantization: the base model's loading (QLoRA), or None.
        states: the model-states plan, the traces' own unless one is given.
        explicit_dtype: whether the precision gives the parameters' dtype (else --dtype's).
        keep_dtypes: whether each parameter keeps the dtype the model was built in.
        config: the model's config (its sizes say which tensor-parallel ranks hold equal shards).
    """

    args: EstimateRequest
    build_model: Callable[[], Any]
    quantization: Optional[Quantization]
    states: ModelStatesPlan
    explicit_dtype: bool
    keep_dtypes: bool
    config: Any = None


def _estimate_step(args: EstimateRequest) -> StepAnswer:
    check_search_options(args)
    from trainer_memcb.plan.answers.max_batch import LargestBatch, max_batch_size, trainer_batches
    from trainer_memcb.plan.answers.step_memory import states_during_step
    from trainer_memcb.plan.settings.micro_batch import per_device_batch

    memory = usable_memory(args)
    traces, settings = _step_traces(args, memory)
    plan_at = functools.partial(_plan_at, traces, settings)
    freeze_what_was_imported()  # the modules the step needs are in: no full collection walks them again
    found: Optional[int] = None
    searched: List[StepMemoryPlan] = []
    largest = None
    if args.max_batch_size:
        first, unit = trainer_batches(settings.preference)  # TRL's steps take only some batches
        found, searched = max_batch_size(plan_at, memory, first=first, unit=unit)
        largest = LargestBatch.of(found, searched, unit)
    step = plan_at(per_device_batch(settings)) if settings.batch_size is not None else None
    # The model-states table from the same trace: each state's most during the engine's step (the
    # states do not depend on the batch, so the search's plan at the answer serves without one).
    traced = step if step is not None else next((plan for plan in searched if plan.settings.per_device_batch == found),
                                                None)
    states = traces.states
    if traced is not None:
        states = states_during_step(states, traced)
    fit = None
    if getattr(args, "fit", False) and step is not None:
        fit = _estimate_fit(dataclasses.replace(traces, states=states), settings, memory)
    return StepAnswer(states, step, largest_batch=largest, fit=fit, largest_step=traced if step is None else None)


def _step_traces(args: EstimateRequest, memory: Optional[int]) -> Tuple[_StepTraces, Any]:
    """The model the options describe, built once (checking the options) with its states planned,
    and the step's settings: what the traces share, and the settings they start from."""
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.model.step_inputs import head_kind
    from trainer_memcb.plan.settings.setup import setup_of

    quantization = quantization_of(args)
    model = estimate_model(args)  # checks the options once, and plans the model states
    if args.seq_len is None and head_kind(model) not in ("image", "speech_seq2seq"):
        raise ValueError(NEEDS_SEQ_LEN)
    settings = step_settings(args, model)
    if settings.batch_size is None and not args.max_batch_size:
        raise ValueError("--batch-size is needed (or per_device_train_batch_size in --training-args)")
    setup = setup_of(settings)
    # Without --precision each parameter keeps the dtype the model was built in (PEFT's float32
    # adapters over a bfloat16 base), as `estimate_plan` and the what-if count them.
    explicit_dtype = args.precision or not precision_from_dtype(settings.sources)
    keep_dtypes = not explicit_dtype or autocast_keeps_dtype(args, settings.precision, settings.sharding)
    explicit_dtype = explicit_dtype and not keep_dtypes
    say_progress("planning the model states")
    states = plan_model_states(model, settings.optimizer, setup, device_memory=memory, model_name=args.model,
                               reference_model=args.reference_model or _dpo_reference(settings),
                               keep_dtypes=keep_dtypes)
    build_model = first_then_new(model, functools.partial(estimate_model, args))
    return _StepTraces(args, build_model, quantization, states, bool(explicit_dtype),
                       keep_dtypes, getattr(model, "config", None)), settings


def _dpo_reference(settings: Any) -> bool:
    """Whether TRL's DPO or GRPO step holds a frozen reference model (`--trainer dpo` without PEFT or
    precomputed log-probs, `--trainer grpo` with beta above 0 without PEFT): the model states then
    count it."""
    return settings.preference is not None and settings.preference.reference == "model"


def _plan_at(traces: _StepTraces, settings: Any, batch: int) -> StepMemoryPlan:
    """The step at the per-device batch `batch`, the other settings kept (a padding-free SFT step's
    one row resized to `batch` x seq_len tokens: `settings_at_batch`)."""
    from trainer_memcb.plan.settings.micro_batch import per_device_batch, settings_at_batch

    # At the settings' own batch they are kept as given: a --packing row need not be whole sequences.
    at = settings if batch == per_device_batch(settings) else settings_at_batch(settings, batch)
    at = dataclasses.replace(at, sources=dict(settings.sources, batch_size=settings.sources.get("batch_size", "flag")))
    return _plan_ranks(traces, at)


def _plan_ranks(traces: _StepTraces, at: Any, **more: Any) -> StepMemoryPlan:
    """The step at the settings `at`, for each process `ranks_to_plan` names (or one of each group
    `tp_groups_to_plan` names): the fullest's plan."""
    groups = tp_groups_to_plan(at, traces.config)
    if groups is not None:
        source = "default: one of each group of ranks holding equal shards (beside CP, running the same ring turns)"
        return with_rank_groups([_plan_for(traces, dataclasses.replace(at, rank=group[0], sources=dict(
            at.sources, rank=source)), **more) for group in groups], groups)
    ranks = ranks_to_plan(at)
    if len(ranks) == 1:
        return _plan_for(traces, at, **more)
    source = f"default: the fuller of ranks {ranks[0]} and {ranks[-1]}"
    return fullest_process([_plan_for(traces, dataclasses.replace(at, rank=rank, sources=dict(at.sources, rank=source)),
                                      **more) for rank in ranks], ranks)


def _plan_for(traces: _StepTraces, at: Any, build: Any = None, states_plan: Any = None, **more: Any) -> StepMemoryPlan:
    """One trace of the step at the settings `at` (`build`, `states_plan` and `more`: --fit's
    proposals, expandable segments among them)."""
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.optimizers.whatif import resolve_dtype
    from trainer_memcb.plan.settings.micro_batch import per_device_batch

    args = traces.args
    several = ranks_to_plan(at) != [at.rank] or at.sources.get("rank") == "flag" or \
        tp_groups_to_plan(at, traces.config) is not None
    say_progress(f"tracing the step at batch {per_device_batch(at)}" + (f", rank {at.rank}" if several else "")
                 + (" (searching the largest batch)" if args.max_batch_size else ""))
    # The settings hold the batch's shape and the device (`step_settings`); `more`: --fit's
    # proposals, expandable segments among them.
    # A --fit proposal over a 4-bit base (`--allow qlora`) brings its own quantization.
    quantization = more.pop("quantization", traces.quantization)
    plan = plan_step_memory(build or traces.build_model, at, quantization=quantization, model_name=args.model,
                            states_plan=states_plan or traces.states,
                            dtype=None if traces.explicit_dtype else resolve_dtype(args.dtype or "float32"),
                            keep_dtypes=traces.keep_dtypes, **more)[0]
    freeze_what_the_plan_keeps()  # out of the collector's later passes (the search keeps it to its end)
    return plan


def _estimate_fit(traces: _StepTraces, settings: Any, memory: Optional[int]) -> Any:
    """--fit's search, each proposal traced as the command's own step is (`traces.states`: the
    states during the own step)."""
    from trainer_memcb.cli.fit_table import estimate_fit

    return estimate_fit(traces.args, settings, memory, functools.partial(_plan_ranks, traces),
                        plan_for_states=functools.partial(_states_for, traces.args, traces.keep_dtypes, {}),
                        estimate_model=estimate_model, step_settings=step_settings)


def _states_for(args: EstimateRequest, keep_dtypes: bool, planned: Dict[Any, ModelStatesPlan],
                at: Any) -> ModelStatesPlan:
    """The model-states plan of a --fit proposal's settings `at`, on a model built anew; `planned`
    keeps each one made, by what it reads of `at` (its optimizer, its setup, the reference model):
    the proposals that change the batch, checkpointing, the attention or the allocator share their
    states plan, and the model is not built again for them."""
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.settings.setup import setup_of

    setup, reference = setup_of(at), bool(args.reference_model or _dpo_reference(at))
    key = (at.optimizer, setup, reference)
    if key not in planned:
        planned[key] = plan_model_states(estimate_model(args), at.optimizer, setup, model_name=args.model,
                                         reference_model=reference, keep_dtypes=keep_dtypes)
    return planned[key]


def ranks_to_plan(settings: Any) -> List[int]:
    """The processes the command plans: the one `--rank` names, else, where processes differ
    (DeepSpeed ZeRO-1/2 on several: each rank's partition keeps other gradients), the first and the
    last, whose partitions hold the embedding and the head; one process otherwise."""
    if settings.sources.get("rank") == "flag" or settings.zero_stage not in (1, 2) or settings.world_size == 1:
        return [settings.rank]
    return [0, settings.world_size - 1]


def tp_groups_to_plan(settings: Any, config: Any) -> Optional[List[List[int]]]:
    """Under tensor or context parallelism, without `--rank`, where the ranks' steps differ (an uneven
    vocabulary or MLP width, FSDP2's uneven chunks, each `cp` rank's turns of the ring): the ranks
    grouped by what they hold (`tp_rank_groups`), one trace each; else None."""
    from trainer_memcb.plan.settings.parallelism import tp_rank_groups

    if settings.sources.get("rank") == "flag" or (settings.tp_size <= 1 and settings.cp_size <= 1):
        return None
    tp, cp, replicate = settings.tp_size, settings.cp_size, settings.replicate
    groups = tp_rank_groups(config, tp, settings.world_size // (tp * cp * replicate), replicate, cp)
    return groups if len(groups) > 1 else None


def with_rank_groups(plans: List[StepMemoryPlan], groups: List[List[int]]) -> StepMemoryPlan:
    """The plan of the fullest group's process (`fullest_process`), with every group's figures
    (`StepPeak.rank_groups`): groups whose steps came out the same to the byte joined."""
    from trainer_memcb.plan.answers.step_plan import RankGroup

    figures: List[RankGroup] = []
    for group, plan in zip(groups, plans):
        step, device, verdict = plan.step, plan.device, plan.verdict
        found = RankGroup(list(group), step.peak_bytes, step.peak_phase, dict(step.model_states_at_optimizer_step_bytes),
                          device.device_total_bytes, verdict.fits, verdict.margin_bytes)
        same = next((index for index, known in enumerate(figures)
                     if dataclasses.replace(known, ranks=[]) == dataclasses.replace(found, ranks=[])), None)
        if same is None:
            figures.append(found)
        else:
            figures[same] = dataclasses.replace(figures[same], ranks=sorted(figures[same].ranks + found.ranks))
    fullest = fullest_process(plans, [group[0] for group in groups])
    return dataclasses.replace(fullest, step=dataclasses.replace(fullest.step, rank_groups=figures))


def fullest_process(plans: List[StepMemoryPlan], ranks: List[int]) -> StepMemoryPlan:
    """The plan of the process that holds the most on the device at its peak (the first if equal),
    with a note of the other's peak."""
    index = max(range(len(plans)), key=lambda i: (plans[i].step.peak_bytes or 0, -i))
    others = ", ".join(f"rank {rank} {format_bytes(plan.step.peak_bytes or 0)} ({plan.step.peak_bytes or 0:,})"
                       for rank, plan in zip(ranks, plans) if rank != ranks[index])
    note = f"rank {ranks[index]} holds the most of ranks {' and '.join(map(str, ranks))} at its peak ({others})"
    fullest = plans[index]
    return dataclasses.replace(fullest, step=dataclasses.replace(fullest.step, notes=list(fullest.step.notes) + [note]))
