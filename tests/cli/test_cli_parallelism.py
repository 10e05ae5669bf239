"""`trainer-memcb estimate ... --parallelism tp=2`: the tensor-parallel step plan per rank on the
command line, and each refusal one usage line."""

from __future__ import annotations

import json

import pytest

from helpers import requires_torch, requires_transformers, tiny_llama_folder

from trainer_memcb.cli import main


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    # The tiny Llama of tests/plan/test_engines.py, whose TP=2 plan a real run checks
    # (tests/training/test_tensor_parallel_runs.py).
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-tp", max_position_embeddings=2048)


STEP = ["--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16", "--device-type", "cpu"]


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_s_tp2_step_in_the_engines_json_shape(tiny_llama_dir, capsys, rank):
    code = main(["estimate", tiny_llama_dir, *STEP, "--parallelism", "tp=2", "--rank", str(rank), "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    used = {name: (value, source) for name, value, source in document["settings"]["used"]}
    assert used["tp_size"] == (2, "flag") and used["world_size"] == (2, "flag") and used["rank"][0] == rank
    assert document["settings"]["engine"] == "tp"
    step = document["step"]
    assert step["peak_bytes"] == 1_038_232  # tests/plan/test_tensor_parallel.py's, the real run's less 8
    assert step["model_states_at_optimizer_step_bytes"] == {"parameters": 230_656, "gradients": 263_424,
                                                           "optimizer_state": 461_396, "master_weights": 0}


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
@pytest.mark.parametrize("layout,world,replicate", [("tp=2,dp_shard=2", 4, 1), ("tp=2,dp_shard=2,dp_replicate=2", 8, 2)])
def test_tp_x_fsdp2_and_tp_x_hsdp(tiny_llama_dir, capsys, layout, world, replicate):
    code = main(["estimate", tiny_llama_dir, *STEP, "--parallelism", layout, "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    used = {name: (value, source) for name, value, source in document["settings"]["used"]}
    assert used["world_size"] == (world, "flag") and used["sharding"] == ("fsdp-full-shard", "flag")
    assert used["replicate"] == (replicate, "flag")
    assert document["settings"]["engine"] == "tp-fsdp2"
    # tests/plan/test_tensor_parallel.py's, each of the real four- and eight-process runs' reading: HSDP's
    # replicas hold what dp_shard alone holds.
    assert document["step"]["peak_bytes"] == 859_424
    assert "rank_groups" not in document["step"]


@pytest.mark.parametrize("argv,phrase", [
    (["--parallelism", "tp=2", "--world-size", "4"],
     "parallelism tp=2 multiplies to 2 processes, but world_size is 4: accelerate refuses"),
    (["--parallelism", "tp=3"], "the model's num_attention_heads=4 does not divide by 3 (each rank runs whole"),
    (["--parallelism", "tp=2,dp_shard=2", "--precision", "deepspeed-bf16"], "without DeepSpeed"),
    (["--parallelism", "tp=2", "--zero", "3"], "tensor parallelism is planned alone (world_size = tp) or with FSDP2"),
    (["--parallelism", "cp=2"], "cp=2 on device_type 'cpu': torch's ring attention runs CUDA's flash"),
    (["--parallelism", "tp=2,dp_replicate=2"], "accelerate does not compose DDP with TP"),
    (["--parallelism", "pp=2"], "argument --parallelism: parallelism 'pp=2': expected NAME=SIZE"),
])
def test_a_layout_the_plan_refuses_is_one_usage_line(tiny_llama_dir, capsys, argv, phrase):
    code = main(["estimate", tiny_llama_dir, *STEP, *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert phrase in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2  # argparse's usage, then the one line


def test_parallelism_without_the_step_plan_is_refused(tiny_llama_dir, capsys):
    assert main(["estimate", tiny_llama_dir, "--parallelism", "tp=2"]) == 2
    assert "--parallelism has no effect without --batch-size or --max-batch-size" in capsys.readouterr().err


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_the_training_args_parallelism_config_is_the_layout(tiny_llama_dir, tmp_path, capsys):
    # As `TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2)).to_json_string()` writes it.
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "optim": "adamw_torch", "parallelism_config": {
        "dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 2, "cp_size": 1, "cp_backend": "torch", "sp_size": 1,
        "sp_backend": "deepspeed", "tp_handler": {}, "cp_handler": None, "sp_handler": None}}))
    code = main(["estimate", tiny_llama_dir, "--training-args", str(args), "--seq-len", "16", "--device-type", "cpu",
                 "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    used = {name: (value, source) for name, value, source in document["settings"]["used"]}
    assert used["tp_size"] == (2, "training args (parallelism_config)") and used["world_size"][0] == 2
    assert document["step"]["peak_bytes"] == 1_038_232


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("layout,row", [("tp=2", "tensor parallel"),
                                        ("tp=2,dp_shard=2", "fsdp-full-shard x tensor parallel")])
def test_the_model_states_table_names_tensor_parallelism(tiny_llama_dir, capsys, layout, row):
    code = main(["estimate", tiny_llama_dir, *STEP, "--parallelism", layout])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("sharding ")]
    # The settings table's row first (the engine's sharding, from where it came), the model states' last.
    assert code == 0 and " ".join(lines[-1][1:]) == row


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
def test_an_uneven_mlp_width_beside_cp_shows_each_rank_s_step(tmp_path_factory, capsys):
    folder = tiny_llama_folder(tmp_path_factory, "tiny-llama-mlp-129", intermediate_size=129)
    code = main(["estimate", folder, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
                 "--device-type", "cuda", "--precision", "bf16", "--parallelism", "tp=2,cp=2", "--json"])
    assert code == 0
    step = json.loads(capsys.readouterr().out)["step"]
    # tests/plan/test_tensor_parallel.py's figures: each rank its own chunks and its own ring.
    assert [(group["ranks"], group["peak_bytes"]) for group in step["rank_groups"]] == [
        ([0], 478_992), ([1], 475_280), ([2], 476_368), ([3], 473_680)]
    assert step["peak_bytes"] == 478_992


@pytest.mark.parametrize("width,world,sizes", [
    (128, 4, [2, 4]),
    (129, 2, [2]),  # TP alone on both processes: planned per rank
    (129, 4, [2, 4]),  # tp=2 beside FSDP2 on the other two: planned per rank too
])
def test_fit_proposes_tp_for_an_uneven_mlp_width(width, world, sizes):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_memcb.cli.fit_table import tensor_parallel_sizes
    from trainer_memcb.plan.settings import resolve_settings

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=width, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
    assert tensor_parallel_sizes(model, resolve_settings(world_size=world, batch_size=2)) == sizes


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
def test_a_model_transformers_gives_no_plan_is_planned_with_the_supplied_one_and_says_how_to_run_it(tmp_path, capsys):
    from transformers import BertConfig

    from plan.test_supplied_tp_plans import BERT
    from trainer_memcb.plan.model.supplied_tp_plans import SUPPLIED_TP_PLANS

    BertConfig(architectures=["BertForSequenceClassification"], **BERT).save_pretrained(str(tmp_path))
    code = main(["estimate", str(tmp_path), "--optimizers", "adamw_torch", "--batch-size", "16", "--seq-len", "64",
                 "--device-type", "cpu", "--parallelism", "tp=2"])
    out = capsys.readouterr().out
    assert code == 0
    [note] = [line for line in out.splitlines() if "no tp_plan" in line]
    plan = {f"bert.{name}": style for name, style in SUPPLIED_TP_PLANS["bert"].items()}
    assert note == ("Note, transformers gives BertForSequenceClassification no tp_plan: planned with trainer_memcb's "
                    "(Megatron's split of each block, the rest whole on every rank), which a run applies as "
                    "from_pretrained(..., distributed_config=DistributedConfig(tp_plan=PLAN, tp_size=N)), PLAN = "
                    f"{json.dumps(plan, separators=(',', ':'))}.")
    assert "10,220,624" in out  # the step's peak (tests/plan/test_supplied_tp_plans.py)
