"""`trainer-memcb estimate ... --fit`: the settings that fit, as a table, and the first one written
as `TrainingArguments` JSON and a DeepSpeed config.

The search and its figures are `trainer_memcb.plan.answers.fit.search_fits`'s; this module gives
it the command's own planner (each proposal's `TrainingArguments` dict and DeepSpeed config
resolved exactly as `--training-args FILE --deepspeed FILE` would be, the other flags kept), and
prints and writes the answer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional

from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.output import TextTable, bytes_cell
from trainer_memcb.plan.answers.fit import (
    FitCandidate,
    FitSearch,
    expandable_segments_option,
    flash_attention_proposable,
    liger_kernel_proposable,
    search_fits,
    training_args_of,
)
from trainer_memcb.plan.answers.step_memory import StepMemoryPlan, plan_step_memory
from trainer_memcb.utils.units import format_bytes

__all__ = ["estimate_fit", "fit_tables", "fit_json", "fit_failure", "write_first_proposal"]


def _user_files(args: EstimateRequest) -> tuple:
    from trainer_memcb.plan.settings.step_settings import read_json_file

    user_args = read_json_file(args.training_args, "training args") if args.training_args else {}
    deepspeed = args.deepspeed if args.deepspeed is not None else user_args.get("deepspeed")
    if isinstance(deepspeed, str):
        deepspeed = read_json_file(deepspeed, "deepspeed config")
    return user_args, deepspeed


def own_setting(settings: Any, args: EstimateRequest) -> tuple:
    """The user's own setting as a `TrainingArguments` dict and a DeepSpeed config (or None),
    whatever gave it (their files, the flags)."""
    user_args, deepspeed = _user_files(args)
    own = training_args_of(settings, user_args)
    if settings.zero_stage:
        deepspeed = dict(deepspeed or {})
        deepspeed["zero_optimization"] = dict(settings.zero)  # the resolved values: flags and "auto" filled
        if settings.precision.startswith("deepspeed-"):
            deepspeed.setdefault(settings.precision[len("deepspeed-"):], {"enabled": "auto"})
        own["deepspeed"] = deepspeed
    else:
        deepspeed = None
        own.pop("deepspeed", None)
    if settings.tp_size > 1 or settings.cp_size > 1:  # accelerate's ParallelismConfig, as TrainingArguments.to_dict writes it
        replicate = settings.replicate if settings.cp_size > 1 else 1
        shards = settings.world_size // (settings.tp_size * settings.cp_size * replicate)
        own["parallelism_config"] = {"tp_size": settings.tp_size, "dp_shard_size": shards,
                                     "dp_replicate_size": replicate, "cp_size": settings.cp_size}
        if settings.cp_size > 1 and settings.cp_comm_strategy != "allgather":
            own["parallelism_config"]["cp_handler"] = {"cp_comm_strategy": settings.cp_comm_strategy}
        own.pop("fsdp", None)
        own.pop("fsdp_config", None)
    elif settings.sharding.startswith("fsdp") and not own.get("fsdp"):
        own["fsdp"] = "full_shard" if settings.reshard_after_forward else "shard_grad_op"
        own["fsdp_config"] = {"version": 2, "reshard_after_forward": settings.reshard_after_forward,
                              "cpu_offload": settings.fsdp_cpu_offload}
    return own, deepspeed


def estimate_fit(args: EstimateRequest, settings: Any, usable: int, plan_ranks: Callable[..., StepMemoryPlan],
                 plan_for_states: Callable[[Any], Any], estimate_model: Callable[[EstimateRequest], Any],
                 step_settings: Callable[[EstimateRequest, Any], Any]) -> FitSearch:
    """The search for the options, each proposal planned as `--training-args` and `--deepspeed`
    files holding it would be planned with the command's other flags (`step_settings`, the
    command's own reading of them; `estimate_model` builds the model the options describe)."""
    from trainer_memcb.plan.optimizers.whatif import DEFAULT_OPTIMIZERS

    model = estimate_model(args)  # its hidden size fills the DeepSpeed config's "auto" values
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    own, own_deepspeed = own_setting(settings, args)

    def planner(training_args: Dict[str, Any], deepspeed: Optional[Dict[str, Any]], **extra: Any) -> StepMemoryPlan:
        # The file says bf16/fp16 (autocast or DeepSpeed's); a model loaded in 16 bits stays a flag.
        changed: Dict[str, Any] = dict(
            training_args=training_args, deepspeed=deepspeed, fsdp_config=None, batch_size=None,
            gradient_checkpointing=False, optimizers=list(DEFAULT_OPTIMIZERS), zero=None, sharding=None,
            parallelism=None, offload_optimizer=False, offload_params=False,
            precision=settings.precision if settings.precision in ("bf16", "fp16") else None)
        more: Dict[str, Any] = {}
        if "seq_len" in extra:  # the settings' too: a padding-free SFT row is the batch x seq_len tokens
            more["seq_len"] = changed["seq_len"] = extra["seq_len"]
        if "alloc_conf" in extra:
            more["alloc_conf"] = extra["alloc_conf"]
        if "attn_implementation" in extra:
            changed["attn_implementation"] = extra["attn_implementation"]
        if extra.get("lora_r"):
            changed["lora_r"] = extra["lora_r"]
        given = dataclasses.replace(args, **changed)
        if extra.get("lora_r"):
            more["build"] = lambda: estimate_model(given)
        if extra.get("load_in_4bit"):
            from trainer_memcb.plan.model.quantized import Quantization

            more["quantization"] = Quantization()
        at = step_settings(given, model)
        return plan_ranks(at, states_plan=plan_for_states(at), **more)

    precision = settings.precision
    device_type = args.device_type or "cuda"
    value_bytes = 2 if precision not in ("fp32", "autocast-bf16", "autocast-fp16") else 4
    return search_fits(planner, own, usable, own_deepspeed=own_deepspeed, world_size=settings.world_size,
                       device_type=device_type, trainable_values=trainable, value_bytes=value_bytes,
                       allow=args.allow, seq_len=args.seq_len, max_candidates=args.max_proposals,
                       expandable_segments=expandable_segments_option(plan_step_memory),
                       flash_attention=flash_attention_proposable(model, precision, device_type),
                       # Not for TRL's steps: their own fused LM head never holds the whole logits
                       # either, and TRL 1.16 turns Liger's fused loss off under it.
                       liger_kernel=(liger_kernel_proposable(model, device_type, settings.use_liger_kernel)
                                     and settings.preference is None and settings.tp_size == 1),
                       trainer_proposals=trainer_proposals(settings, own), **_trl_rules(settings, own, model),
                       **_layout_options(args, settings, model, value_bytes, device_type))


