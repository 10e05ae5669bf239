"""AdamW vs Adafactor vs 8-bit Adam: the same fine-tuning three times, one table of what each costs.

    python examples/compare_optimizers.py                                 # tiny DistilBERT, then the lesson
    python examples/compare_optimizers.py --no-lesson                     # the tiny DistilBERT only
    python examples/compare_optimizers.py --model distilbert-base-cased --max-steps 1
    tensorboard --logdir output/compare_optimizers/tensorboard            # the runs overlaid

Each run is `train_with_trainer.train()` with `OptimizerMemoryCallback`: the measured state and
the estimate come from the callback's own summary. Then, unless `--no-lesson` (or `--model` is
already distilbert-base-cased), the lesson's table: the distilbert-base-cased architecture built
from its shipped config (random weights, offline), one real training step on 8 reviews with each
optimizer, whose state is then final. The rows are written, exact, to
`<output-dir>/comparison.json` (the lesson's under `"lesson"`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import datasets
import torch

from text_classification import (
    DISTILBERT_ARCHITECTURE,
    OPTIMIZERS,
    TINY_MODEL,
    example_parser,
    parse_optimizer_names,
    positive_int,
)
from train_with_trainer import TrainingRun, train
from trainer_memcb.utils.units import format_bytes

DEFAULT_OUTPUT_DIR = os.path.join("output", "compare_optimizers")
COMPARISON_FILE_NAME = "comparison.json"
COLUMNS = ("optimizer", "trainable params", "measured state", "estimate", "eval accuracy", "eval F1", "s/step")
MEMORY_COLUMNS = COLUMNS[:4]  # the lesson's table: one step on 8 reviews, whose scores mean nothing
# The lesson's run: one optimizer step on 8 reviews, evaluated on 8; the state is complete after
# the first step, so the bytes are final.
LESSON_ARGUMENTS = {"model": DISTILBERT_ARCHITECTURE, "max_steps": 1, "train_samples": 8, "eval_samples": 8,
                    "batch_size": 8, "logging_steps": 1}
LESSON_MODEL_NAMES = ("distilbert-base-cased", DISTILBERT_ARCHITECTURE)


def comparison_row(run: TrainingRun) -> Dict[str, Any]:
    """One run's figures, exact: bytes and counts as integers."""
    measured, estimate = run.memory["measured"], run.memory["estimate"]
    return {
        "optimizer": run.optimizer,
        # The estimate names the class with its module: bitsandbytes' AdamW is not torch's.
        "optimizer_class": estimate["optimizer_class"] if estimate is not None else run.memory["optimizer_class"],
        "model_params": run.model_params,
        "trainable_params": estimate["num_params"] if estimate is not None else None,
        "measured_bytes": measured["num_bytes"] if measured is not None else None,
        "measured_elements": measured["num_elements"] if measured is not None else None,
        "estimate_bytes": estimate["num_bytes"] if estimate is not None else None,
        "measured_bytes_by_key": measured["bytes_by_key"] if measured is not None else {},
        "eval_accuracy": run.eval_metrics["eval_accuracy"],
        "eval_f1": run.eval_metrics["eval_f1"],
        "steps": run.steps,
        "seconds_per_step": run.seconds_per_step,
    }


def _bytes_cell(num_bytes: Optional[int]) -> str:
    return "-" if num_bytes is None else f"{num_bytes:,} ({format_bytes(num_bytes)})"


def _count_cell(count: Optional[int]) -> str:
    return "-" if count is None else f"{count:,}"


def _float_cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def comparison_table(rows: List[Dict[str, Any]], scores: bool = True) -> str:
    """The rows as a plain-text table, sizes in exact bytes and in MiB (1024**2 bytes).

    Args:
        scores: with the eval accuracy, F1 and seconds per step; without, the memory columns only.
    """
    columns = COLUMNS if scores else MEMORY_COLUMNS
    cells = [
        [
            row["optimizer"], _count_cell(row["trainable_params"]), _bytes_cell(row["measured_bytes"]),
            _bytes_cell(row["estimate_bytes"]), _float_cell(row["eval_accuracy"], 3),
            _float_cell(row["eval_f1"], 3), _float_cell(row["seconds_per_step"], 3),
        ][:len(columns)]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [list(columns)] + cells) for i in range(len(columns))]
    lines = []
    for line in [list(columns)] + cells:
        # The optimizer's name left-aligned, numbers right-aligned.
        first, *rest = zip(line, widths)
        lines.append("  ".join([first[0].ljust(first[1])] + [cell.rjust(width) for cell, width in rest]))
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def estimate_checks(rows: List[Dict[str, Any]]) -> List[str]:
    """One line per row: does the measured state equal the estimate?"""
    lines = []
    for row in rows:
        name = f"{row['optimizer']} ({row['optimizer_class']})"
        measured, estimate = row["measured_bytes"], row["estimate_bytes"]
        if measured is None or estimate is None:
            lines.append(f"{name}: no {'measurement' if measured is None else 'estimate rule'}")
        elif measured == estimate:
            lines.append(f"{name}: measured == estimate, {measured:,} bytes")
        else:
            lines.append(f"{name}: measured - estimate = {measured - estimate:+,} bytes")
    return lines


