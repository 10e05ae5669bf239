"""FSDP2 traced, not modelled: the real `fully_shard` on the fake process group of the job's size.

As torchtitan's memory estimator runs it: `torch.distributed.init_process_group("fake",
store=FakeStore(), rank=0, world_size=W)` (`torch.testing._internal.distributed.fake_pg`; here the
settings' rank), a
device mesh made before the fake mode (a mesh made under it reads fake values), each decoder
layer sharded and then the root (`fully_shard` as the Trainer's accelerate wraps a transformers
model: `_no_split_modules` layers, then the whole model). FSDP2 itself then allocates, during the
fake step, what a real rank allocates: the sharded parameters (its padded shards: the same bytes on every rank), the root's
parameters left unsharded after the forward's end only with `reshard_after_forward=False`, each
layer's all-gather buffer and unsharded parameters as it runs (with the next layer's prefetched),
the reduce-scatter input of each layer's gradients and the sharded gradients. FSDP2 frees the
unsharded parameters by resizing their storages to 0 (`free_storage`), which the live-storage
tracker follows.

Parts named here: the unsharded parameters (`FSDPParam.all_gather_outputs`, tagged as each module's
forward begins, also kept out of the activations though autograd saves them), the unsharded
gradients (autograd's, until `foreach_reduce` copies them into the reduce-scatter input) and the
engine's buffers (the tensors handed to the all-gather and reduce-scatter collectives).

Gradient accumulation: accelerate runs every micro-batch but the last inside `Accelerator.no_sync`,
which for FSDP2 is `model.set_requires_gradient_sync(False)` (accelerate 1.x `no_sync`; transformers'
`Trainer._inner_training_loop` enters it for all but the last of `batch_samples`): each group's
`post_backward` then reshards the parameters but keeps the unsharded gradients
(`_fsdp_param_group.py`: `if not self.reduce_grads: ... to_accumulated_grad_if_needed()`; in the
reduce dtype, `unsharded_accumulated_grad`, where it differs from the parameters'), and the later
micro-batches add into them (`accumulate_unsharded_grad_if_needed`); the last one reduce-scatters
them. The real `fully_shard` does all this here too; the engine only says which micro-batch runs
and names the unsharded gradients kept between micro-batches.

Mixed precision: the Trainer's bf16=True / fp16=True (autocast-bf16 / autocast-fp16) makes
accelerate hand `fully_shard` a `MixedPrecisionPolicy` of 16-bit parameters and reductions
(`mixed_precision_policy`): the shards and the optimizer state stay fp32, what is gathered and
reduce-scattered is 16-bit.

Streams: FSDP2 runs its communication on streams of its own (`FSDPCommContext.lazy_init`), and
every storage is counted with the stream current when it is allocated (`LiveStorages.stream_of`):
the trace runs the real code on the CPU, whose `torch.cpu.stream` context sets a current stream as
`torch.cuda.stream` does, so which allocation lands on which stream is the installed torch's. In
torch 2.13 (`_fsdp_collectives.py`): each all-gather's inputs (the 16-bit casts of the shards) and
its output are allocated on the all-gather copy-in stream (`foreach_all_gather`, in forward and
for the backward's unshards, `get_all_gather_streams`), the collective runs on the all-gather
stream and allocates nothing, and the unsharded parameters are made on the default stream in the
copy-out; the reduce-scatter's input on the default stream, its output (the sharded gradients,
and their fp32 cast under mixed precision) on the reduce-scatter stream, HSDP's all-reduce on the
all-reduce stream. FSDP2 calls no `record_stream`: it keeps each buffer alive until an event says
the other stream is done (`AllGatherState`, `ReduceScatterState`), and ProcessGroupNCCL stashes a
collective's tensors rather than recording streams (`TORCH_NCCL_AVOID_RECORD_STREAMS` is the
default) and runs a synchronous collective on the current stream. A block freed on the default
stream returns to the pool of the stream it was allocated on, so the all-gather outputs and the
sharded gradients are reused only by their own stream's later allocations.

CPU offload (`CPUOffloadPolicy`): the sharded parameters, their gradients and the optimizer state
live on the CPU; the trace runs on the CPU for both, so those storages are moved out of the
device's timeline by part when the peak is read (`host_parts`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from trainer_memcb.plan.step.engines.base import StepEngine

__all__ = ["FSDP2Engine", "FSDP2_STREAMS"]

# FSDPCommContext's streams (torch 2.13 `_fsdp_param_group.py`, `lazy_init`), by the number the
# plan gives each (`Timeline.streams`; 0 is the default stream).
FSDP2_STREAMS = {1: "all_gather_copy_in_stream", 2: "all_gather_stream", 3: "reduce_scatter_stream",
                 4: "all_reduce_stream"}


def _layers(model: nn.Module) -> List[nn.Module]:
    """The modules accelerate's FSDP2 wraps in a transformers model: those whose class is in
    `_no_split_modules` (its TRANSFORMER_BASED_WRAP default), outermost first."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


