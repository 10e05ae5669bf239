"""`trainer-memcb estimate`: the command line checked before torch is imported, the plans it asks
for gathered, printed as tables or JSON, and the exit code of their one verdict."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

from trainer_memcb.cli.collector import freeze_what_was_imported
from trainer_memcb.cli.deferred_compile import defer_bitsandbytes_compilation
from trainer_memcb.cli.device_options import cuda_context_bytes, reserve_bytes
from trainer_memcb.cli.estimate_asked import needs_peft, needs_torchao, step_asked
from trainer_memcb.cli.estimate_checks import check_options
from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.failures import (EXIT_DONE, EXIT_DOES_NOT_FIT, EXIT_NOTHING_FOUND, EXIT_UNTRACEABLE, KnownFailure,
                                        UsageError, say)
from trainer_memcb.cli.output import print_json, print_tables
from trainer_memcb.cli.progress import showing_progress
from trainer_memcb.cli.quiet import quiet_output
from trainer_memcb.cli.step_answer import StepAnswer, answers_document
from trainer_memcb.plan.model.model_folder import missing_folder

__all__ = ["EstimateAnswer", "estimate_command", "gather", "render", "exit_status", "prepare_process"]


def _states_fit(plan: Any) -> Optional[bool]:
    """The model-states plan's answer: None unasked, False when any optimizer with a figure does not fit."""
    answers = [entry.fits for entry in plan.optimizers if entry.fits is not None]
    return None if not answers else all(answers)


def _step_status(found: StepAnswer) -> int:
    """The exit code of a step plan: untraceable 5, does not fit 3 (the step's answer, or no
    batch fitting for --max-batch-size), else 0."""
    step = found.step
    largest = found.largest_batch
    if (step is not None and step.step.problem is not None) or (largest is not None and largest.problem is not None):
        return EXIT_UNTRACEABLE
    if (step is not None and step.verdict.fits is False) or (largest is not None and largest.max_batch_size is None):
        return EXIT_DOES_NOT_FIT
    return EXIT_DONE


def _fit_status(search: Any, args: EstimateRequest, status: int) -> int:
    """With --fit: write the first proposal where asked; 0 when the step fits as is or a proposal
    fits, else 3 with the nearest miss named in one line (an untraceable own step stays 5)."""
    if status == EXIT_UNTRACEABLE:
        return status
    from trainer_memcb.cli.fit_table import fit_failure, write_first_proposal

    try:
        for line in write_first_proposal(search, args):
            say(line)
    except ValueError as error:
        say(f"error: {error}")
        return EXIT_NOTHING_FOUND
    failure = fit_failure(search)
    if failure is not None:
        say(failure)
        return EXIT_DOES_NOT_FIT
    return EXIT_DONE


def _evaluation_status(evaluation: Any) -> int:
    """The exit code of an evaluation plan: 5 when its forward cannot be traced (fits? has no
    answer), 3 when it does not fit the device or the host, else 0."""
    if evaluation.problem is not None:
        return EXIT_UNTRACEABLE
    return EXIT_DOES_NOT_FIT if False in (evaluation.fits_device, evaluation.fits_host) else EXIT_DONE


def _step_answers(found: StepAnswer) -> bool:
    """Whether the step plan gives the output's fits? (a traced step against --device-memory, or
    the search for the largest batch); then the model-states plan gives none beside it."""
    step = found.step
    if step is not None and step.step.problem is None and step.verdict.fits is not None:
        return True
    return found.largest_batch is not None and found.largest_batch.problem is None


def _without_verdict(states: Any) -> Any:
    """The model-states plan with its fits? and margin left out: one verdict per output, the step's.
    The states' figures stay; only the answer that would contradict the step's goes."""
    import dataclasses

    return dataclasses.replace(states, device_memory_bytes=None, optimizers=[
        dataclasses.replace(entry, fits=None, margin_bytes=None) for entry in states.optimizers])


def _with_memory(document: Dict[str, Any], args: EstimateRequest) -> Dict[str, Any]:
    """The model-states plan's JSON, with the device's memory and the reserve its fits? left out."""
    if args.device_memory is not None:
        document = {**document, "device_memory_bytes": args.device_memory, "reserve_bytes": reserve_bytes(args),
                    "cuda_context_bytes": cuda_context_bytes(args)}
    return document


@dataclass(frozen=True)
class EstimateAnswer:
    """What `estimate` gathered for the options, before it is printed.

    Attributes:
        kind: "step" (a step plan, with the evaluation where asked), "evaluation" (the evaluation
            plan alone), "model states" or "what-if".
        found: the step plan's answers (`estimate_step`), for "step".
        evaluation, evaluation_fit: the evaluation plan and its --fit search, or None.
        result: the model-states plan or the what-if.
    """

    kind: str
    found: Optional[StepAnswer] = None
    evaluation: Any = None
    evaluation_fit: Any = None
    result: Any = None


