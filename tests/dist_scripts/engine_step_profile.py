"""One real training step per engine on the CPU (gloo), its live bytes as torch.profiler records them.

Usage: torchrun --nproc_per_node 2 (or 4) engine_step_profile.py OUT_DIR ENGINE...

ENGINE: ddp (gradient_as_bucket_view=False), ddp-view (True), fsdp2 (full shard), fsdp2-sgo
(reshard_after_forward=False), fsdp2-offload (full shard, `CPUOffloadPolicy(pin_memory=False)`),
fsdp2-hsdp (full shard on a 2 x W/2 mesh: replicated twice, sharded W/2-way), tp and tp-uneven
(torch's parallelize_module with the model's tp_plan; tp-uneven on 257 tokens, `CHANGED_CONFIG`), tp-auto,
tp-auto-uneven-mlp (an MLP width of 129) and tp-attention-whole (transformers' `from_pretrained(tp_plan=...)`), tp-bert (a
tiny BERT, which transformers gives no tp_plan, loaded with the plan trainer_memcb supplies), fsdp2-bf16 (full
shard with the Trainer's bf16=True as accelerate runs it: `MixedPrecisionPolicy` of bf16
parameters and reductions, the forward under CPU autocast); FSDP2's
ENGINE-memtracker: the same steps, the third under torch's FSDPMemTracker instead of the profiler
(`memtracker_run`); ddp-memtracker and ddp-view-memtracker: under torch's MemTracker
(`ddp_memtracker_run`); ENGINE-accN (with -memtracker): the same engine with gradient accumulation
over N micro-batches, each with its own batch (all made at the step's start and kept to its end, as
the Trainer's `get_batch_samples` fetches them to the device), every one but the last inside accelerate's
`Accelerator.no_sync` as the Trainer enters it (`model.no_sync()` for DDP,
`model.set_requires_gradient_sync(False)` for FSDP2), then clipping, the step and `zero_grad`.
The engine's own loop, as the Trainer's would run it: the tiny Llama
of tests/plan/test_engines.py in fp32 (sdpa), the Trainer's `adamw_torch`, forward with labels and
`num_items_in_batch`, backward, clipping at 1.0, step, `zero_grad(set_to_none=True)`. The profiler
records from before the model is made, so that what the engine allocates when it wraps the model
(DDP's buckets) is in the running sum; the figure is the most bytes alive during the third step
(the first made the optimizer state, the second rebuilt DDP's buckets in the order the gradients came). Each process writes `OUT_DIR/<engine>/rank<N>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from typing import Any

import _common  # noqa: F401  (sets up the import path)
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=256)
# The engines that run the tiny Llama with other sizes: `tp-uneven`, 257 tokens, TP's uneven shards of
# the embedding and the head (torch's chunk rule: 129 rows on rank 0, 128 on rank 1).
# `tp-auto-uneven-mlp`, an MLP width of 129 through transformers' own styles (gate_proj's and up_proj's
# rows, down_proj's columns 65 on rank 0, 64 on rank 1).
CHANGED_CONFIG = {"tp-uneven": dict(vocab_size=257), "tp-fsdp2-uneven": dict(vocab_size=257),
                  "tp-auto-uneven-mlp": dict(intermediate_size=129), "tp-fsdp2-uneven-mlp": dict(intermediate_size=129)}
BATCH, SEQ = 2, 16
# The encoder of engine `tp-bert`, for sequence classification: transformers gives it no tp_plan, and
# it is loaded as a user runs it with the plan trainer_memcb supplies
# (`from_pretrained(distributed_config=DistributedConfig(tp_plan=PLAN, tp_size=2))`).
BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
            max_position_embeddings=64)
# Its batch: 16 rows of 64 tokens, so that the backward holds the step's peak.
BERT_BATCH, BERT_SEQ = 16, 64
# The user's tensor-parallel rules of engine tp-attention-whole (tests/training/test_tensor_parallel_runs.py).
ATTENTION_WHOLE = {f"model.layers.*.self_attn.{name}": "replicate" for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def wrap(model: torch.nn.Module, engine: str) -> torch.nn.Module:
    if engine in ("tp", "tp-uneven"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from trainer_memcb.plan.model.tp_plan import model_tp_plan, torch_tp_plan

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        return parallelize_module(model, mesh, torch_tp_plan(model_tp_plan(model)))
    if engine in ("tp-auto", "tp-auto-uneven-mlp", "tp-attention-whole"):
        # The same layout through transformers' own loading: `from_pretrained(tp_plan="auto")` of this
        # model saved (rank 0, then every process loads it), transformers 5's own parallel styles;
        # tp-attention-whole: the user's rules over the model's plan (`DistributedConfig(tp_plan=dict)`,
        # which transformers merges into the model's), the attention's projections replicated.
        from transformers import LlamaForCausalLM

        folder = os.path.abspath(f"{engine}-checkpoint")
        if dist.get_rank() == 0:
            model.save_pretrained(folder)
        dist.barrier()
        del model
        tp_plan = ATTENTION_WHOLE if engine == "tp-attention-whole" else "auto"
        loaded = LlamaForCausalLM.from_pretrained(folder, tp_plan=tp_plan, attn_implementation="sdpa")
        loaded.config.use_cache = False
        return loaded
    if engine == "tp-bert":
        from transformers import BertForSequenceClassification, DistributedConfig

        from trainer_memcb.plan.model.supplied_tp_plans import supplied_tp_plan

        folder = os.path.abspath(f"{engine}-checkpoint")
        if dist.get_rank() == 0:
            model.save_pretrained(folder)
        dist.barrier()
        plan = supplied_tp_plan(model)
        del model
        return BertForSequenceClassification.from_pretrained(
            folder, distributed_config=DistributedConfig(tp_plan=plan, tp_size=dist.get_world_size()),
            attn_implementation="sdpa")
    if engine in ("tp-fsdp2", "tp-fsdp2-uneven", "tp-fsdp2-uneven-mlp", "tp-fsdp2-offload", "tp-hsdp"):
        # TP=2 x FSDP2 on the rest: a (dp_shard, tp) mesh in accelerate's order, the plan on tp, then
        # fully_shard of each layer and the root on dp_shard, as torchtitan and accelerate compose them.
        # tp-hsdp: a (dp_replicate=2, dp_shard, tp) mesh, fully_shard on its (dp_replicate, dp_shard)
        # dimensions (HSDP); tp-fsdp2-offload: FSDP2's CPU offload (not pinned: pinning needs CUDA).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        from trainer_memcb.plan.model.tp_plan import model_tp_plan, torch_tp_plan

        replicate = 2 if engine == "tp-hsdp" else 1
        shape, names = (replicate, dist.get_world_size() // 2 // replicate, 2), ("dp_replicate", "dp_shard", "tp")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        data = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
        parallelize_module(model, mesh["tp"], torch_tp_plan(model_tp_plan(model)))
        policy = CPUOffloadPolicy(pin_memory=False) if engine == "tp-fsdp2-offload" else OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=data, offload_policy=policy)
        return fully_shard(model, mesh=data, offload_policy=policy)
    if engine.startswith("ddp"):
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=engine == "ddp-view")
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = dict(reshard_after_forward=engine != "fsdp2-sgo")
    if engine == "fsdp2-bf16":
        # As accelerate prepares FSDP2 for the Trainer's bf16=True (`set_mixed_precision`).
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    elif engine == "fsdp2-offload":
        # Pinned host memory needs CUDA; on the CPU the host and the device are one memory.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif engine == "fsdp2-hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def tiny_llama(engine: str = "") -> torch.nn.Module:
    """The tiny Llama of tests/plan/test_engines.py, fp32, as the Trainer prepares it (the engine's
    sizes where `CHANGED_CONFIG` names some)."""
    config = LlamaConfig(**dict(CONFIG, **CHANGED_CONFIG.get(engine, {})))
    config._attn_implementation = "sdpa"
    config.use_cache = False  # as the Trainer sets it (args.use_cache)
    return LlamaForCausalLM(config)


def tiny_model(engine: str = "") -> torch.nn.Module:
    """The engine's model: the tiny BERT of `BERT` for `tp-bert`, else the tiny Llama."""
    if engine != "tp-bert":
        return tiny_llama(engine)
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**BERT)
    config._attn_implementation = "sdpa"
    return BertForSequenceClassification(config)