class FSDP2Engine(StepEngine):
    """The real FSDP2 step on a fake process group.

    Args:
        settings: resolved settings (`world_size`, `reshard_after_forward`, `fsdp_cpu_offload`,
            `replicate`, `max_grad_norm`).
    """

    name = "fsdp2"
    stream_names = FSDP2_STREAMS

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.settings = settings
        self._owns_group = False
        self._states: List[Any] = []
        self._hooks: List[Any] = []
        self._gather_serials: Set[int] = set()
        self.host_parts = ("parameters", "gradients", "optimizer_state") if settings.fsdp_cpu_offload else ()
        self._restore: Optional[Any] = None
        self._model: Optional[nn.Module] = None
        self._sync = True
        self._default_stream: Any = None
        self._stream_numbers: Dict[int, int] = {}  # id() of FSDP2's stream objects -> number

    def micro_batch(self, number: int, last: bool) -> None:
        # accelerate's `no_sync` for FSDP2: every micro-batch but the last keeps its gradients unsharded.
        self._sync = last
        if self._model is not None:
            self._model.set_requires_gradient_sync(last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if not self._sync and self.tracker is not None:
            kept = [tensor for state in self._states for group in _param_groups(state)
                    for param in group.fsdp_params
                    for tensor in (getattr(param, "unsharded_accumulated_grad", None),
                                   getattr(getattr(param, "_unsharded_param", None), "grad", None))
                    if tensor is not None]
            self.tracker.tag(kept, "unsharded_gradients", replace=True)

    def wrap(self, model: nn.Module, mode: Any) -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore

        world = self.settings.world_size
        if dist.is_initialized():
            if dist.get_backend() != "fake" or dist.get_world_size() != world:
                raise ValueError("a process group is already initialized here: the FSDP2 plan needs its own fake one")
        else:
            dist.init_process_group("fake", store=FakeStore(), rank=self.settings.rank, world_size=world)
            self._owns_group = True
        mesh = self._mesh()
        self._restore = _quicker_fsdp2()
        policy = CPUOffloadPolicy(pin_memory=False) if self.settings.fsdp_cpu_offload else OffloadPolicy()
        mixed = mixed_precision_policy(self.settings.precision)
        if mixed.param_dtype is not None:
            dtype = str(mixed.param_dtype).replace("torch.", "")
            self.notes.append(f"FSDP2 MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={dtype}), as accelerate "
                              "sets it for the Trainer's 16-bit training: fp32 shards, 16-bit gathers and reductions")
        kwargs = dict(mesh=mesh, reshard_after_forward=self.settings.reshard_after_forward, offload_policy=policy,
                      mp_policy=mixed)
        self._before_sharding(model, mode)
        with mode:
            for layer in _layers(model):
                fully_shard(layer, **kwargs)
            fully_shard(model, **kwargs)
        self._model = model
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is not None:
                self._states.append(state())
                # FSDP2's own pre-forward hook is prepended: this one runs after the unshard.
                self._hooks.append(module.register_forward_pre_hook(self._unsharded_hook(state())))
        return model

    def _mesh(self) -> Any:
        """The mesh FSDP2 shards over, made before the fake mode: the world's, or HSDP's 2-D one."""
        from torch.distributed.device_mesh import init_device_mesh

        world, replicate = self.settings.world_size, self.settings.replicate
        if replicate > 1:
            self.notes.append(f"HSDP: replicated {replicate}x, sharded {world // replicate}-way")
            return init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh("cpu", (world,))

    def _before_sharding(self, model: nn.Module, mode: Any) -> None:
        """What an engine built on this one does to the model before `fully_shard` (tensor parallelism)."""

    def _unsharded_hook(self, state: Any) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            group = state._fsdp_param_group
            if group is None or self.tracker is None:
                return
            outputs = [tensor for param in group.fsdp_params for tensor in (getattr(param, "all_gather_outputs", None) or ())]
            self.tracker.tag(outputs, "unsharded_parameters", replace=True)
            if self.counter is not None:
                for tensor in outputs:
                    storage = tensor.untyped_storage()
                    self.counter._excluded.setdefault(storage._cdata, storage)
        return hook

    def attach(self, tracker: Any, counter: Any) -> None:
        super().attach(tracker, counter)
        tracker.on_op = self._on_op
        self._default_stream = torch.cpu.current_stream()
        tracker.stream_of = self._stream_now

    def _stream_now(self) -> int:
        """The number of the stream current now (`FSDP2_STREAMS`; 0 the default stream, and any
        stream not FSDP2's)."""
        current = torch.cpu.current_stream()
        if current is self._default_stream:
            return 0
        number = self._stream_numbers.get(id(current))
        if number is None and self._states:
            # The streams are made at the root's lazy init, in the first forward, shared by all states.
            context = getattr(self._states[0], "_comm_ctx", None)
            for candidate, attribute in FSDP2_STREAMS.items():
                if getattr(context, attribute, None) is current:
                    number = self._stream_numbers[id(current)] = candidate
        return number or 0

    def _on_op(self, func: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        # The flat buffers FSDP2 hands its collectives (`_fsdp_collectives.py`): the all-gather's
        # output (its input is a slice of it) and the reduce-scatter's input. The reduce-scatter's
        # output becomes the sharded gradients.
        # The unsharded gradients that `foreach_reduce` copies into that input
        # (`foreach_reduce_scatter_copy_in`: torch 2.13's `torch.ops.fsdp.chunk_cat(unsharded_grads,
        # ...)`, `torch._chunk_cat` in older ones) are the unsharded gradients, on the device even
        # with CPU offload, from autograd's making them until the copy frees them.
        name = getattr(func, "__name__", str(func))
        namespace = getattr(func, "namespace", "")
        if namespace in ("fsdp", "aten") and name.lstrip("_").startswith("chunk_cat") and args:
            self.tracker.tag(list(_tensors(args[0])), "unsharded_gradients")
            return
        if namespace not in ("c10d", "_c10d_functional"):
            return
        if "allgather" in name or "all_gather" in name:
            gathered = list(_tensors(args))
            self.tracker.tag(gathered, "engine_buffers")
            self._gather_serials.update(self.tracker.serials(gathered))
        elif "reduce_scatter" in name:
            tensors = list(_tensors(args))
            self.tracker.tag(tensors[1:2] if len(tensors) > 1 else tensors, "engine_buffers")

    def gradients(self, trainable: List[torch.Tensor]) -> List[torch.Tensor]:
        return [p.grad for p in trainable if p.grad is not None]

    def state_of(self, part: str, serial: int) -> Optional[str]:
        # The all-gather buffers carry parameters, the reduce-scatter inputs gradients.
        if part == "engine_buffers" and serial in self._gather_serials:
            return "parameters"
        return super().state_of(part, serial)

    def close(self) -> None:
        import torch.distributed as dist

        for hook in self._hooks:
            hook.remove()
        if self.tracker is not None:
            self.tracker.on_op = None
            self.tracker.stream_of = None
        self._stream_numbers.clear()
        if self._restore is not None:
            self._restore()
            self._restore = None
        self._model = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _param_groups(state: Any) -> List[Any]:
    """An FSDP state's parameter groups (`_fsdp_param_groups` in torch 2.13, `_fsdp_param_group` before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def mixed_precision_policy(precision: str) -> Any:
    """The `MixedPrecisionPolicy` accelerate hands `fully_shard` for the Trainer's precision.

    accelerate's `FullyShardedDataParallelPlugin.set_mixed_precision` (called with the Trainer's
    bf16=True / fp16=True, our autocast-bf16 / autocast-fp16): `param_dtype` and `reduce_dtype` both
    the 16-bit type, so FSDP2 all-gathers 16-bit parameters and reduce-scatters 16-bit gradients from
    fp32 shards (`fsdp2_prepare_model` keeps the trainable parameters fp32); the forward runs under
    autocast as well. Any other precision: torch's default policy (the parameters' own dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype is not None else MixedPrecisionPolicy()


def _quicker_fsdp2() -> Callable[[], None]:
    """The two speed-ups below and the fake-storage fix, for the time of one trace; returns what
    undoes them."""
    undo = [restore for restore in (_quicker_foreach_sharding(), _lazy_shard_chunks(), _unchanged_shards_kept())
            if restore is not None]

    def restore() -> None:
        for one in reversed(undo):
            one()

    return restore


class _Chunks(Sequence):
    """What `torch.chunk(tensor, n, dim)` gives, padded with empty tensors to `n` chunks as FSDP2's
    `_chunk_with_empty` pads it, each chunk made only when it is read (`tensor.narrow`, the same
    view `chunk` makes: same size, strides, offset and storage)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int, size: int) -> None:
        self._tensor, self._num_chunks, self._dim, self._size = tensor, num_chunks, dim, size
        self._split = -(-size // num_chunks)  # torch.chunk's chunk size: the ceiling
        self._count = -(-size // self._split)  # the chunks torch.chunk returns, the last one smaller
        self._made: Dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self._num_chunks

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num_chunks))]
        if index < 0:
            index += self._num_chunks
        if not 0 <= index < self._num_chunks:
            raise IndexError("chunk index out of range")
        made = self._made.get(index)
        if made is None:
            if index < self._count:
                start = index * self._split
                made = self._tensor.narrow(self._dim, start, min(self._split, self._size - start))
            else:
                made = self[0].new_empty(0)
            self._made[index] = made
        return made


def _lazy_shard_chunks() -> Optional[Callable[[], None]]:
    """Let `fully_shard` chunk each parameter lazily; returns what puts torch's function back.

    `FSDPParam` (`_fsdp_param.py`, `_init_sharded_param` and
    `_init_sharded_post_forward_param_metadata`) calls `_chunk_with_empty(param, world_size,
    dim)` and reads one or two of its chunks (this rank's, and chunk 0's size): on W processes
    that made W fake views of every parameter, twice, the most of a 64-process plan's time. The
    chunks read are the same views, made as they are read; nothing else changes."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        return None

    def lazy(original: Callable[..., Any]) -> Callable[..., Any]:
        def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Any:
            size = tensor.size(dim)
            if type(size) is not int or type(num_chunks) is not int or size <= 0 or num_chunks <= 1:
                return original(tensor, num_chunks, dim)
            return _Chunks(tensor, num_chunks, dim, size)
        return chunk_with_empty

    return _patch(_fsdp_param, "_chunk_with_empty", lazy)


def _unchanged_shards_kept() -> Optional[Callable[[], None]]:
    """Let `FSDPParam.reset_sharded_param` see that a shard is unchanged under fake tensors.

    FSDP2's lazy init (the first forward) re-pads a shard whose local tensor is not the padded size
    unless the local tensor is a view of `_sharded_param_data`, which it tells by `data_ptr()`
    (`_fsdp_param.py`, `same_local_tensor`, for a plain `torch.Tensor` only). A fake tensor is
    neither, and its storage's data pointer is 0, so on a rank whose shards are shorter than chunk 0 (the last ones, where a dimension does not split evenly) every
    shard was copied into a new padded tensor and the old one kept alive beside it: 156,088 bytes of
    the tiny Llama's shards twice on rank 2 of 3, which a real run of that rank does not hold. The
    same storage is told here by the storage itself, and the call left out, as a real run's check
    finds it a no-op."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return None

    def unless_unchanged(original: Callable[..., Any]) -> Callable[..., Any]:
        def reset_sharded_param(self: Any) -> Any:
            data = getattr(self, "_sharded_param_data", None)
            module_info = getattr(self, "_module_info", None)
            current = getattr(module_info.module, module_info.param_name, None) if module_info is not None else None
            local = getattr(current, "_local_tensor", None)
            if (current is getattr(self, "sharded_param", None) and type(data) in (torch.Tensor, FakeTensor)
                    and local is not None and not self.pin_memory
                    and data.untyped_storage()._cdata == local.untyped_storage()._cdata):
                return None
            return original(self)
        return reset_sharded_param

    return _patch(FSDPParam, "reset_sharded_param", unless_unchanged)


def _quicker_foreach_sharding() -> Optional[Callable[[], None]]:
    """Make DTensor's sharding propagation of a foreach operation linear in its tensors, not
    quadratic; returns what puts torch's own function back (None: nothing was changed).

    torch's `_sharding_prop.propagate_op_sharding_non_cached` calls
    `_propagate_use_strided_shard_flag(strategy, op_schema)` once per tensor of a foreach
    operation (AdamW's foreach step over every parameter, the gradient clipping's norms), and
    each call walks the whole schema's `args_spec` (every tensor's spec) to see whether one of
    them is a `_StridedShard`; where none is, the function does nothing. That answer is kept
    here per schema, so the walk is made once per operation; a schema with one goes to torch's
    function unchanged. The result is the same: the shards and so every byte traced."""
    try:
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    plain: List[Any] = [None]  # the last schema seen without a _StridedShard (compared by identity)

    def once_per_schema(original: Callable[..., Any]) -> Callable[..., Any]:
        def propagate(op_strategy: Any, op_schema: Any) -> None:
            if plain[0] is op_schema:
                return
            if any(isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements):
                return original(op_strategy, op_schema)
            plain[0] = op_schema
            return None
        return propagate

    return _patch(_sharding_prop, "_propagate_use_strided_shard_flag", once_per_schema)


def _patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Optional[Callable[[], None]]:
    """Replace `owner.name` with `make(original)` for the time of a trace; returns what puts the
    original back, or None (and nothing changed) where this torch has no such attribute."""
    original = getattr(owner, name, None)
    if original is None:
        return None
    setattr(owner, name, make(original))

    def restore() -> None:
        setattr(owner, name, original)

    return restore


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
