"""The `trainer-memcb` command (also `python -m trainer_memcb`): after the run, and before the next.

    trainer-memcb report RUN_DIR            measured vs estimate over the steps, evaluations,
                                            breakdown by state key and dtype, and a PNG plot
    trainer-memcb compare RUN_DIR...        one row per run, sorted by optimizer state memory
    trainer-memcb estimate MODEL            the what-if: each optimizer's state for a model config,
                                            built on the meta device
    trainer-memcb estimate MODEL --world-size 64 --zero 3 --precision deepspeed-bf16 --device-memory 80GiB
                                            the model-states plan: what each process holds, and
                                            whether it fits
    trainer-memcb estimate 7.5e9 --zero 1 --world-size 64
                                            the plan for a bare parameter count (one flat tensor)
    trainer-memcb snapshot FILE             a memory snapshot (torch.cuda.memory._dump_snapshot)
                                            replayed through the allocator model, with what-ifs
    trainer-memcb snapshot FILE             a torch.cuda.memory._dump_snapshot() replayed through
                                            the allocator model: real against replayed, what-ifs

`report` and `compare` show the evaluation metrics the runs logged (`--metrics` chooses); a run
made without the callback has no figures: `report` says so and exits 1, `compare` leaves it out
with a warning line, shows the others and exits 1; so does `compare` with a run it cannot read.

Tables in a terminal, plain text when piped, `--json` for machines (strict JSON: a number that is
not finite is null); while `estimate` works, a terminal's stderr shows the phase on one line
(`progress.py`). The command line is checked before torch and transformers are imported. Exit codes (`EXIT_*` in `trainer_memcb.cli.failures`): 0 done (and, where
`--device-memory` asks, it fits), 1 nothing found (the message says where it looked), a file that
cannot be read, or any other failure, 2 usage error, 3 it does not fit, 4 a package the options
need is not installed, 5 the step (or the evaluation forward) cannot be traced (so fits? has no answer), 130 interrupted.
Every message is one line on stderr, `trainer-memcb: ...` (usage errors `trainer-memcb: error:
...`, the usage itself only with `--help`); a value of the wrong type in a file is left out with
one line `trainer-memcb: warning: FILE: skipped N values ...`. `--debug` shows the traceback of a
failure. `--version` prints `trainer-memcb <version>`.

In three pieces, so that each can be used alone: `parser()`, `command(args)`, `main(argv)`.
"""

from __future__ import annotations

from trainer_memcb.cli.interrupt import stop_on_ctrl_c

stop_on_ctrl_c()  # first of all: Ctrl-C while torch and transformers load is one line too (see interrupt.py)

from trainer_memcb.cli.collector import pause_while_importing

pause_while_importing()  # no full collection over torch's and transformers' modules (see collector.py)

import argparse
import os
import sys
from typing import Any, List, NoReturn, Optional, Sequence, Tuple

from trainer_memcb.cli.failures import (
    EXIT_DONE,
    EXIT_INTERRUPTED,
    EXIT_MISSING_PACKAGE,
    EXIT_NOTHING_FOUND,
    EXIT_USAGE,
    PROGRAM,
    KnownFailure as _KnownFailure,
    UsageError,
    answer,
    quiet_libraries,
    say,
)
from trainer_memcb.cli.choices import DEFAULT_METRICS
from trainer_memcb.cli.estimate_command import estimate_command, prepare_process
from trainer_memcb.cli.estimate_options import add_estimate_arguments
from trainer_memcb.cli.output import print_json, print_tables
from trainer_memcb.cli.snapshot_command import add_snapshot_arguments, snapshot_command
from trainer_memcb.utils.packages import MissingPackageError

# Nothing above imports torch or transformers: the command line is parsed and checked first, so
# that a usage error is answered at once (`tests/cli/test_cli_fast_usage_errors.py`); each command
# imports the modules it runs with inside its handler.

__all__ = ["PROGRAM", "REPORT_PLOT_FILE_NAME", "parser", "command", "main", "console_main"]

# Written into the run folder by `report` unless --plot or --no-plot says otherwise.
REPORT_PLOT_FILE_NAME = "optimizer_memory.png"


def _metrics(text: str) -> List[str]:
    metrics = [name.strip() for name in text.split(",") if name.strip()]
    if not metrics:
        raise argparse.ArgumentTypeError("give one or more metric names, e.g. accuracy,f1")
    return metrics


class _UsageExit(Exception):
    """A usage error found while parsing: its one line is printed by `_parse`."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, `trainer-memcb: error: ...`, whatever the
    subcommand (argparse would print the usage block, and `trainer-memcb estimate: error:`);
    the usage is shown by --help only."""

    def error(self, message: str) -> NoReturn:
        raise _UsageExit(message)


def version() -> str:
    """The package's version, `__version__` of the package root (always imported before this
    module, since Python imports a package's parents first)."""
    return sys.modules[__name__.split(".")[0]].__version__


