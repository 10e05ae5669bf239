"""A generating trainer's two phases logged by the callback (`trainer_memcb.training.generation_phases`):
real `GRPOTrainer` and `RLOOTrainer` runs on the CPU, the tiny Llama and the character tokenizer of
`test_trl.py`, prompts of 10 characters, transformers' generation (no vLLM) made to run every
completion to `max_completion_length` (`min_new_tokens`), so that every step allocates the same.

Each logged step's `generation_phase_peak_bytes` and `training_phase_peak_bytes` sit in the entry
that holds TRL's `reward` (and `kl`, with `beta > 0`), and equal what the profiler records of the
same phase of a fresh trainer's first step (`profiled_run_peak`: its allocations and frees replayed),
run here by hand as `Trainer.train()` runs it; the bytes themselves are asserted as measured, and
against the plan's phase peaks (`trainer-memcb estimate --trainer grpo`) minus the same start. Steps
that are not logged install nothing; the wrappers and the counter are gone after `train()`, whether
it returns or raises."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
from torch.utils._python_dispatch import _get_current_dispatch_mode

from helpers import installed_version, profiled_peak, profiled_run_peak
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.figures import GENERATION_PHASE_PEAK_BYTES, PHASE_KEYS, TRAINING_PHASE_PEAK_BYTES
from trainer_memcb.training.generation_phases import WRAPPER_MARK

pytestmark = pytest.mark.usefixtures("one_torch_thread")

trl = pytest.importorskip("trl", reason="TRL is in the test extra; without it its trainers cannot be tried")
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import training.test_trl as trl_tests  # noqa: E402

PROMPTS = ["the cat sa", "a dog ran ", "hello ther", "good day t"]
BATCH, GENERATIONS, COMPLETION = 4, 4, 8
WRAPPED = ("training_step", "_prepare_inputs", "_generate_and_score_completions")
# The releases the bytes below were measured with; elsewhere only the comparison with the profiler runs.
MEASURED_RELEASES = (installed_version("torch") or (0,))[:2] == (2, 13) and \
    (installed_version("transformers") or (0,))[:2] == (5, 25) and (installed_version("trl") or (0,))[:2] == (1, 16)


def _distinct_characters(completions: List[str], **_: Any) -> List[float]:
    return [float(len(set(completion))) for completion in completions]


def _config(tmp: str, trainer: str, beta: float, **extra: Any) -> Any:
    from trl import GRPOConfig, RLOOConfig

    config = GRPOConfig if trainer == "grpo" else RLOOConfig
    return config(tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                  per_device_train_batch_size=BATCH, num_generations=GENERATIONS, max_completion_length=COMPLETION,
                  beta=beta, generation_kwargs={"min_new_tokens": COMPLETION}, **extra)


def _trainer(folder: str, tmp: str, trainer: str = "grpo", beta: float = 0.1, callbacks: Any = (),
             reward: Any = _distinct_characters, **extra: Any) -> Any:
    from trl import GRPOTrainer, RLOOTrainer

    kind = GRPOTrainer if trainer == "grpo" else RLOOTrainer
    return kind(model=folder, reward_funcs=reward, args=_config(tmp, trainer, beta, **extra),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=trl_tests.char_tokenizer(),
                callbacks=list(callbacks))


class _Profiled(TrainerCallback):
    """The same run without the callback, each phase profiled inside `train()`: the first
    `_prepare_inputs` (the step that generates), and step 2, which trains on the buffered
    completions without generating (`num_iterations=2`), from `on_step_begin` to `on_step_end`."""

    def __init__(self, trainer: Any) -> None:
        self.peaks: Dict[str, int] = {}
        self.profile: Any = None
        generate_inputs = trainer._prepare_inputs

        def first_generation(*args: Any, **kwargs: Any) -> Any:
            del trainer.__dict__["_prepare_inputs"]  # once
            result: Dict[str, Any] = {}
            self.peaks[GENERATION_PHASE_PEAK_BYTES] = profiled_run_peak(
                lambda: result.setdefault("inputs", generate_inputs(*args, **kwargs)))
            return result["inputs"]

        trainer._prepare_inputs = first_generation

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == 2:
            from torch.profiler import ProfilerActivity, profile

            self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profile.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profile is not None:
            self.profile.stop()
            self.peaks[TRAINING_PHASE_PEAK_BYTES], self.profile = profiled_peak(self.profile), None


def _profiled_run(folder: str, tmp: str, trainer_kind: str, beta: float) -> Dict[str, int]:
    trainer = _trainer(folder, tmp, trainer_kind, beta, max_steps=2, logging_steps=1, num_iterations=2)
    profiled = _Profiled(trainer)
    trainer.add_callback(profiled)
    trainer.train()
    return profiled.peaks


class _Watch(TrainerCallback):
    """After the callback, in each step (its optimizer step about to run): whether the Trainer's
    methods are wrapped and a dispatch mode is entered, by step."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.seen: Dict[int, Any] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wrapped = tuple(name for name in WRAPPED if getattr(self.trainer.__dict__.get(name), WRAPPER_MARK, False))
        self.seen[state.global_step + 1] = (wrapped, type(_get_current_dispatch_mode()).__name__)


