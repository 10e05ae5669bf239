"""`--fit` proposes context parallelism beside ZeRO, FSDP2 and tensor parallelism: the layout planned
as `--parallelism cp=2` plans it (tests/plan/test_context_parallel.py checks that plan), the
effective batch kept, ranked with its ring's bytes (tests/plan/test_fit_context_parallel.py counts
them), written as the accelerate config that launches it; and `--fit` beside an own CP layout."""

from __future__ import annotations

import json

import pytest

from helpers import requires_torch, run_estimate, tiny_llama_folder

# Two --fit searches of a dozen tiny traces or fewer: about 12 s here.
pytestmark = requires_torch("2.13", "torch's ring attention package and the fake process group's collectives")

# Two processes (an A100 each, the plan's default GPU: flash for the ring), bf16 weights, SDPA.
COMMON = ["--optimizers", "adamw_torch", "--seq-len", "64", "--precision", "bf16", "--device-memory", "1GiB"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-cp-fit")


@pytest.fixture(scope="module")
def fit(llama_dir) -> dict:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from trainer_memcb.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        # The budget reaches the layouts (liger, checkpointing, 3 optimizers, 4 ZeRO, FSDP2, tp, cp).
        code = main(["estimate", llama_dir, *COMMON, "--batch-size", "2", "--world-size", "2", "--fit", "--json",
                     "--max-proposals", "12"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())["answers"]["fit"]


def _meta_llama():
    """The tiny Llama of these tests (SDPA) on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _cp_candidate(fit: dict) -> dict:
    found = [c for c in fit["candidates"] if c["changes"].get("parallelism", "").startswith("cp=")]
    assert len(found) == 1, [c["changes"] for c in fit["candidates"]]
    return found[0]


def test_context_parallelism_is_proposed_planned_as_the_layout_is(fit, llama_dir, capsys):
    candidate = _cp_candidate(fit)
    # Both processes share each row's tokens under cp=2: twice the micro-batches keep the 4 samples.
    assert candidate["changes"] == {"parallelism": "cp=2", "per_device_train_batch_size": 2,
                                    "gradient_accumulation_steps": 2}
    assert candidate["training_args"]["parallelism_config"] == {"tp_size": 1, "dp_shard_size": 1,
                                                                "dp_replicate_size": 1, "cp_size": 2}
    assert candidate["effective_batch"] == fit["own"]["effective_batch"] == 4
    code, out, _ = run_estimate([llama_dir, *COMMON, "--batch-size", "2", "--gradient-accumulation-steps", "2",
                                 "--parallelism", "cp=2", "--json"], capsys)
    direct = json.loads(out)
    assert code == 0 and direct["settings"]["engine"] == "cp-fsdp2"
    assert (direct["step"]["peak_bytes"], direct["device"]["reserved_peak_bytes"]) == (
        candidate["peak_bytes"], candidate["reserved_peak_bytes"])
    # A rank's tensors are its 32 of the 64 tokens: a micro-batch's FLOPs about half the own's.
    assert fit["own"]["step_flops"] * 0.4 < candidate["step_flops"] < fit["own"]["step_flops"] * 0.55


def test_the_cp_proposal_s_step_time_counts_its_ring_and_fsdp2(fit):
    from trainer_memcb.plan.answers.fit_comm import ModelShape, communication_seconds, links_of
    from trainer_memcb.plan.answers.fit_cost import step_seconds

    values = 115_008  # the tiny Llama's parameters (tests/plan/test_engines.py's NUMEL)
    shape = ModelShape(64, 2, 256, 64, 2, kv_width=64)
    links = links_of(None, 2, 1)

    def seconds(entry: dict) -> float:
        return (step_seconds(entry["step_flops"], entry["micro_batches"], 0, "cuda")
                + communication_seconds(entry["training_args"], None, 2, values * 2, values * 2, shape, links))

    candidate = _cp_candidate(fit)
    assert candidate["relative_step_time"] == round(seconds(candidate) / seconds(fit["own"]), 4)


def test_the_cp_layout_s_accelerate_config_as_accelerate_reads_it(fit, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from trainer_memcb.cli.accelerate_config import accelerate_config_of, accelerate_config_text

    path = str(tmp_path / "cp.yaml")
    with open(path, "w") as handle:
        handle.write(accelerate_config_text(accelerate_config_of(_cp_candidate(fit)["training_args"], 2, 1), path))
    config = load_config_from_file(path)
    assert (config.distributed_type.value, config.num_processes, config.fsdp_config["fsdp_version"]) == ("FSDP", 2, 2)
    assert config.parallelism_config == {"parallelism_config_dp_replicate_size": 1,
                                         "parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 1,
                                         "parallelism_config_cp_size": 2}


def test_fit_beside_an_own_cp_layout_keeps_it_and_its_effective_batch(llama_dir, capsys):
    code, out, err = run_estimate([llama_dir, *COMMON, "--batch-size", "2", "--parallelism", "cp=2,dp_shard=2",
                                   "--fit", "--json", "--max-proposals", "8"], capsys)
    assert code == 0, err
    fit = json.loads(out)["answers"]["fit"]
    assert fit["own"]["training_args"]["parallelism_config"]["cp_size"] == 2
    assert fit["own"]["effective_batch"] == 4  # 2 samples on each of the 2 dp_shard groups
    zero = [c for c in fit["candidates"] if c["changes"].get("deepspeed") == "DeepSpeed ZeRO-1"]
    # On 4 data-parallel processes the 4 samples are 1 a process.
    assert len(zero) == 1 and zero[0]["changes"]["per_device_train_batch_size"] == 1
    assert zero[0]["effective_batch"] == 4 and "parallelism_config" not in zero[0]["training_args"]


@pytest.mark.parametrize("flags, sizes", [
    # 8 processes, 64 tokens: each cp dividing 8 whose 2 x cp divides 64.
    (dict(), [2, 4, 8]),
    (dict(seq_len=40), [2, 4]),  # 40 does not divide by 16
    # An H100 or H200 (cuDNN above 9.15) takes cuDNN's kernel for the ring's turns, which the plan traces.
    (dict(gpu="h100"), [2, 4, 8]),
    (dict(gpu="h200", seq_len=40), [2, 4]),
    (dict(precision="autocast-bf16"), []),  # fp32 weights under autocast: the ring is not planned there
    # float32 and a T4 in fp16 take memory-efficient, whose ring runs where L / (2 x cp) divides by 32.
    (dict(precision="fp32"), []),
    (dict(precision="fp32", seq_len=128), [2]),
    (dict(precision="fp16", gpu="t4", seq_len=256), [2, 4]),
    (dict(precision="bf16", gpu="t4", seq_len=256), []),  # math: a T4 runs no fused kernel in bf16
    (dict(device_type="cpu"), []),
    (dict(attn_implementation="eager"), []),  # the Trainer runs CP with SDPA only
])
def test_the_cp_sizes_proposed_where_the_plan_and_accelerate_take_them(flags, sizes):
    from trainer_memcb.cli.fit_table import context_parallel_sizes
    from trainer_memcb.plan.settings import resolve_settings

    model = _meta_llama()
    settings = resolve_settings(**dict(dict(world_size=8, batch_size=2, seq_len=64, precision="bf16",
                                            device_type="cuda"), **flags))
    assert context_parallel_sizes(model, settings) == sizes


@pytest.mark.slow  # a search of 16 proposals on four processes' layouts: half a minute here
def test_tp_beside_cp_is_proposed_on_four_processes_as_the_layout_plans(llama_dir, capsys):
    """On four processes `--fit` proposes tp=2 and cp=2 together (accelerate's mesh: dp_shard, cp, tp),
    planned as `--parallelism tp=2,cp=2` plans it; its rank's FLOPs the own step's over both."""
    code, out, err = run_estimate([llama_dir, *COMMON, "--batch-size", "2", "--world-size", "4", "--fit", "--json",
                                   "--max-proposals", "16"], capsys)
    assert code == 0, err
    fit = json.loads(out)["answers"]["fit"]
    [candidate] = [c for c in fit["candidates"] if c["changes"].get("parallelism") == "tp=2,cp=2"]
    # Four processes share each row: four micro-batches of 2 keep the 8 samples of the own step.
    assert candidate["changes"] == {"parallelism": "tp=2,cp=2", "per_device_train_batch_size": 2,
                                    "gradient_accumulation_steps": 4}
    assert candidate["training_args"]["parallelism_config"] == {"tp_size": 2, "dp_shard_size": 1,
                                                                "dp_replicate_size": 1, "cp_size": 2}
    assert candidate["effective_batch"] == fit["own"]["effective_batch"] == 8
    assert candidate["step_flops"] == fit["own"]["step_flops"] // 4
    code, out, _ = run_estimate([llama_dir, *COMMON, "--batch-size", "2", "--gradient-accumulation-steps", "4",
                                 "--world-size", "4", "--parallelism", "tp=2,cp=2", "--json"], capsys)
    direct = json.loads(out)
    assert code == 0 and direct["settings"]["engine"] == "tp-cp-fsdp2"
    assert (direct["step"]["peak_bytes"], direct["device"]["reserved_peak_bytes"]) == (
        candidate["peak_bytes"], candidate["reserved_peak_bytes"])
    # The installed `trainer-memcb` (its start keeps some packages out) proposes the same layout.
    from cli.test_console_script import run_script

    done = run_script("estimate", llama_dir, *COMMON, "--batch-size", "2", "--world-size", "4", "--fit", "--json",
                      "--max-proposals", "16")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    [scripted] = [c for c in json.loads(done.stdout)["answers"]["fit"]["candidates"]
                  if c["changes"].get("parallelism") == "tp=2,cp=2"]
    assert scripted == candidate


@pytest.mark.parametrize("step,shape,sizes", [
    ("sft", dict(), [2, 4, 8]),  # TRL's SFT on padded rows: planned under cp
    ("sft packing", dict(batch_size=1, packing=128), []),  # SFTTrainer refuses packing with cp
    ("dpo", dict(), []), ("kto", dict(), []), ("grpo", dict(), []),  # refused (check_context_parallel_step)
    (None, dict(batch_size=1, packing=128), []),  # padding-free packing: documents would attend across
])
def test_the_cp_sizes_proposed_beside_trl_s_steps_are_those_planned(step, shape, sizes):
    from trainer_memcb.cli.fit_table import context_parallel_sizes
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.step.grpo import GrpoStep
    from trainer_memcb.plan.step.kto import KtoStep
    from trainer_memcb.plan.step.preference import DpoStep
    from trainer_memcb.plan.step.sft import SftStep

    steps = {"sft": SftStep(max_length=64), "sft packing": SftStep(max_length=64, padding_free=True),
             "dpo": DpoStep(), "kto": KtoStep(), "grpo": GrpoStep(), None: None}
    model = _meta_llama()
    settings = resolve_settings(**dict(dict(world_size=8, batch_size=2, seq_len=64, precision="bf16",
                                            device_type="cuda", preference=steps[step]), **shape))
    assert context_parallel_sizes(model, settings) == sizes
