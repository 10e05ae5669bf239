"""What `OptimizerMemoryCallback` costs, and what measuring from metadata saves.

Prints, in one run:

(a) the training-step time of a real `transformers.Trainer` on a tiny DistilBERT (built from a
    config, CPU, `logging_steps=1`, `report_to=[]`) with and without `OptimizerMemoryCallback`,
    as the ratio with / without. Target: at most 1.01.
(b) one measurement of distilbert-base-cased's AdamW state (architecture from the config shipped
    in `examples/models/`, state made by one real AdamW step) by `measure_optimizer_state`
    against a naive method that copies every state value to read its size, as the ratio
    naive / ours. Target: at least 600.

Fairness: fixed threads and seeds; warm-up steps and calls that are not timed; medians
throughout. With and without the callback alternate step by step inside each training run, in
ABBA order (the callback is added to and removed from the Trainer between steps), so that the
machine's load, which drifts over seconds, falls on both sides alike: whole runs with and without,
alternated, differed by 15-80% from run to run on a busy 2-core machine, far above the 1% to be
resolved. A step is timed from its `on_step_begin` to the next one (data, forward, backward,
optimizer step, every callback's work and the log entry fall inside), on two clocks: the wall
clock (`time.perf_counter`, the target's measure) and this process's CPU time
(`time.process_time`), which other processes disturb less. Each run gives a ratio of medians;
the headline is the median over runs, and the spread of the runs' ratios shows the noise.
`--quick` is a smoke run whose numbers mean little.

    python benchmarks/overhead.py            # the full benchmark, about two minutes on 2 cores
    python benchmarks/overhead.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # the tiny model and data the tests train on live in tests/

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForSequenceClassification,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
)

from tests.helpers import TinyDataset, tiny_classifier, training_args  # noqa: E402
from trainer_memcb import OptimizerMemoryCallback, measure_optimizer_state  # noqa: E402
from trainer_memcb.units import format_bytes  # noqa: E402

STEP_RATIO_TARGET = 1.01  # (a): with / without the callback, at most
MEASURE_SPEEDUP_TARGET = 600.0  # (b): naive / measure_optimizer_state, at least

DISTILBERT_CONFIG_DIR = os.path.join(REPO_ROOT, "examples", "models", "distilbert-base-cased")
BATCH_SIZE = 4

# `Trainer.log` as transformers ships it, before the callback's hook wraps it: the steps without
# the callback put it back, so that they pay nothing of the callback's, not even the hook.
_UNHOOKED_TRAINER_LOG = Trainer.log


@dataclass(frozen=True)
class Settings:
    threads: int
    runs: int  # training runs, each alternating steps with and without the callback
    steps: int  # timed steps per run, half of them with the callback
    warmup_steps: int  # steps per run before the timed ones, alternating too
    measure_calls: int  # timed calls of measure_optimizer_state
    naive_calls: int  # timed calls of the naive method (each copies the whole state)

    @classmethod
    def full(cls, threads: int) -> "Settings":
        return cls(threads=threads, runs=8, steps=600, warmup_steps=40, measure_calls=200, naive_calls=5)

    @classmethod
    def quick(cls, threads: int) -> "Settings":
        return cls(threads=threads, runs=1, steps=16, warmup_steps=4, measure_calls=10, naive_calls=1)


# -- (a) the training step with and without the callback ---------------------------------------


def with_callback_at(step_index: int) -> bool:
    """ABBA over steps: with, without, without, with, with, ... Drift in the machine's load
    between neighbouring steps then falls on both sides alike."""
    return step_index % 4 in (0, 3)


class AlternatingStepTimer(TrainerCallback):
    """Puts the callback under test into the Trainer for some steps and takes it out for the
    others, and times every step.

    At each `on_step_begin` it adds or removes `callback` (and the hook it installs on
    `Trainer.log`) following `with_callback_at`, then records the wall clock and the process's CPU
    time. Consecutive records bound whole steps: data, forward, backward, optimizer step, every
    callback's work and the log entry. It must be the first user callback, so that the callback
    under test runs after transformers' `DefaultFlowCallback` as it would anyway.
    """

    def __init__(self, callback: OptimizerMemoryCallback) -> None:
        self.callback = callback
        self.handler: Any = None  # the Trainer's callback handler, set once the Trainer exists
        self.hooked_log = Trainer.log  # the callback installed its hook when it was made
        self.wall_starts: List[float] = []
        self.cpu_starts: List[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wanted = with_callback_at(len(self.wall_starts))
        if wanted != (self.callback in self.handler.callbacks):
            if wanted:
                self.handler.add_callback(self.callback)
            else:
                self.handler.remove_callback(self.callback)
            Trainer.log = self.hooked_log if wanted else _UNHOOKED_TRAINER_LOG
        self.cpu_starts.append(time.process_time())
        self.wall_starts.append(time.perf_counter())

    def step_seconds(self, skip: int) -> Dict[bool, Tuple[List[float], List[float]]]:
        """{with the callback?: (wall seconds, CPU seconds) of each step}, after `skip` steps."""
        split: Dict[bool, Tuple[List[float], List[float]]] = {True: ([], []), False: ([], [])}
        for index in range(skip, len(self.wall_starts) - 1):
            wall, cpu = split[with_callback_at(index)]
            wall.append(self.wall_starts[index + 1] - self.wall_starts[index])
            cpu.append(self.cpu_starts[index + 1] - self.cpu_starts[index])
        return split


@dataclass(frozen=True)
class RunTimes:
    """Median seconds per step in one run, with and without the callback, on both clocks."""

    wall_with: float
    wall_without: float
    cpu_with: float
    cpu_without: float


def timed_training_run(settings: Settings, output_dir: str) -> RunTimes:
    """One `trainer.train()` of the tiny classifier, alternating steps with and without the callback."""
    Trainer.log = _UNHOOKED_TRAINER_LOG
    timer = AlternatingStepTimer(OptimizerMemoryCallback())  # present from the start: step 0 is "with"
    # One step more than timed: the last step has no next `on_step_begin` to end it.
    total_steps = settings.warmup_steps + settings.steps + 1
    args = training_args(output_dir, max_steps=total_steps, per_device_train_batch_size=BATCH_SIZE)
    trainer = Trainer(
        model=tiny_classifier(seed=0),
        args=args,
        train_dataset=TinyDataset(size=BATCH_SIZE * total_steps, seed=0),
        callbacks=[timer, timer.callback],
    )
    timer.handler = trainer.callback_handler
    # The console printer would print every entry; no step should pay for that.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    gc.collect()
    try:
        trainer.train()
    finally:
        Trainer.log = _UNHOOKED_TRAINER_LOG
    steps = timer.step_seconds(skip=settings.warmup_steps)
    (wall_with, cpu_with), (wall_without, cpu_without) = steps[True], steps[False]
    return RunTimes(
        wall_with=statistics.median(wall_with),
        wall_without=statistics.median(wall_without),
        cpu_with=statistics.median(cpu_with),
        cpu_without=statistics.median(cpu_without),
    )


@dataclass(frozen=True)
class StepRatio:
    """with / without the callback on one clock, from each run's medians."""

    with_seconds: List[float]
    without_seconds: List[float]

    @property
    def run_ratios(self) -> List[float]:
        return [a / b for a, b in zip(self.with_seconds, self.without_seconds)]

    @property
    def ratio(self) -> float:
        """The headline: the median over runs of each run's with / without."""
        return statistics.median(self.run_ratios)

    @property
    def added_seconds(self) -> float:
        """What the callback adds to a logged step: the median over runs of with - without."""
        return statistics.median(a - b for a, b in zip(self.with_seconds, self.without_seconds))


