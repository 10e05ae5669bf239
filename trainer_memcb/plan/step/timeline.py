"""The traced step's one product: the timeline of the storages it created and freed, by part.

A step traced under fake tensors (`trainer_memcb.plan.step.trace`) is, for everything after it,
this record: every storage counted, in the order it started and stopped counting (`events`), its
bytes (`sizes`), the part it belongs to (`part_of`: an engine's own name for it, else the
parameters, gradients, optimizer state, batch and buffers, or the activations at a moment, else
other), the model state it carries (`states`), and the most bytes alive in each phase with which
storages were alive then (`forward_backward`, `optimizer_step`). The answers
(`trainer_memcb.plan.answers`) read the peak, its parts and the model states from it, never from
the tracker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["PhasePeak", "Timeline", "PLAN_PARTS", "MODEL_STATES", "HOST", "most_by"]

# The plan's own parts, in the order a storage is given the first that holds it (an engine's own
# name for a storage comes before all of them; "activations" is a moment's: saved for backward then).
PLAN_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "batch_and_buffers", "other")
# The model states, as the model-states table names them.
MODEL_STATES = ("parameters", "gradients", "optimizer_state", "master_weights")
# A model state's bytes on the host (offloaded) are kept apart from the device's under this suffix.
HOST = "@host"


@dataclass(frozen=True)
class PhasePeak:
    """The most bytes alive at one moment of a phase.

    Attributes:
        phase: the phase at that moment (forward, backward, optimizer step).
        bytes: the bytes alive then.
        storages: the storages alive then, by serial number.
        saved: of them, those autograd held saved for backward then (the activations).
    """

    phase: str
    bytes: int
    storages: Tuple[int, ...]
    saved: FrozenSet[int] = frozenset()


@dataclass(frozen=True)
class Timeline:
    """The storages one traced step created and freed, in order, each with its bytes and part.

    Attributes:
        events: `s` when storage `s` (a serial number) starts to count, `~s` when it stops.
        sizes: serial number -> bytes, for every storage counted.
        tags: serial number -> part, for the storages an engine names (its buffers, unsharded
            parameters, master weights, ...).
        groups: the plan's own parts (parameters, gradients, optimizer_state, batch_and_buffers)
            -> the storages in each.
        states: serial number -> the model state the storage carries (`MODEL_STATES`, with
            `HOST` appended where it lives on the host); storages of none are absent.
        host_parts: the parts that live on the host (an engine's offload).
        step_start: the index in `events` where the step begins (what came before it is the
            model brought to its state between steps).
        forward_backward, optimizer_step: each phase's peak (the optimizer step's None without one).
        state_resident: the optimizer state was made before the step (DeepSpeed), so it is in
            the timeline from its start.
        activations_bytes, activations_peak_bytes: saved for backward at the end of forward, and
            the most saved at one moment of forward and backward.
        optimizer_failure: why the optimizer could not be built under fake tensors, or None.
        notes: what the trace says of itself (the engine's, the model's).
        engine: the engine's name; optimizer_implementation: foreach, fused or single-tensor.
        gradient_accumulation_steps: the micro-batches of the step; `peak_micro_batch`: the one
            whose forward and backward hold `forward_backward` (1 to gradient_accumulation_steps);
            `micro_batch_peaks`: with accumulation, each traced micro-batch's number and its own
            peak (the first, the second and the last: those between run as the second), in order.
        phase_starts: phase (forward, backward, optimizer step) -> the position in `events` where
            it begins; what comes before the forward's is the model, its batch and the engine's
            resident buffers made before the step.
        first_matmul: phase -> the position in `events` of its first matrix multiply (where CUDA
            makes a cuBLAS handle's workspaces); `groups["batch"]` holds the batch's storages alone.
        generation: TRL's GRPO step's generation phase's peak (None for other steps).
        streams: serial number -> the CUDA stream the storage is allocated on, for those an
            engine allocates on a stream of its own (FSDP2's all-gather and reduce-scatter
            streams, ZeRO's reduction and all-gather streams); every other storage is on the
            default stream, 0. The caching allocator gives a block freed on one stream to that
            stream alone (the allocator replay).
        stream_names: stream number -> the engine's name for it.
    """

    events: Tuple[int, ...]
    sizes: Mapping[int, int]
    tags: Mapping[int, str]
    groups: Mapping[str, FrozenSet[int]]
    states: Mapping[int, str]
    host_parts: Tuple[str, ...]
    step_start: int
    forward_backward: PhasePeak
    optimizer_step: Optional[PhasePeak]
    state_resident: bool
    activations_bytes: int
    activations_peak_bytes: int
    optimizer_failure: Optional[str] = None
    notes: Tuple[str, ...] = ()
    engine: str = "none"
    optimizer_implementation: Optional[str] = None
    gradient_accumulation_steps: int = 1
    peak_micro_batch: int = 1
    micro_batch_peaks: Tuple[Tuple[int, PhasePeak], ...] = ()
    # The FLOPs of the micro-batches traced and the optimizer step (`trainer_memcb.plan.step.flops`),
    # counted inside `counting_flops`; None where not counted.
    flops: Optional[int] = None
    phase_starts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    first_matmul: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # TRL's GRPO step: its generation phase's peak (before the first forward), apart from
    # `forward_backward` (the training phase's); None for every other step.
    generation: Optional[PhasePeak] = None
    streams: Mapping[int, int] = dataclasses.field(default_factory=dict)
    stream_names: Mapping[int, str] = dataclasses.field(default_factory=dict)
    # torch_compile=True traced compiled (`trainer_memcb.plan.step.compiled_step`): the forward's
    # saved tensors AOTAutograd's min-cut partition's; False for the eager step.
    compiled: bool = False

    def with_resident(self, part: str, nbytes: int, *, state: Optional[str] = None,
                      group: Optional[str] = None) -> "Timeline":
        """This timeline with one storage more, of `nbytes`, tagged `part`, alive from before the
        step's first event to its end: what a run holds through the whole step that the trace does
        not make, such as a frozen reference model, or the optimizer state its estimate rule gives
        where the optimizer cannot be built under fake tensors. It is allocated first (before the
        model's parameters), never freed, and alive at every phase's peak; `state` is the model
        state it carries (`HOST` appended where `part` lives on the host), `group` the plan's own
        part it joins (an optimizer state that joins "optimizer_state" is then resident: made
        before the step, as `state_resident` says)."""
        serial = max(self.sizes, default=-1) + 1

        def grown(peak: PhasePeak) -> PhasePeak:
            return dataclasses.replace(peak, bytes=peak.bytes + nbytes, storages=peak.storages + (serial,))

        groups = dict(self.groups)
        if group is not None:
            groups[group] = groups.get(group, frozenset()) | {serial}
        states = dict(self.states)
        if state is not None:
            states[serial] = state + (HOST if part in self.host_parts else "")
        return dataclasses.replace(
            self, events=(serial,) + tuple(self.events), sizes={**self.sizes, serial: nbytes},
            tags={**self.tags, serial: part}, groups=groups, states=states, step_start=self.step_start + 1,
            forward_backward=grown(self.forward_backward),
            optimizer_step=None if self.optimizer_step is None else grown(self.optimizer_step),
            generation=None if self.generation is None else grown(self.generation),
            micro_batch_peaks=tuple((number, grown(peak)) for number, peak in self.micro_batch_peaks),
            state_resident=self.state_resident or group == "optimizer_state",
            phase_starts={phase: index + 1 for phase, index in self.phase_starts.items()},
            first_matmul={phase: index + 1 for phase, index in self.first_matmul.items()})

    def part_of(self, serial: int, saved: FrozenSet[int] = frozenset()) -> str:
        """The part of a storage at a moment when `saved` were saved for backward."""
        tag = self.tags.get(serial)
        if tag is not None:
            return tag
        for name in PLAN_PARTS[:-1]:
            if serial in (saved if name == "activations" else self.groups.get(name, ())):
                return name
        return "other"

    def bytes_of(self, serials: Iterable[int]) -> int:
        """The bytes of the storages `serials`, each once."""
        return sum(self.sizes[serial] for serial in set(serials))

    def allocations(self) -> Iterator[Union[Tuple[str, int, int, int], Tuple[str, int, int], Tuple[str, int]]]:
        """The events as an allocator sees them, in order: `("alloc", serial, nbytes)` (with its
        stream, `("alloc", serial, nbytes, stream)`, for a storage on a stream other than the
        default one) and `("free", serial)`; the storages of every part, those on the host
        (`host_parts`) too."""
        streams = self.streams
        for event in self.events:
            if event < 0:
                yield ("free", ~event)
            elif event in streams:
                yield ("alloc", event, self.sizes[event], streams[event])
            else:
                yield ("alloc", event, self.sizes[event])

    def most_by(self, group_of: Callable[[int], Optional[str]]) -> Dict[str, int]:
        """The most bytes each group held at one moment since the step began (`step_start`), the
        events replayed with `group_of(serial)` naming each storage's group (None: none)."""
        return most_by(self.events, self.sizes, self.step_start, group_of)


def most_by(events: Sequence[int], sizes: Mapping[int, int], start: int,
            group_of: Callable[[int], Optional[str]]) -> Dict[str, int]:
    """The most bytes each group held at one moment from `events[start]` on (what was alive then
    counts from there), the events replayed with `group_of(serial)` naming each storage's group."""
    totals: Dict[str, int] = {}
    most: Dict[str, int] = {}
    groups: Dict[int, Optional[str]] = {}
    for index, event in enumerate(events):
        if index == start:
            most = dict(totals)
        serial = event if event >= 0 else ~event
        group = groups[serial] if serial in groups else groups.setdefault(serial, group_of(serial))
        if group is None:
            continue
        totals[group] = totals.get(group, 0) + (sizes[serial] if event >= 0 else -sizes[serial])
        if index >= start and totals[group] > most.get(group, 0):
            most[group] = totals[group]
    if start >= len(events):
        most = dict(totals)
    return most
