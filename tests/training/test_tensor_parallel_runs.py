"""The tensor-parallel step plan against real runs: torchrun on 2 CPU processes (gloo), TP=2 on
the tiny Llama of tests/plan/test_engines.py, and on 4, TP=2 x FSDP2=2, one measured step each
(tests/dist_scripts/engine_step_profile.py, engines `tp`, `tp-uneven`, `tp-auto`, `tp-auto-uneven-mlp`,
`tp-attention-whole`, `tp-bert`, `tp-fsdp2`, `tp-fsdp2-uneven`, `tp-fsdp2-uneven-mlp`, `tp-fsdp2-offload`
and, on 8, `tp-hsdp`).

The real run applies the same plan the trace applies: the model's `tp_plan` (transformers') in
torch's styles with torch's `parallelize_module` (`trainer_memcb.plan.model.tp_plan`); transformers
5.25's own `from_pretrained(tp_plan="auto")` (its own styles, `transformers.distributed.tensor_parallel`)
runs on this CPU with gloo too, and is compared apart (below). Its gradients are clipped by accelerate's own
`Accelerator._clip_grad_norm_dtensor_aware`, as the Trainer clips a DTensor model. As for DDP
(tests/training/test_engine_runs.py), the judge is torch's MemTracker, entered before the model is
made, over the third step; under TP x FSDP2, as for FSDP2, torch's FSDPMemTracker."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import requires_torch, requires_transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan"))
from test_engines import CONFIG, build  # noqa: E402
from test_engine_runs import _tracked  # noqa: E402
from test_tensor_parallel import forward_peak_of  # noqa: E402

from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402
from trainer_memcb.plan.settings import resolve_settings  # noqa: E402

pytestmark = pytest.mark.slow

PROCESSES = 2
# The real run's device mesh keeps its ranks as a tensor (`DeviceMesh.mesh`, int32, one value per
# process: 8 bytes on two), made under the tracker because the mesh is made as the model is wrapped;
# the plan makes its mesh before its fake step, and on a GPU run that tensor is host memory.
MESH_RANKS_BYTES = 4 * PROCESSES
# gloo's worker thread lets a collective's buffers go late in about one step in twenty (up to 49,152
# bytes above the program's order, in the forward or the backward, on either process, in 10 launches
# here); the run keeps the least of five identical steps, each phase's apart (`TRACKED_STEPS` in
# tests/dist_scripts/engine_step_profile.py), which read the same in every launch here.


def peak_beyond_plan(real: dict, plan, beyond: int) -> int:
    """The tracker's peak less the plan's and `beyond` (the run's own extras): 0 when exact."""
    return real["peak_bytes"] - beyond - plan.step.peak_bytes


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    return _tracked("engine_step_profile.py", tmp_path_factory,
                    ["tp", "tp-auto", "tp-uneven", "tp-attention-whole", "tp-auto-uneven-mlp", "tp-bert"], PROCESSES)


@pytest.fixture(scope="module")
def tp_tracked(tp_runs):
    return tp_runs["tp"]


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("rank", range(PROCESSES))
def test_tp2_peak_per_process_equals_memtrackers_on_the_real_run(tp_tracked, rank):
    settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.settings.engine == "tp"
    real = tp_tracked[rank]
    # 1,038,240 on each process; the plan 1,038,232 (its backward 1,015,584).
    assert (plan.step.peak_bytes, plan.step.forward_backward_peak_bytes) == (1_038_232, 1_015_584)
    assert peak_beyond_plan(real, plan, MESH_RANKS_BYTES) == 0, (plan.step.peak_bytes, real)
    # The tracker's own backward peak (the root module's, the forward's below it) is the plan's.
    beyond = real["phase_peaks"]["backward"] - MESH_RANKS_BYTES - plan.step.forward_backward_peak_bytes
    assert beyond == 0, real["phase_peaks"]
    states = plan.step.model_states_at_optimizer_step_bytes
    # The tracker's parameters and gradients at its peak are the plan's shards to the byte (its
    # optimizer-state figure holds the step's foreach temporaries too, its own way of filing them).
    assert real["parts"]["_MemRefType.PARAM"] == states["parameters"] == 230_656
    assert states["gradients"] == 263_424
    assert real["parts"]["_MemRefType.GRAD"] == 263_424
    assert real["params"] == {"local_bytes": 230_656, "storage_bytes": 230_656}


# -- TP=2 with uneven shards: the tiny Llama with 257 tokens -----------------------------------------

# torch's chunk rule splits the embedding's and the head's 257 rows 129 / 128 (`tp_shard_rows`).
UNEVEN_VOCAB, ROWS = 257, (129, 128)
# By hand, per rank: each layer's shards and norms and the final norm (41,280 values) as at 256 tokens.
LAYERS_AND_NORMS = 2 * (20_480 + 128) + 64


def build_uneven():
    config = LlamaConfig(**dict(CONFIG, vocab_size=UNEVEN_VOCAB))
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def uneven_plan(rank):
    settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build_uneven, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.problem is None and plan.settings.engine == "tp", plan.step.problem
    return plan


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_uneven_tp2_each_rank_s_plan_equals_memtrackers_on_the_real_run(tp_runs):
    plans = [uneven_plan(rank) for rank in range(PROCESSES)]
    for rank, (plan, real) in enumerate(zip(plans, tp_runs["tp-uneven"])):
        rows = ROWS[rank]
        states = plan.step.model_states_at_optimizer_step_bytes
        # The shards: rank 1's 128 rows of the embedding and the head are a view of a 129-row storage
        # (torch's `Shard._shard_tensor` scatters into chunks padded to ceil(257 / 2) and narrows), so
        # both processes hold 129 rows of each, as the real run's storages show.
        assert real["params"] == {"local_bytes": 4 * (LAYERS_AND_NORMS + 2 * rows * 64), "storage_bytes": 231_168}
        assert states["parameters"] == real["parts"]["_MemRefType.PARAM"] == 4 * (LAYERS_AND_NORMS + 2 * 129 * 64)
        # The gradients: the embedding's whole (257 rows, as at 256 tokens), the head's this rank's rows.
        assert states["gradients"] == 4 * (LAYERS_AND_NORMS + UNEVEN_VOCAB * 64 + rows * 64)
        assert real["parts"]["_MemRefType.GRAD"] == states["gradients"]
        # AdamW's two moments like the local shards, and 21 step counts.
        assert states["optimizer_state"] == 2 * 4 * (LAYERS_AND_NORMS + 2 * rows * 64) + 21 * 4
        # Each process's peak is its own plan's to the byte (and the mesh's 8), as is each phase's.
        assert peak_beyond_plan(real, plan, MESH_RANKS_BYTES) == 0, (rank, plan.step.peak_bytes, real)
        beyond = max(real["phase_peaks"].values()) - MESH_RANKS_BYTES - plan.step.forward_backward_peak_bytes
        assert beyond == 0, (rank, plan.step.forward_backward_peak_bytes, real["phase_peaks"])
    assert [plan.step.peak_bytes for plan in plans] == [1_040_792, 1_039_000]  # the real runs' 1,040,800 and 1,039,008
    assert [plan.step.forward_backward_peak_bytes for plan in plans] == [1_017_504, 1_016_728]
    # The ranks differ by the uneven rows alone: one head gradient row (256 bytes), one row of each
    # of the two moments of the embedding and the head (1,024), and at the step's peak one row of
    # each of AdamW's foreach temporaries of those two (512), on rank 0.
    first, last = (plan.step.model_states_at_optimizer_step_bytes for plan in plans)
    assert {part: first[part] - last[part] for part in first} == {
        "parameters": 0, "gradients": 256, "optimizer_state": 2 * 2 * 256, "master_weights": 0}
    assert plans[0].step.peak_bytes - plans[1].step.peak_bytes == 256 + 1_024 + 512
    # The custom loop's logger on each process: the fullest process's optimizer state (its figures are the
    # largest over processes, `reduce_across_processes`) and the job's total, each plan's summed.
    measured, total, _ = _logged_keys()
    for real in tp_runs["tp-uneven"]:
        assert real["logged"][measured] == first["optimizer_state"] == 462_420
        assert real["logged"][total] == first["optimizer_state"] + last["optimizer_state"] == 923_816
    at_step = [real["parts"] for real in tp_runs["tp-uneven"] if real["parts"]["_MemRefType.GRAD"]]
    if len(at_step) == 2:  # both trackers' peaks at the optimizer step: the same difference
        assert at_step[0]["_MemRefType.OPT"] - at_step[1]["_MemRefType.OPT"] == 1_024 + 512


# transformers' own path, `from_pretrained(tp_plan="auto")` of the same model saved (engine `tp-auto`):
# on this CPU each process keeps the same shards (230,656 bytes of them, the plan's), but the shards
# of dim 0 (colwise layers, the embedding, the head) stay views of the whole tensors read from the
# checkpoint, so the storages behind the parameters are 410,880 bytes; a GPU run copies each shard to
# the device, which this CPU run cannot show. Its peak is the plan, those 180,224 bytes, and 16 bytes
# (8 in the parallelize_module run: its device mesh's rank tensor; not traced further here).
WHOLE_STORAGES_BEYOND_SHARDS = 410_880 - 230_656


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("rank", range(PROCESSES))
def test_tp_plan_auto_holds_the_plan_s_shards_on_whole_storages_on_the_cpu(tp_runs, rank):
    settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    real = tp_runs["tp-auto"][rank]
    assert real["params"] == {"local_bytes": plan.step.model_states_at_optimizer_step_bytes["parameters"],
                              "storage_bytes": 230_656 + WHOLE_STORAGES_BEYOND_SHARDS}
    assert peak_beyond_plan(real, plan, WHOLE_STORAGES_BEYOND_SHARDS + 16) == 0, (plan.step.peak_bytes, real)
    # Its gradients and optimizer state are the parallelize_module run's, to the byte.
    for part in ("_MemRefType.GRAD", "_MemRefType.OPT"):
        assert real["parts"][part] == tp_runs["tp"][rank]["parts"][part]
    assert real["parts"]["_MemRefType.GRAD"] == 263_424


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("rank", range(PROCESSES))
def test_the_user_s_rules_over_the_model_s_plan_as_transformers_merges_them(tp_runs, rank):
    """`from_pretrained(tp_plan={...})` with the attention's four projections "replicate": transformers
    5 keeps the model's other rules (`DistributedConfig(tp_plan=dict)`), as the plan's `tp_plan` does."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist_scripts"))
    from engine_step_profile import ATTENTION_WHOLE

    settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch",
                                tp_plan=ATTENTION_WHOLE)
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    real = tp_runs["tp-attention-whole"][rank]
    states = plan.step.model_states_at_optimizer_step_bytes
    # The four projections of each of 2 layers whole: 2 x 4 x 2,048 values more than the model's plan.
    assert states["parameters"] == 230_656 + 2 * 4 * 2_048 * 4 == 296_192 == real["params"]["local_bytes"]
    # The colwise shards of dim 0 are views of the checkpoint's tensors, as under tp-auto (above): the
    # attention's three colwise layers are whole now, 2 x 3 x 8,192 bytes of those views fewer.
    beyond = WHOLE_STORAGES_BEYOND_SHARDS - 2 * 3 * 8_192
    assert real["params"]["storage_bytes"] == 296_192 + beyond
    assert peak_beyond_plan(real, plan, beyond + 16) == 0, (plan.step.peak_bytes, real)
    assert states["gradients"] == 263_424 + 2 * 4 * 2_048 * 4 == 328_960
    assert real["parts"]["_MemRefType.GRAD"] == 328_960


# transformers' own path with an MLP width of 129 (engine `tp-auto-uneven-mlp`): torch's chunk rule,
# which transformers' placeholders (`distribute_tensor`) and loading (`compute_local_shape_and_global_offset`)
# follow, gives rank 0 65 rows of gate_proj and up_proj and 65 columns of down_proj, rank 1 64 of
# each. On this CPU the dim-0 shards are views of the checkpoint's whole tensors, as under tp-auto:
# 180,224 bytes beyond the shards on rank 0, and on rank 1 1,024 more (its 64 rows of gate_proj and
# up_proj in 129-row storages: 2 layers x 2 x 65 x 64 x 4 bytes beyond, against 64 x 64 at 128).
UNEVEN_MLP_BEYOND_SHARDS = (WHOLE_STORAGES_BEYOND_SHARDS, WHOLE_STORAGES_BEYOND_SHARDS + 1_024)


def build_uneven_mlp():
    config = LlamaConfig(**dict(CONFIG, intermediate_size=129))
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_uneven_mlp_width_each_rank_s_plan_equals_the_tp_plan_auto_run(tp_runs):
    plans = []
    for rank, real in enumerate(tp_runs["tp-auto-uneven-mlp"]):
        settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(build_uneven_mlp, seq_len=16, settings=settings, device_type="cpu",
                                   model_states=False)
        assert plan.step.problem is None and plan.settings.engine == "tp", plan.step.problem
        plans.append(plan)
        states, beyond = plan.step.model_states_at_optimizer_step_bytes, UNEVEN_MLP_BEYOND_SHARDS[rank]
        # The shards, to the byte: the plan's parameters are the run's local tensors, each of its own size.
        assert real["params"] == {"local_bytes": states["parameters"], "storage_bytes": states["parameters"] + beyond}
        assert real["parts"]["_MemRefType.PARAM"] == states["parameters"] + beyond
        assert real["parts"]["_MemRefType.GRAD"] == states["gradients"]
        # The peak and the backward's: the plan, the views' bytes and 16 (as under tp-auto).
        assert peak_beyond_plan(real, plan, beyond + 16) == 0, (rank, plan.step.peak_bytes, real)
        assert real["phase_peaks"]["backward"] - beyond - 16 == plan.step.forward_backward_peak_bytes, real
    real = tp_runs["tp-auto-uneven-mlp"]
    # 1,224,872 and 1,219,496 bytes read; 232,192 and 230,656 parameter bytes, 264,960 and 263,424 of gradients.
    assert [(plan.step.peak_bytes, plan.step.forward_backward_peak_bytes) for plan in plans] == [
        (1_044_632, 1_021_216), (1_038_232, 1_015_584)]
    first, last = (plan.step.model_states_at_optimizer_step_bytes for plan in plans)
    assert [(each["parameters"], each["gradients"], each["optimizer_state"]) for each in (first, last)] == [
        (232_192, 264_960, 464_468), (230_656, 263_424, 461_396)]
    # Rank 1 holds the even width's shards: its optimizer reading is tp-auto's; rank 0's is the plan's
    # 3,072 bytes of the two moments' extra rows and 256 of the optimizer step's temporaries above it.
    assert real[1]["parts"]["_MemRefType.OPT"] == tp_runs["tp-auto"][1]["parts"]["_MemRefType.OPT"]
    assert real[0]["parts"]["_MemRefType.OPT"] - real[1]["parts"]["_MemRefType.OPT"] == 3_072 + 256
    assert plans[0].step.peak_bytes - plans[1].step.peak_bytes == 1_536 + 1_536 + 3_072 + 256
    # The custom loop's logger: the fullest process's optimizer state (rank 0's plan) and the job's, both plans'.
    measured, total, _ = _logged_keys()
    for each in real:
        assert each["logged"][measured] == first["optimizer_state"]
        assert each["logged"][total] == first["optimizer_state"] + last["optimizer_state"] == 925_864


# -- TP=2 x FSDP2=2 on 4 processes ----------------------------------------------------------------

# The most one process of the tiny Llama's step holds under TP=2 x FSDP2=2, by the plan (every rank).
TP2_FSDP2_PEAK = 859_424
# What a process read above the plan in the launches here (eight), held by timing: 0 (the plan, to the
# byte) on every process in two launches and on most processes in the others; else a reduce-scatter's
# input and output (82,432 + 41,216 bytes, FSDPMemTracker's REDUCE_SCATTER and SHARDED_GRAD) that
# gloo's worker thread let go after the moment of the plan's peak had passed (on processes 0 and 2,
# the TP rank 0 ones, so far), or 256 bytes, one norm's unsharded gradient, the same way (any process).
HELD_LATE = (0, 256, 66_304)


@pytest.fixture(scope="module")
def tp_fsdp2_runs(tmp_path_factory):
    return _tracked("engine_step_profile.py", tmp_path_factory,
                    ["tp-fsdp2", "tp-fsdp2-uneven", "tp-fsdp2-uneven-mlp", "tp-fsdp2-offload"], 4)


@pytest.fixture(scope="module")
def tp_fsdp2_tracked(tp_fsdp2_runs):
    return tp_fsdp2_runs["tp-fsdp2"]


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_tp2_fsdp2_peak_per_process_equals_fsdp_memtrackers_on_the_real_run(tp_fsdp2_tracked):
    for rank, real in enumerate(tp_fsdp2_tracked):
        settings = resolve_settings(parallelism="tp=2,dp_shard=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
        assert plan.settings.engine == "tp-fsdp2"
        assert plan.step.peak_bytes == TP2_FSDP2_PEAK
        assert real["peak_bytes"] - plan.step.peak_bytes in HELD_LATE, (rank, plan.step.peak_bytes, real)
        # The tracker's own peaks of the root module's forward and backward (the step's peak is the
        # backward's here): the plan's forward and its forward-and-backward peak, the gathered logits
        # held as the real process holds them (tests/plan/test_tensor_parallel.py). The mesh's ranks
        # were made before the tracker, with the model.
        assert (forward_peak_of(plan), plan.step.forward_backward_peak_bytes) == (801_432, TP2_FSDP2_PEAK)
        assert real["phase_peaks"]["forward"] == forward_peak_of(plan), (rank, real["phase_peaks"])
        assert real["phase_peaks"]["backward"] - plan.step.forward_backward_peak_bytes in HELD_LATE, (rank, real)
        # The shards FSDP2 keeps of each TP shard and the optimizer state like them, to the byte: a
        # quarter of one process's parameters but the norms' halves (115,328 bytes), two moments of
        # them and 21 step counts.
        states = plan.step.model_states_at_optimizer_step_bytes
        assert real["parts"]["_FSDPRefType.SHARDED_PARAM"] == states["parameters"] == 115_328
        assert real["parts"]["_FSDPRefType.OPT"] == states["optimizer_state"] == 2 * 115_328 + 21 * 4


# Each rank of TP=2 x FSDP2=2 on 257 tokens, by the plan (rank = dp_shard position x 2 + TP rank): TP's
# 129 / 128 rows of the embedding and the head, FSDP2's 65 / 64 of the 129 and 64 / 64 of the 128
# (`tp_rank_groups`). Rank 0's optimizer state holds one row more of each of the two tables than rank 2's
# (2 x 64 values x 2 moments x 4 bytes = 1,024); their parameters are equal, FSDP2's shards padded to
# 65 rows.
UNEVEN_TP2_FSDP2 = {0: (862_240, 115_840, 231_764), 1: (859_424, 115_328, 230_740),
                    2: (861_216, 115_840, 230_740), 3: (859_424, 115_328, 230_740)}


# Each rank of TP=2 x FSDP2=2 with an MLP width of 129, by the plan: TP's 65 / 64 rows of gate_proj and
# up_proj (and columns of down_proj), FSDP2's 33 / 32 of the 65 and 32 / 32 of the 64
# (tests/plan/test_tensor_parallel.py counts the bytes).
UNEVEN_MLP_TP2_FSDP2 = {0: (867_232, 116_608, 233_300), 1: (859_424, 115_328, 230_740),
                        2: (865_184, 116_608, 231_252), 3: (859_424, 115_328, 230_740)}


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
@pytest.mark.parametrize("row,build_model,figures", [("tp-fsdp2-uneven", build_uneven, UNEVEN_TP2_FSDP2),
                                                     ("tp-fsdp2-uneven-mlp", build_uneven_mlp, UNEVEN_MLP_TP2_FSDP2)])
def test_uneven_tp2_fsdp2_each_rank_s_plan_equals_fsdp_memtrackers_on_the_real_run(tp_fsdp2_runs, row, build_model,
                                                                                  figures):
    for rank, real in enumerate(tp_fsdp2_runs[row]):
        settings = resolve_settings(parallelism="tp=2,dp_shard=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(build_model, seq_len=16, settings=settings, device_type="cpu", model_states=False)
        assert plan.step.problem is None and plan.settings.engine == "tp-fsdp2", plan.step.problem
        states = plan.step.model_states_at_optimizer_step_bytes
        assert (plan.step.peak_bytes, states["parameters"], states["optimizer_state"]) == figures[rank]
        assert real["peak_bytes"] - plan.step.peak_bytes in HELD_LATE, (rank, plan.step.peak_bytes, real)
        assert real["phase_peaks"]["forward"] == forward_peak_of(plan), (rank, real["phase_peaks"])
        assert real["parts"]["_FSDPRefType.SHARDED_PARAM"] == states["parameters"]
        assert real["parts"]["_FSDPRefType.OPT"] == states["optimizer_state"]


# TP=2 x FSDP2=3 on 6 processes: FSDP2 splits 64 rows as 22, 22 and 20, so the third dp_shard position
# (ranks 4 and 5) holds less optimizer state (tests/plan/test_tensor_parallel.py counts it).
UNEVEN_POSITIONS = {0: (755_440, 157_636), 4: (744_096, 146_292)}


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_tp2_fsdp2_on_three_positions_each_rank_s_plan_equals_fsdp_memtrackers_on_the_real_run(tmp_path_factory):
    real = _tracked("engine_step_profile.py", tmp_path_factory, ["tp-fsdp2"], 6)["tp-fsdp2"]
    for rank, each in enumerate(real):
        settings = resolve_settings(parallelism="tp=2,dp_shard=3", rank=rank, batch_size=2, optimizer="adamw_torch")
        planned = 0 if rank < 4 else 4
        if rank in UNEVEN_POSITIONS:
            plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
            states = plan.step.model_states_at_optimizer_step_bytes
            assert (plan.step.peak_bytes, states["optimizer_state"]) == UNEVEN_POSITIONS[rank]
            assert each["phase_peaks"]["forward"] == forward_peak_of(plan), (rank, each["phase_peaks"])
        peak, optimizer_state = UNEVEN_POSITIONS[planned]
        assert each["peak_bytes"] - peak in HELD_LATE, (rank, peak, each)
        assert each["parts"]["_FSDPRefType.OPT"] == optimizer_state, (rank, each["parts"])
        assert each["parts"]["_FSDPRefType.SHARDED_PARAM"] == 78_776

@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_tp2_fsdp2_with_cpu_offload_on_the_cpu_is_the_plan_with_its_host_parts(tp_fsdp2_runs):
    # `CPUOffloadPolicy(pin_memory=False)` on a CPU mesh moves nothing (the host is the device: see
    # tests/training/test_engine_runs_wide.py), so the real run reads TP x FSDP2's figure; the plan
    # files the shards and AdamW's state on the host, and with them is that figure, to the byte.
    settings = resolve_settings(parallelism="tp=2,dp_shard=2", fsdp_cpu_offload=True, rank=0, batch_size=2,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    host = dict(plan.step.host_bytes)
    assert host == {"parameters": 115_328, "optimizer_state": 230_740}
    for real in tp_fsdp2_runs["tp-fsdp2-offload"]:
        assert real["peak_bytes"] - (plan.step.peak_bytes + sum(host.values())) in HELD_LATE, (plan.step.peak_bytes, real)
        assert real["parts"]["_FSDPRefType.SHARDED_PARAM"] == host["parameters"]
        assert real["parts"]["_FSDPRefType.OPT"] == host["optimizer_state"]


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_tp2_beside_hsdp_on_eight_processes_each_rank_s_plan_equals_fsdp_memtrackers(tmp_path_factory):
    # accelerate's (dp_replicate=2, dp_shard=2, tp=2) mesh, fully_shard on (dp_replicate, dp_shard):
    # each replica's ranks hold what TP=2 x FSDP2=2's hold, and each of the eight real processes reads it.
    real = _tracked("engine_step_profile.py", tmp_path_factory, ["tp-hsdp"], 8)["tp-hsdp"]
    settings = resolve_settings(parallelism="tp=2,dp_shard=2,dp_replicate=2", batch_size=2, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.peak_bytes == TP2_FSDP2_PEAK
    states = plan.step.model_states_at_optimizer_step_bytes
    for rank, each in enumerate(real):
        assert each["peak_bytes"] - plan.step.peak_bytes in HELD_LATE, (rank, each)
        assert each["phase_peaks"]["forward"] == forward_peak_of(plan), (rank, each["phase_peaks"])
        assert each["parts"]["_FSDPRefType.SHARDED_PARAM"] == states["parameters"] == 115_328
        assert each["parts"]["_FSDPRefType.OPT"] == states["optimizer_state"]

# -- What the logger logs under TP ------------------------------------------------------------------


def _logged_keys():
    from trainer_memcb.training.figures import MEASURED_BYTES, MEASURED_TOTAL_BYTES, MODEL_PARAMS_BYTES

    return MEASURED_BYTES, MEASURED_TOTAL_BYTES, MODEL_PARAMS_BYTES


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_the_loggers_figures_under_tp_are_each_process_s_shards_and_the_plan_s(tp_tracked):
    # `OptimizerMemoryLogger(optimizer, model=model)`, the callback's measuring in a custom loop, after
    # the real step: each process reads its DTensor shards' local bytes (metadata only), the job's
    # total is their sum, as under FSDP2.
    measured, total, params = _logged_keys()
    own = []
    for rank, real in enumerate(tp_tracked):
        settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=2, optimizer="adamw_torch")
        plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
        states = plan.step.model_states_at_optimizer_step_bytes
        logged = real["logged"]
        assert logged[params] == states["parameters"] == 230_656
        # Two moments of the shards (the norms whole on each process) and 21 step counts.
        assert logged[measured] == states["optimizer_state"] == 2 * 230_656 + 21 * 4
        own.append(logged[measured])
    assert {real["logged"][total] for real in tp_tracked} == {sum(own)}


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
def test_the_loggers_figures_under_tp_x_fsdp2_are_each_process_s_shards(tp_fsdp2_tracked):
    measured, total, params = _logged_keys()
    for real in tp_fsdp2_tracked:
        assert real["logged"][params] == 115_328
        assert real["logged"][measured] == 2 * 115_328 + 21 * 4
        assert real["logged"][total] == 4 * (2 * 115_328 + 21 * 4)


# A tiny BERT, which transformers gives no tp_plan, loaded as a user runs it with the plan supplied
# here (engine `tp-bert`: `from_pretrained(distributed_config=DistributedConfig(tp_plan=PLAN,
# tp_size=2))`, transformers' own styles), 16 rows of 64 tokens: the backward holds the peak. As
# under tp-auto, the colwise shards of dim 0 stay views of the checkpoint's whole tensors on this
# CPU: in each of 2 blocks the other halves of query, key and value (3 x (8,192 + 128) bytes) and of
# the MLP's first layer (16,384 + 256).
BERT_WHOLE_STORAGES_BEYOND_SHARDS = 2 * (3 * (8_192 + 128) + 16_384 + 256)


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
@pytest.mark.parametrize("rank", range(PROCESSES))
def test_a_bert_loaded_with_the_supplied_plan_holds_the_plan_s_shards_and_peak(tp_runs, rank):
    from plan.test_supplied_tp_plans import build_bert

    settings = resolve_settings(parallelism="tp=2", rank=rank, batch_size=16, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build_bert, seq_len=64, settings=settings, device_type="cpu", model_states=False)
    real = tp_runs["tp-bert"][rank]
    parameters = plan.step.model_states_at_optimizer_step_bytes["parameters"]
    assert real["params"] == {"local_bytes": parameters, "storage_bytes": parameters + BERT_WHOLE_STORAGES_BEYOND_SHARDS}
    assert BERT_WHOLE_STORAGES_BEYOND_SHARDS == 83_200
    # The backward holds the peak, in the plan and in the run.
    assert plan.step.peak_bytes == plan.step.forward_backward_peak_bytes
    assert real["phase_peaks"]["backward"] == real["peak_bytes"]
    # The peak: the plan, the whole storages and 12 bytes, as under tp-auto's 16 (the mesh's rank
    # tensor among them; not traced further).
    assert peak_beyond_plan(real, plan, BERT_WHOLE_STORAGES_BEYOND_SHARDS + 12) == 0, (plan.step.peak_bytes, real)
