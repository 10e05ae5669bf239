"""The communication's share of a `--fit` proposal's step time: each engine's collectives' bytes,
counted by hand here from NCCL's ring formulas, and the link they cross."""

from __future__ import annotations

import pytest

from trainer_memcb.plan.answers.fit_comm import (NETWORK_BYTES_PER_SECOND, PCIE_BYTES_PER_SECOND, Links, ModelShape,
                                                 communication_bytes, communication_seconds, layout_sizes, links_of)

PARAMS, GRADS = 1_000_000, 800_000  # bytes of the parameters and of the trainable ones' gradients
SHAPE = ModelShape(hidden_size=32, num_layers=2, vocab_size=96, seq_len=16, activation_bytes=2)


def layout(tp: int, dp_shard: int) -> dict:
    return {"tp_size": tp, "dp_shard_size": dp_shard, "dp_replicate_size": 1, "cp_size": 1}


def test_the_layout_sizes_come_from_the_parallelism_config():
    assert layout_sizes({}, 8) == (1, 8)
    assert layout_sizes({"parallelism_config": layout(2, 4)}, 8) == (2, 4)
    assert layout_sizes({"parallelism_config": layout(8, 1)}, 8) == (8, 1)


@pytest.mark.parametrize("args, deepspeed, expected", [
    # DDP: one all-reduce of the gradients per step, 2 (n - 1) / n of them, whatever the accumulation.
    ({"gradient_accumulation_steps": 4}, None, 2 * 3 / 4 * GRADS),
    # ZeRO-1: the gradients reduce-scattered at the boundary, the parameters all-gathered.
    ({"gradient_accumulation_steps": 4}, {"zero_optimization": {"stage": 1}}, 3 / 4 * (GRADS + PARAMS)),
    # ZeRO-2: the gradients reduce-scattered after each of the 4 backwards.
    ({"gradient_accumulation_steps": 4}, {"zero_optimization": {"stage": 2}}, 3 / 4 * (4 * GRADS + PARAMS)),
    # ZeRO-3 and FSDP2: two all-gathers and a reduce-scatter per micro-batch.
    ({"gradient_accumulation_steps": 4}, {"zero_optimization": {"stage": 3}}, 4 * 3 / 4 * (2 * PARAMS + GRADS)),
    ({"gradient_accumulation_steps": 4, "fsdp": "full_shard"}, None, 4 * 3 / 4 * (2 * PARAMS + GRADS)),
    # Without resharding after the forward, one all-gather.
    ({"gradient_accumulation_steps": 4, "fsdp": "shard_grad_op"}, None, 4 * 3 / 4 * (PARAMS + GRADS)),
])
def test_data_parallel_bytes_per_engine(args, deepspeed, expected):
    sync, activations = communication_bytes(args, deepspeed, 4, PARAMS, GRADS, SHAPE)
    assert sync == pytest.approx(expected, rel=1e-12) and activations == 0


def test_tensor_parallel_bytes_by_hand():
    args = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "parallelism_config": layout(2, 2)}
    sync, activations = communication_bytes(args, None, 4, PARAMS, GRADS, SHAPE)
    # FSDP2 over the 2 data-parallel processes moves half the model: a tp rank holds 1/2 of it.
    assert sync == pytest.approx(2 * 1 / 2 * (2 * PARAMS / 2 + GRADS / 2), rel=1e-12)
    tokens = 2 * 16
    hidden = tokens * 32 * 2  # [B, L, hidden] in 2-byte values
    per_layer = 4 * 2 * 1 / 2 * hidden  # two all-reduces forward, two backward
    embedding = 2 * 1 / 2 * hidden
    logits = 1 / 2 * tokens * 96 * 2  # the head's column-wise output all-gathered
    assert activations == pytest.approx(2 * (2 * per_layer + embedding + logits), rel=1e-12)
    # A checkpointed layer's recomputed forward all-reduces once more.
    _, checkpointed = communication_bytes(dict(args, gradient_checkpointing=True), None, 4, PARAMS, GRADS, SHAPE)
    assert checkpointed - activations == pytest.approx(2 * 2 * (2 * 1 / 2 * hidden), rel=1e-12)


def test_the_links_of_a_gpu_and_its_nodes():
    assert links_of("H100", 16, 2) == Links(450e9, NETWORK_BYTES_PER_SECOND, 8)
    assert links_of(None, 8, 1).intra_node == 300e9  # the plan's default GPU, an A100
    assert links_of("L4", 4, 1).intra_node == PCIE_BYTES_PER_SECOND  # no NVLink on an L4


def test_tensor_parallelism_inside_a_node_crosses_nvlink_and_across_nodes_the_network():
    links = Links(intra_node=400.0, inter_node=50.0, per_node=8)
    inside = {"parallelism_config": layout(8, 2)}
    sync, activations = communication_bytes(inside, None, 16, PARAMS, GRADS, SHAPE)
    # tp=8 within a node (NVLink); the data-parallel groups span the two nodes (the network).
    assert communication_seconds(inside, None, 16, PARAMS, GRADS, SHAPE, links) == pytest.approx(
        sync / 50.0 + activations / 400.0, rel=1e-12)
    across = {"parallelism_config": layout(16, 1)}
    sync, activations = communication_bytes(across, None, 16, PARAMS, GRADS, SHAPE)
    assert sync == 0 and communication_seconds(across, None, 16, PARAMS, GRADS, SHAPE, links) == pytest.approx(
        activations / 50.0, rel=1e-12)
    # One node: DDP's all-reduce on NVLink; without links (the CPU) nothing is counted.
    assert communication_seconds({}, None, 8, PARAMS, GRADS, SHAPE, links) == pytest.approx(2 * 7 / 8 * GRADS / 400.0)
    assert communication_seconds({}, None, 8, PARAMS, GRADS, SHAPE, None) == 0.0
    assert communication_seconds({}, None, 1, PARAMS, GRADS, SHAPE, links) == 0.0
