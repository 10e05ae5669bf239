"""Steps shared inside `sharing_traces`: a step that differs from one traced before by its optimizer
alone runs no forward and backward of its own, and its plan and timeline are those of a trace of its
own, to the event; and the number of traces `estimate --fit` makes, counted exactly."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Dict, List

import pytest
import torch

import trainer_memcb.plan.step.trace as trace
from helpers import requires_torch, requires_transformers, requires_version, tiny_llama_config, trl_llama_config
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIMIZERS = ("adamw_torch", "adafactor", "adamw_bnb_8bit", "sgd")


def build() -> torch.nn.Module:
    config = tiny_llama_config("sdpa", vocab_size=256, max_position_embeddings=32)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def counting_traces(monkeypatch: Any) -> Dict[str, int]:
    """Counts, as they run, the whole traces (`trace_step_once`) and the optimizer phases run from
    a step kept before (`_another_optimizer`)."""
    counts = {"traced": 0, "optimizer steps shared": 0}
    once, another = trace.trace_step_once, trace._another_optimizer

    def traced(*args: Any, **kwargs: Any) -> Any:
        counts["traced"] += 1
        return once(*args, **kwargs)

    def stepped(*args: Any, **kwargs: Any) -> Any:
        counts["optimizer steps shared"] += 1
        return another(*args, **kwargs)

    monkeypatch.setattr(trace, "trace_step_once", traced)
    monkeypatch.setattr(trace, "_another_optimizer", stepped)
    return counts


def plans(flags: Dict[str, Any], device_type: str) -> List[Any]:
    return [plan_step_memory(build, seq_len=32, settings=resolve_settings(batch_size=4, optimizer=name, **flags),
                             device_type=device_type, model_states=False)[0] for name in OPTIMIZERS]


@requires_torch("2.13", "an optimizer phase steps from a kept step only where it was checked equal to a trace of "
                "its own (torch 2.13 with transformers 5: trace._shares_optimizer_phases); older releases trace "
                "each step whole")
@requires_transformers("5.0", "an optimizer phase steps from a kept step only with transformers 5 "
                       "(trace._shares_optimizer_phases)")
@pytest.mark.parametrize("flags, device_type", [
    ({}, "cuda"),
    ({"world_size": 2, "sharding": "ddp"}, "cuda"),
    ({"gradient_accumulation_steps": 3, "gradient_checkpointing": True, "precision": "bf16"}, "cpu"),
], ids=["one process", "ddp", "accumulation and checkpointing on the CPU"])
def test_an_optimizer_only_change_steps_from_the_shared_forward_and_backward_as_a_trace_of_its_own(
        monkeypatch, flags, device_type):
    with trace.counting_flops():
        alone = plans(flags, device_type)
    counts = counting_traces(monkeypatch)
    with trace.sharing_traces(), trace.counting_flops():
        shared = plans(flags, device_type)
    # One forward and backward; every other optimizer stepped from where the first one's began.
    assert counts == {"traced": 1, "optimizer steps shared": len(OPTIMIZERS) - 1}
    for own, kept in zip(alone, shared):
        assert kept.step.problem is None and kept.settings.optimizer == own.settings.optimizer
        assert kept == own  # every figure of the plan (the timeline apart, compared next)
        assert kept.timeline == own.timeline  # every event, size, part, peak and FLOP
    # The 8-bit optimizer's constructor reads values: its failure, and its rule's state, as alone.
    assert shared[2].timeline.optimizer_failure is not None
    assert len({plan.step.peak_bytes for plan in shared}) == len(OPTIMIZERS)


def trl_steps() -> Dict[str, Any]:
    from trainer_memcb.plan.step.grpo import GrpoStep
    from trainer_memcb.plan.step.kto import KtoStep
    from trainer_memcb.plan.step.preference import DpoStep
    from trainer_memcb.plan.step.sft import SftStep

    return {
        "dpo, the reference a model": dict(preference=DpoStep(reference="model")),
        "kto": dict(preference=KtoStep()),
        "sft": dict(preference=SftStep(max_length=32)),
        # TRL generates inside the accumulation: a second generation before the second micro-batch.
        "grpo, generating inside the accumulation": dict(
            preference=GrpoStep(num_generations=4, steps_per_generation=1, max_completion_length=8),
            gradient_accumulation_steps=2),
        "grpo, vllm, checkpointing, bf16": dict(
            preference=GrpoStep(use_vllm=True, num_generations=4, max_completion_length=8),
            gradient_checkpointing=True, precision="bf16"),
    }


def trl_model() -> torch.nn.Module:
    # Two layers: each step traced whole (the folded step's optimizer phases shared: test_layer_fold).
    with torch.device("meta"):
        return LlamaForCausalLM(trl_llama_config(max_position_embeddings=128))


@requires_torch("2.13", "an optimizer phase steps from a kept step only where it was checked equal to a trace of "
                "its own (torch 2.13 with transformers 5: trace._shares_optimizer_phases); older releases trace "
                "each step whole")
@requires_transformers("5.0", "an optimizer phase steps from a kept step only with transformers 5 "
                       "(trace._shares_optimizer_phases)")
@requires_version("trl", "1.16", "TRL's fused LM heads, which the DPO, KTO and SFT steps are planned with")
@pytest.mark.parametrize("case", list(trl_steps()))
def test_a_trl_step_with_another_optimizer_steps_from_the_shared_step_as_a_trace_of_its_own(monkeypatch, case):
    """DPO (its reference model alive), KTO, SFT and GRPO (its generations in the step) keep their
    step up to the optimizer phase as the Trainer's does: Adafactor stepped from AdamW's kept step
    gives the timeline of its own trace, to the event."""
    flags = trl_steps()[case]

    def planned() -> List[Any]:
        return [plan_step_memory(trl_model, seq_len=16, device_type="cuda", model_states=False, settings=resolve_settings(
            batch_size=4, optimizer=name, device_type="cuda", **flags))[0] for name in ("adamw_torch", "adafactor")]

    with trace.counting_flops():
        alone = planned()
    counts = counting_traces(monkeypatch)
    with trace.sharing_traces(), trace.counting_flops():
        shared = planned()
    assert counts == {"traced": 1, "optimizer steps shared": 1}
    for own, kept in zip(alone, shared):
        assert kept.step.problem is None
        assert kept == own and kept.timeline == own.timeline
    assert shared[0].step.peak_bytes != shared[1].step.peak_bytes


@requires_torch("2.13", "torch 2.6's fake process group has no fake kernel for c10d._allgather_base_, which FSDP2 "
                "gathers with (the plan then says the step cannot run under fake tensors); 2.13's has")
def test_an_engine_with_state_of_its_own_traces_each_optimizer_whole(monkeypatch):
    flags = {"world_size": 2, "sharding": "fsdp-full-shard"}
    counts = counting_traces(monkeypatch)
    with trace.sharing_traces():
        first, second = [plan_step_memory(build, seq_len=32, model_states=False, device_type="cuda",
                                          settings=resolve_settings(batch_size=4, optimizer=name, **flags))[0]
                         for name in ("adamw_torch", "adafactor")]
    assert counts == {"traced": 2, "optimizer steps shared": 0}
    assert first.step.problem is None and second.step.problem is None, (first.step.problem, second.step.problem)
    assert first.step.peak_bytes != second.step.peak_bytes


@requires_torch("2.13", "an optimizer phase steps from a kept step only where it was checked equal to a trace of "
                "its own (torch 2.13 with transformers 5: trace._shares_optimizer_phases); older releases trace "
                "each step whole")
@requires_transformers("5.0", "an optimizer phase steps from a kept step only with transformers 5 "
                       "(trace._shares_optimizer_phases)")
def test_estimate_fit_traces_each_forward_and_backward_once(monkeypatch):
    """The golden tiny Llama at batch 2 x 16 on 446 MiB: nothing fits (the CUDA context and the
    caching allocator's 20 MiB blocks leave no room); the search plans Liger's kernels, checkpointing,
    the three leaner optimizers, the expandable segments, the batch 1 x 2 alone and with
    checkpointing, and that with Adafactor. The own step and the allocator's option share one trace
    and the three optimizers step from it; Liger's kernels, checkpointing, the batch 1 x 2 and the
    batch 1 x 2 with checkpointing are traced, and Adafactor steps from the last: 5 traces, 4
    optimizer phases."""
    from trainer_memcb.cli import main

    counts = counting_traces(monkeypatch)
    model = os.path.join(REPO_ROOT, "tests", "data", "golden", "tiny-llama")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        main(["estimate", model, "--batch-size", "2", "--seq-len", "16", "--device-memory", "446MiB", "--fit"])
    assert counts == {"traced": 5, "optimizer steps shared": 4}, out.getvalue()[-2000:]


@requires_torch("2.13", "an optimizer phase steps from a kept step only where it was checked equal to a trace of "
                "its own (torch 2.13 with transformers 5: trace._shares_optimizer_phases); older releases trace "
                "each step whole")
@requires_transformers("5.0", "an optimizer phase steps from a kept step only with transformers 5 "
                       "(trace._shares_optimizer_phases)")
def test_search_fits_traces_each_forward_and_backward_once(monkeypatch):
    """batch 8 x 32 on 3,000,000 bytes: the own step (4,746,144 bytes on the newest releases) does not fit; of the 8 proposals
    (checkpointing, the three leaner optimizers, the batches 4 x 2 and 2 x 4, each with checkpointing
    too) the optimizers step from the own step's trace: 6 traces for 9 plans."""
    from trainer_memcb.plan.answers.fit import search_fits, step_planner

    own = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "optim": "adamw_torch",
           "gradient_checkpointing": False, "max_grad_norm": 1.0, "bf16": False, "fp16": False}
    counts = counting_traces(monkeypatch)
    found = search_fits(step_planner(build, 32, device_type="cpu"), own, 3_000_000, device_type="cpu",
                        max_candidates=8)
    assert len(found.candidates) == 8
    assert counts == {"traced": 6, "optimizer steps shared": 3}
    own_alone = plan_step_memory(build, seq_len=32, settings=resolve_settings(own, world_size=1),
                                 device_type="cpu", model_states=False)[0]
    assert found.own.peak_bytes == own_alone.step.peak_bytes > 3_000_000
    adafactor = next(c for c in found.candidates if c.changes == {"optim": "adafactor"})
    alone = plan_step_memory(build, seq_len=32, settings=resolve_settings(adafactor.training_args, world_size=1),
                             device_type="cpu", model_states=False)[0]
    assert adafactor.plan == alone and adafactor.plan.timeline.events == alone.timeline.events


