"""Fine-tune a review classifier with the Trainer, and log what the optimizer state holds.

    python examples/train_with_trainer.py                     # distilbert-base-cased, random weights, offline
    python examples/train_with_trainer.py --model tiny-distilbert --optim adafactor
    python examples/train_with_trainer.py --model distilbert-base-cased   # real weights when the hub is reachable

`OptimizerMemoryCallback` puts `optimizer_state_bytes`, `optimizer_state_estimate_bytes`, ... into
the Trainer's own log entries, beside the loss and eval accuracy/F1; TensorBoard gets them under
`<output-dir>/tensorboard/<optim>` (a run named for its optimizer, as compare_optimizers.py's), and
the callback writes `<output-dir>/optimizer_memory.json` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import text_classification  # noqa: F401  (first: it drops other libraries' import notices, see there)
import torch
from transformers import DataCollatorWithPadding, ProgressCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.integrations import TensorBoardCallback

from text_classification import (
    DISTILBERT_ARCHITECTURE,
    OPTIMIZERS,
    Scores,
    add_optimizer_argument,
    example_parser,
    load_model,
    load_reviews,
    tokenize_reviews,
)
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.summary import SUMMARY_FILE_NAME
from trainer_memcb.utils.units import format_bytes

DEFAULT_OUTPUT_DIR = os.path.join("output", "train_with_trainer")


class StepTimer(TrainerCallback):
    """Wall time of the training steps alone (forward, backward, optimizer step), not evaluation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self._started: Optional[float] = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.steps += 1
            self._started = None

    @property
    def seconds_per_step(self) -> Optional[float]:
        return self.seconds / self.steps if self.steps else None


class ProgressBarsOnly(ProgressCallback):
    """The Trainer's progress bars (training steps, evaluation batches), without the log entries
    it would print under them: for a caller that prints its own summary."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        pass


@dataclass
class TrainingRun:
    """What one fine-tuning run produced.

    Attributes:
        optimizer: the optimizer's name in `OPTIMIZERS`.
        origin: how the model and tokenizer were obtained.
        model_params: `sum(p.numel() for p in model.parameters())`, as the lesson counts them.
        steps: optimizer steps taken.
        seconds_per_step: mean wall time of a training step.
        eval_metrics: the last evaluation's entry (`eval_accuracy`, `eval_f1`, ...).
        memory: the callback's JSON summary (`measured`, `estimate`, exact bytes).
        log_history: the Trainer's log entries.
    """

    optimizer: str
    origin: str
    model_params: int
    steps: int
    seconds_per_step: Optional[float]
    eval_metrics: Dict[str, Any]
    memory: Dict[str, Any]
    log_history: List[Dict[str, Any]]


def training_arguments(args: argparse.Namespace, optimizer: str, output_dir: str) -> TrainingArguments:
    # Evaluate at each epoch's end, or once at the last step with --max-steps: always at the end.
    schedule: Dict[str, Any] = (
        {"max_steps": args.max_steps, "eval_strategy": "steps", "eval_steps": args.max_steps}
        if args.max_steps else {"num_train_epochs": args.num_epochs, "eval_strategy": "epoch"}
    )
    return TrainingArguments(
        output_dir=output_dir, optim=OPTIMIZERS[optimizer].trainer_optim, learning_rate=args.learning_rate,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64,
        logging_steps=args.logging_steps, save_strategy="no", report_to="none", seed=args.seed,
        dataloader_num_workers=0, dataloader_pin_memory=torch.cuda.is_available(), disable_tqdm=False, **schedule,
    )


def train(
    args: argparse.Namespace, optimizer: str, output_dir: str, tensorboard_dir: str, print_logs: bool = True
) -> TrainingRun:
    """Fine-tune `args.model` with `optimizer`; TensorBoard events go to `tensorboard_dir`.

    A progress bar shows the steps as they go; with `print_logs`, each log entry is printed under
    it as the Trainer logs it (figures included).
    """
    from torch.utils.tensorboard import SummaryWriter

    reviews = load_reviews(eval_samples=args.eval_samples, train_samples=args.train_samples)
    loaded = load_model(args.model, reviews["train"]["text"], seed=args.seed)
    tokenized = tokenize_reviews(reviews, loaded.tokenizer, loaded.max_length)
    timer = StepTimer()
    trainer = Trainer(
        model=loaded.model,
        args=training_arguments(args, optimizer, output_dir),
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=DataCollatorWithPadding(loaded.tokenizer),
        compute_metrics=Scores().compute_metrics,
        callbacks=[TensorBoardCallback(SummaryWriter(log_dir=tensorboard_dir)), OptimizerMemoryCallback(), timer],
    )
    if not print_logs:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(ProgressBarsOnly())
    trainer.train()
    # trainer_state.json beside optimizer_memory.json, so that `trainer-memcb report` and
    # `compare` find the whole log history (eval accuracy and F1 included) in the run's folder.
    trainer.save_state()
    history = trainer.state.log_history
    with open(os.path.join(output_dir, SUMMARY_FILE_NAME), encoding="utf-8") as handle:
        memory = json.load(handle)
    return TrainingRun(
        optimizer=optimizer,
        origin=loaded.origin,
        model_params=sum(param.numel() for param in loaded.model.parameters()),
        steps=trainer.state.global_step,
        seconds_per_step=timer.seconds_per_step,
        eval_metrics=[entry for entry in history if "eval_accuracy" in entry][-1],
        memory=memory,
        log_history=history,
    )


def parser() -> argparse.ArgumentParser:
    parser = example_parser(__doc__, DISTILBERT_ARCHITECTURE, DEFAULT_OUTPUT_DIR, default_epochs=1,
                            default_learning_rate=1e-4)
    add_optimizer_argument(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    run = train(args, args.optim, args.output_dir, os.path.join(args.output_dir, "tensorboard", args.optim))
    measured, estimate = run.memory["measured"], run.memory["estimate"]
    print(f"Model: {run.origin}")
    print(f"Parameters: {run.model_params:,}")
    print(f"After {run.steps} steps: eval accuracy {run.eval_metrics['eval_accuracy']:.3f}, "
          f"eval F1 {run.eval_metrics['eval_f1']:.3f}")
    if measured is not None:
        print(f"{run.memory['optimizer_class']} state, measured: {measured['num_bytes']:,} bytes "
              f"({format_bytes(measured['num_bytes'])}) in {measured['num_elements']:,} values")
    if estimate is not None:
        print(f"{run.memory['optimizer_class']} state, estimate: {estimate['num_bytes']:,} bytes "
              f"({format_bytes(estimate['num_bytes'])}) for {estimate['num_params']:,} trainable parameters")
    print(f"TensorBoard: tensorboard --logdir {os.path.join(args.output_dir, 'tensorboard')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
