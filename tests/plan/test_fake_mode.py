"""The quicker fake-tensor dispatch-cache key (`trainer_memcb.plan.step.fake_mode`): the same key as
torch's, so the same fake tensors and the same plans."""

from __future__ import annotations

import json

import torch

from helpers import requires_torch, run_estimate
from trainer_memcb.plan.step import fake_mode

pytestmark = requires_torch("2.13", "the quick key is written for torch 2.13's TensorMetadata and walk")

STEP = ["--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16", "--precision", "bf16",
        "--gradient-checkpointing", "--gpu", "h100", "--json"]


def test_the_quick_mode_is_the_one_made_here():
    assert fake_mode.quick_keys_available()
    assert type(fake_mode.fake_tensor_mode()).__name__ == "QuickKeyFakeTensorMode"


def test_every_key_of_a_traced_step_is_torchs(tiny_llama_dir, capsys, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode_class = fake_mode._quick_mode_class()
    quick, plain = mode_class._prep_args_for_hash, FakeTensorMode._prep_args_for_hash
    walking = [None]  # the walk a nested call takes: the one its outermost call is comparing
    compared = []

    def both(self, result, args, state, id_hashed_objects):
        if walking[0] is not None:
            return walking[0](self, result, args, state, id_hashed_objects)
        keys = []
        for walk in (quick, plain):
            walking[0], key = walk, []
            try:
                walk(self, key, args, state, [])
            finally:
                walking[0] = None
            keys.append(key)
        assert keys[0] == keys[1] and list(map(type, keys[0])) == list(map(type, keys[1]))
        compared.append(sum(isinstance(value, torch.dtype) for value in keys[0]))
        walking[0] = plain
        try:
            return plain(self, result, args, state, id_hashed_objects)
        finally:
            walking[0] = None

    monkeypatch.setattr(mode_class, "_prep_args_for_hash", both)
    monkeypatch.setattr(fake_mode, "_MODE_CLASS", [mode_class])
    code, out, _ = run_estimate([tiny_llama_dir, *STEP], capsys)
    assert code == 0 and json.loads(out)["step"]["peak_bytes"] > 0
    assert len(compared) > 1000  # every cached operation of the step: forward, recomputation, backward, AdamW
    assert sum(compared) > 1000  # tensors among their arguments


def test_the_plan_is_the_plan_under_torchs_own_mode(tiny_llama_dir, capsys, monkeypatch):
    code, quick_out, _ = run_estimate([tiny_llama_dir, *STEP], capsys)
    monkeypatch.setattr(fake_mode, "_MODE_CLASS", [None])  # torch's FakeTensorMode as it is, its key torch's
    plain = type(fake_mode.fake_tensor_mode())
    assert plain.__mro__[2] is torch._subclasses.fake_tensor.FakeTensorMode  # the imports' mixin alone before it
    assert plain._prep_args_for_hash is torch._subclasses.fake_tensor.FakeTensorMode._prep_args_for_hash
    plain_code, plain_out, _ = run_estimate([tiny_llama_dir, *STEP], capsys)
    assert code == plain_code == 0 and quick_out == plain_out


def test_a_key_laid_out_otherwise_keeps_torchs_mode(monkeypatch):
    monkeypatch.setattr(fake_mode, "_FIELDS", fake_mode._FIELDS[:-1])
    assert fake_mode._quick_mode_class() is None


def test_a_key_that_disagrees_on_the_samples_keeps_torchs_mode(monkeypatch):
    real = fake_mode._keys_agree

    def off_by_one(mode_class):
        original = mode_class._prep_args_for_hash

        def wrong(self, result, args, state, ids):
            original(self, result, args, state, ids)
            result.append("extra")
        mode_class._prep_args_for_hash = wrong
        return real(mode_class)
    monkeypatch.setattr(fake_mode, "_keys_agree", off_by_one)
    assert fake_mode._quick_mode_class() is None