def test_the_device_s_memory_the_reserve_the_allocator_and_a_gpu_of_the_same_capability_trace_nothing_new(
        monkeypatch: Any) -> None:
    counts = counting_traces(monkeypatch)
    base = resolve_settings(batch_size=4, seq_len=32, optimizer="adamw_torch")
    with trace.sharing_traces():
        first, _ = plan_step_memory(build, base, model_states=False)
        others = [plan_step_memory(build, base, model_states=False, **flags)[0] for flags in (
            {"device_memory": 2**30}, {"device_memory": 2**30, "reserve_bytes": 2**20},
            {"alloc_conf": "expandable_segments:True"}, {"gpu": "a100-40gb"}, {"gpu": "a100-80gb"})]
        assert counts == {"traced": 1, "optimizer steps shared": 0}
        # A GPU of another compute capability (the H100s 9.0, the default and the A100s 8.0) runs
        # other attention kernels: a step of its own.
        plan_step_memory(build, base, model_states=False, gpu="h100")
        assert counts == {"traced": 2, "optimizer steps shared": 0}
    assert all(plan.step.peak_bytes == first.step.peak_bytes for plan in others)
    assert [plan.verdict.fits for plan in others[:2]] == [True, True]
    assert others[1].verdict.margin_bytes == others[0].verdict.margin_bytes - 2**20


