"""A step of N identical layers folded from its steps of 1, 2 and 3 (`trainer_memcb.plan.step.layer_fold`):
the timeline the fold writes is the one a trace of all N layers gives, field for field (every event,
size, part, phase peak with its storages and saved ones, position, FLOP and note), across optimizers,
precisions, checkpointing, accumulation and a peak that moves as layers are added; where the layers
differ, or the logs do not fold, the step is traced whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import TRANSFORMERS_4, installed_version, requires_version, tiny_llama_config, trl_llama_config
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step import layer_fold, trace
from trainer_memcb.plan.step.live_storages import LiveStorages


def llama(layers: int, **overrides) -> LlamaForCausalLM:
    config = tiny_llama_config("sdpa", **{"vocab_size": 256, "max_position_embeddings": 2048,
                                          "num_hidden_layers": layers, **overrides})
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def traced(monkeypatch, model, fold: bool, device_type: str = "cuda", batch_size: int = 2, seq_len: int = 16,
           **given):
    """The step's timeline, folded or traced whole, and the outcome of each fold tried (True: folded)."""
    folds = []
    real = layer_fold.fold

    def spy(recorded, layers):
        found = real(recorded, layers)
        folds.append(found is not None)
        return found

    monkeypatch.setattr(layer_fold, "fold", spy)
    monkeypatch.setattr(trace, "FOLD_LAYERS", [fold])
    settings = resolve_settings(batch_size=batch_size, seq_len=seq_len, device_type=device_type, **given)
    timeline = trace.trace_step(model, settings, args=None, step_dtype=torch.float32)
    monkeypatch.undo()
    return timeline, folds


CASES = {
    "adamw, cuda": dict(optimizer="adamw_torch"),
    "checkpointing": dict(optimizer="adamw_torch", gradient_checkpointing=True),
    "accumulation 3": dict(optimizer="adamw_torch", gradient_accumulation_steps=3),
    "sgd, cpu": dict(optimizer="sgd", device_type="cpu"),
    "adafactor, autocast-bf16": dict(optimizer="adafactor", precision="autocast-bf16"),
    "adamw, bf16": dict(optimizer="adamw_torch", precision="bf16"),
    "liger's kernels": dict(optimizer="adamw_torch", use_liger_kernel=True),
}


# On torch 2.6 (the oldest allowed) checkpointing's logs do not fold: one reference names, in the
# logs of 2 and 3 layers, two different storages outside the blocks, which no rule over the copies
# names; the step is traced whole there.
OLD_TORCH = (installed_version("torch") or (0,)) < (2, 13)


@pytest.mark.parametrize("given", CASES.values(), ids=CASES.keys())
def test_the_folded_step_is_the_step_traced_whole(monkeypatch, given):
    folded, folds = traced(monkeypatch, llama(5), True, **given)
    whole, none = traced(monkeypatch, llama(5), False, **given)
    assert folds == [not (OLD_TORCH and given.get("gradient_checkpointing"))] and none == []
    assert dataclasses.asdict(folded) == dataclasses.asdict(whole)
    assert folded.forward_backward.bytes == whole.forward_backward.bytes > 0


def test_sixteen_layers_with_a_wide_vocabulary_fold_to_the_step_traced_whole(monkeypatch):
    # Thirteen copies of each block written from logs of one, two and three layers.
    model = dict(vocab_size=8192)
    folded, folds = traced(monkeypatch, llama(16, **model), True, optimizer="adamw_torch", batch_size=1, seq_len=128)
    whole, _ = traced(monkeypatch, llama(16, **model), False, optimizer="adamw_torch", batch_size=1, seq_len=128)
    assert folds == [True]
    assert dataclasses.asdict(folded) == dataclasses.asdict(whole)
    # transformers 4.57's rotary embedding holds 32 bytes fewer (its `original_inv_freq` is the same tensor)
    assert (whole.forward_backward.bytes, len(whole.forward_backward.saved)) == (29011756 if TRANSFORMERS_4 else
                                                                                29011788, 280)


