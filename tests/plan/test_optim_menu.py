"""Every optimizer the Trainer offers, exact: each `transformers.training_args.OptimizerNames`
value through a real Trainer (tiny model, 3 steps, evaluation with accuracy), the callback's
measured bytes against an independent count of what the optimizer holds, and the estimate against
the measured bytes.

A name runs here, or skips for a reason stated in `SKIP_REASONS`; a name in neither (a future
transformers adding one) fails until it has a rule or a stated reason.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import pytest
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification, Trainer
from transformers.training_args import OptimizerNames

from helpers import SEQUENCE_LENGTH, TinyDataset, accuracy_and_f1, optimi_picks_triton, training_args
from reference_walker import held_bytes
from trainer_memcb import OptimizerMemoryCallback, estimate_optimizer_state, measure_optimizer_state
from trainer_memcb.training.figures import ESTIMATE_BYTES, MEASURED_BYTES

# Names whose optimizer cannot run on this machine's CPU-only torch, and why. A rule for the
# CUDA-only ones is still checked against its source, on CPU stand-ins, in the tests named.
SKIP_REASONS: Dict[str, str] = {
    "adamw_torch_xla": "needs torch_xla (a TPU runtime)",
    "adamw_torch_npu_fused": "needs torch_npu (an Ascend NPU)",
    "adamw_anyprecision": "needs torchdistx, which has no build for this torch",
    "galore_adamw_8bit": "CUDA only: galore_torch AdamW8bit.step calls torch.cuda.synchronize() "
    "(rule checked on a CPU stand-in: test_galore_adamw8bit_on_a_cpu_stand_in)",
    "galore_adamw_8bit_layerwise": "CUDA only: galore_torch AdamW8bit.step calls torch.cuda.synchronize() "
    "(rule checked on a CPU stand-in: test_galore_adamw8bit_on_a_cpu_stand_in)",
    "galore_adafactor_layerwise": "transformers 5.24 builds each layer's GaLoreAdafactor with lr and without "
    "relative_step=False, which Adafactor refuses (rule checked by test_galore_adafactor_variants)",
    "adalomo": "CUDA only: AdaLomo.__init__ puts its state on .cuda() "
    "(rule checked on a CPU stand-in: test_adalomo_on_a_cpu_stand_in)",
}
if optimi_picks_triton():
    SKIP_REASONS["stable_adamw"] = (
        "torch-optimi 0.3.3's StableAdamW takes its Triton kernels whenever Triton imports (a CUDA build of "
        "torch), and they cannot step CPU tensors (rule checked on the state made before the kernel launch: "
        "test_torch_optimi[StableAdamW])")
if "adamw_apex_fused" in {name.value for name in OptimizerNames}:  # transformers 4.x only
    SKIP_REASONS["adamw_apex_fused"] = "needs NVIDIA apex (a CUDA build of its own), not installed here"

# Names that need settings beyond the optimizer's name: GaLore and APOLLO project only the
# parameters of `optim_target_modules`, here every Linear layer, at a rank below their size.
_LOW_RANK = {"optim_target_modules": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"], "optim_args": "rank=4"}
EXTRA_ARGS: Dict[str, Dict[str, Any]] = {
    name.value: _LOW_RANK for name in OptimizerNames if name.value.startswith(("galore_", "apollo_"))
}

# Names whose optimizer keeps no state at all: 0 bytes once stepped.
STATELESS = {"sgd", "lomo"}

TRAIN_STEPS = 3


def menu_model(seed: int = 0) -> DistilBertForSequenceClassification:
    """A 2-label DistilBERT whose word embeddings (256 x 16) and feed-forward matrices (16 x 256,
    256 x 16) hold 4096 values each: just enough for bitsandbytes' and torchao's 8-bit and 4-bit
    state (4096 values and up; the Trainer keeps bitsandbytes' embedding state 32-bit)."""
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=256, dim=16, n_layers=1, n_heads=2, hidden_dim=256,
        max_position_embeddings=SEQUENCE_LENGTH, num_labels=2,
    )
    return DistilBertForSequenceClassification(config)


