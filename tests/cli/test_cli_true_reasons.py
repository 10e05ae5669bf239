"""`trainer-memcb estimate`: every refusal names the real cause and what is allowed (exit 2 for a
flag, 1 for a config file), and no setting given is dropped or misread."""

from __future__ import annotations

import json
from typing import Any, List

import pytest
from transformers import GPT2Config

from helpers import SMALLEST_LLAMA, made_step_plan, one_line, smallest_llama, requires_torch, run_estimate, tiny_llama_folder


llama = smallest_llama


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: Any) -> str:
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-reasons", **SMALLEST_LLAMA)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory: Any) -> str:
    folder = tmp_path_factory.mktemp("tiny-gpt2-reasons")
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    return str(folder)


run = run_estimate


def write_json(path: Any, value: Any) -> str:
    path.write_text(json.dumps(value))
    return str(path)


# -- 4: the real cause, not "cannot run under fake tensors" -----------------------------------------


@pytest.mark.parametrize("plan", [["--batch-size", "2"], ["--eval-samples", "4"]])
def test_an_unknown_attention_implementation_is_named_with_the_allowed_ones(tiny_llama_dir: str, capsys: Any,
                                                                           plan: List[str]) -> None:
    code, _, err = run([tiny_llama_dir, "--seq-len", "8", "--attn-implementation", "bogus"] + plan, capsys)
    line = one_line(err)
    assert code == 2
    assert "--attn-implementation 'bogus' is not one of transformers' attention implementations: give one of " \
           "eager, " in line and "sdpa" in line and "fake tensors" not in line


@pytest.mark.parametrize("plan", [["--batch-size", "2"], ["--eval-samples", "4"]])
def test_a_config_with_no_token_is_a_bad_config(tmp_path: Any, capsys: Any, plan: List[str]) -> None:
    llama(vocab_size=0).save_pretrained(tmp_path)
    code, _, err = run([str(tmp_path), "--seq-len", "8"] + plan, capsys)
    assert one_line(err) == ("trainer-memcb: LlamaForCausalLM's config has vocab_size=0: a model of token inputs "
                             "needs at least 1 token (its ids are 0 to vocab_size - 1)")
    assert code == 1


@pytest.mark.parametrize("plan", [["--batch-size", "2"], ["--eval-samples", "4"]])
def test_a_length_past_a_learned_position_table_names_the_table(tiny_gpt2_dir: str, capsys: Any,
                                                                plan: List[str]) -> None:
    code, _, err = run([tiny_gpt2_dir, "--seq-len", "65"] + plan, capsys)
    assert one_line(err) == ("trainer-memcb: error: --seq-len 65 is past GPT2LMHeadModel's 64 positions (n_positions "
                             "in its config; its learned position table transformer.wpe has no row beyond): give at most 64")
    assert code == 2
    code, out, _ = run([tiny_gpt2_dir, "--seq-len", "64", "--json"] + plan, capsys)
    assert code == 0


def test_rotary_positions_have_no_such_bound(tiny_llama_dir: str, capsys: Any) -> None:
    # Llama's rotary embedding computes any position: a real run of 65 tokens runs (max_position_embeddings 64).
    code, out, _ = run([tiny_llama_dir, "--batch-size", "1", "--seq-len", "65", "--json"], capsys)
    assert code == 0 and json.loads(out)["step"]["problem"] is None


