"""The step plan for the options of `trainer-memcb estimate`: the step traced at the batch asked
(each process that differs), the largest batch searched, the model states during the step, and
--fit's search."""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from trainer_memcb.cli.collector import freeze_what_was_imported
from trainer_memcb.cli.device_options import DEFAULT_DEVICE_TYPE, alloc_conf_of, reserve_bytes, usable_memory
from trainer_memcb.cli.estimate_checks import _NEEDS_SEQ_LEN, _check_search_options
from trainer_memcb.cli.estimate_model import _first_then_new, _quantization, estimate_model
from trainer_memcb.cli.estimate_settings import _autocast_keeps_dtype, step_settings
from trainer_memcb.cli.progress import say_progress
from trainer_memcb.utils.units import format_bytes

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.step_memory import StepMemoryPlan

__all__ = ["estimate_step", "fullest_process", "ranks_to_plan"]


def estimate_step(args: argparse.Namespace) -> Dict[str, Any]:
    """The step plan (and the model-states plan) for the options: a dict of plans and the search.

    Raises:
        ValueError: --seq-len or --device-memory missing where needed, a bad setup.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.step.trace import counting_flops, sharing_traces

    # Each distinct step traced once: the search, the own step and --fit's, which reads the FLOPs.
    with sharing_traces(), counting_flops() if getattr(args, "fit", False) else contextlib.nullcontext():
        return _estimate_step(args)


def _estimate_step(args: argparse.Namespace) -> Dict[str, Any]:
    _check_search_options(args)
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.model.step_inputs import head_kind
    from trainer_memcb.plan.answers.max_batch import MAX_BATCH_SEARCH_LIMIT, max_batch_size
    from trainer_memcb.plan.answers.step_memory import plan_step_memory, states_during_step
    from trainer_memcb.plan.settings.setup import setup_of
    from trainer_memcb.plan.optimizers.whatif import resolve_dtype

    memory = usable_memory(args)
    device_type = args.device_type or DEFAULT_DEVICE_TYPE
    alloc_conf = alloc_conf_of(args) if device_type == "cuda" else None
    quantization = _quantization(args)
    model = estimate_model(args)  # checks the options once, and plans the model states
    if args.seq_len is None and head_kind(model) not in ("image", "speech_seq2seq"):
        raise ValueError(_NEEDS_SEQ_LEN)
    settings = step_settings(args, model)
    if settings.batch_size is None and not args.max_batch_size:
        raise ValueError("--batch-size is needed (or per_device_train_batch_size in --training-args)")
    setup = setup_of(settings)
    # Without --precision each parameter keeps the dtype the model was built in (PEFT's float32
    # adapters over a bfloat16 base), as `estimate_plan` and the what-if count them.
    explicit_dtype = args.precision or settings.sources.get("precision", "default") != "flag"
    keep_dtypes = not explicit_dtype or _autocast_keeps_dtype(args, settings.precision, settings.sharding)
    explicit_dtype = explicit_dtype and not keep_dtypes
    say_progress("planning the model states")
    states = plan_model_states(model, settings.optimizer, setup, device_memory=memory, model_name=args.model,
                               reference_model=args.reference_model, keep_dtypes=keep_dtypes)
    build_model = _first_then_new(model, lambda: estimate_model(args))
    del model

    def plan_at(batch: int) -> StepMemoryPlan:
        import dataclasses

        at = dataclasses.replace(settings, batch_size=batch, sources=dict(settings.sources, batch_size=settings.sources.get("batch_size", "flag")))
        return plan_ranks(at)

    def plan_ranks(at: Any, **more: Any) -> StepMemoryPlan:
        import dataclasses

        ranks = ranks_to_plan(at)
        if len(ranks) == 1:
            return plan_for(at, **more)
        source = f"default: the fuller of ranks {ranks[0]} and {ranks[-1]}"
        return fullest_process([plan_for(dataclasses.replace(at, rank=rank, sources=dict(at.sources, rank=source)), **more)
                                for rank in ranks], ranks)

    def plan_for(at: Any, build: Any = None, states_plan: Any = None, **more: Any) -> StepMemoryPlan:
        several = ranks_to_plan(at) != [at.rank] or at.sources.get("rank") == "flag"
        say_progress(f"tracing the step at batch {at.batch_size}" + (f", rank {at.rank}" if several else "")
                     + (" (searching the largest batch)" if args.max_batch_size else ""))
        options = dict(seq_len=args.seq_len, quantization=quantization, alloc_conf=alloc_conf,
                       gpu=getattr(args, "gpu", None))
        options.update(more)  # --fit's proposals: expandable segments among them
        return plan_step_memory(build or build_model, settings=at, **options,
                                attn_implementation=args.attn_implementation, device_type=device_type,
                                device_memory=args.device_memory, reserve_bytes=reserve_bytes(args) or 0, model_name=args.model,
                                states_plan=states_plan or states,
                                dtype=None if explicit_dtype else resolve_dtype(args.dtype or "float32"),
                                target_len=getattr(args, "target_len", None), image_size=getattr(args, "image_size", None),
                                padding=getattr(args, "padding", 0) or 0, keep_dtypes=keep_dtypes)[0]

    freeze_what_was_imported()  # the modules the step needs are in: no full collection walks them again
    found: Optional[int] = None
    searched: List[StepMemoryPlan] = []
    problem: Optional[str] = None
    if args.max_batch_size:
        found, searched = max_batch_size(plan_at, memory)
        problem = next((f"at batch {plan.batch_size} {plan.problem}" for plan in searched if plan.problem is not None),
                       None)
    step = plan_at(settings.batch_size) if settings.batch_size is not None else None
    # The model-states table from the same trace: each state's most during the engine's step (the
    # states do not depend on the batch, so the search's plan at the answer serves without one).
    traced = step if step is not None else next((plan for plan in searched if plan.batch_size == found), None)
    if traced is not None:
        states = states_during_step(states, traced)
    fit = None
    if getattr(args, "fit", False) and step is not None:
        from trainer_memcb.cli.fit_table import estimate_fit

        fit = estimate_fit(args, settings, memory, plan_ranks, plan_for_states=lambda at: plan_model_states(
            estimate_model(args), at.optimizer, setup_of(at), model_name=args.model,
            reference_model=args.reference_model, keep_dtypes=keep_dtypes), estimate_model=estimate_model,
            step_settings=step_settings)
    return {"step": step, "model_states": states, "max_batch_size": found, "searched": searched,
            "search": args.max_batch_size, "max_batch_size_problem": problem,
            "max_batch_size_is_search_limit": found == MAX_BATCH_SEARCH_LIMIT, "fit": fit}


def ranks_to_plan(settings: Any) -> List[int]:
    """The processes the command plans: the one `--rank` names, else, where processes differ
    (DeepSpeed ZeRO-1/2 on several: each rank's partition keeps other gradients), the first and the
    last, whose partitions hold the embedding and the head; one process otherwise."""
    if settings.sources.get("rank") == "flag" or settings.zero_stage not in (1, 2) or settings.world_size == 1:
        return [settings.rank]
    return [0, settings.world_size - 1]


def fullest_process(plans: List[StepMemoryPlan], ranks: List[int]) -> StepMemoryPlan:
    """The plan of the process that holds the most on the device at its peak (the first if equal),
    with a note of the other's peak."""
    import dataclasses

    index = max(range(len(plans)), key=lambda i: (plans[i].peak_bytes or 0, -i))
    others = ", ".join(f"rank {rank} {format_bytes(plan.peak_bytes or 0)} ({plan.peak_bytes or 0:,})"
                       for rank, plan in zip(ranks, plans) if rank != ranks[index])
    note = f"rank {ranks[index]} holds the most of ranks {' and '.join(map(str, ranks))} at its peak ({others})"
    return dataclasses.replace(plans[index], notes=list(plans[index].notes) + [note])
