"""`trainer-memcb estimate ... --batch-size B --seq-len S`: the step plan on the command line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from helpers import made_step_plan, rotary_buffers_beyond_transformers_5s, tiny_llama_folder

from trainer_memcb.cli import main
from trainer_memcb.plan.answers.step_memory import StepMemoryPlan, plan_step_memory
from trainer_memcb.plan.answers.max_batch import max_batch_size
from trainer_memcb.plan.model.trainer_model import reentrant_by_default
from trainer_memcb.plan.optimizers.whatif import build_meta_model


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return tiny_llama_folder(tmp_path_factory, "tiny-llama", vocab_size=128)


def run_json(argv, capsys, expected_code=0):
    assert main(argv) == expected_code
    return json.loads(capsys.readouterr().out)


def test_the_step_plan_on_the_command_line_is_the_python_plan(tiny_llama_dir, capsys):
    document = run_json(["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "4", "--seq-len",
                         "16", "--attn-implementation", "eager", "--device-memory", "428MiB", "--reserve", "0B", "--json"],
                        capsys, expected_code=3)  # 3: it does not fit
    step, settings, device, answers = (document[key] for key in ("step", "settings", "device", "answers"))
    plan, _ = plan_step_memory(lambda: build_meta_model(tiny_llama_dir, torch.float32), batch_size=4, seq_len=16,
                               attn_implementation="eager", optimizer="adamw_torch", model_states=False)
    assert step["activations_bytes"] == plan.step.activations_bytes == 708872
    assert step["peak_bytes"] == plan.step.peak_bytes
    assert sum(step["peak_parts"].values()) == step["peak_bytes"]
    assert (settings["attn_implementation"], settings["device_type"], settings["traced_on"]) == ("eager", "cuda", "cpu")
    # Fits? is answered from the step's peak, not from the model states, which would fit: the
    # model states carry no answer of their own beside it.
    states = document["model_states"]["optimizers"][0]
    assert states["model_states_bytes"] == 1578068 and states["fits"] is None and states["margin_bytes"] is None
    assert document["model_states"]["device_memory_bytes"] is None
    # 428 MiB less the CUDA context (426 MiB) leaves 2 MiB for the allocator: the step's blocks and
    # the cuBLAS workspaces, replayed, need more (does not fit; the margin from the reserved peak).
    assert answers["fits"] is False and answers["margin_bytes"] == 2 * 1024 ** 2 - device["reserved_peak_bytes"] < 0
    assert device["reserve_bytes"] == 0 and device["cuda_context_bytes"] == 426 * 1024 ** 2


def test_the_activations_alive_at_a_peak_in_backward_are_a_part_of_it(tiny_llama_dir):
    # On the CPU (AdamW's single-tensor loop, no foreach intermediates) the peak of this step is in
    # backward, at the loss's log_softmax, where two logits-sized fp32 gradients (4 x 16 x 128 x 4
    # bytes each) are alive: every activation saved in forward is alive then but the loss's last
    # ones, whose nodes have run: the shifted labels (4 x 16 int64, 512 bytes), nll_loss's
    # total_weight and the num_items_in_batch divisor (4 bytes each).
    plan, _ = plan_step_memory(lambda: build_meta_model(tiny_llama_dir, torch.float32), batch_size=4, seq_len=16,
                               attn_implementation="eager", optimizer="adamw_torch", model_states=False,
                               device_type="cpu")
    assert (plan.step.peak_phase, plan.step.activations_bytes) == ("backward", 708872)
    assert plan.step.peak_parts["activations"] == 708872 - 512 - 4 - 4
    assert plan.step.peak_parts["other"] == 2 * 4 * 16 * 128 * 4 + 12
    assert sum(plan.step.peak_parts.values()) == plan.step.peak_bytes


def test_tables_say_what_was_traced_and_where(tiny_llama_dir, capsys):
    assert main(["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "8",
                 "--gradient-checkpointing", "--attn-implementation", "sdpa"]) == 0
    out = capsys.readouterr().out
    assert "attention traced" in out and "sdpa" in out
    assert "cuda (traced on fake cpu tensors)" in out
    # Without keywords, as the installed transformers checkpoints (reentrant in 4.x).
    assert f"on ({'reentrant' if reentrant_by_default() else 'non-reentrant'})" in out
    assert "fp32 (parameters in float32)" in out
    assert "Alive at the step's peak" in out


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_training_args_checkpointing_keywords_reach_the_trace(tiny_llama_dir, tmp_path, capsys, reentrant):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"gradient_checkpointing": True, "per_device_train_batch_size": 4,
                                "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}))
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--training-args", str(path), "--seq-len", "16",
            "--attn-implementation", "sdpa", "--device-type", "cpu"]
    document = run_json(argv + ["--json"], capsys)
    step = document["step"]
    assert document["settings"]["checkpointing_kwargs"] == {"use_reentrant": reentrant}
    # Reentrant checkpointing holds 21,440 bytes more at this step's peak in backward: each block's
    # recomputed forward keeps its saved tensors until the block's own backward has run (16,384), where
    # the non-reentrant one frees each as it is unpacked, and each block's context keeps its CPU
    # generator state until then (5,056). Both held to real steps in tests/plan/test_step_memory.py.
    assert step["peak_bytes"] == (1822368 if reentrant else 1800928) + rotary_buffers_beyond_transformers_5s(
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama_dir)))
    assert main(argv) == 0
    assert f"on ({'reentrant' if reentrant else 'non-reentrant'})" in capsys.readouterr().out


def test_without_batch_size_the_command_is_unchanged(tiny_llama_dir, capsys):
    document = run_json(["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--json"], capsys)
    assert "step" not in document and "optimizers" in document


@pytest.mark.parametrize("argv,phrase", [
    (["--batch-size", "2"], "need --seq-len"),
    (["--max-batch-size", "--seq-len", "8"], "--max-batch-size needs --device-memory"),
    (["--batch-size", "0", "--seq-len", "8"], "'0' is not a positive integer"),
    (["--batch-size", "2", "--seq-len", "8", "--device-type", "tpu"], "invalid choice: 'tpu'"),
    (["--batch-size", "2", "--seq-len", "8", "--world-size", "4", "--zero", "2", "--rank", "4"],
     "rank=4 is not a process of world_size=4: expected 0 to 3"),
    (["--batch-size", "2", "--seq-len", "8", "--rank", "-1"], "argument --rank: '-1' is not a whole number of at least 0"),
    (["--world-size", "4", "--zero", "2", "--rank", "1"], "--rank has no effect without --batch-size"),
])
def test_bad_step_options_get_one_line_and_an_exit_code(tiny_llama_dir, capsys, argv, phrase):
    code = main(["estimate", tiny_llama_dir, *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert phrase in err
    assert "Traceback" not in err


def test_a_model_fake_tensors_cannot_run_gets_one_line_and_the_model_states(tmp_path, capsys):
    # Dynamic NTK rope scaling compares the largest position with the cached length: a value read.
    # (Mixtral, once the example here, is planned now: see tests/plan/test_step_families.py.)
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    document = run_json(["estimate", str(tmp_path), "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len",
                         "8", "--json"], capsys, expected_code=5)  # 5: the step cannot be traced
    assert document["step"]["problem"].startswith("the step cannot run under fake tensors (")
    assert document["step"]["activations_bytes"] is None and document["step"]["peak_bytes"] is None
    assert document["model_states"]["optimizers"][0]["model_states_bytes"] > 0
    # The search says why, never "no batch fits".
    assert main(["estimate", str(tmp_path), "--optimizers", "adamw_torch", "--max-batch-size", "--seq-len", "8",
                 "--device-memory", "80GiB"]) == 5  # 5: the step cannot be traced
    out = capsys.readouterr().out
    assert "No largest batch: at batch 1 the step cannot run under fake tensors (DataDependentOutputException: " \
           "aten._local_scalar_dense.default); only the model states are planned" in out
    assert "No batch fits" not in out


def _plan(batch: int, peak: int, activations_peak: int) -> StepMemoryPlan:
    return made_step_plan(batch, peak, activations_peak_bytes=activations_peak)


@pytest.mark.parametrize("memory,expected", [(999, None), (1000, 6), (1100, 11), (1234, 17), (10**6, 500)])
def test_max_batch_size_finds_the_largest_batch_of_a_convex_peak(memory, expected):
    # A constant optimizer-step peak (1000) and a forward/backward peak of 900 + 20 per sample beyond
    # batch 1: the first batches sit on the flat part and cannot tell the slope.
    traced = []

    def plan_at(batch: int) -> StepMemoryPlan:
        traced.append(batch)
        return _plan(batch, max(1000 + 20 * (batch - 1) - (100 if batch > 1 else 0), 1000), 15 * batch)

    found, plans = max_batch_size(plan_at, memory, limit=500)
    peak = lambda b: max(1000 + 20 * (b - 1) - (100 if b > 1 else 0), 1000)  # noqa: E731
    brute = max((b for b in range(1, 501) if peak(b) <= memory), default=None)
    assert found == brute == expected
    assert len(traced) == len(set(traced)) <= 12
    assert [p.settings.batch_size for p in plans] == sorted(traced)


def test_sharded_setups_trace_the_peak_at_one_moment(tiny_llama_dir):
    build = lambda: build_meta_model(tiny_llama_dir, torch.float32)  # noqa: E731
    whole, _ = plan_step_memory(build, batch_size=4, seq_len=16, attn_implementation="eager", optimizer="adamw_torch",
                                model_states=False)
    plan, states = plan_step_memory(build, batch_size=4, seq_len=16, attn_implementation="eager", optimizer="adamw_torch",
                                    world_size=4, sharding="zero3", precision="deepspeed-bf16")
    row = states.optimizers[0]
    # Activations do not depend on the sharding (the trace in 16 bits saves half of fp32's floats).
    assert plan.step.activations_bytes is not None and plan.step.activations_bytes < whole.step.activations_bytes
    assert plan.settings.engine == "zero"
    parts = plan.step.peak_parts
    # The peak is one moment of the traced timeline: its parts sum to it, never a swap of parts.
    assert sum(parts.values()) == plan.step.peak_bytes
    # DeepSpeed's own states, alive through the step, agree with the model-states plan.
    assert (parts["optimizer_state"], parts["master_weights"]) == (row.optimizer_state_bytes, row.master_weights_bytes)
    assert not any(note.startswith("peak composed") for note in plan.step.notes)


def test_a_reference_model_is_alive_through_the_step(tiny_llama_dir, capsys):
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "8",
            "--attn-implementation", "eager", "--json"]
    plain = run_json(argv, capsys)["step"]
    document = run_json(argv + ["--reference-model"], capsys)
    reference = document["model_states"]["optimizers"][0]["reference_model_bytes"]
    assert reference == 394496  # the tiny Llama's fp32 parameters, once more
    assert document["step"]["peak_parts"]["reference_model"] == reference
    assert document["step"]["peak_bytes"] == plain["peak_bytes"] + reference
    assert sum(document["step"]["peak_parts"].values()) == document["step"]["peak_bytes"]


def test_loras_adapter_dtype_is_the_same_with_and_without_the_step_plan(tiny_llama_dir, capsys):
    common = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--dtype", "bfloat16", "--lora-r", "4",
              "--device-memory", "80GiB", "--json"]
    states = run_json(common, capsys)["optimizers"][0]
    with_step = run_json([*common, "--batch-size", "1", "--seq-len", "8"], capsys)
    [row] = with_step["model_states"]["optimizers"]
    # PEFT keeps the adapters in float32 over a bfloat16 base: 4 bytes per value for the gradients
    # and 8 (+ a 4-byte step per tensor) for AdamW's state, of the adapters (q_proj and v_proj,
    # rank 4, hidden 64, 2 layers: 2,048 values in 8 tensors), the same in both tables and the step.
    assert row["grads_bytes"] == states["grads_bytes"] == 2048 * 4
    assert row["optimizer_state_bytes"] == states["optimizer_state_bytes"] == 2 * 2048 * 4 + 8 * 4
    assert with_step["step"]["peak_parts"]["optimizer_state"] == 2 * 2048 * 4 + 8 * 4


def test_qlora_on_the_command_line_is_the_python_plan(tiny_llama_dir, capsys):
    pytest.importorskip("bitsandbytes")
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.model.quantized import Quantization

    document = run_json(["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--lora-r", "4", "--load-in-4bit",
                         "--bnb-4bit-use-double-quant", "--batch-size", "2", "--seq-len", "16", "--json"], capsys)
    plan, _ = plan_step_memory(lambda: add_lora_adapters(build_meta_model(tiny_llama_dir, torch.float32), 4, None),
                               batch_size=2, seq_len=16, optimizer="adamw_torch", model_states=False, keep_dtypes=True,
                               quantization=Quantization(double_quant=True))
    step = document["step"]
    assert (step["activations_bytes"], step["peak_bytes"]) == (plan.step.activations_bytes, plan.step.peak_bytes)
    [note] = [note for note in step["notes"] if "loaded in 4-bit" in note]
    assert note.startswith("14 linear layers loaded in 4-bit (nf4, double quantization)")


def test_8bit_loading_on_the_command_line_is_the_python_plan(tiny_llama_dir, capsys):
    pytest.importorskip("bitsandbytes")
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.model.quantized import Quantization

    document = run_json(["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--lora-r", "4", "--load-in-8bit",
                         "--batch-size", "2", "--seq-len", "16", "--json"], capsys)
    plan, _ = plan_step_memory(lambda: add_lora_adapters(build_meta_model(tiny_llama_dir, torch.float32), 4, None),
                               batch_size=2, seq_len=16, optimizer="adamw_torch", model_states=False, keep_dtypes=True,
                               quantization=Quantization(bits=8))
    step = document["step"]
    assert step["problem"] is None
    assert (step["activations_bytes"], step["peak_bytes"]) == (plan.step.activations_bytes, plan.step.peak_bytes)
    [note] = [note for note in step["notes"] if "loaded in 8-bit" in note]
    assert note.startswith("14 linear layers loaded in 8-bit (LLM.int8)")


@pytest.mark.parametrize("flags,message", [
    (["--load-in-8bit", "--load-in-4bit"], "--load-in-8bit and --load-in-4bit: give one"),
    (["--load-in-8bit", "--bnb-4bit-use-double-quant"],
     "--bnb-4bit-use-double-quant is an option of --load-in-4bit, not of --load-in-8bit"),
    (["--load-in-4bit", "--llm-int8-threshold", "4"], "--llm-int8-threshold is an option of --load-in-8bit"),
    (["--load-in-8bit", "--llm-int8-threshold", "-1"], "--llm-int8-threshold -1.0: expected a number of at least 0"),
])
def test_mixed_quantization_options_are_refused_in_one_line(tiny_llama_dir, capsys, flags, message):
    code = main(["estimate", tiny_llama_dir, *flags, "--batch-size", "2", "--seq-len", "16"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_zero2_on_several_processes_answers_for_the_fuller_of_the_first_and_last_rank(tiny_llama_dir, tmp_path, capsys):
    # Each ZeRO-1/2 rank's partition keeps other gradients; the last rank's holds the head, whose
    # gradient is reduced first in backward, so its partition lives beside backward's activations.
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    base = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
            "--world-size", "4", "--deepspeed", str(config), "--device-type", "cpu", "--json"]
    first, last = (run_json(base + ["--rank", str(rank)], capsys)["step"] for rank in (0, 3))
    document = run_json(base, capsys)
    default = document["step"]
    assert last["peak_bytes"] > first["peak_bytes"]
    assert default["peak_bytes"] == last["peak_bytes"]
    used = {name: (value, source) for name, value, source in document["settings"]["used"]}
    assert used["rank"] == (3, "default: the fuller of ranks 0 and 3")
    assert "rank 3 holds the most of ranks 0 and 3 at its peak (rank 0 " in " ".join(default["notes"])
    assert f"({first['peak_bytes']:,})" in " ".join(default["notes"])


def test_the_step_command_gives_one_fits_answer_the_steps(tiny_llama_dir, capsys):
    """The model states alone (1,578,068 bytes) would fit in 1,800,000 (a CPU device: no CUDA
    context to take from so little); the step does not: the output says so once, and the model-states table has no fits? column to say otherwise."""
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "4", "--seq-len", "16",
            "--attn-implementation", "eager", "--device-type", "cpu", "--device-memory", "1800000B", "--reserve", "0B"]
    assert main(argv) == 3
    out = capsys.readouterr().out
    assert re.findall(r"to spare|short", out) == ["short"]
    states_table = out[out.index("Model states plan for"):]
    assert "fits" not in states_table and "device memory" not in states_table
    # Without a step verdict (no --device-memory) neither plan answers.
    assert main(argv[:-4]) == 0
    assert re.findall(r"to spare|short", capsys.readouterr().out) == []


def test_the_settings_table_names_a_flags_source_and_writes_whole_numbers_whole(tiny_llama_dir, tmp_path, capsys):
    """--zero 2 over a config file's stage 1 is the flag's; a DeepSpeed config's 5e8 (a JSON
    float) and --bucket-cap-mb 10 are shown as the whole numbers they are."""
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}')
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "1", "--seq-len", "8",
            "--world-size", "2", "--device-type", "cpu"]
    assert main(argv + ["--zero", "2", "--deepspeed", str(ds)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["zero.stage", "2", "flag"] in rows
    assert ["zero.reduce_bucket_size", "500,000,000", "deepspeed", "config"] in rows
    assert main(argv + ["--sharding", "ddp", "--bucket-cap-mb", "10"]) == 0
    assert ["bucket_cap_mb", "10", "flag"] in [line.split() for line in capsys.readouterr().out.splitlines()]


def test_beside_a_step_the_model_states_table_does_not_call_the_traced_parts_not_counted(tiny_llama_dir, capsys):
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "1", "--seq-len", "8",
            "--device-type", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    states_title = next(line for line in out.splitlines() if line.startswith("Per process, the most each state holds"))
    assert states_title.endswith(". The activations and temporaries are in the step's peak above")
    assert "Not counted: activations" not in out and "activations (saved for backward)" in out
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_states"]["not_counted"] == (
        "the CUDA context, allocator fragmentation (the activations and temporaries are in the step plan's peak)")


def test_a_training_args_dump_made_with_use_cpu_plans_the_device_asked_for(tiny_llama_dir, tmp_path, capsys):
    """The guide's recipe (docs/step-memory.md): TrainingArguments(bf16=True) is refused on a
    machine without a bf16 GPU, so the dump is made with use_cpu=True; the plan reads bf16 from it,
    and neither use_cpu nor the machine decides the device: --device-type does (CUDA by default)."""
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path / "plan"), bf16=True, use_cpu=True, per_device_train_batch_size=4,
                             gradient_accumulation_steps=8, report_to=[])
    (tmp_path / "training_args.json").write_text(args.to_json_string())
    document = run_json(["estimate", tiny_llama_dir, "--training-args", str(tmp_path / "training_args.json"),
                         "--seq-len", "8", "--optimizers", "adamw", "--json"], capsys)
    settings = document["settings"]
    assert (settings["device_type"], settings["precision"], settings["batch_size"]) == ("cuda", "autocast-bf16", 4)
    used = {name: (value, source) for name, value, source in settings["used"]}
    assert used["gradient_accumulation_steps"] == (8, "training args")
    assert "use_cpu" not in used and used["fsdp_cpu_offload"] == (False, "default")