def _layout_options(args: EstimateRequest, settings: Any, model: Any, value_bytes: int,
                    device_type: str) -> Dict[str, Any]:
    """`search_fits`'s tensor-parallel sizes and what its collectives' cost is read from: the links
    of `--gpu` (CUDA only) on `--nodes`, the model's shape and its parameters' bytes."""
    from trainer_memcb.plan.answers.fit_comm import ModelShape, links_of
    world = settings.world_size
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    links = links_of(settings.gpu, world, settings.nodes) if device_type == "cuda" else None
    shape = None
    if text is not None and args.seq_len and all(isinstance(getattr(text, name, None), int)
                                                  for name in ("hidden_size", "num_hidden_layers", "vocab_size")):
        heads = getattr(text, "num_attention_heads", None) or 1
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        shape = ModelShape(text.hidden_size, text.num_hidden_layers, text.vocab_size, args.seq_len,
                           4 if settings.precision == "fp32" else 2, kv_width=kv_heads * head_dim)
    return dict(tensor_parallel_sizes=tensor_parallel_sizes(model, settings),
                context_parallel_sizes=context_parallel_sizes(model, settings), links=links, shape=shape,
                parameter_bytes=sum(p.numel() for p in model.parameters()) * value_bytes)


def tensor_parallel_sizes(model: Any, settings: Any) -> List[int]:
    """The tensor-parallel sizes `--fit` proposes: each divisor of the world size above 1 and at most
    the processes of a node (accelerate's mesh keeps `tp` innermost, on one node's links), for a model
    with a tensor-parallel plan whose heads split over it (an uneven MLP width or vocabulary is
    planned per rank); none for TRL's steps, PEFT's
    adapters or an own DeepSpeed precision (the plan traces TP alone or with FSDP2), nor on a plan
    supplied where transformers gives the model none (its run needs the plan passed by hand: the
    step plan of `--parallelism tp=N` says how)."""
    from trainer_memcb.plan.model.tp_plan import model_tp_plan
    from trainer_memcb.plan.settings.parallelism import check_tensor_parallel_model

    world, per_node = settings.world_size, max(1, settings.world_size // max(1, settings.nodes))
    if world <= 1 or settings.preference is not None or hasattr(model, "peft_config"):
        return []
    try:
        model_tp_plan(model, settings.tp_plan, supplied=False)
    except ValueError:
        return []
    sizes = []
    for tp in range(2, min(world, per_node) + 1):
        try:
            check_tensor_parallel_model(getattr(model, "config", None), tp, own_rules=bool(settings.tp_plan))
        except ValueError:
            continue
        if world % tp == 0:
            sizes.append(tp)
    return sizes


def context_parallel_sizes(model: Any, settings: Any) -> List[int]:
    """The context-parallel sizes `--fit` proposes: each divisor of the world size above 1 whose
    `2 x cp` divides the sequence (torch's head-tail load balancing), where accelerate, the Trainer
    and the plan take context parallelism (`check_context_parallel`'s and
    `check_context_parallel_model`'s rules: CUDA, SDPA attention, no step whose trainer refuses it,
    `context_parallel_step_refusal`: of TRL's, SFT's padded rows only, and no packing; no own
    tensor parallelism) and torch's ring runs the kernel the GPU takes (`_ring_is_traced`; weights in
    16 or 32 bits, not autocast); none for PEFT's adapters or on a torch without the ring."""
    from trainer_memcb.plan.settings.parallelism import check_context_parallel_model, context_parallel_step_refusal
    from trainer_memcb.plan.step.ring_attention import ring_module

    world, seq_len = settings.world_size, settings.seq_len
    attention = settings.attn_implementation or getattr(getattr(model, "config", None), "_attn_implementation", None)
    if (world <= 1 or settings.device_type != "cuda" or settings.precision not in ("bf16", "fp16", "fp32")
            or settings.tp_size > 1 or context_parallel_step_refusal(settings) is not None
            or hasattr(model, "peft_config") or not seq_len or ring_module() is None):
        return []
    try:
        check_context_parallel_model(model, attention, 2)
    except ValueError:
        return []
    return [cp for cp in range(2, world + 1)
            if world % cp == 0 and seq_len % (2 * cp) == 0 and _ring_is_traced(model, settings, seq_len // cp)]


def _ring_is_traced(model: Any, settings: Any, share: int) -> bool:
    """Whether torch's ring runs the kernel the settings' GPU takes for the ring's turns
    (`sdpa_backend`, causal, no mask, a `share` of the tokens each, in the attention's dtype): flash,
    cuDNN (an H100 or H200 with cuDNN above 9.15 prefers it in 16-bit) or memory-efficient (float32, a
    GPU before Ampere) where its padded logsumexp merges (`ring_refusal`), not math."""
    from trainer_memcb.plan.device.cuda_kernels import sdpa_backend
    from trainer_memcb.plan.step.ring_attention import ring_refusal

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if not isinstance(head_dim, int):
        return False
    # The attention's dtype: autocast and DeepSpeed run it in their 16-bit dtype.
    dtype = ("float32" if settings.precision == "fp32" else "bfloat16" if "bf16" in settings.precision
             else "float16")
    backend = sdpa_backend(dtype, head_dim, has_mask=False, is_causal=True,
                           compute_capability=settings.compute_capability, seq_len_q=share, seq_len_k=share)
    return ring_refusal(backend, share) is None


def _trl_rules(settings: Any, own: Dict[str, Any], model: Any) -> Dict[str, Any]:
    """For TRL's GRPO and RLOO steps (RLOO's generation is GRPO's, from the same fields of its
    config), the search's `settle_args` (the generation batch kept as the batch changes) and
    `trainer_searches` (a smaller `generation_batch_size`, a lower `vllm_gpu_memory_utilization`):
    `trainer_memcb.plan.answers.grpo_fit`; for KTO's, `settle_args` alone (no micro-batch of 1 with
    its KL term: `settle_kto_args`); nothing for another step."""
    from trainer_memcb.plan.answers.grpo_fit import grpo_searches, settle_grpo_args, vllm_floor_bytes
    from trainer_memcb.plan.answers.kto_fit import settle_kto_args

    step = getattr(settings, "preference", None)
    trainer = getattr(step, "trainer", None)
    if trainer == "kto":
        return {"settle_args": settle_kto_args(step)}
    if trainer == "sft" and settings.cp_size > 1:
        return {"settle_args": settle_sft_context_parallel_args}
    if trainer not in ("grpo", "rloo"):
        return {}
    floor = vllm_floor_bytes(model, step, own) if step.use_vllm else None
    return {"settle_args": settle_grpo_args(step, settings.batch_size),
            "trainer_searches": grpo_searches(step, settings.batch_size, settings.gradient_accumulation_steps,
                                              int(own.get("num_iterations") or 1), settings.device_memory_bytes, floor)}


def settle_sft_context_parallel_args(args: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """TRL's SFT step beside processes is planned under context parallelism only (beside FSDP2 over
    `dp_shard x cp`, `check_context_parallel`): a setting whose `parallelism_config` has no `cp_size`
    above 1 (the data-parallel, ZeRO and FSDP2 proposals) is not planned (None), others as given.

    Examples:
        >>> from trainer_memcb.cli.fit_table import settle_sft_context_parallel_args
        >>> settle_sft_context_parallel_args({"parallelism_config": {"cp_size": 2}}) is not None
        True
        >>> settle_sft_context_parallel_args({"fsdp": "full_shard"}) is None
        True
    """
    layout = args.get("parallelism_config") or {}
    return args if isinstance(layout, dict) and (layout.get("cp_size") or 1) > 1 else None


def trainer_proposals(settings: Any, own: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The changes of the trainer's own config proposed: for TRL's DPO and KTO steps with a
    reference that runs a forward (a frozen model, or the policy with its adapters off),
    `precompute_ref_log_probs` (TRL computes the reference's log-probs once, before training: the
    step then holds no reference model and runs no reference forward), unless the user's config
    (`own`) syncs the reference model, which TRL refuses beside it."""
    from trainer_memcb.plan.step.kto import KtoStep
    from trainer_memcb.plan.step.preference import DpoStep

    preference = getattr(settings, "preference", None)
    if (isinstance(preference, (DpoStep, KtoStep)) and preference.reference != "precomputed"
            and not own.get("sync_ref_model")):
        return [{"precompute_ref_log_probs": True}]
    return []


def _time_cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _row(name: str, candidate: FitCandidate, reserved: bool) -> List[str]:
    marks = []
    if candidate.changes_optimizer:
        marks.append("changes the optimizer")
    if candidate.alters_training:
        marks.append("changes the training")
    if candidate.needs_package:
        marks.append(f"needs {candidate.needs_package}")
    fits = "-" if candidate.fits is None else ("yes" if candidate.fits else "no")
    margin = "-" if candidate.margin_bytes is None else (
        bytes_cell(candidate.margin_bytes))  # signed: short is negative, in both figures
    row = [name, candidate.label + (f" ({'; '.join(marks)})" if marks else ""), bytes_cell(candidate.peak_bytes),
           fits, margin, _time_cell(candidate.relative_step_time), str(candidate.effective_batch)]
    if reserved:
        row.insert(3, "-" if candidate.reserved_peak_bytes is None else bytes_cell(candidate.reserved_peak_bytes))
    return row


def fit_tables(search: FitSearch, evaluation: bool = False, title: Optional[str] = None) -> List[TextTable]:
    """The user's own setting, then each proposal: its changes, peak, fits?, margin, relative step
    time (`evaluation`: the evaluation's proposals, fewest batches first, no time estimated;
    `title`: the table's, in place of the default)."""
    # On CUDA fits? is the allocator replay's: its reserved peak is what the margin is taken from.
    reserved = any(c.reserved_peak_bytes is not None for c in [search.own] + search.candidates)
    rows = [_row("own", search.own, reserved)] + [_row(str(index), c, reserved)
                                                 for index, c in enumerate(search.candidates, 1)]
    if title is None and evaluation:
        title = (f"Evaluation settings that fit in {format_bytes(search.usable_bytes)} per process, fewest batches "
                 f"first; effective batch: the eval batch")
    if title is None:
        limit = "the CUDA context and the reserve" if reserved else "the reserve"
        vllm = (" less each setting's share for colocated vLLM (its vllm_gpu_memory_utilization x the device's "
                "memory)" if _vllm_colocated(search) else "")
        title = (f"Settings that fit in {format_bytes(search.usable_bytes)} per process (the device's memory less "
                 f"{limit}){vllm}, fastest first; step time relative to your own"
                 + ("; fits? and the margin by what the caching allocator reserves over two steps" if reserved else ""))
    columns = ["", "changes", "peak", "fits", "margin", "step time", "effective batch"]
    if reserved:
        columns.insert(3, "reserved")
    return [TextTable(title, columns, rows, text_columns=(0, 1, 4 if reserved else 3))]


def _vllm_colocated(search: FitSearch) -> bool:
    """Whether the user's step is TRL's GRPO or RLOO with vLLM colocated (its share in each setting's reserve)."""
    settings = search.own.plan.settings if search.own.plan is not None else None
    generation = getattr(getattr(settings, "preference", None), "generation", None)
    return getattr(generation, "vllm_gpu_memory_utilization", None) is not None


def fit_json(search: FitSearch) -> Dict[str, Any]:
    """The `fit` object of `--json`."""
    return search.to_dict()


def fit_failure(search: FitSearch) -> Optional[str]:
    """The one line said when nothing fits, naming the nearest miss; None when something fits."""
    if search.found:
        return None
    nearest = search.nearest_miss()
    if nearest is None:
        return "nothing fits: no setting could be planned"
    held = (f"reserving {format_bytes(nearest.reserved_peak_bytes)}" if nearest.reserved_peak_bytes is not None
            else f"at {format_bytes(nearest.peak_bytes)}")
    return (f"nothing fits: the nearest is {nearest.label}, {held} per process, "
            f"{format_bytes(-nearest.margin_bytes)} over {format_bytes(search.usable_bytes)}")


def _write(path: str, data: bytes, force: bool) -> None:
    """`data` written whole to `path` (never through a link, never a partial file), one line refused."""
    from trainer_memcb.utils.safe_io import UnsafeFileError, atomic_write

    try:
        atomic_write(path, lambda handle: handle.write(data), overwrite=force)
    except (UnsafeFileError, FileExistsError) as error:
        text = str(error) if isinstance(error, UnsafeFileError) else f"{path} exists; not replacing it without --force"
        raise ValueError(text) from None


def _write_accelerate_config(first: FitCandidate, args: EstimateRequest, path: str, said: List[str]) -> None:
    """Write `first`'s accelerate config to `path` where it has one; say what was done."""
    from trainer_memcb.cli.accelerate_config import accelerate_config_of, accelerate_config_text

    world = int(args.world_size or 1)
    config = accelerate_config_of(first.training_args, world, int(args.nodes or 1))
    if config is None:
        said.append(f"{path} not written: {first.label} uses neither FSDP2 nor tensor parallelism")
        return
    _write(path, accelerate_config_text(config, path).encode("utf-8"), args.force)
    said.append(f"wrote {path}: the accelerate config of {first.label} (accelerate launch --config_file {path})")


def write_first_proposal(search: FitSearch, args: EstimateRequest) -> List[str]:
    """Write the user's own setting when it fits, else the first proposal that fits
    (`--write-training-args`, `--write-deepspeed`, `--write-accelerate-config`); the lines to say
    about it. The TrainingArguments JSON names the DeepSpeed file when both are written.

    Raises:
        ValueError: a destination refused (a link, a file without --force), one line.
    """
    said: List[str] = []
    accelerate_path = getattr(args, "write_accelerate_config", None)
    if not (args.write_training_args or args.write_deepspeed or accelerate_path):
        return said
    # The user's own setting when it fits as it is: a re-run with the file written plans the same
    # setting, and nothing changes that did not need to.
    first = search.own if search.fits_as_is else search.best
    if first is None:
        return ["nothing written: no proposal fits"]
    training_args = dict(first.training_args)

    def write(path: str, document: Dict[str, Any]) -> None:
        _write(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8"), args.force)

    if args.write_deepspeed:
        if first.deepspeed is None:
            said.append(f"{args.write_deepspeed} not written: {first.label} uses no DeepSpeed")
        else:
            write(args.write_deepspeed, first.deepspeed)
            said.append(f"wrote {args.write_deepspeed}: the DeepSpeed config of {first.label}")
            training_args["deepspeed"] = args.write_deepspeed
    if accelerate_path:
        _write_accelerate_config(first, args, accelerate_path, said)
    if args.write_training_args:
        write(args.write_training_args, training_args)
        kind = {"sft": "SFTConfig", "dpo": "DPOConfig", "kto": "KTOConfig", "grpo": "GRPOConfig",
                "rloo": "RLOOConfig"}.get(getattr(args, "trainer", "trainer"), "TrainingArguments")
        said.append(f"wrote {args.write_training_args}: {kind} of {first.label}")
    if "attn_implementation" in first.changes:  # not a TrainingArguments field: said, not written
        said.append(f"load the model with attn_implementation={first.changes['attn_implementation']!r} "
                    f"(a from_pretrained argument; needs {first.needs_package})")
    return said
