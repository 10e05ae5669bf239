"""The engine plans for Llama-2-7B at scale, under fake tensors, against the engines' own figures.

- FSDP2 full shard, bf16, AdamW, batch 1 x 512, at 4, 8 and 64 processes: the plan's peak and
  its parts against torch's `FSDPMemTracker` on the same fake step (`fsdp_reference.py`).
- DeepSpeed ZeRO-2 and ZeRO-3 (with and without `offload_optimizer` / `offload_param`) at 8 and
  64 processes: the installed DeepSpeed's own estimators beside the engine-traced plan's model
  states, term by term (`zero_reference.py`), and the guide's table from the same rows.

Each row traces Llama-2-7B's real step (one to two minutes a row on a loaded 2-core machine): all
slow.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.step_memory import plan_step_memory  # noqa: E402
from trainer_memcb.plan.whatif import build_meta_model  # noqa: E402

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
    assert plan.problem is None and plan.engine == "fsdp2"
    tracker = {key.replace("_FSDPRefType.", ""): value
               for key, value in fsdp_memtracker_peak(build, settings, BATCH, SEQ, torch.bfloat16).items()}
    parts = plan.peak_parts
    # The plan's peak is the tracker's and the 0-dim fp32 `num_items_in_batch` the plan passes as
    # the Trainer does (4 bytes): the tracker's step makes it too, outside what it tracks.
    assert plan.peak_bytes == tracker["Total"] + 4
    # The same storages under the same names: the shards, the gathered root and layer, AdamW's state,
    # the sharded gradients, and FSDP2's all-gather and reduce-scatter buffers of the layer in flight
    # (404,766,720 each: one decoder layer's 202,383,360 bf16 values).
    assert parts["parameters"] == tracker["SHARDED_PARAM"]
    assert parts["unsharded_parameters"] == tracker["UNSHARDED_PARAM"] == 929_062_912
    assert parts["gradients"] == tracker["SHARDED_GRAD"]
    assert parts["optimizer_state"] == tracker["OPT"]
    assert parts["engine_buffers"] == tracker["ALL_GATHER"] + tracker["REDUCE_SCATTER"] == 2 * 404_766_720
    # What is left is filed apart differently, measured: the batch's attention mask (1 x 512 int64,
    # 4,096 bytes), which the plan files among the activations once a kernel saves it and the tracker
    # among the inputs it was told of; and 8 bytes of 0-dim fp32 scalars the plan files among the
    # temporaries and the tracker among the activations. The tracker's unsharded gradients at its
    # peak are the plan's (reduce-scatter inputs) filed as its temporaries.
    assert parts["activations"] + parts["batch_and_buffers"] == tracker["ACT"] + tracker["INP"] + tracker["BUFFER"] - 8
    assert parts["activations"] == tracker["ACT"] + 4_096 - 8
    assert parts["unsharded_gradients"] + parts["other"] == tracker["UNSHARDED_GRAD"] + tracker["TEMP"] + 4 + 8
    if world in FSDP_TRACKER:  # the figures the guide and engine_references.py print
        assert {key: tracker[key] for key in FSDP_TRACKER[world]} == FSDP_TRACKER[world]
