"""What `OptimizerMemoryCallback` costs, and what measuring from metadata saves.

Prints, in one run:

(a) the training-step time of a real `transformers.Trainer` on a tiny DistilBERT (built from a
    config, CPU, `logging_steps=1`, `report_to=[]`) with and without `OptimizerMemoryCallback`,
    as the ratio with / without. Target: at most 1.01.
(b) one measurement of distilbert-base-cased's AdamW state (architecture from the config shipped
    in `examples/models/`, state made by one real AdamW step) by `measure_optimizer_state`
    against a naive method that copies every state value to read its size, as the ratio
    naive / ours. Target: at least 600.

Fairness: fixed threads and seeds; warm-up runs, steps and calls that are not timed; runs with
and without the callback interleaved in ABBA order so that drift in the machine's load hits both
alike; per-step intervals from `on_step_begin` to the next `on_step_begin` (data, forward,
backward, optimizer step, the callback's measuring and the log entry all fall inside); medians
throughout. Each step is timed twice: wall clock (`time.perf_counter`, the target's measure) and
this process's CPU time (`time.process_time`), which other processes on a busy machine disturb
far less. `--quick` is a smoke run whose numbers mean little.

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
from typing import Any, Callable, List, Optional, Sequence, Tuple

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

# `Trainer.log` as transformers ships it, before the callback's hook wraps it: the runs without
# the callback put it back, so that they pay nothing of the callback's, not even the hook.
_UNHOOKED_TRAINER_LOG = Trainer.log


@dataclass(frozen=True)
class Settings:
    threads: int
    pairs: int  # runs with the callback, and as many without, interleaved
    warmup_runs: int  # untimed runs of each kind before the timed ones
    steps: int  # timed steps per run
    warmup_steps: int  # steps per run before the timed ones
    measure_calls: int  # timed calls of measure_optimizer_state
    naive_calls: int  # timed calls of the naive method (each copies the whole state)

    @classmethod
    def full(cls, threads: int) -> "Settings":
        return cls(threads=threads, pairs=10, warmup_runs=1, steps=300, warmup_steps=20, measure_calls=200, naive_calls=5)

    @classmethod
    def quick(cls, threads: int) -> "Settings":
        return cls(threads=threads, pairs=1, warmup_runs=0, steps=10, warmup_steps=3, measure_calls=10, naive_calls=1)


# -- (a) the training step with and without the callback ---------------------------------------


class StepTimer(TrainerCallback):
    """Records the wall clock and the process's CPU time at every `on_step_begin`: consecutive
    differences are whole steps, the log entry and every callback's work included."""

    def __init__(self) -> None:
        self.wall_starts: List[float] = []
        self.cpu_starts: List[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.cpu_starts.append(time.process_time())
        self.wall_starts.append(time.perf_counter())

    @staticmethod
    def _intervals(starts: List[float]) -> List[float]:
        return [later - earlier for earlier, later in zip(starts, starts[1:])]

    def median_step_seconds(self, skip: int) -> Tuple[float, float]:
        """(wall, CPU) median seconds per step, leaving out the first `skip` steps."""
        return (statistics.median(self._intervals(self.wall_starts[skip:])),
                statistics.median(self._intervals(self.cpu_starts[skip:])))


def timed_training_run(with_callback: bool, settings: Settings, output_dir: str) -> Tuple[float, float]:
    """One `trainer.train()` of the tiny classifier; (wall, CPU) median seconds per timed step."""
    Trainer.log = _UNHOOKED_TRAINER_LOG
    timer = StepTimer()
    callbacks: List[TrainerCallback] = [timer]
    if with_callback:
        callbacks.append(OptimizerMemoryCallback())  # installs its hook on Trainer.log again
    # One step more than timed: the last step has no next `on_step_begin` to end it.
    total_steps = settings.warmup_steps + settings.steps + 1
    args = training_args(output_dir, max_steps=total_steps, per_device_train_batch_size=BATCH_SIZE)
    trainer = Trainer(
        model=tiny_classifier(seed=0),
        args=args,
        train_dataset=TinyDataset(size=BATCH_SIZE * total_steps, seed=0),
        callbacks=callbacks,
    )
    # The console printer would print every entry; neither run should pay for that.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    gc.collect()
    trainer.train()
    Trainer.log = _UNHOOKED_TRAINER_LOG
    return timer.median_step_seconds(skip=settings.warmup_steps)


@dataclass(frozen=True)
class StepTimes:
    """Median seconds per step of each run on one clock, in the order the runs ran."""

    with_callback: List[float]
    without_callback: List[float]

    @property
    def ratio(self) -> float:
        """The headline: median run with the callback / median run without."""
        return statistics.median(self.with_callback) / statistics.median(self.without_callback)

    @property
    def paired_ratios(self) -> List[float]:
        """with / without for each interleaved pair, which ran under much the same load."""
        return [a / b for a, b in zip(self.with_callback, self.without_callback)]


def spread(values: List[float]) -> float:
    """Run-to-run noise: the interquartile range over the median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / statistics.median(values)


def compare_step_times(settings: Settings, report: Callable[[str], None]) -> Tuple[StepTimes, StepTimes]:
    """(wall, CPU) step times with and without the callback."""
    runs = {True: [], False: []}  # with the callback? -> [(wall, CPU)] per run
    with tempfile.TemporaryDirectory() as output_dir:
        # Untimed runs of each kind first: lazy imports, the allocator and caches settle.
        for _ in range(settings.warmup_runs):
            for flag in (True, False):
                timed_training_run(flag, settings, output_dir)
        for pair in range(settings.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)  # ABBA
            for flag in order:
                wall, cpu = timed_training_run(flag, settings, output_dir)
                runs[flag].append((wall, cpu))
                label = "with   " if flag else "without"
                report(f"  pair {pair + 1:>2} {label} callback: median step {wall * 1e3:.4f} ms wall, "
                       f"{cpu * 1e3:.4f} ms CPU")
    wall, cpu = (StepTimes(with_callback=[run[clock] for run in runs[True]],
                           without_callback=[run[clock] for run in runs[False]]) for clock in (0, 1))
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


# -- the command ---------------------------------------------------------------------------------


def verdict(holds: bool) -> str:
    return "target met" if holds else "target NOT met"


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    result.add_argument("--quick", action="store_true", help="a short smoke run; its numbers mean little")
    result.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    return result


def command(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads}: expected a positive number of threads")
    settings = Settings.quick(args.threads) if args.quick else Settings.full(args.threads)
    torch.set_num_threads(settings.threads)
    model = tiny_classifier(seed=0)
    print("Inputs")
    print(f"  python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}{', QUICK run' if args.quick else ''}")
    print(f"  (a) tiny DistilBERT from tests/helpers.py: {sum(p.numel() for p in model.parameters()):,} parameters "
          f"in {len(list(model.parameters()))} tensors; Trainer on the CPU, batch {BATCH_SIZE}, logging_steps=1, "
          f"report_to=[], default optimizer")
    print(f"      {settings.pairs} runs with the callback and {settings.pairs} without, interleaved ABBA; per run "
          f"{settings.warmup_steps} warm-up steps, then {settings.steps} timed steps")
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
        print(f"  {title}: {times.ratio:.4f} (median with {statistics.median(times.with_callback) * 1e3:.4f} ms, "
              f"without {statistics.median(times.without_callback) * 1e3:.4f} ms; paired ratios "
              f"{min(times.paired_ratios):.4f}..{max(times.paired_ratios):.4f}; run-to-run spread "
              f"{spread(times.with_callback):.1%} with, {spread(times.without_callback):.1%} without) "
              f"-> {verdict(times.ratio <= STEP_RATIO_TARGET)} (<= {STEP_RATIO_TARGET})")
    print(f"  (b) naive / measure_optimizer_state: {measuring.ratio:.0f}x "
          f"-> {verdict(measuring.ratio >= MEASURE_SPEEDUP_TARGET)} (>= {MEASURE_SPEEDUP_TARGET:.0f}x)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
