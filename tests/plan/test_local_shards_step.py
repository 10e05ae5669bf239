"""The optimizer step of DTensor parameters run on their local shards
(`trainer_memcb.plan.step.engines.local_shards_step`): the very timeline DTensor's own dispatch gives,
storage for storage, under FSDP2 and TP x FSDP2; DTensor's dispatch kept where a gradient is laid
out otherwise than its parameter (TP alone: the embedding's), or the optimizer's state follows shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import requires_torch, tiny_llama_config
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.engines import local_shards_step
from trainer_memcb.plan.step.trace import trace_step


def build():
    config = tiny_llama_config("sdpa", vocab_size=256, max_position_embeddings=2048)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def traced(monkeypatch, local: bool, **given):
    """The step's timeline, its optimizer stepped on the local shards or through DTensor's dispatch;
    and whether the local shards stepped."""
    stepped = []
    real = local_shards_step._local_kernels_alone

    def decided(params, dtensor):
        stepped.append(real(params, dtensor))
        return stepped[-1]

    monkeypatch.setattr(local_shards_step, "_local_kernels_alone", decided)
    if not local:
        monkeypatch.setattr(local_shards_step, "ELEMENTWISE_OPTIMIZERS", ())
    settings = resolve_settings(batch_size=2, seq_len=16, device_type="cuda", **given)
    timeline = trace_step(build(), settings, args=None, step_dtype=torch.float32)
    monkeypatch.undo()
    return timeline, stepped


def same_timeline(first, second):
    return dataclasses.asdict(first) == dataclasses.asdict(second)


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
@pytest.mark.parametrize("optimizer", ["adamw_torch", "sgd"])
@pytest.mark.parametrize("given", [dict(world_size=2, sharding="fsdp-full-shard"), dict(parallelism="tp=2,dp_shard=2")],
                         ids=["fsdp2", "tp2-fsdp2"])
def test_the_local_step_is_dtensor_s_step_storage_for_storage(monkeypatch, given, optimizer):
    local, stepped = traced(monkeypatch, True, optimizer=optimizer, **given)
    through_dtensor, _ = traced(monkeypatch, False, optimizer=optimizer, **given)
    assert stepped == [True]
    assert local.optimizer_failure is None and local.optimizer_step is not None
    assert same_timeline(local, through_dtensor)


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_tp_alone_keeps_dtensor_s_dispatch_where_a_gradient_is_laid_out_otherwise(monkeypatch):
    # The embedding's rows are sharded, its gradient comes back replicated: DTensor redistributes it
    # inside the step.
    timeline, stepped = traced(monkeypatch, True, optimizer="adamw_torch", parallelism="tp=2")
    assert stepped == [False]
    assert timeline.optimizer_failure is None and timeline.optimizer_step is not None


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_an_optimizer_whose_state_follows_shapes_keeps_dtensor_s_dispatch(monkeypatch):
    given = dict(optimizer="adafactor", world_size=2, sharding="fsdp-full-shard")
    timeline, stepped = traced(monkeypatch, True, **given)
    assert stepped == []  # Adafactor is not elementwise: never asked
    # What DTensor's own dispatch makes of it (here: its factored moments, plain tensors of the
    # global shape, meet the DTensor gradient, which DTensor refuses), unchanged.
    assert "got mixed torch.Tensor and DTensor" in timeline.optimizer_failure
    assert same_timeline(timeline, traced(monkeypatch, False, **given)[0])


def test_after_the_step_the_state_is_keyed_by_the_dtensors_and_no_local_shard_is_held():
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.ones(5))
        param.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        plain.grad = torch.ones(5)
        optimizer = torch.optim.AdamW([param, plain], foreach=True)
        seen = []
        step = optimizer.step

        def spy():
            seen.extend(p for group in optimizer.param_groups for p in group["params"])
            return step()

        optimizer.step = spy
        with local_shards_step.stepping_local_shards(optimizer):
            optimizer.step()
        local = seen[0]
        assert type(local) is torch.nn.Parameter and local.shape == (2, 3)  # the shard, not the DTensor
        assert local.untyped_storage().data_ptr() == param._local_tensor.untyped_storage().data_ptr()
        assert seen[1] is plain
        assert optimizer.param_groups[0]["params"] == [param, plain]
        assert list(optimizer.state) == [param, plain]
        moments = optimizer.state[param]["exp_avg"]
        assert not isinstance(moments, DTensor) and moments.shape == (2, 3)
        assert local.grad is None  # the local gradient's reference dropped
        gone = weakref.ref(local)
        seen.clear()
        del local
        assert gone() is None
    finally:
        dist.destroy_process_group()


def test_a_step_that_raises_leaves_the_dtensor_parameters_in_place():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
        param.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        optimizer = torch.optim.SGD([param], lr=0.1)

        def fails():
            assert optimizer.param_groups[0]["params"][0] is not param  # the local shard inside
            raise RuntimeError("a step that fails")

        optimizer.step = fails
        with pytest.raises(RuntimeError, match="a step that fails"):
            with local_shards_step.stepping_local_shards(optimizer):
                optimizer.step()
        assert optimizer.param_groups[0]["params"] == [param] and len(optimizer.state) == 0
    finally:
        dist.destroy_process_group()
