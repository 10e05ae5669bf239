"""What the caching allocator reserves for a traced step: its allocations replayed, two steps in a row.

The timeline (`trainer_memcb.plan.step.timeline.Timeline`) holds every storage the step created
and freed, in order. `step_allocations` turns it into the calls a CUDA process makes to PyTorch's
caching allocator over its first two training steps, and `replay_step` runs them through the model
of that allocator (`trainer_memcb.plan.device.caching_allocator.CachingAllocatorModel`):

- **Step 1** is the timeline from its start: what the plan adds for the whole step (a frozen
  reference model, an optimizer state estimated by rule: `Timeline.with_resident`), the model's
  parameters and buffers, the batch and an engine's resident buffers made first, in order, then the forward, the backward and the optimizer
  step, whose optimizer state (and any buffer an engine makes lazily) is made as the step reaches it.
- **Step 2** keeps what step 1 left alive (the cache is never emptied between steps by the
  Trainer): the optimizer state and the engine's buffers are not made again. The optimizer state
  (and ZeRO's master weights) is never freed: the trace drops its optimizer after the step, a run
  keeps it to the end. Its batch is new: in
  transformers' `Trainer._inner_training_loop` the next batch is moved to the device by
  `get_batch_samples` (accelerate's `DataLoaderShard` sends each batch as it is yielded) while the
  list that holds the previous batch (`batch_samples`) is still alive, so the new batch's
  storages are allocated first and the old batch's freed after. Then the step's events run again.
- **`torch_empty_cache_steps=N`**: `Trainer.training_step` calls `torch.cuda.empty_cache()` after
  the forward (`compute_loss`, then `del inputs`) and before the backward, in each step whose
  `state.global_step` (the optimizer steps done before it) N divides: step 1 (global step 0)
  always, step 2 when N is 1.
- **CUDA's own allocations** (`trainer_memcb.plan.device.cuda_kernels`): ATen gives each (cuBLAS
  handle, stream) a cuBLAS workspace and a cuBLASLt workspace through the caching allocator the
  first time the handle multiplies (`CublasHandlePool.cpp`), and keeps them for the process's life:
  one pair at the forward's first matrix multiply, and one for the autograd engine's device
  thread, whose handle is its own, at the backward's first. They are allocated, so they are in the
  replay's allocated figures (`allocated_peak_bytes`), not in the trace's `peak_bytes`.
- **Streams**: a storage the timeline puts on a stream of the engine's own (`Timeline.streams`:
  FSDP2's all-gather copy-in, reduce-scatter and all-reduce streams, ZeRO-1/2's reduction stream,
  ZeRO-3's all-gather stream) is allocated on that stream
  (`("alloc", key, nbytes, stream)`), so the allocator gives its block, once freed, to that
  stream's later requests alone, and a request of that stream takes no block freed on another.
  FSDP2 holds its buffers until an event instead of `record_stream`, and ProcessGroupNCCL stashes
  a collective's tensors; ZeRO-3's `record_stream` calls delay a free until the GPU has run the
  recorded stream's work so far, which the replay takes to be at once (the GPU keeping up with
  the host): every free returns its block at once.
- Only the device's storages are replayed: what an engine keeps on the host (offload, the
  timeline's `host_parts`) never reaches the allocator.

What is not replayed: the `scaled_dot_product_attention` differences between the CPU kernel the
trace runs and CUDA's (the memory-efficient kernel's padded logsumexp, FlashAttention-2's backward
workspaces), gradient accumulation's micro-batches, NCCL's buffers (outside the allocator) and CUDA
graphs. `fits?` leaves them to the user's `reserve_bytes`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple, Union

from trainer_memcb.plan.device.alloc_conf import AllocConf, as_alloc_conf
from trainer_memcb.plan.device.caching_allocator import CachingAllocatorModel, OutOfMemory
from trainer_memcb.plan.device.cuda_kernels import cublas_workspace_bytes, cublaslt_workspace_bytes
from trainer_memcb.plan.device.gpus import DEFAULT_COMPUTE_CAPABILITY
from trainer_memcb.plan.step.timeline import Timeline

__all__ = ["ReplayOptions", "StepReplay", "step_allocations", "replay_step", "step_replayer", "DEFAULT_COMPUTE_CAPABILITY"]


@dataclass(frozen=True)
class ReplayOptions:
    """The arguments of the `replay_step` whose figures a step plan reports, kept so that the same
    replay can be run again (`trainer_memcb.plan.answers.plan_snapshot`).

    Attributes:
        alloc_conf: the allocator's settings replayed.
        device_memory: the limit the replay ran under (the device's memory less the CUDA context
            and the reserve, where the allocator had to release its cache to fit), or None.
        compute_capability: the GPU's (the cuBLAS workspaces' size).
        empty_cache_steps: the Trainer's `torch_empty_cache_steps`, or None.
    """

    alloc_conf: AllocConf
    device_memory: Optional[int] = None
    compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY
    empty_cache_steps: Optional[int] = None


@dataclass(frozen=True)
class StepReplay:
    """Two training steps' allocations through the caching allocator, on one process.

    Attributes:
        reserved_peak_bytes: the most the allocator held from the device (`torch.cuda.max_memory_reserved`).
        allocated_peak_bytes: the most it handed out, blocks rounded up to 512 bytes and CUDA's
            workspaces included (`torch.cuda.max_memory_allocated`).
        allocated_at_reserved_peak_bytes: handed out at the moment of the reserved peak.
        fragmentation_bytes: `reserved_peak_bytes - allocated_peak_bytes`: what the allocator
            holds beyond the most it ever hands out (cached blocks, the unused ends of segments),
            peak against peak: what the caching costs on top of the allocated peak.
        reserved_after_step_bytes: reserved at the end of each step (steps 1 and 2).
        cuda_workspace_bytes: the cuBLAS and cuBLASLt workspaces allocated (both handles).
        oom: None, or where a device of `device_memory` bytes runs out: "step N, PHASE".
        events: the allocator calls replayed.
    """

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    allocated_at_reserved_peak_bytes: int
    fragmentation_bytes: int
    reserved_after_step_bytes: Tuple[int, int]
    cuda_workspace_bytes: int
    oom: Optional[str]
    events: int


_Event = Union[Tuple[str, Any, int], Tuple[str, Any], Tuple[str]]


def step_allocations(timeline: Timeline, *, compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
                     empty_cache_steps: Optional[int] = None,
                     env: Optional[Mapping[str, str]] = None) -> List[Tuple[_Event, str]]:
    """The allocator calls of two steps of `timeline` (see the module docstring), each with where
    it happens ("step N, PHASE").

    Args:
        timeline: the traced step.
        compute_capability: the GPU's, for the cuBLAS workspaces' size.
        empty_cache_steps: the Trainer's `torch_empty_cache_steps` (None: never).
        env: the environment the workspaces' sizes read (`CUBLAS_WORKSPACE_CONFIG`, ...).
    """
    return _calls(timeline, _workspaces(compute_capability, env), empty_cache_steps)[0]


def _workspaces(compute_capability: Tuple[int, int], env: Optional[Mapping[str, str]]) -> Tuple[int, int]:
    """The cuBLAS and cuBLASLt workspaces' bytes, as `env` sets them (None: the defaults)."""
    return cublas_workspace_bytes(compute_capability, env), cublaslt_workspace_bytes(compute_capability, env)


