"""`LiveStorages`, the step plan's tracker of live bytes, on a few real CPU operations whose
storages are known: each storage once, views free, a storage freed with its last tensor, and the
peak with what was alive then."""

from __future__ import annotations

import torch

from trainer_memcb.plan.step.live_storages import LiveStorages


def test_each_storage_counts_once_from_its_first_tensor_to_its_last():
    weight = torch.zeros(4, 4)  # 64 bytes, there before the step
    tracker = LiveStorages()
    tracker.add(weight)
    tracker.add(weight)  # the same tensor again: still once
    assert (tracker.alive_bytes, tracker.peak_bytes) == (64, 64)
    with tracker:
        tracker.phase = "forward"
        x = torch.ones(2, 4)  # 32
        y = x @ weight  # 32
        view = y.view(8)  # y's storage: nothing more
        assert tracker.alive_bytes == 128
        del y  # the view still holds the storage
        assert tracker.alive_bytes == 128
        z = view * 2  # 32
        tracker.phase = "after"
        del x, view
        assert tracker.alive_bytes == 96  # the weight and z
        w = torch.ones(1)  # 4: below the peak
    assert (tracker.peak_bytes, tracker.peak_label) == (160, "forward")
    assert tracker.sizes == {0: 64, 1: 32, 2: 32, 3: 32, 4: 4}
    assert sorted(tracker.peak_keys) == [0, 1, 2, 3]
    assert tracker.serials([z, w, weight]) == [3, 4, 0]
    with tracker:
        detached = z.detach()  # z's storage, and no reference back to z (unlike a view)
    del z
    assert tracker.alive_bytes == 100  # the weight, w, and z's storage: the detached tensor holds it
    del detached
    assert tracker.alive_bytes == 68


def test_the_watched_storages_alive_at_the_peak_are_kept():
    tracker = LiveStorages()
    kept = torch.zeros(8)  # 32
    tracker.add(kept)
    tracker.watch = {kept.untyped_storage()._cdata: None}
    with tracker:
        a = torch.ones(16)  # 64: the peak, with `kept` alive
        del a
        b = torch.ones(2)
    assert (tracker.peak_bytes, tracker.peak_watch) == (96, [0])
    assert tracker.serials([b]) == [2]


def test_the_timeline_replayed_gives_each_groups_most_at_one_moment():
    tracker = LiveStorages(keep_timeline=True)
    weight = torch.zeros(4)  # 16 bytes, serial 0: replaced by its shard when the step begins
    tracker.add(weight)
    tracker.set_size(weight.untyped_storage(), 4)  # serial 1
    tracker.restart_peak()
    with tracker:
        a = torch.ones(8)  # 32, serial 2: group "x"
        b = torch.ones(4)  # 16, serial 3: group "x"
        del a
        c = torch.ones(16)  # 64, serial 4: group "y"
        d = torch.ones(2)  # 8, serial 5: group "x"
    group = {1: "w", 2: "x", 3: "x", 4: "y", 5: "x"}
    # "x" at most 48 (a and b together, before a was freed), not 56 (a, b and d never met); the
    # weight whole (16) came before the step began.
    assert tracker.most_by(group.get) == {"w": 4, "x": 48, "y": 64}
    assert tracker.events == [0, ~0, 1, 2, 3, ~2, 4, 5]
    assert LiveStorages().events == []  # kept only when asked: a real run's tracker keeps none
    del b, c, d


def test_a_tensor_an_operation_returns_again_is_freed_once_it_dies():
    tracker = LiveStorages(keep_timeline=True)
    with tracker:
        x = torch.ones(10)  # 40 bytes, serial 0
        same = x.add_(1)  # an in-place operation returns the same tensor object: met again
        assert same is x and tracker.alive_bytes == 40
        del same, x
        assert tracker.alive_bytes == 0
    assert tracker.events == [0, ~0]


def test_a_wrapper_subclass_counts_each_inner_storage_once():
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.zeros(4), torch.zeros(2, 4)  # 16 and 32 bytes
    pair = TwoTensor(a, b[0])  # a's storage and b's (all 32 bytes of it, a view's storage is whole)
    tracker = LiveStorages()
    tracker.add(pair)
    assert (tracker.alive_bytes, sorted(tracker.sizes.values())) == (48, [16, 32])
    tracker.add(a)  # a's storage again, through another tensor object: not twice
    assert tracker.alive_bytes == 48
    del pair  # b's storage had no other tracked tensor; a still holds its own
    assert tracker.alive_bytes == 16
    del a
    assert tracker.alive_bytes == 0
