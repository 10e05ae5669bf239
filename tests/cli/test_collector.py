"""The collector in the `trainer-memcb` process (`trainer_memcb.cli.collector`), and the step
plan's freeze of the objects older than its trace."""

from __future__ import annotations

import gc

import pytest

from trainer_memcb.cli import collector
from trainer_memcb.cli.estimate_model import first_then_new
from trainer_memcb.utils.collector_scope import collecting_only_what_it_makes, freeze_older_objects


@pytest.fixture
def nothing_frozen():
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable()
    collector._paused[0] = False
    collector._froze[0] = False


def test_python_code_that_imports_the_cli_keeps_its_collector(nothing_frozen):
    assert collector.pause_while_importing() is False  # pytest is not the command's own process
    assert gc.isenabled()
    collector.freeze_what_was_imported()  # nothing was paused: nothing frozen
    assert gc.get_freeze_count() == 0


def test_the_command_pauses_the_collector_then_freezes_what_it_imported(nothing_frozen, monkeypatch):
    monkeypatch.setattr(collector, "this_process_is_the_command", lambda: True)
    assert collector.pause_while_importing() is True
    assert not gc.isenabled()
    collector.freeze_what_was_imported()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    collector.freeze_what_was_imported()  # once only
    assert freezes == []


def test_the_step_freezes_older_objects_only_when_the_program_froze_none(nothing_frozen):
    assert freeze_older_objects() is True
    frozen = gc.get_freeze_count()
    assert frozen > 0
    assert freeze_older_objects() is False  # frozen already (by the program): left as it is
    # Nothing more frozen (a frozen object may still die by its reference count: fewer, on 3.10).
    assert 0 < gc.get_freeze_count() <= frozen


def test_the_first_trace_gets_the_model_already_built_the_others_new_ones():
    built = []

    def build():
        built.append(object())
        return built[-1]

    first = object()
    builder = first_then_new(first, build)
    assert builder() is first and built == []
    second, third = builder(), builder()
    assert built == [second, third] and second is not third


def test_after_each_plan_the_command_freezes_what_it_keeps(nothing_frozen, monkeypatch):
    collector._froze[0] = False
    collector.freeze_what_the_plan_keeps()  # Python code that imports the CLI: its collector left alone
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(collector, "this_process_is_the_command", lambda: True)
    collector.pause_while_importing()
    collector.freeze_what_was_imported()
    frozen = gc.get_freeze_count()
    kept = [[index] for index in range(1000)]  # what a plan leaves, alive to the search's end
    collector.freeze_what_the_plan_keeps()
    assert gc.get_freeze_count() >= frozen + len(kept)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_block_s_own_cycles_are_collected_and_the_older_objects_unfrozen_after(nothing_frozen):
    import weakref

    older = _Cycle()
    with collecting_only_what_it_makes():
        assert gc.get_freeze_count() > 0  # the older objects, `older` among them, out of sight
        made = _Cycle()
        gone = weakref.ref(made)
        del made
    assert gone() is None  # collected at the block's end
    assert gc.get_freeze_count() == 0
    assert gc.is_tracked(older) and any(obj is older for obj in gc.get_objects())


def test_the_block_leaves_a_freeze_of_the_program_s_own_as_it_was(nothing_frozen):
    gc.freeze()
    frozen = gc.get_freeze_count()
    with collecting_only_what_it_makes():
        pass
    assert 0 < gc.get_freeze_count() <= frozen  # not undone (an object may die by its reference count)


def test_an_evaluation_plan_collects_with_the_older_objects_frozen(nothing_frozen, monkeypatch):
    # In a pytest process, one full collection after an evaluation forward took 0.6 s (the trace
    # itself 0.03 s): the plan must collect its own garbage only.
    import torch

    from helpers import tiny_llama_config
    from transformers import LlamaForCausalLM
    from trainer_memcb.plan.answers.eval_memory import EvalSettings, plan_eval_memory

    frozen_at_collection = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: frozen_at_collection.append(gc.get_freeze_count()) or collect(*args))

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaForCausalLM(tiny_llama_config("eager", use_cache=False))

    plan = plan_eval_memory(build, EvalSettings(batch_size=2, samples=2, seq_len=8))
    assert plan.problem is None
    assert len(frozen_at_collection) == 1 and frozen_at_collection[0] > 0
    assert gc.get_freeze_count() == 0
