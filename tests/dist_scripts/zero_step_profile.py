"""One real DeepSpeed ZeRO training step per engine row on the CPU (gloo), its live bytes as
torch.profiler records them, per process.

Usage: torchrun --nproc_per_node 2 zero_step_profile.py OUT_DIR ROW...

ROW: a name of `ROWS` below, or NAME where OUT_DIR/NAME.json holds a DeepSpeed config as the
Trainer is handed it ("auto" values filled as the Trainer fills them, `trainer_filled`; a
proposal of `trainer-memcb estimate --fit`), (ZeRO-1, 2 and 3, each with `overlap_comm` false and true, ZeRO-2
with `offload_optimizer` to the CPU, ZeRO-3 with its fetch limits binding at 128 tokens, with
`offload_optimizer` and `offload_param` to the CPU, and in bf16); ROW-memtracker: the same steps under torch's MemTracker
instead of the profiler (`memtracker_run`), the figure tests/training/test_engine_runs.py holds the
plan to: the profiler, even fenced, misses frees on gloo's worker thread (see `memtracker_run`). The model, batch and client optimizer are those of
engine_step_profile.py (the tiny Llama in fp32, the Trainer's `adamw_torch` in its two param groups),
handed to `deepspeed.initialize` as the Trainer hands them when the DeepSpeed config has no
optimizer section; the loop is the one accelerate runs for the Trainer: `engine(**batch).loss`,
`engine.backward(loss)`, `engine.step()` (clipping at 1.0 inside, `gradient_clipping`). The config's
bucket sizes are the Trainer's "auto" values for hidden_size 64 (`reduce_bucket_size` 64², the
stage-3 prefetch 0.9 · 64², persistence 10 · 64), written out.

DeepSpeed's CPU shared-memory all-reduce op (compiled on first use) is switched off as in
deepspeed_zero.py, so that DeepSpeed talks to gloo. fp32: DeepSpeed's bf16 path on the CPU runs too
(deepspeed_zero.py trains it), the plan's comparison here is the fp32 one.

The profiler records from before the model is made, so that what `deepspeed.initialize` allocates
(the flat 16-bit groups, the fp32 master partitions, the optimizer state that
`initialize_optimizer_states` makes) is in the running sum; the figure is the most bytes alive
during the third step. gloo's collectives are fenced (`_gloo_fence.py`), so that every free of a
tensor that went through one is recorded (else, by timing, some are freed on gloo's worker thread,
where the profiler records nothing, and the count stays high). Each process writes `OUT_DIR/<row>/rank<N>.json` with its DeepSpeed config.
With TRAINER_MEMCB_PROFILE_DETAIL=1 it also lists what was alive at the peak, by the Python
function that allocated it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import os
from collections import Counter
from typing import Any, Dict, List

import _common  # noqa: F401  (sets up the import path)
import _gloo_fence
import deepspeed
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from engine_step_profile import BATCH, CONFIG, SEQ, batch, one_count, peak_of, tiny_llama, trainer_optimizer, warm_up

# deepspeed_zero.py's switch: `deepspeed.comm.torch` as an attribute is the torch package itself.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

HIDDEN = CONFIG["hidden_size"]
# The Trainer's "auto" values (transformers integrations/deepspeed.py, trainer_config_finalize).
AUTO = {"reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
        "stage3_param_persistence_threshold": 10 * HIDDEN}


def ds_config(stage: int, overlap_comm: bool, offload: bool = False, offload_param: bool = False,
              bf16: bool = False, **zero_settings: Any) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": stage, "overlap_comm": overlap_comm, "reduce_bucket_size": AUTO["reduce_bucket_size"]}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=AUTO["stage3_prefetch_bucket_size"],
                    stage3_param_persistence_threshold=AUTO["stage3_param_persistence_threshold"])
    config: Dict[str, Any] = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 1.0, "zero_optimization": zero,
                              "zero_allow_untested_optimizer": True, "steps_per_print": 1_000_000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        # The Trainer's adamw_torch as the client optimizer: DeepSpeed otherwise insists on its
        # DeepSpeedCPUAdam for offload (engine.py, _configure_basic_optimizer).
        config["zero_force_ds_cpu_optimizer"] = False
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if bf16:
        config["bf16"] = {"enabled": True}
    zero.update(zero_settings)
    return config


# ZeRO-3 with its fetch limits binding on the tiny Llama (2 layers, 9 modules with parameters
# each): every parameter partitioned (persistence 0), released after its forward and fetched again
# in backward (`stage3_max_reuse_distance` 0), the next modules' parameters prefetched up to 8,192
# values a time (one MLP projection; `fetch_sub_module`) while at most 20,000 values are whole
# (`stage3_max_live_parameters`, which bounds the prefetch only).
LIMITS = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
              stage3_prefetch_bucket_size=8192, stage3_max_live_parameters=20_000)


def accumulating(config: Dict[str, Any], steps: int) -> Dict[str, Any]:
    """`config` with `gradient_accumulation_steps`."""
    return dict(copy.deepcopy(config), gradient_accumulation_steps=steps)


ROWS = {
    "zero1-acc2": accumulating(ds_config(1, False), 2), "zero2-acc2": accumulating(ds_config(2, False), 2),
    "zero3-acc2": accumulating(ds_config(3, True), 2),
    "zero2-offload-acc2": accumulating(ds_config(2, False, offload=True), 2),
    "zero1": ds_config(1, False), "zero1-overlap": ds_config(1, True),
    "zero2": ds_config(2, False), "zero2-overlap": ds_config(2, True),
    "zero3-no-overlap": ds_config(3, False), "zero3": ds_config(3, True),
    "zero2-offload": ds_config(2, False, offload=True),
    "zero3-limits": ds_config(3, True, **LIMITS),
    "zero3-offload": ds_config(3, True, offload=True, offload_param=True),
    "zero3-bf16": ds_config(3, True, bf16=True),
}
# The sequence length per row where it is not engine_step_profile.py's: 128 tokens put ZeRO-3's
# peak in backward, where the fetch limits act (at 16 it is in the optimizer step).
ROW_SEQ = {"zero3-limits": 128, "zero1-acc2": 64, "zero2-acc2": 64, "zero3-acc2": 64,
           "zero2-offload-acc2": 64}


def trainer_filled(config: Dict[str, Any]) -> Dict[str, Any]:
    """A Trainer's DeepSpeed config with its "auto" values filled as the Trainer fills them for this
    model, batch and `max_grad_norm` 1.0 on `world_size` processes (transformers'
    integrations/deepspeed.py, `trainer_config_process` and `trainer_config_finalize`), the client
    optimizer kept with offload as `ds_config` keeps it."""
    filled = copy.deepcopy(config)
    values = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "train_batch_size": BATCH * dist.get_world_size(), "gradient_clipping": 1.0}
    for key, value in values.items():
        if filled.get(key) == "auto":
            filled[key] = value
    zero = filled.get("zero_optimization", {})
    for key, value in AUTO.items():
        if zero.get(key) == "auto":
            zero[key] = value
    filled.update(zero_allow_untested_optimizer=True, steps_per_print=1_000_000)
    if "offload_optimizer" in zero:
        filled["zero_force_ds_cpu_optimizer"] = False
    return filled


def alive_at_peak(prof: profile, window_name: str = "measured step") -> Dict[str, Any]:
    """The peak inside the window and what was alive then: [bytes, count, the allocating frames],
    largest first."""
    allocations = []

    def name_of(node: Any) -> str:
        try:
            return node.name
        except UnicodeDecodeError:  # with_stack=True garbles some names in torch 2.13
            return "?"

    def visit(node: Any, frames: List[str]) -> None:
        fields = type(node.extra_fields).__name__
        if fields.startswith("_ExtraFields_Allocation"):
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, tuple(frames)))
        elif fields.startswith("_ExtraFields_PyCall") or name_of(node) == window_name:
            frames = frames + [name_of(node).split("site-packages/")[-1]]
        for child in node.children:
            visit(child, frames)

    windows = []

    def find(node: Any) -> None:
        if name_of(node) == window_name:
            windows.append(node)
        for child in node.children:
            find(child)

    roots = prof.profiler.kineto_results.experimental_event_tree()
    for root in roots:
        visit(root, [])
        find(root)
    allocations.sort()
    [window] = windows
    start, end = window.start_time_ns, window.end_time_ns
    alive: Dict[int, Any] = {}
    total = best = 0
    best_alive: Dict[int, Any] = {}
    for time, ptr, size, frames in allocations:
        if time > end:
            break
        if size > 0:
            alive[ptr] = (size, frames)
        else:
            alive.pop(ptr, None)
        total += size
        if time >= start and total >= best:
            best, best_alive = total, dict(alive)
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for size, frames in best_alive.values():
        key = " < ".join(reversed([f for f in frames if not f.startswith("<built-in")][-4:]))
        counts[key] += 1
        sizes[key] += size
    return {"peak_bytes": best, "alive_at_peak": [[sizes[key], counts[key], key] for key, _ in sizes.most_common()]}


def zero_engine(config: Dict[str, Any]):
    """The tiny Llama wrapped by `deepspeed.initialize` with the Trainer's optimizer."""
    model = tiny_llama()
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=trainer_optimizer(model), config=copy.deepcopy(config))
    return engine


