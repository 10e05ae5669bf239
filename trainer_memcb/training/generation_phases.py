"""The two phases of a generating trainer's logged step: generating completions, and training on them.

TRL's GRPOTrainer and RLOOTrainer (the trainers with a `_generate_and_score_completions`) run, in
an optimizer step, `training_step` for each micro-batch; its `_prepare_inputs` generates the
completions of `steps_per_generation` micro-batches with the policy (transformers' `generate`, its
KV cache; the reference model's and the old policy's log-probs), scores them, and buffers them,
on the steps where a generation is due, and hands back the micro-batch's slice. What is left of
the step is the training phase: the loss's forward and backward over the micro-batch, then the
optimizer step. The phases peak apart, and the plan plans each (`trainer-memcb estimate --trainer
grpo`: each phase's entry with its `phase`). On the steps the Trainer logs, the probe measures
each, and the training entry (the one holding TRL's `reward` and `kl`) carries:

| key | unit | meaning |
|---|---|---|
| `generation_phase_peak_bytes` | bytes | the most bytes alive at once of the storages the step's generation allocated (`_prepare_inputs` on a call that generates: completions, KV cache, log-probs, rewards, the buffered micro-batches); the largest, if the step generated more than once; left out when the step generated nothing (its micro-batches came from the buffer) |
| `training_phase_peak_bytes` | bytes | the most bytes alive at once of the storages the step's training allocated: each micro-batch's `training_step` (its generation left out), and the optimizer step (AdamW's state, on the first step) |

Both count what was allocated during the phase, above what was alive when it began (parameters,
buffers, the optimizer state, the reference model, the buffered batch): the plan's phase peak minus
the same start. They are counted by `trainer_memcb.training.allocated_storages.AllocatedStorages`
(a dispatch mode: storages from the operation that allocates them until their last tensor is gone),
so on the CPU they are the allocations of the phase's tensors, and on CUDA the same without the
caching allocator's rounding (`device_peak_allocated_bytes` is its whole peak).

How the phases are delimited: while a logged step runs, the Trainer's `training_step`,
`_prepare_inputs` and `_generate_and_score_completions` are wrappers set on the Trainer instance
(its class and every other Trainer untouched); the optimizer step is delimited by the callback's
`on_pre_optimizer_step` and `on_optimizer_step`. The wrappers are set at `on_step_begin` of a step
the Trainer will log, and taken off at its `on_step_end`, or when `train()` leaves, returning or
raising (`trainer_train_hook.py`); on a step that is not logged nothing is set and nothing runs.
Not measured, with one warning each: a compiled model (a dispatch mode would stop dynamo from
compiling it for the rest of the process, `trainer_memcb.utils.compiled`); on torch 2.6, any step
once dynamo has compiled something in the process (its dispatch modes cannot let a compiled
function that the phases call compile, `dispatch_modes_stop_compiling`); and the generation with
vLLM (`use_vllm`: its engine allocates outside torch's operations; only the training phase is
measured). A failure warns once and leaves the figures out; the run itself is never affected.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from trainer_memcb.training.allocated_storages import AllocatedStorages
from trainer_memcb.training.figures import GENERATION_PHASE_PEAK_BYTES, TRAINING_PHASE_PEAK_BYTES
from trainer_memcb.training.trainer_method_hook import InstanceWrappers
from trainer_memcb.utils.compiled import dispatch_modes_stop_compiling, has_compiled_part

__all__ = ["COMPILED_MESSAGE", "PhasePeaksProbe", "check_phases", "generates"]

COMPILED_MESSAGE = ("the generation and training phases of a compiled model (torch.compile) are not measured; "
                    f"{GENERATION_PHASE_PEAK_BYTES} and {TRAINING_PHASE_PEAK_BYTES} are left out")
COMPILING_MESSAGE = (f"this torch ({torch.__version__}) cannot measure the generation and training phases without "
                     "keeping the torch.compile'd code they may call from compiling (newer torch can); "
                     f"{GENERATION_PHASE_PEAK_BYTES} and {TRAINING_PHASE_PEAK_BYTES} are left out")
VLLM_MESSAGE = f"a generation by vLLM (use_vllm) is not measured; {GENERATION_PHASE_PEAK_BYTES} is left out"
# An attribute on each wrapper, so that one is told apart from the Trainer's own method.
WRAPPER_MARK = "__trainer_memcb_phases__"
_GENERATE = "_generate_and_score_completions"


def check_phases(phases: Any) -> bool:
    """`phases` if it is a bool; else a `ValueError`."""
    if not isinstance(phases, bool):
        raise ValueError(f"phases={phases!r}: expected True (measure a generating trainer's generation and "
                         "training phases on logged steps) or False (do not)")
    return phases


def generates(trainer: Any) -> bool:
    """Whether `trainer` generates its training batches (TRL's GRPO and RLOO): it has the method
    that generates and scores them, and the `_prepare_inputs` that calls it."""
    return callable(getattr(trainer, _GENERATE, None)) and callable(getattr(trainer, "_prepare_inputs", None))


def _nothing() -> None:
    return None


class PhasePeaksProbe:
    """Measures the generation and training phases of the logged steps of a generating trainer.

    Args:
        warn_once: `warn_once(kind, message)`, the caller's warning that is given once per kind.
    """

    def __init__(self, warn_once: Optional[Callable[[str, str], None]] = None) -> None:
        self._warn_once = warn_once or (lambda kind, message: None)
        # While armed: the Trainer (weakly), the wrappers set on it and what each replaced.
        self._trainer: Callable[[], Any] = _nothing
        self._wrappers = InstanceWrappers()
        self._step: Optional[int] = None
        self._training: Optional[AllocatedStorages] = None
        self._generation: Optional[int] = None  # the largest generation's peak in the step so far
        self._generated = False  # whether the `_prepare_inputs` under way generated
        self._figures: Dict[str, int] = {}
        self._figures_step: Optional[int] = None

    @property
    def armed(self) -> bool:
        return self._step is not None

    def arm(self, trainer: Any, step: int) -> None:
        """Measure the phases of optimizer step `step` of `trainer` (a generating trainer; any other
        is left alone) until `step_end`."""
        self.disarm()
        if trainer is None or not generates(trainer):
            return
        try:
            if getattr(getattr(trainer, "args", None), "torch_compile", False) or \
                    has_compiled_part(getattr(trainer, "model", None)):
                self._warn_once("phases-compiled", COMPILED_MESSAGE)
                return
            if dispatch_modes_stop_compiling():  # torch 2.6, once dynamo has compiled anything
                self._warn_once("phases-compiling", COMPILING_MESSAGE)
                return
            if getattr(trainer, "use_vllm", False):
                self._warn_once("phases-vllm", VLLM_MESSAGE)
            self._step, self._trainer = step, weakref.ref(trainer)
            self._training, self._generation = AllocatedStorages(), None
            # The probe's methods, unbound: a wrapper holds its probe weakly.
            self._wrap(trainer, "training_step", PhasePeaksProbe._training_step)
            self._wrap(trainer, "_prepare_inputs", PhasePeaksProbe._prepare_inputs)
            self._wrap(trainer, _GENERATE, PhasePeaksProbe._generate)
        except Exception as error:  # never break training over a figure
            self.disarm()
            self._warn_once("phases", f"measuring the generation and training phases failed ({error!r}); "
                                      "they are left out")

    def _wrap(self, trainer: Any, name: str, measuring: Callable[..., Any]) -> None:
        original = getattr(trainer, name)
        owner = weakref.ref(self)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            probe = owner()
            if probe is None or not probe._wrappers.owns(name, wrapper):  # left behind: call straight through
                return original(*args, **kwargs)
            return measuring(probe, original, args, kwargs)

        setattr(wrapper, WRAPPER_MARK, True)
        self._wrappers.set(trainer, name, wrapper)

    # -- the phases, as the wrappers and the callback's events see them ---------------------------

    def _training_step(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        self._enter_training()
        try:
            return original(*args, **kwargs)
        finally:
            self._leave_training()

    def _prepare_inputs(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        # The generation is not the training phase: the training counter is left for its time, and
        # what the generation leaves alive (the buffered batch) is where the training phase starts.
        resume = self._training is not None and self._training.entered
        counter = None
        try:
            if resume:
                self._leave_training()
            counter, self._generated = AllocatedStorages(), False
            counter.enter()
        except Exception as error:  # never break training over a figure
            self._fail(error)
        try:
            return original(*args, **kwargs)
        finally:
            self._generation_ended(counter, resume)

    def _generation_ended(self, counter: Optional[AllocatedStorages], resume: bool) -> None:
        try:
            if counter is not None:
                left = counter.leave()
                if self._generated and left and self.armed:
                    self._generation = max(self._generation or 0, counter.peak_bytes)
                counter.forget()
            if resume:
                self._enter_training()
        except Exception as error:  # never break training over a figure
            self._fail(error)

    def _generate(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        self._generated = True
        return original(*args, **kwargs)

    def _enter_training(self) -> None:
        if self._training is not None:
            try:
                self._training.enter()
            except Exception as error:  # never break training over a figure
                self._fail(error)

    def _leave_training(self) -> None:
        if self._training is not None and not self._training.leave():
            self._fail(RuntimeError("another dispatch mode was entered inside the training phase and is still on"))

    def optimizer_step_begin(self) -> None:
        """`on_pre_optimizer_step`: the optimizer step belongs to the training phase."""
        if self.armed:
            self._enter_training()

    def optimizer_step_end(self) -> None:
        """`on_optimizer_step`: the optimizer step is done."""
        if self.armed:
            self._leave_training()

    def step_end(self) -> None:
        """`on_step_end`: keep the step's figures, and take everything off."""
        if self.armed and self._training is not None and self._training.leave():
            figures = {TRAINING_PHASE_PEAK_BYTES: int(self._training.peak_bytes)}
            if self._generation is not None and not getattr(self._trainer(), "use_vllm", False):
                figures = {GENERATION_PHASE_PEAK_BYTES: int(self._generation), **figures}
            self._figures, self._figures_step = figures, self._step
        self.disarm()

    def _fail(self, error: BaseException) -> None:
        self._warn_once("phases", f"measuring the generation and training phases failed ({error!r}); they are "
                                  "left out")
        self.disarm()

    def disarm(self) -> None:
        """Take every wrapper off the Trainer and stop counting; safe to call at any time."""
        training = self._training
        self._trainer, self._training, self._step = _nothing, None, None
        self._generation, self._generated = None, False
        if training is not None:
            training.leave()
            training.forget()
        self._wrappers.remove_all()

    def figures(self, step: Optional[int]) -> Dict[str, int]:
        """The keys measured for `step`, or `{}`."""
        if step is None or step != self._figures_step:
            return {}
        return dict(self._figures)
