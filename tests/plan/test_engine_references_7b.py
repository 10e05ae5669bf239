"""The engine plans for Llama-2-7B at scale, under fake tensors, against the engines' own figures.

- FSDP2 full shard, bf16, AdamW, batch 1 x 512, at 4, 8 and 64 processes: the plan's peak and
  its parts against torch's `FSDPMemTracker` on the same fake step (`fsdp_reference.py`).
- DeepSpeed ZeRO-2 and ZeRO-3 (with and without `offload_optimizer` / `offload_param`) at 8 and
  64 processes: the installed DeepSpeed's own estimators beside the engine-traced plan's model
  states, term by term (`zero_reference.py`), and the guide's table from the same rows.

Each row traces Llama-2-7B's real step, all slow. Measured on the shared 2-core machine (load 3 to
10): FSDP2 95 s, 111 s and 232 s at 4, 8 and 64 processes (the plan, then the tracker's two
steps); the ten ZeRO rows and the guide's table 192 s together (10 to 35 s a row; the table reuses
the rows' traces).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402
from trainer_memcb.plan.optimizers.whatif import build_meta_model  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")
BATCH, SEQ = 1, 512
PSI = 6_738_415_616  # Llama-2-7B's parameters
LARGEST = 32_000 * 4_096  # its largest layer: the embedding (and the head)


def build():
    return build_meta_model(LLAMA, dtype=torch.bfloat16)


# Per world: FSDPMemTracker's figures at its peak (bytes), as measured on torch 2.13. The plan's
# parts, summed as the tracker files them, are these to the byte but for the two sums below.
FSDP_TRACKER = {
    4: dict(SHARDED_PARAM=3_369_207_808, SHARDED_GRAD=3_035_750_400, OPT=6_738_416_780, ACT=104_140_808,
            Total=15_699_180_948),
    8: dict(SHARDED_PARAM=1_684_603_904, SHARDED_GRAD=50_595_840, OPT=3_369_208_972, ACT=2_873_352_200,
            Total=10_429_426_068),
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8, 64])
def test_fsdp2_plan_of_llama_2_7b_equals_fsdp_memtracker(world):
    from fsdp_reference import fsdp_memtracker_peak

    settings = resolve_settings(world_size=world, sharding="fsdp-full-shard", precision="bf16", batch_size=BATCH,
                                optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.problem is None and plan.settings.engine == "fsdp2"
    tracker = {key.replace("_FSDPRefType.", ""): value
               for key, value in fsdp_memtracker_peak(build, settings, BATCH, SEQ, torch.bfloat16).items()}
    parts = plan.step.peak_parts
    # The plan's peak is the tracker's and the 0-dim fp32 `num_items_in_batch` the plan passes as
    # the Trainer does (4 bytes): the tracker's step makes it too, outside what it tracks.
    assert plan.step.peak_bytes == tracker["Total"] + 4
    # The same storages under the same names: the shards, the gathered root and layer, AdamW's state,
    # the sharded gradients, and FSDP2's all-gather and reduce-scatter buffers of the layer in flight
    # (404,766,720 each: one decoder layer's 202,383,360 bf16 values).
    assert parts["parameters"] == tracker["SHARDED_PARAM"]
    assert parts["unsharded_parameters"] == tracker["UNSHARDED_PARAM"] == 929_062_912
    assert parts["gradients"] == tracker["SHARDED_GRAD"]
    assert parts["optimizer_state"] == tracker["OPT"]
    assert parts["engine_buffers"] == tracker["ALL_GATHER"] + tracker["REDUCE_SCATTER"] == 2 * 404_766_720
    # What is left is filed apart, measured (the same on the tiny Llama in fp32 and bf16): a 1 x 512
    # int64 batch tensor (4,096 bytes: the input ids, which the embedding saves for its backward) the
    # plan files among the activations and the tracker among the inputs it was told of; and 8 bytes
    # the plan files among its temporaries and the tracker among the activations. The tracker files
    # the unsharded gradients at its peak (the reduce-scatter's inputs) among its temporaries.
    assert parts["activations"] + parts["batch_and_buffers"] == tracker["ACT"] + tracker["INP"] + tracker["BUFFER"] - 8
    assert parts["activations"] == tracker["ACT"] + 4_096 - 8
    assert parts["unsharded_gradients"] + parts["other"] == tracker["UNSHARDED_GRAD"] + tracker["TEMP"] + 4 + 8
    if world in FSDP_TRACKER:  # the figures the guide and engine_references.py print
        assert {key: tracker[key] for key in FSDP_TRACKER[world]} == FSDP_TRACKER[world]


# -- DeepSpeed ZeRO: the installed estimators beside the engine-traced plan --------------------------
P8, P64 = PSI // 8, PSI // 64  # Ψ/N: Llama-2-7B's parameters are a multiple of 2 x 64
NO_DECAY = 65 * 4_096  # the Trainer's no-decay group: the 65 RMSNorm weights
LM_HEAD_GRAD = 2 * LARGEST  # the head's bf16 gradient, whole
BUCKET = 2 * 4_096**2  # reduce_bucket_size "auto" = hidden_size², bf16
# ZeRO-3's 16-bit parameters gathered at the parameters' most (in backward), measured: what the
# prefetch gathers up to stage3_max_live_parameters (10⁹ values by default: the bucket is filled
# until at least the room left, so a module's fetch may pass it) and the modules kept whole from
# their forward to their backward within stage3_max_reuse_distance; 1,097,859,072 values (with the
# limit at 5 x 10⁸, 586,153,984: the limit binds).
GATHERED = 2 * 1_097_859_072
# What the traced step holds beyond the rules' terms, per setting, measured: the 16-bit parameters
# gathered at the parameters' most and the 16-bit gradients in flight at the gradients' most.
IN_FLIGHT = {  # the same at 8 and 64 processes
    "ZeRO-2": dict(params16_gathered=0, grads16_whole=0),  # the gradients' most: at the step's
    # the bucket, the head's gradient kept whole (more values than the bucket) and the final norm's
    # gradient (4,096 values) arriving, which releases it
    "ZeRO-2, offload optimizer": dict(params16_gathered=0, grads16_whole=BUCKET + LM_HEAD_GRAD + 2 * 4_096),
    "ZeRO-3": dict(params16_gathered=GATHERED, grads16_whole=0),
    "ZeRO-3, offload optimizer": dict(params16_gathered=GATHERED, grads16_whole=LM_HEAD_GRAD),
    "ZeRO-3, offload optimizer and params": dict(params16_gathered=GATHERED, grads16_whole=LM_HEAD_GRAD),
}


def _rows():
    from zero_reference import ZERO_ROWS

    return [(world, *setting) for world in (8, 64) for setting in ZERO_ROWS]


_TRACED = {}


def zero_row(world, label, stage, offload_optimizer, offload_param):
    from zero_reference import plan_row

    key = (world, label)
    if key not in _TRACED:
        _TRACED[key] = plan_row(build, label, stage, offload_optimizer, offload_param, world)
    return _TRACED[key]


@pytest.mark.slow
@pytest.mark.parametrize("world,label,stage,offload_optimizer,offload_param", _rows())
def test_zero_plan_of_llama_2_7b_beside_deepspeeds_estimators_term_by_term(world, label, stage, offload_optimizer,
                                                                          offload_param):
    pytest.importorskip("deepspeed")
    from zero_reference import plan_figures

    row = zero_row(world, label, stage, offload_optimizer, offload_param)
    assert (row["psi"], row["largest"]) == (PSI, LARGEST)
    assert [sum(group) for group in row["groups"]] == [PSI - NO_DECAY, NO_DECAY]
    ds, ours = row["deepspeed"], plan_figures(row)
    n, per_node = world, min(world, 8)
    share = PSI // n
    # DeepSpeed's figures are the installed functions' and their terms sum to them, to the byte.
    assert sum(ds.gpu_terms.values()) == ds.gpu_bytes and sum(ds.cpu_terms.values()) == ds.cpu_bytes_per_node
    assert "rounding" not in ds.gpu_terms and "rounding" not in ds.cpu_terms  # Ψ/N exact here
    # The plan's terms sum to its figures, to the byte.
    plan = row["plan"]
    assert sum(ours.device_terms.values()) == ours.device_bytes == sum(plan.step.model_states_most_bytes.values())
    assert sum(ours.host_terms.values()) * per_node == ours.host_bytes_per_node
    terms = ours.device_terms
    assert {key: terms.get(key, 0) for key in IN_FLIGHT[label]} == IN_FLIGHT[label]
    # Term by term. The optimizer's states: the same partitions (each group padded to 2N values,
    # no padding here), and torch AdamW's 4-byte step per flat partition, which DeepSpeed leaves out.
    states = ours.host_terms if offload_optimizer else terms
    assert states["master32"] == 4 * share and states["moments32"] == 8 * share and states["adam_steps"] == 4 * 2
    # The fp32 gradient partition: one param group's at a time inside the step (offload keeps the
    # whole partition on the host between steps, ZeRO-3 each sub-group's); DeepSpeed counts it whole.
    one_group = 4 * (PSI - NO_DECAY) // n
    assert states["grads32_partition"] == (4 * share if offload_optimizer else one_group)
    if not offload_optimizer:
        assert ds.gpu_terms["grads32_partition"] - terms["grads32_partition"] == 4 * NO_DECAY // n
    if stage == 2:
        assert terms["params16_whole"] == ds.gpu_terms["params16_whole"] == 2 * PSI
        if offload_optimizer:
            # DeepSpeed's GPU figure is the 16-bit parameters alone; the plan keeps the device's
            # staging buffer (the largest parameter) and the gradients in flight; on the host the
            # partition's 16-bit copy and the host staging buffer beside the fp32 states.
            assert terms["offload_copies"] == LM_HEAD_GRAD
            assert ours.host_terms["offload_copies"] == 2 * share + LM_HEAD_GRAD
            # DeepSpeed's CPU figure is for loading: an fp32 copy per GPU of the job, x 1.5.
            assert ds.cpu_terms == {"loading": 4 * PSI * n, "buffer_factor": 2 * PSI * n}
        else:
            # The 16-bit gradient partition: the plan holds the gradients of every parameter the
            # partition touches, whole.
            from trainer_memcb.state.rules.deepspeed_zero import zero12_gradient_numel

            assert terms["grads16_partition"] == 2 * zero12_gradient_numel(row["groups"], n, 0)
            assert ds.gpu_terms["grads16_partition"] == 2 * share
            assert ds.cpu_terms == {"loading": 4 * PSI * per_node, "buffer_factor": 2 * PSI * per_node}
    else:
        # ZeRO-3: the 16-bit partitions and the persistent norms whole; the 16-bit gradient partition
        # and the bucket, which DeepSpeed's 18Ψ/N leaves out; DeepSpeed's 4 x the largest layer
        # against what the step holds gathered and in flight.
        # With offload_optimizer the 16-bit gradient partition is on the host (DeepSpeed makes it on
        # `self.device`, the CPU), with offload_param every 16-bit parameter partition too.
        assert (ours.host_terms if offload_param else terms)["params16_partition"] == 2 * share
        assert (ours.host_terms if offload_optimizer else terms)["grads16_partition"] == 2 * share
        assert terms["params16_persistent"] == 2 * NO_DECAY and terms["reduce_bucket"] == BUCKET
        assert ds.gpu_terms["params16_gathered"] == ds.gpu_terms["grads16_whole"] == 2 * LARGEST
        assert "grads16_partition" not in ds.gpu_terms
        if offload_optimizer:
            # On the host the fp32 states, each sub-group's fp32 gradient kept there between steps
            # (held above by the host terms summing to the host figure), and the partitions above.
            assert plan.step.model_states_host_bytes["parameters"] == (2 * share if offload_param else 0)
        else:
            assert ds.cpu_terms == {"loading": 4 * LARGEST * per_node, "buffer_factor": 2 * LARGEST * per_node}


@pytest.mark.slow
def test_the_guides_deepspeed_table_is_these_rows():
    # Run after the rows above, whose traces it reuses (each row is traced once per session).
    pytest.importorskip("deepspeed")
    from zero_reference import legend_lines, summary_lines, term_lines

    rows = [zero_row(*row) for row in _rows()]
    with open(os.path.join(REPO_ROOT, "docs", "will-it-fit.md"), encoding="utf-8") as handle:
        page = handle.read().splitlines()
    for line in summary_lines(rows) + term_lines([row for row in rows if row["world"] == 8]) + legend_lines():
        assert line in page, line
