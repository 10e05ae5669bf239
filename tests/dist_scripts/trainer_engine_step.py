"""Real training runs driven by the Hugging Face `Trainer` itself on the CPU (gloo), the third
optimizer step's peak per process as torch's MemTracker counts it.

Usage: torchrun --nproc_per_node 2 trainer_engine_step.py OUT_DIR ROW...
(`--nproc_per_node 1` for the one-process rows: the Trainer then makes no process group)

ROW: a name of `ROWS` below (ddp-used and ddp-view-used: DDP with `ddp_find_unused_parameters=False`,
which tells the reducer's used-parameter maps apart; fsdp2: what the Trainer does with an FSDP2
config on the CPU, DDP). The models are the tiny Llama of engine_step_profile.py (fp32, sdpa)
and a tiny BertForSequenceClassification (2 layers, hidden 64); the Trainer runs them as a user's
script would: `TrainingArguments(use_cpu=True, ddp_backend="gloo", optim="adamw_torch", ...)`, a
torch dataset of tokenized rows (Python lists, as a tokenizer gives them) and the Trainer's default
collator (`default_data_collator`, no tokenizer given), `max_steps=3`; DeepSpeed through
`TrainingArguments(deepspeed=CONFIG)`, its bucket sizes "auto" as the Trainer fills them; DDP with
`gradient_as_bucket_view=True` through accelerate's `DistributedDataParallelKwargs` handler, which
the Trainer makes from its arguments but for this flag (set on it before training).

The tracker (`torch.distributed._tools.mem_tracker.MemTracker`) is entered before the model is
made, so that what the engine allocates when the Trainer wraps the model (DDP's buckets,
DeepSpeed's flat partitions and optimizer state) is counted, and stays entered through training;
a `TrainerCallback` leaves it and enters it again at `on_step_begin` of the third step (which
restarts its peak from what is alive then: the batch already collated, the dataloader's next one)
and reads its peak at that step's `on_step_end` (after the optimizer step and `zero_grad`). Each
process writes `OUT_DIR/<row>/rank<N>.json` with its TrainingArguments as JSON (the plan reads
them back).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import tempfile
from typing import Any, Dict

import _common  # noqa: F401  (sets up the import path)
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from engine_step_profile import BATCH, SEQ, tiny_llama

# deepspeed_zero.py's switch: DeepSpeed's CPU shared-memory all-reduce op would be compiled on
# first use; without it DeepSpeed talks to gloo.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

MEASURED_STEP = 3
# Rows per process in the dataset: more than the three steps take, so that the dataloader has a
# next batch in hand during the third, as in any longer run.
ROWS_PER_PROCESS = 4 * BATCH * MEASURED_STEP
BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
            max_position_embeddings=64, num_labels=2)

# A user's DeepSpeed config: what the Trainer fills, "auto".
DS_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "steps_per_print": 1_000_000}


def ds_config(stage: int) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    return dict(DS_AUTO, zero_optimization=zero)


# row: (model, TrainingArguments keywords beyond the common ones, gradient_as_bucket_view)
ROWS = {
    "ddp": ("llama", {}, False),
    "ddp-view": ("llama", {}, True),
    "ddp-view-used": ("llama", {"ddp_find_unused_parameters": False}, True),
    "ddp-used": ("llama", {"ddp_find_unused_parameters": False}, False),
    "bert-ddp": ("bert", {}, False),
    "zero2": ("llama", {"deepspeed": ds_config(2)}, False),
    "zero3": ("llama", {"deepspeed": ds_config(3)}, False),
    "bert-zero2": ("bert", {"deepspeed": ds_config(2)}, False),
    # One process (launched with --nproc_per_node 1), 4 micro-batches per optimizer step.
    "one-acc4": ("llama", {"gradient_accumulation_steps": 4}, False),
    "ddp-acc2": ("llama", {"gradient_accumulation_steps": 2}, False),
    "fsdp2": ("llama", {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True,
                                                              "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
              False),
}


class TokenRows(torch.utils.data.Dataset):
    """Tokenized rows as a tokenizer returns them (Python lists): a causal LM's labels are its
    ids; a classifier's one label per row."""

    def __init__(self, kind: str, count: int) -> None:
        generator = torch.Generator().manual_seed(_common.rank())
        self.ids = torch.randint(0, 100, (count, SEQ), generator=generator).tolist()
        self.kind = kind

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        ids = self.ids[index]
        row = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        row["labels"] = list(ids) if self.kind == "llama" else index % 2
        return row


