"""The traced step's timeline: each storage's part at a moment, and the replay of its events."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.timeline import PhasePeak, Timeline
from trainer_memcb.plan.step.trace import trace_step


def timeline() -> Timeline:
    # Serial 0: a parameter (16 bytes), 1: its gradient (16), 2: an engine's bucket (32), 3: a
    # tensor saved for backward at the forward's peak (64), 4: the batch (8), 5: a temporary (4).
    sizes = {0: 16, 1: 16, 2: 32, 3: 64, 4: 8, 5: 4}
    groups = {"parameters": frozenset({0}), "gradients": frozenset({1}), "optimizer_state": frozenset(),
              "batch_and_buffers": frozenset({4})}
    return Timeline(events=(0, 4, 3, 5, ~5, ~3, 1, 2, ~2), sizes=sizes, tags={2: "engine_buffers"}, groups=groups,
                    states={0: "parameters", 1: "gradients", 2: "gradients"}, host_parts=(), step_start=2,
                    forward_backward=PhasePeak("forward", 92, (0, 4, 3, 5), frozenset({3})), optimizer_step=None,
                    state_resident=False, activations_bytes=64, activations_peak_bytes=64)


def test_a_storage_s_part_is_the_engine_s_name_then_the_plan_s_own_then_saved_at_that_moment():
    line = timeline()
    at = line.forward_backward
    assert [line.part_of(serial, at.saved) for serial in range(6)] == [
        "parameters", "gradients", "engine_buffers", "activations", "batch_and_buffers", "other"]
    assert line.part_of(3) == "other"  # saved for backward only at the moment that says so
    assert line.bytes_of([0, 0, 3]) == 80  # each storage once


def test_the_replay_gives_each_state_s_most_from_the_step_s_start():
    # The gradients: 16, then 16 + 32 with the bucket, then 16 (the bucket freed): at most 48.
    # The parameter came before the step's start and counts from there.
    assert timeline().most_by(timeline().states.get) == {"parameters": 16, "gradients": 48}


def test_the_events_read_as_an_allocator_replays_them():
    assert list(timeline().allocations())[:5] == [("alloc", 0, 16), ("alloc", 4, 8), ("alloc", 3, 64), ("alloc", 5, 4),
                                                  ("free", 5)]
    assert len(list(timeline().allocations())) == 9


def test_a_traced_step_s_timeline_holds_each_phase_s_peak_and_the_answer_reads_it():
    def build():
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=256)
        with torch.device("meta"):
            return LlamaForCausalLM(config)

    settings = resolve_settings(world_size=2, sharding="ddp", batch_size=2, seq_len=16, optimizer="adamw_torch",
                                device_type="cpu")
    line = trace_step(build(), settings, args=None, step_dtype=torch.float32)
    assert line.engine == "ddp" and line.optimizer_step is not None
    for peak in (line.forward_backward, line.optimizer_step):
        assert line.bytes_of(peak.storages) == peak.bytes  # the storages alive then, each once
    # The parameters' whole fp32 bytes, filed as parameters; the buckets carry gradients.
    assert line.bytes_of(line.groups["parameters"]) == sum(
        p.numel() * 4 for p in {id(p): p for p in build().parameters()}.values())
    assert "engine_buffers" in set(line.tags.values())
    plan, _ = plan_step_memory(build, seq_len=16, settings=settings, device_type="cpu", model_states=False)
    assert plan.step.forward_backward_peak_bytes == line.forward_backward.bytes + line.bytes_of(line.groups["optimizer_state"])


def test_what_the_plan_adds_for_the_whole_step_is_a_storage_of_the_timeline():
    # A 100-byte optimizer state estimated by rule, then a 1000-byte reference model: each made
    # first, alive at every phase's peak, never freed; the state is a model state and resident.
    line = timeline().with_resident("optimizer_state", 100, state="optimizer_state", group="optimizer_state")
    line = line.with_resident("reference_model", 1000)
    assert line.events[:3] == (7, 6, 0) and line.step_start == 4
    assert (line.sizes[6], line.sizes[7]) == (100, 1000)
    assert (line.part_of(6), line.part_of(7)) == ("optimizer_state", "reference_model")
    assert line.groups["optimizer_state"] == frozenset({6}) and line.state_resident
    assert line.forward_backward.bytes == 92 + 1100 and line.bytes_of(line.forward_backward.storages) == 1192
    assert line.most_by(line.states.get) == {"parameters": 16, "gradients": 48, "optimizer_state": 100}
    assert list(line.allocations())[:3] == [("alloc", 7, 1000), ("alloc", 6, 100), ("alloc", 0, 16)]
    assert not any(event == ("free", 6) or event == ("free", 7) for event in line.allocations())
    assert timeline().forward_backward.bytes == 92  # the timeline it grew from is unchanged


def test_a_resident_part_that_lives_on_the_host_carries_its_state_there():
    import dataclasses

    line = dataclasses.replace(timeline(), host_parts=("optimizer_state",))
    line = line.with_resident("optimizer_state", 100, state="optimizer_state", group="optimizer_state")
    assert line.states[6] == "optimizer_state@host"