def compare_step_times(settings: Settings, report: Callable[[str], None]) -> Tuple[StepRatio, StepRatio]:
    """(wall, CPU) step-time ratios with / without the callback."""
    runs: List[RunTimes] = []
    with tempfile.TemporaryDirectory() as output_dir:
        for index in range(settings.runs):
            run = timed_training_run(settings, output_dir)
            runs.append(run)
            report(f"  run {index + 1:>2}: median step with / without callback: "
                   f"wall {run.wall_with * 1e3:.4f} / {run.wall_without * 1e3:.4f} ms = {run.wall_with / run.wall_without:.4f}; "
                   f"CPU {run.cpu_with * 1e3:.4f} / {run.cpu_without * 1e3:.4f} ms = {run.cpu_with / run.cpu_without:.4f}")
    wall = StepRatio([run.wall_with for run in runs], [run.wall_without for run in runs])
    cpu = StepRatio([run.cpu_with for run in runs], [run.cpu_without for run in runs])
    return wall, cpu


# -- (b) measuring distilbert-base-cased's AdamW state -------------------------------------------


def distilbert_adamw() -> torch.optim.AdamW:
    """distilbert-base-cased for 2 labels, built offline from its config, after one AdamW step."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(DISTILBERT_CONFIG_DIR, num_labels=2)
    model = AutoModelForSequenceClassification.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    input_ids = torch.randint(1000, 2000, (2, 16))
    model(input_ids=input_ids, labels=torch.tensor([0, 1])).loss.backward()
    optimizer.step()
    return optimizer


def naive_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The method this library replaces: copy every state value, then read the copy's size."""
    total = 0
    for param_state in optimizer.state.values():
        for value in param_state.values():
            copy = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
            total += copy.numel() * copy.element_size()
    return total


def median_call_seconds(function: Callable[[], Any], calls: int, warmup: int) -> Tuple[float, Any]:
    """The median wall-clock seconds of `calls` calls after `warmup` untimed ones; the last result."""
    for _ in range(warmup):
        function()
    gc.collect()
    seconds = []
    result = None
    for _ in range(calls):
        start = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