def test_layers_that_differ_are_not_folded(monkeypatch):
    model = llama(5)
    mlp = model.model.layers[3].mlp  # a narrower MLP in one layer
    hidden = mlp.up_proj.in_features
    mlp.gate_proj, mlp.up_proj = (torch.nn.Linear(hidden, 96, bias=False, device="meta") for _ in range(2))
    mlp.down_proj = torch.nn.Linear(96, hidden, bias=False, device="meta")
    assert layer_fold.layer_list(model) is None
    _, folds = traced(monkeypatch, model, True, optimizer="sgd")
    assert folds == []


def test_layer_types_that_differ_are_not_folded():
    model = llama(5)
    model.config.layer_types = ["full_attention", "sliding_attention"] * 2 + ["full_attention"]
    assert layer_fold.layer_list(model) is None


def test_a_model_of_three_layers_or_fewer_is_traced_whole(monkeypatch):
    _, folds = traced(monkeypatch, llama(3), True, optimizer="sgd")
    assert folds == []


def test_several_processes_are_traced_whole(monkeypatch):
    _, folds = traced(monkeypatch, llama(5), True, optimizer="sgd", world_size=2, sharding="ddp")
    assert folds == []


def test_with_layers_copies_the_first_layers_and_leaves_the_model_as_it_was():
    model = llama(5)
    small = layer_fold.with_layers(model, 2)
    assert len(small.model.layers) == 2 and small.config.num_hidden_layers == 2
    assert len(model.model.layers) == 5 and model.config.num_hidden_layers == 5
    assert small.model.layers[0] is not model.model.layers[0]


def _recorded(model, **given):
    settings = resolve_settings(batch_size=2, seq_len=16, device_type="cuda", **given)
    recorded = []
    for count in layer_fold.FOLDED_LAYERS:
        trace._RECORDING[0] = []
        try:
            timeline = trace._trace_step_once(layer_fold.with_layers(model, count), settings, args=None,
                                              step_dtype=torch.float32)
            recorded.append(layer_fold.Recorded(timeline, *trace._RECORDING[0][0]))
        finally:
            trace._RECORDING[0] = None
    return recorded


def test_logs_that_do_not_repeat_do_not_fold():
    recorded = _recorded(llama(5), optimizer="sgd")
    assert layer_fold.fold(recorded, 5) is not None
    # The third log with one storage counted twice the bytes: its blocks are not the second's.
    third = recorded[2]
    serial = next(token for token in third.tokens if isinstance(token, int) and token > 40)
    sizes = dict(third.timeline.sizes)
    sizes[serial] *= 2
    broken = layer_fold.Recorded(dataclasses.replace(third.timeline, sizes=sizes), third.tokens, third.labels,
                                 third.companions)
    assert layer_fold.fold([recorded[0], recorded[1], broken], 5) is None
    # A log that lost a token.
    cut = layer_fold.Recorded(third.timeline, third.tokens[:-1], third.labels, third.companions)
    assert layer_fold.fold([recorded[0], recorded[1], cut], 5) is None


def test_notes_fold_their_counts_and_keep_their_constants():
    def recorded(notes):
        timeline = dataclasses.replace(_EMPTY, notes=notes)
        return layer_fold.Recorded(timeline, [])

    logs = [recorded((f"rms_norm ({3 + 2 * n} calls), state 5,056 bytes",)) for n in range(3)]
    assert layer_fold._notes(logs, 1) == ("rms_norm (5 calls), state 5,056 bytes",)
    assert layer_fold._notes(logs, 31) == ("rms_norm (65 calls), state 5,056 bytes",)
    uneven = [recorded((f"{count} calls",)) for count in (1, 2, 4)]
    assert layer_fold._notes(uneven, 5) is None


_EMPTY = trace.Timeline(events=(), sizes={}, tags={}, groups={}, states={}, host_parts=(), step_start=0,
                        forward_backward=trace.PhasePeak("forward", 0, ()), optimizer_step=None,
                        state_resident=False, activations_bytes=0, activations_peak_bytes=0)


