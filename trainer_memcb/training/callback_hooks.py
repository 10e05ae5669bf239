"""The callback's hooks on the Trainer's methods: the one installer, and what they call it for.

A callback is never handed the Trainer, so what it needs of a Trainer's own calls is a hook on the
class's method (`trainer_method_hook.py`): `Trainer.log` (`trainer_log_hook.py`: the figures go
into the entry), `Trainer.train` (`trainer_train_hook.py`: told when `train()` returns or raises)
and `Trainer.evaluation_loop` (`evaluation_hook.py`: told when a loop starts and ends).
`install_trainer_hooks` installs the ones a callback needs; a `HookedCallback` is asked by all
three. The hooks themselves stay for the process; what a step or a loop installs on the user's
objects is removed on every way out: `train()` returning or raising (`Runs.leave`), a loop
returning or raising (`EvaluationLoops.ended`), a nested Trainer's loop (innermost first).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

from transformers.utils import logging

from trainer_memcb.training.callback_measuring import Run
from trainer_memcb.training.evaluation_hook import EvaluationWatcher, install_evaluation_hook
from trainer_memcb.training.evaluation_probe import EvaluationProbe
from trainer_memcb.training.oom_report import (
    allocator_state,
    cuda_device_of,
    oom_report_path,
    oom_report_text,
    write_oom_report,
)
from trainer_memcb.training.phase_judgement import largest_evaluation
from trainer_memcb.training.trainer_log_hook import LogContributor, install_log_hook
from trainer_memcb.training.trainer_train_hook import TrainExitListener, install_train_hook
from trainer_memcb.utils.compiled import is_compiled

__all__ = ["EvaluationLoops", "HookedCallback", "check_evaluation", "install_trainer_hooks", "report_out_of_memory"]

# The callback's own logger, as before its parts had modules of their own: the name users configure.
logger = logging.get_logger(f"{__package__}.callback")


class HookedCallback(LogContributor, EvaluationWatcher, TrainExitListener):
    """The base class of a callback that the hooks on `Trainer.log`, `Trainer.train` and
    `Trainer.evaluation_loop` call; every method must never raise."""

    __slots__ = ()


def install_trainer_hooks(evaluation: bool) -> None:
    """Install the hooks a `HookedCallback` needs: on `Trainer.log` and `Trainer.train` always, on
    `Trainer.evaluation_loop` when it measures evaluations. Each is installed once per process."""
    install_log_hook()
    install_train_hook()
    if evaluation:
        install_evaluation_hook()


def check_evaluation(evaluation: bool) -> bool:
    """`evaluation` if it is a bool; else a `ValueError`."""
    if not isinstance(evaluation, bool):
        raise ValueError(f"evaluation={evaluation!r}: expected True (measure what each evaluation holds) or "
                         "False (do not)")
    return evaluation


class _Loop:
    """An evaluation loop under way: its Trainer (weakly), its prefix, and the probe measuring it."""

    __slots__ = ("trainer", "prefix", "probe")

    def __init__(self, trainer: Any, prefix: str, probe: EvaluationProbe) -> None:
        self.trainer = weakref.ref(trainer)
        self.prefix = prefix
        self.probe = probe


def _runs_compiled(trainer: Any) -> bool:
    """Whether `trainer` runs its model compiled where the callback is not handed the compiled module:
    the Trainer's own `torch_compile` compiles a wrapper (`model_wrapped`), not `trainer.model`."""
    return bool(getattr(getattr(trainer, "args", None), "torch_compile", False)) or \
        is_compiled(getattr(trainer, "model_wrapped", None))


