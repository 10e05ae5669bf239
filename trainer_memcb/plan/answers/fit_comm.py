"""Make it fit, the communication's share of a proposal's step time: the bytes each process sends
per optimizer step for its engine's collectives, at the bandwidth of the link they cross.

Each collective is counted as NCCL's ring algorithms send (the NCCL tests' "bus bandwidth"
formulas, `PERFORMANCE.md` of nccl-tests): over `n` processes, an all-reduce of `S` bytes sends
`2 (n - 1) / n * S` from each, an all-gather or a reduce-scatter of the whole `S` sends
`(n - 1) / n * S`. Per optimizer step of `m` micro-batches, with `G` the trainable parameters'
gradient bytes and `P` the parameters' bytes on the device, over the `d` processes of data
parallelism:

- DDP: one all-reduce of `G` (the Trainer skips the gradient sync inside accumulation, accelerate's
  `no_sync`);
- ZeRO-1: a reduce-scatter of `G` at the accumulation boundary and an all-gather of the updated `P`
  (`stage_1_and_2.py`: the partitions are reduced once, the parameters gathered after the step);
- ZeRO-2: a reduce-scatter of `G` after every micro-batch's backward (its gradients are partitioned
  as they come, `reduce_ipg_grads`) and the all-gather of `P`;
- ZeRO-3 and FSDP2 full shard: every micro-batch all-gathers `P` for the forward and again for the
  backward and reduce-scatters `G`; FSDP2 without resharding after the forward gathers once;
- tensor parallelism over `t` processes (`ColwiseParallel` / `RowwiseParallel` as the model's
  `tp_plan` lays them out, Megatron's pattern): every micro-batch, each decoder layer all-reduces its
  activations `[B, L, hidden]` twice in the forward (the attention's and the MLP's row-wise outputs)
  and twice in the backward (the column-wise inputs' gradients), a third time in a checkpointed
  layer's recomputed forward; the embedding's row-wise output once, and the head's column-wise
  logits `[B, L, vocab]` all-gathered; beside it the data-parallel sync above moves `1/t` of `P`
  and `G`.
- context parallelism over `c` processes (torch's ring attention, `ring_attention` of the plan, torch
  2.13's `_templated_ring_attention` and `_templated_ring_attention_backward`): every micro-batch,
  each decoder layer's attention sends its local keys and values `S = 2 [B, L / c, kv_width]` round
  the ring in the forward (accelerate's default `allgather`: one all-gather, `(c - 1) S` sent; the
  `alltoall` rotation sends the same in `c - 1` turns), again in the backward, a third time in a
  checkpointed layer's recomputed forward, and in the backward the keys' and values' gradients,
  float32 (torch's `convert_to_f32`) and the same shape, passed on at each of the `c` turns; the data
  sync above is FSDP2's over `dp_shard x cp`, the whole `P` and `G` over `d x c` processes.

The link: tensor parallelism's ranks are the innermost dimension of accelerate's mesh, context
parallelism's the next, so they share a node while `t` (or `c x t`) is at most the processes per node, over NVLink (`NVLINK_BYTES_PER_SECOND`, a
GPU's one-way NVLink bandwidth) or, on cards without it, PCIe; data parallelism's groups span the
nodes as soon as there are several, and cross the network (`NETWORK_BYTES_PER_SECOND` per GPU). The
figures are peak link rates: real collectives reach less, and overlap with computation, which this
model does not credit: it ranks layouts by what they move, it does not time them. On the CPU
(gloo) communication is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["Links", "ModelShape", "links_of", "layout_sizes", "context_parallel_size", "context_parallel_bytes",
           "communication_bytes", "communication_seconds",
           "NVLINK_BYTES_PER_SECOND", "PCIE_BYTES_PER_SECOND", "NETWORK_BYTES_PER_SECOND"]

# One-way NVLink bandwidth per GPU: NVLink 4 on H100/H200 SXM, 18 links of 25 GB/s each way (900 GB/s
# both ways, NVIDIA's H100 datasheet); NVLink 3 on A100 SXM, 12 links (600 GB/s both ways).
NVLINK_BYTES_PER_SECOND: Dict[str, float] = {"H100": 450e9, "H200": 450e9, "A100-40GB": 300e9, "A100-80GB": 300e9}
# Cards without NVLink talk over PCIe 4.0 x16: what CUDA's bandwidthTest measures (~25 GB/s of 32),
# as the host transfers of offload (`fit_cost.HOST_BANDWIDTH`).
PCIE_BYTES_PER_SECOND = 25e9
# The network per GPU across nodes: one 400 Gb/s InfiniBand or RoCE adapter per GPU (a DGX H100's
# eight ConnectX-7).
NETWORK_BYTES_PER_SECOND = 50e9


@dataclass(frozen=True)
class Links:
    """The links of one process: `intra_node` and `inter_node` bytes per second each way, and the
    processes per node."""

    intra_node: float
    inter_node: float
    per_node: int


@dataclass(frozen=True)
class ModelShape:
    """What tensor parallelism's activation collectives scale with: the model's hidden size, decoder
    layers and vocabulary, the sequence length and the bytes of an activation value."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    seq_len: int
    activation_bytes: int
    # The keys' (and the values') width each token holds: key-value heads x head size (0: hidden_size).
    kv_width: int = 0


