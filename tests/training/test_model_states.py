"""The four model states measured during training (one process here; torchrun jobs in
test_distributed.py): parameters, gradients before the step, their sum with the optimizer state,
and the plan's figure beside it."""

from __future__ import annotations

import doctest
import warnings

import pytest
import torch
from torch import nn
from transformers import Trainer

import trainer_memcb.training.model_states_probe
from helpers import TinyDataset, scratch_folder, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger
from trainer_memcb.training.model_states_probe import (
    ModelStatesProbe, detect_setup, measure_grads_bytes, measure_params_bytes, tap_zero_gradients,
)

KEYS = ("model_params_bytes", "model_grads_bytes", "model_states_bytes", "model_states_total_bytes",
        "model_states_estimate_bytes", "model_states_estimate_total_bytes")


def test_docstring_examples_run():
    result = doctest.testmod(trainer_memcb.training.model_states_probe)
    assert result.attempted >= 1 and result.failed == 0


def test_tied_weights_count_once():
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    assert measure_params_bytes(model) == 40 * 4


def test_parameters_that_are_views_of_one_flat_buffer_count_it_once():
    # As ZeRO-1/2 flattens a group: every parameter a view into one buffer, which counts once, whole.
    flat = torch.zeros(10)
    model = nn.Module()
    model.first, model.second = nn.Parameter(flat[:6]), nn.Parameter(flat[6:])
    assert model.first.untyped_storage().data_ptr() == model.second.untyped_storage().data_ptr()
    assert measure_params_bytes(model) == 10 * 4


def test_meta_parameters_and_gradients_hold_nothing():
    real, meta = nn.Linear(4, 2), nn.Linear(4, 3, device="meta")
    meta.weight.grad = torch.empty(3, 4, device="meta")
    real(torch.ones(1, 4)).sum().backward()
    model = nn.ModuleDict({"real": real, "meta": meta})
    assert measure_params_bytes(model) == measure_grads_bytes(model) == (8 + 2) * 4


def test_zero3_partitioned_parameters_count_by_their_partitions():
    # Stand-ins for DeepSpeed ZeRO-3 parameters (deepspeed is not installable here): an empty (0,)
    # tensor with the real shape in ds_shape and this rank's values in ds_tensor.
    layer = nn.Linear(4, 7)
    for name, partition_numel in (("weight", 14), ("bias", 4)):
        param = getattr(layer, name)
        stand_in = nn.Parameter(torch.empty(0))
        stand_in.ds_shape, stand_in.ds_numel = param.shape, param.numel()
        stand_in.ds_tensor = torch.zeros(partition_numel)
        setattr(layer, name, stand_in)
    assert measure_params_bytes(layer) == (14 + 4) * 4


class ZeroStage2StandIn:
    """Shaped like DeepSpeed's `DeepSpeedZeroOptimizer` (ZeRO-2) by the attributes read here, and
    freeing its gradients inside `step` as it does; DeepSpeed's own runs are in test_distributed.py."""

    def __init__(self, model: nn.Module) -> None:
        self.bit16_groups = [list(model.parameters())]
        self.single_partition_of_fp32_groups = [torch.zeros(30)]
        self.bit16_groups_flat = [torch.zeros(60, dtype=torch.bfloat16)]
        self.partition_gradients = True
        self.optimizer = torch.optim.AdamW(self.single_partition_of_fp32_groups)
        self.steps = 0

    def backward(self) -> None:  # the reduced partition: views of one buffer, and padding zeros
        buffer = torch.zeros(28, dtype=torch.bfloat16)
        self.averaged_gradients = {0: [buffer[:20], buffer[20:], torch.zeros(2, dtype=torch.bfloat16)]}

    def step(self) -> None:
        self.averaged_gradients = {0: None}  # freed before the inner step
        self.steps += 1