def test_the_tracker_logs_nothing_unless_asked():
    assert LiveStorages(keep_timeline=True).tokens is None
    tracker = LiveStorages(keep_timeline=True)
    tracker.keep_tokens()
    kept = torch.empty(4)
    with tracker:
        tracker.add(kept)
        tracker.reset_peak()
        tracker.phase = "forward"
        tracker.add(torch.empty(2))  # counted, then freed
        tracker.take("micro-batch")
    assert tracker.tokens == [0, ("c",), ("r",), ("p", "forward"), 1, ("c",), ~1, ("t", "micro-batch")]
    assert tracker.events == [0, 1, ~1]


@pytest.fixture(scope="module")
def five_layer_llama(tmp_path_factory) -> str:
    from helpers import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory, "five-layers", num_hidden_layers=5)


@pytest.mark.parametrize("extra", [["--lora-r", "4"], ["--lora-r", "4", "--load-in-4bit"]], ids=["lora", "qlora"])
def test_lora_and_qlora_plans_fold_to_the_plan_traced_whole(monkeypatch, five_layer_llama, extra):
    # PEFT's adapters in each layer, and bitsandbytes' 4-bit layers: the command's whole JSON the same.
    import contextlib
    import io

    from trainer_memcb.cli import main

    def planned(fold: bool):
        folds = []
        real = layer_fold.fold
        monkeypatch.setattr(layer_fold, "fold", lambda recorded, layers: folds.append(real(recorded, layers)) or folds[-1])
        monkeypatch.setattr(trace, "FOLD_LAYERS", [fold])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["estimate", five_layer_llama, "--batch-size", "2", "--seq-len", "16", "--json", *extra])
        monkeypatch.undo()
        return code, out.getvalue(), [found is not None for found in folds]

    code, folded, folds = planned(True)
    assert (code, folds) == (0, [True])
    assert (code, folded) == planned(False)[:2]


@pytest.mark.parametrize("second", ["sgd", "adafactor", "adamw_torch_fused"])
def test_another_optimizer_steps_from_the_folded_steps_kept_and_is_its_step_traced_whole(monkeypatch, second):
    # Inside `sharing_traces` the steps of 1, 2 and 3 layers are kept up to their optimizer phase:
    # another optimizer steps from each (no forward or backward again), and the three fold.
    wholes = {}
    for name in ("adamw_torch", second):
        wholes[name], _ = traced(monkeypatch, llama(5), False, optimizer=name)
    traces = []
    real = trace._trace_step_once
    monkeypatch.setattr(trace, "_trace_step_once", lambda *a, **k: traces.append(1) or real(*a, **k))
    with trace.sharing_traces():
        first = trace.trace_step(llama(5), resolve_settings(batch_size=2, seq_len=16, device_type="cuda",
                                                            optimizer="adamw_torch"), args=None, step_dtype=torch.float32)
        other = trace.trace_step(llama(5), resolve_settings(batch_size=2, seq_len=16, device_type="cuda",
                                                            optimizer=second), args=None, step_dtype=torch.float32)
    # The three of fewer layers, once; on the oldest releases, where no optimizer phase is shared
    # (`_shares_optimizer_phases`), once for each optimizer.
    assert len(traces) == (3 if trace._shares_optimizer_phases() else 6)
    assert dataclasses.asdict(first) == dataclasses.asdict(wholes["adamw_torch"])
    assert dataclasses.asdict(other) == dataclasses.asdict(wholes[second])


def _preference_step(preference, fold: bool, monkeypatch, **given):
    with torch.device("meta"):
        model = LlamaForCausalLM(trl_llama_config(num_hidden_layers=5))
    options = dict(dict(device_type="cpu", attn_implementation="sdpa"), **given)
    return traced(monkeypatch, model, fold, seq_len=32, optimizer="adamw_torch", preference=preference, **options)


