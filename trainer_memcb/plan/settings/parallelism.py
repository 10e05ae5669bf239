"""The job's parallel layout as accelerate's `ParallelismConfig` gives it, read and checked as
accelerate and transformers check it, each refusal one line naming the rule.

A layout is four sizes: `dp_replicate` (replicas), `dp_shard` (FSDP2's shards), `cp` (context
parallel) and `tp` (tensor parallel). It is given as `--parallelism tp=2,dp_shard=4` or read from the
`parallelism_config` of a TrainingArguments JSON (`TrainingArguments.to_dict` writes
`ParallelismConfig.to_json()`: `dp_replicate_size`, `dp_shard_size`, `tp_size`, `cp_size`, ...).

The rules (accelerate 1.16 `parallelism_config.py`, `ParallelismConfig.__post_init__` and
`_validate_accelerator`):

- every size a whole number of at least 1;
- the sizes multiply to the number of processes (`total_size != num_processes` is refused);
- context parallelism beside pure replication (`cp > 1`, `dp_replicate > 1`, `dp_shard == 1`) is
  refused;
- `dp_replicate > 1` with `tp > 1` needs `dp_shard > 1` (its docstring: "composing DDP + TP is
  currently not supported").

And the model's, for `tp > 1` (`check_tensor_parallel_model`): each rank runs whole attention heads,
so `num_attention_heads` and `num_key_value_heads` divide by `tp` (a colwise `k_proj`/`v_proj`
split inside a head would break the attention's `view(..., -1, head_dim)`; transformers'
`get_kv_heads_per_rank` gives None then). An MLP's `intermediate_size` that does not divide by
`tp` is planned under TP alone, as transformers 5's own styles (`from_pretrained(tp_plan="auto")`)
run it: `gate_proj`'s and `up_proj`'s rows and `down_proj`'s columns split by torch's chunk rule
(`distribute_tensor`; 129 over 2 ranks: 65 on rank 0, 64 on rank 1), `down_proj`'s input given the
layer's width (`trainer_memcb.plan.model.tp_styles`: torch's own `RowwiseParallel` takes each rank's
columns as even shards and its matmul is refused). Beside FSDP2 each rank's chunk is chunked again
by the same rule at the rank's `dp_shard` position (65 rows: 33 and 32; 64: 32 and 32), as
`fully_shard` splits a DTensor shard; beside context parallelism FSDP2 shards over `dp_shard x cp`,
and the chunk is the rank's position on that dimension.

Uneven shards elsewhere are planned per rank, as torch runs them: a vocabulary that does not divide
by `tp` splits the embedding's and the head's rows by torch's chunk rule (`Shard._split_tensor`:
the first ranks `ceil(V / tp)` rows, the last ones fewer, possibly none), and each rank's trace,
on the fake process group of its own rank, holds its own shards, gradients, optimizer state and
redistribution buffers; no style of the plan splits the `hidden_size` (colwise layers split their
output features, rowwise ones their input features, the embedding its rows). Beside FSDP2
(`dp_shard > 1`), which shards each rank's TP shard again by the same rule over `dp_shard`, a rank
of the 2-D mesh holds the chunk of its `dp_shard` position of its TP shard (of its `dp_shard x cp`
position beside context parallelism). The ranks' figures then
differ, and the CLI shows each group of ranks holding equal shards (`tp_rank_groups`,
`trainer_memcb.cli.estimate_step.with_rank_groups`, `StepPeak.rank_groups`).

And context parallelism's (`cp > 1`, `check_context_parallel`), as accelerate, transformers and torch
run it:

- beside FSDP2 only: accelerate's `AcceleratorState` refuses `cp_size > 1` without an FSDP plugin
  ("we also shard the model across the device mesh") or with FSDP1, and FSDP2 shards over the
  joint `dp_shard x cp` ranks; DeepSpeed is refused;
- on CUDA: torch's ring (`_sdpa_handler`) dispatches CUDA's flash, memory-efficient and cuDNN
  attention kernels only ("CP only supports flash attention and memory efficient attention now");
- the model's attention implementation "sdpa" (`Trainer._prepare_context_parallel_inputs`:
  "Context parallelism is supported only with SDPA attention") and full causal attention
  (accelerate refuses a model whose `supports_context_parallel` is False: sliding-window, chunked
  or recurrent layers), checked with the model (`check_context_parallel_model`);
- the rotate method `cp_comm_strategy` "allgather" or "alltoall" (`TorchContextParallelConfig`);
- a sequence length divisible by `2 x cp`: torch's head-tail load balancer
  (`_create_default_load_balancer`) reorders the tokens only then, while its ring keeps load
  balancing on (`_cp_options.enable_load_balance`, which neither accelerate nor the Trainer
  changes) and splits each share in halves as if they had been reordered (`_templated_ring_attention`):
  at other lengths the ring runs with a wrong causal mask (later tokens seen, earlier ones
  missed), or, where `cp` does not divide them, with shares of other sizes than its equal-sized
  all-gathers and all-to-alls exchange; nothing in accelerate or the Trainer pads or refuses them;
- beside tensor parallelism, as accelerate lays the mesh out (`dp_shard, cp, tp`: its
  `ParallelismConfig` takes both, `_prepare_tp` then `_prepare_cp`): the world a multiple of
  `cp x tp` (`TensorContextParallelEngine`);
- beside the step's trainer as it runs under context parallelism (`check_context_parallel_step`):
  the plain Trainer's padded rows and TRL's SFT step on padded rows are planned (the Trainer shards
  `input_ids`, `labels`, `shift_labels`, the 2-D `attention_mask` and `position_ids`,
  `Trainer._prepare_context_parallel_inputs`; TRL's fused LM head scores the rank's `shift_labels`
  unshifted). Refused, each with the software's own reason: SFT with packing (TRL 1.16's
  `SFTTrainer.__init__`: "documents would attend across their boundaries"); GRPO and RLOO (their
  configs' `__post_init__` refuse `cp_size > 1`: the inputs are built after generation); DPO and
  KTO (their batches keep `completion_mask`, and KTO's KL rows, whole: `input_ids.masked_fill(
  completion_mask == 0, -100)` meets the rank's `L / cp` tokens against `L` and fails); the plain
  Trainer's padding-free packing (`DataCollatorWithFlattening`: no mask, the restarting
  `position_ids` sharded, and accelerate's hook runs the ring causal over the whole row, so the
  documents would attend across their boundaries silently; refused as TRL refuses packing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

__all__ = ["TP_STYLES", "Parallelism", "parse_parallelism", "parallelism_from_config", "check_tensor_parallel_model",
           "tp_shard_rows", "tp_rank_groups", "check_context_parallel", "check_context_parallel_model",
           "check_context_parallel_step", "context_parallel_step_refusal", "PARALLELISM_SIZES", "CP_COMM_STRATEGIES",
           "CP_SHARDED_KEYS"]

# accelerate's `TorchContextParallelConfig.cp_comm_strategy` values (torch's `set_rotate_method`).
CP_COMM_STRATEGIES = ("allgather", "alltoall")

# The sizes, in accelerate's mesh order (`ParallelismConfig._get_mesh`: dp_replicate, dp_shard, cp, tp).
PARALLELISM_SIZES = ("dp_replicate", "dp_shard", "cp", "tp")


# transformers' style names that `trainer_memcb.plan.model.tp_plan` maps to torch's styles (the
# table there); "replicate" maps to none.
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
             "embedding_rowwise", "embedding_colwise", "replicate")


@dataclass(frozen=True)
class Parallelism:
    """One parallel layout: the four sizes of accelerate's `ParallelismConfig`.

    Examples:
        >>> from trainer_memcb.plan.settings.parallelism import Parallelism
        >>> Parallelism(tp=2, dp_shard=4).total
        8
    """

    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in PARALLELISM_SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallelism {name}={value!r}: every size is a whole number of at least 1 "
                                 "(accelerate's ParallelismConfig)")
        if self.cp > 1 and self.dp_replicate > 1 and self.dp_shard == 1:
            raise ValueError(f"parallelism cp={self.cp} with dp_replicate={self.dp_replicate} and dp_shard=1: "
                             "accelerate refuses context parallelism beside pure data parallelism; give dp_shard > 1")
        if self.tp > 1 and self.dp_replicate > 1 and self.dp_shard == 1:
            raise ValueError(f"parallelism tp={self.tp} with dp_replicate={self.dp_replicate} and dp_shard=1: "
                             "accelerate does not compose DDP with TP; give dp_shard > 1 (HSDP x TP)")

    @property
    def total(self) -> int:
        """The processes the layout takes: the sizes' product (accelerate's `total_size`)."""
        return self.tp * self.dp_shard * self.dp_replicate * self.cp

    def text(self) -> str:
        """The layout as `--parallelism` spells it, sizes of 1 left out ("tp=2,dp_shard=4")."""
        given = [f"{name}={getattr(self, name)}" for name in ("tp", "dp_shard", "dp_replicate", "cp")
                 if getattr(self, name) > 1]
        return ",".join(given) or "tp=1"

    def check_world(self, world_size: int) -> None:
        """Refuse a world size the sizes do not multiply to.

        Raises:
            ValueError: naming both numbers.
        """
        if self.total != world_size:
            raise ValueError(f"parallelism {self.text()} multiplies to {self.total} processes, but world_size is "
                             f"{world_size}: accelerate refuses a ParallelismConfig whose total_size is not "
                             "num_processes")


def parse_parallelism(text: str) -> Parallelism:
    """`tp=2,dp_shard=4` (any of tp, dp_shard, dp_replicate, cp; the others 1) as a `Parallelism`.

    Raises:
        ValueError: an unknown name, a name given twice, or a size that is not a whole number of at least 1.

    Examples:
        >>> from trainer_memcb.plan.settings.parallelism import parse_parallelism
        >>> parse_parallelism("tp=2,dp_shard=2")
        Parallelism(tp=2, dp_shard=2, dp_replicate=1, cp=1)
    """
    sizes: Dict[str, int] = {}
    for item in str(text).split(","):
        name, equals, value = item.strip().partition("=")
        name = name.strip()
        if not equals or name not in PARALLELISM_SIZES:
            raise ValueError(f"parallelism {item.strip()!r}: expected NAME=SIZE with NAME one of "
                             f"{', '.join(('tp', 'dp_shard', 'dp_replicate', 'cp'))}, e.g. tp=2,dp_shard=4")
        if name in sizes:
            raise ValueError(f"parallelism: {name} given twice")
        try:
            size = int(value.strip())
        except ValueError:
            raise ValueError(f"parallelism {name}={value.strip()!r}: expected a whole number of at least 1") from None
        sizes[name] = size
    return Parallelism(**sizes)


def parallelism_from_config(config: Any, where: str = "training args") -> Optional[Parallelism]:
    """The layout of a `ParallelismConfig`, or of its JSON (`to_json()`, as TrainingArguments' dump
    writes it: `tp_size`, `dp_shard_size`, ...); None where none is given.

    Raises:
        ValueError: a value that is not a mapping of sizes, or sequence parallelism (`sp_size` > 1),
            which this plan does not trace.
    """
    if config is None:
        return None
    values: Mapping[str, Any] = config if isinstance(config, Mapping) else getattr(config, "__dict__", None)
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: parallelism_config={config!r}: expected ParallelismConfig's fields "
                         "(tp_size, dp_shard_size, dp_replicate_size, cp_size)")
    sp = values.get("sp_size")
    if sp not in (None, 1):
        raise ValueError(f"{where}: parallelism_config sp_size={sp!r}: DeepSpeed's sequence parallelism is not "
                         "planned; give sp_size 1")
    sizes = {name: values.get(f"{name}_size") for name in PARALLELISM_SIZES}
    try:
        return Parallelism(**{name: 1 if value is None else value for name, value in sizes.items()})
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def check_tensor_parallel_model(config: Any, tp: int, own_rules: bool = False) -> None:
    """Refuse a model whose heads do not split whole over `tp` ranks (module docstring); an uneven
    vocabulary or MLP width is planned per rank, under TP alone, beside FSDP2 and beside context
    parallelism. With `own_rules` (the user's `tp_plan` over the model's), which may split a layer
    along the hidden size (an embedding colwise, a head rowwise), the hidden size must divide too: its
    uneven shards are not planned (`tp_rank_groups` does not group the ranks by them).

    Raises:
        ValueError: naming the size, its value, `tp` and the rule.

    Examples:
        >>> from transformers import LlamaConfig
        >>> from trainer_memcb.plan.settings.parallelism import check_tensor_parallel_model
        >>> check_tensor_parallel_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
        ...                                         vocab_size=257), 2)  # 129 and 128 rows of the vocabulary
    """
    if tp <= 1 or config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    checks = (("num_attention_heads", heads, "each rank runs whole attention heads"),
              ("num_key_value_heads", kv_heads, "each rank runs whole key/value heads (k_proj and v_proj are "
               "split colwise)"),
              )
    if own_rules:
        checks += (("hidden_size", getattr(text, "hidden_size", None), "your tp_plan rules may split layers "
                    "along it, and uneven hidden shards are not planned"),)
    for name, value, why in checks:
        if isinstance(value, int) and value % tp:
            raise ValueError(f"parallelism tp={tp}: the model's {name}={value} does not divide by {tp} ({why})")


def tp_shard_rows(size: int, tp: int, rank: int) -> int:
    """Rows of a dimension of `size` that TP rank `rank` holds, by torch's chunk rule
    (`Shard._split_tensor`: `torch.chunk` of `ceil(size / tp)` rows, the last ranks fewer, possibly 0).

    Examples:
        >>> from trainer_memcb.plan.settings.parallelism import tp_shard_rows
        >>> [tp_shard_rows(257, 2, rank) for rank in range(2)], [tp_shard_rows(5, 4, rank) for rank in range(4)]
        ([129, 128], [2, 2, 1, 0])
    """
    full = -(-size // tp)
    return max(0, min(full, size - rank * full))


def tp_rank_groups(config: Any, tp: int, dp_shard: int = 1, dp_replicate: int = 1, cp: int = 1) -> List[List[int]]:
    """The ranks of accelerate's `dp_replicate x dp_shard x cp x tp` mesh grouped by what they hold: ranks of one group
    hold shards of the same sizes, so their steps are the same to the byte; one group when every
    split is even. The sizes the plan's styles split unevenly are the vocabulary's, TP's chunk of
    its rows and beside FSDP2 the chunk of that chunk at the rank's `dp_shard` position (accelerate's
    mesh: `dp_shard`, then `tp`, so rank = dp_position x tp + tp_rank), and the MLP's
    `intermediate_size`, TP's chunk of it and beside FSDP2 the chunk of that chunk the same way
    (`check_tensor_parallel_model` refuses others). HSDP's `dp_replicate` replicas (accelerate's mesh
    `dp_replicate`, `dp_shard`, `cp`, `tp`) hold the same shards as the first one's ranks. Beside
    context parallelism FSDP2 shards over `dp_shard x cp` (its position counts `cp` too), and each
    `cp` rank is a group of its own: torch's ring runs other turns on each (the tiny Llama at
    `tp=2,cp=2`: 1,600 bytes apart).

    Examples:
        >>> from transformers import LlamaConfig
        >>> from trainer_memcb.plan.settings.parallelism import tp_rank_groups
        >>> tp_rank_groups(LlamaConfig(vocab_size=257), 4)  # 65, 65, 65 and 62 rows
        [[0, 1, 2], [3]]
        >>> tp_rank_groups(LlamaConfig(vocab_size=257), 2, dp_shard=2)  # 129 rows as 65 and 64, 128 as 64 and 64
        [[0], [1, 3], [2]]
        >>> tp_rank_groups(LlamaConfig(vocab_size=256, intermediate_size=129), 2)  # 65 and 64 of the MLP's width
        [[0], [1]]
        >>> tp_rank_groups(LlamaConfig(vocab_size=256, intermediate_size=129), 2, dp_shard=2)  # 33, 32, 32, 32
        [[0], [1, 3], [2]]
        >>> tp_rank_groups(LlamaConfig(vocab_size=256), 2, cp=2)  # each cp rank's ring
        [[0, 1], [2, 3]]
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if isinstance(hidden, int) and heads else None)
    # TP splits these (the vocabulary, the MLP's width, the attention's heads), FSDP2 the first
    # dimension of each TP shard again; FSDP2 alone splits the layers' hidden size (norms, rows of
    # o_proj and down_proj), which FSDP2 pads: its chunks differ where dp_shard does not divide it.
    tp_split = [getattr(text, "vocab_size", None), getattr(text, "intermediate_size", None),
                heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else None,
                kv_heads * head_dim if isinstance(kv_heads, int) and isinstance(head_dim, int) else None]
    groups: Dict[Any, List[int]] = {}
    tp, sharded = max(1, tp), max(1, dp_shard) * max(1, cp)  # FSDP2 shards over dp_shard x cp
    for rank in range(tp * sharded * max(1, dp_replicate)):
        tp_rank, position = rank % tp, rank // tp % sharded
        chunks = [(size, sharded) for size in (tp_shard_rows(size, tp, tp_rank) for size in tp_split
                                               if isinstance(size, int) and (tp > 1 or sharded > 1))]
        chunks += [(hidden, sharded)] if isinstance(hidden, int) and sharded > 1 else []
        key = (position % max(1, cp),) + tuple((rows, tp_shard_rows(rows, parts, position)) for rows, parts in chunks)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def check_context_parallel(settings: Any) -> None:
    """Refuse context parallel settings accelerate, transformers or torch refuse, or that this plan
    does not trace yet (module docstring).

    Raises:
        ValueError: one line naming the setting, its value and the rule.
    """
    cp = settings.cp_size
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp_size={cp!r}: expected a whole number of at least 1")
    if cp == 1:
        return
    strategy = settings.cp_comm_strategy
    if strategy not in CP_COMM_STRATEGIES:
        raise ValueError(f"cp_comm_strategy={strategy!r}: accelerate takes {' or '.join(CP_COMM_STRATEGIES)}")
    if not settings.sharding.startswith("fsdp-") or settings.precision.startswith("deepspeed-"):
        raise ValueError(f"parallelism cp={cp} with sharding {settings.sharding!r}: accelerate runs context "
                         "parallelism beside FSDP2 only (it shards the model over dp_shard x cp)")
    world, replicate = settings.world_size, settings.replicate
    if world % (cp * replicate * settings.tp_size):
        raise ValueError(f"parallelism cp={cp} on world_size={world} with replicate={replicate} and tp="
                         f"{settings.tp_size}: the world is dp_replicate x dp_shard x cp x tp processes")
    if settings.device_type != "cuda":
        raise ValueError(f"parallelism cp={cp} on device_type {settings.device_type!r}: torch's ring attention "
                         "runs CUDA's flash, memory-efficient or cuDNN kernels only; give device_type cuda")
    if settings.seq_len is not None and settings.seq_len % (2 * cp):
        raise ValueError(f"parallelism cp={cp} with seq_len={settings.seq_len}: the sequence must divide by 2 x cp "
                         f"= {2 * cp} (torch's ring splits each share as if its head-tail load balancer had reordered "
                         "the tokens, which it does only then: other lengths train with a wrong causal mask, or, where "
                         "cp does not divide them, hand the ring's equal-sized exchanges shares of other sizes; pad to "
                         "a multiple, e.g. the collator's pad_to_multiple_of)")
    check_context_parallel_step(settings)


