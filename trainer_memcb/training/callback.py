"""`OptimizerMemoryCallback`: the Trainer glue. Thin: it composes its parts, one module each.

`callback_measuring` (what is measured of each optimizer's run, on the logged steps),
`callback_logging` (what goes into the Trainer's log entries, the charts and the summary),
`callback_hooks` (the hooks on the Trainer's methods, installed by one installer, and the
evaluation loops they report) and `callback_preflight` (the run's step planned before it starts).
Measuring and estimating themselves live further down (`monitor`, `trainer_memcb.state`, `.plan`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Iterable, Optional, Set, Union

from transformers import TrainerCallback

from trainer_memcb.plan.optimizers import whatif
from trainer_memcb.training.activations_probe import validate_activation_options
from trainer_memcb.training.callback_hooks import (
    EvaluationLoops,
    HookedCallback,
    check_evaluation,
    install_trainer_hooks,
    report_out_of_memory,
)
from trainer_memcb.training.callback_logging import EntryLogging, check_summary_file, log_entry_prefix
from trainer_memcb.training.callback_measuring import Runs
from trainer_memcb.training.callback_preflight import check_preflight, run_preflight
from trainer_memcb.training.memory_snapshots import (
    MemorySnapshots,
    check_memory_snapshot_dir,
    check_snapshot_steps,
)
from trainer_memcb.training.generation_phases import check_phases
from trainer_memcb.training.figures import BREAKDOWN_KEY_DESCRIPTIONS, KEY_DESCRIPTIONS, select_keys
from trainer_memcb.training.monitor import validate_breakdown
from trainer_memcb.training.oom_report import OUT_OF_MEMORY_ERRORS
from trainer_memcb.training.reporter_limits import mlflow_file_store_warning
from trainer_memcb.training.step_plan_probe import validate_plan_step
from trainer_memcb.training.summary import SUMMARY_FILE_NAME
from trainer_memcb.utils.name_lists import name_list

__all__ = ["OptimizerMemoryCallback", "log_entry_prefix"]


class OptimizerMemoryCallback(TrainerCallback, HookedCallback):
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
    | `generation_phase_peak_bytes` | bytes | a generating trainer's (TRL's GRPO, RLOO) training entries: the most alive at once of what the logged step's generation allocated, when it generated |
    | `training_phase_peak_bytes` | bytes | the same of what its training allocated (micro-batches' forward and backward, the optimizer step) |
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

    A trainer that generates its batches (TRL's GRPO and RLOO) runs two phases in a step, which peak
    apart: the generation (transformers' `generate` and its KV cache, the log-probs, the scores) and
    the training on what was generated. On the steps it logs, each is measured
    (`trainer_memcb.training.generation_phases`), and its training entry, the one holding TRL's
    `reward` and `kl`, carries `generation_phase_peak_bytes` and `training_phase_peak_bytes`.

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
        memory_snapshot_dir: a folder (str or os.PathLike) for the CUDA caching allocator's recorded
            history: with CUDA available, `torch.cuda.memory._record_memory_history` from the start
            of the first of `snapshot_steps` to the end of the last, then `_dump_snapshot` into
            `memory_snapshot_step<N>.pickle` there (N the last step; `-rank<R>` added with several
            processes), and into `memory_snapshot_oom.pickle` when an out-of-memory error leaves
            `train()` while recording (`trainer_memcb.training.memory_snapshots`). Read it with
            `trainer-memcb snapshot FILE --plan PLAN`. None (default): nothing is recorded. Without
            CUDA it warns once and records nothing.
        snapshot_steps: the optimizer steps to record (step 1 is the first), a list or tuple of
            positive ints or one comma-separated string; recorded from the first to the last.
        phases: measure a generating trainer's generation and training phases on the steps it logs
            (a dispatch mode counts their operations' storages: some microseconds per operation, on
            those steps only); False for none. Other trainers are never touched.

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
                 preflight: Union[bool, int] = False,
                 memory_snapshot_dir: Union[str, "os.PathLike[str]", None] = None,
                 snapshot_steps: Union[str, Iterable[int]] = (1, 2), phases: bool = True) -> None:
        # Each argument checked where its part lives, in the order they always were: a ValueError names it.
        self.summary_file = check_summary_file(summary_file)
        self.breakdown = validate_breakdown(breakdown)
        validate_activation_options(activations, reset_device_peak)
        self.evaluation = check_evaluation(evaluation)
        validate_plan_step(plan_step)
        self.plan_step = plan_step
        self.preflight = check_preflight(preflight)
        self.memory_snapshot_dir = check_memory_snapshot_dir(memory_snapshot_dir)
        self.snapshot_steps = check_snapshot_steps(snapshot_steps)
        self.phases = check_phases(phases)
        # What the preflight found (`trainer_memcb.training.preflight.Preflight`), or None.
        self.preflight_result: Any = None
        self.activations, self.reset_device_peak = activations, reset_device_peak
        chosen = name_list(what_if, "what_if", whatif.optimizer_names())
        self.what_if_optimizers = whatif.resolve_optimizer_names(chosen) if chosen else ()
        # None: every key; else the names kept (`trainer_memcb.training.figures.select_keys`).
        self.eval_keys = select_keys(eval_keys, "eval_keys")
        self.train_keys = select_keys(train_keys, "train_keys")
        # Warnings given, shared by every run's monitor: each kind of fault warns once per callback.
        self._warned: Set[str] = set()
        # The parts: what is measured, what is logged, and the evaluation loops the hooks report.
        self._runs = Runs(self.breakdown, activations, reset_device_peak, plan_step, self.what_if_optimizers,
                          self._warned, self._warn_once, phases)
        self._entries = EntryLogging(self.eval_keys, self.train_keys, summary_file, self._warn_once)
        self._evaluations = EvaluationLoops(evaluation, self._warn_once)
        self._snapshots = MemorySnapshots(self.memory_snapshot_dir, self.snapshot_steps, self._warn_once)
        install_trainer_hooks(evaluation)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"trainer_memcb: {message}", RuntimeWarning, stacklevel=3)

    # -- Trainer events ------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.preflight is not False and state.is_world_process_zero and self.preflight_result is None:
            self.preflight_result = run_preflight(self.preflight, args, kwargs.get("model"),
                                                  kwargs.get("processing_class"), kwargs.get("train_dataloader"),
                                                  self._warn_once)
        if self._runs.begin(args, state, optimizer, kwargs.get("model")) is not None:
            self._evaluations.largest = {}
        if state.is_world_process_zero:
            message = mlflow_file_store_warning(args, self.breakdown)
            if message is not None:
                self._warn_once("mlflow-file-store", message)

    def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._snapshots.step_begin(args, state)
        self._runs.step_begin(args, state, optimizer, kwargs.get("model"), kwargs.get("train_dataloader"))

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._runs.step_end(state, control, optimizer)
        self._snapshots.step_end(state)

    def on_epoch_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._runs.epoch_end(state, optimizer)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._runs.pre_optimizer_step(args, state, kwargs.get("optimizer"), model)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self._runs.optimizer_step(optimizer)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               optimizer: Any = None, **kwargs: Any) -> None:
        self._entries.late(logs, state, self._runs, optimizer)

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        # Nothing installed outlives training, even a loop left unfinished; the loops of a Trainer
        # that runs this one (an evaluation that trains another model) go on.
        self._evaluations.end(kwargs.get("model"))
        self._snapshots.train_end(state)
        run = self._runs.run(optimizer)
        self._runs.current = None
        if run is None:
            return
        self._runs.uninstall(run)
        try:
            self._entries.end(run, args, state, self._evaluations.largest)
        finally:
            # Training is over: hold nothing of this optimizer (most are held weakly anyway).
            self._runs.release(optimizer)

    # -- what the hooks on the Trainer's methods call (`callback_hooks.py`) ---------------------

    def contribute_to_trainer_log(self, trainer: Any, logs: Dict[str, Any]) -> None:
        """Called by the hook on `Trainer.log` just before `trainer` stores and reports `logs`."""
        self._entries.contribute(trainer, logs, self._runs, self._evaluations)

    def evaluation_loop_started(self, trainer: Any, prefix: str) -> None:
        """Called by the hook on `Trainer.evaluation_loop` as a loop starts: arm a probe for it."""
        self._evaluations.started(trainer, prefix)

    def evaluation_loop_ended(self, trainer: Any, prefix: str, failed: bool) -> None:
        """Called by the hook as that loop ends, returning or raising: disarm, remove every wrapper,
        and keep its figures for its Trainer's entry."""
        self._evaluations.ended(trainer, prefix, failed)

    def after_train(self, trainer: Any, error: Optional[BaseException] = None) -> None:
        """Called by the hook on `Trainer.train` as it returns or raises `error`: a step that raised
        (an out-of-memory error in backward, say) left its activations wrapper, the step plan's
        batch hook and, under ZeRO-1/2, the step tap installed; they are removed now. After
        `on_train_end` nothing is left to remove. An out-of-memory error gets its report
        (`trainer_memcb.training.oom_report`); `error` itself is only read."""
        run = self._runs.leave(trainer)
        # The allocator's history, if still recorded: dumped on an out-of-memory error, then stopped.
        self._snapshots.train_left(isinstance(error, OUT_OF_MEMORY_ERRORS))
        if isinstance(error, OUT_OF_MEMORY_ERRORS):
            report_out_of_memory(trainer, run, error, self._warn_once)
