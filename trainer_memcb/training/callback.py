"""`OptimizerMemoryCallback`: the Trainer glue. Thin: measuring and estimating live elsewhere."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Union

from transformers import TrainerCallback
from transformers.utils import logging

from trainer_memcb.plan.optimizers import whatif
from trainer_memcb.training.activations_probe import (
    ActivationsProbe,
    trainer_logs_step,
    validate_activation_options,
    without_activation_keys,
)
from trainer_memcb.training.evaluation_hook import EvaluationWatcher, install_evaluation_hook
from trainer_memcb.training.evaluation_probe import EvaluationProbe
from trainer_memcb.training.figures import (
    BREAKDOWN_KEY_DESCRIPTIONS,
    KEY_DESCRIPTIONS,
    keep_keys,
    select_keys,
    with_prefix,
)
from trainer_memcb.training.model_states_probe import tap_zero_gradients
from trainer_memcb.training.monitor import OptimizerStateMonitor, validate_breakdown
from trainer_memcb.training.oom_report import (
    OUT_OF_MEMORY_ERRORS,
    allocator_state,
    cuda_device_of,
    oom_report_path,
    oom_report_text,
    write_oom_report,
)
from trainer_memcb.training.per_optimizer import PerOptimizer
from trainer_memcb.training.phase_judgement import judge_phases, largest_evaluation
from trainer_memcb.training.step_plan_probe import StepPlanProbe, validate_plan_step
from trainer_memcb.training.summary import SUMMARY_FILE_NAME, step_memory_figures, summary_text, write_summary
from trainer_memcb.training.tensorboard_view import TensorBoardView, reporter_log_dir, summary_markdown, trainer_tag
from trainer_memcb.training.trainer_log_hook import LogContributor, install_log_hook
from trainer_memcb.training.trainer_train_hook import TrainExitListener, install_train_hook
from trainer_memcb.utils.compiled import is_compiled
from trainer_memcb.utils.name_lists import name_list

__all__ = ["OptimizerMemoryCallback", "log_entry_prefix"]

logger = logging.get_logger(__name__)

_RUNTIME_SUFFIX = "_runtime"


def log_entry_prefix(logs: Dict[str, Any]) -> Optional[str]:
    """Which kind of Trainer log entry `logs` is, as the prefix its keys take.

    `""` for a training entry (it holds `loss`); `"eval"`, `"test"`, `"eval_<name>"` for an
    evaluation entry (`evaluate()` adds `<prefix>_runtime`); None for anything else, such as the
    closing `train_runtime` summary, which gets no figures.
    """
    if "loss" in logs:
        return ""
    for key in logs:
        if isinstance(key, str) and key.endswith(_RUNTIME_SUFFIX):
            prefix = key[: -len(_RUNTIME_SUFFIX)]
            if prefix and prefix != "train":
                return prefix
    return None


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


class OptimizerMemoryCallback(TrainerCallback, LogContributor, EvaluationWatcher, TrainExitListener):
    """Logs what the optimizer state really holds, and what it should hold, in the Trainer's logs.

    `Trainer(..., callbacks=[OptimizerMemoryCallback()])` is all it takes. The figures go into the
    Trainer's own log entries, so they reach `trainer.state.log_history`, `trainer_state.json`,
    the console and every `report_to` reporter (TensorBoard shows `train/optimizer_state_bytes`
    beside `train/loss`, and `eval/optimizer_state_bytes` beside `eval/accuracy`).

    Logged keys (exact integers; evaluation entries carry them with the evaluation's prefix, e.g.
    `eval_optimizer_state_bytes`):

    | key | unit | meaning |
    |---|---|---|
    | `optimizer_state_bytes` | bytes | storage the optimizer state really holds, each storage once |
    | `optimizer_state_estimate_bytes` | bytes | what it should hold for this optimizer family |
    | `optimizer_state_elements` | values | values stored in the state |
    | `optimizer_trainable_params` | parameters | trainable parameter values the estimate covers |
    | `optimizer_state_total_bytes` | bytes | `optimizer_state_bytes` summed over all processes (with several) |
    | `optimizer_state_estimate_total_bytes` | bytes | the estimate summed over all processes (with several) |
    | `optimizer_master_weights_bytes` | bytes | DeepSpeed ZeRO's fp32 master weights (with ZeRO only) |
    | `optimizer_state_unexpected_bytes` | bytes | measured minus estimate (signed), once every trainable parameter has state |
    | `model_params_bytes` | bytes | storage of the model's parameters, each storage once (tied weights once) |
    | `model_grads_bytes` | bytes | storage of the gradients, taken before the optimizer step |
    | `model_states_bytes` | bytes | parameters + gradients + optimizer state + master weights + reference model |
    | `model_states_estimate_bytes` | bytes | the model-states plan's figure for the setup detected in the run |
    | `model_states_total_bytes` | bytes | `model_states_bytes` summed over all processes (with several) |
    | `model_states_estimate_total_bytes` | bytes | `model_states_estimate_bytes` summed over all processes (with several) |
    | `reference_model_params_bytes` | bytes | the frozen reference model's parameters (`trainer.ref_model`), when the trainer holds one |
    | `optimizer_state_bytes_by_key/<key>` | bytes | with `breakdown=("key",)`: per state key |
    | `optimizer_state_bytes_by_dtype/<dtype>` | bytes | with `breakdown=("dtype",)`: per dtype |
    | `optimizer_state_bytes_by_device/<device>` | bytes | with `breakdown=("device",)` |
    | `activations_bytes` | bytes | saved for backward by the logged step's last micro-batch forward (all its forwards, if several), training entries |
    | `activations_peak_bytes` | bytes | the most of those alive during that micro-batch's forward and backward |
    | `device_peak_allocated_bytes` | bytes | CUDA only: `torch.cuda.max_memory_allocated` of the model's device |
    | `device_peak_reserved_bytes` | bytes | CUDA only: `torch.cuda.max_memory_reserved` of the model's device |
    | `step_plan_peak_bytes` | bytes | training entries from the first logged step: the step plan's peak for the run's own settings, planned once per run (on CUDA, or with `plan_step=True`) |
    | `step_plan_reserved_bytes` | bytes | CUDA only: the same plan's reserved bytes, its allocations replayed through the caching allocator over two steps |
    | `containers_device_bytes` | bytes | evaluation entries: the most the evaluation loop's containers held as torch tensors, each storage once |
    | `containers_host_bytes` | bytes | evaluation entries: the most they held as numpy arrays on the host |
    | `concat_peak_bytes` | bytes | evaluation entries: the most held during a batch's add (old, new and the concatenation's result) |
    | `host_concat_peak_bytes` | bytes | evaluation entries: the same on the host, while tensors become arrays |
    | `forward_peak_bytes` | bytes | evaluation entries: the most bytes alive of the storages the evaluation's first forward creates |

    Which keys an entry carries: by default a training entry carries every key above that the
    run has, and an evaluation entry only `optimizer_state_bytes`,
    `optimizer_state_estimate_bytes`, `containers_device_bytes` and `containers_host_bytes` (with
    its prefix), so that a notebook's evaluation table and
    a console line keep the metrics readable. `train_keys=` and `eval_keys=` choose otherwise:
    `"all"`, `"short"` (those), or a list of key names (a breakdown by its first part,
    `optimizer_state_bytes_by_key`). The end-of-training summary file always holds every figure.

    The reference model (TRL's DPO, KTO, RLOO, and GRPO with `beta > 0` hold one, as
    `trainer.ref_model`) is counted once, its parameters' storages without those it shares with the
    policy: `reference_model_params_bytes`, included in `model_states_bytes`; the plan's
    `model_states_estimate_bytes` includes it as a frozen copy of its parameters (no gradients, no
    optimizer state), laid out like the policy's parameters. A PEFT model trained with
    `ref_model=None` has no reference model: TRL disables the adapters to get the reference.

    In breakdown keys, characters other than letters, digits, `_` and `-` in a part name become
    `_` (`cuda:0` -> `cuda_0`), so that no key is a path prefix of another and every reporter
    (TensorBoard, W&B, MLflow, DVCLive) can store them all.

    Measured keys are left out before the first optimizer step (`state.global_step == 0`) and
    logged after it, 0 for a stateless optimizer (plain SGD, LOMO); the estimate keys are left out
    when no rule knows the optimizer. Measuring reads tensor metadata only, on the
    steps where the Trainer logs and at epoch ends. At the end of training a summary goes to the
    logger and the exact bytes to `<output_dir>/optimizer_memory.json`; when measured and estimate
    differ, one warning says by how much, where, and the likely cause (`trainer_memcb.state.judge`). When
    the Trainer reports to TensorBoard, the reporter's run folder also gets charts of measured and
    estimate together, the summary in its Text tab and a table of each evaluation's figures there
    (`trainer_memcb.training.tensorboard_view`). With several processes
    every process measures, per-process keys become the largest over the processes (one small
    exchange per logged step), and only the main process logs.
    Nothing here can stop a run: a failure warns once and leaves the figure out.

    When `train()` raises a CUDA out-of-memory error (`torch.OutOfMemoryError`), the callback writes
    `<output_dir>/out_of_memory_report.txt` (what the step plan holds at its peak, by part; the
    caching allocator's segments, largest free block and reserved minus allocated bytes, read then)
    and the error reaches the caller unchanged, the same object (`trainer_memcb.training.oom_report`).

    One instance may serve several Trainers, in turn or interleaved: each Trainer's entries get
    its own optimizer's figures. The callback holds an optimizer by a weak reference only, so it
    never keeps one (and its state) alive once its Trainer is gone.

    Args:
        breakdown: extra per-part byte keys to log: any of `"key"`, `"dtype"`, `"device"`.
        summary_file: file name, inside `args.output_dir`, for the end-of-training JSON summary;
            None writes none.
        what_if: the Trainer `optim` names whose state to estimate once at train begin for the
            model being trained (logger and summary, under `"what_if"`); `()` or None for none.
        eval_keys: the keys evaluation entries carry: `"short"` (default), `"all"`, or key names
            (never the activation keys, which describe training steps).
        train_keys: the keys training entries carry: `"all"` (default), `"short"`, or key names.
        activations: measure the activations on the steps the Trainer logs (the forwards of the
            step's last micro-batch run under a saved-tensors counter;
            `trainer_memcb.training.activations_probe` says what is counted, and why a compiled
            model is left out); False for none.
        reset_device_peak: on CUDA, reset the allocator's peak statistics at the start of each
            logged step, so that `device_peak_allocated_bytes` is that step's own peak; by
            default they are never reset (they are global: other code may read them).
        evaluation: measure what each evaluation loop holds (`trainer_memcb.training.evaluation_probe`:
            its containers, and its first forward), in the evaluation's entry; False for none.
        plan_step: plan the run's own step once, at its first logged step (its batch's shapes read
            there), and log `step_plan_peak_bytes` from then on (`trainer_memcb.training.step_plan_probe`):
            `"cuda"` (default) when the model trains on CUDA, True on any device, False never.
        preflight: at `on_train_begin`, plan the run's own step (`trainer_memcb.training.preflight`)
            and, on CUDA, compare it with the device's free memory: if it will not fit, one warning
            before the first step names the best proposal of the settings that fit. A number of
            bytes compares with that instead (on any device). The run itself is never changed.

    Every argument that names things (`breakdown`, `what_if`, `eval_keys`, `train_keys`) takes a
    list, or one comma-separated string; None or `()` is none; a name given twice counts once; an
    unknown name is a `ValueError` that names it and the allowed ones.

    Examples:
        >>> from trainer_memcb import OptimizerMemoryCallback
        >>> callback = OptimizerMemoryCallback(breakdown=("key",))
        >>> OptimizerMemoryCallback(breakdown=("shape",))
        Traceback (most recent call last):
        ...
        ValueError: breakdown='shape' is not one of ['device', 'dtype', 'key']
    """

    KEYS = {**KEY_DESCRIPTIONS, **BREAKDOWN_KEY_DESCRIPTIONS}

    def __init__(self, breakdown: Iterable[str] = (), summary_file: Optional[str] = SUMMARY_FILE_NAME,
                 what_if: Iterable[str] = whatif.DEFAULT_OPTIMIZERS,
                 eval_keys: Union[str, Iterable[str], None] = "short",
                 train_keys: Union[str, Iterable[str], None] = "all", activations: bool = True,
                 reset_device_peak: bool = False, evaluation: bool = True,
                 plan_step: Union[str, bool] = "cuda",
                 preflight: Union[bool, int] = False) -> None:
        if summary_file is not None and (
            not isinstance(summary_file, str) or summary_file in ("", ".", "..")
            or os.path.basename(summary_file) != summary_file
        ):
            raise ValueError(f"summary_file={summary_file!r}: expected a plain file name such as "
                             f"{SUMMARY_FILE_NAME!r}, or None for no file")
        self.breakdown = validate_breakdown(breakdown)
        validate_activation_options(activations, reset_device_peak)
        if not isinstance(evaluation, bool):
            raise ValueError(f"evaluation={evaluation!r}: expected True (measure what each evaluation holds) or "
                             "False (do not)")
        self.evaluation = evaluation
        validate_plan_step(plan_step)
        self.plan_step = plan_step
        if not (isinstance(preflight, bool) or (isinstance(preflight, int) and preflight > 0)):
            raise ValueError(f"preflight={preflight!r}: expected True (plan the step against the CUDA device's free "
                             "memory), False, or the bytes the step may use")
        self.preflight = preflight
        # What the preflight found (`trainer_memcb.training.preflight.Preflight`), or None.
        self.preflight_result: Any = None
        self.activations, self.reset_device_peak = activations, reset_device_peak
        self.summary_file = summary_file
        chosen = name_list(what_if, "what_if", whatif.optimizer_names())
        self.what_if_optimizers = whatif.resolve_optimizer_names(chosen) if chosen else ()
        # None: every key; else the names kept (`trainer_memcb.training.figures.select_keys`).
        self.eval_keys = select_keys(eval_keys, "eval_keys")
        self.train_keys = select_keys(train_keys, "train_keys")
        # Warnings given, shared by every run's monitor: each kind of fault warns once per callback.
        self._warned: Set[str] = set()
        self._runs: PerOptimizer[_Run] = PerOptimizer(self._new_run)
        # The run of the training under way, for the rare event that comes without an optimizer.
        self._current: Optional[_Run] = None
        # The entry the hook filled last, so that `on_log` can tell whether the hook ran for it.
        self._contributed_entry: Optional[Dict[str, Any]] = None
        # The evaluation loops under way, innermost last: one probe each, so that a loop run inside
        # another (a `compute_metrics` that evaluates a second Trainer) leaves the outer one's alone.
        self._loops: List[_Loop] = []
        # The figures of each finished loop, by its Trainer (held weakly) and prefix, until its entry.
        self._evaluations: "weakref.WeakKeyDictionary[Any, Dict[str, Dict[str, int]]]" = weakref.WeakKeyDictionary()
        # The evaluation that held the most since training began, every figure (for the summary).
        self._largest_evaluation: Dict[str, int] = {}
        install_log_hook()
        install_train_hook()
        if evaluation:
            install_evaluation_hook()

    def _new_run(self, optimizer: Any) -> _Run:
        monitor = OptimizerStateMonitor(breakdown=self.breakdown, keep_alive=False, warned=self._warned)
        monitor.attach(optimizer)
        monitor.activations = ActivationsProbe(self.activations, self.reset_device_peak, monitor.warn_once)
        return _Run(monitor, StepPlanProbe(self.plan_step, monitor.warn_once))

    def _run(self, optimizer: Any) -> Optional[_Run]:
        if optimizer is None:
            return self._current
        return self._runs.setdefault(optimizer)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"trainer_memcb: {message}", RuntimeWarning, stacklevel=3)

    # -- Trainer events ------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.preflight is not False and state.is_world_process_zero and self.preflight_result is None:
            self._preflight(args, kwargs.get("model"), kwargs.get("processing_class"), kwargs.get("train_dataloader"))
        run = self._current = self._run(optimizer)
        if run is None:
            return
        run.monitor.start_run()  # global_step restarts with each train() call
        self._largest_evaluation = {}
        if run.untap is None:  # ZeRO-1/2 frees its gradients before on_pre_optimizer_step
            run.untap = tap_zero_gradients(optimizer, lambda: self._measures_model_states(run, args, state))
        run.monitor.activations.forget()  # nothing left over from a run that raised
        run.step_plan.start(bool(state.is_world_process_zero))  # planned once per run, by the main process
        if state.is_world_process_zero:
            run.monitor.estimate()
            self._state_what_if(run, args, kwargs.get("model"))

    def _preflight(self, args: Any, model: Any, processing_class: Any, train_dataloader: Any = None) -> None:
        # The run's own step planned before the first step: one warning if it will not fit. The run
        # is never changed, and a plan that fails only warns.
        from trainer_memcb.training.preflight import preflight

        if model is None:
            return
        try:
            memory = None if self.preflight is True else int(self.preflight)
            self.preflight_result = preflight(model, args, processing_class=processing_class, device_memory=memory,
                                              train_dataloader=train_dataloader)
        except Exception as error:  # never break training over a plan
            self._warn_once("preflight", f"the preflight plan failed ({error!r}); it is left out")
            return
        if self.preflight_result is not None and self.preflight_result.warning:
            self._warn_once("preflight", self.preflight_result.warning)

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

    def _evaluation_figures(self, trainer: Any, logs: Dict[str, Any], prefix: str) -> Dict[str, int]:
        """The figures of the evaluation loop whose entry `logs` is, kept by `eval_keys`, unprefixed."""
        try:
            finished = self._evaluations.get(trainer)
        except TypeError:  # a Trainer that cannot be held weakly had none kept
            finished = None
        measured = finished.pop(prefix, {}) if finished else {}
        if measured:
            self._largest_evaluation = largest_evaluation([self._largest_evaluation, measured])
        figures = keep_keys(measured, self.eval_keys)
        if figures and getattr(trainer.state, "is_world_process_zero", True):
            logs.update(with_prefix(figures, prefix))
        return figures

    def contribute_to_trainer_log(self, trainer: Any, logs: Dict[str, Any]) -> None:
        """Called by the hook on `Trainer.log` just before `trainer` stores and reports `logs`."""
        try:
            prefix = log_entry_prefix(logs)
            if prefix is None:
                return
            self._contributed_entry = logs
            # Evaluation's own figures, whether or not the Trainer has trained yet.
            evaluation = self._evaluation_figures(trainer, logs, prefix) if prefix else {}
            # This Trainer's own optimizer: the callback may serve others, before or in between.
            optimizer = getattr(trainer, "optimizer", None)
            if optimizer is None:
                return  # not trained yet: no optimizer to measure, on any process
            state = trainer.state
            run = self._runs.setdefault(optimizer)
            # The frozen reference model, if the trainer holds one (TRL): every process, before
            # the figures (a collective with several processes).
            run.monitor.reference_model(getattr(trainer, "ref_model", None), getattr(trainer, "model", None))
            figures = self._kept(run.monitor.figures(state.global_step, stepped=state.global_step > 0), prefix)
            if state.is_world_process_zero:
                if not prefix:  # the step plan, made at the first logged step, beside the device's peaks
                    figures.update(keep_keys(run.step_plan.figures(getattr(trainer, "model", None), trainer.args),
                                             self.train_keys))
                # A training entry (no prefix) takes the monitor's fresh dict as it is.
                logs.update(with_prefix(figures, prefix) if prefix else figures)
                self._observe(run, trainer, {**figures, **evaluation}, prefix, state.global_step, logs)
        except Exception as error:  # never break training over a figure
            self._warn_once("log", f"adding the optimizer figures to the log failed ({error!r})")

    def _kept(self, figures: Dict[str, int], prefix: str) -> Dict[str, int]:
        """The figures an entry of this kind carries (`train_keys`, `eval_keys`); an evaluation
        entry never the activations, which belong to training steps."""
        if prefix:
            return keep_keys(without_activation_keys(figures), self.eval_keys)
        return keep_keys(figures, self.train_keys)

    def _observe(self, run: _Run, trainer: Any, figures: Dict[str, int], prefix: str, step: int,
                 entry: Dict[str, Any]) -> None:
        """The charts of the figures an entry logged; for an evaluation's entry, also its table."""
        if not figures:
            return
        try:
            if run.tensorboard is None:
                # The reporter names its folder in its own on_train_begin, before any entry. The
                # folder, not the Trainer, is kept: the run must not hold its optimizer alive.
                folder = reporter_log_dir(getattr(getattr(trainer, "callback_handler", None), "callbacks", None))
                if folder is None:
                    return
                run.tensorboard = TensorBoardView(folder, trainer_tag)
            run.tensorboard.observe(figures, prefix, step)
            if prefix:
                run.tensorboard.write_evaluation(entry, prefix, step)
        except Exception as error:  # never break training over a chart
            self._warn_once("tensorboard", f"writing the TensorBoard charts failed ({error!r})")

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               optimizer: Any = None, **kwargs: Any) -> None:
        # A Trainer subclass whose `log` never calls `Trainer.log` bypasses the hook. Then the
        # figures still reach `log_history` (the entry appended just now) and the reporters after
        # this callback; the ones before it miss them, which the warning says.
        if logs is None or logs is self._contributed_entry:
            return
        prefix = log_entry_prefix(logs)
        run = self._run(optimizer)
        if prefix is None or run is None:
            return
        figures = with_prefix(self._kept(run.monitor.figures(state.global_step, stepped=state.global_step > 0),
                                         prefix), prefix)
        if not figures or not state.is_world_process_zero:
            return
        self._warn_once(
            "hook-bypassed",
            "this Trainer's log() does not call transformers.Trainer.log; the optimizer figures are added "
            "to log_history late and miss the report_to reporters",
        )
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

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

    @staticmethod
    def _uninstall(run: _Run) -> None:
        """Remove what the run installed: the step plan's batch hook, the ZeRO-1/2 step tap and any
        activations wrapper."""
        run.step_plan.remove()
        if run.untap is not None:
            run.untap, untap = None, run.untap
            untap()
        run.monitor.activations.forget()

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        # Nothing installed outlives training, even a loop left unfinished; the loops of a Trainer
        # that runs this one (an evaluation that trains another model) go on.
        self._end_loops(kwargs.get("model"))
        run = self._run(optimizer)
        self._current = None
        if run is None:
            return
        self._uninstall(run)
        try:
            self._end(run, args, state)
        finally:
            # Training is over: hold nothing of this optimizer (most are held weakly anyway).
            self._runs.release(optimizer)

    def _end(self, run: _Run, args: Any, state: Any) -> None:
        monitor = run.monitor
        stepped = state.global_step > 0  # an optimizer step has run: the state is a claim, even empty
        final_figures = monitor.figures(state.global_step, stepped=stepped)  # every process takes part
        if not state.is_world_process_zero:
            return
        try:
            measurement = monitor.claimed_measurement(state.global_step, stepped)
            estimate = monitor.estimate()
            if measurement is None and estimate is None:
                return
            document = monitor.summary_document(
                state.global_step,
                stepped=stepped,
                extra={"final_figures": {**final_figures, **keep_keys(run.step_plan.planned, self.train_keys)},
                       **({"what_if": run.what_if.to_dict()} if run.what_if is not None else {})},
            )
            phases = judge_phases(step_memory_figures(document)[0], self._largest_evaluation)
            if phases is not None:
                document["evaluation"] = dict(self._largest_evaluation)
                document["phases"] = {**phases.to_dict(), "text": phases.text()}
            logger.info(summary_text(measurement, estimate, monitor.judgement(state.global_step),
                                     *step_memory_figures(document))
                        + (f"\n{phases.text()}" if phases is not None else ""))
            if self.summary_file is not None:
                write_summary(document, os.path.join(args.output_dir, self.summary_file))
        except Exception as error:  # never break training over a summary
            self._warn_once("summary", f"writing the optimizer memory summary failed ({error!r})")
            document = None
        self._write_tensorboard_summary(run, document, state.global_step)

    def _write_tensorboard_summary(self, run: _Run, document: Optional[Dict[str, Any]], step: int) -> None:
        view, run.tensorboard = run.tensorboard, None
        if view is None:
            return
        try:
            if document is not None:
                view.write_text(summary_markdown(document), step)
            view.close()
        except Exception as error:  # never break training over a summary
            self._warn_once("tensorboard", f"writing the TensorBoard summary failed ({error!r})")
