"""`trainer-memcb estimate ... --parallelism cp=2,dp_shard=2`: the context-parallel step plan per rank
on the command line (tests/plan/test_context_parallel.py checks the plan), each refusal one usage
line."""

from __future__ import annotations

import json

import pytest

from helpers import requires_torch, tiny_llama_folder

from trainer_memcb.cli import main


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    # The tiny Llama of tests/plan/test_engines.py.
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-cp", max_position_embeddings=2048)


STEP = ["--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "64", "--precision", "bf16"]


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
@pytest.mark.parametrize("rank,peak", [(0, 1_103_152), (3, 1_090_352)])
def test_each_rank_s_cp2_x_fsdp2_step_in_the_json(tiny_llama_dir, capsys, rank, peak):
    code = main(["estimate", tiny_llama_dir, *STEP, "--parallelism", "cp=2,dp_shard=2", "--rank", str(rank),
                 "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    used = {name: (value, source) for name, value, source in document["settings"]["used"]}
    assert used["cp_size"] == (2, "flag") and used["world_size"] == (4, "flag") and used["rank"][0] == rank
    assert used["sharding"] == ("fsdp-full-shard", "flag") and used["cp_comm_strategy"][0] == "allgather"
    assert document["settings"]["engine"] == "cp-fsdp2"
    step = document["step"]
    # tests/plan/test_context_parallel.py's cp=2 plans with FSDP2's shards halved again (57,504 bytes
    # of parameters, 115,092 of optimizer state fewer): a cp rank 0 (ranks 0, 2) or 1 (ranks 1, 3).
    assert step["peak_bytes"] == peak
    assert step["model_states_at_optimizer_step_bytes"]["parameters"] == 57_504


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
def test_without_rank_each_cp_rank_s_step_is_shown(tiny_llama_dir, capsys):
    # Each cp rank runs its own turns of torch's ring: ranks 0 and 2 (cp rank 0), 1 and 3 (cp rank 1),
    # the figures of the test above; the plan's own figures the fuller's.
    code = main(["estimate", tiny_llama_dir, *STEP, "--parallelism", "cp=2,dp_shard=2", "--json"])
    assert code == 0
    step = json.loads(capsys.readouterr().out)["step"]
    assert [(group["ranks"], group["peak_bytes"]) for group in step["rank_groups"]] == [
        ([0, 2], 1_103_152), ([1, 3], 1_090_352)]
    assert step["peak_bytes"] == 1_103_152


@pytest.mark.parametrize("argv,phrase", [
    (["--parallelism", "cp=2", "--device-type", "cpu"], "cp=2 on device_type 'cpu': torch's ring attention runs"),
    (["--parallelism", "cp=2", "--seq-len", "30"], "the sequence must divide by 2 x cp = 4"),
    (["--parallelism", "cp=2", "--zero", "2"], "accelerate runs context parallelism beside FSDP2 only"),
    (["--parallelism", "cp=2", "--attn-implementation", "eager"], "runs context parallelism with SDPA attention only"),
])
def test_a_cp_layout_the_plan_refuses_is_one_usage_line(tiny_llama_dir, capsys, argv, phrase):
    code = main(["estimate", tiny_llama_dir, *STEP, *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert phrase in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2  # argparse's usage, then the one line


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
def test_cp_beside_tp_is_planned_on_accelerate_s_mesh(tiny_llama_dir, capsys):
    code = main(["estimate", tiny_llama_dir, *STEP, "--parallelism", "tp=2,cp=2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    document = json.loads(out)
    assert document["settings"]["engine"] == "tp-cp-fsdp2"
    # tests/plan/test_fit_context_parallel.py's hand count: the tp_plan's layers over tp x cp, the
    # norms over cp (114,688 / 4 + 320 / 2 bf16 values).
    assert document["step"]["model_states_at_optimizer_step_bytes"]["parameters"] == 57_664


@requires_torch("2.13", "torch's ring attention package and the fake process group's collectives FSDP2 runs")
def test_the_cp_plan_through_the_console_script(tiny_llama_dir):
    """The installed `trainer-memcb`, whose start keeps some packages out: the ring's hooks come from
    accelerate, the same bytes as above."""
    from cli.test_console_script import run_script

    done = run_script("estimate", tiny_llama_dir, *STEP, "--parallelism", "cp=2,dp_shard=2", "--rank", "0", "--json")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    document = json.loads(done.stdout)
    assert (document["settings"]["engine"], document["step"]["peak_bytes"]) == ("cp-fsdp2", 1_103_152)
