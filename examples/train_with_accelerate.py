"""Fine-tune a review classifier in a custom Accelerate loop, and log what the optimizer state holds.

    python examples/train_with_accelerate.py                   # distilbert-base-cased, random weights, offline
    python examples/train_with_accelerate.py --model tiny-distilbert --gradient-accumulation-steps 2
    tensorboard --logdir output/train_with_accelerate/tensorboard   # one run per optimizer, named for it

The loop is the lesson's (`accelerator.backward(loss)`, `optimizer.step()`, `lr_scheduler.step()`,
`optimizer.zero_grad()`) plus three lines: `OptimizerMemoryLogger(optimizer, accelerator,
max_steps=...)` before it, a call right after `optimizer.step()`, which logs
`optimizer_state_bytes`, `optimizer_state_estimate_bytes`, ... through `accelerator.log` to
TensorBoard (on logging steps and on the last step), and `memory.add_to(metrics, prefix="eval")`,
which puts `eval_optimizer_state_bytes`, ... beside `eval_accuracy` in the evaluation's entry.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Dict, List, Optional

import text_classification  # noqa: F401  (first: it drops other libraries' import notices, see there)
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from transformers import DataCollatorWithPadding, get_linear_schedule_with_warmup

from text_classification import (
    DISTILBERT_ARCHITECTURE,
    OPTIMIZERS,
    Scores,
    add_optimizer_argument,
    example_parser,
    load_model,
    load_reviews,
    positive_int,
    tokenize_reviews,
)
from trainer_memcb import OptimizerMemoryLogger

DEFAULT_OUTPUT_DIR = os.path.join("output", "train_with_accelerate")
# The tracker writes to <logging_dir>/<run name>: the run folders under <output-dir>/tensorboard,
# each named for its optimizer, which is the run's name in TensorBoard (as compare_optimizers.py's).
TENSORBOARD_DIR = "tensorboard"
MAX_GRAD_NORM = 1.0


def evaluate(model: Any, loader: Any, accelerator: Accelerator, scores: Scores) -> Dict[str, float]:
    """Accuracy and F1 over the whole validation set, gathered from every process."""
    model.eval()
    predictions: List[int] = []
    references: List[int] = []
    for batch in loader:
        with torch.no_grad():
            logits = model(**batch).logits
        batch_predictions, batch_labels = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["labels"]))
        predictions += batch_predictions.tolist()
        references += batch_labels.tolist()
    model.train()
    return {f"eval_{name}": value for name, value in scores(predictions, references).items()}


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """The custom loop; returns the last evaluation and the last optimizer figures."""
    project = ProjectConfiguration(project_dir=args.output_dir,
                                   logging_dir=os.path.join(args.output_dir, TENSORBOARD_DIR))
    accelerator = Accelerator(
        log_with="tensorboard", project_config=project, gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    accelerator.init_trackers(args.optim)  # events in <output-dir>/tensorboard/<optim>
    set_seed(args.seed)
    reviews = load_reviews(eval_samples=args.eval_samples, train_samples=args.train_samples)
    loaded = load_model(args.model, reviews["train"]["text"], seed=args.seed)
    tokenized = tokenize_reviews(reviews, loaded.tokenizer, loaded.max_length).rename_column("label", "labels")
    collator = DataCollatorWithPadding(loaded.tokenizer)
    train_loader = torch.utils.data.DataLoader(
        tokenized["train"], shuffle=True, batch_size=args.batch_size, collate_fn=collator
    )
    eval_loader = torch.utils.data.DataLoader(tokenized["validation"], batch_size=64, collate_fn=collator)

    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_steps = args.max_steps or steps_per_epoch * args.num_epochs
    optimizer = OPTIMIZERS[args.optim].build(loaded.model.parameters(), args.learning_rate)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=max_steps)
    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        loaded.model, optimizer, train_loader, eval_loader, lr_scheduler
    )
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=args.logging_steps, max_steps=max_steps)
    scores = Scores()

    step, figures, metrics = 0, {}, {}
    model.train()
    while step < max_steps:
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # clip as the Trainer does (max_grad_norm=1.0)
                    accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                figures = memory() or figures  # the figures, on logging steps
                lr_scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue  # a micro-batch of gradient accumulation
            step += 1
            if step % args.logging_steps == 0 or step == max_steps:  # the last step too, as the logger does
                accelerator.log({"loss": loss.item(), "learning_rate": lr_scheduler.get_last_lr()[0]}, step=step)
            if step == max_steps:
                break
        metrics = evaluate(model, eval_loader, accelerator, scores)
        accelerator.log(memory.add_to(dict(metrics), prefix="eval"), step=step)  # every process: add_to is collective
        accelerator.print(f"step {step}: {metrics}")
    accelerator.end_training()
    if accelerator.is_main_process:
        memory.save_summary(args.output_dir)
    return {"origin": loaded.origin, "steps": step, "metrics": metrics, "figures": figures,
            "summary": memory.summary(), "model_params": sum(param.numel() for param in model.parameters())}


def parser() -> argparse.ArgumentParser:
    parser = example_parser(__doc__, DISTILBERT_ARCHITECTURE, DEFAULT_OUTPUT_DIR, default_epochs=1,
                            default_learning_rate=1e-4)
    add_optimizer_argument(parser)
    parser.add_argument("--gradient-accumulation-steps", type=positive_int, default=1,
                        help="micro-batches per optimizer step, through accelerator.accumulate (default: 1)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    result = train(args)
    print(f"Model: {result['origin']}")
    print(f"Parameters: {result['model_params']:,}")
    print(f"After {result['steps']} steps: eval accuracy {result['metrics']['eval_accuracy']:.3f}, "
          f"eval F1 {result['metrics']['eval_f1']:.3f}")
    print(result["summary"])
    print(f"TensorBoard: tensorboard --logdir {os.path.join(args.output_dir, TENSORBOARD_DIR)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