@pytest.mark.parametrize("size", ["-5", "NaN"])
def test_a_negative_or_nan_bucket_size_names_the_key(tiny_llama_dir: str, tmp_path: Any, capsys: Any, size: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": %s}}' % size)
    code, _, err = run([tiny_llama_dir, "--batch-size", "2", "--seq-len", "8", "--world-size", "2", "--deepspeed",
                        str(path)], capsys)
    assert one_line(err) == (f"trainer-memcb: deepspeed config: zero_optimization.reduce_bucket_size={float(size)!r}"
                             .replace("-5.0", "-5") + ": expected a whole number of at least 1, as "
                             "DeepSpeedZeroConfig's reduce_bucket_size field takes")
    assert code == 1


# -- 7: the evaluation plan ------------------------------------------------------------------------


def test_the_evaluation_plan_answers_fits_after_the_reserve(tiny_llama_dir: str, capsys: Any) -> None:
    # On the CPU: the device peak against the memory less the reserve (on CUDA the allocator replay
    # answers, inside the memory less the CUDA context and the reserve).
    argv = [tiny_llama_dir, "--eval-samples", "8", "--seq-len", "12", "--attn-implementation", "eager",
            "--device-type", "cpu", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    peak = json.loads(out)["answers"]["evaluation"]["device_peak_bytes"]
    # Memory for the peak and 1,000 bytes more: it fits with no reserve, not with a reserve of 1,001.
    code, out, _ = run(argv + ["--device-memory", f"{peak + 1000}B", "--reserve", "0B"], capsys)
    assert code == 0 and json.loads(out)["answers"]["evaluation"]["fits_device"] is True
    code, out, _ = run(argv + ["--device-memory", f"{peak + 1000}B", "--reserve", "1001B"], capsys)
    evaluation = json.loads(out)["answers"]["evaluation"]
    assert code == 3
    assert (evaluation["fits_device"], evaluation["reserve_bytes"], evaluation["device_memory_bytes"]) == \
        (False, 1001, peak + 1000)
    # The default reserve is 0B: the memory alone answers.
    code, out, _ = run(argv + ["--device-memory", f"{peak + 1000}B"], capsys)
    assert code == 0 and json.loads(out)["answers"]["evaluation"]["reserve_bytes"] == 0


def test_an_evaluation_that_cannot_be_traced_exits_5_not_fits(tmp_path: Any, capsys: Any) -> None:
    # Dynamic NTK rope scaling compares the largest position with the cached length: a value read.
    llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).save_pretrained(tmp_path)
    code, out, _ = run([str(tmp_path), "--eval-samples", "8", "--seq-len", "12", "--device-memory", "80GiB",
                        "--json"], capsys)
    evaluation = json.loads(out)["answers"]["evaluation"]
    assert evaluation["problem"].startswith("the evaluation forward cannot run under fake tensors (")
    assert evaluation["fits_device"] is None
    assert code == 5


# -- 6: settings never dropped or misread ----------------------------------------------------------


@pytest.mark.parametrize("file_name,content,phrase", [
    ("args.json", {"per_device_train_batchsize": 4}, "did you mean 'per_device_train_batch_size'?"),
    ("args.json", {"bf16": True, "fp16": True}, "bf16 and fp16 are both true"),
    ("args.json", {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ("args.json", {"gradient_checkpointing": "false"}, "gradient_checkpointing='false' is a string"),
    ("ds.json", {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "bf16.enabled and fp16.enabled are both true"),
    ("ds.json", {"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}},
     "zero_optimization.reduce_bucket_size=-5: expected a whole number of at least 1"),
    ("fsdp.json", {"reshard_after_forward": "maybe"}, "reshard_after_forward='maybe': the Trainer reads it with str_to_bool"),
])
def test_a_config_file_value_the_trainer_refuses_is_one_line_and_exit_1(tiny_llama_dir: str, tmp_path: Any,
                                                                        capsys: Any, file_name: str, content: Any,
                                                                        phrase: str) -> None:
    option = {"args.json": "--training-args", "ds.json": "--deepspeed", "fsdp.json": "--fsdp-config"}[file_name]
    path = write_json(tmp_path / file_name, content)
    code, _, err = run([tiny_llama_dir, "--batch-size", "2", "--seq-len", "8", "--world-size", "2", option, path],
                       capsys)
    assert phrase in one_line(err) and code == 1


def test_the_evaluation_plans_training_args_refuse_a_typo_too(tiny_llama_dir: str, tmp_path: Any, capsys: Any) -> None:
    path = write_json(tmp_path / "args.json", {"per_device_eval_batchsize": 4})
    code, _, err = run([tiny_llama_dir, "--eval-samples", "8", "--seq-len", "8", "--training-args", path], capsys)
    assert "'per_device_eval_batchsize' is not a TrainingArguments field" in one_line(err) and code == 1


@requires_torch("2.13", "the FSDP2 plan needs torch 2.13's fake collectives (tests/plan/test_engines.py)")
def test_fsdp_yes_and_1_are_true_as_the_trainer_reads_them(tiny_llama_dir: str, tmp_path: Any, capsys: Any) -> None:
    path = write_json(tmp_path / "fsdp.json", {"reshard_after_forward": "yes", "cpu_offload": 1})
    code, out, _ = run([tiny_llama_dir, "--batch-size", "2", "--seq-len", "8", "--world-size", "4", "--fsdp-config",
                        path, "--json"], capsys)
    used = {name: value for name, value, _ in json.loads(out)["settings"]["used"]}
    assert code == 0
    assert (used["sharding"], used["reshard_after_forward"], used["fsdp_cpu_offload"]) == ("fsdp-full-shard", True, True)


@pytest.mark.parametrize("argv,phrase", [
    (["--eval-batch-size", "4"], "--eval-batch-size has no effect without --eval-samples (the evaluation plan)"),
    (["--eval-logits", "argmax"], "--eval-logits has no effect without --eval-samples"),
    (["--no-eval-concat"], "--no-eval-concat has no effect without --eval-samples"),
    (["--eval-accumulation-steps", "2"], "--eval-accumulation-steps has no effect without --eval-samples"),
    (["--eval-include-inputs"], "--eval-include-inputs has no effect without --eval-samples"),
    (["--host-memory", "64GiB"], "--host-memory has no effect without --eval-samples"),
    (["--device-memory", "0B"], "argument --device-memory: '0B' is no memory"),
    (["--batch-size", "2", "--seq-len", "8", "--load-in-8bit", "--llm-int8-threshold", "nan", "--lora-r", "4"],
     "--llm-int8-threshold nan: expected a number of at least 0"),
    (["--batch-size", "2", "--seq-len", "8", "--load-in-4bit"],
     "--load-in-4bit needs --lora-r: the Trainer refuses to train a purely quantized model"),
    (["--batch-size", "2", "--seq-len", "8", "--load-in-8bit"], "--load-in-8bit needs --lora-r"),
    (["--batch-size", "2", "--seq-len", "8", "--world-size", "2", "--sharding", "ddp", "--bucket-cap-mb", "nan"],
     "--bucket-cap-mb nan: expected a finite number of megabytes above 0"),
    (["--batch-size", "2", "--seq-len", "8", "--world-size", "2", "--sharding", "ddp", "--bucket-cap-mb", "-1"],
     "--bucket-cap-mb -1.0: expected a finite number of megabytes above 0"),
])
def test_a_flag_that_would_be_ignored_or_misread_is_one_line_and_exit_2(tiny_llama_dir: str, capsys: Any,
                                                                        argv: List[str], phrase: str) -> None:
    code, _, err = run([tiny_llama_dir] + argv, capsys)
    assert phrase in one_line(err) and code == 2


def test_qlora_on_gpt2_loads_its_conv1d_layers_in_4bit(tiny_gpt2_dir: str, capsys: Any) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    code, out, _ = run([tiny_gpt2_dir, "--batch-size", "2", "--seq-len", "8", "--load-in-4bit", "--lora-r", "4",
                        "--device-type", "cpu", "--json"], capsys)
    assert code == 0
    # c_attn, attn.c_proj, c_fc and mlp.c_proj of the one block: Conv1D layers, as transformers loads them.
    assert any(note.startswith("4 linear layers loaded in 4-bit (nf4)") for note in json.loads(out)["step"]["notes"])


def test_the_search_limit_is_said_as_at_least(tiny_llama_dir: str, capsys: Any) -> None:
    from trainer_memcb.cli.plan_table import step_tables
    from trainer_memcb.cli.step_answer import StepAnswer
    from trainer_memcb.plan.answers.max_batch import LargestBatch

    MAX_BATCH_SEARCH_LIMIT = 1_048_576  # the search goes no further

    code, out, _ = run([tiny_llama_dir, "--max-batch-size", "--seq-len", "8", "--device-memory", "1000TiB",
                        "--reserve", "0B", "--device-type", "cpu", "--json"], capsys)
    document = json.loads(out)
    assert code == 0
    largest = document["answers"]["largest_batch"]
    assert (largest["max_batch_size"], largest["is_search_limit"]) == (MAX_BATCH_SEARCH_LIMIT, True)
    assert largest["searched"][-1] == {"batch_size": MAX_BATCH_SEARCH_LIMIT, "peak_bytes":
                                       largest["searched"][-1]["peak_bytes"], "fits": True,
                                       "reserved_peak_bytes": None, "device_total_bytes": None}
    plan = made_step_plan(MAX_BATCH_SEARCH_LIMIT, 1, activations_peak_bytes=1, fits=True)
    found = StepAnswer(None, largest_batch=LargestBatch.of(MAX_BATCH_SEARCH_LIMIT, [plan]))
    [table] = step_tables(found)
    assert table.title == ("Largest per-device batch that fits: at least 1,048,576, the search's limit (it fits; no "
                           "larger batch was tried)")


def states(argv: List[str], capsys: Any) -> Any:
    code, out, err = run(argv + ["--optimizers", "adamw_torch", "--json"], capsys)
    assert code == 0, err
    document = json.loads(out)
    return document["setup"], document["optimizers"][0]


def test_the_model_states_plan_reads_the_deepspeed_config_without_batch_size(tiny_llama_dir: str, tmp_path: Any,
                                                                             capsys: Any) -> None:
    path = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    setup, row = states([tiny_llama_dir, "--deepspeed", path, "--world-size", "8"], capsys)
    assert (setup["sharding"], setup["precision"], setup["world_size"]) == ("zero3", "deepspeed-bf16", 8)
    _, flags_row = states([tiny_llama_dir, "--zero", "3", "--precision", "deepspeed-bf16", "--world-size", "8"], capsys)
    assert row == flags_row
    # 16,480 bf16 parameters in 8 ZeRO-3 partitions; fp32 master weights of the same partitions.
    assert (row["params_bytes"], row["master_weights_bytes"]) == (16480 * 2 // 8, 16480 * 4 // 8)
    # Alone, the config turns the what-if into the plan too (one process).
    setup, _ = states([tiny_llama_dir, "--deepspeed", path], capsys)
    assert (setup["sharding"], setup["world_size"]) == ("zero3", 1)


def test_the_world_size_a_deepspeed_batch_implies_is_taken_or_checked(tiny_llama_dir: str, tmp_path: Any,
                                                                      capsys: Any) -> None:
    path = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}, "train_batch_size": 32,
                                             "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    setup, _ = states([tiny_llama_dir, "--deepspeed", path], capsys)
    assert (setup["sharding"], setup["world_size"]) == ("zero2", 8)
    code, _, err = run([tiny_llama_dir, "--deepspeed", path, "--world-size", "4"], capsys)
    assert one_line(err) == ("trainer-memcb: deepspeed config: train_batch_size=32 is not "
                             "train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2 x world size 4: DeepSpeed "
                             "refuses it (\"Check batch related parameters\")")
    assert code == 1


def test_the_model_states_plan_reads_the_fsdp_config_and_replicate(tiny_llama_dir: str, tmp_path: Any,
                                                                    capsys: Any) -> None:
    path = write_json(tmp_path / "fsdp.json", {"reshard_after_forward": "no"})
    setup, hsdp = states([tiny_llama_dir, "--fsdp-config", path, "--world-size", "8", "--replicate", "2"], capsys)
    assert (setup["sharding"], setup["replicate"]) == ("fsdp-shard-grad-op", 2)
    # HSDP 2 x 4: each process holds a quarter, as plain FSDP over 4 processes does.
    _, four = states([tiny_llama_dir, "--sharding", "fsdp-shard-grad-op", "--world-size", "4"], capsys)
    _, eight = states([tiny_llama_dir, "--sharding", "fsdp-shard-grad-op", "--world-size", "8"], capsys)
    assert (hsdp["params_bytes"], hsdp["grads_bytes"], hsdp["optimizer_state_bytes"]) == \
        (four["params_bytes"], four["grads_bytes"], four["optimizer_state_bytes"])
    assert hsdp["params_bytes"] > eight["params_bytes"]


@pytest.mark.parametrize("argv,phrase", [
    (["--world-size", "8", "--replicate", "2", "--sharding", "ddp"],
     "replicate=2 is FSDP2's HSDP: use it with sharding fsdp-full-shard or fsdp-shard-grad-op, not 'ddp'"),
    (["--world-size", "8", "--replicate", "3", "--sharding", "fsdp-full-shard"], "replicate=3 does not divide world_size=8"),
    (["--bucket-cap-mb", "50"], "--bucket-cap-mb has no effect without --batch-size or --max-batch-size"),
    (["--gradient-as-bucket-view"], "--gradient-as-bucket-view has no effect without --batch-size or --max-batch-size"),
])
def test_replicate_and_ddp_flags_where_they_would_be_ignored_are_refused(tiny_llama_dir: str, capsys: Any,
                                                                         argv: List[str], phrase: str) -> None:
    code, _, err = run([tiny_llama_dir] + argv, capsys)
    assert phrase in one_line(err) and code == 2
