"""The `trainer-memcb` command (also `python -m trainer_memcb`): after the run, and before the next.

    trainer-memcb report RUN_DIR            measured vs estimate over the steps, evaluations,
                                            breakdown by state key and dtype, and a PNG plot
    trainer-memcb compare RUN_DIR...        one row per run, sorted by optimizer state memory
    trainer-memcb estimate MODEL            the what-if: each optimizer's state for a model config,
                                            built on the meta device
    trainer-memcb estimate MODEL --world-size 64 --zero 3 --precision deepspeed-bf16 --device-memory 80GiB
                                            the model-states plan: what each process holds, and
                                            whether it fits

Tables in a terminal, plain text when piped, `--json` for machines. Exit codes: 0 done, 1 nothing
found (the message says where it looked) or a file that cannot be read, 2 usage error.

In three pieces, so that each can be used alone: `parser()`, `command(args)`, `main(argv)`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

from trainer_memcb.cli.compare import compare_runs, compare_table
from trainer_memcb.cli.estimate import estimate_tables
from trainer_memcb.cli.plan_table import plan_tables
from trainer_memcb.cli.output import print_json, print_tables
from trainer_memcb.cli.plots import PlotError, compare_plot, report_plot
from trainer_memcb.cli.quiet import quiet_output
from trainer_memcb.cli.report import DEFAULT_METRICS, report_tables, run_report
from trainer_memcb.plan import PRECISIONS, SHARDINGS, Setup, parse_bytes, plan_model_states
from trainer_memcb.run_logs import RunLogError, load_run
from trainer_memcb.whatif import (
    DEFAULT_OPTIMIZERS,
    DTYPES,
    ModelConfigError,
    build_meta_model,
    resolve_dtype,
    resolve_optimizer_names,
    select_trainable,
    what_if,
)

__all__ = ["PROGRAM", "REPORT_PLOT_FILE_NAME", "parser", "command", "main", "console_main"]

PROGRAM = "trainer-memcb"
# Written into the run folder by `report` unless --plot or --no-plot says otherwise.
REPORT_PLOT_FILE_NAME = "optimizer_memory.png"

EXIT_DONE = 0
EXIT_NOTHING_FOUND = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input found after parsing (an option that does not fit the model)."""


def _metrics(text: str) -> List[str]:
    metrics = [name.strip() for name in text.split(",") if name.strip()]
    if not metrics:
        raise argparse.ArgumentTypeError("give one or more metric names, e.g. accuracy,f1")
    return metrics


