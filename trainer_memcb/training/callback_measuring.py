"""The callback's measuring: what is measured of an optimizer's run, on the steps the Trainer logs.

Moved out of `callback.py`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from transformers.utils import logging

from trainer_memcb.plan.optimizers import whatif
from trainer_memcb.training.activations_probe import ActivationsProbe, trainer_logs_step
from trainer_memcb.training.monitor import OptimizerStateMonitor
from trainer_memcb.training.step_plan_probe import StepPlanProbe
from trainer_memcb.training.tensorboard_view import TensorBoardView

# The callback's own logger, as before its parts had modules of their own: the name users configure.
logger = logging.get_logger(f"{__package__}.callback")


class _Run:
    """What the callback knows of one optimizer's training: its monitor and its what-if."""

    __slots__ = ("monitor", "what_if", "tensorboard", "untap", "step_plan")

    def __init__(self, monitor: OptimizerStateMonitor, step_plan: StepPlanProbe) -> None:
        self.monitor = monitor
        # The step plan of the run's own settings, made once, at its first logged step.
        self.step_plan = step_plan
        self.what_if: Optional[whatif.WhatIf] = None
        # Charts and the text summary, in the folder of the Trainer's TensorBoard reporter.
        self.tensorboard: Optional[TensorBoardView] = None
        # Stops measuring ZeRO-1/2's gradients inside DeepSpeed's step (zero_gradients.py).
        self.untap: Optional[Callable[[], None]] = None


class _MeasuringPart:
    """The callback's measuring, one run per optimizer."""

    def _new_run(self, optimizer: Any) -> _Run:
        monitor = OptimizerStateMonitor(breakdown=self.breakdown, keep_alive=False, warned=self._warned)
        monitor.attach(optimizer)
        monitor.activations = ActivationsProbe(self.activations, self.reset_device_peak, monitor.warn_once)
        return _Run(monitor, StepPlanProbe(self.plan_step, monitor.warn_once))

    def _run(self, optimizer: Any) -> Optional[_Run]:
        if optimizer is None:
            return self._current
        return self._runs.setdefault(optimizer)

    def _state_what_if(self, run: _Run, args: Any, model: Any) -> None:
        # Once per optimizer: a few optimizers built over meta-device stand-ins, nothing allocated.
        if not self.what_if_optimizers or model is None or run.what_if is not None:
            return
        try:
            run.what_if = whatif.what_if(model, self.what_if_optimizers, args=args)
            logger.info(whatif.what_if_text(run.what_if))
        except Exception as error:  # never break training over a what-if
            self._warn_once("what-if", f"the optimizer what-if failed ({error!r}); it is left out")

    # Every process measures and takes part in the figures, in the same order: with several
    # processes they are combined (a collective), and then only the main process logs them.

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        # The forwards of the step about to run are measured only if the Trainer will log it. With
        # `torch_compile` the Trainer runs a compiled wrapper of the model the callback is handed.
        if not (self.activations or self.plan_step) or not trainer_logs_step(
                args, state, state.global_step + 1, kwargs.get("train_dataloader")):
            return
        run = self._run(optimizer)
        if run is None:
            return
        if self.activations:
            run.monitor.activations.arm(kwargs.get("model"), state.global_step + 1,
                                        compiled=bool(getattr(args, "torch_compile", False)), in_train_call=True)
        if state.is_world_process_zero:  # only the main process logs the plan: only it plans
            run.step_plan.arm(kwargs.get("model"), args, bool(getattr(args, "torch_compile", False)))

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        run = self._run(optimizer)
        if run is not None:
            run.monitor.activations.before_optimizer_step()  # disarmed already, unless that event was missed
        # Measure only when this step will be logged: every hook returns early otherwise.
        if control.should_log and run is not None:
            run.step_plan.remove()  # its batch hook, if the step ran no forward
            run.monitor.measure(state.global_step)

    def on_epoch_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        run = self._run(optimizer)
        if run is not None:
            run.monitor.measure(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # The gradients exist now; the step is followed by zero_grad. Metadata only, every process,
        # on the first step and on the steps that will be logged (their sizes do not change between).
        run = self._run(kwargs.get("optimizer"))
        if run is None:
            return
        run.monitor.activations.before_optimizer_step()  # the last micro-batch's backward is done
        if self._measures_model_states(run, args, state):
            run.monitor.before_optimizer_step(model)

    @staticmethod
    def _measures_model_states(run: _Run, args: Any, state: Any) -> bool:
        """Whether the coming optimizer step is one whose parameters and gradients are measured."""
        every = getattr(args, "logging_steps", 1) or 1
        return not run.monitor.model_states.measured or every < 1 or (state.global_step + 1) % int(every) == 0

    @staticmethod
    def _uninstall(run: _Run) -> None:
        """Remove what the run installed: the step plan's batch hook, the ZeRO-1/2 step tap and any
        activations wrapper."""
        run.step_plan.remove()
        if run.untap is not None:
            run.untap, untap = None, run.untap
            untap()
        run.monitor.activations.forget()
