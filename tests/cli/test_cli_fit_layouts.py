"""`--fit` with several processes proposes tensor parallelism beside ZeRO and FSDP2: each layout
planned as `--parallelism` plans it (the plan itself held against real torchrun runs in
tests/training/test_tensor_parallel_runs.py), the effective batch kept, ranked with its
collectives' cost, and written as the accelerate config that launches it."""

from __future__ import annotations

import json

import pytest

from helpers import run_estimate, tiny_llama_folder

pytestmark = pytest.mark.slow  # about 16 tiny traces per --fit: over a minute here

# Two processes of one node of H100s, bf16: a Llama of 2 layers of 4 heads, 4 x 32 tokens each.
COMMON = ["--optimizers", "adamw_torch", "--seq-len", "32", "--precision", "bf16", "--gpu", "h100"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-layouts")


@pytest.fixture(scope="module")
def fit(llama_dir, tmp_path_factory) -> dict:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from trainer_memcb.cli import main

    folder = tmp_path_factory.mktemp("layouts-written")
    out, err = io.StringIO(), io.StringIO()
    written = {"training_args": str(folder / "args.json"), "accelerate": str(folder / "accelerate.yaml")}
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["estimate", llama_dir, *COMMON, "--batch-size", "4", "--world-size", "2", "--device-memory",
                     "1GiB", "--fit", "--json", "--write-training-args", written["training_args"],
                     "--write-accelerate-config", written["accelerate"]])
    return {"code": code, "document": json.loads(out.getvalue()), "err": err.getvalue(), "written": written}


def _layout_candidate(document: dict) -> dict:
    """The tensor-parallel proposal (an H100 in bf16 also takes context parallelism's, on cuDNN's ring:
    tests/cli/test_cli_fit_context_parallel.py)."""
    found = [c for c in document["answers"]["fit"]["candidates"]
             if c["changes"].get("parallelism", "").startswith("tp=")]
    assert len(found) == 1, [c["changes"] for c in document["answers"]["fit"]["candidates"]]
    return found[0]


def test_tensor_parallelism_is_proposed_with_the_effective_batch_kept(fit, llama_dir, capsys):
    assert fit["code"] == 0
    own = fit["document"]["answers"]["fit"]["own"]
    candidate = _layout_candidate(fit["document"])
    # Both processes share each batch under tp=2: twice the micro-batches keep the 8 samples a step.
    assert candidate["changes"] == {"parallelism": "tp=2", "per_device_train_batch_size": 4,
                                    "gradient_accumulation_steps": 2}
    assert candidate["training_args"]["parallelism_config"] == {"tp_size": 2, "dp_shard_size": 1,
                                                                "dp_replicate_size": 1, "cp_size": 1}
    assert "deepspeed" not in candidate["training_args"] and "fsdp" not in candidate["training_args"]
    assert candidate["effective_batch"] == own["effective_batch"] == 8
    # The layout planned as --parallelism plans it: the same figures to the byte.
    code, out, _ = run_estimate([llama_dir, *COMMON, "--batch-size", "4", "--gradient-accumulation-steps", "2",
                                 "--world-size", "2", "--parallelism", "tp=2", "--device-memory", "1GiB", "--json"],
                                capsys)
    direct = json.loads(out)
    assert code == 0
    assert (direct["step"]["peak_bytes"], direct["device"]["reserved_peak_bytes"]) == (
        candidate["peak_bytes"], candidate["reserved_peak_bytes"])


def test_the_layouts_step_time_counts_its_collectives(fit):
    from trainer_memcb.plan.answers.fit_comm import ModelShape, communication_seconds, links_of

    candidate = _layout_candidate(fit["document"])
    own = fit["document"]["answers"]["fit"]["own"]
    # What the ranking read: the own (DDP) and the layout's seconds, each its FLOPs' time and fixed
    # costs plus its collectives at NVLink's rate; recomputed here from the plan's own figures.
    from trainer_memcb.plan.answers.fit_cost import step_seconds

    values = (64 * 256 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 256 * 64)  # the tiny Llama's parameters
    shape = ModelShape(64, 2, 256, 32, 2)
    links = links_of("H100", 2, 1)

    def seconds(entry: dict) -> float:
        args = entry["training_args"]
        return (step_seconds(entry["step_flops"], entry["micro_batches"], 0, "cuda")
                + communication_seconds(args, None, 2, values * 2, values * 2, shape, links))

    assert candidate["relative_step_time"] == round(seconds(candidate) / seconds(own), 4)
    assert candidate["relative_step_time"] > 1  # two micro-batches, and activations sent per layer
    # A rank multiplies its shards: the FLOPs of a micro-batch of the same 4 rows are about half
    # (the counter sees the whole DTensor shapes; the plan divides them by tp).
    assert own["step_flops"] * 0.45 < candidate["step_flops"] < own["step_flops"] * 0.55


