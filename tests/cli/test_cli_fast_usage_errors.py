"""A usage error is answered from the command line alone, before torch and transformers are
imported (seconds): each case runs in a fresh process and reports what it imported. The time it
takes, against `--version`'s, is in `benchmarks/usage_errors.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

import pytest

from trainer_memcb.cli import choices

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join("examples", "models", "tiny-distilbert")
HEAVY = ("torch", "transformers", "numpy")

# Each: the arguments after `estimate`, and the start of the one line that answers them.
USAGE_ERRORS = [
    ([TINY, "--batch-size", "4"], "--batch-size and --max-batch-size need --seq-len"),
    ([TINY, "--max-batch-size", "--seq-len", "8"], "--max-batch-size needs --device-memory"),
    ([TINY, "--seq-len", "8"], "--seq-len has no effect without"),
    ([TINY, "--packing", "64"], "--packing has no effect without"),
    ([TINY, "--torch-compile"], "--torch-compile has no effect without"),
    ([TINY, "--liger-kernel"], "--liger-kernel has no effect without"),
    ([TINY, "--batch-size", "1", "--seq-len", "4", "--liger-kernel-config", '{"rms_nrom": false}'],
     "argument --liger-kernel-config: liger_kernel_config: 'rms_nrom' is not a keyword"),
    ([TINY, "--max-batch-size", "--seq-len", "8", "--packing", "64", "--device-memory", "1GiB"],
     "--max-batch-size searches the rows of a batch; --packing makes one row"),
    ([TINY, "--reserve", "1GiB"], "--reserve has no effect without --device-memory"),
    ([TINY, "--device-memory", "1GiB", "--reserve", "1GiB", "--batch-size", "1", "--seq-len", "4"], "leaves nothing of --device-memory"),
    ([TINY, "--lora-target-modules", "q_lin"], "--lora-target-modules and --lora-modules-to-save need --lora-r"),
    ([TINY, "--batch-size", "1", "--seq-len", "4", "--load-in-8bit", "--load-in-4bit"], "--load-in-8bit and --load-in-4bit"),
    ([TINY, "--eval-samples", "8"], "--eval-samples needs --seq-len"),
    ([TINY, "--eval-samples", "8", "--seq-len", "4", "--host-memory", "lots"], "argument --host-memory"),
    ([TINY, "--zero", "4"], "argument --zero: invalid choice"),
    ([TINY, "--world-size", "3", "--nodes", "2"], "world_size=3 is not a multiple of nodes=2"),
    ([TINY, "--sharding", "fsdp-full-shard", "--precision", "deepspeed-bf16"],
     "precision='deepspeed-bf16' is DeepSpeed's: use it with sharding none, ddp, zero1, zero2 or zero3"),
    ([TINY, "--parallelism", "tp=2,pp=2"], "argument --parallelism: parallelism 'pp=2': expected NAME=SIZE"),
    ([TINY, "--parallelism", "tp=2"], "--parallelism has no effect without"),
    ([TINY, "--batch-size", "0"], "argument --batch-size"),
    (["7.5e9"], "a parameter count (7,500,000,000) answers the model-states plan only"),
    (["7.5e9", "--zero", "1", "--lora-r", "8"], "--lora-r needs a model's modules and names"),
    (["7.5e9", "--batch-size", "1", "--seq-len", "4"], "a parameter count (7,500,000,000) cannot be traced"),
    (["7.25"], "MODEL '7.25' is not a whole parameter count"),
    ([TINY, "--batch-size", "1", "--seq-len", "4", "--training-args", "training_args.bin"], "--training-args"),
    ([TINY, "--batch-size", "1", "--seq-len", "4", "--deepspeed", "no/such/ds_config.json"], "--deepspeed: no/such"),
]


def run_and_list_imports(argv: List[str], flag: str = "") -> subprocess.CompletedProcess:
    """The command in a fresh process (`main`, or `console_main` as the console script runs it);
    the last line of stdout lists which of HEAVY it imported."""
    call = "console_main()" if flag == "console" else f"main({argv!r})"
    code = ("import json, sys\n"
            f"sys.argv = ['trainer-memcb'] + {argv!r}\n"
            "from trainer_memcb.cli import main, console_main\n"
            f"code = {call}\n"
            f"print(json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("argv,line", USAGE_ERRORS, ids=[" ".join(argv) for argv, _ in USAGE_ERRORS])
def test_a_usage_error_is_answered_before_torch_is_imported(argv: List[str], line: str) -> None:
    done = run_and_list_imports(["estimate", *argv])
    code, imported = json.loads(done.stdout.splitlines()[-1])
    [message] = done.stderr.splitlines()
    assert message.startswith("trainer-memcb: error: ") and line in message, message
    assert (code, imported) == (2, [])


def test_a_bad_allocator_setting_in_the_environment_is_answered_before_torch_is_imported(monkeypatch) -> None:
    # The allocator replay reads it (a CUDA step plan): 8 s of imports before it was found.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1")
    done = run_and_list_imports(["estimate", TINY, "--batch-size", "2", "--seq-len", "16"])
    code, imported = json.loads(done.stdout.splitlines()[-1])
    [message] = done.stderr.splitlines()
    assert message == ("trainer-memcb: error: PYTORCH_CUDA_ALLOC_CONF in the environment: PYTORCH_CUDA_ALLOC_CONF "
                       "'max_split_size_mb:1': max_split_size_mb too small, must be >= 20, got 1")
    assert (code, imported) == (2, [])


def test_the_console_script_answers_a_usage_error_before_torch_is_imported() -> None:
    done = run_and_list_imports(["estimate", TINY, "--batch-size", "4"], flag="console")
    assert json.loads(done.stdout.splitlines()[-1]) == [2, []]
    assert done.stderr == "trainer-memcb: error: --batch-size and --max-batch-size need --seq-len (the sequence length)\n"


def test_version_and_help_import_no_torch() -> None:
    for argv in (["--version"], ["estimate", "--help"]):
        done = run_and_list_imports(argv, flag="console")
        assert json.loads(done.stdout.splitlines()[-1]) == [0, []]


def test_an_image_model_needs_no_seq_len_so_the_built_model_decides(tmp_path) -> None:
    """A config with an image key leaves --seq-len to the built model: no early refusal."""
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=16, architectures=["ViTForImageClassification"]).save_pretrained(tmp_path)
    done = run_and_list_imports(["estimate", str(tmp_path), "--batch-size", "1", "--optimizers", "adamw", "--json"])
    code, imported = json.loads(done.stdout.splitlines()[-1])
    assert code == 0 and "torch" in imported, done.stderr


def test_the_choices_are_the_plans_own() -> None:
    from trainer_memcb.plan.answers import eval_memory
    from trainer_memcb.plan.model import quantized
    from trainer_memcb.plan.optimizers import whatif
    from trainer_memcb.plan.settings import setup
    from trainer_memcb.plan.step import trace

    assert choices.SHARDINGS == setup.SHARDINGS
    assert choices.PRECISIONS == tuple(setup.PRECISIONS)
    assert choices.DTYPES == tuple(whatif.DTYPES)
    assert choices.DEVICE_TYPES == trace.DEVICE_TYPES
    assert choices.QUANT_TYPES == quantized.QUANT_TYPES
    assert choices.DEFAULT_OPTIMIZERS == whatif.DEFAULT_OPTIMIZERS
    assert choices.EVAL_LOGITS == eval_memory.EVAL_LOGITS
