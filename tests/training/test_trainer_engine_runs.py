"""The step plan against real runs driven by the Hugging Face Trainer itself: torchrun on 2 CPU
processes (gloo), the Trainer's own DDP and DeepSpeed ZeRO-2/3 (tests/dist_scripts/trainer_engine_step.py),
the tiny Llama of tests/plan/test_engines.py and a tiny BERT classifier, fp32, per process.

One launch runs every row (about 75 s here). The plan reads the run's own `TrainingArguments` (as
JSON, `to_json_string()`) and DeepSpeed config, as a user hands them over; the real figure is the
most bytes alive during the Trainer's third optimizer step as torch's MemTracker counts it, from
before the model was made (see the script). tests/training/test_engine_runs.py holds the same plans
to the engines' bare loops; what the Trainer's loop holds beyond them is below, byte by byte."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan"))
from test_engines import build  # noqa: E402
from test_engine_runs import _launch  # noqa: E402

from trainer_memcb.plan.settings import resolve_settings  # noqa: E402
from trainer_memcb.plan.answers.step_memory import plan_step_memory  # noqa: E402

# The real runs (one torchrun launch) are slow; the plan's unit test at the end is not.
slow = pytest.mark.slow

BATCH, SEQ = 2, 16
BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
            max_position_embeddings=64, num_labels=2)
ROWS = ("ddp", "ddp-view", "bert-ddp", "fsdp2", "zero2", "zero3", "bert-zero2")


def build_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**BERT)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return BertForSequenceClassification(config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import test_distributed

    out_dir = str(tmp_path_factory.mktemp("trainer-runs"))
    _launch("trainer_engine_step.py", out_dir, list(ROWS))
    return {row: [json.load(open(os.path.join(out_dir, row, f"rank{rank}.json")))
                  for rank in range(test_distributed.PROCESSES)] for row in ROWS}


def plan_of(run, **flags):
    """The plan from the run's own TrainingArguments (JSON) and DeepSpeed config."""
    settings = resolve_settings(run["training_args"], deepspeed=run["deepspeed_config"], hidden_size=64,
                                world_size=run["world_size"], **flags)
    assert settings.sources["batch_size"] == "training args" and settings.sources["optimizer"] == "training args"
    model = build_bert if run["row"].startswith("bert") else build
    plan, _ = plan_step_memory(model, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.problem is None, plan.step.problem
    return plan


# What the Trainer's loop holds that the engines' bare loops (and the plan) do not, found storage by
# storage (the storages alive at the two peaks, the Trainer's and the bare loop's, compared by size
# and by the frame that first handed each to the tracker) and the same in five launches (under loads of 2 to 13),
# on both processes unless said:
# - The dataloader's next batch: accelerate's `DataLoaderShard.__iter__` fetches one batch ahead
#   (to know the last), so during every step but an epoch's last the next micro-batch is alive
#   beside the current one. The Trainer's default collator (`default_data_collator`) makes int64
#   tensors: the Llama's input_ids, attention_mask and labels (3 x 2 x 16 x 8 = 768 bytes), BERT's
#   input_ids and attention_mask and its 2 labels (2 x 256 + 16 = 528). No pinned copies: the
#   dataloader pins only where an accelerator exists (torch `_BaseDataLoaderIter`), none on the CPU.
NEXT_BATCH = {"llama": 3 * BATCH * SEQ * 8, "bert": 2 * BATCH * SEQ * 8 + BATCH * 8}
# - The Trainer's own copy of the batch: `Trainer._prepare_input` moves each tensor to `args.device`,
#   which is `cpu:0` under use_cpu with a process group, while the collated tensors are on `cpu`:
#   `Tensor.to` then copies. The copies die with `training_step`'s `del inputs`, but the copy of
#   input_ids is saved by the embedding for its backward, the last to run: alive to the end of
#   backward (2 x 16 x 8 = 256 bytes), so at a peak in backward (DDP with gradient_as_bucket_view,
#   ZeRO-3), not at one in the optimizer step.
INPUT_IDS_COPY = BATCH * SEQ * 8
#   On a GPU neither of these two is on the device: the next batch waits on the host until it is
#   moved, and the device holds the one copy `to(device)` makes, the plan's batch; so the plan
#   leaves them out: they are the CPU's.
# - (Planned, not a difference: DDP's used-parameter maps. The Trainer sets
#   `find_unused_parameters=True` for a model without gradient checkpointing, and the reducer then
#   keeps two int32 maps, 8 bytes per parameter tensor: 168 for the Llama's 21, 328 for BERT's 41.
#   The plan reads it from the arguments (`resolve_settings`, the unit test below); the same runs
#   with `ddp_find_unused_parameters=False` read exactly 168 bytes less, 2,465,700 and 2,271,792.)
# - 0-dim scalars, the only tolerance (at most 48 bytes), exact per row: DDP at the optimizer step,
#   the Trainer's running `_tr_loss`, the step's loss kept detached (`tr_loss_step`; the bare loop
#   frees it after backward) and the clip's norm (`grad_norm`, a tensor until logged): 12 bytes; in
#   backward (ddp-view) the previous step's loss and norm, `_tr_loss` and accelerate's `loss /
#   gradient_accumulation_steps` (`Accelerator.backward`): 16. DeepSpeed's own (test_engine_runs.py
#   ZERO_SCALARS: 16 for ZeRO-2, 21 for ZeRO-3 on the Llama) with the Trainer's beside them: ZeRO-2
#   24, ZeRO-3 21; BERT under ZeRO-2 (no bare run): 32 on both processes, against each one's own
#   plan (rank 1's is 16 bytes above rank 0's: its partition's gradients; against rank 0's plan
#   this row read 32 and 48).
SCALARS = {"ddp": [12, 12], "ddp-view": [16, 16], "bert-ddp": [12, 12], "zero2": [24, 24], "zero3": [21, 21],
           "bert-zero2": [32, 32]}
BACKWARD_PEAK = ("ddp-view", "zero3")


def trainer_extra(row):
    model = "bert" if row.startswith("bert") else "llama"
    held = NEXT_BATCH[model] + (INPUT_IDS_COPY if row in BACKWARD_PEAK else 0)
    return [held + scalars for scalars in SCALARS[row]]


@slow
@pytest.mark.parametrize("row", ["ddp", "ddp-view", "bert-ddp"])
def test_trainers_ddp_peak_per_process_is_the_plan_and_what_the_trainers_loop_holds(runs, row):
    run = runs[row]
    assert [r["model_wrapped"] for r in run] == ["DistributedDataParallel"] * 2
    assert [r["global_step"] for r in run] == [3, 3]
    # The Trainer's arguments have no gradient_as_bucket_view (it is set on accelerate's handler):
    # given here as the flag it is. DDP itself is read from the arguments: the Trainer's whenever
    # world_size > 1 with no DeepSpeed or FSDP.
    plan = plan_of(run[0], gradient_as_bucket_view=row == "ddp-view")
    assert plan.settings.engine == "ddp" and plan.settings.used[[r[0] for r in plan.settings.used].index(
        "find_unused_parameters")][1:] == [True, "training args (Trainer: not gradient_checkpointing)"]
    peaks = [r["peak_bytes"] for r in run]
    # The plan with the maps, and the real: ddp 2,465,088 + 780 = 2,465,868; ddp-view
    # 2,270,920 + 1,040 = 2,271,960; bert-ddp 1,972,520 + 540 = 1,973,060.
    assert peaks == [plan.step.peak_bytes + extra for extra in trainer_extra(row)], (plan.step.peak_bytes, peaks)


@slow
@pytest.mark.parametrize("row", ["zero2", "zero3", "bert-zero2"])
def test_trainers_deepspeed_peak_per_process_is_the_plan_and_what_the_trainers_loop_holds(runs, row):
    run = runs[row]
    assert [r["model_wrapped"] for r in run] == ["DeepSpeedEngine"] * 2
    assert run[0]["zero_class"] == ("DeepSpeedZeroOptimizer_Stage3" if row == "zero3" else "DeepSpeedZeroOptimizer")
    plans = [plan_of(r, rank=rank) for rank, r in enumerate(run)]  # each process's own
    assert {plan.settings.engine for plan in plans} == {"zero"}
    # The DeepSpeed config's "auto" bucket sizes, filled as the Trainer fills them (hidden 64).
    assert dict((name, source) for name, _, source in plans[0].settings.used)["zero.reduce_bucket_size"] == \
        "deepspeed config auto (Trainer: from hidden_size)"
    peaks = [r["peak_bytes"] for r in run]
    # zero2 2,069,196 + 792 = 2,069,988; zero3 2,057,044 + 1,045 = 2,058,089;
    # bert-zero2 1,647,548 / 1,647,564 + 560 = 1,648,108 / 1,648,124.
    assert peaks == [plan.step.peak_bytes + extra for plan, extra in zip(plans, trainer_extra(row))], \
        ([plan.step.peak_bytes for plan in plans], peaks)


@slow
def test_the_trainer_runs_no_fsdp_on_the_cpu_it_runs_ddp(runs):
    # TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2, ...}) with use_cpu=True:
    # accelerate 1.16's AcceleratorState turns FSDP on only inside its branch for GPU-like
    # distributed types (MULTI_GPU, MULTI_XPU, ...: state.py, `if os.environ.get("ACCELERATE_USE_FSDP")
    # ... self.distributed_type = DistributedType.FSDP`); MULTI_CPU is not among them, so the Trainer
    # wraps the model in DDP, without an error or a warning, and the step is the ddp row's, to the byte.
    # FSDP2's real runs are the engine's own loop (test_engine_runs.py).
    assert [r["model_wrapped"] for r in runs["fsdp2"]] == ["DistributedDataParallel"] * 2
    assert [r["peak_bytes"] for r in runs["fsdp2"]] == [r["peak_bytes"] for r in runs["ddp"]]


def test_ddp_from_the_trainers_arguments_counts_the_reducers_used_parameter_maps():
    from transformers import TrainingArguments

    def plan(args=None, **flags):
        settings = resolve_settings(args, world_size=2, sharding="ddp", batch_size=BATCH, optimizer="adamw_torch",
                                    **flags)
        plan, _ = plan_step_memory(build, seq_len=SEQ, settings=settings, device_type="cpu", model_states=False)
        return settings, plan

    bare_settings, bare = plan()
    trainer_settings, trainer = plan(TrainingArguments("unused", report_to=[], use_cpu=True))
    # The Trainer's default: find_unused_parameters=True without gradient checkpointing, and the
    # reducer's two int32 maps, one value per parameter tensor (21), beside the buckets.
    assert (bare_settings.find_unused_parameters, trainer_settings.find_unused_parameters) == (False, True)
    assert trainer_settings.sources["find_unused_parameters"] == "training args (Trainer: not gradient_checkpointing)"
    assert trainer.step.peak_bytes == bare.step.peak_bytes + 2 * 4 * 21
    assert trainer.step.peak_parts["engine_buffers"] == bare.step.peak_parts["engine_buffers"] + 2 * 4 * 21
    # Bookkeeping, no model state: the table's gradients (the buckets' copy of them) stay.
    assert trainer.step.model_states_most_bytes == bare.step.model_states_most_bytes
    _, given = plan(TrainingArguments("unused", report_to=[], use_cpu=True, ddp_find_unused_parameters=False))
    assert given.step.peak_bytes == bare.step.peak_bytes
    checkpointed, _ = plan(TrainingArguments("unused", report_to=[], use_cpu=True, gradient_checkpointing=True))
    assert checkpointed.find_unused_parameters is False