def links_of(gpu: Optional[str], world_size: int, nodes: int) -> Links:
    """The links of a job of `world_size` processes on `nodes` machines of `gpu` (a preset's name;
    None: the plan's default GPU, an A100)."""
    intra = NVLINK_BYTES_PER_SECOND.get(gpu or "A100-80GB", PCIE_BYTES_PER_SECOND)
    return Links(intra, NETWORK_BYTES_PER_SECOND, max(1, world_size // max(1, nodes)))


def layout_sizes(args: Mapping[str, Any], world_size: int) -> Tuple[int, int]:
    """(tensor-parallel size, data-parallel size) of a `TrainingArguments` dict: its
    `parallelism_config`'s `tp_size`, and the processes left for the data (each row's batch is
    shared by `tp x cp` processes)."""
    tp = _config_size(args, "tp_size")
    return tp, max(1, world_size // (tp * context_parallel_size(args)))


def context_parallel_size(args: Mapping[str, Any]) -> int:
    """The `parallelism_config`'s `cp_size` of a `TrainingArguments` dict (1 without one)."""
    return _config_size(args, "cp_size")


def _config_size(args: Mapping[str, Any], name: str) -> int:
    config = args.get("parallelism_config") or {}
    return int(config.get(name) or 1) if isinstance(config, Mapping) else 1


def _engine(args: Mapping[str, Any], deepspeed: Optional[Mapping[str, Any]]) -> str:
    if deepspeed:
        return f"zero{int((deepspeed.get('zero_optimization') or {}).get('stage') or 0)}"
    fsdp = args.get("fsdp")
    if fsdp:
        text = " ".join(fsdp) if isinstance(fsdp, (list, tuple)) else str(fsdp)
        return "fsdp-shard-grad-op" if "shard_grad_op" in text else "fsdp"
    config = args.get("parallelism_config") or {}
    if isinstance(config, Mapping) and (int(config.get("dp_shard_size") or 1) > 1
                                        or int(config.get("cp_size") or 1) > 1):
        return "fsdp"  # accelerate shards the data dimension (and dp_shard x cp) with FSDP2
    return "ddp"


def _sync_bytes(engine: str, d: int, params: float, grads: float, micro_batches: int) -> float:
    """The data-parallel collectives' bytes sent by one process per optimizer step."""
    if d <= 1:
        return 0.0
    share = (d - 1) / d
    if engine in ("ddp", "zero0"):  # one all-reduce of the gradients
        return 2 * share * grads
    if engine == "zero1":  # the gradients reduce-scattered, the updated parameters all-gathered
        return share * (grads + params)
    if engine == "zero2":
        return share * (micro_batches * grads + params)
    gathers = 1 if engine == "fsdp-shard-grad-op" else 2
    return micro_batches * share * (gathers * params + grads)


def _tensor_parallel_bytes(t: int, shape: ModelShape, batch: int, micro_batches: int, checkpointing: bool,
                           cp: int = 1) -> float:
    """Tensor parallelism's activation collectives' bytes sent by one process per optimizer step;
    beside context parallelism over `cp` processes each carries a rank's `1 / cp` of the tokens."""
    if t <= 1:
        return 0.0
    tokens = batch * (shape.seq_len // cp)
    hidden = tokens * shape.hidden_size * shape.activation_bytes
    per_layer = (5 if checkpointing else 4) * 2 * (t - 1) / t * hidden
    logits = (t - 1) / t * tokens * shape.vocab_size * shape.activation_bytes
    embedding = 2 * (t - 1) / t * hidden
    return micro_batches * (shape.num_layers * per_layer + embedding + logits)


def context_parallel_bytes(c: int, shape: ModelShape, batch: int, micro_batches: int, checkpointing: bool,
                           tp: int = 1) -> float:
    """Context parallelism's ring bytes sent by one process per optimizer step (module docstring); beside
    tensor parallelism over `tp` processes the ring carries a rank's `1 / tp` of the heads."""
    if c <= 1:
        return 0.0
    keys_values = 2 * batch * (shape.seq_len // c) * ((shape.kv_width or shape.hidden_size) // tp)
    rotations = (3 if checkpointing else 2) * (c - 1) * keys_values * shape.activation_bytes
    gradients = c * keys_values * 4
    return micro_batches * shape.num_layers * (rotations + gradients)


def communication_bytes(args: Mapping[str, Any], deepspeed: Optional[Mapping[str, Any]], world_size: int,
                        parameter_bytes: int, gradient_bytes: int, shape: Optional[ModelShape]) -> Tuple[float, float]:
    """(data-parallel bytes, tensor- and context-parallel bytes) one process sends per optimizer step
    of the setting (`args` a `TrainingArguments` dict, `deepspeed` its config or None) on
    `world_size` processes; `parameter_bytes` and `gradient_bytes` are the whole model's on the
    device."""
    tp, dp = layout_sizes(args, world_size)
    cp = context_parallel_size(args)
    micro = int(args.get("gradient_accumulation_steps") or 1)
    batch = int(args.get("per_device_train_batch_size") or 1)
    # FSDP2 shards over dp_shard x cp: its collectives span the context-parallel ranks too.
    sync = _sync_bytes(_engine(args, deepspeed), dp * cp, parameter_bytes / tp, gradient_bytes / tp, micro)
    checkpointing = bool(args.get("gradient_checkpointing"))
    activations = (_tensor_parallel_bytes(tp, shape, batch, micro, checkpointing, cp)
                   + context_parallel_bytes(cp, shape, batch, micro, checkpointing, tp) if shape is not None else 0.0)
    return sync, activations


def communication_seconds(args: Mapping[str, Any], deepspeed: Optional[Mapping[str, Any]], world_size: int,
                          parameter_bytes: int, gradient_bytes: int, shape: Optional[ModelShape],
                          links: Optional[Links]) -> float:
    """The seconds one process spends sending its collectives' bytes per optimizer step at the links'
    bandwidth (0 without `links`: not counted)."""
    if links is None or world_size <= 1:
        return 0.0
    sync, activations = communication_bytes(args, deepspeed, world_size, parameter_bytes, gradient_bytes, shape)
    tp, _ = layout_sizes(args, world_size)
    inner = tp * context_parallel_size(args)  # the mesh's innermost dimensions, cp outside tp
    tp_link = links.intra_node if inner <= links.per_node else links.inter_node
    dp_link = links.intra_node if world_size <= links.per_node else links.inter_node
    return sync / dp_link + activations / tp_link