def _calls(timeline: Timeline, workspaces: Tuple[int, int],
           empty_cache_steps: Optional[int]) -> Tuple[List[Tuple[_Event, str]], int, int]:
    """The allocator calls of two steps (`step_allocations`), where step 2's begin, and the
    workspaces' bytes among them."""
    events, sizes, streams = timeline.events, timeline.sizes, timeline.streams
    host_parts = set(timeline.host_parts)
    tags = timeline.tags
    on_host = {serial for serial, tag in tags.items() if tag in host_parts} if host_parts else set()
    forward = timeline.phase_starts.get("forward", timeline.step_start)
    backward = timeline.phase_starts.get("backward")
    first = {index: phase for phase, index in timeline.first_matmul.items() if phase in ("forward", "backward")}
    calls: List[Tuple[_Event, str]] = []
    append = calls.append
    # The optimizer's state (and ZeRO's master weights) lives from the step that makes it to the end
    # of training; the trace frees it when it drops its optimizer after the step, which a run never does.
    kept = set(timeline.groups.get("optimizer_state", ())) | {
        serial for serial, state in timeline.states.items() if state in ("optimizer_state", "master_weights")}
    alive: Dict[int, None] = {}
    workspace = 0  # the cuBLAS and cuBLASLt workspaces allocated (one pair a handle)
    phase = "step 1, setup"
    starts = {index: f"step 1, {name}" for name, index in timeline.phase_starts.items()}
    for index, event in enumerate(events):
        if index in starts:
            phase = starts[index]
        if index == backward and empty_cache_steps is not None:
            append((("empty_cache",), phase))
        if index in first:
            handle = first[index]
            append((("alloc", ("cublas", handle), workspaces[0]), phase))
            append((("alloc", ("cublaslt", handle), workspaces[1]), phase))
            workspace += workspaces[0] + workspaces[1]
        serial = event if event >= 0 else ~event
        if serial in on_host:
            continue
        if event >= 0:
            alive[serial] = None
            stream = streams.get(serial)
            append((("alloc", serial, sizes[serial], stream) if stream else ("alloc", serial, sizes[serial]), phase))
        elif serial not in kept:
            del alive[serial]
            append((("free", serial), phase))
    step1_end = len(calls)
    _second_step(calls, timeline, alive, on_host, kept, forward, backward, empty_cache_steps)
    return calls, step1_end, workspace


