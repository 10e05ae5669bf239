"""What `OptimizerMemoryCallback` costs, and what measuring from metadata saves.

Prints, in one run:

(a) the training-step time of a real `transformers.Trainer` (CPU, `logging_steps=1`,
    `report_to=[]`) with and without `OptimizerMemoryCallback`, as the ratio with / without,
    target at most 1.01, for two models built from configs, side by side: the tests' tiny
    DistilBERT (3,714 parameters: a step that is almost all framework overhead, the worst case),
    and a small DistilBERT (distilbert-base-cased's config cut to dim 256 and 2 layers, sequences
    of 128 tokens, batch 8: a step that does real work on every tensor).
(b) one measurement of distilbert-base-cased's AdamW state (architecture from the config shipped
    in `examples/models/`, state made by one real AdamW step) by `measure_optimizer_state`,
    against two others: the floor, a bare loop that only reads each state tensor's
    `untyped_storage().nbytes()`, as the ratio ours / floor (target at most 2); and a naive method
    that copies every state value to read its size, as the ratio naive / ours (target at least
    600). Each side is the fastest of its rounds (a busy machine only adds time); ours and the
    floor take turns round by round. The floor ratio is also printed for the states that live
    elsewhere (GrokAdamW's param groups, bitsandbytes' 8-bit states and shared maps), on the small
    model below, when those libraries are installed.

Fairness: fixed threads and seeds; warm-up steps and calls that are not timed; in (a), medians.
With and without the callback alternate step by step inside each training run, in ABBA order (the
callback is added to and removed from the Trainer between steps), so that the machine's load, which
drifts over seconds, falls on both sides alike: whole runs with and without, alternated, differed
by 15-80% from run to run on a busy 2-core machine, far above the 1% to be resolved. A step is
timed from its `on_step_begin` to the next one (data, forward, backward, optimizer step, every
callback's work and the log entry fall inside), on two clocks: the wall clock (`time.perf_counter`,
the target's measure) and this process's CPU time (`time.process_time`). Each run gives its median
steps with and without, and its ratio: the median, over its ABBA blocks of 4 steps, of the block's
steps with over its steps without (a block's two sides sit symmetrically around its middle, so
steady drift cancels out: the small model's step times vary by about 17% here, slowly). The
headline is the median over runs, and the spread of the runs' ratios shows the noise. Beside it,
the callback's own work (its `on_step_begin`, its `on_pre_optimizer_step`, its `on_step_end`, its contribution to the log entry, its `on_log`) is
timed inside the same runs: a lower bound on its cost that a long step's noise does not hide.
The callback measures the activations at every step in (a) (its default, `logging_steps=1`): on
the small model the ratio is also held to 1.02, the activations' target. (c) isolates them: the
small model with the callback in every step, measuring the activations in half of them (its
`activations` option switched step by step, ABBA), as the ratio with / without, target at most 1.02.
(d) `Trainer.evaluate()` on the small model (64 samples in batches of 8, `compute_metrics` given, so
that the loop gathers every batch's logits and labels), with the callback measuring what the
evaluation holds or not (its `evaluation` switch, ABBA evaluation by evaluation), as the ratio of
the median block, target at most 1.01. The side without measuring still passes through the hook on
`Trainer.evaluation_loop`, which then only finds nothing armed.
`--quick` is a smoke run whose numbers mean little.

    python benchmarks/overhead.py            # the full benchmark, about four minutes on 2 cores
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
from trainer_memcb.utils.units import format_bytes  # noqa: E402

STEP_RATIO_TARGET = 1.01  # (a): with / without the callback, at most
# (a) on the small model, with the callback measuring the activations too (its default), at most;
# and (c): the callback measuring the activations / the callback not measuring them, at most.
ACTIVATIONS_STEP_RATIO_TARGET = 1.02
MEASURE_SPEEDUP_TARGET = 600.0  # (b): naive / measure_optimizer_state, at least
FLOOR_RATIO_TARGET = 2.0  # (b): measure_optimizer_state / the bare loop over the state's storages, at most
EVALUATE_RATIO_TARGET = 1.01  # (d): evaluate() measured / not measured, at most
EVAL_SAMPLES = 64

DISTILBERT_CONFIG_DIR = os.path.join(REPO_ROOT, "examples", "models", "distilbert-base-cased")

# `Trainer.log` as transformers ships it, before the callback's hook wraps it: the steps without
# the callback put it back, so that they pay nothing of the callback's, not even the hook.
_UNHOOKED_TRAINER_LOG = Trainer.log


@dataclass(frozen=True)
class RunLengths:
    runs: int  # training runs, each alternating steps with and without the callback
    steps: int  # timed steps per run, half of them with the callback
    warmup_steps: int  # steps per run before the timed ones, alternating too; a multiple of 4 (ABBA)


@dataclass(frozen=True)
class Settings:
    threads: int
    tiny: RunLengths  # (a) on the tiny model: steps of 7-30 ms
    small: RunLengths  # (a) on the small model: steps of about 300 ms, so fewer of them
    measure_rounds: int  # (b): rounds of measure_optimizer_state and of the bare loop, taking turns
    measure_calls: int  # (b): calls per round
    naive_calls: int  # (b): timed calls of the naive method (each copies the whole state), one a round
    eval_blocks: int = 8  # (d): ABBA blocks of 4 evaluate() calls

    @classmethod
    def full(cls, threads: int) -> "Settings":
        return cls(threads=threads, tiny=RunLengths(runs=8, steps=600, warmup_steps=40),
                   small=RunLengths(runs=4, steps=120, warmup_steps=8), measure_rounds=100, measure_calls=10,
                   naive_calls=5)

    @classmethod
    def quick(cls, threads: int) -> "Settings":
        return cls(threads=threads, tiny=RunLengths(runs=1, steps=16, warmup_steps=4),
                   small=RunLengths(runs=1, steps=8, warmup_steps=4), measure_rounds=3, measure_calls=2,
                   naive_calls=1, eval_blocks=1)


# -- the two models ------------------------------------------------------------------------------


class RandomSequences(torch.utils.data.Dataset):
    """`size` sequences of `length` random token ids below `vocab_size`, each with a random binary
    label: what a step costs does not depend on what the data mean."""

    def __init__(self, size: int, length: int, vocab_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (size, length), generator=generator)
        self.labels = torch.randint(0, 2, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def small_classifier() -> torch.nn.Module:
    """distilbert-base-cased's config (its whole vocabulary) cut to dim 256, 2 layers, 4 heads and a
    feed-forward width of 1,024, for 2 labels."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(DISTILBERT_CONFIG_DIR, num_labels=2, dim=256, n_layers=2, n_heads=4,
                                        hidden_dim=1024)
    return AutoModelForSequenceClassification.from_config(config)