def batch(engine: str = "") -> dict:
    """The collator's batch (the tokenizer's all-ones attention mask included) and the Trainer's
    `num_items_in_batch`; for `tp-bert`, a label per row (the Trainer passes no count to a model
    whose forward takes none)."""
    if engine == "tp-bert":
        ids = torch.randint(0, 100, (BERT_BATCH, BERT_SEQ))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (BERT_BATCH,))}
    ids = torch.randint(0, 100, (BATCH, SEQ))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
            "num_items_in_batch": torch.tensor(float(ids.numel()))}


def one_count(batches) -> list:
    """The micro-batches of a step as `Trainer.get_batch_samples` hands them out: one
    `num_items_in_batch` tensor for them all."""
    batch_samples = list(batches)
    for each in batch_samples[1:]:
        each["num_items_in_batch"] = batch_samples[0]["num_items_in_batch"]
    return batch_samples


def trainer_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return build_trainer_optimizer("adamw_torch", TrainingArguments("unused", report_to=[]), model)


def peak_of(prof: profile, window_name: str = "measured step") -> dict:
    """The most bytes alive during the `record_function(window_name)` window, counted from the
    profiler's start (every allocation and free it recorded, summed in time order)."""
    events = list(prof.profiler.kineto_results.events())
    [window] = [e for e in events if e.name() == window_name]
    start, end = window.start_ns(), window.start_ns() + window.duration_ns()
    alive = peak = at_start = 0
    for record in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if record.start_ns() > end:
            break
        alive += record.nbytes()
        if record.start_ns() >= start:
            peak = max(peak, alive)
        else:
            at_start = alive
    return {"peak_bytes": max(peak, at_start), "alive_at_start_bytes": at_start}


