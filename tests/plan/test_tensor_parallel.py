"""Tensor parallelism: the layout read and checked as accelerate's `ParallelismConfig`, the model's
`tp_plan` in torch's styles, and the step traced per rank with `parallelize_module` on the fake
process group (the real two-process run is tests/training/test_tensor_parallel_runs.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import installed_version, requires_torch

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.model.tp_plan import model_tp_plan, torch_tp_plan
from trainer_memcb.plan.model.tp_styles import RowwiseParallelGivenWidth
from trainer_memcb.plan.step.engines.tensor_parallel import forget_sharding_cache
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.settings.parallelism import (Parallelism, check_tensor_parallel_model, parallelism_from_config,
                                                     parse_parallelism, tp_rank_groups, tp_shard_rows)

sys.path.insert(0, os.path.dirname(__file__))
from test_engines import CONFIG, build  # noqa: E402

# -- the layout --------------------------------------------------------------------------------


def test_parallelism_is_read_as_tp_dp_shard_dp_replicate_cp_sizes():
    assert parse_parallelism("tp=2") == Parallelism(tp=2)
    assert parse_parallelism(" tp=2, dp_shard=4 ,dp_replicate=2") == Parallelism(tp=2, dp_shard=4, dp_replicate=2)
    assert parse_parallelism("tp=2,dp_shard=4").total == 8
    assert parse_parallelism("dp_shard=4,tp=2").text() == "tp=2,dp_shard=4"


@pytest.mark.parametrize("text,message", [
    ("pp=2", "'pp=2': expected NAME=SIZE with NAME one of tp, dp_shard, dp_replicate, cp"),
    ("tp", "'tp': expected NAME=SIZE"),
    ("tp=2,tp=4", "tp given twice"),
    ("tp=two", "tp='two': expected a whole number of at least 1"),
    ("tp=0", "tp=0: every size is a whole number of at least 1"),
    ("tp=2,dp_replicate=2", "accelerate does not compose DDP with TP; give dp_shard > 1"),
    ("cp=2,dp_replicate=2", "accelerate refuses context parallelism beside pure data parallelism"),
])
def test_a_bad_layout_is_one_line_naming_the_rule(text, message):
    with pytest.raises(ValueError) as refused:
        parse_parallelism(text)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_layout_gives_the_world_size_and_a_different_world_is_refused_as_accelerate_does():
    settings = resolve_settings(parallelism="tp=2", batch_size=2)
    assert (settings.world_size, settings.tp_size, settings.sharding) == (2, 2, "none")
    assert settings.sources["world_size"] == settings.sources["tp_size"] == "flag"
    with pytest.raises(ValueError, match="tp=2 multiplies to 2 processes, but world_size is 4: accelerate refuses"):
        resolve_settings(parallelism="tp=2", world_size=4)


@pytest.mark.parametrize("flags,message", [
    (dict(parallelism="tp=2", sharding="zero3"), "planned alone \\(world_size = tp\\) or with FSDP2"),
    # Replicas with no sharding between them (the layout's own check refuses it from --parallelism).
    (dict(tp_size=2, world_size=4, sharding="fsdp-full-shard", replicate=2),
     "tp=2 with replicate=2 on world_size=4: the world is dp_replicate x dp_shard x tp processes, with dp_shard > 1"),
    (dict(parallelism="tp=2", precision="deepspeed-bf16"), "without DeepSpeed"),
])
def test_what_is_not_planned_yet_is_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(**flags)


def test_trl_s_steps_beside_tp_are_refused_naming_the_trainer():
    from trainer_memcb.plan.step.sft import SftStep

    with pytest.raises(ValueError, match="parallelism tp=2 with TRL's SFT step: TRL's steps are planned without tensor "
                                         "parallelism so far"):
        resolve_settings(parallelism="tp=2", batch_size=2, preference=SftStep(max_length=16))


def test_tp_with_dp_shard_is_fsdp2_on_the_rest_of_the_world():
    settings = resolve_settings(parallelism="tp=2,dp_shard=4", batch_size=2)
    assert (settings.world_size, settings.tp_size, settings.sharding) == (8, 2, "fsdp-full-shard")
    assert settings.sources["sharding"] == "flag"


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_tp_beside_hsdp_and_beside_fsdp2_s_offload_is_the_tp_x_fsdp2_step():
    """HSDP's replicas beside TP (accelerate's (dp_replicate, dp_shard, tp) mesh, fully_shard on its
    first two dimensions) hold what the same dp_shard holds without them; FSDP2's CPU offload files
    the shards and the optimizer state on the host, the rest on the device. The real runs (8 and 4
    processes) read these figures (tests/training/test_tensor_parallel_runs.py)."""
    settings = resolve_settings(parallelism="tp=2,dp_shard=2,dp_replicate=2", batch_size=2, optimizer="adamw_torch")
    assert (settings.world_size, settings.replicate, settings.sharding) == (8, 2, "fsdp-full-shard")
    hsdp, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert hsdp.settings.engine == "tp-fsdp2" and hsdp.step.problem is None
    assert hsdp.step.notes[0].startswith("TP x HSDP: a 2 x 2 x 2 mesh (dp_replicate, dp_shard, tp)")
    assert (hsdp.step.peak_bytes, forward_peak_of(hsdp)) == (859_424, 801_432)  # TP=2 x FSDP2=2's, below
    settings = resolve_settings(parallelism="tp=2,dp_shard=2", fsdp_cpu_offload=True, batch_size=2,
                                optimizer="adamw_torch")
    offload, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert dict(offload.step.host_bytes) == {"parameters": 115_328, "optimizer_state": 230_740}
    assert offload.step.peak_bytes == 859_424 - 115_328 - 230_740 == 513_356


def test_the_training_args_parallelism_config_is_read_as_to_json_writes_it():
    # `TrainingArguments.to_dict()` writes `ParallelismConfig.to_json()`: its fields by name.
    written = {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 2, "cp_size": 1, "cp_backend": "torch",
               "sp_size": 1, "sp_backend": "deepspeed", "tp_handler": {}, "cp_handler": None, "sp_handler": None}
    settings = resolve_settings({"parallelism_config": written, "per_device_train_batch_size": 2})
    assert (settings.world_size, settings.tp_size, settings.sharding) == (2, 2, "none")
    assert settings.sources["tp_size"] == "training args (parallelism_config)"
    assert parallelism_from_config(dict(written, dp_shard_size=4)) == Parallelism(tp=2, dp_shard=4)
    with pytest.raises(ValueError, match="sp_size=2: DeepSpeed's sequence parallelism is not planned"):
        parallelism_from_config(dict(written, sp_size=2))


def test_the_accelerate_parallelism_config_object_reads_the_same():
    from accelerate.parallelism_config import ParallelismConfig

    assert parallelism_from_config(ParallelismConfig(tp_size=2, dp_shard_size=2)) == Parallelism(tp=2, dp_shard=2)


@pytest.mark.parametrize("change,message", [
    (dict(num_attention_heads=2, num_key_value_heads=2, hidden_size=64), None),
    (dict(num_attention_heads=8, num_key_value_heads=2), "num_key_value_heads=2 does not divide by 4"),
    (dict(num_attention_heads=2, num_key_value_heads=2, hidden_size=32, head_dim=16), "num_attention_heads=2"),
])
def test_the_model_s_heads_and_widths_split_whole_over_tp(change, message):
    config = LlamaConfig(**dict(CONFIG, **change))
    if message is None:
        with pytest.raises(ValueError, match="num_attention_heads=2 does not divide by 4 \\(each rank runs whole"):
            check_tensor_parallel_model(config, 4)
        check_tensor_parallel_model(config, 2)
        return
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_model(config, 4)


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
@pytest.mark.parametrize("change,figures", [
    # The even model's ranks: 57,664 parameter bytes (bf16), 115,412 of optimizer state, each cp rank's
    # own ring (475,280 and 473,680 bytes).
    ({}, [(475_280, 57_664, 115_412), (475_280, 57_664, 115_412), (473_680, 57_664, 115_412),
          (473_680, 57_664, 115_412)]),
    # 257 tokens: TP rank 0's 129 rows of the embedding and the head split 65 / 64 by FSDP2 over
    # dp_shard x cp, TP rank 1's 128 as 64 / 64. FSDP2's padded shards of 65 rows on ranks 0 and 2 (2
    # tables x 64 bf16 values more, 256 bytes), rank 0's moments over its 65 rows (2 x 2 x 64 x 2, 512).
    ({"vocab_size": 257}, [(476_688, 57_920, 115_924), (475_280, 57_664, 115_412), (474_576, 57_920, 115_412),
                           (473_680, 57_664, 115_412)]),
    # An MLP width of 129: gate_proj's and up_proj's 65 rows split 33 / 32, down_proj's 65 columns kept
    # by both (160 values more a layer in FSDP2's padded shards, 640 bytes); the moments rank 0's 320
    # values more (1,280 bytes), rank 2's down_proj columns only (2 x 2 x 32 x 2, 256).
    ({"intermediate_size": 129}, [(478_992, 58_304, 116_692), (475_280, 57_664, 115_412),
                                  (476_368, 58_304, 115_668), (473_680, 57_664, 115_412)]),
])
def test_uneven_shards_beside_cp_are_planned_per_rank(change, figures):
    """Beside context parallelism FSDP2 shards over dp_shard x cp, so a TP rank's chunk is chunked
    again at each cp position, and each cp rank runs its own turns of torch's ring: at tp=2,cp=2 every
    rank is a group of its own where a size splits unevenly. No CPU run of CP exists (its ring runs
    CUDA kernels): the shards are checked against the hand count from torch's chunk rule, as for the
    real runs beside FSDP2."""
    config = LlamaConfig(**dict(CONFIG, **change))
    check_tensor_parallel_model(config, 2)
    assert tp_rank_groups(config, 2, cp=2) == ([[0, 1], [2, 3]] if not change else [[0], [1], [2], [3]])
    planned = []
    for rank in range(4):
        settings = resolve_settings(parallelism="tp=2,cp=2", rank=rank, batch_size=2, seq_len=16, precision="bf16",
                                    device_type="cuda", optimizer="adamw_torch")
        plan, _ = plan_step_memory(lambda: _llama(**change), settings=settings, model_states=False)
        assert plan.step.problem is None and plan.settings.engine == "tp-cp-fsdp2", plan.step.problem
        states = plan.step.model_states_at_optimizer_step_bytes
        planned.append((plan.step.peak_bytes, states["parameters"], states["optimizer_state"]))
    assert planned == figures


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_an_uneven_mlp_width_is_planned_per_rank_as_transformers_styles_split_it():
    """129 columns of the tiny Llama's MLP at tp=2: rank 0 holds 65 rows of gate_proj and up_proj and
    65 columns of down_proj, rank 1 64 of each (torch's chunk rule, which transformers' placeholders
    and loading follow), each shard a tensor of its own size; the real run's figures are
    tests/training/test_tensor_parallel_runs.py's."""
    assert tp_rank_groups(LlamaConfig(**dict(CONFIG, intermediate_size=129)), 2) == [[0], [1]]
    plans = []
    for rank in range(2):
        settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(lambda: _llama(intermediate_size=129), seq_len=16, settings=settings,
                                   device_type="cpu", model_states=False)
        assert plan.step.problem is None and plan.settings.engine == "tp", plan.step.problem
        plans.append(plan)
    states = [plan.step.model_states_at_optimizer_step_bytes for plan in plans]
    # Rank 0: one row of each of gate_proj and up_proj and one column of down_proj more per layer than
    # at a width of 128 (2 x 3 x 64 values); rank 1 the even shards' 230,656 bytes (not a view of a
    # 65-row storage, as torch's distribute_tensor would leave it: 1,024 bytes more).
    assert [each["parameters"] for each in states] == [230_656 + 2 * 3 * 64 * 4, 230_656]
    assert [each["gradients"] for each in states] == [263_424 + 2 * 3 * 64 * 4, 263_424]
    assert [each["optimizer_state"] for each in states] == [461_396 + 2 * 2 * 3 * 64 * 4, 461_396]
    assert [(plan.step.peak_bytes, plan.step.forward_backward_peak_bytes) for plan in plans] == [
        (1_044_632, 1_021_216), (1_038_232, 1_015_584)]  # rank 1: the even width's step, to the byte


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_an_uneven_mlp_width_beside_fsdp2_is_planned_per_rank_as_fully_shard_splits_each_tp_chunk():
    """129 columns at tp=2,dp_shard=2: TP rank 0's 65 rows of gate_proj and up_proj (and columns of
    down_proj) split 33 / 32 by FSDP2, TP rank 1's 64 split 32 / 32, so ranks 0 and 2 differ and ranks
    1 and 3 hold the even width's step; each figure is the real four-process run's FSDPMemTracker
    reading (tests/training/test_tensor_parallel_runs.py)."""
    assert tp_rank_groups(LlamaConfig(**dict(CONFIG, intermediate_size=129)), 2, dp_shard=2) == [[0], [1, 3], [2]]
    figures = []
    for rank in (0, 1, 2):
        settings = resolve_settings(parallelism="tp=2,dp_shard=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(lambda: _llama(intermediate_size=129), seq_len=16, settings=settings,
                                   device_type="cpu", model_states=False)
        assert plan.step.problem is None and plan.settings.engine == "tp-fsdp2", plan.step.problem
        states = plan.step.model_states_at_optimizer_step_bytes
        figures.append((plan.step.peak_bytes, states["parameters"], states["optimizer_state"]))
    # Ranks 0 and 2 keep FSDP2's padded shards, of equal size: gate_proj's and up_proj's 33 rows of 64
    # and down_proj's 32 rows of 65 columns against 32 x 64 each, 160 values more in each of two layers
    # (1,280 bytes). The optimizer's moments are made like the unpadded shards: rank 0's 33 rows, 2,560
    # bytes more; rank 2's 32 rows, only down_proj's column more (2 x 32 x 2 moments x 4 = 512 bytes).
    assert figures == [(867_232, 116_608, 233_300), (859_424, 115_328, 230_740), (865_184, 116_608, 231_252)]


