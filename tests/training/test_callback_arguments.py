"""`OptimizerMemoryCallback`'s arguments that name things read alike: a list, one comma string,
None for none, a name given twice counts once, an unknown name or a number is a ValueError naming
it and the allowed ones. One test per argument and rule. And the class docstring's key table
lists every key the figures' table knows."""

from __future__ import annotations

import doctest
import importlib
import re

import pytest

from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.plan.optimizers.whatif import optimizer_names
from trainer_memcb.training.figures import BREAKDOWN_KEY_DESCRIPTIONS, KEY_DESCRIPTIONS, key_names
from trainer_memcb.training.monitor import BREAKDOWNS

# argument -> (two allowed names, the attribute the callback keeps them in, the allowed list named
# in the error)
ARGUMENTS = {
    "breakdown": (("key", "dtype"), "breakdown", sorted(BREAKDOWNS)),
    "what_if": (("adamw_torch", "adafactor"), "what_if_optimizers", sorted(optimizer_names())),
    "eval_keys": (("optimizer_state_bytes", "model_params_bytes"), "eval_keys", sorted(key_names())),
    "train_keys": (("optimizer_state_bytes", "model_params_bytes"), "train_keys", sorted(key_names())),
}


def kept(argument: str, value) -> tuple:
    return getattr(OptimizerMemoryCallback(**{argument: value}), ARGUMENTS[argument][1])


@pytest.mark.parametrize("argument", ARGUMENTS)
def test_a_list_is_kept_in_its_order(argument):
    (first, second), _, _ = ARGUMENTS[argument]
    assert kept(argument, [second, first]) == (second, first)


@pytest.mark.parametrize("argument", ARGUMENTS)
def test_a_comma_string_reads_as_the_list(argument):
    (first, second), _, _ = ARGUMENTS[argument]
    assert kept(argument, f"{first}, {second}") == (first, second)
    assert kept(argument, first) == (first,)


@pytest.mark.parametrize("argument", ARGUMENTS)
def test_none_an_empty_tuple_and_an_empty_string_are_none(argument):
    assert kept(argument, None) == kept(argument, ()) == kept(argument, "") == ()


@pytest.mark.parametrize("argument", ARGUMENTS)
def test_a_name_given_twice_counts_once(argument):
    (first, second), _, _ = ARGUMENTS[argument]
    assert kept(argument, (first, second, first)) == (first, second)
    assert kept(argument, f"{first},{first}") == (first,)


@pytest.mark.parametrize("argument", ARGUMENTS)
def test_an_unknown_name_is_refused_naming_it_and_the_allowed_ones(argument):
    (first, _), _, allowed = ARGUMENTS[argument]
    with pytest.raises(ValueError, match=re.escape(f"{argument}='shape' is not one of {allowed}")):
        OptimizerMemoryCallback(**{argument: (first, "shape")})
    with pytest.raises(ValueError, match=re.escape(f"{argument}='shape' is not one of {allowed}")):
        OptimizerMemoryCallback(**{argument: f"{first},shape"})
    with pytest.raises(ValueError, match=re.escape(f"{argument}=3 is not one of {allowed}")):
        OptimizerMemoryCallback(**{argument: (first, 3)})


@pytest.mark.parametrize("argument", ARGUMENTS)
def test_a_number_is_refused_naming_it_and_the_allowed_ones(argument):
    _, _, allowed = ARGUMENTS[argument]
    with pytest.raises(ValueError, match=re.escape(f"{argument}=7: expected some of {allowed}")):
        OptimizerMemoryCallback(**{argument: 7})


@pytest.mark.parametrize("argument", ["eval_keys", "train_keys"])
def test_the_key_presets(argument):
    assert kept(argument, "all") is None  # every key the run has
    # The optimizer pair, and in evaluation entries what the evaluation's containers held.
    assert kept(argument, "short") == ("optimizer_state_bytes", "optimizer_state_estimate_bytes",
                                       "containers_device_bytes", "containers_host_bytes")
    with pytest.raises(ValueError, match=re.escape("or one of ['all', 'short']")):
        OptimizerMemoryCallback(**{argument: "most"})


def test_the_defaults_short_evaluation_entries_and_full_training_entries():
    callback = OptimizerMemoryCallback()
    assert callback.eval_keys == ("optimizer_state_bytes", "optimizer_state_estimate_bytes",
                                  "containers_device_bytes", "containers_host_bytes")
    assert callback.train_keys is None


def test_what_if_aliases_resolve_to_the_trainers_names_once():
    assert kept("what_if", "adamw,adamw_torch") == ("adamw_torch",)


def test_the_class_docstring_lists_every_key_of_the_figures_table():
    documented = re.findall(r"^\s*\| `([^`]+)` \| (?:bytes|values|parameters) \|", OptimizerMemoryCallback.__doc__,
                            flags=re.MULTILINE)
    assert len(documented) == len(set(documented))
    assert set(documented) == set(KEY_DESCRIPTIONS) | set(BREAKDOWN_KEY_DESCRIPTIONS)


@pytest.mark.parametrize("module", ["trainer_memcb.utils.name_lists", "trainer_memcb.training.figures"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted >= 1 and result.failed == 0