@dataclass(frozen=True)
class Workload:
    """A model and its data, trained with and without the callback."""

    name: str  # as the output names it
    description: str
    build_model: Callable[[], torch.nn.Module]
    build_dataset: Callable[[int], torch.utils.data.Dataset]  # number of examples -> dataset
    batch_size: int


SMALL_SEQUENCE_LENGTH = 128
TINY = Workload(
    name="tiny model",
    description="tiny DistilBERT from tests/helpers.py (dim 16, 1 layer, sequences of 8 tokens)",
    build_model=lambda: tiny_classifier(seed=0),
    build_dataset=lambda size: TinyDataset(size=size, seed=0),
    batch_size=4,
)
SMALL = Workload(
    name="small model",
    description=f"small DistilBERT (distilbert-base-cased's config at dim 256, 2 layers, 4 heads, FFN 1,024; "
                f"random sequences of {SMALL_SEQUENCE_LENGTH} tokens)",
    build_model=small_classifier,
    build_dataset=lambda size: RandomSequences(
        size, SMALL_SEQUENCE_LENGTH, vocab_size=AutoConfig.from_pretrained(DISTILBERT_CONFIG_DIR).vocab_size),
    batch_size=8,
)


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

    It also times, on the wall clock, the callback's own work in each step: its
    `on_pre_optimizer_step` (parameters and gradients), its `on_step_end` (the measurement), its
    contribution to the log entry and its `on_log`. That leaves out the
    dispatch of its events and what its work does to the caches of the rest of the step, so it is a
    lower bound on what the callback costs; on a long step it is the figure the step times cannot
    resolve.
    """

    OWN_WORK = ("on_step_begin", "on_pre_optimizer_step", "on_step_end", "contribute_to_trainer_log", "on_log")

    def __init__(self, callback: OptimizerMemoryCallback, toggle: str = "callback") -> None:
        self.callback = callback
        # "callback": the callback is in the Trainer or not; "activations": it is always in, and
        # measures the activations or not (its `activations` option, read at each step's begin).
        self.toggle = toggle
        self.handler: Any = None  # the Trainer's callback handler, set once the Trainer exists
        self.hooked_log = Trainer.log  # the callback installed its hook when it was made
        self.wall_starts: List[float] = []
        self.cpu_starts: List[float] = []
        self.own_seconds: Dict[int, float] = {}  # step index -> seconds in the callback's own work
        for name in self.OWN_WORK:  # the Trainer and the log hook look these up on the instance
            setattr(callback, name, self._timed(getattr(callback, name)))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                step = len(self.wall_starts) - 1
                self.own_seconds[step] = self.own_seconds.get(step, 0.0) + time.perf_counter() - start
        return timed

    def own_work_seconds(self, skip: int) -> List[float]:
        """The callback's own seconds in each step with it, after `skip` steps."""
        return [self.own_seconds.get(index, 0.0) for index in range(skip, len(self.wall_starts) - 1)
                if with_callback_at(index)]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wanted = with_callback_at(len(self.wall_starts))
        if self.toggle == "activations":
            self.callback.activations = wanted
        elif wanted != (self.callback in self.handler.callbacks):
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

    def abba_blocks(self, skip: int) -> Dict[str, List[Tuple[float, float]]]:
        """{clock: [(with / without, seconds the callback adds to a step) of each ABBA block]}.

        A block is 4 steps (with, without, without, with) from the first block start after
        `skip` steps. Its two sides sit symmetrically around its middle, so a load that drifts
        steadily across the block falls on both alike.
        """
        blocks: Dict[str, List[Tuple[float, float]]] = {"wall": [], "cpu": []}
        first = -(-skip // 4) * 4
        for start in range(first, len(self.wall_starts) - 4, 4):
            for clock, starts in (("wall", self.wall_starts), ("cpu", self.cpu_starts)):
                with_seconds = starts[start + 1] - starts[start] + starts[start + 4] - starts[start + 3]
                without_seconds = starts[start + 3] - starts[start + 1]
                blocks[clock].append((with_seconds / without_seconds, (with_seconds - without_seconds) / 2))
        return blocks


@dataclass(frozen=True)
class ClockTimes:
    """One run on one clock: median step with and without the callback, and the paired figures."""

    median_with: float  # seconds
    median_without: float  # seconds
    num_blocks: int  # ABBA blocks timed
    block_ratio: float  # the median over ABBA blocks of with / without
    block_added: float  # the median over ABBA blocks of the seconds the callback adds to a step


@dataclass(frozen=True)
class RunTimes:
    wall: ClockTimes
    cpu: ClockTimes
    own_work: float  # the median step's seconds in the callback's own work (wall clock)


def timed_training_run(workload: Workload, lengths: RunLengths, output_dir: str, toggle: str = "callback") -> RunTimes:
    """One `trainer.train()` of `workload`, alternating steps with and without the callback (or,
    with `toggle="activations"`, with the callback measuring the activations and not)."""
    Trainer.log = _UNHOOKED_TRAINER_LOG
    timer = AlternatingStepTimer(OptimizerMemoryCallback(), toggle)  # present from the start: step 0 is "with"
    # One step more than timed: the last step has no next `on_step_begin` to end it.
    total_steps = lengths.warmup_steps + lengths.steps + 1
    args = training_args(output_dir, max_steps=total_steps, per_device_train_batch_size=workload.batch_size)
    trainer = Trainer(
        model=workload.build_model(),
        args=args,
        train_dataset=workload.build_dataset(workload.batch_size * total_steps),
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
    steps = timer.step_seconds(skip=lengths.warmup_steps)
    blocks = timer.abba_blocks(skip=lengths.warmup_steps)
    times = {}
    for index, clock in enumerate(("wall", "cpu")):
        ratios, added = zip(*blocks[clock])
        times[clock] = ClockTimes(
            median_with=statistics.median(steps[True][index]),
            median_without=statistics.median(steps[False][index]),
            num_blocks=len(ratios),
            block_ratio=statistics.median(ratios),
            block_added=statistics.median(added),
        )
    return RunTimes(wall=times["wall"], cpu=times["cpu"],
                    own_work=statistics.median(timer.own_work_seconds(skip=lengths.warmup_steps)))


@dataclass(frozen=True)
class StepRatio:
    """with / without the callback on one clock, over runs."""

    runs: List[ClockTimes]

    @property
    def run_ratios(self) -> List[float]:
        return [run.block_ratio for run in self.runs]

    @property
    def ratio(self) -> float:
        """The headline: the median over runs of each run's median over its ABBA blocks."""
        return statistics.median(self.run_ratios)

    @property
    def added_seconds(self) -> float:
        """What the callback adds to a logged step, likewise."""
        return statistics.median(run.block_added for run in self.runs)

    @property
    def step_seconds(self) -> float:
        """A step without the callback: the median over runs of each run's median."""
        return statistics.median(run.median_without for run in self.runs)


def compare_step_times(workload: Workload, lengths: RunLengths, run_label: str,
                       report: Callable[[str], None], toggle: str = "callback") -> Tuple[StepRatio, StepRatio, float]:
    """(wall, CPU) step-time ratios with / without the callback (or its activations, with
    `toggle="activations"`), and the median over runs of the callback's own seconds in a step;
    each run reported as `  run  1{run_label}: ...`."""
    runs: List[RunTimes] = []
    with tempfile.TemporaryDirectory() as output_dir:
        for index in range(lengths.runs):
            run = timed_training_run(workload, lengths, output_dir, toggle)
            runs.append(run)
            wall, cpu = run.wall, run.cpu
            report(f"  run {index + 1:>2}{run_label}: median step with / without callback: "
                   f"wall {wall.median_with * 1e3:.4f} / {wall.median_without * 1e3:.4f} ms = "
                   f"{wall.median_with / wall.median_without:.4f}; "
                   f"CPU {cpu.median_with * 1e3:.4f} / {cpu.median_without * 1e3:.4f} ms = "
                   f"{cpu.median_with / cpu.median_without:.4f}")
            report(f"          median over its {wall.num_blocks} ABBA blocks of with / without: "
                   f"wall {wall.block_ratio:.4f}, CPU {cpu.block_ratio:.4f}; the callback's own work "
                   f"{run.own_work * 1e3:.4f} ms a step")
    own_work = statistics.median(run.own_work for run in runs)
    return StepRatio([run.wall for run in runs]), StepRatio([run.cpu for run in runs]), own_work


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


def bare_loop_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The floor: a loop that only reads each state tensor's storage size, the least any Python
    reader of the state must do. It counts a storage held twice twice, and gives no breakdown."""
    total = 0
    for param_state in optimizer.state.values():
        for value in param_state.values():
            total += value.untyped_storage().nbytes()
    return total


def bare_loop_at(location: Callable[[Any], Any]) -> Callable[[Any], int]:
    """The floor for a state kept elsewhere: the same loop over `location(optimizer)`, passing over
    values that are not tensors (a plain-int `step`)."""
    def loop(optimizer: Any) -> int:
        total = 0
        for param_state in location(optimizer):
            for value in param_state.values():
                if type(value) is torch.Tensor:
                    total += value.untyped_storage().nbytes()
        return total
    return loop


def fastest_call_seconds(functions: Sequence[Callable[[], Any]], rounds: int, calls: int,
                         warmup: int) -> Tuple[List[float], List[Any]]:
    """Per function, the fastest round's wall-clock seconds per call, over `rounds` rounds of
    `calls` calls after `warmup` untimed calls, and its last result. The functions take turns
    round by round, so that the machine's load falls on each alike. The minimum, not the median:
    a busy machine only ever adds time, so the fastest round is the nearest to the cost itself."""
    results = []
    for function in functions:
        for _ in range(warmup):
            function()
        results.append(function())
    gc.collect()
    fastest = [float("inf")] * len(functions)
    for _ in range(rounds):
        for index, function in enumerate(functions):
            start = time.perf_counter()
            for _ in range(calls):
                function()
            fastest[index] = min(fastest[index], (time.perf_counter() - start) / calls)
    return fastest, results


@dataclass(frozen=True)
class MeasureTimes:
    ours_seconds: float
    floor_seconds: float
    naive_seconds: float
    ours_bytes: int
    floor_bytes: int
    naive_bytes: int
    num_state_tensors: int
    num_params: int

    @property
    def ratio(self) -> float:  # naive / ours: what measuring from metadata saves
        return self.naive_seconds / self.ours_seconds

    @property
    def floor_ratio(self) -> float:  # ours / the bare loop: what measuring costs above the least
        return self.ours_seconds / self.floor_seconds


def compare_measuring(settings: Settings) -> MeasureTimes:
    optimizer = distilbert_adamw()
    (ours, floor), (measured, floor_bytes) = fastest_call_seconds(
        [lambda: measure_optimizer_state(optimizer), lambda: bare_loop_bytes(optimizer)],
        settings.measure_rounds, settings.measure_calls, warmup=10)
    (naive,), (naive_bytes,) = fastest_call_seconds([lambda: naive_state_bytes(optimizer)], settings.naive_calls, 1,
                                                    warmup=1)
    return MeasureTimes(
        ours_seconds=ours,
        floor_seconds=floor,
        naive_seconds=naive,
        ours_bytes=measured.num_bytes,
        floor_bytes=floor_bytes,
        naive_bytes=naive_bytes,
        num_state_tensors=measured.num_tensors,
        num_params=sum(p.numel() for group in optimizer.param_groups for p in group["params"]),
    )


@dataclass(frozen=True)
class LocationTimes:
    name: str
    ours_seconds: float
    floor_seconds: float
    num_bytes: int
    num_state_tensors: int

    @property
    def floor_ratio(self) -> float:
        return self.ours_seconds / self.floor_seconds


def state_locations() -> List[Tuple[str, Callable[[Any], Any], Callable[[Any], Any]]]:
    """(name, optimizer on given parameters, where its state lives) for the installed libraries
    whose optimizers keep their state outside `optimizer.state`, or beside it."""
    found: List[Tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = []
    try:
        import grokadamw

        from trainer_memcb.state.rules.grokadamw_optim import grokadamw_state
    except ImportError:
        pass
    else:
        found.append(("GrokAdamW (its state in its param groups)",
                      lambda params: grokadamw.GrokAdamW(params, lr=1e-5), grokadamw_state))
    try:
        import bitsandbytes

        from trainer_memcb.state.rules.bitsandbytes_optim import bitsandbytes_state
    except ImportError:
        pass
    else:
        found.append(("bitsandbytes AdamW8bit (8-bit and 32-bit states, shared qmaps)",
                      lambda params: bitsandbytes.optim.AdamW8bit(params, lr=1e-5), bitsandbytes_state))
    return found


def compare_state_locations(settings: Settings) -> List[LocationTimes]:
    """The floor ratio on the small model's state after one step, for each of `state_locations`."""
    found = []
    for name, build, location in state_locations():
        model = small_classifier()
        optimizer = build(model.parameters())
        model(input_ids=torch.randint(1000, 2000, (2, 16)), labels=torch.tensor([0, 1])).loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        floor_loop = bare_loop_at(location)
        (ours, floor), (measured, _) = fastest_call_seconds(
            [lambda: measure_optimizer_state(optimizer), lambda: floor_loop(optimizer)],
            settings.measure_rounds, settings.measure_calls, warmup=10)
        found.append(LocationTimes(name=name, ours_seconds=ours, floor_seconds=floor, num_bytes=measured.num_bytes,
                                   num_state_tensors=measured.num_tensors))
        del model, optimizer
    return found


# -- where the callback's time goes ------------------------------------------------------------


def profile_callback(settings: Settings) -> str:
    """cProfile over one run of the tiny model with the callback in every step: the package's functions, by
    cumulative time. cProfile slows Python code several-fold, so read the shares, not the times."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory() as output_dir:
        Trainer.log = _UNHOOKED_TRAINER_LOG
        total_steps = settings.tiny.warmup_steps + settings.tiny.steps
        trainer = Trainer(
            model=TINY.build_model(),
            args=training_args(output_dir, max_steps=total_steps, per_device_train_batch_size=TINY.batch_size),
            train_dataset=TINY.build_dataset(TINY.batch_size * total_steps),
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


# -- (d) evaluate() with and without measuring what it holds -----------------------------------


def _accuracy(prediction: Any) -> Dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def compare_evaluate_times(settings: Settings) -> Tuple[float, List[float], float, float]:
    """The median over ABBA blocks of the block's evaluate() seconds measured / not measured, the
    blocks' ratios, and the median seconds of an evaluate() measured and not."""
    callback = OptimizerMemoryCallback(what_if=(), summary_file=None)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(model=SMALL.build_model(), args=training_args(output_dir, per_device_eval_batch_size=8),
                          eval_dataset=SMALL.build_dataset(EVAL_SAMPLES), compute_metrics=_accuracy,
                          callbacks=[callback])
        for quiet in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(quiet)
        times: Dict[bool, List[float]] = {True: [], False: []}
        ratios = []
        for block in range(settings.eval_blocks + 1):  # the first block warms up, untimed
            block_times: Dict[bool, float] = {True: 0.0, False: 0.0}
            for measured in (True, False, False, True):
                callback.evaluation = measured
                start = time.perf_counter()
                trainer.evaluate()
                block_times[measured] += time.perf_counter() - start
                if block:
                    times[measured].append(time.perf_counter() - start)
            if block:
                ratios.append(block_times[True] / block_times[False])
        callback.evaluation = True
    return statistics.median(ratios), ratios, statistics.median(times[True]), statistics.median(times[False])


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
    print("Inputs")
    print(f"  python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}{', QUICK run' if args.quick else ''}")
    print("  (a) Trainer on the CPU, logging_steps=1, report_to=[], the default optimizer (AdamW: 3 state tensors "
          "per parameter tensor); with and without the callback alternating ABBA step by step")
    for workload, lengths in ((TINY, settings.tiny), (SMALL, settings.small)):
        model = workload.build_model()
        print(f"      {workload.name}: {workload.description}: {sum(p.numel() for p in model.parameters()):,} "
              f"parameters in {len(list(model.parameters()))} tensors, batch {workload.batch_size}; {lengths.runs} runs "
              f"of {lengths.warmup_steps} warm-up steps, then {lengths.steps} timed steps")
    del model
    print(f"  (b) distilbert-base-cased (examples/models/distilbert-base-cased/config.json, num_labels=2), "
          f"one torch.optim.AdamW step; measure_optimizer_state and the bare loop taking turns in "
          f"{settings.measure_rounds} rounds of {settings.measure_calls} calls, {settings.naive_calls} calls of the "
          f"naive copy; the fastest round of each")
    print(f"      and the state of each optimizer that keeps it elsewhere, on the small model after one step: "
          f"{', '.join(name for name, _, _ in state_locations()) or 'none installed'}")
    sys.stdout.flush()

    step_ratios = {}
    for workload, lengths, run_label in ((TINY, settings.tiny, ""), (SMALL, settings.small, f", {SMALL.name}")):
        print(f"(a) training step, {workload.name}")
        step_ratios[workload.name] = compare_step_times(workload, lengths, run_label,
                                                        report=lambda line: print(line, flush=True))
    print(f"(c) training step, {SMALL.name}, the callback in every step, measuring the activations or not")
    activations_ratios = compare_step_times(SMALL, settings.small, f", {SMALL.name}",
                                            report=lambda line: print(line, flush=True), toggle="activations")
    print(f"(d) evaluate(), {SMALL.name}, {EVAL_SAMPLES} samples in batches of 8, measuring what it holds or not")
    evaluate_ratio, evaluate_ratios, measured_seconds, plain_seconds = compare_evaluate_times(settings)
    print("(b) measuring the state")
    measuring = compare_measuring(settings)
    print(f"  state: {measuring.num_params:,} parameters, {measuring.num_state_tensors} state tensors; "
          f"measure_optimizer_state {measuring.ours_bytes:,} bytes ({format_bytes(measuring.ours_bytes)}), "
          f"naive {measuring.naive_bytes:,} bytes, bare loop {measuring.floor_bytes:,} bytes")
    print(f"  measure_optimizer_state: fastest {measuring.ours_seconds * 1e6:.1f} us per call")
    print(f"  bare loop (the floor):   fastest {measuring.floor_seconds * 1e6:.1f} us per call")
    print(f"  naive copy:              fastest {measuring.naive_seconds * 1e3:.1f} ms per call")
    locations = compare_state_locations(settings)
    for location in locations:
        print(f"  {location.name}: {location.num_state_tensors} state tensors, {location.num_bytes:,} bytes; "
              f"measure_optimizer_state fastest {location.ours_seconds * 1e6:.1f} us, bare loop "
              f"{location.floor_seconds * 1e6:.1f} us per call")

    print("Results")
    for name, title in ((TINY.name, "(a) step time with / without callback"),
                        (SMALL.name, f"(a) {SMALL.name}, step time with / without callback")):
        wall, cpu, own_work = step_ratios[name]
        for line_title, times in ((title, wall), ("    same, in CPU time", cpu)):
            print(f"  {line_title}: {times.ratio:.4f} ({name}; median over {len(times.run_ratios)} runs; runs' ratios "
                  f"{min(times.run_ratios):.4f}..{max(times.run_ratios):.4f}; adds {times.added_seconds * 1e3:.4f} ms "
                  f"to a step of {times.step_seconds * 1e3:.1f} ms) "
                  f"-> {verdict(times.ratio <= STEP_RATIO_TARGET)} (<= {STEP_RATIO_TARGET})")
        print(f"      the callback's own work, timed around its hooks: {own_work * 1e3:.4f} ms a step, as a ratio "
              f"{1 + own_work / wall.step_seconds:.4f} (a lower bound on the ratio above)")
        if name == SMALL.name:  # the callback measures the activations at every step here (logging_steps=1)
            print(f"      with the activations measured (the callback's default): {wall.ratio:.4f} "
                  f"-> {verdict(wall.ratio <= ACTIVATIONS_STEP_RATIO_TARGET)} (<= {ACTIVATIONS_STEP_RATIO_TARGET})")
    wall, cpu, _ = activations_ratios
    for line_title, times in (("(c) small model, step time with / without measuring the activations", wall),
                              ("    same, in CPU time", cpu)):
        print(f"  {line_title}: {times.ratio:.4f} (median over {len(times.run_ratios)} runs; runs' ratios "
              f"{min(times.run_ratios):.4f}..{max(times.run_ratios):.4f}; adds {times.added_seconds * 1e3:.4f} ms "
              f"to a step of {times.step_seconds * 1e3:.1f} ms) "
              f"-> {verdict(times.ratio <= ACTIVATIONS_STEP_RATIO_TARGET)} (<= {ACTIVATIONS_STEP_RATIO_TARGET})")
    print(f"  (d) evaluate() time measured / not measured: {evaluate_ratio:.4f} (median over {len(evaluate_ratios)} "
          f"ABBA blocks; blocks' ratios {min(evaluate_ratios):.4f}..{max(evaluate_ratios):.4f}; an evaluate() "
          f"{measured_seconds * 1e3:.1f} ms measured, {plain_seconds * 1e3:.1f} ms not) "
          f"-> {verdict(evaluate_ratio <= EVALUATE_RATIO_TARGET)} (<= {EVALUATE_RATIO_TARGET})")
    print(f"  (b) naive / measure_optimizer_state: {measuring.ratio:.0f}x "
          f"-> {verdict(measuring.ratio >= MEASURE_SPEEDUP_TARGET)} (>= {MEASURE_SPEEDUP_TARGET:.0f}x)")
    print(f"  (b) measure_optimizer_state / bare loop: {measuring.floor_ratio:.2f}x "
          f"-> {verdict(measuring.floor_ratio <= FLOOR_RATIO_TARGET)} (<= {FLOOR_RATIO_TARGET:.0f}x)")
    for location in locations:
        print(f"      {location.name}: {location.floor_ratio:.2f}x "
              f"-> {verdict(location.floor_ratio <= FLOOR_RATIO_TARGET)} (<= {FLOOR_RATIO_TARGET:.0f}x)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