@requires_version("trl", "1.16", "DPOTrainer's and KTOTrainer's fused LM head, whose steps are planned")
@pytest.mark.parametrize("step", ["dpo, the reference a model", "dpo, precomputed", "kto"])
def test_dpo_and_kto_steps_fold_to_their_steps_traced_whole(monkeypatch, step):
    from trainer_memcb.plan.step.kto import KtoStep
    from trainer_memcb.plan.step.preference import DpoStep

    preference = {"dpo, the reference a model": DpoStep(reference="model"),
                  "dpo, precomputed": DpoStep(reference="precomputed"), "kto": KtoStep()}[step]
    folded, folds = _preference_step(preference, True, monkeypatch)
    whole, _ = _preference_step(preference, False, monkeypatch)
    assert folds == [True]
    assert dataclasses.asdict(folded) == dataclasses.asdict(whole)


SFT_CASES = {
    "padded, nll": ("cpu", dict(max_length=32), dict(attn_implementation="sdpa")),
    "padding-free, checkpointing": ("cpu", dict(max_length=32, padding_free=True),
                                    dict(attn_implementation="sdpa", gradient_checkpointing=True)),
    "dft, liger's kernels": ("cpu", dict(max_length=32, loss_type="dft"),
                             dict(attn_implementation="sdpa", use_liger_kernel=True)),
    "padding-free, flash, bf16, cuda": ("cuda", dict(max_length=32, padding_free=True),
                                        dict(attn_implementation="flash_attention_2", precision="bf16")),
}


@requires_version("trl", "1.16", "SFTTrainer's fused LM head, whose step is planned")
@pytest.mark.parametrize("case", SFT_CASES)
def test_sft_steps_fold_to_their_steps_traced_whole(monkeypatch, case):
    from trainer_memcb.plan.step.sft import SftStep

    device_type, fields, given = SFT_CASES[case]
    step = SftStep(**fields)
    shape = dict(batch_size=1, packing=64) if step.padding_free else dict(batch_size=2)
    folded, folds = _preference_step(step, True, monkeypatch, device_type=device_type, **shape, **given)
    whole, _ = _preference_step(step, False, monkeypatch, device_type=device_type, **shape, **given)
    assert folds == [True]
    assert dataclasses.asdict(folded) == dataclasses.asdict(whole)


def test_grpo_and_rloo_steps_are_traced_whole():
    from trainer_memcb.plan.step.grpo import GrpoStep
    from trainer_memcb.plan.step.kto import KtoStep
    from trainer_memcb.plan.step.preference import DpoStep
    from trainer_memcb.plan.step.rloo import RlooStep
    from trainer_memcb.plan.step.sft import SftStep

    assert not any(trace._folds_trainer(step) for step in (GrpoStep(), RlooStep()))
    assert trace._folds_trainer(None)
    assert all(trace._folds_trainer(step) for step in (SftStep(max_length=32), DpoStep(), KtoStep()))


def test_a_folded_plan_of_five_layers_is_a_real_steps_peak(monkeypatch):
    # The folded plan against a real CPU step of the same five-layer Llama (the profiler's live
    # bytes after a first step), as tests/plan/test_step_memory.py holds the plans traced whole.
    from plan.test_step_memory import BATCH, SEQ, batch, profiled_peak
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.model.trainer_model import prepare_like_trainer

    folds = []
    real_fold = layer_fold.fold
    monkeypatch.setattr(layer_fold, "fold", lambda recorded, layers: folds.append(real_fold(recorded, layers)) or folds[-1])
    plan, _ = plan_step_memory(lambda: llama(5), batch_size=BATCH, seq_len=SEQ, attn_implementation="sdpa",
                               optimizer="adamw_torch", model_states=False, device_type="cpu")
    assert [found is not None for found in folds] == [True]
    torch.manual_seed(0)
    model = prepare_like_trainer(LlamaForCausalLM(tiny_llama_config("sdpa", vocab_size=256, max_position_embeddings=2048,
                                                                    num_hidden_layers=5)), gradient_checkpointing=False)
    start, above = profiled_peak(model, batch("llama"))
    # 4,591,372 bytes planned and profiled (4,591,340 with transformers 4.57's rotary buffers).
    assert plan.step.peak_bytes == start + above == (4591340 if TRANSFORMERS_4 else 4591372)
