"""Measured against estimate, judged: each likely cause shown by a real optimizer set up to show it.

Every test makes real state with a real optimizer step (bitsandbytes' 8-bit AdamW on the CPU, torch's
AdamW) and asserts the exact bytes: the difference, per state key, and per cause. The end-to-end
tests go through `OptimizerMemoryLogger` and a real `Trainer` and read the logged figure, the one
warning, the summary file and `trainer-memcb report` back.
"""

from __future__ import annotations

import doctest
import json
import warnings
from typing import Any, List

import pytest
import torch
from transformers import Trainer, get_constant_schedule

import trainer_memcb.state.judge
from helpers import TinyDataset, entries_with, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger, estimate_optimizer_state, measure_optimizer_state
from trainer_memcb.cli import main as cli_main
from trainer_memcb.training.figures import ESTIMATE_BYTES, MEASURED_BYTES, UNEXPECTED_BYTES
from trainer_memcb.state.judge import expect_state, judge_state


def one_step(model: torch.nn.Module, optimizer: Any, inputs: torch.Tensor) -> None:
    model(inputs).float().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def memcb_warnings(caught: List[warnings.WarningMessage]) -> List[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("trainer_memcb:")]


# -- 32-bit state where 8-bit was expected (bitsandbytes) ---------------------------------------


def test_bnb_override_after_the_estimate_gives_32bit_state_where_8bit_was_expected():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)  # weight: 8,192 values, 8-bit by default; bias: 64, 32-bit
    optimizer = bnb.optim.AdamW8bit(model.parameters())
    estimate, expectation = estimate_optimizer_state(optimizer), expect_state(optimizer)
    # bitsandbytes' documented override, made after the estimate: min_8bit_size above the weight's size.
    bnb.optim.GlobalOptimManager.get_instance().override_config(model.weight, "min_8bit_size", 2**40)
    one_step(model, optimizer, torch.ones(2, 128))

    measured = measure_optimizer_state(optimizer)
    # bitsandbytes makes its two 256-entry fp32 quantization maps at construction: measured as held
    # where the registry says the optimizer keeps them, else only inside an 8-bit parameter's state.
    maps = measured.bytes_by_key.get("qmap1", 0) + measured.bytes_by_key.get("qmap2", 0)
    assert maps in (0, 2 * 1024)
    judged = judge_state(optimizer, measured, estimate, expectation)
    # Expected: 2 x (8,192 uint8 codes + 32 fp32 scales) + the 2 maps, + the bias's 2 x 64 fp32
    # values. Held: 2 x 8,192 fp32 values, no scales.
    assert (judged.measured_bytes, judged.estimate_bytes) == (2 * 4 * 8192 + 2 * 4 * 64 + maps, 19_200)
    difference = 2 * 3 * 8192 - 2 * 128 - (2 * 1024 - maps)  # 46,848 without the maps, 48,896 with them
    assert judged.difference_bytes == difference
    missing_maps = {"qmap1": (0, 1024), "qmap2": (0, 1024)} if not maps else {}
    assert judged.bytes_by_key == {"state1": (33_024, 8_448), "state2": (33_024, 8_448), "absmax1": (0, 128),
                                   "absmax2": (0, 128), **missing_maps}
    assert judged.dtypes_by_key == {"state1": {"float32": 33_024}, "state2": {"float32": 33_024}}
    [cause] = judged.causes
    assert (cause.kind, cause.num_bytes, cause.num_params) == ("32bit_where_8bit", difference, 1)
    assert set(cause.state_keys) == {"state1", "state2", "absmax1", "absmax2", *missing_maps}
    assert cause.dtypes == ("float32",)
    assert f"32-bit state where 8-bit state was expected: +{difference:,} bytes" in judged.text()


def test_bnb_min_8bit_size_set_at_construction_is_what_the_rule_expects():
    # The rule reads min_8bit_size: 32-bit state asked for up front is no surprise.
    bnb = pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(128, 64)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=2**40)
    estimate, expectation = estimate_optimizer_state(optimizer), expect_state(optimizer)
    one_step(model, optimizer, torch.ones(2, 128))
    measured = measure_optimizer_state(optimizer)
    maps = measured.bytes_by_key.get("qmap1", 0) + measured.bytes_by_key.get("qmap2", 0)  # as above
    judged = judge_state(optimizer, measured, estimate, expectation)
    assert judged.agrees and judged.causes == () and judged.measured_bytes == 33_024 * 2 + maps