def split_accumulation(engine: str) -> tuple:
    """`ddp-acc2` -> ("ddp", 2); an engine without the suffix accumulates over 1."""
    name, _, count = engine.rpartition("-acc")
    return (name, int(count)) if name and count.isdigit() else (engine, 1)


@contextlib.contextmanager
def no_sync(model: torch.nn.Module):
    """accelerate's `Accelerator.no_sync` (accelerator.py): FSDP2's `set_requires_gradient_sync(False)`
    for the time of the block, DDP's own `no_sync()`."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def steps_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: dict, before=lambda: None,
             autocast: bool = False, accumulation: int = 1):
    """One training step as the Trainer's loop runs it, over the trainable parameters (`before`
    called first; the forward under bf16 CPU autocast with `autocast`, as accelerate wraps it).
    With `accumulation` above 1, that many micro-batches, each with a batch of its own, all made
    at the step's start and kept to its end (the Trainer's `get_batch_samples`), all but the last
    under `no_sync`."""
    trainable = [p for p in model.parameters() if p.requires_grad]

    def micro_batch(batch_inputs: dict) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch_inputs).loss
        loss.backward()
        del loss

    def step() -> None:
        before()
        if accumulation == 1:
            micro_batch(inputs)
        else:
            batch_samples = one_count(batch() for _ in range(accumulation))
            for index, batch_inputs in enumerate(batch_samples):
                if index:
                    before()  # the trackers' per-module figures hold one forward each
                with (no_sync(model) if index < accumulation - 1 else contextlib.nullcontext()):
                    micro_batch(batch_inputs)
            del batch_samples, batch_inputs
        if len({getattr(p, "device_mesh", None) for p in trainable}) > 1:
            # TP's DTensor parameters beside whole ones (the norms), or under TP x FSDP2 on two meshes:
            # torch's clip_grad_norm_ refuses the mix; the Trainer's accelerate clips them so
            # (`Accelerator.clip_grad_norm_`), which reads nothing of self. FSDP2's parameters, all on
            # one mesh, keep torch's clipping.
            from accelerate import Accelerator

            Accelerator._clip_grad_norm_dtensor_aware(None, trainable, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def warm_up(step) -> None:
    step()
    step()  # DDP rebuilds its buckets once, at the second step's forward (`_rebuild_buckets`)
    # gloo's finished work objects of the last step hold small tensors until collected.
    dist.barrier()
    gc.collect()


def run(engine: str) -> dict:
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = wrap(tiny_llama(), engine)
        model.train()
        optimizer = trainer_optimizer(model)
        step = steps_of(model, optimizer, batch())
        warm_up(step)
        with record_function("measured step"):
            step()
    return peak_of(prof)


def memtracker_run(engine: str) -> dict:
    """The same steps with torch's `FSDPMemTracker` over the third to seventh (the least kept,
    `TRACKED_STEPS`) instead of the profiler: on the CPU, torch.profiler records the memory events of the threads it was started on only, so a
    buffer that a gloo worker thread frees last (the collectives' tensors) stays alive in its sum,
    by timing; the tracker follows every storage by its tensors' lifetimes (and FSDP2's resizes)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    engine, accumulation = split_accumulation(engine)
    torch.manual_seed(0)
    model = wrap(tiny_llama(engine), engine)
    model.train()
    optimizer = trainer_optimizer(model)
    inputs = batch() if accumulation == 1 else {}  # else each micro-batch makes its own
    trackers: list = []  # the tracker, made after the warm-up: its per-module figures reset per micro-batch
    step = steps_of(model, optimizer, inputs, autocast=engine == "fsdp2-bf16", accumulation=accumulation,
                    before=lambda: trackers and trackers[0].reset_mod_stats())
    warm_up(step)
    tracker = FSDPMemTracker(mod=model, optm=optimizer)
    trackers.append(tracker)
    tracker.track_inputs(tuple(inputs.values()))
    tp = engine.startswith(("tp-fsdp2", "tp-hsdp"))
    measured = []
    for _ in range(TRACKED_STEPS):  # the least of identical steps (`TRACKED_STEPS`)
        with tracker:
            step()
        snapshot = tracker.get_tracker_snapshot("peak")
        (stats,) = snapshot[model].values() if model in snapshot else snapshot.values()
        measured.append({"peak_bytes": int(stats["Total"]), "parts": {str(key): int(value) for key, value in stats.items()},
                         "phase_peaks": phase_peaks(tracker, model) if tp else None})
    return dict(least_of(measured), logged=logged_figures(model, optimizer, step) if tp else None)