def row_batch(seq: int) -> Dict[str, torch.Tensor]:
    """engine_step_profile.py's batch at `seq` tokens."""
    ids = torch.randint(0, 100, (BATCH, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
            "num_items_in_batch": torch.tensor(float(ids.numel()))}


def engine_steps(engine, before=lambda: None, seq: int = 0):
    """One training step as the Trainer runs it under DeepSpeed (`before` called first). With the
    config's `gradient_accumulation_steps` above 1, as accelerate runs each micro-batch
    (`DeepSpeedEngineWrapper.backward`): the boundary set (true on the last only), `backward`, and
    `step` after the last; each micro-batch with a batch of its own, all made at the step's start
    and kept to its end (the Trainer's `get_batch_samples`)."""
    accumulation = engine.gradient_accumulation_steps()
    inputs = (row_batch(seq) if seq else batch()) if accumulation == 1 else {}

    def step() -> None:
        before()
        if accumulation == 1:
            loss = engine(**inputs).loss
            engine.backward(loss)
            del loss
            engine.step()
            return
        batch_samples = one_count(row_batch(seq or SEQ) for _ in range(accumulation))
        for index, micro_inputs in enumerate(batch_samples):
            last = index == accumulation - 1
            if index:
                before()  # the tracker's per-module figures hold one forward each
            engine.set_gradient_accumulation_boundary(is_boundary=last)
            loss = engine(**micro_inputs).loss
            engine.backward(loss)
            del loss
            if last:
                engine.step()
        del batch_samples, micro_inputs

    return step


def closed(engine, result: Dict[str, Any]) -> Dict[str, Any]:
    """The result, with the engine's class; the engine destroyed so the next row starts bare."""
    result = dict(result, zero_class=type(engine.optimizer).__name__)
    engine.destroy()
    del engine
    gc.collect()
    return result


def run(config: Dict[str, Any], detail: bool, seq: int = 0) -> Dict[str, Any]:
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=detail) as prof:
        engine = zero_engine(config)
        step = engine_steps(engine, seq=seq)
        warm_up(step)
        with record_function("measured step"):
            step()
    # with_stack=True garbles the kineto events' names (a UnicodeDecodeError here): the detail
    # mode reads the event tree only.
    return closed(engine, alive_at_peak(prof) if detail else peak_of(prof))


