"""The estimate command's request (`trainer_memcb.cli.estimate_request`): one typed field per
option, read once from the parsed options, frozen, and the parsed options left as they were."""

import argparse
import dataclasses
from typing import Any

import pytest

from trainer_memcb.cli import parser
from trainer_memcb.cli.estimate_command import estimate_command
from trainer_memcb.cli.estimate_options import add_estimate_arguments
from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.plan.device.gpus import gpu_preset


def _estimate_actions() -> dict:
    estimate = argparse.ArgumentParser()
    add_estimate_arguments(estimate)
    return {action.dest: action for action in estimate._actions if action.dest != "help"}


def test_the_request_has_a_field_for_each_option_with_its_default() -> None:
    actions = _estimate_actions()
    fields = {item.name: item for item in dataclasses.fields(EstimateRequest)}
    # Every option, the top-level --debug, and the plans asked (read from the options).
    assert set(fields) == set(actions) | {"debug", "questions"}
    for name, action in actions.items():
        if fields[name].default is not dataclasses.MISSING:
            assert fields[name].default == action.default or (name == "allow" and action.default == []), name
    assert [name for name, item in fields.items() if item.default is dataclasses.MISSING] == ["model", "optimizers"]


def test_the_gpus_memory_is_the_requests_unless_the_device_memory_is_given() -> None:
    args = parser().parse_args(["estimate", "7.5e9", "--gpu", "t4"])
    request = EstimateRequest.of(args)
    assert request.device_memory == gpu_preset("t4").total_bytes == 15_843_721_216
    assert request.questions.plan and not request.questions.step and not request.questions.evaluation
    given = EstimateRequest.of(parser().parse_args(["estimate", "7.5e9", "--gpu", "t4", "--device-memory", "8GiB"]))
    assert given.device_memory == 8 * 2**30
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.device_memory = 1  # type: ignore[misc]


def test_the_command_leaves_the_parsed_options_unchanged(capsys: Any) -> None:
    args = parser().parse_args(["estimate", "1e6", "--gpu", "t4", "--optimizers", "adamw"])
    before = dict(vars(args))
    assert estimate_command(args) == 0
    assert vars(args) == before  # the GPU's memory and the resolved optimizer names are the request's alone
    assert "adamw_torch" in capsys.readouterr().out