def _optimizers(text: str) -> tuple:
    try:
        with quiet_output():  # the names come from transformers' TrainingArguments: import chatter
            return resolve_optimizer_names(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parser() -> argparse.ArgumentParser:
    """The argument parser of `trainer-memcb`."""
    main_parser = argparse.ArgumentParser(
        prog=PROGRAM, description="What your optimizer held in memory, against its estimate; and what another would hold."
    )
    commands = main_parser.add_subparsers(dest="command", metavar="{report,compare,estimate}")

    metrics_help = f"eval metrics to show, comma-separated (default: {','.join(DEFAULT_METRICS)})"

    report = commands.add_parser("report", help="one run: state over the steps, evaluations, breakdown, plot")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the Trainer's output_dir (or one of its checkpoints)")
    plot = report.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="PNG", help=f"where to write the plot (default: RUN_DIR/{REPORT_PLOT_FILE_NAME})")
    plot.add_argument("--no-plot", action="store_true", help="write no plot")
    report.add_argument("--metrics", type=_metrics, default=list(DEFAULT_METRICS), help=metrics_help)
    report.add_argument("--json", action="store_true", help="print JSON with the exact figures instead of tables")
    report.set_defaults(handler=_report)

    compare = commands.add_parser("compare", help="several runs side by side, sorted by optimizer state memory")
    compare.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="the runs' output_dir folders")
    compare.add_argument("--plot", metavar="PNG", help="also write a bar chart there")
    compare.add_argument("--metrics", type=_metrics, default=list(DEFAULT_METRICS), help=metrics_help)
    compare.add_argument("--json", action="store_true", help="print JSON with the exact figures instead of a table")
    compare.set_defaults(handler=_compare)

    estimate = commands.add_parser("estimate", help="the what-if before training, from a model config")
    estimate.add_argument("model", metavar="MODEL", help="a folder holding config.json, or a hub name when online")
    estimate.add_argument(
        "--optimizers", type=_optimizers, default=DEFAULT_OPTIMIZERS,
        help=f"the Trainer's optim names, comma-separated (default: {','.join(DEFAULT_OPTIMIZERS)}); "
             "e.g. adamw,adafactor,adamw_8bit,adamw_torch_8bit",
    )
    estimate.add_argument(
        "--architecture", metavar="CLASS",
        help="the transformers class to build, e.g. DistilBertForSequenceClassification; default: the config's",
    )
    estimate.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the parameters' dtype (default: float32)")
    estimate.add_argument(
        "--trainable", metavar="REGEX",
        help="train only the parameters whose name matches (re.search), e.g. 'q_proj|v_proj'; default: all",
    )
    estimate.add_argument("--json", action="store_true", help="print JSON with the exact figures instead of tables")
    plan = estimate.add_argument_group(
        "model-states plan", "with any of these, the parameters, gradients, optimizer state and master weights "
        "each process holds")
    plan.add_argument("--world-size", type=int, metavar="W", help="processes in the job (default 1)")
    plan.add_argument("--nodes", type=int, metavar="N", help="machines; CPU figures are per node (default 1)")
    shard = plan.add_mutually_exclusive_group()
    shard.add_argument("--sharding", choices=SHARDINGS, help="how the states are split (default none)")
    shard.add_argument("--zero", type=int, choices=(1, 2, 3), metavar="{1,2,3}", help="DeepSpeed ZeRO stage: --sharding zeroN")
    plan.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer state and master weights on the CPU")
    plan.add_argument("--offload-params", action="store_true", help="ZeRO-3 / FSDP: parameters on the CPU too")
    plan.add_argument("--precision", choices=list(PRECISIONS), help="fp32 (default), autocast-bf16/fp16 (Trainer "
                      "bf16=True/fp16=True), bf16 (model loaded in bf16), deepspeed-bf16/fp16 (fp32 master weights)")
    plan.add_argument("--device-memory", metavar="SIZE", help="accelerator memory per process, e.g. 80GiB: says whether it fits")
    estimate.add_argument("--verbose", action="store_true",
                          help="let other libraries' messages through (import warnings of bitsandbytes, torchao, ...)")
    estimate.set_defaults(handler=_estimate)
    return main_parser


def _write_plot(draw, *arguments, explicit: bool) -> Tuple[int, bool]:
    """Draw; on failure say why. Returns the exit code and whether the plot was written: a plot
    asked for by --plot that cannot be drawn fails the command, the default one only warns."""
    try:
        draw(*arguments)
    except PlotError as error:
        print(f"{PROGRAM}: no plot: {error}", file=sys.stderr)
        return (EXIT_NOTHING_FOUND if explicit else EXIT_DONE), False
    return EXIT_DONE, True


def _report(args: argparse.Namespace) -> int:
    report = run_report(load_run(args.run_dir), args.metrics)
    plot_path = None if args.no_plot else args.plot or os.path.join(args.run_dir, REPORT_PLOT_FILE_NAME)
    status = EXIT_DONE
    if plot_path is not None:
        status, written = _write_plot(report_plot, report, plot_path, args.metrics, explicit=args.plot is not None)
        plot_path = plot_path if written else None
    if args.json:
        print_json({**report.to_dict(), "plot": plot_path}, sys.stdout)
    else:
        print_tables(report_tables(report, args.metrics), sys.stdout)
        if plot_path is not None:
            print(f"\nPlot: {plot_path}")
    return status


