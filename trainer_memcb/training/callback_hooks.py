"""What the callback does when the hooks on the Trainer's methods call it: an evaluation loop
starts or ends, `train()` returns or raises. Moved out of `callback.py`."""

from __future__ import annotations

import weakref
from typing import Any, Optional

from transformers.utils import logging

from trainer_memcb.training.callback_measuring import _Run
from trainer_memcb.training.evaluation_probe import EvaluationProbe
from trainer_memcb.training.oom_report import (
    OUT_OF_MEMORY_ERRORS,
    allocator_state,
    cuda_device_of,
    oom_report_path,
    oom_report_text,
    write_oom_report,
)
from trainer_memcb.utils.compiled import is_compiled

# The callback's own logger, as before its parts had modules of their own: the name users configure.
logger = logging.get_logger(f"{__package__}.callback")


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


class _HookEventsPart:
    """The callback's answers to the hooks on the Trainer's methods."""

    def evaluation_loop_started(self, trainer: Any, prefix: str) -> None:
        """Called by the hook on `Trainer.evaluation_loop` as a loop starts: arm a probe for it."""
        if not self.evaluation:
            return
        try:
            probe = EvaluationProbe(lambda kind, message: self._warn_once(kind, message))
            self._loops.append(_Loop(trainer, prefix, probe))
            probe.arm(getattr(trainer, "model", None), prefix, compiled=_runs_compiled(trainer))  # never raises
        except Exception as error:  # never break an evaluation over a figure
            self._warn_once("evaluation", f"measuring the evaluation failed ({error!r}); its figures are left out")

    def evaluation_loop_ended(self, trainer: Any, prefix: str, failed: bool) -> None:
        """Called by the hook as that loop ends, returning or raising: disarm, remove every wrapper,
        and keep its figures for its Trainer's entry."""
        for index in range(len(self._loops) - 1, -1, -1):  # the innermost loop of this Trainer
            loop = self._loops[index]
            if loop.trainer() is trainer and loop.prefix == prefix:
                del self._loops[index]
                loop.probe.disarm(failed)
                figures = loop.probe.take(prefix)
                if figures:
                    try:
                        self._evaluations.setdefault(trainer, {})[prefix] = figures
                    except TypeError:  # a Trainer that cannot be held weakly: its figures are left out
                        pass
                return

    def _end_loops(self, model: Any) -> None:
        """Disarm the loops still under way on `model` (None: every loop), keeping no figures."""
        for loop in [loop for loop in self._loops if model is None or getattr(loop.trainer(), "model", None) is model]:
            self._loops.remove(loop)
            loop.probe.disarm(failed=True)

    def after_train(self, trainer: Any, error: Optional[BaseException] = None) -> None:
        """Called by the hook on `Trainer.train` as it returns or raises `error`: a step that raised
        (an out-of-memory error in backward, say) left its activations wrapper, the step plan's
        batch hook and, under ZeRO-1/2, the step tap installed; they are removed now. After
        `on_train_end` nothing is left to remove. An out-of-memory error gets its report
        (`trainer_memcb.training.oom_report`); `error` itself is only read."""
        run = None
        try:
            optimizer = getattr(trainer, "optimizer", None)
            run = self._runs.get(optimizer) if optimizer is not None else None
            if run is not None:  # else it never began, or it ended and was released
                if run is self._current:
                    self._current = None
                self._uninstall(run)
        except Exception as failure:  # never break training, nor hide its own error
            self._warn_once("cleanup", f"removing what a step installed failed ({failure!r})")
        if isinstance(error, OUT_OF_MEMORY_ERRORS):
            self._report_out_of_memory(trainer, run, error)

    def _report_out_of_memory(self, trainer: Any, run: Optional[_Run], error: BaseException) -> None:
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
            self._warn_once("oom-report", f"writing the out-of-memory report failed ({failure!r})")
