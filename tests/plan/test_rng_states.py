"""`rng_states_counted`: checkpointing's CPU generator states as storages a fake trace counts."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from trainer_memcb.plan.step.rng_states import cpu_rng_state_bytes, rng_states_counted


def test_within_a_fake_mode_the_state_is_a_fake_tensor_of_the_real_states_size() -> None:
    assert cpu_rng_state_bytes() == torch.get_rng_state().numel() == 5056  # mt19937's
    with rng_states_counted(), FakeTensorMode():
        state = torch.get_rng_state()
        assert isinstance(state, FakeTensor)
        assert (state.dtype, state.numel(), state.untyped_storage().nbytes()) == (torch.uint8, 5056, 5056)
        torch.set_rng_state(state)  # passed over: no generator to restore in a fake step


def test_a_real_state_still_restores_the_real_generator_and_everything_is_put_back() -> None:
    original_get, original_set = torch.get_rng_state, torch.set_rng_state
    torch.manual_seed(0)
    saved = torch.get_rng_state()
    expected = torch.rand(3)
    with rng_states_counted():
        with rng_states_counted():  # a trace inside a trace restores what it found
            assert torch.equal(torch.get_rng_state(), original_get())  # no fake mode: the real state
            torch.set_rng_state(saved)
            assert torch.equal(torch.rand(3), expected)
        assert torch.get_rng_state is not original_get
    assert (torch.get_rng_state, torch.set_rng_state) == (original_get, original_set)


def test_what_was_patched_is_put_back_when_the_trace_raises() -> None:
    original_get = torch.get_rng_state
    try:
        with rng_states_counted():
            raise RuntimeError("the trace failed")
    except RuntimeError:
        pass
    assert torch.get_rng_state is original_get