def estimate_command(args: argparse.Namespace) -> int:
    """`trainer-memcb estimate`: the parsed options read once as a request (`EstimateRequest`) and
    checked (before torch is imported), the plans gathered, printed as tables or JSON, and the exit
    code of their verdict."""
    request = EstimateRequest.of(args)
    try:  # the command line alone, before torch and transformers are imported
        check_options(request)
    except ValueError as error:
        raise UsageError(str(error)) from None
    missing = missing_folder(request.model)
    if missing is not None:  # a bad model folder (exit 1), before the imports it would wait on
        raise KnownFailure(missing)
    answer = gather(request)
    render(answer, request)
    _write_plan_files(answer, request)
    return exit_status(answer, request)


def _write_plan_files(answer: EstimateAnswer, args: EstimateRequest) -> None:
    """--write-snapshot and --write-html: the step written, each file said in one line on stderr.

    Raises:
        UsageError: the step cannot be written as asked (exit 2).
        KnownFailure: a file could not be written (exit 1).
    """
    from trainer_memcb.cli.plan_files import write_plan_files

    found = answer.found
    if found is None:
        return
    try:
        lines = write_plan_files(found.step if found.step is not None else found.largest_step, args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise KnownFailure(f"{error.filename or 'a file'}: cannot be written ({error.strerror or error})") from None
    for line in lines:
        say(line)


def gather(args: EstimateRequest) -> EstimateAnswer:
    """The plans the options ask for (`EstimateRequest.questions`). Everything that imports transformers and the optimizers'
    libraries runs with their chatter held back, and a terminal shows what is being done (stderr
    only).

    Raises:
        KnownFailure: a bad model config or settings file (exit 1).
        UsageError: a value the plan refuses (exit 2).
    """
    with showing_progress("importing torch and transformers"), quiet_output(enabled=not args.verbose):
        from trainer_memcb.cli.estimate_checks import check_settings_values, resolve_optimizers
        from trainer_memcb.cli.estimate_model import estimate_model
        from trainer_memcb.cli.estimate_states import estimate_plan, estimate_what_if
        from trainer_memcb.cli.estimate_step import estimate_step
        from trainer_memcb.cli.eval_estimate import estimate_evaluation, eval_fit
        from trainer_memcb.plan.model.config_error import ModelConfigError
        from trainer_memcb.plan.settings import SettingsFileError

        try:
            asked = args.questions
            args = resolve_optimizers(args)
            check_settings_values(args)  # the settings files' values, before the model is built
            if not (asked.step or asked.evaluation):
                if asked.plan:
                    return EstimateAnswer("model states", result=estimate_plan(args))
                return EstimateAnswer("what-if", result=estimate_what_if(args))
            found = estimate_step(args) if asked.step else None
            evaluation = None
            if asked.evaluation:
                evaluation = estimate_evaluation(args, lambda: estimate_model(args),
                                                 found.model_states if found is not None else None,
                                                 reserve=reserve_bytes(args) or 0)
            evaluation_fit = (eval_fit(args, lambda: estimate_model(args), evaluation,
                                       found.model_states if found is not None else None, reserve_bytes(args) or 0)
                              if evaluation is not None and args.fit else None)
        except (ModelConfigError, SettingsFileError) as error:  # a bad config or settings file: exit 1
            raise KnownFailure(str(error)) from None
        except ValueError as error:  # an unknown architecture, a bad regular expression, LoRA modules not found
            raise UsageError(str(error)) from None
    return EstimateAnswer("step" if found is not None else "evaluation", found=found, evaluation=evaluation,
                          evaluation_fit=evaluation_fit)


def render(answer: EstimateAnswer, args: EstimateRequest) -> None:
    """Print the answer: tables, or with --json one document in the schema's version."""
    from trainer_memcb.cli.estimate_schema import with_schema
    from trainer_memcb.cli.eval_estimate import eval_fit_tables, eval_tables
    from trainer_memcb.cli.fit_table import fit_tables
    from trainer_memcb.cli.plan_table import plan_tables, step_tables
    from trainer_memcb.cli.whatif_table import estimate_tables

    memory, reserve = args.device_memory, reserve_bytes(args)
    context = cuda_context_bytes(args) if memory is not None else 0
    evaluation, evaluation_fit = answer.evaluation, answer.evaluation_fit
    if answer.kind == "evaluation":
        if args.json:
            print_json(with_schema({"answers": answers_document(evaluation, evaluation_fit)}), sys.stdout)
        else:
            print_tables(eval_tables(evaluation) + (eval_fit_tables(evaluation_fit, evaluation) if evaluation_fit else []),
                         sys.stdout)
    elif answer.kind == "step":
        found = answer.found
        one_verdict = _step_answers(found)
        if one_verdict:
            found = dataclasses.replace(found, model_states=_without_verdict(found.model_states))
        if args.json:
            states = None if one_verdict else _with_memory(found.model_states.to_dict(), args)
            print_json(with_schema(found.to_document(evaluation, evaluation_fit, states)), sys.stdout)
        else:
            states = (plan_tables(found.model_states, verdict=False) if one_verdict
                      else plan_tables(found.model_states, memory, reserve, context=context))
            print_tables(step_tables(found) + states + (eval_tables(evaluation) if evaluation else [])
                         + (fit_tables(found.fit) if found.fit is not None else [])
                         + (eval_fit_tables(evaluation_fit, evaluation) if evaluation_fit else []), sys.stdout)
    elif args.json:
        result = answer.result
        print_json(with_schema(_with_memory(result.to_dict(), args) if answer.kind == "model states"
                               else result.to_dict()), sys.stdout)
    else:
        print_tables(plan_tables(answer.result, memory, reserve, context=context) if answer.kind == "model states"
                     else estimate_tables(answer.result), sys.stdout)


def exit_status(answer: EstimateAnswer, args: EstimateRequest) -> int:
    """The exit code of the answer's one verdict, after --fit's files are written where asked."""
    from trainer_memcb.cli.fit_table import fit_failure

    evaluation, evaluation_fit = answer.evaluation, answer.evaluation_fit
    if answer.kind == "evaluation":
        return _evaluation_status(evaluation) if evaluation_fit is None else _fit_status(
            evaluation_fit, args, _evaluation_status(evaluation))
    if answer.kind != "step":
        return EXIT_DOES_NOT_FIT if answer.kind == "model states" and _states_fit(answer.result) is False else EXIT_DONE
    status = _step_status(answer.found)
    if answer.found.fit is not None:
        status = _fit_status(answer.found.fit, args, status)
    if status != EXIT_DONE or evaluation is None:
        return status
    status = _evaluation_status(evaluation)
    if status == EXIT_DOES_NOT_FIT and evaluation_fit is not None:  # a proposal fits: 0; else the nearest miss
        failure = fit_failure(evaluation_fit)
        if failure is None:
            return EXIT_DONE
        say(failure)
    return status


def prepare_process(args: "argparse.Namespace | int") -> None:
    """The `trainer-memcb` process, once its command line is parsed (`args`, or the exit code
    parsing gave), before the command runs: what was imported is frozen out of the collector's
    way, unless `estimate` plans a step (`estimate_step` does it once its modules are in).

    For an `estimate` without LoRA, peft is kept out of the process: transformers' `trainer_utils`,
    which the optimizer handlers import, imports peft whenever it is installed (and peft imports
    bitsandbytes), only to recognise PEFT models, and such an estimate builds none. That import is
    about 50 MiB and seconds of start-up. `sys.modules["peft"] = None` makes transformers see peft
    as not installed (`importlib.util.find_spec` answers None). It is decided from the parsed
    command (`--lora-r` needs peft, to add the adapters), which parsing allows because it imports
    nothing of transformers.

    torchao is kept out the same way unless one of its optimizers may be built (`needs_torchao`):
    transformers' model loading imports every quantizer it finds installed, torchao's among them
    (about 2 s of each start here), and an estimate quantizes with bitsandbytes only. scikit-learn
    is kept out of every estimate: transformers before 5 imports it with its generation utilities
    (`candidate_generator`, for an assistant model's ROC curve), about 2 s, and no plan uses it.
    bitsandbytes' CPU kernels are compiled at their first call instead of at its import
    (`trainer_memcb.cli.deferred_compile`), which an estimate never makes: about 0.65 s.
    """
    estimate = getattr(args, "command", None) == "estimate"
    if not (estimate and step_asked(args)):
        freeze_what_was_imported()
    if estimate and not needs_peft(args) and "peft" not in sys.modules:
        sys.modules["peft"] = None
    if estimate and not needs_torchao(args) and "torchao" not in sys.modules:
        sys.modules["torchao"] = None
    if estimate and "sklearn" not in sys.modules:
        sys.modules["sklearn"] = None
    if estimate:  # bitsandbytes' CPU kernels compiled at their first call, not at its import
        defer_bitsandbytes_compilation()
