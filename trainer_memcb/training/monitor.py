"""The framework-free core behind the Trainer callback and the custom-loop API.

`OptimizerStateMonitor` holds one optimizer, estimates its state once, measures it when asked
(once per step at most), keeps the latest and the largest measurement, and turns them into the
logged figures. It never raises: a failure warns once and leaves the figure out. In a job of several
processes its figures are the job's (`trainer_memcb.training.distributed`): every process must ask for them
at the same steps.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple

from trainer_memcb.training.distributed import reduce_across_processes
from trainer_memcb.state.estimate import StateEstimate, estimate_optimizer_state
from trainer_memcb.training.figures import (
    MASTER_WEIGHTS_BYTES,
    MEASURED_BYTES,
    UNEXPECTED_BYTES,
    breakdown_key,
    claims_measurement,
    optimizer_figures,
)
from trainer_memcb.state.judge import StateJudge, StateJudgement
from trainer_memcb.state.measure import StateMeasurement, measure_optimizer_state
from trainer_memcb.training.activations_probe import ActivationsProbe
from trainer_memcb.training.model_states_probe import ModelStatesProbe
from trainer_memcb.training.summary import summary_document
from trainer_memcb.state.rules.deepspeed_zero import find_zero_optimizer, master_weights_bytes
from trainer_memcb.state.unwrap import inner_optimizers
from trainer_memcb.utils.name_lists import name_list

__all__ = ["BREAKDOWNS", "OptimizerStateMonitor", "validate_breakdown"]

# Which breakdowns may be logged beside the totals, and the measurement field each one reads.
BREAKDOWNS = {"key": "bytes_by_key", "dtype": "bytes_by_dtype", "device": "bytes_by_device"}


def _no_optimizer() -> Any:
    return None


def _strong(optimizer: Any) -> Callable[[], Any]:
    return lambda: optimizer


def validate_breakdown(breakdown: Any) -> Tuple[str, ...]:
    """The breakdowns asked for, by the package's one rule for name lists
    (`trainer_memcb.utils.name_lists`: a list, a comma string, None for none, each name once)."""
    return name_list(breakdown, "breakdown", BREAKDOWNS)


def optimizer_class_name(optimizer: Any) -> str:
    classes = dict.fromkeys(type(inner).__qualname__ for inner in inner_optimizers(optimizer))
    return ", ".join(classes) or type(optimizer).__qualname__


class OptimizerStateMonitor:
    """Measures and estimates one optimizer's state, fail-soft.

    Args:
        breakdown: extra byte breakdowns to log: any of `"key"`, `"dtype"`, `"device"`.
        keep_alive: hold the optimizer; False holds it by a weak reference only, so that the
            monitor never keeps an optimizer and its state alive after its owner let go of it
            (the figures are then left out). Optimizers that cannot be weakly referenced are held.
        warned: the set of warnings already given, to share "warn once" with other monitors.
    """

    def __init__(self, breakdown: Iterable[str] = (), keep_alive: bool = True,
                 warned: Optional[Set[str]] = None) -> None:
        self.breakdown = validate_breakdown(breakdown)
        self._keep_alive = keep_alive
        self._optimizer_ref: Callable[[], Any] = _no_optimizer
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
        self._warned: Set[str] = warned if warned is not None else set()
        # Measured against estimate, judged once every trainable parameter has state; the last
        # judgement and its step.
        self._judge = StateJudge()
        self._judged: Optional[Tuple[Optional[int], Optional[StateJudgement]]] = None
        # Parameters and gradients, measured before the optimizer step (`before_optimizer_step`).
        self.model_states = ModelStatesProbe()
        # The activations of logged steps, armed and read by the glue (off unless it turns it on).
        self.activations = ActivationsProbe(enabled=False)

    # -- the optimizer -------------------------------------------------------------------------

    @property
    def _optimizer(self) -> Any:
        return self._optimizer_ref()

    @property
    def optimizer(self) -> Any:
        return self._optimizer_ref()

    def start_run(self) -> None:
        """A new run counts its steps from its own start: a measurement cached under a step
        number of the last run describes another moment (a second `train()` call on one Trainer
        keeps the optimizer and restarts `global_step`)."""
        self._latest_step = None
        self._failed_step = None
        self._figures_step = None
        self._judged = None

    def attach(self, optimizer: Any) -> None:
        """Watch `optimizer` (a new one resets the estimate and the measurements)."""
        if optimizer is None or optimizer is self._optimizer:
            return
        self._optimizer_ref = _strong(optimizer)
        if not self._keep_alive:
            try:
                self._optimizer_ref = weakref.ref(optimizer)
            except TypeError:  # a class without weak references: held, as with keep_alive
                pass
        self._estimate, self._estimated = None, False
        self._latest, self._latest_step, self._peak = None, None, None
        self._failed_step = None
        self._figures_step = None
        self._is_zero = None
        self._judge = StateJudge()
        self._judged = None

    def before_optimizer_step(self, model: Any) -> None:
        """Measure the model's parameters and gradients now, where the gradients exist."""
        try:
            self.model_states.before_step(model, self._optimizer)
        except Exception as error:  # never break training over a figure
            self.warn_once("model-states", f"measuring the parameters and gradients failed ({error!r}); "
                           "the model-states figures are left out")
            self.model_states = ModelStatesProbe()

    def reference_model(self, reference: Any, policy: Any = None) -> None:
        """The trainer's frozen reference model, or None; measured once per model."""
        try:
            self.model_states.reference_model(reference, policy)
        except Exception as error:  # never break training over a figure
            self.warn_once("reference-model", f"measuring the reference model failed ({error!r}); "
                           "reference_model_params_bytes is left out")

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
        if self._estimate is not None:
            try:  # the rule's per-parameter numbers, taken with the estimate
                self._judge.expect(self._optimizer)
            except Exception as error:  # never break training over a figure
                self.warn_once("judge", f"judging measured against estimate failed ({error!r}); it is left out")
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

    def figures(self, step: Optional[int] = None, stepped: Optional[bool] = None) -> Dict[str, int]:
        """The exact integers to log at `step`, unprefixed; unknown figures left out. The measured
        ones only once the optimizer has `stepped` (the caller's step count says so; None: once the
        state holds something).

        With several processes (`torch.distributed` initialized) this is a collective: every
        process must call it at the same steps. Per-process figures are then the largest over the
        processes, and `..._total_bytes` their sums (with one process there are no totals).
        """
        if step is not None and step == self._figures_step:
            return dict(self._figures)
        try:
            figures = self._own_figures(step, stepped)
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

    def _own_figures(self, step: Optional[int], stepped: Optional[bool] = None) -> Dict[str, int]:
        """This process's own figures, before any exchange."""
        measurement = self.measure(step)
        figures = optimizer_figures(measurement, self.estimate(), stepped)
        if measurement is not None and MEASURED_BYTES in figures:
            for name in self.breakdown:
                for part, num_bytes in getattr(measurement, BREAKDOWNS[name]).items():
                    # Two parts may share a safe name ("a.b" and "a_b"): their bytes add up.
                    key = breakdown_key(name, part)
                    figures[key] = figures.get(key, 0) + num_bytes
        try:
            if self._is_zero is None:
                self._is_zero = find_zero_optimizer(self._optimizer) is not None
            master_bytes = master_weights_bytes(self._optimizer) if self._is_zero else None
        except Exception as error:  # never break training over a figure
            self.warn_once("master-weights", f"measuring the master weights failed ({error!r}); the figure is left out")
            master_bytes = None
        if master_bytes is not None:
            figures[MASTER_WEIGHTS_BYTES] = master_bytes
        self._add_unexpected(figures, measurement)
        try:
            figures.update(self.model_states.figures(figures))
        except Exception as error:  # never break training over a figure
            self.warn_once("model-states-estimate", f"the model-states figures failed ({error!r}); they are left out")
        figures.update(self.activations.figures(step))  # measured for this step, or nothing
        return figures

    def _add_unexpected(self, figures: Dict[str, int], measurement: Optional[StateMeasurement]) -> None:
        """`optimizer_state_unexpected_bytes` once every trainable parameter has state, and one
        warning, with the likely causes, the first time measured and estimate differ."""
        try:
            estimate = self.estimate()
            difference = self._judge.difference(self._optimizer, measurement, estimate)
            if difference is None:
                return
            figures[UNEXPECTED_BYTES] = difference
            if difference and "differs" not in self._warned:
                judgement = self._judge.judge(self._optimizer, measurement, estimate)
                if judgement is not None:
                    self.warn_once("differs", judgement.message())
        except Exception as error:  # never break training over a figure
            self.warn_once("judge", f"judging measured against estimate failed ({error!r}); it is left out")

    def judgement(self, step: Optional[int] = None) -> Optional[StateJudgement]:
        """Measured (at `step`) against estimate, judged; None until every trainable parameter
        has state, without an estimate, or on failure."""
        if step is not None and self._judged is not None and self._judged[0] == step:
            return self._judged[1]  # the summary's text and its file ask at the same step
        try:
            judgement = self._judge.judge(self._optimizer, self.measure(step), self.estimate())
            self._judged = (step, judgement) if step is not None else None
            return judgement
        except Exception as error:  # never break training over a summary
            self.warn_once("judge", f"judging measured against estimate failed ({error!r}); it is left out")
            return None

    # -- the end of a run ----------------------------------------------------------------------

    def claimed_measurement(self, step: Optional[int], stepped: Optional[bool] = None) -> Optional[StateMeasurement]:
        """The measurement at `step` as the logs report it: None before the optimizer has
        `stepped` (see `figures`)."""
        measurement = self.measure(step)
        return measurement if claims_measurement(measurement, stepped) else None

    def summary_document(self, step: int, extra: Optional[Dict[str, Any]] = None,
                         stepped: Optional[bool] = None) -> Dict[str, Any]:
        """The end-of-run JSON document (`optimizer_memory.json`): the measurement at `step`
        against the estimate (none before the optimizer has `stepped`, as in the logs), the
        largest measurement seen, the last logged step's activations, and `extra`."""
        peak = self._peak
        activations = self.activations.latest()  # the last logged step's, with that step
        if activations is not None:
            extra = {"activations": activations, **(extra or {})}
        judgement = self.judgement(step)
        if judgement is not None:
            extra = {"judgement": judgement.to_dict(), **(extra or {})}
        return summary_document(
            self.claimed_measurement(step, stepped),
            self.estimate(),
            optimizer_class_name(self._optimizer),
            step,
            extra={"peak_measured_bytes": peak.num_bytes if peak is not None else None, **(extra or {})},
        )