def _assert_nothing_left(trainer: Any) -> None:
    assert not set(WRAPPED) & set(trainer.__dict__)  # the class's methods again
    assert _get_current_dispatch_mode() is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> str:
    return trl_tests.saved_tiny_llama(str(tmp_path_factory.mktemp("phases-llama")))


# Measured (torch 2.13, transformers 5.25, TRL 1.16): each phase's figure, and how many bytes the
# profiler records above it for the same phase of the same run. The training phase: 10_112 bytes
# more in the profile, the kernels' own buffers at the backward's peak, which no operation returns
# (the plan test's real training phase holds them too: tests/plan/test_grpo_step.py).
CASES = {
    ("grpo", 0.1): ({GENERATION_PHASE_PEAK_BYTES: 4_554_188, TRAINING_PHASE_PEAK_BYTES: 4_593_332},
                    {GENERATION_PHASE_PEAK_BYTES: 0, TRAINING_PHASE_PEAK_BYTES: 10_112}),
    ("grpo", 0.0): ({GENERATION_PHASE_PEAK_BYTES: 4_554_188, TRAINING_PHASE_PEAK_BYTES: 4_593_332},
                    {GENERATION_PHASE_PEAK_BYTES: 0, TRAINING_PHASE_PEAK_BYTES: 10_112}),
    ("rloo", 0.1): ({GENERATION_PHASE_PEAK_BYTES: 4_554_180, TRAINING_PHASE_PEAK_BYTES: 4_593_332},
                    {GENERATION_PHASE_PEAK_BYTES: 0, TRAINING_PHASE_PEAK_BYTES: 10_112}),
}


@pytest.mark.parametrize("trainer_kind,beta", sorted(CASES), ids=lambda value: str(value))
def test_logged_entries_carry_each_phase_peak_beside_the_reward(folder: str, tmp_path: Any, trainer_kind: str,
                                                              beta: float) -> None:
    """Steps 1 and 3 generate (`num_iterations=2`), 2 trains on the buffer; 1 and 2 are logged."""
    watch = _Watch()
    trainer = _trainer(folder, str(tmp_path / "run"), trainer_kind, beta,
                       callbacks=[OptimizerMemoryCallback(what_if=()), watch],
                       max_steps=3, logging_steps=2, logging_first_step=True, num_iterations=2)
    watch.trainer = trainer
    trainer.train()
    first, second = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert (first["step"], second["step"]) == (1, 2)  # step 3 is not logged
    # Beside TRL's own figures, in the same entry: the generation's where TRL logs its reward.
    # GRPO's KL is logged as its loss computes it, RLOO's as it scores the completions.
    assert isinstance(first["reward"], float) and ("kl" in first) == (beta > 0)
    assert ("kl" in second) == (beta > 0 and trainer_kind == "grpo")
    assert "reward" not in second and GENERATION_PHASE_PEAK_BYTES not in second
    assert second[TRAINING_PHASE_PEAK_BYTES] == first[TRAINING_PHASE_PEAK_BYTES]  # every step trains alike
    logged = {key: first[key] for key in PHASE_KEYS}
    profiled = _profiled_run(folder, str(tmp_path / "profiled"), trainer_kind, beta)
    expected, difference = CASES[(trainer_kind, beta)]
    assert {key: profiled[key] - logged[key] for key in PHASE_KEYS} == difference
    if MEASURED_RELEASES:
        assert logged == expected
    # The closing entry carries the reward of step 3's generation, and no figure of a step not logged.
    closing = trainer.state.log_history[-1]
    assert "train_runtime" in closing and not set(PHASE_KEYS) & set(closing)
    # Installed on the logged steps only, and nothing left once train() returned.
    assert watch.seen == {1: (WRAPPED, "AllocatedStorages"), 2: (WRAPPED, "AllocatedStorages"),
                          3: ((), "NoneType")}
    _assert_nothing_left(trainer)
