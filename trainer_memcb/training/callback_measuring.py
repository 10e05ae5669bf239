"""The callback's measuring: what is measured of an optimizer's run, on the steps the Trainer logs.

One `Run` per optimizer (held weakly, `per_optimizer.py`): its monitor (the optimizer state and the
model states, `monitor.py`), its activations probe, its step plan, its what-if, and for a trainer
that generates (TRL's GRPO, RLOO) its phases probe (`generation_phases.py`). Every process
measures and takes part in the figures, in the same order: with several processes they are
combined (a collective), and then only the main process logs them (`callback_logging.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Set, Tuple, Union

from transformers.utils import logging

from trainer_memcb.plan.optimizers import whatif
from trainer_memcb.training.activations_probe import ActivationsProbe, trainer_logs_step
from trainer_memcb.training.generation_phases import PhasePeaksProbe
from trainer_memcb.training.model_states_probe import tap_zero_gradients
from trainer_memcb.training.monitor import OptimizerStateMonitor
from trainer_memcb.training.per_optimizer import PerOptimizer
from trainer_memcb.training.step_plan_probe import StepPlanProbe
from trainer_memcb.training.tensorboard_view import TensorBoardView
from trainer_memcb.training.trainer_train_hook import current_trainer

__all__ = ["Run", "Runs"]

# The callback's own logger, as before its parts had modules of their own: the name users configure.
logger = logging.get_logger(f"{__package__}.callback")


class Run:
    """What the callback knows of one optimizer's training: its monitor and its what-if."""

    __slots__ = ("monitor", "what_if", "tensorboard", "untap", "step_plan", "phases")

    def __init__(self, monitor: OptimizerStateMonitor, step_plan: StepPlanProbe,
                 phases: Optional[PhasePeaksProbe] = None) -> None:
        self.monitor = monitor
        # A generating trainer's generation and training phases, on its logged steps.
        self.phases = phases or PhasePeaksProbe()
        # The step plan of the run's own settings, made once, at its first logged step.
        self.step_plan = step_plan
        self.what_if: Optional[whatif.WhatIf] = None
        # Charts and the text summary, in the folder of the Trainer's TensorBoard reporter.
        self.tensorboard: Optional[TensorBoardView] = None
        # Stops measuring ZeRO-1/2's gradients inside DeepSpeed's step (zero_gradients.py).
        self.untap: Optional[Callable[[], None]] = None


