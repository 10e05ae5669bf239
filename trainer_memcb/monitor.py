"""The framework-free core behind the Trainer callback and the custom-loop API.

`OptimizerStateMonitor` holds one optimizer, estimates its state once, measures it when asked
(once per step at most), keeps the latest and the largest measurement, and turns them into the
logged figures. It never raises: a failure warns once and leaves the figure out. In a job of several
processes its figures are the job's (`trainer_memcb.distributed`): every process must ask for them
at the same steps.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, Optional, Set, Tuple

from trainer_memcb.distributed import reduce_across_processes
from trainer_memcb.estimate import StateEstimate, estimate_optimizer_state
from trainer_memcb.figures import MASTER_WEIGHTS_BYTES, MEASURED_BYTES, optimizer_figures
from trainer_memcb.measure import StateMeasurement, measure_optimizer_state
from trainer_memcb.model_states import ModelStatesProbe
from trainer_memcb.summary import summary_document
from trainer_memcb.rules.deepspeed_zero import find_zero_optimizer, master_weights_bytes
from trainer_memcb.unwrap import inner_optimizers

__all__ = ["BREAKDOWNS", "OptimizerStateMonitor", "validate_breakdown"]

# Which breakdowns may be logged beside the totals, and the measurement field each one reads.
BREAKDOWNS = {"key": "bytes_by_key", "dtype": "bytes_by_dtype", "device": "bytes_by_device"}


def validate_breakdown(breakdown: Iterable[str]) -> Tuple[str, ...]:
    if isinstance(breakdown, str):
        breakdown = (breakdown,)
    try:
        chosen = tuple(breakdown)
    except TypeError:  # None, a number: say what is allowed rather than "not iterable"
        raise ValueError(f"breakdown={breakdown!r}: expected some of {sorted(BREAKDOWNS)}, or () for none") from None
    for name in chosen:
        if name not in BREAKDOWNS:
            raise ValueError(f"breakdown={name!r} is not one of {sorted(BREAKDOWNS)}")
    return chosen


def optimizer_class_name(optimizer: Any) -> str:
    classes = dict.fromkeys(type(inner).__qualname__ for inner in inner_optimizers(optimizer))
    return ", ".join(classes) or type(optimizer).__qualname__


class OptimizerStateMonitor:
    """Measures and estimates one optimizer's state, fail-soft.

    Args:
        breakdown: extra byte breakdowns to log: any of `"key"`, `"dtype"`, `"device"`.
    """

    def __init__(self, breakdown: Iterable[str] = ()) -> None:
        self.breakdown = validate_breakdown(breakdown)
        self._optimizer: Any = None
        self._estimate: Optional[StateEstimate] = None
        self._estimated = False
        self._latest: Optional[StateMeasurement] = None
        self._latest_step: Optional[int] = None
        self._peak: Optional[StateMeasurement] = None
        # The step whose measurement failed: asked again at that step (the log entry after the
        # step end), the state is not walked a second time only to fail again.
        self._failed_step: Optional[int] = None
        # The figures handed out last, and their step: asked again at that step (an evaluation
        # entry after a training entry), they are reused without another exchange.
        self._figures: Dict[str, int] = {}
        self._figures_step: Optional[int] = None
        # Whether the optimizer is a DeepSpeed ZeRO one (the only kind with master weights),
        # decided once per optimizer: finding out walks its wrappers and tries a few attributes,
        # too much to repeat at every logged step for an answer that cannot change.
        self._is_zero: Optional[bool] = None
        self._warned: Set[str] = set()
        # Parameters and gradients, measured before the optimizer step (`before_optimizer_step`).
        self.model_states = ModelStatesProbe()

    # -- the optimizer -------------------------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def start_run(self) -> None:
        """A new run counts its steps from its own start: a measurement cached under a step
        number of the last run describes another moment (a second `train()` call on one Trainer
        keeps the optimizer and restarts `global_step`)."""
        self._latest_step = None
        self._failed_step = None
        self._figures_step = None

    def attach(self, optimizer: Any) -> None:
        """Watch `optimizer` (a new one resets the estimate and the measurements)."""
        if optimizer is None or optimizer is self._optimizer:
            return
        self._optimizer = optimizer
        self._estimate, self._estimated = None, False
        self._latest, self._latest_step, self._peak = None, None, None
        self._failed_step = None
        self._figures_step = None
        self._is_zero = None

    def before_optimizer_step(self, model: Any) -> None:
        """Measure the model's parameters and gradients now, where the gradients exist."""
        try:
            self.model_states.before_step(model, self._optimizer)
        except Exception as error:  # never break training over a figure
            self.warn_once("model-states", f"measuring the parameters and gradients failed ({error!r}); "
                           "the model-states figures are left out")
            self.model_states = ModelStatesProbe()

    # -- warnings ------------------------------------------------------------------------------

    def warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"trainer_memcb: {message}", RuntimeWarning, stacklevel=3)

    # -- figures -------------------------------------------------------------------------------

    def estimate(self) -> Optional[StateEstimate]:
        """The estimate, computed once per optimizer; None without a rule or on failure."""
        if self._optimizer is None or self._estimated:
            return self._estimate
        self._estimated = True
        try:
            self._estimate = estimate_optimizer_state(self._optimizer)
        except Exception as error:  # never break training over a figure
            self.warn_once("estimate", f"estimating the optimizer state failed ({error!r}); no estimate is logged")
            return None
        if self._estimate is None:
            name = optimizer_class_name(self._optimizer)
            self.warn_once(
                "no-rule",
                f"no estimate rule for optimizer class {name}; only the measured figure is logged. "
                "Add one with trainer_memcb.register_estimate_rule(YourOptimizerClass, per_param_rule).",
            )
        return self._estimate

    def measure(self, step: Optional[int] = None) -> Optional[StateMeasurement]:
        """Measure now, or reuse the measurement already taken at this `step`."""
        if self._optimizer is None:
            return None
        if step is not None and step == self._latest_step:
            return self._latest
        if step is not None and step == self._failed_step:
            return None
        try:
            measurement = measure_optimizer_state(self._optimizer)
        except Exception as error:  # never break training over a figure
            self._failed_step = step
            self.warn_once("measure", f"measuring the optimizer state failed ({error!r}); the figure is left out")
            return None
        self._latest, self._latest_step = measurement, step
        if self._peak is None or measurement.num_bytes > self._peak.num_bytes:
            self._peak = measurement
        return measurement

    @property
    def latest(self) -> Optional[StateMeasurement]:
        return self._latest

    @property
    def peak(self) -> Optional[StateMeasurement]:
        return self._peak

    def figures(self, step: Optional[int] = None) -> Dict[str, int]:
        """The exact integers to log at `step`, unprefixed; unknown figures left out.

        With several processes (`torch.distributed` initialized) this is a collective: every
        process must call it at the same steps. Per-process figures are then the largest over the
        processes, and `..._total_bytes` their sums (with one process, equal to them).
        """
        if step is not None and step == self._figures_step:
            return dict(self._figures)
        try:
            figures = self._own_figures(step)
        except Exception as error:  # this process then has no figures, and still takes part
            self.warn_once("figures", f"collecting the optimizer figures failed ({error!r}); they are left out")
            figures = {}
        try:
            figures = reduce_across_processes(figures)
        except Exception as error:  # never break training over a figure
            self.warn_once("across-processes", f"combining the figures across processes failed ({error!r}); "
                           "they are left out")
            figures = {}
        self._figures, self._figures_step = figures, step
        return dict(figures)

    def _own_figures(self, step: Optional[int]) -> Dict[str, int]:
        """This process's own figures, before any exchange."""
        measurement = self.measure(step)
        figures = optimizer_figures(measurement, self.estimate())
        if measurement is not None and MEASURED_BYTES in figures:
            for name in self.breakdown:
                for part, num_bytes in getattr(measurement, BREAKDOWNS[name]).items():
                    figures[f"{MEASURED_BYTES}/by_{name}/{part}"] = num_bytes
        try:
            if self._is_zero is None:
                self._is_zero = find_zero_optimizer(self._optimizer) is not None
            master_bytes = master_weights_bytes(self._optimizer) if self._is_zero else None
        except Exception as error:  # never break training over a figure
            self.warn_once("master-weights", f"measuring the master weights failed ({error!r}); the figure is left out")
            master_bytes = None
        if master_bytes is not None:
            figures[MASTER_WEIGHTS_BYTES] = master_bytes
        try:
            figures.update(self.model_states.figures(figures))
        except Exception as error:  # never break training over a figure
            self.warn_once("model-states-estimate", f"the model-states figures failed ({error!r}); they are left out")
        return figures

    # -- the end of a run ----------------------------------------------------------------------

    def summary_document(self, step: int, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The end-of-run JSON document (`optimizer_memory.json`): the measurement at `step`
        against the estimate, the largest measurement seen, and `extra`."""
        peak = self._peak
        return summary_document(
            self.measure(step),
            self.estimate(),
            optimizer_class_name(self._optimizer),
            step,
            extra={"peak_measured_bytes": peak.num_bytes if peak is not None else None, **(extra or {})},
        )