_FIRST_AND_SECOND_PLAN = """
import sys
sys.path.insert(0, {tests!r})
import torch
from transformers import LlamaForCausalLM
from helpers import tiny_llama_config
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings

def build():
    with torch.device("meta"):
        return LlamaForCausalLM(tiny_llama_config("sdpa", vocab_size=256, max_position_embeddings=32))

for _ in range(2):
    plan = plan_step_memory(build, seq_len=32, settings=resolve_settings(batch_size=4, optimizer="adamw_bnb_8bit"),
                            device_type="cuda", model_states=False)[0]
    print(plan.device.allocator_allocated_peak_bytes, len(plan.timeline.events))
from torch._subclasses.fake_tensor import FakeTensor
print(sorted(name for name, module in list(sys.modules.items())
             for value in list(getattr(module, "__dict__", {{}}).values()) if isinstance(value, FakeTensor)))
"""


def test_the_first_plan_of_a_process_counts_no_tensor_its_optimizers_import_makes():
    # In a fresh process (the suite's has imported bitsandbytes already): bitsandbytes 0.50's
    # `bitsandbytes.optim`, imported by the Trainer's handler inside the first trace, made two
    # storages there, 1,024 bytes of the first plan's allocated peak and in no later plan's.
    pytest.importorskip("bitsandbytes")
    import subprocess
    import sys

    tests = os.path.join(REPO_ROOT, "tests")
    result = subprocess.run([sys.executable, "-c", _FIRST_AND_SECOND_PLAN.format(tests=tests)], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    first, second, fake_globals = result.stdout.split("\n")[-4:-1]
    assert first == second
    assert fake_globals == "[]"  # no library imported during the trace keeps a fake tensor of it
