"""Context parallelism's share of a `--fit` proposal's step time: the ring's bytes counted by hand
from torch 2.13's `_templated_ring_attention` and `_templated_ring_attention_backward`, and held
equal to what the ring the plan traces hands its collectives (tests/cli/test_cli_fit_context_parallel.py
checks the proposals themselves); and beside tensor parallelism (`tp=2,cp=2`), each rank's heads."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import requires_torch

from trainer_memcb.plan.answers.fit_comm import (ModelShape, communication_bytes, communication_seconds,
                                                 context_parallel_bytes, layout_sizes, links_of)

sys.path.insert(0, os.path.dirname(__file__))
from test_engines import build  # noqa: E402

# tests/plan/test_engines.py's tiny Llama: hidden 64, 2 layers of 4 heads (4 key-value heads of 16).
SHAPE = ModelShape(hidden_size=64, num_layers=2, vocab_size=256, seq_len=64, activation_bytes=2, kv_width=64)


def cp_layout(cp: int, dp_shard: int) -> dict:
    return {"parallelism_config": {"tp_size": 1, "dp_shard_size": dp_shard, "dp_replicate_size": 1, "cp_size": cp}}


def test_cp_s_processes_share_each_row_so_the_data_groups_are_fewer():
    assert layout_sizes(cp_layout(2, 4), 8) == (1, 4)
    assert layout_sizes(cp_layout(8, 1), 8) == (1, 1)


@pytest.mark.parametrize("checkpointing, expected", [
    # Batch 2 of 64 tokens on cp=2: each rank's keys and values are 2 x [2, 32, 64] = 8,192 values.
    # Forward: one all-gather of them in bf16, (2 - 1) x 16,384 bytes sent; backward: the same again,
    # and their float32 gradients (32,768 bytes) passed on at each of the 2 turns. Two layers.
    (False, 2 * (2 * 16_384 + 2 * 32_768)),
    # A checkpointed layer's recomputed forward all-gathers them a third time.
    (True, 2 * (3 * 16_384 + 2 * 32_768)),
])
def test_the_ring_s_bytes_counted_by_hand(checkpointing, expected):
    assert context_parallel_bytes(2, SHAPE, batch=2, micro_batches=1, checkpointing=checkpointing) == expected
    # Per micro-batch: 3 of them send three times as much.
    assert context_parallel_bytes(2, SHAPE, batch=2, micro_batches=3, checkpointing=checkpointing) == 3 * expected


def test_cp_s_data_sync_is_fsdp2_over_dp_shard_x_cp_and_its_ring_crosses_the_node_s_links():
    params, grads = 1_000_000, 800_000
    args = dict(cp_layout(2, 4), gradient_accumulation_steps=2, per_device_train_batch_size=2)
    sync, ring = communication_bytes(args, None, 8, params, grads, SHAPE)
    # FSDP2 over the 8 processes of dp_shard x cp: two all-gathers and a reduce-scatter a micro-batch.
    assert sync == pytest.approx(2 * 7 / 8 * (2 * params + grads), rel=1e-12)
    assert ring == context_parallel_bytes(2, SHAPE, 2, 2, False) == 2 * 2 * 98_304  # 2 micro-batches, 2 layers
    # One node of 8 H100s: all of it over NVLink.
    links = links_of("H100", 8, 1)
    assert communication_seconds(args, None, 8, params, grads, SHAPE, links) == pytest.approx(
        (sync + ring) / links.intra_node, rel=1e-12)


def _ring_bytes_sent(monkeypatch, layout, rank=0, **flags):
    """The bytes the traced step hands the ring's collectives on one rank, (group, bytes) a call, and its plan."""
    import torch.distributed._functional_collectives as ft_c

    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.settings import resolve_settings

    sent = []
    gather, permute = ft_c.all_gather_single, ft_c.permute_tensor

    def all_gather_single(tensor, gather_dim, group, *args, **kwargs):
        size = group.size() if hasattr(group, "size") else len(group)
        sent.append((group, (size - 1) * tensor.nbytes))  # a ring all-gather: each sends the others its part
        return gather(tensor, gather_dim, group, *args, **kwargs)

    def permute_tensor(tensor, src_dst, group, *args, **kwargs):
        sent.append((group, tensor.nbytes))  # one turn: its whole buffer to the next rank
        return permute(tensor, src_dst, group, *args, **kwargs)

    # The ring calls them as `ft_c.all_gather_single` and `ft_c.permute_tensor` (DTensor's own
    # redistributions use other functional collectives): counted where it calls them.
    monkeypatch.setattr(ft_c, "all_gather_single", all_gather_single)
    monkeypatch.setattr(ft_c, "permute_tensor", permute_tensor)
    settings = resolve_settings(parallelism=layout, rank=rank, batch_size=2, optimizer="adamw_torch", precision="bf16",
                                **flags)
    plan, _ = plan_step_memory(build, seq_len=64, settings=settings, device_type="cuda", model_states=False)
    assert plan.step.problem is None, plan.step.problem
    return sent, plan


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_traced_ring_sends_the_bytes_counted(monkeypatch, checkpointing):
    sent, _ = _ring_bytes_sent(monkeypatch, "cp=2", gradient_checkpointing=checkpointing)
    # One micro-batch traced; the forward's all-gathers and the backward's gathers and turns, 2 layers.
    assert len(sent) == 2 * ((3 if checkpointing else 2) + 2)
    assert sum(nbytes for _, nbytes in sent) == context_parallel_bytes(2, SHAPE, batch=2, micro_batches=1, checkpointing=checkpointing)


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
def test_beside_tensor_parallelism_the_ring_carries_a_rank_s_heads(monkeypatch):
    sent, plan = _ring_bytes_sent(monkeypatch, "tp=2,cp=2")
    assert plan.settings.engine == "tp-cp-fsdp2"
    # tp=2 leaves a rank 2 of the 4 key-value heads: keys and values 2 x [2, 32, 32] = 4,096 values,
    # half of cp=2's alone. 8,192 bytes all-gathered forward and backward, 2 x 16,384 of float32
    # gradients passed on; two layers.
    # The ring's calls are on its `cp` group, the first layer's forward all-gather's; the one other
    # is tensor parallelism's: the head's logits all-gathered over `tp`, 1 x [2, 32, 128] bf16
    # (`fit_comm`'s logits term, (2 - 1) / 2 x 64 tokens x 256 x 2 bytes).
    ring = [nbytes for group, nbytes in sent if group is sent[0][0]]
    assert [nbytes for group, nbytes in sent if group is not sent[0][0]] == [16_384]
    # tp=2 leaves a rank 2 of the 4 key-value heads: keys and values 2 x [2, 32, 32] = 4,096 values,
    # half of cp=2's alone. 8,192 bytes all-gathered forward and backward, 2 x 16,384 of float32
    # gradients passed on; two layers.
    assert sum(ring) == 2 * (2 * 8_192 + 2 * 16_384) == context_parallel_bytes(2, SHAPE, 2, 1, False, tp=2)
    # The parameters: the tp_plan's layers (all but the 5 norms' 320 values) split over tp and FSDP2
    # over cp, the norms over cp alone: (114,688 / 4 + 320 / 2) bf16 values.
    assert plan.step.model_states_at_optimizer_step_bytes["parameters"] == (114_688 // 4 + 320 // 2) * 2


def test_tp_collectives_beside_cp_carry_a_rank_s_share_of_the_tokens():
    """tp=2 beside cp=2 on four processes: each TP collective is `[batch, seq / cp, hidden]` (and the
    head's `[batch, seq / cp, vocab]`), half of tp=2 alone's, by hand."""
    from trainer_memcb.plan.answers.fit_comm import ModelShape, communication_bytes

    shape = ModelShape(64, 2, 256, 64, 2, kv_width=64)
    args = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}

    def activations(tp: int, cp: int) -> float:
        layout = {"tp_size": tp, "cp_size": cp, "dp_shard_size": 4 // (tp * cp), "dp_replicate_size": 1}
        return communication_bytes(dict(args, parallelism_config=layout), None, 4, 0, 0, shape)[1]

    tokens = 2 * 64 // 2  # a cp rank's 32 of each row's 64, two rows
    hidden = tokens * 64 * 2
    tp_bytes = 2 * 4 * 2 * 0.5 * hidden + 2 * 0.5 * hidden + 0.5 * tokens * 256 * 2  # layers, embedding, logits
    # The ring's (context_parallel_bytes), 2 layers: keys and values of a rank's 32 tokens x its half of
    # the 64 key-value width, rotated once forward and once backward (bf16), their fp32 gradients at 2 turns.
    keys_values = 2 * 2 * 32 * 32
    ring = 2 * (2 * (2 - 1) * keys_values * 2 + 2 * keys_values * 4)
    assert tp_bytes == 90_112 and activations(2, 2) == tp_bytes + ring == 188_416
    assert activations(2, 1) == 2 * tp_bytes