def memtracker_run(config: Dict[str, Any], seq: int = 0) -> Dict[str, Any]:
    """The same steps under torch's `MemTracker` instead of the profiler: it follows every storage
    made under it (a dispatch mode on the main thread) to its end by a weak reference, whichever
    thread drops the last one, so gloo's worker threads do not hide a free. Entered before the
    model is made, so that what `deepspeed.initialize` allocates is counted; left and entered again
    before the third step, which restarts its peak from what is alive then (`__enter__`)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        engine = zero_engine(config)
        # Its per-module figures hold one iteration; the peak is kept apart.
        step = engine_steps(engine, before=tracker.reset_mod_stats, seq=seq)
        warm_up(step)
    with tracker:
        step()
    peaks = tracker.get_tracker_snapshot("peak")
    stats = peaks[torch.device("cpu")]
    return closed(engine, {
        "peak_bytes": int(stats["Total"]), "parts": {str(key): int(value) for key, value in stats.items()},
        "other_devices": {str(device): int(snap["Total"]) for device, snap in peaks.items() if device.type != "cpu"}})


def main() -> None:
    parsed = argparse.ArgumentParser().parse_known_args()[1]
    out_dir, rows = parsed[0], parsed[1:]
    detail = os.environ.get("TRAINER_MEMCB_PROFILE_DETAIL") == "1"
    _gloo_fence.install()  # before the process group is made: see _gloo_fence.py
    deepspeed.init_distributed(dist_backend="gloo")
    for row in rows:
        # ROW-memtracker: MemTracker's peak of the same step (see memtracker_run).
        name = row[:-len("-memtracker")] if row.endswith("-memtracker") else row
        given = os.path.join(out_dir, f"{name}.json")
        if name not in ROWS and os.path.isfile(given):
            with open(given) as handle:
                ROWS[name] = trainer_filled(json.load(handle))
        config, seq = ROWS[name], ROW_SEQ.get(name, 0)
        result = memtracker_run(config, seq) if row.endswith("-memtracker") else run(config, detail, seq)
        _common.write_result(os.path.join(out_dir, row), dict(result, row=row, deepspeed_config=config, seq_len=seq or SEQ,
                                                                world_size=dist.get_world_size()))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
