"""A functional collective's result taken as the real process holds it: set for the time of a
traced tensor-parallel or context-parallel step, and given back on every path, a failing trace's
among them."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist
import torch.distributed._functional_collectives as ft_c

from helpers import requires_torch

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.collective_results import results_as_returned, take_results_as_returned

sys.path.insert(0, os.path.dirname(__file__))
from test_engines import build  # noqa: E402

ORIGINAL = ft_c._maybe_wrap_tensor  # torch's, as this module is imported


def test_nested_uses_give_back_what_each_found():
    undo = take_results_as_returned()
    taken = ft_c._maybe_wrap_tensor
    assert taken is not ORIGINAL
    with results_as_returned():
        assert ft_c._maybe_wrap_tensor is taken
    assert ft_c._maybe_wrap_tensor is taken
    undo()
    undo()  # a second undo changes nothing
    assert ft_c._maybe_wrap_tensor is ORIGINAL


def test_an_error_inside_gives_the_wrapper_back():
    with pytest.raises(KeyError):
        with results_as_returned():
            raise KeyError("inside")
    assert ft_c._maybe_wrap_tensor is ORIGINAL


def _failing_in_the_forward():
    model = build()

    def fail(*_):
        raise RuntimeError("a layer that fails in the forward")

    model.model.layers[0].mlp.register_forward_hook(fail)
    return model


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("parallelism", ["tp=2", "tp=2,dp_shard=2"])
def test_a_tensor_parallel_trace_that_fails_gives_everything_back(parallelism):
    settings = resolve_settings(parallelism=parallelism, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(_failing_in_the_forward, seq_len=16, settings=settings, device_type="cpu",
                               model_states=False)
    assert "a layer that fails in the forward" in plan.step.problem
    assert ft_c._maybe_wrap_tensor is ORIGINAL
    assert not dist.is_initialized()