# The keys transformers 5.25's `Trainer._prepare_context_parallel_inputs` shards on the sequence
# (`shift_labels` and `position_ids` added where missing); any other key stays whole.
CP_SHARDED_KEYS = ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")


def context_parallel_step_refusal(settings: Any) -> Optional[str]:
    """Why the step's trainer refuses context parallelism, or why what it would run is not its
    step (module docstring); None where the step is planned (the plain Trainer's rows, TRL's SFT
    step on padded rows)."""
    step = settings.preference
    trainer = None if step is None else getattr(step, "trainer", "dpo")
    if trainer in ("grpo", "rloo"):
        return (f"TRL's {trainer.upper()}Config refuses cp_size > 1 (\"{trainer.upper()} builds model inputs after "
                "generation inside the trainer, so Transformers' context-parallel input sharding cannot be applied "
                "to the raw generation batch\")")
    if trainer == "dpo":
        return ("TRL's DPO batch has no labels and keeps completion_mask whole (the Trainer shards only "
                f"{', '.join(CP_SHARDED_KEYS)}): DPOTrainer's input_ids.masked_fill(completion_mask == 0, -100) "
                "meets L / cp tokens against L and fails")
    if trainer == "kto":
        return ("TRL's KTO batch keeps completion_mask and its KL rows (KL_input_ids, KL_attention_mask, "
                f"KL_completion_mask) whole (the Trainer shards only {', '.join(CP_SHARDED_KEYS)}): KTOTrainer's "
                "forwards meet L / cp tokens against L (the sharded position_ids against KL_input_ids, input_ids "
                "against completion_mask) and fail")
    if trainer == "sft" and (getattr(step, "padding_free", False) or getattr(step, "eval_packing", False)):
        return ("TRL's SFTTrainer refuses packing with context parallelism (\"context parallelism drops that mask, "
                "so documents would attend across their boundaries\"); give packing and eval_packing false")
    if trainer is None and settings.packing is not None:
        return ("padding-free packing's documents would attend across their boundaries: accelerate's hook drops "
                "the mask and runs the ring causal over the whole row (TRL's SFTTrainer refuses packing with "
                "context parallelism for this reason); leave --packing out")
    return None


def check_context_parallel_step(settings: Any) -> None:
    """Refuse context parallelism beside a step its trainer refuses it for (`context_parallel_step_refusal`).

    Raises:
        ValueError: one line naming the step and the rule.
    """
    why = context_parallel_step_refusal(settings)
    if why is not None:
        raise ValueError(f"parallelism cp={settings.cp_size}: {why}")


def check_context_parallel_model(model: Any, attn_implementation: Any, cp: int) -> None:
    """Refuse a model the Trainer or accelerate refuse context parallelism for (module docstring).

    Raises:
        ValueError: naming the attention implementation, or the model's class.
    """
    if cp <= 1:
        return
    if attn_implementation != "sdpa":
        raise ValueError(f"parallelism cp={cp} with attention {attn_implementation!r}: the Trainer runs context "
                         "parallelism with SDPA attention only; give --attn-implementation sdpa")
    if not getattr(model, "supports_context_parallel", True):
        raise ValueError(f"parallelism cp={cp}: accelerate refuses {type(model).__name__} (its layers' masks are "
                         "not full causal attention, which is all context parallelism expresses)")
