"""`trainer_memcb.utils.compiled`: a `torch.compile` wrapper, in place or around, told by its attributes."""

from __future__ import annotations

import doctest

import torch

import trainer_memcb.utils.compiled as compiled


def test_docstring_examples_run():
    result = doctest.testmod(compiled)
    assert result.attempted >= 1 and result.failed == 0


def test_a_model_holding_a_compiled_part_is_not_compiled_as_a_whole():
    part = torch.compile(torch.nn.Linear(2, 2))
    outer = torch.nn.Sequential(part)
    assert compiled.uncompiled(outer) is outer and not compiled.is_compiled(outer)