def least_of(measured: list) -> dict:
    """The reading of least peak among identical steps' readings, and each phase's least apart."""
    least = dict(min(measured, key=lambda each: each["peak_bytes"]), each_peak=[each["peak_bytes"] for each in measured])
    if least["phase_peaks"] is not None:
        least["phase_peaks"] = {phase: min(each["phase_peaks"][phase] for each in measured)
                                for phase, value in least["phase_peaks"].items() if value is not None}
    return least


# gloo's worker thread lets a collective's buffers go after the program has moved on in about one
# step in twenty of the TP rows here (32,896 to 49,152 bytes above the program's order, in the
# forward or the backward, on either process), and more often under FSDP2 on a busy machine (49,152
# or 115,200 bytes at accumulation's last micro-batch in 8 of 36 steps read, 65,792 or 164,352 in
# full shard's in 9 of 60); a late free only adds, so of identical steps (the optimizer state made,
# DDP's buckets rebuilt) the least peak is the step in the program's order.
TRACKED_STEPS = 5


def ddp_memtracker_run(engine: str) -> dict:
    """DDP's steps under torch's `MemTracker` instead of the profiler (FSDPMemTracker wants FSDP
    modules): entered before the model is made, so that the reducer's buckets are counted, and left
    and entered again before each of the third to seventh steps, which restarts its peak from what
    is alive then; the least of them is kept (`TRACKED_STEPS`), each phase's least apart. The tracker
    follows each storage to its end by a weak reference, on whichever thread drops it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    engine, accumulation = split_accumulation(engine)
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        model = wrap(tiny_model(engine), engine)
        model.train()
        optimizer = trainer_optimizer(model)
        # Its per-module figures hold one iteration; the peak is kept apart.
        step = steps_of(model, optimizer, batch(engine) if accumulation == 1 else {}, before=tracker.reset_mod_stats,
                        accumulation=accumulation)
        warm_up(step)
    measured = []
    for _ in range(TRACKED_STEPS):
        with tracker:
            step()
        stats = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        measured.append({"peak_bytes": int(stats["Total"]), "parts": {str(key): int(value) for key, value in stats.items()},
                         "phase_peaks": phase_peaks(tracker, model) if engine.startswith("tp") else None})
    return dict(least_of(measured), params=parameter_bytes(model),
                logged=logged_figures(model, optimizer, step) if engine.startswith("tp") else None)


def phase_peaks(tracker: Any, model: torch.nn.Module) -> dict:
    """The tracker's most bytes alive during the model's forward and during its backward (its
    per-module figures of the root, reset at the step's start; FSDPMemTracker's of the root FSDP
    module, under its own states)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModState
    from torch.distributed._tools.mem_tracker import _ModState

    states = _FSDPModState if isinstance(tracker, FSDPMemTracker) else _ModState
    snapshots = tracker.memory_tracking[model].snapshots
    return {phase: max((int(each[torch.device("cpu")]["Total"]) for each in snapshots.get(state, [])), default=None)
            for phase, state in (("forward", states.PEAK_FW), ("backward", states.PEAK_BW))}