def tiny_bert() -> torch.nn.Module:
    config = BertConfig(**BERT)
    config._attn_implementation = "sdpa"
    return BertForSequenceClassification(config)


class ThirdStepWindow(TrainerCallback):
    """Restart the tracker's peak as the third step begins; read it as that step ends."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker = tracker
        self.peak: Dict[str, int] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == MEASURED_STEP - 1:
            # Left and entered again: `__enter__` takes what is alive now as the peak so far.
            self.tracker.__exit__(None, None, None)
            self.tracker.__enter__()
        self.tracker.reset_mod_stats()  # its per-module figures hold one step; the peak is kept apart

    def on_substep_end(self, args, state, control, **kwargs):
        # With gradient accumulation, after each micro-batch but the last: the next forward's
        # per-module figures start afresh (the peak is kept apart).
        self.tracker.reset_mod_stats()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == MEASURED_STEP:
            stats = self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            self.peak = {str(key): int(value) for key, value in stats.items()}


def run(row: str, scratch: str) -> Dict[str, Any]:
    kind, extra, bucket_view = ROWS[row]
    # One process (WORLD_SIZE=1, no torchrun): no backend, else accelerate looks for a process group.
    backend = "gloo" if _common.world_size() > 1 else None
    args = TrainingArguments(os.path.join(scratch, row), use_cpu=True, ddp_backend=backend, optim="adamw_torch",
                             per_device_train_batch_size=BATCH, max_steps=MEASURED_STEP, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, **extra)
    tracker = MemTracker()
    window = ThirdStepWindow(tracker)
    with tracker:
        torch.manual_seed(0)
        model = tiny_llama() if kind == "llama" else tiny_bert()
        # A next batch in hand during the third step with accumulation too.
        rows = ROWS_PER_PROCESS * args.gradient_accumulation_steps * _common.world_size()
        trainer = Trainer(model=model, args=args, train_dataset=TokenRows(kind, rows), callbacks=[window])
        if bucket_view:
            trainer.accelerator.ddp_handler.gradient_as_bucket_view = True
        trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    result = {"peak_bytes": window.peak.get("Total"), "parts": window.peak, "model_wrapped": wrapped,
              "global_step": trainer.state.global_step, "training_args": json.loads(args.to_json_string()),
              "deepspeed_config": extra.get("deepspeed"),
              "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    if extra.get("deepspeed"):
        result["zero_class"] = type(trainer.model_wrapped.optimizer).__name__
        trainer.model_wrapped.destroy()
    del trainer, model
    gc.collect()
    return result


def main() -> None:
    parsed = argparse.ArgumentParser().parse_known_args()[1]
    out_dir, rows = parsed[0], parsed[1:]
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as scratch:
        for row in rows:
            # TrainingArguments tells accelerate its engine through the environment
            # (ACCELERATE_USE_DEEPSPEED, ACCELERATE_USE_FSDP, ...): each row starts from the launch's.
            for key in set(os.environ) - set(environment):
                del os.environ[key]
            try:
                result = run(row, scratch)
            except Exception as error:  # recorded: a row the Trainer cannot run here says why
                result = {"error": f"{type(error).__name__}: {error}"[:2000]}
            _common.write_result(os.path.join(out_dir, row), dict(result, row=row))
            if dist.is_initialized():
                dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