def test_an_uneven_hidden_size_is_refused_under_the_user_s_own_rules():
    """The model's plan splits no layer along the hidden size; a user's rule may (an embedding
    colwise), and its uneven shards are not planned. (transformers 5 refuses a Llama whose hidden
    size is not its heads' width; Qwen3's head_dim is its own.)"""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=33, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16, vocab_size=256)
    check_tensor_parallel_model(config, 2)
    with pytest.raises(ValueError, match="hidden_size=33 does not divide by 2 \\(your tp_plan rules may split"):
        check_tensor_parallel_model(config, 2, own_rules=True)

    def qwen3():
        with torch.device("meta"):
            return Qwen3ForCausalLM(config)

    settings = resolve_settings(parallelism="tp=2", batch_size=2, tp_plan={"model.embed_tokens": "colwise"})
    with pytest.raises(ValueError, match="hidden_size=33 does not divide by 2"):
        plan_step_memory(qwen3, seq_len=16, settings=settings, device_type="cpu", model_states=False)


@pytest.mark.parametrize("size,tp,rows,groups", [
    (257, 2, [129, 128], [[0], [1]]),
    (256, 2, [128, 128], [[0, 1]]),
    (257, 4, [65, 65, 65, 62], [[0, 1, 2], [3]]),
    (5, 4, [2, 2, 1, 0], [[0, 1], [2], [3]]),  # torch.chunk: the last rank holds none
])
def test_tp_ranks_hold_torch_s_chunks_and_are_grouped_by_them(size, tp, rows, groups):
    # torch's own split of a tensor of `size` rows over `tp` ranks (`Shard._split_tensor`), the judge.
    from torch.distributed.tensor import Shard

    shards, _ = Shard(0)._split_tensor(torch.empty(size, 1), tp, with_padding=False)
    assert [tp_shard_rows(size, tp, rank) for rank in range(tp)] == [shard.shape[0] for shard in shards] == rows
    assert tp_rank_groups(LlamaConfig(**dict(CONFIG, vocab_size=size)), tp) == groups