def logged_figures(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step) -> dict:
    """What the custom loop's `OptimizerMemoryLogger` (the callback's measuring, given the model)
    logs after one more step (made after the tracked one, so its hooks stay out of the tracker's
    figures), on every process: its own figures and the job's, exchanged."""
    from trainer_memcb import OptimizerMemoryLogger

    logger = OptimizerMemoryLogger(optimizer, model=model)
    step()
    return dict(logger())


def parameter_bytes(model: torch.nn.Module) -> dict:
    """The bytes of the parameters' local tensors (a DTensor's shard), and of the storages behind
    them, each storage once: more where a shard is a view of a larger tensor."""
    locals_ = [getattr(param, "_local_tensor", param) for param in model.parameters()]
    storages = {local.untyped_storage().data_ptr(): local.untyped_storage().nbytes() for local in locals_}
    return {"local_bytes": sum(local.numel() * local.element_size() for local in locals_),
            "storage_bytes": sum(storages.values())}


def main() -> None:
    parsed = argparse.ArgumentParser().parse_known_args()[1]
    out_dir, engines = parsed[0], parsed[1:]
    dist.init_process_group("gloo")
    for engine in engines:
        # ENGINE-memtracker: FSDPMemTracker's peak of the same step (see memtracker_run).
        if engine.endswith("-memtracker"):
            name = engine[:-len("-memtracker")]
            plain = name.startswith("ddp") or name in ("tp", "tp-auto", "tp-auto-uneven-mlp", "tp-uneven",
                                                          "tp-attention-whole", "tp-bert")  # FSDPMemTracker wants FSDP modules
            result = ddp_memtracker_run(name) if plain else memtracker_run(name)
        else:
            result = run(engine)
        _common.write_result(os.path.join(out_dir, engine), dict(result, engine=engine, world_size=dist.get_world_size()))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