def test_the_written_files_launch_and_plan_the_written_setting(fit, llama_dir, capsys):
    from accelerate.commands.config.config_args import load_config_from_file

    document, written = fit["document"], fit["written"]
    # The own setting fits: it is what is written, and DDP needs no accelerate config.
    own = document["answers"]["fit"]["own"]
    assert document["answers"]["fit"]["fits_as_is"] is True
    with open(written["training_args"]) as handle:
        assert json.load(handle) == own["training_args"]
    assert f"{written['accelerate']} not written: your own setting uses neither FSDP2 nor tensor parallelism" in fit["err"]
    # The layout's own accelerate config, as accelerate reads it.
    from trainer_memcb.cli.accelerate_config import accelerate_config_of, accelerate_config_text

    candidate = _layout_candidate(document)
    path = written["accelerate"] + ".layout.yaml"
    with open(path, "w") as handle:
        handle.write(accelerate_config_text(accelerate_config_of(candidate["training_args"], 2, 1), path))
    config = load_config_from_file(path)
    assert (config.distributed_type.value, config.num_processes, config.num_machines) == ("FSDP", 2, 1)
    # --precision bf16 is the model loaded in bf16: no mixed precision to ask accelerate for.
    assert config.mixed_precision == "no" and config.fsdp_config["fsdp_version"] == 2
    assert config.parallelism_config == {"parallelism_config_dp_replicate_size": 1,
                                         "parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 2,
                                         "parallelism_config_cp_size": 1}
    # The TrainingArguments JSON of the layout, given back, plans the proposal's figure.
    args_path = written["accelerate"] + ".layout.json"
    with open(args_path, "w") as handle:
        json.dump(candidate["training_args"], handle)
    code, out, _ = run_estimate([llama_dir, *COMMON, "--world-size", "2", "--training-args", args_path,
                                 "--device-memory", "1GiB", "--json"], capsys)
    assert code == 0 and json.loads(out)["step"]["peak_bytes"] == candidate["peak_bytes"]


def test_a_model_whose_heads_do_not_split_gets_no_layout(tmp_path_factory, capsys):
    odd = tiny_llama_folder(tmp_path_factory, "tiny-llama-3-heads", hidden_size=48, num_attention_heads=3,
                            num_key_value_heads=3)
    code, out, _ = run_estimate([odd, *COMMON, "--batch-size", "4", "--world-size", "2", "--device-memory", "1GiB",
                                 "--fit", "--json", "--max-proposals", "16"], capsys)
    changes = [c["changes"] for c in json.loads(out)["answers"]["fit"]["candidates"]]
    # No tensor parallelism; context parallelism splits the sequence, not the heads.
    assert code == 0 and changes and [c["parallelism"] for c in changes if "parallelism" in c] == ["cp=2"]


def test_an_own_layout_is_kept_and_data_parallel_proposals_keep_its_effective_batch(llama_dir, capsys):
    code, out, _ = run_estimate([llama_dir, *COMMON, "--batch-size", "4", "--world-size", "4", "--parallelism",
                                 "tp=2,dp_shard=2", "--device-memory", "1GiB", "--fit", "--json"], capsys)
    fit = json.loads(out)["answers"]["fit"]
    assert code == 0 and fit["own"]["training_args"]["parallelism_config"]["tp_size"] == 2
    assert fit["own"]["effective_batch"] == 8  # 4 samples on each of the 2 data-parallel groups
    zero = [c for c in fit["candidates"] if c["changes"].get("deepspeed") == "DeepSpeed ZeRO-1"]
    assert len(zero) == 1
    # On 4 data-parallel processes the 8 samples are 2 a process.
    assert zero[0]["changes"]["per_device_train_batch_size"] == 2
    assert zero[0]["effective_batch"] == 8 and "parallelism_config" not in zero[0]["training_args"]