@dataclass(frozen=True)
class MeasureTimes:
    ours_seconds: float
    naive_seconds: float
    ours_bytes: int
    naive_bytes: int
    num_state_tensors: int
    num_params: int

    @property
    def ratio(self) -> float:
        return self.naive_seconds / self.ours_seconds


def compare_measuring(settings: Settings) -> MeasureTimes:
    optimizer = distilbert_adamw()
    ours, measured = median_call_seconds(lambda: measure_optimizer_state(optimizer), settings.measure_calls, warmup=10)
    naive, naive_bytes = median_call_seconds(lambda: naive_state_bytes(optimizer), settings.naive_calls, warmup=1)
    return MeasureTimes(
        ours_seconds=ours,
        naive_seconds=naive,
        ours_bytes=measured.num_bytes,
        naive_bytes=naive_bytes,
        num_state_tensors=measured.num_tensors,
        num_params=sum(p.numel() for group in optimizer.param_groups for p in group["params"]),
    )


# -- where the callback's time goes ------------------------------------------------------------


def profile_callback(settings: Settings) -> str:
    """cProfile over one run with the callback in every step: the package's functions, by
    cumulative time. cProfile slows Python code several-fold, so read the shares, not the times."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory() as output_dir:
        Trainer.log = _UNHOOKED_TRAINER_LOG
        total_steps = settings.warmup_steps + settings.steps
        trainer = Trainer(
            model=tiny_classifier(seed=0),
            args=training_args(output_dir, max_steps=total_steps, per_device_train_batch_size=BATCH_SIZE),
            train_dataset=TinyDataset(size=BATCH_SIZE * total_steps, seed=0),
            callbacks=[OptimizerMemoryCallback()],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        profiler.enable()
        try:
            trainer.train()
        finally:
            profiler.disable()
            Trainer.log = _UNHOOKED_TRAINER_LOG
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(r"trainer_memcb|trainer\.py.*\(_inner_training_loop\)|trainer_callback\.py.*call_event", 14)
    return text.getvalue()


# -- the command ---------------------------------------------------------------------------------


def verdict(holds: bool) -> str:
    return "target met" if holds else "target NOT met"


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    result.add_argument("--quick", action="store_true", help="a short smoke run; its numbers mean little")
    result.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    result.add_argument("--profile", action="store_true",
                        help="instead: profile one training run with the callback (cProfile) and print "
                             "where the callback's time goes")
    return result


def command(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads}: expected a positive number of threads")
    settings = Settings.quick(args.threads) if args.quick else Settings.full(args.threads)
    torch.set_num_threads(settings.threads)
    if args.profile:
        print(profile_callback(settings))
        return 0
    model = tiny_classifier(seed=0)
    print("Inputs")
    print(f"  python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}{', QUICK run' if args.quick else ''}")
    print(f"  (a) tiny DistilBERT from tests/helpers.py: {sum(p.numel() for p in model.parameters()):,} parameters "
          f"in {len(list(model.parameters()))} tensors; Trainer on the CPU, batch {BATCH_SIZE}, logging_steps=1, "
          f"report_to=[], default optimizer")
    print(f"      {settings.runs} runs; per run {settings.warmup_steps} warm-up steps, then {settings.steps} timed steps, "
          f"with and without the callback alternating ABBA step by step")
    print(f"  (b) distilbert-base-cased (examples/models/distilbert-base-cased/config.json, num_labels=2), "
          f"one torch.optim.AdamW step; {settings.measure_calls} timed calls of measure_optimizer_state, "
          f"{settings.naive_calls} of the naive copy")
    sys.stdout.flush()

    print("(a) training step")
    wall, cpu = compare_step_times(settings, report=lambda line: print(line, flush=True))
    print("(b) measuring the state")
    measuring = compare_measuring(settings)
    print(f"  state: {measuring.num_params:,} parameters, {measuring.num_state_tensors} state tensors; "
          f"measure_optimizer_state {measuring.ours_bytes:,} bytes ({format_bytes(measuring.ours_bytes)}), "
          f"naive {measuring.naive_bytes:,} bytes")
    print(f"  measure_optimizer_state: median {measuring.ours_seconds * 1e6:.1f} us per call")
    print(f"  naive copy:              median {measuring.naive_seconds * 1e3:.1f} ms per call")

    print("Results")
    for title, times in (("(a) step time with / without callback", wall), ("    same, in CPU time", cpu)):
        print(f"  {title}: {times.ratio:.4f} (median over {len(times.run_ratios)} runs; runs' ratios "
              f"{min(times.run_ratios):.4f}..{max(times.run_ratios):.4f}; adds {times.added_seconds * 1e3:.4f} ms a step) "
              f"-> {verdict(times.ratio <= STEP_RATIO_TARGET)} (<= {STEP_RATIO_TARGET})")
    print(f"  (b) naive / measure_optimizer_state: {measuring.ratio:.0f}x "
          f"-> {verdict(measuring.ratio >= MEASURE_SPEEDUP_TARGET)} (>= {MEASURE_SPEEDUP_TARGET:.0f}x)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