class EvaluationLoops:
    """The evaluation loops under way and the figures of those finished, for the callback.

    Args: `enabled` (the callback's `evaluation`: False measures none) and `warn` (warn once per
    kind of fault).
    """

    def __init__(self, enabled: bool, warn: Callable[[str, str], None]) -> None:
        self.enabled, self._warn = enabled, warn
        # The evaluation loops under way, innermost last: one probe each, so that a loop run inside
        # another (a `compute_metrics` that evaluates a second Trainer) leaves the outer one's alone.
        self.loops: List[_Loop] = []
        # The figures of each finished loop, by its Trainer (held weakly) and prefix, until its entry.
        self._finished: "weakref.WeakKeyDictionary[Any, Dict[str, Dict[str, int]]]" = weakref.WeakKeyDictionary()
        # The evaluation that held the most since training began, every figure (for the summary).
        self.largest: Dict[str, int] = {}

    def started(self, trainer: Any, prefix: str) -> None:
        """Called by the hook on `Trainer.evaluation_loop` as a loop starts: arm a probe for it."""
        if not self.enabled:
            return
        try:
            probe = EvaluationProbe(lambda kind, message: self._warn(kind, message))
            self.loops.append(_Loop(trainer, prefix, probe))
            probe.arm(getattr(trainer, "model", None), prefix, compiled=_runs_compiled(trainer))  # never raises
        except Exception as error:  # never break an evaluation over a figure
            self._warn("evaluation", f"measuring the evaluation failed ({error!r}); its figures are left out")

    def ended(self, trainer: Any, prefix: str, failed: bool) -> None:
        """Called by the hook as that loop ends, returning or raising: disarm, remove every wrapper,
        and keep its figures for its Trainer's entry."""
        for index in range(len(self.loops) - 1, -1, -1):  # the innermost loop of this Trainer
            loop = self.loops[index]
            if loop.trainer() is trainer and loop.prefix == prefix:
                del self.loops[index]
                loop.probe.disarm(failed)
                figures = loop.probe.take(prefix)
                if figures:
                    try:
                        self._finished.setdefault(trainer, {})[prefix] = figures
                    except TypeError:  # a Trainer that cannot be held weakly: its figures are left out
                        pass
                return

    def end(self, model: Any) -> None:
        """Disarm the loops still under way on `model` (None: every loop), keeping no figures."""
        for loop in [loop for loop in self.loops if model is None or getattr(loop.trainer(), "model", None) is model]:
            self.loops.remove(loop)
            loop.probe.disarm(failed=True)

    def take(self, trainer: Any, prefix: str) -> Dict[str, int]:
        """The figures of `trainer`'s finished loop whose metrics take `prefix`, unprefixed, once
        (`{}` if none); the largest evaluation so far counts them."""
        try:
            finished = self._finished.get(trainer)
        except TypeError:  # a Trainer that cannot be held weakly had none kept
            finished = None
        measured = finished.pop(prefix, {}) if finished else {}
        if measured:
            self.largest = largest_evaluation([self.largest, measured])
        return measured


def report_out_of_memory(trainer: Any, run: Optional[Run], error: BaseException,
                         warn: Callable[[str, str], None]) -> None:
    """Write the out-of-memory report to the run's `output_dir`; never raises."""
    try:
        args, model = trainer.args, getattr(trainer, "model", None)
        plan = run.step_plan.plan_if_ready(model, args) if run is not None else None
        no_plan = run.step_plan.left_out if run is not None else "not made (no step began)"
        device = cuda_device_of(model)
        allocator = allocator_state(device) if device is not None else None
        text = oom_report_text(error, int(getattr(trainer.state, "global_step", 0) or 0), plan, no_plan, device,
                               allocator, "no CUDA device: the model is not on one, and CUDA is not available")
        path = oom_report_path(args.output_dir, int(getattr(args, "process_index", 0) or 0),
                               int(getattr(args, "world_size", 1) or 1))
        write_oom_report(path, text)
        logger.warning(f"trainer_memcb: out of memory; what the plan and the allocator held is in {path}")
    except Exception as failure:  # never hide the run's own error
        warn("oom-report", f"writing the out-of-memory report failed ({failure!r})")
