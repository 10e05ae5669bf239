"""`trainer-memcb estimate MODEL --eval-samples N --seq-len S`: will evaluation fit?

The options of the evaluation plan, the settings they give (flags over `--training-args FILE` over
the installed `TrainingArguments`' defaults), and its table; the figures come from
`trainer_memcb.plan.answers.eval_memory.plan_eval_memory`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

# The options are parsed and checked before torch is imported: the plan's modules are imported
# inside the functions that use them.
from trainer_memcb.cli.choices import EVAL_LOGITS, positive_int
from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.output import TextTable, bytes_cell
from trainer_memcb.cli.progress import say_progress
from trainer_memcb.utils.units import parse_size

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.eval_memory import EvalMemoryPlan, EvalSettings
    from trainer_memcb.plan.answers.fit import FitSearch
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan

__all__ = ["add_eval_arguments", "check_eval_options", "estimate_evaluation", "eval_fit", "eval_fit_tables",
           "eval_planner", "eval_tables", "training_arguments_from_file"]


EVAL_NEEDS_SEQ_LEN = "--eval-samples needs --seq-len (the sequence length)"


def _host_size(text: str) -> int:
    try:
        return parse_size(text, "--host-memory")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_eval_arguments(estimate: argparse.ArgumentParser) -> None:
    """The options of the evaluation plan (`--seq-len` and `--device-memory` are the step plan's)."""
    group = estimate.add_argument_group(
        "evaluation plan", "with --eval-samples, what Trainer.evaluate() holds per process: its forward under fake "
        "tensors, and the logits, labels and losses its containers gather on the device and on the host")
    group.add_argument("--eval-samples", type=positive_int, metavar="N", help="evaluation samples per process")
    group.add_argument("--eval-batch-size", type=positive_int, metavar="B",
                       help="per_device_eval_batch_size (default: --training-args', else the Trainer's, 8)")
    group.add_argument("--eval-accumulation-steps", type=positive_int, metavar="K",
                       help="eval_accumulation_steps: move the containers to the host every K batches")
    group.add_argument("--no-eval-concat", action="store_true",
                       help="eval_do_concat_batches=False: batches kept in lists, not concatenated")
    group.add_argument("--eval-logits", choices=EVAL_LOGITS,
                       help="what the containers keep of the logits: full (as the model returns them; the default), "
                            "argmax (a preprocess_logits_for_metrics returning logits.argmax(-1)), none "
                            "(prediction_loss_only, or no compute_metrics)")
    group.add_argument("--eval-include-inputs", action="store_true", help="include_for_metrics=['inputs']")
    group.add_argument("--host-memory", metavar="SIZE", type=_host_size, help="host memory per process, e.g. 64GiB: says whether the "
                       "containers' arrays fit")


# The evaluation plan's own options: without --eval-samples they would change nothing.
_EVAL_ONLY = (("eval_batch_size", "--eval-batch-size"), ("eval_accumulation_steps", "--eval-accumulation-steps"),
              ("no_eval_concat", "--no-eval-concat"), ("eval_logits", "--eval-logits"),
              ("eval_include_inputs", "--eval-include-inputs"), ("host_memory", "--host-memory"))


def check_eval_options(args: EstimateRequest, evaluation: bool) -> None:
    """Refuse the evaluation plan's options where the evaluation plan is not asked for (`evaluation`:
    `--eval-samples`).

    Raises:
        ValueError: one line naming the option.
    """
    if evaluation:
        return
    given = [flag for name, flag in _EVAL_ONLY if getattr(args, name, None) not in (None, False)]
    if given:
        raise ValueError(f"{given[0]} has no effect without --eval-samples (the evaluation plan)")


def training_arguments_from_file(path: Optional[str]) -> Any:
    """`TrainingArguments` from a JSON file (None: the defaults), for the settings they give.

    Raises:
        ValueError: a file that cannot be read, is not a JSON object, or that TrainingArguments refuses.
        SettingsFileError: a key that is not a TrainingArguments field, or a value it would misread
            (`trainer_memcb.plan.settings.check_training_args`).
    """
    from transformers import TrainingArguments

    from trainer_memcb.plan.settings import check_training_args, read_json_file

    data: Dict[str, Any] = read_json_file(path, "--training-args") if path is not None else {}
    check_training_args(data, f"--training-args {path}")  # a key TrainingArguments has not is refused, as it refuses it
    kept = {key: value for key, value in data.items() if key not in ("output_dir", "report_to")}
    try:
        return TrainingArguments(output_dir="trainer-memcb-plan", report_to=[], **kept)
    except Exception as error:  # TrainingArguments' own checks: one line
        raise ValueError(f"--training-args {path}: {' '.join(str(error).split())[:300]}") from None


def _settings(args: EstimateRequest, in_train: bool = False) -> EvalSettings:
    from trainer_memcb.plan.answers.eval_memory import eval_settings_from_args

    training = training_arguments_from_file(getattr(args, "training_args", None))
    settings = eval_settings_from_args(training, samples=args.eval_samples, seq_len=args.seq_len, logits=args.eval_logits,
                                       in_train=in_train)
    changes: Dict[str, Any] = {}
    if args.eval_batch_size is not None:
        changes["batch_size"] = args.eval_batch_size
    if args.eval_accumulation_steps is not None:
        changes["accumulation_steps"] = args.eval_accumulation_steps
    if args.no_eval_concat:
        changes["concat_batches"] = False
    if args.eval_include_inputs:
        changes["include_inputs"] = True
    from dataclasses import replace

    return replace(settings, **changes)


def estimate_evaluation(args: EstimateRequest, build_model: Any,
                        states: Optional[ModelStatesPlan] = None, reserve: int = 0) -> EvalMemoryPlan:
    """The evaluation plan for the options (`eval_planner`'s, at the options' settings).

    Raises:
        ValueError: --seq-len missing, a bad size or settings file.
    """
    if args.seq_len is None:
        raise ValueError(EVAL_NEEDS_SEQ_LEN)
    # With the step plan, evaluation runs inside train(): the model keeps its training dtype.
    return eval_planner(args, build_model, states, reserve)(_settings(args, in_train=states is not None))


def eval_planner(args: EstimateRequest, build_model: Any, states: Optional[ModelStatesPlan] = None,
                 reserve: int = 0) -> Callable[[EvalSettings], EvalMemoryPlan]:
    """`plan(settings) -> EvalMemoryPlan`: the evaluation plan of the options' model and memory at
    any `EvalSettings` (`--fit`'s proposals are planned by it).

    Args:
        args: the parsed options.
        build_model: makes the model the options describe on the meta device.
        states: the model-states plan, when planned too: its optimizer state (and master weights)
            stays alive while evaluation runs inside `train()`.
        reserve: bytes of `--device-memory` evaluation cannot use (`--reserve`, or its default).
    """
    from trainer_memcb.plan.answers.eval_memory import plan_eval_memory

    resident = 0
    if states is not None and states.optimizers:
        row = states.optimizers[0]
        resident = (row.optimizer_state_bytes or 0) + (row.master_weights_bytes or 0)
    device = parse_size(args.device_memory) if args.device_memory is not None else None
    host = parse_size(args.host_memory) if args.host_memory is not None else None
    attention = getattr(args, "attn_implementation", None)
    from trainer_memcb.cli.device_options import DEFAULT_DEVICE_TYPE, alloc_conf_of, cuda_context_bytes

    cuda = (getattr(args, "device_type", None) or DEFAULT_DEVICE_TYPE) == "cuda"
    from trainer_memcb.plan.device.gpus import gpu_preset

    gpu = getattr(args, "gpu", None)
    preset = gpu_preset(gpu) if gpu is not None else None
    capability = preset.compute_capability if preset is not None else None

    def plan(settings: EvalSettings) -> EvalMemoryPlan:
        def build() -> Any:
            return _traced_model(build_model, attention, settings)

        return plan_eval_memory(build, settings, device_memory=device, host_memory=host, resident_bytes=resident,
                                model_name=args.model, reserve_bytes=reserve,
                                cuda_context_bytes=cuda_context_bytes(args) if cuda else None,
                                alloc_conf=alloc_conf_of(args) if cuda else None, compute_capability=capability,
                                gpu=preset.name if preset is not None else None)

    return plan


def eval_fit(args: EstimateRequest, build_model: Any, evaluation: EvalMemoryPlan,
             states: Optional[ModelStatesPlan] = None, reserve: int = 0) -> Optional[FitSearch]:
    """With --fit: smaller eval batches and `eval_accumulation_steps`, each planned by `eval_planner`
    (`trainer_memcb.plan.answers.eval_fit.search_eval_fits`); None when the own could not be planned."""
    from trainer_memcb.plan.answers.eval_fit import search_eval_fits

    if evaluation.problem is not None or evaluation.usable_device_bytes is None:
        return None
    search = search_eval_fits(eval_planner(args, build_model, states, reserve), evaluation.settings,
                              max_candidates=args.max_proposals)
    path = getattr(args, "training_args", None)
    if path is None:
        return search
    # Each proposal's TrainingArguments are the user's file with its evaluation keys replaced:
    # written by --write-training-args, the file given back alone plans the same evaluation.
    from dataclasses import replace

    from trainer_memcb.plan.settings import read_json_file

    given = read_json_file(path, "--training-args")

    def complete(candidate: Any) -> Any:
        return replace(candidate, training_args={**given, **candidate.training_args})

    return replace(search, own=complete(search.own), candidates=[complete(c) for c in search.candidates])


def eval_fit_tables(search: FitSearch, evaluation: EvalMemoryPlan) -> List[TextTable]:
    """`--fit`'s table of the evaluation's proposals, titled with the usable bytes as the
    evaluation plan's table names them, and the figure its peak column holds."""
    from trainer_memcb.cli.fit_table import fit_tables
    from trainer_memcb.plan.answers.eval_memory import USABLE_LABELS
    from trainer_memcb.utils.units import format_bytes

    cuda = evaluation.reserved_peak_bytes is not None
    title = (f"Evaluation settings that fit in {format_bytes(search.usable_bytes)} per process, the "
             f"{USABLE_LABELS[cuda]}; peak: the {'reserved peak (caching allocator)' if cuda else 'device peak'}; "
             f"fewest batches first; effective batch: the eval batch")
    return fit_tables(search, evaluation=True, title=title)


def _traced_model(build_model: Any, attention: Optional[str], settings: EvalSettings) -> Any:
    """The meta model for an evaluation forward, with the options' attention implementation."""
    model = build_model()
    say_progress(f"tracing the evaluation forward at batch {settings.batch_size}")
    if attention is not None and getattr(model, "config", None) is not None:
        from trainer_memcb.plan.answers.step_memory import check_attn_implementation

        check_attn_implementation(model, attention)
        model.config._attn_implementation = attention  # as the step plan traces it
    return model


def _fits(fits: Optional[bool], peak: Optional[int], memory: Optional[int]) -> str:
    if fits is None or peak is None or memory is None:
        return "-"
    margin = bytes_cell(abs(memory - peak))
    return f"fits, {margin} to spare" if fits else f"does not fit, {margin} short"


def eval_tables(plan: EvalMemoryPlan) -> List[TextTable]:
    """What was planned, the figures (as a run logs them, `eval_...`), fits? and the advice."""
    settings = plan.settings
    about = [
        ["samples, eval batch", f"{settings.samples} in batches of {settings.batch_size} x {settings.seq_len} tokens"],
        ["eval_accumulation_steps", str(settings.accumulation_steps) if settings.accumulation_steps else "none"],
        ["eval_do_concat_batches", str(settings.concat_batches)],
        ["logits kept", settings.logits],
    ]
    if plan.problem is not None:
        about.append(["problem", plan.problem])
        return [TextTable(f"Evaluation plan for {plan.model}", ["", "value"], about)]
    rows = [
        ["forward peak (eval_forward_peak_bytes)", bytes_cell(plan.forward_peak_bytes)],
        ["containers on the device (eval_containers_device_bytes)", bytes_cell(plan.containers_device_bytes)],
        ["  while concatenating (eval_concat_peak_bytes)", bytes_cell(plan.concat_peak_bytes)],
        ["containers on the host (eval_containers_host_bytes)", bytes_cell(plan.containers_host_bytes)],
        ["  while concatenating (eval_host_concat_peak_bytes)", bytes_cell(plan.host_concat_peak_bytes)],
        ["model (parameters, buffers)", bytes_cell(plan.model_bytes)],
    ]
    if plan.resident_bytes:
        rows.append(["optimizer state alive from training", bytes_cell(plan.resident_bytes)])
    rows += [
        ["device peak (model + forward + concatenation)", bytes_cell(plan.device_peak_bytes)],
    ]
    if plan.device_memory_bytes is not None:
        rows += [["device memory", bytes_cell(plan.device_memory_bytes)],
                 ["reserve (your own margin)", bytes_cell(plan.reserve_bytes or 0)]]
    cuda = plan.reserved_peak_bytes is not None
    if cuda:
        rows += [["reserved peak (caching allocator)", bytes_cell(plan.reserved_peak_bytes)],
                 ["device total (nvidia-smi, with the CUDA context)", bytes_cell(plan.device_total_bytes)],
                 ["CUDA context", bytes_cell(plan.cuda_context_bytes)]]
    # fits? compares the plan's figure (the reserved peak on CUDA, else the device peak) with the
    # usable bytes (the memory less the reserve, and less the context on CUDA): the figures --fit's
    # own row and the Why: line say too.
    if plan.usable_device_bytes is not None:
        from trainer_memcb.plan.answers.eval_memory import USABLE_LABELS

        rows.append([USABLE_LABELS[cuda], bytes_cell(plan.usable_device_bytes)])
    rows.append(["fits on the device?", _fits(plan.fits_device, plan.device_figure_bytes, plan.usable_device_bytes)])
    if plan.host_memory_bytes is not None:
        rows.append(["host memory", bytes_cell(plan.host_memory_bytes)])
    rows.append(["fits on the host?", _fits(plan.fits_host, plan.host_peak_bytes, plan.host_memory_bytes)])
    per_sample = ", ".join(f"{name} {value:,}" for name, value in plan.per_sample_bytes.items())
    note = "\n".join([f"Bytes per sample: {per_sample}."] + [f"Why: {line}." for line in plan.advice])
    return [TextTable(f"Evaluation plan for {plan.model}", ["", "value"], about),
            TextTable("Evaluation, per process", ["", "bytes"], rows, note=note)]