@pytest.mark.parametrize("size,dp_shard,groups", [
    # 129 rows as 65 and 64 over dp_shard, 128 as 64 and 64 (ranks: dp position x tp + TP rank); the
    # real four-process run reads rank 0, rank 2 and ranks 1 and 3 apart
    # (tests/training/test_tensor_parallel_runs.py).
    (257, 2, [[0], [1, 3], [2]]),
    (256, 2, [[0, 1, 2, 3]]),
    # At dp_shard=3 the third position's chunks differ too: FSDP2 splits the hidden size's 64 rows (the
    # norms, o_proj's and down_proj's) and each TP shard's 64 rows (q_proj's to v_proj's, gate_proj's and
    # up_proj's) as 22, 22 and 20 (test_uneven_fsdp2_positions_plan_their_own_chunks); 129 as 43 x 3.
    (257, 3, [[0, 2], [1, 3], [4], [5]]),
    (256, 3, [[0, 1, 2, 3], [4, 5]]),
])
def test_beside_fsdp2_ranks_are_grouped_by_the_chunk_of_their_tp_chunk(size, dp_shard, groups):
    assert tp_rank_groups(LlamaConfig(**dict(CONFIG, vocab_size=size)), 2, dp_shard=dp_shard) == groups


def test_hsdp_s_replicas_hold_their_dp_shard_position_s_chunks():
    # accelerate's (dp_replicate, dp_shard, tp) mesh: rank = (replica x dp_shard + position) x tp + TP rank.
    config = LlamaConfig(**dict(CONFIG, vocab_size=257))
    assert tp_rank_groups(config, 2, dp_shard=2, dp_replicate=2) == [[0, 4], [1, 3, 5, 7], [2, 6]]


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_uneven_fsdp2_positions_plan_their_own_chunks():
    """The tiny Llama at tp=2,dp_shard=3: FSDP2 splits 64 rows as 22, 22 and 20 and the 128 rows of
    the embedding's and the head's TP shards as 43, 43 and 42, so the third position (ranks 4 and 5)
    holds less optimizer state; its parameters are FSDP2's padded shards, the same size."""
    states, peaks = [], []
    for rank in (0, 4):
        settings = resolve_settings(parallelism="tp=2,dp_shard=3", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
        states.append(plan.step.model_states_at_optimizer_step_bytes)
        peaks.append(plan.step.peak_bytes)
    assert states[0]["parameters"] == states[1]["parameters"] == 78_776
    # Per layer q_proj, k_proj and v_proj 1 row of 64, o_proj 2 of 32, gate_proj, up_proj and down_proj
    # 2 of 64, two norms 2 values (644); the embedding and the head a row of 64 each, the final norm 2:
    # 1,418 values fewer, two moments of 4 bytes each.
    assert states[0]["optimizer_state"] - states[1]["optimizer_state"] == (2 * 644 + 2 * 64 + 2) * 2 * 4 == 11_344
    assert peaks == [755_440, 744_096]


def _llama(**change):
    config = LlamaConfig(**dict(CONFIG, **change))
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


# -- the model's plan --------------------------------------------------------------------------


def test_llama_s_plan_is_transformers_own_in_torch_s_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    meta = build()
    plan = model_tp_plan(meta)
    # The config's base_model_tp_plan under the base model's prefix, every entry naming modules.
    base = {f"model.{name}": style for name, style in meta.config.base_model_tp_plan.items()}
    assert {name: plan[name] for name in base} == base
    styles = torch_tp_plan(plan)
    # torch's RowwiseParallel, its input given the layer's width as transformers gives it.
    assert type(styles["model.layers.*.mlp.down_proj"]) is RowwiseParallelGivenWidth
    assert isinstance(styles["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert styles["model.layers.*.self_attn.q_proj"].output_layouts == (Shard(-1),)
    if installed_version("transformers") < (5,):
        # transformers 4.57's merged plan holds the same entries without the prefix too (left out: they
        # name no module of the causal LM), and no head or embedding entry.
        assert set(meta.tp_plan) - set(plan) == set(meta.config.base_model_tp_plan) and plan == base
        return
    # transformers 5's merged plan: the config's, the head's and the embedding's.
    assert plan == dict(meta.tp_plan) and plan["lm_head"] == "colwise_gather_output"
    head, embedding = styles["lm_head"], styles["model.embed_tokens"]
    assert type(head) is ColwiseParallel and head.output_layouts == (Replicate(),)
    assert type(embedding) is RowwiseParallel and embedding.input_layouts == (Replicate(),)


def test_a_style_with_no_torch_equivalent_is_refused_by_name():
    with pytest.raises(ValueError, match="'experts': style 'moe_tp_experts' is not planned"):
        torch_tp_plan({"experts": "moe_tp_experts"})
    assert torch_tp_plan({"norm": "replicate"}) == {}


def test_the_sequence_parallel_style_is_refused_with_its_reason():
    # transformers 5.25's own SequenceParallel on the tiny Llama's norms, loaded with from_pretrained(
    # tp_plan=rules) in a real 2-process run here, failed in LlamaRMSNorm's forward ("aten.mul.Tensor got
    # mixed torch.Tensor and DTensor"); the plan refuses the rule rather than plan a step that does not run.
    with pytest.raises(ValueError, match="'model.norm': style 'sequence_parallel' is not planned: transformers' "
                                         "SequenceParallel fails in the norm's forward"):
        resolve_settings(parallelism="tp=2", tp_plan={"model.norm": "sequence_parallel"})


def test_a_model_without_a_plan_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no tensor-parallel plan"):
        model_tp_plan(model)


# -- the traced step per rank ------------------------------------------------------------------

# The tiny Llama's values on one of two ranks, by the plan: the embedding's and the head's 256 x 64
# rows halved (8,192 each), each layer's seven linear layers halved (4 x 2,048 + 3 x 4,096 =
# 20,480) beside its two whole norms (128), the final norm whole (64).
TP2_PARAMS = 8_192 + 8_192 + 2 * (20_480 + 128) + 64


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_step_holds_each_rank_s_shards(rank):
    settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.problem is None, plan.step.problem
    assert plan.settings.engine == "tp"
    states = plan.step.model_states_at_optimizer_step_bytes
    assert states["parameters"] == 4 * TP2_PARAMS == 230_656  # half of one process's 460,032 but the norms
    # AdamW's two moments like each shard, and 21 four-byte step counts.
    assert states["optimizer_state"] == 2 * 4 * TP2_PARAMS + 21 * 4 == 461_396
    # The gradients are the shards' but the embedding's: torch 2.13's DTensor propagates the
    # backward of an embedding sharded by rows (`Shard(0)`, a replicated input) to a replicated
    # gradient, all 256 x 64 values on each rank (the real run's too, 32,768 bytes above its shard).
    assert states["gradients"] == 4 * TP2_PARAMS + 4 * 8_192 == 263_424
    # 1,038,240 on each real process (MemTracker), 8 bytes of it the device mesh's own rank tensor.
    assert plan.step.peak_bytes == 1_038_232
    assert sum(plan.step.peak_parts.values()) == plan.step.peak_bytes


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_a_model_whose_heads_do_not_split_is_refused_before_tracing():
    def two_heads():
        config = LlamaConfig(**dict(CONFIG, num_attention_heads=2, num_key_value_heads=2, hidden_size=64))
        with torch.device("meta"):
            return LlamaForCausalLM(config)

    settings = resolve_settings(parallelism="tp=4", batch_size=2)
    with pytest.raises(ValueError, match="num_attention_heads=2 does not divide by 4"):
        plan_step_memory(two_heads, seq_len=16, settings=settings, device_type="cpu", model_states=False)


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_uneven_vocabulary_each_rank_holds_its_own_chunk():
    # 257 tokens over 2 ranks: 129 rows of the embedding and the head on rank 0, 128 on rank 1 (torch's
    # chunk rule), each traced on its own rank of the fake process group. The real 2-process run's
    # MemTracker reads the same per rank (tests/training/test_tensor_parallel_runs.py).
    layers_and_norms = TP2_PARAMS - 2 * 8_192
    figures = []
    for rank, rows in enumerate((129, 128)):
        settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(lambda: _llama(vocab_size=257), seq_len=16, settings=settings, device_type="cpu",
                                   model_states=False)
        assert plan.step.problem is None, plan.step.problem
        states = plan.step.model_states_at_optimizer_step_bytes
        # Rank 1's 128 rows are a view of a storage padded to 129 (torch's `Shard._shard_tensor`).
        assert states["parameters"] == 4 * (layers_and_norms + 2 * 129 * 64) == 231_168
        assert states["gradients"] == 4 * (layers_and_norms + 257 * 64 + rows * 64)  # the embedding's whole
        assert states["optimizer_state"] == 2 * 4 * (layers_and_norms + 2 * rows * 64) + 21 * 4
        figures.append((plan.step.peak_bytes, plan.step.forward_backward_peak_bytes))
    assert figures == [(1_040_792, 1_017_504), (1_039_000, 1_016_728)]


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_down_proj_s_uneven_input_runs_with_its_width_given_as_transformers_gives_it():
    """torch's own RowwiseParallel takes rank 0's 65 of 129 columns as one of two even shards (130)
    and refuses the matmul, as a real run under parallelize_module does ("a and b must have same
    reduction dim"); given the width, as transformers 5's RowwiseParallel gives it, it runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for style, fails in ((RowwiseParallel(), True), (RowwiseParallelGivenWidth(), False)):
            down = parallelize_module(torch.nn.Linear(129, 64, bias=False), mesh, style)
            assert down.weight.to_local().shape == (64, 65)  # torch's chunk rule: rank 0 holds the 65
            if fails:
                with pytest.raises(RuntimeError, match="reduction dim"):
                    down(torch.ones(2, 16, 65))
            else:
                # Used, so that its all-reduce (async, torch's style) is waited for before the group goes.
                assert (down(torch.ones(2, 16, 65)) * 1).shape == (2, 16, 64)
    finally:
        dist.destroy_process_group()
        forget_sharding_cache()


def forward_peak_of(plan) -> int:
    """The most bytes the plan holds in its forward: the timeline's most alive between the forward's
    first event and the backward's, and the optimizer state made in the step before (resident, as
    in the plan's forward-and-backward peak; a real run's tracker, over its third step, holds it)."""
    timeline = plan.timeline
    alive, most = 0, 0
    for index, event in enumerate(timeline.events[:timeline.phase_starts["backward"]]):
        alive += timeline.sizes[event] if event >= 0 else -timeline.sizes[~event]
        if index >= timeline.phase_starts["forward"]:
            most = max(most, alive)
    return most + plan.step.model_states_at_optimizer_step_bytes["optimizer_state"]


# Under TP=2 x FSDP2=2 each process holds half of each TP shard (FSDP2's `_StridedShard` on dim 0)
# and half of each norm: a quarter of the tiny Llama's 115,008 values, to the value (all split evenly).
TP2_FSDP2_PARAMS = TP2_PARAMS // 2


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_tp2_fsdp2_step_holds_fsdp2_s_shards_of_the_tp_shards():
    peaks = []
    for rank in (0, 3):  # one process, one trace after the other: each its own process group
        settings = resolve_settings(parallelism="tp=2,dp_shard=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
        assert plan.step.problem is None, plan.step.problem
        assert plan.settings.engine == "tp-fsdp2"
        states = plan.step.model_states_at_optimizer_step_bytes
        assert states["parameters"] == 4 * TP2_FSDP2_PARAMS == 115_328 == 115_008 * 4 // 4 + 80 * 4
        assert states["optimizer_state"] == 2 * 4 * TP2_FSDP2_PARAMS + 21 * 4
        # FSDP2's all-gathered layer (TP shards, 148,224 bytes at the peak) and its buffers are in it.
        assert plan.step.peak_parts["unsharded_parameters"] == 148_224
        peaks.append((plan.step.peak_bytes, plan.step.forward_backward_peak_bytes, forward_peak_of(plan)))
    # Each process of a real 4-process run reads 859,424 when gloo frees on time, in its backward, and
    # 801,432 in its forward (tests/training/test_tensor_parallel_runs.py): the head's all-gathered
    # logits taken as the real process holds them, not copied by the fake `wait_tensor` (32,768 bytes
    # more, 834,200, before).
    assert peaks == [(859_424, 859_424, 801_432)] * 2


# Llama 3 70B's shapes (its published config: 80 layers of 8,192, MLP 28,672, 64 heads, 8 key/value
# heads, 128,256 tokens), built from the config on the meta device.
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)


def build_70b():
    config = LlamaConfig(**LLAMA3_70B)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.slow
@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_70b_at_tp8_dp_shard16_holds_the_hand_counted_shards():
    settings = resolve_settings(parallelism="tp=8,dp_shard=16", batch_size=1, optimizer="adamw_torch",
                                precision="autocast-bf16", gradient_checkpointing=True)
    plan, _ = plan_step_memory(build_70b, seq_len=512, settings=settings, device_type="cuda", model_states=False)
    assert plan.step.problem is None, plan.step.problem
    # By hand: every linear layer, the embedding and the head split 8 ways by TP and 16 by FSDP2
    # (128,256 rows: 16,032 per TP rank, 1,002 per process), the 161 norms of 8,192 16 ways by FSDP2.
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    norms = (2 * 80 + 1) * 8192
    per_process = (80 * layer + 2 * 128256 * 8192) // 128 + norms // 16
    assert per_process == 551_272_960
    states = plan.step.model_states_at_optimizer_step_bytes
    assert states["parameters"] == 4 * per_process == 2_205_091_840  # fp32 shards: the Trainer's bf16 is autocast
    assert states["optimizer_state"] == 2 * 4 * per_process + 4 * (80 * 9 + 3)  # AdamW's moments, 723 steps


@pytest.mark.slow
@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_torchtitan_s_70b_fsdp32_x_tp8_settings_under_transformers_plan():
    """docs/published-runs.md's torchtitan section: Llama 3.1 70B's shapes at tp=8,dp_shard=32, x 8192
    tokens, full activation checkpointing, on a 96 GiB H100, under the model's own transformers plan (no
    sequence or loss parallelism); its command holds the figures at torchtitan's batch of 16 (run by
    tests/test_docs.py), this test the largest batch that fits."""
    def plan_of(batch):
        settings = resolve_settings(parallelism="tp=8,dp_shard=32", batch_size=batch, optimizer="adamw_torch",
                                    precision="autocast-bf16", gradient_checkpointing=True, gpu="H100",
                                    device_memory=96 * 2**30)
        plan, _ = plan_step_memory(build_70b, seq_len=8192, settings=settings, device_type="cuda", model_states=False)
        assert plan.step.problem is None, plan.step.problem
        return plan

    # The largest batch that fits: 3 of torchtitan's 16.
    fitting, too_many = plan_of(3), plan_of(4)
    # The activations at the peak, by hand, per sequence: the 80 checkpointed layers' inputs, whole on
    # every TP rank (80 x 8192 x 8192 in bf16), the loss's fp32 log-probabilities over the gathered
    # vocabulary (8192 x 128,256), and 512.1 MiB more; sequence and loss parallelism keep an eighth of
    # each of the two. At the page's batch of 16: 247,633,281,024 bytes, 8.0 GiB of them the rest.
    layer_inputs, log_probabilities, rest = 80 * 8192 * 8192 * 2, 8192 * 128256 * 4, 536_969_216
    assert dict(fitting.step.peak_parts)["activations"] == 3 * (layer_inputs + log_probabilities + rest)
    assert 16 * (layer_inputs + log_probabilities + rest) == 247_633_281_024
    assert (fitting.device.reserved_peak_bytes, fitting.verdict.fits) == (90_217_381_888, True)
    assert (too_many.device.reserved_peak_bytes, too_many.verdict.fits) == (118_839_312_384, False)


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
def test_tp_x_cp_with_hsdp_s_replicas_holds_what_dp_shard_alone_holds():
    """accelerate's (dp_replicate, dp_shard, cp, tp) mesh: FSDP2 over dp_shard x cp, replicated over
    dp_replicate, so a replica's ranks hold what the same layout without replicas holds."""
    peaks = []
    for parallelism in ("tp=2,cp=2,dp_shard=2", "tp=2,cp=2,dp_shard=2,dp_replicate=2"):
        settings = resolve_settings(parallelism=parallelism, batch_size=2, seq_len=16, precision="bf16",
                                    device_type="cuda", optimizer="adamw_torch")
        plan, _ = plan_step_memory(build, settings=settings, model_states=False)
        assert plan.step.problem is None and plan.settings.engine == "tp-cp-fsdp2", plan.step.problem
        peaks.append((plan.step.peak_bytes, plan.step.model_states_at_optimizer_step_bytes["parameters"]))
    assert peaks == [(388_784, 28_832)] * 2  # a quarter of the TP shards' 115,328 bf16 bytes (with the norms')
    assert plan.step.notes[0].startswith("TP x CP x FSDP2: a 2 x 2 x 2 x 2 mesh (dp_replicate, dp_shard, cp, tp)")
    assert plan.step.notes[0].endswith("FSDP2 over dp_shard x cp = 4, replicated 2x (HSDP)")
