"""`OptimizerMemoryLogger`: the custom-loop glue. Thin: it counts steps and hands the figures on.

Measuring, estimating, the key names and the fail-soft warnings are the `OptimizerStateMonitor`'s,
the same object the Trainer callback uses, so both log the same figures under the same keys.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional

from trainer_memcb.figures import KEY_DESCRIPTIONS
from trainer_memcb.monitor import OptimizerStateMonitor
from trainer_memcb.summary import SUMMARY_FILE_NAME, summary_text, write_summary
from trainer_memcb.unwrap import inner_optimizers

__all__ = ["OptimizerMemoryLogger"]


class OptimizerMemoryLogger:
    """Logs what the optimizer state really holds, and what it should hold, from a custom loop.

    Make it from the optimizer (and the `accelerate.Accelerator`), and call it right after
    `optimizer.step()`. On a logging step it returns the figures and passes them to
    `accelerator.log(figures, step=step)`, so every tracker of `Accelerator(log_with=...)` receives
    them (TensorBoard shows `optimizer_state_bytes` beside your loss). On other steps it returns
    `{}` without measuring anything.

    Logged keys: exactly `OptimizerMemoryCallback`'s, exact integers (`OptimizerMemoryLogger.KEYS`
    gives each with its unit): `optimizer_state_bytes` (bytes the state really holds),
    `optimizer_state_estimate_bytes` (what it should hold for this optimizer family),
    `optimizer_state_elements` (values stored), `optimizer_trainable_params` (parameter values the
    estimate covers), with several processes the totals over them, and with `breakdown=` the bytes
    per state key, dtype or device (`optimizer_state_bytes/by_key/exp_avg`, ...). Measured keys are
    left out before the first step (the state is empty), estimate keys when no rule knows the
    optimizer.

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
        model: the model being trained, to log the four model states as well
            (`model_params_bytes`, `model_grads_bytes`, `model_states_bytes`,
            `model_states_estimate_bytes`; see `trainer_memcb.model_states`).

    Example:
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
        model: Any = None,
    ) -> None:
        if optimizer is None:
            raise ValueError("optimizer=None: expected the optimizer whose state to measure")
        if isinstance(logging_steps, bool) or not isinstance(logging_steps, int) or logging_steps < 1:
            raise ValueError(f"logging_steps={logging_steps!r}: expected a whole number of at least 1")
        if accelerator is not None and not callable(getattr(accelerator, "log", None)):
            raise ValueError(
                f"accelerator={accelerator!r}: expected an accelerate.Accelerator (it has no log method)"
            )
        self.monitor = OptimizerStateMonitor(breakdown=breakdown)
        self.monitor.attach(optimizer)
        self.accelerator = accelerator
        self.logging_steps = logging_steps
        self.optimizer_steps = 0
        self.model = model
        if model is not None:
            self._hook_before_steps(optimizer)

    def _hook_before_steps(self, optimizer: Any) -> None:
        """Measure the parameters and gradients right before the optimizer steps, where the
        gradients exist (a step pre-hook on each torch optimizer behind the wrappers)."""
        def before_step(*_: Any) -> None:
            coming = self.optimizer_steps + 1
            if not self.monitor.model_states.measured or coming % self.logging_steps == 0:
                self.monitor.before_optimizer_step(self.model)

        for inner in inner_optimizers(optimizer):
            register = getattr(inner, "register_step_pre_hook", None)
            if register is None:
                self.monitor.warn_once("model-states-hook", f"{type(inner).__qualname__} takes no step pre-hook; "
                                       "the model-states figures are left out")
                continue
            register(before_step)

    def __call__(self, step: Optional[int] = None) -> Dict[str, int]:
        """Call right after `optimizer.step()`; the figures logged at this step, or `{}`.

        Args:
            step: the step to log at, if you count steps yourself; by default the optimizer steps
                this object has counted (micro-batches of gradient accumulation excluded).
        """
        if self.accelerator is not None and not getattr(self.accelerator, "sync_gradients", True):
            return {}  # a micro-batch: the wrapped optimizer skipped its step
        self.optimizer_steps += 1
        if step is None:
            step = self.optimizer_steps
        if step % self.logging_steps:
            return {}
        figures = self.monitor.figures(step)
        if figures and self.accelerator is not None and getattr(self.accelerator, "is_main_process", True):
            try:
                self.accelerator.log(figures, step=step)
            except Exception as error:  # never break training over a figure
                self.monitor.warn_once("log", f"accelerator.log failed for the optimizer figures ({error!r})")
        return figures

    def summary(self) -> str:
        """The latest measurement against the estimate, by state key and dtype, in MiB/GiB."""
        return summary_text(self.monitor.latest, self.monitor.estimate())

    def save_summary(self, output_dir: str, file_name: str = SUMMARY_FILE_NAME) -> Optional[str]:
        """Measure now and write the same JSON summary as the callback; returns its path.

        Call it once, after the loop, on the main process. None (and a warning) if it fails.
        """
        try:
            document = self.monitor.summary_document(self.optimizer_steps)
            path = os.path.join(output_dir, file_name)
            write_summary(document, path)
            return path
        except Exception as error:  # never break training over a summary
            self.monitor.warn_once("summary", f"writing the optimizer memory summary failed ({error!r})")
            return None