def parser() -> argparse.ArgumentParser:
    """The argument parser of `trainer-memcb`."""
    debug_help = "on a failure, show the traceback"
    main_parser = _Parser(
        prog=PROGRAM, description="What your optimizer held in memory, against its estimate; and what another would hold."
    )
    main_parser.add_argument("--version", action="version", version=f"{PROGRAM} {version()}")
    main_parser.add_argument("--debug", action="store_true", help=debug_help)
    # Also after the command (`report RUN --debug`); SUPPRESS keeps a --debug given before it.
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    commands = main_parser.add_subparsers(dest="command", metavar="{report,compare,estimate,snapshot}")

    metrics_help = ("eval metrics to show, comma-separated (default: those the run logged: "
                    f"{' and '.join(DEFAULT_METRICS)} when logged, else every one, loss included)")

    report = commands.add_parser("report", parents=[debug], help="one run: state over the steps, evaluations, breakdown, plot")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the Trainer's output_dir (or one of its checkpoints)")
    plot = report.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="PATH",
                      help=f"where to write the plot, .png, .pdf or .svg (default: RUN_DIR/{REPORT_PLOT_FILE_NAME})")
    plot.add_argument("--no-plot", action="store_true", help="write no plot")
    report.add_argument("--metrics", type=_metrics, help=metrics_help)
    report.add_argument("--json", action="store_true", help="print JSON with the exact figures instead of tables")
    report.set_defaults(handler=_report)

    compare = commands.add_parser("compare", parents=[debug], help="several runs side by side, sorted by optimizer state memory")
    compare.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="the runs' output_dir folders")
    compare_plot_options = compare.add_mutually_exclusive_group()
    compare_plot_options.add_argument("--plot", metavar="PATH", help="also write a bar chart there, .png, .pdf or .svg")
    compare_plot_options.add_argument("--no-plot", action="store_true", help="write no plot (the default)")
    compare.add_argument("--metrics", type=_metrics, help=metrics_help)
    compare.add_argument("--json", action="store_true", help="print JSON with the exact figures instead of a table")
    compare.set_defaults(handler=_compare)

    estimate = commands.add_parser("estimate", parents=[debug], help="the what-if before training, from a model config")
    add_estimate_arguments(estimate)
    estimate.set_defaults(handler=estimate_command)

    snapshot = commands.add_parser("snapshot", parents=[debug],
                                   help="a recorded memory snapshot: real against the allocator model, and what-ifs")
    add_snapshot_arguments(snapshot)
    snapshot.set_defaults(handler=snapshot_command)
    return main_parser


def _write_plot(draw, *arguments, explicit: bool) -> Tuple[int, bool]:
    """Draw; on failure say why. Returns the exit code and whether the plot was written: a plot
    asked for by --plot that cannot be drawn fails the command, the default one only warns."""
    from trainer_memcb.cli.plots import PlotError

    try:
        draw(*arguments)
    except PlotError as error:
        say(f"no plot: {error}")
        return (EXIT_NOTHING_FOUND if explicit else EXIT_DONE), False
    return EXIT_DONE, True


def _check_plot_path(path: Optional[str]) -> None:
    """An unknown extension is refused before any file is read or written."""
    from trainer_memcb.cli.plots import plot_format

    if path is not None:
        try:
            plot_format(path)
        except ValueError as error:
            raise UsageError(str(error)) from None


def _load(run_dir: str, metrics: Sequence[str]) -> Any:
    from trainer_memcb.runs.run_logs import load_run

    run = load_run(run_dir, metrics)
    for warning in run.warnings:
        say(f"warning: {warning}")
    return run


def _load_runs(run_dirs: Sequence[str], asked: Optional[Sequence[str]],
               leave_out_unreadable: bool = False) -> Tuple[List[Any], List[str]]:
    """The runs, and the metrics to show: those asked for (`--metrics`), else those the runs
    logged (`logged_metrics`).

    Which values are checked depends on the metrics shown, so without `--metrics` the runs are
    read twice: once, checking no metric, to find which they logged, then as with `--metrics`.
    With `leave_out_unreadable` (compare), a run that cannot be read is left out with a warning
    line, unless none can be read: then its failure is the answer."""
    from trainer_memcb.cli.report import logged_metrics
    from trainer_memcb.runs.run_logs import RunLogError, load_run

    first = []
    for run_dir in run_dirs:
        try:
            first.append(load_run(run_dir, ()))
        except RunLogError as error:
            if not leave_out_unreadable or (not first and run_dir == run_dirs[-1]):
                raise
            say(f"warning: {error}; left out")
    metrics = list(asked) if asked is not None else logged_metrics(first)
    return [_load(run.run_dir, metrics) for run in first], metrics


def _without_figures(run_dir: str, history_source: Optional[str]) -> str:
    return (f"{run_dir}: no optimizer memory figures in {history_source or 'its logs'}: the run was made without "
            "OptimizerMemoryCallback (or OptimizerMemoryLogger)")


def _report(args: argparse.Namespace) -> int:
    from trainer_memcb.runs.run_logs import RunLogError

    try:
        return _report_run(args)
    except RunLogError as error:
        raise _KnownFailure(str(error)) from None


