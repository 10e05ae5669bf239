"""SavedTensorsCounter: exact bytes on real and fake tensors, release during backward, other hooks
on the stack, and activation checkpointing."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import requires_torch
from trainer_memcb.state.saved_tensors import SavedTensorsCounter, storages_of

# torch 2.6 and 2.7 cannot read the top of the saved-tensor hooks' stack.
needs_hook_stack = requires_torch("2.8", "reads the top of the saved-tensor hooks' stack")

F32 = 4


class Block(torch.nn.Module):
    """x -> b(relu(a(x))) + x: a saves x, relu saves its output, b saves relu's output (the same
    storage), the addition saves nothing."""

    def __init__(self, width: int = 8, inner: int = 16) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, inner)
        self.b = torch.nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu()) + x


def blocks(n: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList([Block() for _ in range(n)])


def forward(model: torch.nn.ModuleList, x: torch.Tensor, ckpt: bool = False) -> torch.Tensor:
    h = x
    for block in model:
        h = checkpoint(block, h, use_reentrant=False) if ckpt else block(h)
    return h.pow(2).sum()  # pow saves its input


# Batch 4, width 8, inner 16, fp32: a block input is 128 bytes, a relu output 256.
PER_BLOCK = 4 * 8 * F32 + 4 * 16 * F32
LOSS_INPUT = 4 * 8 * F32


def test_counts_each_storage_once_and_never_the_parameters() -> None:
    model = blocks()
    with SavedTensorsCounter(exclude=model.parameters()) as counter:
        loss = forward(model, torch.randn(4, 8))
    assert counter.counting and counter.refused_reason is None
    assert counter.saved_bytes == 3 * PER_BLOCK + LOSS_INPUT == 1280
    assert counter.alive_bytes == counter.peak_bytes == 1280
    loss.backward()
    # Released as backward consumed them; the peak stays.
    assert counter.alive_bytes == 0
    assert counter.peak_bytes == 1280
    assert counter.saved_bytes == 1280


def test_without_exclude_the_weights_count_too() -> None:
    model = blocks(1)
    with SavedTensorsCounter() as counter:
        loss = forward(model, torch.randn(4, 8))
    # b saves its weight (8x16); a does not save its weight, since its input needs no gradient.
    assert counter.saved_bytes == PER_BLOCK + LOSS_INPUT + 16 * 8 * F32
    del loss


def test_freed_graph_releases_everything() -> None:
    model = blocks()
    with SavedTensorsCounter(exclude=model.parameters()) as counter:
        loss = forward(model, torch.randn(4, 8))
    del loss
    gc.collect()
    assert counter.alive_bytes == 0 and counter.saved_bytes == 1280


def test_a_storage_saved_twice_stays_counted_until_both_are_released() -> None:
    x = torch.randn(4, requires_grad=True)
    with SavedTensorsCounter() as counter:
        y = x * 2  # a Python number: nothing saved
        first, second = y.sin(), y.cos()  # each saves y: one storage, two holders
    assert counter.saved_bytes == 4 * F32
    first.sum().backward(retain_graph=True)  # the graph is kept: nothing released
    assert counter.alive_bytes == 4 * F32
    del first
    gc.collect()
    assert counter.alive_bytes == 4 * F32  # cos still holds y
    del second
    gc.collect()
    assert counter.alive_bytes == 0 and counter.peak_bytes == 4 * F32


def test_fake_tensors_count_the_same_bytes_as_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # On a CPU-only build of torch, autograd aborts the process on fake CUDA tensors (its input
    # metadata asks for a CUDA device guard), so this runs on fake CPU tensors.
    with FakeTensorMode():
        model = blocks()
        with SavedTensorsCounter(exclude=model.parameters()) as counter:
            loss = forward(model, torch.empty(4, 8))
    assert type(loss).__name__ == "FakeTensor"
    assert counter.saved_bytes == 1280


def test_a_wrapper_subclass_counts_its_inner_tensors() -> None:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.randn(3), torch.randn(3))
    # The outer storage claims 12 bytes; the two inner tensors hold 24.
    assert [nbytes for _, nbytes, _ in storages_of(t)] == [12, 12]


@needs_hook_stack
def test_hooks_are_popped_when_the_forward_raises() -> None:
    model = blocks(1)
    with pytest.raises(ZeroDivisionError):
        with SavedTensorsCounter(exclude=model.parameters()):
            model[0](torch.randn(4, 8))
            raise ZeroDivisionError
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


@needs_hook_stack
def test_chains_to_a_users_pair_of_hooks() -> None:
    model = blocks()
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.shape)
        return t.clone()  # a copy: what stays held is the copy

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with SavedTensorsCounter(exclude=model.parameters()) as counter:
            loss = forward(model, torch.randn(4, 8))
        assert torch._C._autograd._top_saved_tensors_default_hooks(True)[0] is pack
    # The user's pack hook saw every saved tensor, the weights' views included: 5 per block (the
    # first block's a saves no weight: its input needs no gradient) and the loss's input.
    assert len(seen) == 3 * 5 - 1 + 1
    # Counted: the copies the user's hook keeps. b's saved relu output is a second copy, and the
    # weights' copies are no longer the parameters.
    weight = 16 * 8 * F32
    assert counter.saved_bytes == 3 * (PER_BLOCK + 4 * 16 * F32 + 2 * weight) - weight + LOSS_INPUT == 4608
    loss.backward()
    assert counter.alive_bytes == 0
    assert model[0].a.weight.grad is not None


@needs_hook_stack
def test_save_on_cpu_still_applies_inside_the_counter() -> None:
    model = blocks()
    with torch.autograd.graph.save_on_cpu() as offload:
        with SavedTensorsCounter(exclude=model.parameters()) as counter:
            loss = forward(model, torch.randn(4, 8))
    assert counter.counting
    assert counter.saved_bytes > 0
    loss.backward()
    assert counter.alive_bytes == 0
    del offload


@needs_hook_stack
def test_refuses_to_count_inside_another_pair_when_asked() -> None:
    model = blocks()
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t.detach(), lambda t: t):
        with SavedTensorsCounter(exclude=model.parameters(), other_hooks="refuse") as counter:
            forward(model, torch.randn(4, 8)).backward()
    assert not counter.counting
    assert "another pair of saved-tensor hooks is active" in counter.refused_reason
    assert counter.saved_bytes == 0
    assert len(seen) == 3 * 5 - 1 + 1  # the user's hooks saw everything


def test_checkpointing_counts_each_blocks_saved_inputs_and_the_recomputation() -> None:
    model = blocks()
    counter = SavedTensorsCounter(exclude=model.parameters(), watch_recomputation=True)
    with counter:
        loss = forward(model, torch.randn(4, 8), ckpt=True)
    # Each checkpointed block's input (saved by checkpoint, seen by the outer hook), and the loss's
    # input; what the blocks save inside is not kept.
    assert counter.saved_bytes == 3 * 4 * 8 * F32 + LOSS_INPUT == 512
    loss.backward()
    # Backward frees the loss's input first, then recomputes the last block: its input (already
    # counted) plus its relu output (256): 384 + 256.
    assert counter.peak_bytes == 3 * 4 * 8 * F32 + 4 * 16 * F32 == 640
    assert counter.alive_bytes == 0
    counter.close()
    assert torch.utils.checkpoint._recomputation_hook.__name__ == "_recomputation_hook"


def test_without_watching_the_recomputation_is_not_counted() -> None:
    model = blocks()
    with SavedTensorsCounter(exclude=model.parameters()) as counter:
        loss = forward(model, torch.randn(4, 8), ckpt=True)
    loss.backward()
    assert (counter.saved_bytes, counter.peak_bytes, counter.alive_bytes) == (512, 512, 0)


def test_bad_options_raise_naming_the_value() -> None:
    with pytest.raises(ValueError, match="other_hooks='ignore'"):
        SavedTensorsCounter(other_hooks="ignore")
    with pytest.raises(ValueError, match="watch_recomputation=1"):
        SavedTensorsCounter(watch_recomputation=1)  # type: ignore[arg-type]
