"""The collector in the `trainer-memcb` process (`trainer_memcb.cli.collector`), and the step
plan's freeze of the objects older than its trace."""

from __future__ import annotations

import gc

import pytest

from trainer_memcb.cli import collector
from trainer_memcb.cli.estimate_model import first_then_new
from trainer_memcb.plan.step.trace import _freeze_older_objects


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
    assert _freeze_older_objects() is True
    frozen = gc.get_freeze_count()
    assert frozen > 0
    assert _freeze_older_objects() is False  # frozen already (by the program): left as it is
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
