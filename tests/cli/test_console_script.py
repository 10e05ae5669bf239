"""`trainer-memcb` as installed: the console script next to this Python, in a process of its own.

`main()` called in the test process never meets what only the console script does (keeping peft
out of an estimate's start-up), so these tests run the installed script itself, from the
repository root, as a reader of the README would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from typing import List

import pytest

from helpers import requires_torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "trainer-memcb")
LLAMA = os.path.join("examples", "models", "llama-2-7b")


def run_script(*argv: str) -> subprocess.CompletedProcess:
    assert os.path.isfile(SCRIPT), f"{SCRIPT}: the console script is not installed (pip install -e .)"
    return subprocess.run([SCRIPT, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def readme_commands(program: str, command: str) -> List[List[str]]:
    """The `program command ...` lines of README.md's shell blocks, continuation lines joined."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    commands = []
    for block in re.findall(r"```(?:bash|console|shell|sh)\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            words = shlex.split(line, comments=True)
            if words[:2] == [program, command]:
                commands.append(words[2:])
    return commands


@pytest.mark.slow  # a 7B plan with LoRA through the console script: half a minute here
def test_lora_estimate_runs_through_the_console_script():
    # Before: the script kept peft out of every estimate, and this exited 2 ("need the peft package").
    done = run_script("estimate", LLAMA, "--lora-r", "16", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # PEFT's default for Llama: q_proj and v_proj in 32 layers, A (16 x 4096) and B (4096 x 16).
    assert (result["trainable_params"], result["trainable_tensors"]) == (32 * 2 * 2 * 16 * 4096, 128) == (8_388_608, 128)
    by_name = {entry["name"]: entry["estimate"]["num_bytes"] for entry in result["optimizers"]}
    assert by_name["adamw_torch"] == 8 * 8_388_608 + 4 * 128 == 67_109_376


@pytest.mark.parametrize("allow", ["lora", "qlora"])
def test_fit_may_propose_lora_through_the_console_script(allow):
    # --allow lora/qlora needs peft, which the script keeps out of an estimate that asks for no LoRA.
    done = run_script("estimate", os.path.join("tests", "data", "golden", "tiny-llama"), "--seq-len", "32",
                      "--device-type", "cpu", "--batch-size", "4", "--device-memory", "2MiB", "--reserve", "0B",
                      "--fit", "--allow", allow, "--json")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    changes = [candidate["changes"] for candidate in json.loads(done.stdout)["answers"]["fit"]["candidates"]]
    assert {"lora_r": 16, **({"load_in_4bit": True} if allow == "qlora" else {})} in changes


def test_the_zero_paper_table_1_row_through_the_console_script():
    # ZeRO (Rajbhandari et al. 2020) Table 1: 7.5B parameters, Nd = 64, P_os: 31.4 GB per device
    # with mixed-precision Adam (fp16 weights and gradients, K = 12 bytes of fp32 state and master).
    done = run_script("estimate", "7500000000", "--zero", "1", "--world-size", "64", "--precision", "deepspeed-fp16",
                      "--optimizers", "adamw", "--json")
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(done.stdout)["optimizers"]
    assert entry["model_states_bytes"] == 2 * 7_500_000_000 + 2 * 7_500_000_000 + 12 * 7_500_000_000 // 64 + 4
    assert f"{entry['model_states_bytes'] / 1e9:.1f}" == "31.4"
    # Without a plan option a count gets one line saying what it can answer.
    bare = run_script("estimate", "7.5e9")
    assert bare.returncode == 2 and bare.stdout == ""
    assert bare.stderr.startswith("trainer-memcb: error: a parameter count (7,500,000,000) answers the model-states "
                                  "plan only") and bare.stderr.count("\n") == 1


# The estimate command lines the README showed (the guide's pages are run by tests/test_docs.py),
# with a real model in place of the placeholders MODEL and tiny-llama.
SHOWN_BEFORE = [
    f"{LLAMA} --world-size 64 --nodes 8 --zero 3 --precision deepspeed-bf16 --optimizers adamw,adafactor,adamw_8bit "
    "--device-memory 80GiB",
    "examples/models/distilbert-base-cased --architecture DistilBertForSequenceClassification "
    "--optimizers adamw,adafactor,adamw_8bit,adamw_torch_8bit",
    f"{LLAMA} --optimizers galore_adamw,galore_adamw_layerwise,apollo_adamw --optim-args 'rank=64,update_proj_gap=200' "
    "--optim-target-modules '.*(attn|mlp).*'",
    f"{LLAMA} --lora-r 8 --lora-target-modules q_proj,v_proj --lora-modules-to-save lm_head "
    "--optimizers adamw_torch,paged_adamw_8bit",
]


@pytest.mark.slow  # a 7B plan per command through the console script: half a minute each here
@pytest.mark.parametrize("argv", [shlex.split(line) for line in SHOWN_BEFORE] + readme_commands("trainer-memcb", "estimate"),
                         ids=lambda argv: " ".join(argv[:2]))
def test_the_readme_estimate_commands_run_as_written(argv):
    done = run_script("estimate", *argv)
    assert done.returncode == 0, f"trainer-memcb estimate {shlex.join(argv)}: {done.stderr}"
    assert done.stderr == "", argv
    assert ("Optimizer state" in done.stdout) != ("Per process" in done.stdout), argv  # the what-if, or the plan


@pytest.mark.parametrize("argv,line", [
    ([], "choose a command: report, compare, estimate or snapshot (trainer-memcb --help shows them)"),
    (["estimate"], "the following arguments are required: MODEL"),
    (["report"], "the following arguments are required: RUN_DIR"),
    (["estimate", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["estimate", "x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from float32, bfloat16, "
                                           "float16)"),
    (["frobnicate"], "argument {report,compare,estimate,snapshot}: invalid choice: 'frobnicate' (choose from report, "
                     "compare, estimate, snapshot)"),
])
def test_a_usage_error_is_one_line_with_one_prefix(argv, line):
    done = run_script(*argv)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.replace("'", "").replace('"', "") == f"trainer-memcb: error: {line}\n".replace("'", "")


def test_the_usage_is_shown_on_help_only_and_version_says_the_version():
    import trainer_memcb

    helped = run_script("estimate", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: trainer-memcb estimate ") and helped.stderr == ""
    version = run_script("--version")
    assert (version.returncode, version.stdout, version.stderr) == (0, f"trainer-memcb {trainer_memcb.__version__}\n", "")


@pytest.mark.parametrize("delay_s", [0.5, 1.0, 2.0, 4.0])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(delay_s):
    # From the first imports (torch, transformers) to the traces of a 7B `--fit`, which takes far
    # longer than the last delay (about 20 s here; a 7B step plan alone, folded, ends within 4 s on
    # a quiet machine). Before the package's first line runs, the interpreter's own start-up (about
    # 0.2 s here, the editable install's finder included) answers with Python's traceback.
    import signal
    import time

    process = subprocess.Popen([SCRIPT, "estimate", LLAMA, "--optimizers", "adamw_torch", "--batch-size", "8",
                                "--seq-len", "2048", "--precision", "bf16", "--device-memory", "80GiB", "--fit"],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, HF_HUB_OFFLINE="1"))
    time.sleep(delay_s)
    assert process.poll() is None, "the command ended before the signal: give it a longer one"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert (process.returncode, out, err) == (130, "", "trainer-memcb: interrupted\n")


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_tensor_parallel_with_uneven_shards_shows_each_rank_s_step(tmp_path):
    # The tiny Llama of tests/plan/test_engines.py with 257 tokens: under tp=2 rank 0 holds 129 rows of
    # the embedding and the head, rank 1 128 (torch's chunk rule), so their steps differ. Each figure is
    # the real 2-process run's MemTracker reading less the device mesh's 8 bytes
    # (tests/training/test_tensor_parallel_runs.py).
    import jsonschema
    from transformers import LlamaConfig

    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=257)
    LlamaConfig(**config).save_pretrained(str(tmp_path))
    done = run_script("estimate", str(tmp_path), "--parallelism", "tp=2", "--batch-size", "2", "--seq-len", "16",
                      "--device-type", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    with open(os.path.join(REPO_ROOT, "docs", "estimate.schema.json"), encoding="utf-8") as handle:
        jsonschema.Draft202012Validator(json.load(handle)).validate(document)  # the committed schema names the key
    step = document["step"]
    groups = [(group["ranks"], group["peak_bytes"], group["model_states_at_optimizer_step_bytes"])
              for group in step["rank_groups"]]
    assert groups == [
        ([0], 1_040_792, {"parameters": 231_168, "gradients": 263_936, "optimizer_state": 462_420, "master_weights": 0}),
        ([1], 1_039_000, {"parameters": 231_168, "gradients": 263_680, "optimizer_state": 461_396, "master_weights": 0}),
    ]
    # The plan's own figures are the fuller process's, rank 0's.
    assert step["peak_bytes"] == 1_040_792
    assert "rank 0 holds the most of ranks 0 and 1 at its peak (rank 1 1014.6 KiB (1,039,000))" in step["notes"]
    # Beside FSDP2 on four processes, each rank holds FSDP2's chunk of its TP chunk: three groups, each
    # the real four-process run's FSDPMemTracker reading (tests/training/test_tensor_parallel_runs.py).
    done = run_script("estimate", str(tmp_path), "--parallelism", "tp=2,dp_shard=2", "--batch-size", "2", "--seq-len",
                      "16", "--device-type", "cpu", "--optimizers", "adamw_torch", "--json")
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout)["step"]
    assert [(group["ranks"], group["peak_bytes"]) for group in step["rank_groups"]] == [
        ([0], 862_240), ([1, 3], 859_424), ([2], 861_216)]
    assert step["peak_bytes"] == 862_240
    # At 256 tokens every rank holds the same: one step, no groups.
    LlamaConfig(**dict(config, vocab_size=256)).save_pretrained(str(tmp_path))
    even = run_script("estimate", str(tmp_path), "--parallelism", "tp=2", "--batch-size", "2", "--seq-len", "16",
                      "--device-type", "cpu", "--json")
    assert even.returncode == 0, even.stderr
    assert "rank_groups" not in json.loads(even.stdout)["step"]
    assert json.loads(even.stdout)["step"]["peak_bytes"] == 1_038_232
    # An MLP width of 129: rank 0 holds 65 rows of gate_proj and up_proj and 65 columns of down_proj,
    # rank 1 64, as transformers' own styles split them; each figure the real from_pretrained(tp_plan=
    # "auto") run's MemTracker reading less its views of the checkpoint's tensors and 16 bytes
    # (tests/training/test_tensor_parallel_runs.py).
    LlamaConfig(**dict(config, vocab_size=256, intermediate_size=129)).save_pretrained(str(tmp_path))
    mlp = run_script("estimate", str(tmp_path), "--parallelism", "tp=2", "--batch-size", "2", "--seq-len", "16",
                     "--device-type", "cpu", "--json")
    assert mlp.returncode == 0, mlp.stderr
    assert [(group["ranks"], group["peak_bytes"]) for group in json.loads(mlp.stdout)["step"]["rank_groups"]] == [
        ([0], 1_044_632), ([1], 1_038_232)]