# -- a dtype other than the parameter's, through the custom-loop logger ----------------------------


def test_bf16_adamw_whose_moments_were_cast_to_fp32_holds_another_dtype_than_its_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    estimate = estimate_optimizer_state(optimizer)
    one_step(model, optimizer, torch.ones(4, 16, dtype=torch.bfloat16))
    for entry in optimizer.state.values():  # moments kept in fp32 for a bf16 model (torch's AdamW
        # cannot step so: lerp_ needs one dtype; the state is judged as it stands)
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg"].float(), entry["exp_avg_sq"].float()
    judged = judge_state(optimizer, measure_optimizer_state(optimizer), estimate)
    num_values = 16 * 8 + 8 + 8 * 2 + 2  # 154
    assert judged.estimate_bytes == 2 * 2 * num_values + 4 * 4  # bf16 moments + a 4-byte step per tensor: 632
    assert judged.difference_bytes == 2 * 2 * num_values == 616  # each moment value 4 bytes, not 2
    assert judged.bytes_by_key == {"exp_avg": (616, 308), "exp_avg_sq": (616, 308)}
    [cause] = judged.causes
    assert (cause.kind, cause.num_bytes, cause.state_keys, cause.dtypes, cause.param_dtypes, cause.num_params) == (
        "dtype_differs_from_param", 616, ("exp_avg", "exp_avg_sq"), ("float32",), ("bfloat16",), 4)


def test_bf16_sgd_with_fp32_momentum_warns_once_and_logs_the_difference(tmp_path):
    # SGD steps on with fp32 momentum for bf16 parameters (in-place adds cast), so this runs for real.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    memory = OptimizerMemoryLogger(optimizer)
    inputs = torch.ones(4, 16, dtype=torch.bfloat16)
    num_values = 154
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_step(model, optimizer, inputs)
        first = memory()
        for entry in optimizer.state.values():
            entry["momentum_buffer"] = entry["momentum_buffer"].float()
        one_step(model, optimizer, inputs)
        second = memory()
        one_step(model, optimizer, inputs)
        third = memory()
    assert (first[MEASURED_BYTES], first[ESTIMATE_BYTES], first[UNEXPECTED_BYTES]) == (308, 308, 0)
    assert (second[MEASURED_BYTES], second[UNEXPECTED_BYTES], third[UNEXPECTED_BYTES]) == (616, 308, 308)
    assert all(entry["momentum_buffer"].dtype == torch.float32 for entry in optimizer.state.values())
    [message] = memcb_warnings(caught)
    assert "holds 308 bytes (308 B) more than estimated (measured 616, estimate 308)" in message
    assert ("state in another dtype than its parameter's, where the rule expected the parameter's: +308 bytes "
            "(+308 B) (keys momentum_buffer; held as float32; parameters bfloat16; 4 parameter tensors)") in message

    path = memory.save_summary(str(tmp_path))
    with open(path, encoding="utf-8") as handle:
        judgement = json.load(handle)["judgement"]
    assert judgement["difference_bytes"] == 2 * num_values
    assert judgement["bytes_by_key"] == {"momentum_buffer": {"measured": 616, "estimate": 308}}
    assert [(c["kind"], c["num_bytes"], c["num_params"]) for c in judgement["causes"]] == [
        ("dtype_differs_from_param", 308, 4)]
    assert "likely causes:" in memory.summary() and "+308 bytes" in memory.summary()


# -- state the rule does not know ------------------------------------------------------------------


