"""`OptimizerMemoryLogger`: the custom-loop glue. Thin: it counts steps and hands the figures on.

Measuring, estimating, the key names and the fail-soft warnings are the `OptimizerStateMonitor`'s,
the same object the Trainer callback uses, so both log the same figures under the same keys.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, Dict, Iterable, List, Optional

from trainer_memcb.training.activations_probe import (
    ActivationsProbe,
    validate_activation_options,
    without_activation_keys,
)
from trainer_memcb.training.figures import KEY_DESCRIPTIONS, with_prefix
from trainer_memcb.training.model_states_probe import tap_zero_gradients
from trainer_memcb.training.monitor import OptimizerStateMonitor
from trainer_memcb.training.summary import SUMMARY_FILE_NAME, summary_text, write_summary
from trainer_memcb.training.tensorboard_view import TensorBoardView, loop_tag, summary_markdown, tracker_log_dir
from trainer_memcb.state.unwrap import inner_optimizers

__all__ = ["OptimizerMemoryLogger"]


class OptimizerMemoryLogger:
    """Logs what the optimizer state really holds, and what it should hold, from a custom loop.

    Make it from the optimizer (and the `accelerate.Accelerator`), and call it right after
    `optimizer.step()`. On a logging step it returns the figures and passes them to
    `accelerator.log(figures, step=step)`, so every tracker of `Accelerator(log_with=...)` receives
    them (TensorBoard shows `optimizer_state_bytes` beside your loss). On other steps it returns
    `{}` without measuring anything. The last step of the run (`max_steps`) is always a logging
    step, so a run shorter than `logging_steps`, or one that does not end on a multiple of it,
    still logs its figures. `add_to(metrics, prefix="eval")` puts the current figures into an
    entry of your own, such as your evaluation's metrics, beside `eval_accuracy`.

    Logged keys: exactly `OptimizerMemoryCallback`'s, exact integers (`OptimizerMemoryLogger.KEYS`
    gives each with its unit): `optimizer_state_bytes` (bytes the state really holds),
    `optimizer_state_estimate_bytes` (what it should hold for this optimizer family),
    `optimizer_state_elements` (values stored), `optimizer_trainable_params` (parameter values the
    estimate covers), with several processes the totals over them, and with `breakdown=` the bytes
    per state key, dtype or device (`optimizer_state_bytes_by_key/exp_avg`, ...), and, once every
    trainable parameter has state, `optimizer_state_unexpected_bytes` (measured minus estimate;
    a difference also warns once, with its likely cause). Every call follows an optimizer step, so
    the measured keys are always there (0 for a stateless optimizer such as plain SGD); estimate
    keys are left out when no rule knows the optimizer. With `model=`, on logged steps also
    `activations_bytes` (what the step's last micro-batch forward saved for backward),
    `activations_peak_bytes` (the most of it alive during that forward and backward) and, on CUDA,
    `device_peak_allocated_bytes` and `device_peak_reserved_bytes` (`trainer_memcb.training.activations_probe`).

    With a TensorBoard tracker, its folder also gets charts of measured and estimate together and,
    at `save_summary`, the summary in its Text tab (`trainer_memcb.training.tensorboard_view`).

    Steps are optimizer steps: inside `accelerator.accumulate(model)` a call on a micro-batch whose
    gradients are not synchronised (`accelerator.sync_gradients` is False; the wrapped optimizer
    did not step) is not counted. Every process measures on logging steps, so that figures gathered
    across processes stay in step; only the main process logs. Measuring reads tensor metadata only.
    Nothing here can stop a run: a failure warns once and leaves the figure out.

    Args:
        optimizer: the optimizer, as `accelerator.prepare` returned it or unwrapped.
        accelerator: an `accelerate.Accelerator` to log through; None to only return the figures.
        logging_steps: log on every optimizer step that is a multiple of this.
        breakdown: extra per-part byte keys to log: any of `"key"`, `"dtype"`, `"device"`.
        max_steps: the run's last optimizer step, logged whatever `logging_steps` says; None when
            the loop has no known end (then log the end yourself with `memory(step=...)` or
            `add_to`).
        model: the model being trained, to log the four model states as well
            (`model_params_bytes`, `model_grads_bytes`, `model_states_bytes`,
            `model_states_estimate_bytes`; see `trainer_memcb.training.model_states_probe`) and
            the activations. It hooks the optimizer to measure before its steps (under DeepSpeed
            ZeRO-1/2 it wraps DeepSpeed's `step`, `trainer_memcb.training.zero_gradients`);
            `close()` removes that.
        activations: with `model=`, measure the activations of the steps that will be logged: from
            the optimizer step before (or from here, for step 1), the model's forwards run under a
            saved-tensors counter until that step's optimizer update; `save_summary` removes
            what is left. False for none.
        reset_device_peak: on CUDA, reset the allocator's peak statistics at the start of each
            logged step; by default they are never reset.

    Examples:
        >>> import torch
        >>> from trainer_memcb import OptimizerMemoryLogger
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> memory = OptimizerMemoryLogger(optimizer)  # with an accelerator: (optimizer, accelerator)
        >>> model(torch.ones(1, 4)).sum().backward()
        >>> optimizer.step()
        >>> figures = memory()
        >>> figures["optimizer_state_bytes"], figures["optimizer_state_estimate_bytes"]
        (88, 88)
        >>> metrics = memory.add_to({"eval_accuracy": 0.5}, prefix="eval")
        >>> metrics["eval_accuracy"], metrics["eval_optimizer_state_bytes"]
        (0.5, 88)
        >>> OptimizerMemoryLogger(optimizer, logging_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: logging_steps=0: expected a whole number of at least 1
    """

    KEYS = KEY_DESCRIPTIONS

    def __init__(
        self,
        optimizer: Any,
        accelerator: Any = None,
        logging_steps: int = 1,
        breakdown: Iterable[str] = (),
        max_steps: Optional[int] = None,
        model: Any = None,
        activations: bool = True,
        reset_device_peak: bool = False,
    ) -> None:
        if optimizer is None:
            raise ValueError("optimizer=None: expected the optimizer whose state to measure")
        if isinstance(logging_steps, bool) or not isinstance(logging_steps, int) or logging_steps < 1:
            raise ValueError(f"logging_steps={logging_steps!r}: expected a whole number of at least 1")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps={max_steps!r}: expected a whole number of at least 1, or None")
        if accelerator is not None and not callable(getattr(accelerator, "log", None)):
            raise ValueError(
                f"accelerator={accelerator!r}: expected an accelerate.Accelerator (it has no log method)"
            )
        validate_activation_options(activations, reset_device_peak)
        self.monitor = OptimizerStateMonitor(breakdown=breakdown)
        self.monitor.attach(optimizer)
        self.monitor.activations = ActivationsProbe(activations and model is not None, reset_device_peak,
                                                    self.monitor.warn_once)
        self.accelerator = accelerator
        self.logging_steps = logging_steps
        self.max_steps = max_steps
        self.optimizer_steps = 0
        # Charts and the text summary, in the TensorBoard tracker's folder when there is one.
        self._tensorboard: Optional[TensorBoardView] = None
        if accelerator is not None:
            self._tensorboard = TensorBoardView(lambda: tracker_log_dir(accelerator), loop_tag)
        self.model = model
        self._hooks: List[Any] = []
        self._untap: Optional[Callable[[], None]] = None
        if model is not None:
            self._hook_before_steps(optimizer)
            self._arm_if_logged(1)

    def _logs_step(self, step: int) -> bool:
        return step % self.logging_steps == 0 or step == self.max_steps

    def _arm_if_logged(self, step: int) -> None:
        """Measure the forwards of optimizer step `step` if it will be logged."""
        if self._logs_step(step) and (self.max_steps is None or step <= self.max_steps):
            self.monitor.activations.arm(self.model, step)

    def _hook_before_steps(self, optimizer: Any) -> None:
        """Measure the parameters and gradients right before the optimizer steps, where the
        gradients exist (a step pre-hook on each torch optimizer behind the wrappers; under ZeRO-1/2,
        also when DeepSpeed's step begins, since it frees its gradients before its inner step)."""
        def wanted() -> bool:
            coming = self.optimizer_steps + 1
            return not self.monitor.model_states.measured or coming % self.logging_steps == 0 or coming == self.max_steps

        def before_step(*_: Any) -> None:
            self.monitor.activations.before_optimizer_step()  # the step's last backward is done
            if wanted():
                self.monitor.before_optimizer_step(self.model)

        self._untap = tap_zero_gradients(optimizer, wanted)
        for inner in inner_optimizers(optimizer):
            register = getattr(inner, "register_step_pre_hook", None)
            if register is None:
                self.monitor.warn_once("model-states-hook", f"{type(inner).__qualname__} takes no step pre-hook; "
                                       "the model-states figures are left out")
                continue
            self._hooks.append(register(before_step))

    def close(self) -> None:
        """Remove what this logger installed (its step pre-hooks on the optimizer, under ZeRO-1/2
        its wrapper of DeepSpeed's step, and any activations wrapper still on the model). Call it
        when training ends; the figures stay."""
        self.monitor.activations.forget()
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        untap, self._untap = self._untap, None
        if untap is not None:
            untap()

    def __enter__(self) -> "OptimizerMemoryLogger":
        """`with OptimizerMemoryLogger(...) as memory:` around the loop: `close()` runs however the
        loop ends, so that a step that raises (an out-of-memory error in backward) leaves nothing
        installed on the model or the optimizer."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, step: Optional[int] = None) -> Dict[str, int]:
        """Call right after `optimizer.step()`; the figures logged at this step, or `{}`.

        Args:
            step: the step to log at, if you count steps yourself; by default the optimizer steps
                this object has counted (micro-batches of gradient accumulation excluded). One
                that is not a whole number (`"5"`, `2.5`) warns once and logs nothing at that call.
        """
        if self.accelerator is not None and not getattr(self.accelerator, "sync_gradients", True):
            return {}  # a micro-batch: the wrapped optimizer skipped its step
        self.optimizer_steps += 1
        try:
            return self._figures_at(step)
        finally:
            self._arm_if_logged(self.optimizer_steps + 1)

    def _figures_at(self, step: Optional[int]) -> Dict[str, int]:
        if step is None:
            step = self.optimizer_steps
        else:
            try:
                if isinstance(step, bool):
                    raise TypeError
                step = operator.index(step)  # ints, numpy and torch integers
            except TypeError:  # never break the user's loop over a figure
                self.monitor.warn_once(
                    "step", f"step={step!r} is not a whole number; the figures of this call are left out")
                return {}
        if step % self.logging_steps and step != self.max_steps:
            return {}
        self.monitor.activations.relabel(self.optimizer_steps, step)  # measured for the step counted here
        # This call follows an optimizer step: the state is a claim from now on, even empty.
        figures = self.monitor.figures(step, stepped=True)
        if figures and self.accelerator is not None and getattr(self.accelerator, "is_main_process", True):
            try:
                self.accelerator.log(figures, step=step)
            except Exception as error:  # never break training over a figure
                self.monitor.warn_once("log", f"accelerator.log failed for the optimizer figures ({error!r})")
            self._observe(figures, "", step)
        return figures

    def _is_main_process(self) -> bool:
        return self.accelerator is not None and getattr(self.accelerator, "is_main_process", True)

    def _observe(self, figures: Dict[str, int], prefix: str, step: int, entry: Optional[Dict[str, Any]] = None) -> None:
        """The charts of the figures logged; for an evaluation's entry, also its table."""
        if self._tensorboard is None or not figures:
            return
        try:
            self._tensorboard.observe(figures, prefix, step)
            if prefix and entry is not None:
                self._tensorboard.write_evaluation(entry, prefix, step)
        except Exception as error:  # never break training over a chart
            self.monitor.warn_once("tensorboard", f"writing the TensorBoard layout failed ({error!r})")

    def add_to(self, entry: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
        """Add the current figures to `entry`, a dict your loop logs; returns `entry`.

        With `prefix="eval"` the keys read `eval_optimizer_state_bytes`, ..., beside
        `eval_accuracy` in the same `accelerator.log(entry, step=step)` call. The figures are
        those of the last optimizer step counted (measured now unless this step was measured
        already). With several processes every process must call this at the same points (it
        takes part in the exchange); put it where your evaluation runs on every process.

        Args:
            entry: the dict to add to (changed in place: pass your own entry, not a shared one).
            prefix: put before each key with an underscore, as the Trainer does for evaluations.
        """
        if not isinstance(entry, dict):
            raise ValueError(f"entry={entry!r}: expected the dict your loop logs")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix={prefix!r}: expected a string such as 'eval', or '' for none")
        figures = self.monitor.figures(self.optimizer_steps, stepped=self.optimizer_steps > 0)
        if prefix:  # an evaluation's entry: the activations belong to training steps
            figures = without_activation_keys(figures)
        entry.update(with_prefix(figures, prefix))
        if self._is_main_process():
            self._observe(figures, prefix, self.optimizer_steps, entry)
        return entry

    def summary(self) -> str:
        """The latest measurement against the estimate, by state key and dtype, in MiB/GiB, and the
        last logged step's activations."""
        measurement = self.monitor.latest if self.optimizer_steps > 0 else None
        activations = self.monitor.activations.latest() or {}
        return summary_text(measurement, self.monitor.estimate(), self.monitor.judgement(self.optimizer_steps),
                            activations, activations.get("step"))

    def save_summary(self, output_dir: str, file_name: str = SUMMARY_FILE_NAME) -> Optional[str]:
        """Measure now and write the same JSON summary as the callback; returns its path. With a
        TensorBoard tracker, the same summary goes to its Text tab (`optimizer_memory`).

        Call it once, after the loop, on the main process. None (and a warning) if it fails.
        """
        self.monitor.activations.forget()  # the loop is over: no step of it is left to measure
        try:
            document = self.monitor.summary_document(self.optimizer_steps, stepped=self.optimizer_steps > 0)
            path = os.path.join(output_dir, file_name)
            write_summary(document, path)
        except Exception as error:  # never break training over a summary
            self.monitor.warn_once("summary", f"writing the optimizer memory summary failed ({error!r})")
            return None
        if self._tensorboard is not None:
            try:  # the same summary in the tracker's Text tab
                self._tensorboard.write_text(summary_markdown(document), self.optimizer_steps)
                self._tensorboard.close()
            except Exception as error:  # never break training over a summary
                self.monitor.warn_once("tensorboard", f"writing the TensorBoard summary failed ({error!r})")
        return path