def parser() -> argparse.ArgumentParser:
    parser = example_parser(__doc__, TINY_MODEL, DEFAULT_OUTPUT_DIR, default_epochs=8, default_learning_rate=1e-3)
    parser.add_argument(
        "--optimizers", type=parse_optimizer_names, default=list(OPTIMIZERS),
        help=f"comma-separated, from {', '.join(OPTIMIZERS)} (default: all three)",
    )
    parser.add_argument(
        "--lesson", action=argparse.BooleanOptionalAction, default=None,
        help="after the comparison, the lesson's table: distilbert-base-cased built from its shipped config "
             "(65,783,042 parameters, random weights, offline), one training step on 8 reviews per optimizer, "
             "on all of torch's threads (default: on, unless --model is distilbert-base-cased)",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=1,
        help="CPU threads for torch (default: 1: the tiny model gains little from more, and loses much "
             "when other work shares the cores; raise it for a bigger --model)",
    )
    return parser


def train_each(args: argparse.Namespace, output_dir: str, name: str) -> Dict[str, Any]:
    """Train `args.model` (called `name`) once per optimizer, each run under `output_dir`; the
    model's name, how it was built, and the rows."""
    rows, origin = [], ""
    for optimizer in args.optimizers:
        print(f"Training {name} with {optimizer} ({OPTIMIZERS[optimizer].state}) ...", flush=True)
        run = train(
            args, optimizer, os.path.join(output_dir, optimizer),
            os.path.join(output_dir, "tensorboard", optimizer), print_logs=False,
        )
        rows.append(comparison_row(run))
        origin = run.origin
    return {"model": name, "origin": origin, "rows": rows}


def runs_the_lesson(args: argparse.Namespace) -> bool:
    """`--lesson`, or by default: the lesson follows unless the comparison is already of its model."""
    return args.lesson if args.lesson is not None else args.model not in LESSON_MODEL_NAMES


def compare(args: argparse.Namespace) -> Dict[str, Any]:
    """Train once per optimizer on `--threads` threads, then the lesson's runs, when they follow, on
    all of torch's threads (66 million parameters use every core); also written to comparison.json."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        document = train_each(args, args.output_dir, args.model)
    finally:
        torch.set_num_threads(threads)
    if runs_the_lesson(args):
        lesson_args = argparse.Namespace(**{**vars(args), **LESSON_ARGUMENTS})
        document["lesson"] = train_each(lesson_args, os.path.join(args.output_dir, "lesson"), "distilbert-base-cased")
    with open(os.path.join(args.output_dir, COMPARISON_FILE_NAME), "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    return document


def print_rows(document: Dict[str, Any], scores: bool = True) -> None:
    rows = document["rows"]
    print(f"Model: {document['model']}, {rows[0]['model_params']:,} parameters, {document['origin']}")
    print(comparison_table(rows, scores=scores))
    print()
    print("\n".join(estimate_checks(rows)))


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    datasets.disable_progress_bars()  # the datasets' maps take milliseconds; the training has its bars
    document = compare(args)
    print()
    print_rows(document)
    if "lesson" in document:
        print("\nThe lesson's numbers: one step on 8 reviews each, after which the state is final "
              "(the scores of one step mean nothing)")
        print_rows(document["lesson"], scores=False)
    print()
    print("\n".join(closing_lines(args.output_dir, document)))
    return 0


def closing_lines(output_dir: str, document: Dict[str, Any]) -> List[str]:
    """Where the figures are: the rows, and for the comparison's runs and the lesson's, the command
    that compares them and TensorBoard's, each run's folder named as the command takes it."""
    lines = [f"Rows: {os.path.join(output_dir, COMPARISON_FILE_NAME)}"]
    for label, folder, part in (("The runs", output_dir, document),
                                ("The lesson's runs", os.path.join(output_dir, "lesson"), document.get("lesson"))):
        if part is None:
            continue
        runs = " ".join(os.path.join(folder, row["optimizer"]) for row in part["rows"])
        lines += [f"{label}: trainer-memcb compare {runs}",
                  f"{label} in TensorBoard: tensorboard --logdir {os.path.join(folder, 'tensorboard')}"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