class AdamWWithEMA(torch.optim.AdamW):
    """AdamW that also keeps an exponential moving average of each parameter in its state: the
    AdamW rule (found through the base class) knows nothing of `ema`."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                entry = self.state[param]
                if "ema" not in entry:
                    entry["ema"] = param.detach().clone()
                entry["ema"].lerp_(param, 0.01)
        return loss


def test_a_subclass_that_keeps_more_state_shows_the_key_the_rule_does_not_know():
    model = torch.nn.Linear(4, 2)
    optimizer = AdamWWithEMA(model.parameters())
    memory = OptimizerMemoryLogger(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_step(model, optimizer, torch.ones(1, 4))
        figures = memory()
    assert (figures[MEASURED_BYTES], figures[ESTIMATE_BYTES], figures[UNEXPECTED_BYTES]) == (88 + 40, 88, 40)
    [message] = memcb_warnings(caught)
    assert ("state the rule does not know: +40 bytes (+40 B) (keys ema; held as float32; parameters float32; "
            "2 parameter tensors)") in message
    judged = memory.monitor.judgement(memory.optimizer_steps)
    assert judged.bytes_by_key == {"ema": (40, 0)}
    assert [(c.kind, c.num_bytes) for c in judged.causes] == [("unknown_state_key", 40)]


# -- state for a frozen parameter, through the Trainer ---------------------------------------------


def test_state_kept_for_a_parameter_frozen_before_the_trainer_warns_and_reaches_the_summary_and_report(tmp_path, capsys):
    # Two phases on one optimizer: every parameter trains one step, then the word embeddings are
    # frozen and the Trainer goes on. AdamW keeps their moments, which the estimate does not count.
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = TinyDataset(4)
    model(input_ids=batch.input_ids, labels=batch.labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    embeddings = model.distilbert.embeddings.word_embeddings.weight
    embeddings.requires_grad_(False)
    frozen_bytes = 2 * 4 * embeddings.numel() + 4  # 64 x 16 values: two fp32 moments and a step: 8,196

    trainer = Trainer(
        model=model, args=training_args(str(tmp_path), max_steps=2),
        train_dataset=TinyDataset(16), optimizers=(optimizer, get_constant_schedule(optimizer)),
        callbacks=[OptimizerMemoryCallback()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    entries = entries_with(trainer.state.log_history, UNEXPECTED_BYTES)
    assert [(entry["step"], entry[UNEXPECTED_BYTES]) for entry in entries] == [(1, frozen_bytes), (2, frozen_bytes)]
    assert entries[0][MEASURED_BYTES] - entries[0][ESTIMATE_BYTES] == frozen_bytes
    [message] = memcb_warnings(caught)
    assert ("state for parameters that do not train (requires_grad=False): +8,196 bytes (+8.0 KiB) "
            "(keys step, exp_avg, exp_avg_sq; held as float32; parameters float32; 1 parameter tensor)") in message

    with open(tmp_path / "optimizer_memory.json", encoding="utf-8") as handle:
        judgement = json.load(handle)["judgement"]
    assert judgement["difference_bytes"] == frozen_bytes
    assert [(c["kind"], c["num_bytes"]) for c in judgement["causes"]] == [("frozen_param_state", frozen_bytes)]

    assert cli_main(["report", str(tmp_path), "--no-plot"]) == 0
    printed = capsys.readouterr().out
    assert "state for parameters that do not train (requires_grad=False)" in printed
    assert "8,196" in printed
    assert cli_main(["report", str(tmp_path), "--no-plot", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["judgement"]["difference_bytes"] == frozen_bytes


def test_state_left_behind_by_a_parameter_taken_out_of_the_groups():
    # Two layers train; then the second leaves the optimizer's groups, its moments stay in the state.
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()])
    second(first(torch.ones(1, 4))).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["params"] = list(first.parameters())
    judged = judge_state(optimizer, measure_optimizer_state(optimizer), estimate_optimizer_state(optimizer))
    left_behind = 2 * 4 * (4 * 2 + 2) + 2 * 4  # the second layer's two moments and two steps: 88
    assert judged.difference_bytes == left_behind
    assert [(c.kind, c.num_bytes, c.num_params) for c in judged.causes] == [("state_for_other_tensors", 88, 2)]


def test_adagrad_state_for_frozen_parameters_is_expected_and_not_flagged():
    # Adagrad makes `step` and `sum` at construction for every parameter in its groups, frozen ones
    # included, and its rule says so (includes_frozen=True). One cast makes a difference to judge:
    # only the cast is a cause, never the frozen layer's state.
    frozen, trained = torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adagrad([*frozen.parameters(), *trained.parameters()])
    estimate, expectation = estimate_optimizer_state(optimizer), expect_state(optimizer)
    assert expectation.includes_frozen
    assert estimate.num_bytes == 4 * (4 * 4 + 4) + 4 * (4 * 2 + 2) + 4 * 4  # every `sum`, every `step`: 136
    one_step(torch.nn.Sequential(frozen, trained), optimizer, torch.ones(1, 4))
    measured = measure_optimizer_state(optimizer)
    assert judge_state(optimizer, measured, estimate, expectation).agrees
    optimizer.state[trained.bias]["sum"] = optimizer.state[trained.bias]["sum"].double()  # 2 values: +8 bytes
    judged = judge_state(optimizer, measure_optimizer_state(optimizer), estimate, expectation)
    assert judged.difference_bytes == 8
    assert [(c.kind, c.num_bytes, c.num_params) for c in judged.causes] == [("dtype_differs_from_param", 8, 1)]


def test_what_no_cause_accounts_for_is_unexplained_and_the_causes_add_up():
    # A tensor kept in the state outside any parameter's entry: measured, but in no entry the
    # causes are looked for in. It is the unexplained rest, so the causes still add up.
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    one_step(layer, optimizer, torch.ones(1, 4))
    optimizer.state["loss_scale"] = torch.ones(4)  # 16 bytes
    del optimizer.state[layer.bias]["exp_avg_sq"]  # -8 bytes, a missing key
    judged = judge_state(optimizer, measure_optimizer_state(optimizer), estimate_optimizer_state(optimizer))
    assert judged.difference_bytes == 8
    assert [(c.kind, c.num_bytes) for c in judged.causes] == [("unexplained", 16), ("missing_state_key", -8)]
    assert sum(cause.num_bytes for cause in judged.causes) == judged.difference_bytes


def test_agreeing_runs_log_zero_and_warn_nothing(tmp_path):
    model = tiny_classifier()
    trainer = Trainer(model=model, args=training_args(str(tmp_path), max_steps=2), train_dataset=TinyDataset(16),
                      callbacks=[OptimizerMemoryCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert [entry[UNEXPECTED_BYTES] for entry in entries_with(trainer.state.log_history, UNEXPECTED_BYTES)] == [0, 0]
    assert memcb_warnings(caught) == []
    with open(tmp_path / "optimizer_memory.json", encoding="utf-8") as handle:
        judgement = json.load(handle)["judgement"]
    assert judgement == {"measured_bytes": 29_808, "estimate_bytes": 29_808, "difference_bytes": 0,
                         "bytes_by_key": {}, "dtypes_by_key": {}, "causes": []}


def test_no_figure_until_every_trainable_parameter_has_state():
    # Only the first layer gets a gradient at first: its state alone is no measure of the estimate.
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()])
    memory = OptimizerMemoryLogger(optimizer)
    first(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert UNEXPECTED_BYTES not in memory()
    second(first(torch.ones(1, 4))).sum().backward()
    optimizer.step()
    assert memory()[UNEXPECTED_BYTES] == 0


def test_state_holding_less_than_estimated_logs_a_negative_difference():
    # measured minus estimate, signed: a moment missing from the state is a negative figure.
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    memory = OptimizerMemoryLogger(optimizer)
    one_step(layer, optimizer, torch.ones(1, 4))
    del optimizer.state[layer.weight]["exp_avg_sq"]  # 8 fp32 values
    with pytest.warns(RuntimeWarning, match="holds 32 bytes .* less than estimated"):
        figures = memory()
    assert figures[UNEXPECTED_BYTES] == figures[MEASURED_BYTES] - figures[ESTIMATE_BYTES] == -32


def test_docstring_example_runs():
    results = doctest.testmod(trainer_memcb.state.judge, optionflags=doctest.ELLIPSIS)
    assert (results.failed, results.attempted) == (0, 10)
