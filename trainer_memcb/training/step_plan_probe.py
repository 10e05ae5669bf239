"""The step plan of the run's own settings, made once per run, in the run: `StepPlanProbe`.

The callback logs the plan's figures beside what the device measured, so that a user reads
planned against real in TensorBoard (`step_plan_peak_bytes` beside `device_peak_allocated_bytes`,
`step_plan_reserved_bytes` beside `device_peak_reserved_bytes`), and the out-of-memory report
says what the plan holds at its peak (`trainer_memcb.training.oom_report`).

Planning takes seconds, so it runs once per run and off the step: the plan needs the batch's
sizes, which only a real batch says, so at the start of the first logged step a forward pre-hook
on the model catches the shapes of the batch it is called with, and removes itself at once (it
reads `.shape`, nothing else: no copy, no sync). The plan is made when that step's entry is logged,
after the step: `trainer_memcb.training.run_plan.plan_for_trainer` on the model as loaded, the
`TrainingArguments`, the engine and that batch. From then on every training entry carries the
figures. Nothing is installed on a step that is not logged, and a hook left by a step that raised
is removed when `Trainer.train` leaves (`trainer_train_hook.py`).

Where: by default only where the model trains on CUDA (`plan_step="cuda"`), since that is where
an out-of-memory error is a question; `plan_step=True` plans on any device (the CPU trace is what
a CPU run allocates, to the byte), `False` never. A compiled model gets no hook (dynamo would trace
it): there the plan takes the arguments' `max_length` when they have one (TRL's configs), and is
otherwise left out, said once. A failure warns once and leaves the keys out: planning never stops
a run.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from trainer_memcb.training.figures import STEP_PLAN_PEAK_BYTES, STEP_PLAN_RESERVED_BYTES
from trainer_memcb.training.run_plan import plan_for_trainer, plan_reserved_bytes, trained_module
from trainer_memcb.utils.compiled import is_compiled

__all__ = ["PLAN_STEP_CHOICES", "StepPlanProbe", "validate_plan_step"]

# `plan_step=`: "cuda" (the default: where the model trains on CUDA), True (any device), False (never).
PLAN_STEP_CHOICES = ("cuda", True, False)
NOT_YET = "not made yet (it is made at the first logged step, from that step's batch)"
COMPILED_MESSAGE = ("the step plan of a compiled model (torch.compile) needs the batch's length, which is not read "
                    "from a compiled forward; step_plan_peak_bytes is left out")


def validate_plan_step(plan_step: Any) -> None:
    """`ValueError` naming a bad value and what is allowed."""
    if not any(plan_step is choice or (isinstance(choice, str) and plan_step == choice) for choice in PLAN_STEP_CHOICES):
        raise ValueError(f"plan_step={plan_step!r}: expected 'cuda' (plan the run's step once when the model "
                         "trains on CUDA; the default), True (on any device) or False (never)")


def _nothing() -> None:
    return None


class _BatchShapes:
    """A forward pre-hook that reads the shapes of the tensors the next forward is called with, once."""

    def __init__(self) -> None:
        self.shapes: Optional[Dict[str, Tuple[int, ...]]] = None
        self._handle: Any = None

    @property
    def watching(self) -> bool:
        return self._handle is not None

    def watch(self, module: torch.nn.Module) -> None:
        if self._handle is None:
            self._handle = module.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.remove()  # first: whatever follows, the hook is gone
        try:
            shapes = {name: tuple(value.shape) for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
            if args and isinstance(args[0], torch.Tensor):  # model(input_ids)
                shapes.setdefault("input_ids", tuple(args[0].shape))
            self.shapes = shapes
        except Exception:  # nothing of the step depends on it: the plan waits for another batch
            pass

    def remove(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()


class StepPlanProbe:
    """Plans the run's own step once per run (see the module docstring) and holds its figures.

    Args:
        plan_step: "cuda", True or False (`PLAN_STEP_CHOICES`).
        warn_once: `warn_once(kind, message)`, the caller's warning that is given once per kind.
    """

    def __init__(self, plan_step: Any = "cuda", warn_once: Optional[Callable[[str, str], None]] = None) -> None:
        validate_plan_step(plan_step)
        self.plan_step = plan_step
        self._warn_once = warn_once or (lambda kind, message: None)
        self._batch = _BatchShapes()
        self._module: Callable[[], Any] = _nothing
        self.plan: Any = None  # the StepMemoryPlan, once made
        self._figures: Dict[str, int] = {}
        self._done = False  # planned, or given up: never planned twice in a run
        self._seq_len: Optional[int] = None
        self.left_out = NOT_YET  # why there is no plan (the out-of-memory report says it)

    def start(self, main_process: bool = True) -> None:
        """A run begins: nothing planned yet, nothing installed. Only the main process plans (it
        alone logs)."""
        self.remove()
        self.plan, self._figures, self._done, self._seq_len = None, {}, not main_process, None
        self._batch.shapes = None
        self.left_out = NOT_YET if main_process else "made by the main process only"

    def remove(self) -> None:
        """Take off the batch hook if it is still on; safe at any time."""
        self._batch.remove()
        self._module = _nothing

    def _wanted(self, module: torch.nn.Module) -> bool:
        if self.plan_step is True:
            return True
        if self.plan_step is False:
            return False
        return any(param.device.type == "cuda" for param in module.parameters())

    def arm(self, model: Any, args: Any, compiled: bool = False) -> None:
        """At the start of a step that will be logged: watch for its batch, until one is seen."""
        if self._done or self._batch.shapes is not None or self._batch.watching or model is None:
            return
        try:
            module = trained_module(model)
            if not self._wanted(module):
                self._done, self.left_out = True, f"not made on this device (plan_step={self.plan_step!r})"
                return
            if compiled or is_compiled(model) or torch.compiler.is_compiling():
                max_length = getattr(args, "max_length", None)
                if isinstance(max_length, int) and not isinstance(max_length, bool) and max_length > 0:
                    self._seq_len, self._batch.shapes = max_length, {}
                else:
                    self._done, self.left_out = True, "left out: " + COMPILED_MESSAGE
                    self._warn_once("step-plan-compiled", COMPILED_MESSAGE)
                return
            self._batch.watch(module)
            self._module = weakref.ref(module)
        except Exception as error:  # never break training over a plan
            self.remove()
            self._failed(repr(error))

    @property
    def planned(self) -> Dict[str, int]:
        """The figures planned so far (`{}` before the plan), never planning: the end-of-run summary's."""
        return dict(self._figures)

    def figures(self, model: Any, args: Any) -> Dict[str, int]:
        """The plan's figures, planning now if a batch has been seen and nothing was planned yet."""
        self._plan(model, args)
        return dict(self._figures)

    def plan_if_ready(self, model: Any, args: Any) -> Any:
        """The plan, made now if a batch has been seen (the out-of-memory report's path), or None."""
        self._plan(model, args)
        return self.plan

    def _failed(self, why: str) -> None:
        self._done, self.left_out = True, f"planning it failed ({why})"
        self._warn_once("step-plan", f"planning the run's step failed ({why}); it is left out")

    def _plan(self, model: Any, args: Any) -> None:
        if self._done or self._batch.shapes is None or model is None:
            return
        self._done = True
        self.remove()
        try:
            plan = plan_for_trainer(model, args, self._batch.shapes, seq_len=self._seq_len)
        except Exception as error:  # never break training over a plan
            self._failed(repr(error))
            return
        if plan.step.problem is not None or plan.step.peak_bytes is None:
            self._failed(str(plan.step.problem))
            return
        self.plan = plan
        self._figures = {STEP_PLAN_PEAK_BYTES: int(plan.step.peak_bytes)}
        reserved = plan_reserved_bytes(plan)
        if reserved is not None:
            self._figures[STEP_PLAN_RESERVED_BYTES] = int(reserved)