class Runs:
    """The callback's runs, one per optimizer, and what each Trainer event measures of them.

    Args: the callback's own (`breakdown`, `activations`, `reset_device_peak`, `plan_step`, the
    resolved `what_if` names, `phases`), `warned` (the kinds of fault warned already, shared with every
    monitor) and `warn` (warn once per kind).
    """

    def __init__(self, breakdown: Tuple[str, ...], activations: bool, reset_device_peak: bool,
                 plan_step: Union[str, bool], what_if_optimizers: Tuple[str, ...], warned: Set[str],
                 warn: Callable[[str, str], None], phases: bool = True) -> None:
        self.breakdown, self.activations, self.reset_device_peak = breakdown, activations, reset_device_peak
        self.phases = phases
        self.plan_step, self.what_if_optimizers = plan_step, what_if_optimizers
        self._warned, self._warn = warned, warn
        self._runs: PerOptimizer[Run] = PerOptimizer(self._new_run)
        # The run of the training under way, for the rare event that comes without an optimizer.
        self.current: Optional[Run] = None

    def _new_run(self, optimizer: Any) -> Run:
        monitor = OptimizerStateMonitor(breakdown=self.breakdown, keep_alive=False, warned=self._warned)
        monitor.attach(optimizer)
        monitor.activations = ActivationsProbe(self.activations, self.reset_device_peak, monitor.warn_once)
        return Run(monitor, StepPlanProbe(self.plan_step, monitor.warn_once), PhasePeaksProbe(monitor.warn_once))

    def run(self, optimizer: Any) -> Optional[Run]:
        """The run of `optimizer`, made at its first event; None: the run under way."""
        if optimizer is None:
            return self.current
        return self._runs.setdefault(optimizer)

    def release(self, optimizer: Any) -> None:
        """Hold nothing more of `optimizer`'s run."""
        self._runs.release(optimizer)

    def begin(self, args: Any, state: Any, optimizer: Any, model: Any) -> Optional[Run]:
        """`on_train_begin`: the run starts (again), with nothing left over from one that raised."""
        run = self.current = self.run(optimizer)
        if run is None:
            return None
        run.monitor.start_run()  # global_step restarts with each train() call
        if run.untap is None:  # ZeRO-1/2 frees its gradients before on_pre_optimizer_step
            run.untap = tap_zero_gradients(optimizer, lambda: self.measures_model_states(run, args, state))
        run.monitor.activations.forget()  # nothing left over from a run that raised
        run.phases.disarm()
        run.step_plan.start(bool(state.is_world_process_zero))  # planned once per run, by the main process
        if state.is_world_process_zero:
            run.monitor.estimate()
            self._state_what_if(run, args, model)
        return run

    def _state_what_if(self, run: Run, args: Any, model: Any) -> None:
        # Once per optimizer: a few optimizers built over meta-device stand-ins, nothing allocated.
        if not self.what_if_optimizers or model is None or run.what_if is not None:
            return
        try:
            run.what_if = whatif.what_if(model, self.what_if_optimizers, args=args)
            logger.info(whatif.what_if_text(run.what_if))
        except Exception as error:  # never break training over a what-if
            self._warn("what-if", f"the optimizer what-if failed ({error!r}); it is left out")

    def step_begin(self, args: Any, state: Any, optimizer: Any, model: Any, train_dataloader: Any) -> None:
        """`on_step_begin`: arm the activations probe and the step plan if the step will be logged."""
        # The forwards of the step about to run are measured only if the Trainer will log it. With
        # `torch_compile` the Trainer runs a compiled wrapper of the model the callback is handed.
        if not (self.activations or self.plan_step or self.phases) or not trainer_logs_step(
                args, state, state.global_step + 1, train_dataloader):
            return
        run = self.run(optimizer)
        if run is None:
            return
        if self.phases:
            trainer = current_trainer()  # the Trainer whose step this is: the one training this optimizer
            if trainer is not None and getattr(trainer, "optimizer", None) is optimizer:
                run.phases.arm(trainer, state.global_step + 1)
        if self.activations:
            run.monitor.activations.arm(model, state.global_step + 1,
                                        compiled=bool(getattr(args, "torch_compile", False)), in_train_call=True)
        if state.is_world_process_zero:  # only the main process logs the plan: only it plans
            run.step_plan.arm(model, args, bool(getattr(args, "torch_compile", False)))

    def step_end(self, state: Any, control: Any, optimizer: Any) -> None:
        """`on_step_end`: measure the state if the Trainer logs this step."""
        run = self.run(optimizer)
        if run is not None:
            run.monitor.activations.before_optimizer_step()  # disarmed already, unless that event was missed
            run.phases.step_end()  # its figures kept, its wrappers taken off the Trainer
        # Measure only when this step will be logged: every hook returns early otherwise.
        if control.should_log and run is not None:
            run.step_plan.remove()  # its batch hook, if the step ran no forward
            run.monitor.measure(state.global_step)

    def epoch_end(self, state: Any, optimizer: Any) -> None:
        """`on_epoch_end`: measure the state."""
        run = self.run(optimizer)
        if run is not None:
            run.monitor.measure(state.global_step)

    def pre_optimizer_step(self, args: Any, state: Any, optimizer: Any, model: Any) -> None:
        """`on_pre_optimizer_step`: the gradients exist now; the step is followed by zero_grad."""
        # Metadata only, every process, on the first step and on the steps that will be logged
        # (their sizes do not change between).
        run = self.run(optimizer)
        if run is None:
            return
        run.monitor.activations.before_optimizer_step()  # the last micro-batch's backward is done
        if self.measures_model_states(run, args, state):
            run.monitor.before_optimizer_step(model)
        run.phases.optimizer_step_begin()  # last: the optimizer step is the training phase's, not ours

    def optimizer_step(self, optimizer: Any) -> None:
        """`on_optimizer_step`: the optimizer step is done."""
        run = self.run(optimizer)
        if run is not None:
            run.phases.optimizer_step_end()

    @staticmethod
    def measures_model_states(run: Run, args: Any, state: Any) -> bool:
        """Whether the coming optimizer step is one whose parameters and gradients are measured."""
        every = getattr(args, "logging_steps", 1) or 1
        return not run.monitor.model_states.measured or every < 1 or (state.global_step + 1) % int(every) == 0

    @staticmethod
    def uninstall(run: Run) -> None:
        """Remove what the run installed: the step plan's batch hook, the ZeRO-1/2 step tap, any
        activations wrapper and the phases' wrappers on a generating Trainer."""
        run.phases.disarm()
        run.step_plan.remove()
        if run.untap is not None:
            run.untap, untap = None, run.untap
            untap()
        run.monitor.activations.forget()

    def leave(self, trainer: Any) -> Optional[Run]:
        """`trainer.train()` returned or raised: remove what its run's steps installed (a step that
        raised left them), and return the run (None if it never began, or ended and was released).
        Never raises."""
        run = None
        try:
            optimizer = getattr(trainer, "optimizer", None)
            run = self._runs.get(optimizer) if optimizer is not None else None
            if run is not None:  # else it never began, or it ended and was released
                if run is self.current:
                    self.current = None
                self.uninstall(run)
        except Exception as failure:  # never break training, nor hide its own error
            self._warn("cleanup", f"removing what a step installed failed ({failure!r})")
        return run