def _second_step(calls: List[Tuple[_Event, str]], timeline: Timeline, alive: Dict[int, None], on_host: Set[int],
                 kept: Set[int], forward: int, backward: Optional[int], empty_cache_steps: Optional[int]) -> None:
    """Step 2's calls, appended to `calls`: a new batch, the old one freed after; then the step's
    events again, what step 1 left `alive` kept under its own key."""
    events, sizes, streams = timeline.events, timeline.sizes, timeline.streams
    append = calls.append
    batch = [serial for serial in timeline.groups.get("batch", ()) if serial in alive]
    phase = "step 2, setup"
    for serial in sorted(batch):
        append((("alloc", (2, serial), sizes[serial]), phase))
    for serial in sorted(batch):
        append((("free", serial), phase))
        del alive[serial]
    live2 = {serial: (2, serial) for serial in batch}
    starts = {index: f"step 2, {name}" for name, index in timeline.phase_starts.items()}
    for index in range(forward, len(events)):
        if index in starts:
            phase = starts[index]
        if index == backward and empty_cache_steps == 1:
            append((("empty_cache",), phase))
        event = events[index]
        serial = event if event >= 0 else ~event
        if serial in on_host:
            continue
        if event >= 0:
            if serial in alive:  # made in step 1 and still alive: not made again
                continue
            key = live2[serial] = (2, serial)
            stream = streams.get(serial)
            append((("alloc", key, sizes[serial], stream) if stream else ("alloc", key, sizes[serial]), phase))
        elif serial not in kept:
            key = live2.pop(serial, None)
            if key is not None:
                append((("free", key), phase))
            elif serial in alive:
                del alive[serial]
                append((("free", serial), phase))


def replay_step(timeline: Timeline, *, alloc_conf: Union[None, str, AllocConf] = None,
                device_memory: Optional[int] = None,
                compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
                empty_cache_steps: Optional[int] = None,
                env: Optional[Mapping[str, str]] = None) -> StepReplay:
    """Replay two steps of `timeline` through the caching allocator (`step_allocations`).

    Args:
        alloc_conf: `PYTORCH_CUDA_ALLOC_CONF` (a string or a parsed `AllocConf`; None: torch's defaults).
        device_memory: what the allocator may take from the device (its memory less the CUDA
            context and any reserve); None: no limit.
        compute_capability: as `step_allocations`.
        empty_cache_steps: as `step_allocations`.
        env: as `step_allocations`.
    """
    return step_replayer(timeline, compute_capability=compute_capability, empty_cache_steps=empty_cache_steps,
                         env=env)(alloc_conf, device_memory)


def step_replayer(timeline: Timeline, *, compute_capability: Tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
                  empty_cache_steps: Optional[int] = None,
                  env: Optional[Mapping[str, str]] = None) -> Callable[..., StepReplay]:
    """`replay_step` for one timeline, its allocator calls made once: a plan that runs past the
    device's memory replays the same calls again with the limit, and the calls of a 7B step take a
    sixth of a replay's time. The function returned takes `alloc_conf` and `device_memory`."""
    calls = _calls(timeline, _workspaces(compute_capability, env), empty_cache_steps)
    return functools.partial(_replay_calls, calls)


def _replay_calls(made: Tuple[List[Tuple[_Event, str]], int, int], alloc_conf: Union[None, str, AllocConf] = None,
                  device_memory: Optional[int] = None) -> StepReplay:
    """The allocator model run over the calls `_calls` made."""
    conf = as_alloc_conf(alloc_conf)
    calls, step1_end, workspace = made
    model = CachingAllocatorModel(conf, device_memory)
    best_reserved = -1
    at_peak = 0
    reserved_after = [0, 0]
    oom: Optional[str] = None
    malloc, free = model.malloc, model.free
    done = 0
    try:
        for position, (event, where) in enumerate(calls):
            if position == step1_end:
                reserved_after[0] = model.reserved
            kind = event[0]
            if kind == "alloc":
                malloc(*event[1:])
                if model.reserved > best_reserved:
                    best_reserved, at_peak = model.reserved, model.allocated
            elif kind == "free":
                free(event[1])
            else:
                model.empty_cache()
            done = position + 1
    except OutOfMemory:
        oom = calls[done][1]
    if step1_end >= len(calls):
        reserved_after[0] = model.reserved
    reserved_after[1] = model.reserved
    reserved = model.reserved_peak
    if best_reserved < reserved:  # reached inside a retry; the allocated bytes of then are unknown
        at_peak = model.allocated
    return StepReplay(reserved_peak_bytes=reserved, allocated_peak_bytes=model.allocated_peak,
                      allocated_at_reserved_peak_bytes=at_peak,
                      fragmentation_bytes=reserved - model.allocated_peak,
                      reserved_after_step_bytes=(reserved_after[0], reserved_after[1]),
                      cuda_workspace_bytes=workspace, oom=oom, events=done)
