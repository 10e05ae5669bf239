"""The reference model's figure at the probe and the monitor: storages shared with the policy are
the policy's, the plan counts a frozen copy, a reference that cannot be measured warns once and
is left out. The TRL trainers that hold one run in test_trl.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from trainer_memcb.training.model_states_probe import ModelStatesProbe, measure_reference_model_bytes
from trainer_memcb.training.monitor import OptimizerStateMonitor


def stepped(model: nn.Module) -> ModelStatesProbe:
    probe = ModelStatesProbe()
    model(torch.ones(1, 4)).sum().backward()
    probe.before_step(model)
    return probe


def test_a_reference_sharing_a_storage_with_the_policy_counts_only_its_own():
    policy = nn.Linear(4, 2)  # 8 + 2 fp32 values
    reference = nn.Linear(4, 2)
    assert measure_reference_model_bytes(reference, policy) == 40
    reference.weight = policy.weight
    assert measure_reference_model_bytes(reference, policy) == 8  # the bias alone
    assert measure_reference_model_bytes(reference) == 40  # no policy named: everything


def test_the_probe_adds_the_reference_to_both_sums():
    policy = nn.Linear(4, 2)
    probe = stepped(policy)
    optimizer_figures = {"optimizer_state_bytes": 88, "optimizer_state_estimate_bytes": 88}
    without = probe.figures(optimizer_figures)
    reference = nn.Linear(4, 2)
    probe.reference_model(reference, policy)
    assert probe.figures(optimizer_figures) == {
        "model_params_bytes": 40, "model_grads_bytes": 40,
        "model_states_bytes": without["model_states_bytes"] + 40,
        "model_states_estimate_bytes": without["model_states_estimate_bytes"] + 40,
        "reference_model_params_bytes": 40,
    }
    # Shared with the policy: measured without the shared weight, planned as a whole frozen copy.
    shared = nn.Linear(4, 2)
    shared.weight = policy.weight
    probe.reference_model(shared, policy)
    figures = probe.figures(optimizer_figures)
    assert figures["reference_model_params_bytes"] == 8
    assert figures["model_states_bytes"] == without["model_states_bytes"] + 8
    assert figures["model_states_estimate_bytes"] == without["model_states_estimate_bytes"] + 40
    # None: the trainer holds no reference model (PEFT, GRPO with beta=0).
    probe.reference_model(None, policy)
    assert probe.figures(optimizer_figures) == without


class Unmeasurable(nn.Module):
    def parameters(self, recurse: bool = True):
        raise RuntimeError("no parameters here")


def test_a_reference_that_cannot_be_measured_warns_once_and_is_left_out():
    policy = nn.Linear(4, 2)
    monitor = OptimizerStateMonitor()
    monitor.attach(torch.optim.AdamW(policy.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.reference_model(Unmeasurable(), policy)
        monitor.reference_model(Unmeasurable(), policy)
    messages = [str(warning.message) for warning in caught if "reference model" in str(warning.message)]
    assert len(messages) == 1 and "reference_model_params_bytes is left out" in messages[0]
    assert "reference_model_params_bytes" not in monitor.figures(step=1)


@pytest.mark.parametrize("not_a_model", [None, "ref", 3])
def test_anything_but_a_module_is_no_reference(not_a_model):
    policy = nn.Linear(4, 2)
    probe = stepped(policy)
    probe.reference_model(not_a_model, policy)
    assert "reference_model_params_bytes" not in probe.figures({"optimizer_state_bytes": 88})