def _compare(args: argparse.Namespace) -> int:
    rows = compare_runs([load_run(run_dir) for run_dir in args.run_dirs], args.metrics)
    status, plot_path = EXIT_DONE, None
    if args.plot is not None:
        status, written = _write_plot(compare_plot, rows, args.plot, args.metrics, explicit=True)
        plot_path = args.plot if written else None
    if args.json:
        print_json({"runs": [row.to_dict() for row in rows], "plot": plot_path}, sys.stdout)
    else:
        print_tables([compare_table(rows, args.metrics)], sys.stdout)
        if plot_path is not None:
            print(f"\nPlot: {plot_path}")
    return status


def _estimate(args: argparse.Namespace) -> int:
    # Everything that imports transformers and the optimizers' libraries runs with their chatter
    # held back; the tables are printed afterwards.
    with quiet_output(enabled=not args.verbose):
        try:
            model = build_meta_model(args.model, resolve_dtype(args.dtype), args.architecture)
            trainable = select_trainable(model, args.trainable)
        except ValueError as error:  # an unknown architecture, a bad regular expression
            raise UsageError(str(error)) from None
        if trainable == 0:
            names = [name for name, _ in model.named_parameters()][:3]
            raise ModelConfigError(
                f"no parameter name of {args.model} matches --trainable {args.trainable!r}; names look like: {', '.join(names)}"
            )
        plan_asked = any(getattr(args, name) not in (None, False) for name in _PLAN_OPTIONS)
        if plan_asked:
            plan = _plan(args, model)
        else:
            result = what_if(model, args.optimizers, model_name=args.model)
    if args.json:
        print_json((plan if plan_asked else result).to_dict(), sys.stdout)
    else:
        print_tables(plan_tables(plan) if plan_asked else estimate_tables(result), sys.stdout)
    return EXIT_DONE


# Any of these turns `estimate` into the model-states plan.
_PLAN_OPTIONS = ("world_size", "nodes", "sharding", "zero", "offload_optimizer", "offload_params", "precision",
                 "device_memory")


def _plan(args: argparse.Namespace, model):
    try:
        setup = Setup(world_size=args.world_size or 1, nodes=args.nodes or 1,
                      sharding=f"zero{args.zero}" if args.zero else (args.sharding or "none"),
                      precision=args.precision or "fp32", offload_optimizer=args.offload_optimizer,
                      offload_params=args.offload_params)
        memory = parse_bytes(args.device_memory) if args.device_memory is not None else None
    except ValueError as error:
        raise UsageError(str(error)) from None
    return plan_model_states(model, args.optimizers, setup, device_memory=memory, model_name=args.model)


def command(args: argparse.Namespace) -> int:
    """Run the parsed command; bad input becomes a message on stderr and an exit code, never a traceback."""
    handler = getattr(args, "handler", None)
    if handler is None:
        parser().print_usage(sys.stderr)
        print(f"{PROGRAM}: error: choose a command: report, compare or estimate", file=sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args)
    except (RunLogError, ModelConfigError) as error:
        print(f"{PROGRAM}: {error}", file=sys.stderr)
        return EXIT_NOTHING_FOUND
    except UsageError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `trainer-memcb`; returns the exit code.

    Example:
        >>> main(["compare", "no/such/run"])  # stderr: trainer-memcb: no/such/run: no such folder
        1
    """
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_request:  # argparse exits on --help (0) and on usage errors (2)
        code = exit_request.code
        return code if isinstance(code, int) else (EXIT_DONE if code is None else EXIT_USAGE)
    return command(args)


def console_main() -> int:
    """The `trainer-memcb` console script (and `python -m trainer_memcb`): `main` in a process of its own.

    For `estimate`, peft is kept out of the process: transformers' `trainer_utils`, which the
    optimizer handlers import, imports peft whenever it is installed (and peft imports
    bitsandbytes), only to recognise PEFT models, and `estimate` builds none. That import is about
    50 MiB and seconds of start-up. `sys.modules["peft"] = None` makes transformers see peft as not
    installed (`importlib.util.find_spec` answers None). Only here, in a process that ends with the
    command: `main()` called from Python changes nothing.
    """
    if len(sys.argv) > 1 and sys.argv[1] == "estimate" and "peft" not in sys.modules:
        sys.modules["peft"] = None
    return main()