def test_zero12_gradients_are_measured_when_deepspeeds_step_begins():
    model = nn.Linear(2, 2)
    zero = ZeroStage2StandIn(model)
    assert detect_setup(model, zero).sharding == "zero2"
    assert detect_setup(model).sharding == "none"
    zero.backward()
    zero.step()
    with pytest.raises(LookupError, match="frees its gradients inside its step, and none were measured"):
        measure_grads_bytes(model, zero)  # nobody watched the step

    wanted = [False, True]  # by the steps taken so far: the second step is measured, the third not
    stop = tap_zero_gradients(zero, lambda: wanted[zero.steps % 2])
    assert "step" in vars(zero)
    zero.backward()
    zero.step()
    assert zero.steps == 2  # the step ran
    assert measure_grads_bytes(model, zero) == 28 * 2 + 2 * 2  # the buffer and the zeros, each once
    zero.averaged_gradients = {0: [torch.zeros(5, dtype=torch.bfloat16)]}
    zero.step()  # not wanted: nothing measured, the last figure stays
    assert measure_grads_bytes(model, zero) == 60
    stop()
    assert "step" not in vars(zero) and zero.step() is None and zero.steps == 4
    # A second owner on the same optimizer shares the wrapper; the last one out removes it.
    stops = [tap_zero_gradients(zero, lambda: True) for _ in range(2)]
    stops[0]()
    assert "step" in vars(zero)
    stops[1]()
    assert "step" not in vars(zero)
    assert tap_zero_gradients(torch.optim.AdamW(model.parameters()), lambda: True) is None  # no ZeRO: nothing


def test_zero12_gradients_are_measured_when_one_of_two_owners_wants_them():
    # A Trainer callback and a loop logger on one ZeRO optimizer: the one that wants this step decides.
    model = nn.Linear(2, 2)
    zero = ZeroStage2StandIn(model)
    stops = [tap_zero_gradients(zero, lambda: False), tap_zero_gradients(zero, lambda: True)]
    zero.backward()
    zero.step()
    assert measure_grads_bytes(model, zero) == 28 * 2 + 2 * 2
    for stop in stops:
        stop()
    assert "step" not in vars(zero)


def test_trainer_logs_model_states_equal_to_the_plan():
    model = tiny_classifier()
    trainer = Trainer(model=model, args=training_args(scratch_folder("unused"), max_steps=2, logging_steps=1),
                      train_dataset=TinyDataset(16), callbacks=[OptimizerMemoryCallback(what_if=(), summary_file=None)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [str(w.message) for w in caught if str(w.message).startswith("trainer_memcb")]
    # 3,714 fp32 values: 14,856 bytes of weights, as many of gradients, 29,808 of AdamW state.
    # One process: no `..._total_bytes` keys, which would only repeat the per-process ones.
    expected = {"model_params_bytes": 14_856, "model_grads_bytes": 14_856, "model_states_bytes": 59_520,
                "model_states_estimate_bytes": 59_520}
    training = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(training) == 2
    for entry in training:
        assert {key: entry[key] for key in KEYS if key in entry} == expected


def test_loop_logger_takes_the_gradients_before_the_step_even_after_zero_grad():
    model = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    memory = OptimizerMemoryLogger(optimizer, model=model)
    without_model = OptimizerMemoryLogger(optimizer)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients are gone: they were measured in the step's pre-hook
        figures = memory()
        assert not any(key.startswith("model_") for key in without_model())
        assert {key: figures[key] for key in KEYS if key in figures} == {  # one process: no totals
            "model_params_bytes": 236, "model_grads_bytes": 236, "model_states_bytes": 236 + 236 + 488,
            "model_states_estimate_bytes": 960}


def test_no_measurement_before_a_step_means_no_model_states_figures():
    probe = ModelStatesProbe()
    assert probe.figures({"optimizer_state_bytes": 88}) == {} and not probe.measured


class ParametersFail(nn.Module):
    """A model whose parameters cannot be listed: measuring it raises."""

    def parameters(self, recurse: bool = True):
        raise RuntimeError("no parameters today")


def test_a_failing_measurement_warns_once_and_leaves_the_model_states_out():
    layer = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    memory = OptimizerMemoryLogger(optimizer, model=ParametersFail())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            layer(torch.ones(1, 4)).sum().backward()
            optimizer.step()  # the pre-hook measures, fails, warns; the step still happens
            figures = memory()
            assert figures["optimizer_state_bytes"] == 88
            assert not any(key.startswith("model_") for key in figures)
    messages = [str(w.message) for w in caught if str(w.message).startswith("trainer_memcb")]
    assert messages == ["trainer_memcb: measuring the parameters and gradients failed "
                        "(RuntimeError('no parameters today')); the model-states figures are left out"]