def run_menu_name(name: str, tmp_path) -> Dict[str, Any]:
    model = menu_model()
    args = training_args(
        str(tmp_path), optim=name, max_steps=TRAIN_STEPS, eval_strategy="steps", eval_steps=TRAIN_STEPS,
        eval_on_start=True, **EXTRA_ARGS.get(name, {}),
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=TinyDataset(size=16), eval_dataset=TinyDataset(size=8, seed=1),
        compute_metrics=accuracy_and_f1, callbacks=[OptimizerMemoryCallback(what_if=())],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    optimizer = trainer.optimizer.optimizer  # what the Trainer built, inside accelerate's wrapper
    return {
        "model": model,
        "optimizer": optimizer,
        "log_history": trainer.state.log_history,
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("trainer_memcb")],
    }


def test_every_name_has_a_run_or_a_reason() -> None:
    assert set(SKIP_REASONS) <= {name.value for name in OptimizerNames}, "a reason for a name that is gone"


# torchao's 4-bit AdamW compiles its step with inductor on the first call (a C++ build): a minute here.
SLOW_NAMES = {"adamw_torch_4bit"}


@pytest.mark.parametrize("name", [pytest.param(name.value, marks=[pytest.mark.slow] if name.value in SLOW_NAMES else [])
                                  for name in OptimizerNames])
def test_optimizer_name_is_exact_through_the_trainer(name: str, tmp_path) -> None:
    if name in SKIP_REASONS:
        pytest.skip(SKIP_REASONS[name])
    run = run_menu_name(name, tmp_path)
    optimizer, model = run["optimizer"], run["model"]

    measured = measure_optimizer_state(optimizer).num_bytes
    estimate = estimate_optimizer_state(optimizer)
    assert estimate is not None, f"{name}: no estimate rule for {type(optimizer).__qualname__}"
    assert measured == held_bytes(optimizer, model)
    assert estimate.num_bytes == measured
    if name in STATELESS:
        assert measured == 0
    assert run["warnings"] == []

    history: List[Dict[str, Any]] = run["log_history"]
    evaluations = [entry for entry in history if "eval_accuracy" in entry]
    assert [entry["step"] for entry in evaluations] == [0, TRAIN_STEPS]
    before, after = evaluations
    # Before the first optimizer step: the estimate, and no measured claim.
    assert MEASURED_BYTES not in {key[len("eval_"):] for key in before}
    assert before[f"eval_{ESTIMATE_BYTES}"] == estimate.num_bytes
    # After it: the measured bytes beside the accuracy, in the same entry.
    assert (after[f"eval_{MEASURED_BYTES}"], after[f"eval_{ESTIMATE_BYTES}"]) == (measured, measured)
    training = [entry for entry in history if "loss" in entry]
    assert [(entry["step"], entry[MEASURED_BYTES]) for entry in training] == [
        (step, measured) for step in range(1, TRAIN_STEPS + 1)
    ]


@pytest.mark.parametrize("name", sorted(STATELESS))
def test_stateless_optimizers_log_zero_after_the_first_step_and_nothing_before(name: str, tmp_path) -> None:
    import json

    from trainer_memcb.training.summary import SUMMARY_FILE_NAME

    run = run_menu_name(name, tmp_path)
    history = run["log_history"]
    before = [entry for entry in history if entry["step"] == 0]
    after = [entry for entry in history if entry["step"] > 0 and ("loss" in entry or "eval_loss" in entry)]
    assert len(before) == 1 and "eval_accuracy" in before[0]
    assert [key for key in before[0] if "optimizer_state_bytes" in key] == []
    assert before[0]["eval_optimizer_state_estimate_bytes"] == 0
    assert len(after) == TRAIN_STEPS + 1
    assert all(entry.get(MEASURED_BYTES, entry.get(f"eval_{MEASURED_BYTES}")) == 0 for entry in after)
    with open(tmp_path / SUMMARY_FILE_NAME, encoding="utf-8") as handle:
        document = json.load(handle)
    assert (document["measured"]["num_bytes"], document["estimate"]["num_bytes"]) == (0, 0)


def test_the_loop_logger_logs_zero_for_plain_sgd() -> None:
    from trainer_memcb import OptimizerMemoryLogger

    model = menu_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = OptimizerMemoryLogger(optimizer)
    data = TinyDataset(size=4)
    model(input_ids=data.input_ids, labels=data.labels).loss.backward()
    optimizer.step()
    figures = memory()
    assert (figures[MEASURED_BYTES], figures[ESTIMATE_BYTES]) == (0, 0)
