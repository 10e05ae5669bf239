"""`trainer-memcb estimate MODEL --trainer sft --training-args SFTCONFIG.json --parallelism cp=2,dp_shard=2`:
TRL's SFT step on padded rows planned per rank under context parallelism (tests/plan/test_sft_context_parallel.py
checks the plan's per-rank sizes), the steps TRL refuses under it one usage line each, and `--fit`
beside the own layout proposing another cp and no layout the SFT step is not planned with."""

from __future__ import annotations

import json
from typing import Any, List

import pytest

from helpers import requires_torch, requires_version, run_estimate, trl_config_files

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "SFTTrainer's fused LM head (add_fused_lm_head), whose step is planned"),
              requires_torch("2.13", "torch's ring attention package and the fake process group's collectives")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

# The tiny Llama of tests/plan/test_dpo_step.py, two rows of 32 tokens, 16 on each cp rank.
BATCH, MAX_LENGTH = 2, 32


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> dict:
    from trl import DPOConfig, SFTConfig

    paths = trl_config_files(tmp_path_factory, "sft-cp-cli", SFTConfig, BATCH, MAX_LENGTH,
                             {"sft": {}, "packing": {"packing": True},
                              "eval_packing": {"eval_packing": True}}, {})
    dpo = trl_config_files(tmp_path_factory, "dpo-cp-cli", DPOConfig, BATCH, MAX_LENGTH, {"dpo": {}}, {})
    paths["dpo"] = dpo["dpo"]
    return paths


def cp_argv(files: dict, config: str, *more: str, trainer: str = "sft") -> List[str]:
    return [files["model"], "--trainer", trainer, "--training-args", files[config], "--seq-len", str(MAX_LENGTH),
            "--device-type", "cuda", "--precision", "bf16", "--attn-implementation", "sdpa", "--batch-size",
            str(BATCH), *more]


def test_rank_0_s_sft_step_under_cp2_through_the_console_script(files: dict) -> None:
    """The installed `trainer-memcb` (its start keeps some packages out): rank 0's bytes below."""
    from cli.test_console_script import run_script

    run = run_script("estimate", *cp_argv(files, "sft", "--parallelism", "cp=2,dp_shard=2", "--rank", "0", "--json"))
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    assert json.loads(run.stdout)["step"]["peak_bytes"] == 2_297_408


@pytest.mark.parametrize("rank,peak", [(0, 2_297_408), (1, 2_293_312)])
def test_each_rank_s_sft_step_under_cp2_x_fsdp2(files: dict, capsys: Any, rank: int, peak: int) -> None:
    code, out, err = run_estimate(cp_argv(files, "sft", "--parallelism", "cp=2,dp_shard=2", "--rank", str(rank),
                                          "--json"), capsys)
    assert code == 0, err
    document = json.loads(out)
    used = {name: value for name, value, _ in document["settings"]["used"]}
    assert (used["cp_size"], used["world_size"], used["sharding"]) == (2, 4, "fsdp-full-shard")
    assert document["settings"]["engine"] == "cp-fsdp2"
    assert document["settings"]["preference"]["trainer"] == "sft"
    step = document["step"]
    # The fused head's tile on the rank's 2 x 16 tokens: 32 x 32,768 bf16 (TRL's chunk columns),
    # alive at the peak, in the backward.
    assert step["peak_phase"] == "backward" and step["peak_parts"]["other"] > 32 * 32_768 * 2
    # The plain cp step's pattern: rank 0 copies the merged attention output for o_proj, rank 1
    # does not (2 layers x [2, 16, 64] bf16 = 4,096 bytes here).
    assert step["peak_bytes"] == peak
    assert any(note.startswith("context parallel over 2 processes: each holds 16 of the 32 tokens")
               for note in step["notes"])


@pytest.mark.parametrize("config,trainer,line", [
    ("packing", "sft", "trainer-memcb: error: parallelism cp=2: TRL's SFTTrainer refuses packing with context "
                       "parallelism (\"context parallelism drops that mask, so documents would attend across their "
                       "boundaries\"); give packing and eval_packing false"),
    ("eval_packing", "sft", "trainer-memcb: error: parallelism cp=2: TRL's SFTTrainer refuses packing with context "
                            "parallelism (\"context parallelism drops that mask, so documents would attend across "
                            "their boundaries\"); give packing and eval_packing false"),
    ("dpo", "dpo", "trainer-memcb: error: parallelism cp=2: TRL's DPO batch has no labels and keeps completion_mask "
                   "whole (the Trainer shards only input_ids, labels, shift_labels, attention_mask, position_ids): "
                   "DPOTrainer's input_ids.masked_fill(completion_mask == 0, -100) meets L / cp tokens against L and "
                   "fails"),
])
def test_a_trl_step_refused_under_cp_is_one_usage_line(files: dict, capsys: Any, config: str, trainer: str,
                                                       line: str) -> None:
    code, _, err = run_estimate(cp_argv(files, config, "--parallelism", "cp=2,dp_shard=2", trainer=trainer), capsys)
    assert code == 2 and "Traceback" not in err
    lines = [each for each in err.splitlines() if each.strip()]
    assert lines[-1] == line and len(lines) <= 2  # argparse's usage, then the one line


def test_fit_beside_the_sft_cp_layout_proposes_cp4_and_no_layout_sft_is_not_planned_with(files: dict,
                                                                                          capsys: Any) -> None:
    code, out, err = run_estimate(cp_argv(files, "sft", "--parallelism", "cp=2,dp_shard=2", "--fit", "--json",
                                          "--device-memory", "1GiB", "--max-proposals", "12"), capsys)
    assert code == 0, err
    fit = json.loads(out)["answers"]["fit"]
    changes = [candidate["changes"] for candidate in fit["candidates"]]
    # No ZeRO, plain FSDP2 or DDP layout: the SFT step is planned beside processes under cp only.
    assert not any(key in change for change in changes for key in ("zero", "fsdp", "deepspeed"))
    [candidate] = [c for c in fit["candidates"] if c["changes"].get("parallelism") == "cp=4"]
    # Four processes share each row (8 tokens each): two micro-batches keep the own step's 4 samples.
    assert candidate["changes"] == {"parallelism": "cp=4", "per_device_train_batch_size": 2,
                                    "gradient_accumulation_steps": 2}
    assert candidate["effective_batch"] == fit["own"]["effective_batch"] == 4
    code, out, _ = run_estimate(cp_argv(files, "sft", "--parallelism", "cp=4", "--gradient-accumulation-steps", "2",
                                        "--json"), capsys)
    direct = json.loads(out)
    assert code == 0 and direct["settings"]["engine"] == "cp-fsdp2"
    assert direct["step"]["peak_bytes"] == candidate["peak_bytes"] == 1_229_920