def _report_run(args: argparse.Namespace) -> int:
    from trainer_memcb.cli.plots import report_plot
    from trainer_memcb.cli.report import report_tables, run_report
    from trainer_memcb.runs.run_logs import RunLogError

    _check_plot_path(args.plot)
    (run,), metrics = _load_runs([args.run_dir], args.metrics)
    report = run_report(run, metrics)
    if not report.has_figures:
        raise RunLogError(_without_figures(args.run_dir, report.history_source))
    plot_path = None if args.no_plot else args.plot or os.path.join(args.run_dir, REPORT_PLOT_FILE_NAME)
    status = EXIT_DONE
    if plot_path is not None:
        status, written = _write_plot(report_plot, report, plot_path, metrics, explicit=args.plot is not None)
        plot_path = plot_path if written else None
    if args.json:
        print_json({**report.to_dict(), "metrics": metrics, "plot": plot_path}, sys.stdout)
    else:
        print_tables(report_tables(report, metrics), sys.stdout)
        if plot_path is not None:
            print(f"\nPlot: {plot_path}")
    return status


def _compare(args: argparse.Namespace) -> int:
    from trainer_memcb.runs.run_logs import RunLogError

    try:
        return _compare_runs(args)
    except RunLogError as error:
        raise _KnownFailure(str(error)) from None


def _compare_runs(args: argparse.Namespace) -> int:
    from trainer_memcb.cli.compare import compare_runs, compare_table
    from trainer_memcb.cli.plots import compare_plot
    from trainer_memcb.cli.report import run_report
    from trainer_memcb.runs.run_logs import RunLogError

    _check_plot_path(args.plot)
    runs, metrics = _load_runs(args.run_dirs, args.metrics, leave_out_unreadable=True)
    kept = []
    for run in runs:
        if run_report(run, metrics).has_figures:
            kept.append(run)
        else:
            say(f"warning: {_without_figures(run.run_dir, run.history_source)}; left out")
    if not kept:
        raise RunLogError("no run holds optimizer memory figures: they were made without OptimizerMemoryCallback "
                          "(or OptimizerMemoryLogger)")
    rows = compare_runs(kept, metrics)
    status, plot_path = EXIT_DONE, None
    if args.plot is not None:
        status, written = _write_plot(compare_plot, rows, args.plot, metrics, explicit=True)
        plot_path = args.plot if written else None
    if args.json:
        print_json({"runs": [row.to_dict() for row in rows], "metrics": metrics, "plot": plot_path}, sys.stdout)
    else:
        print_tables([compare_table(rows, metrics)], sys.stdout)
        if plot_path is not None:
            print(f"\nPlot: {plot_path}")
    return EXIT_NOTHING_FOUND if len(kept) < len(args.run_dirs) else status


def command(args: argparse.Namespace) -> int:
    """Run the parsed command; any failure becomes one line on stderr and an exit code, never a
    traceback (unless `args.debug`)."""
    handler = getattr(args, "handler", None)
    if handler is None:
        say("error: choose a command: report, compare, estimate or snapshot (trainer-memcb --help shows them)")
        return EXIT_USAGE
    return answer(lambda: _missing_package_is_its_own_answer(handler, args), _KnownFailure,
                  debug=getattr(args, "debug", False))


def _missing_package_is_its_own_answer(handler: Any, args: argparse.Namespace) -> int:
    try:
        return handler(args)
    except MissingPackageError as error:
        say(str(error))
        return EXIT_MISSING_PACKAGE


def _parse(argv: Optional[Sequence[str]]) -> "argparse.Namespace | int":
    """The parsed arguments, or the exit code argparse asked for (`--help` 0, a usage error 2).
    Parsing imports nothing of transformers, so that `console_main` can decide what to keep out
    of the process from the parsed command."""
    try:
        return parser().parse_args(argv)
    except _UsageExit as error:
        say(f"error: {error}")
        return EXIT_USAGE
    except SystemExit as exit_request:  # argparse exits on --help and --version (0)
        code = exit_request.code
        return code if isinstance(code, int) else (EXIT_DONE if code is None else EXIT_USAGE)


def _run(args: argparse.Namespace) -> int:
    if args.debug:
        return command(args)
    with quiet_libraries():  # their warnings would add lines to the one line the command says
        return command(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `trainer-memcb`; returns the exit code.

    Examples:
        >>> main(["compare", "no/such/run"])  # stderr: trainer-memcb: no/such/run: no such folder
        1
    """
    args = _parse(argv)
    return args if isinstance(args, int) else _run(args)


def console_main() -> int:
    """The `trainer-memcb` console script (and `python -m trainer_memcb`): `main` in a process of its own,
    prepared from the parsed command (`prepare_process`). Only here, in a process that ends with the
    command: `main()` called from Python changes nothing.
    """
    try:
        args = _parse(None)
        prepare_process(args)
        if isinstance(args, int):
            return args
        return _run(args)
    except KeyboardInterrupt:  # outside the command's own answer (while parsing): the same one line
        say("interrupted")
        return EXIT_INTERRUPTED
