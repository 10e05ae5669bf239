"""Start-up: `import trainer_memcb` and the `trainer-memcb` command import no part of transformers'
Trainer machinery until it is needed, and other libraries' import chatter stays off the terminal.

Each check runs in a fresh Python process, since this test process has imported everything already.
Timing lives in `benchmarks/startup.py`, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import requires_transformers
from trainer_memcb.plan.optimizers.trainer_optimizers import trainer_optimizer_cls_and_kwargs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(REPO_ROOT, "examples", "models", "tiny-distilbert")
# What the callback's import chain used to pull in: seconds of start-up.
HEAVY = ("transformers", "transformers.trainer", "transformers.trainer_utils", "peft", "bitsandbytes", "datasets",
         "torchao", "sklearn")
# transformers 4.x has no `transformers.trainer_optimizer`: the estimate asks the Trainer itself for
# each optimizer's class and arguments, so it imports `transformers.trainer` (and with it peft).
NEEDS_THE_HANDLERS = requires_transformers(
    "5.0", "the optimizer handlers apart from the Trainer (transformers.trainer_optimizer) are transformers 5's")


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


def loaded_after(code: str) -> dict:
    done = run_python(f"{code}\nimport json, sys\nprint(json.dumps({{m: sys.modules.get(m) is not None for m in {HEAVY!r}}}))")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_trainer_memcb_loads_no_transformers():
    assert loaded_after("import trainer_memcb") == dict.fromkeys(HEAVY, False)


def test_the_estimate_functions_load_no_transformers():
    code = ("import torch, trainer_memcb\n"
            "optimizer = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters())\n"
            "assert trainer_memcb.estimate_optimizer_state(optimizer).num_bytes == 88")
    assert loaded_after(code) == dict.fromkeys(HEAVY, False)


def test_the_callback_is_imported_on_first_use():
    code = ("import trainer_memcb, sys\n"
            "assert 'trainer_memcb.training.callback' not in sys.modules\n"
            "from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger\n"
            "assert OptimizerMemoryCallback.__module__ == 'trainer_memcb.training.callback'\n"
            "assert OptimizerMemoryLogger.__module__ == 'trainer_memcb.training.accelerate_loop'\n"
            "assert trainer_memcb.OptimizerMemoryCallback is OptimizerMemoryCallback")
    loaded = loaded_after(code)
    assert loaded["transformers.trainer_utils"] is True  # the callback needs TrainerCallback
    assert loaded["transformers.trainer"] is False  # ... and not the Trainer itself


def test_an_unknown_name_is_an_attribute_error():
    import trainer_memcb

    with pytest.raises(AttributeError, match="no attribute 'OptimizerMemoryCalback'"):
        trainer_memcb.OptimizerMemoryCalback  # noqa: B018
    assert {"OptimizerMemoryCallback", "OptimizerMemoryLogger"} <= set(dir(trainer_memcb))


def test_report_and_compare_load_no_transformers():
    code = ("from trainer_memcb.cli import main\n"
            "assert main(['compare', 'no/such/run']) == 1\n"
            "assert main(['report', 'no/such/run', '--no-plot']) == 1")
    assert loaded_after(code) == dict.fromkeys(HEAVY, False)


@pytest.fixture(scope="module")
def adamw_estimate_loads() -> dict:
    """What `estimate TINY --optimizers adamw` (the model states and the optimizer's state, no
    step) loads, through the console script's entry."""
    return _estimate_loads("--optimizers", "adamw")


@pytest.fixture(scope="module")
def step_plan_loads(tmp_path_factory) -> dict:
    """What a step plan of the tiny model with AdamW, from a --training-args file, loads."""
    other = tmp_path_factory.mktemp("args") / "other.json"
    other.write_text(json.dumps({"optim": "adamw_torch", "per_device_train_batch_size": 1}))
    return _estimate_loads("--training-args", str(other), "--seq-len", "8")


@NEEDS_THE_HANDLERS
def test_the_estimate_command_keeps_peft_out_of_its_process(adamw_estimate_loads):
    loaded = adamw_estimate_loads
    assert loaded["peft"] is False and loaded["bitsandbytes"] is False and loaded["transformers.trainer"] is False
    assert loaded["transformers.trainer_utils"] is True
    assert loaded["torchao"] is False  # installed (the test extra), and no optimizer of its asked
    assert loaded["sklearn"] is False  # installed (the test extra); transformers 4's generation imports it


def test_a_step_plan_keeps_scikit_learn_out_of_its_process(step_plan_loads):
    pytest.importorskip("sklearn", reason="scikit-learn is not installed")
    assert step_plan_loads["sklearn"] is False


def _estimate_loads(*argv: str) -> dict:
    code = ("import sys\n"
            f"sys.argv = ['trainer-memcb', 'estimate', {TINY_CONFIG!r}, *{list(argv)!r}]\n"
            "from trainer_memcb.cli import console_main\n"
            "assert console_main() == 0")
    return loaded_after(code)


def test_an_estimate_of_torchaos_optimizers_loads_torchao():
    pytest.importorskip("torchao", reason="torchao is not installed")
    assert _estimate_loads("--optimizers", "adamw,adamw_torch_8bit")["torchao"] is True


def test_a_training_args_file_naming_a_torchao_optimizer_loads_torchao(tmp_path, step_plan_loads):
    pytest.importorskip("torchao", reason="torchao is not installed")
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"optim": "adamw_torch_4bit", "per_device_train_batch_size": 1}))
    assert _estimate_loads("--training-args", str(named), "--seq-len", "8")["torchao"] is True
    assert step_plan_loads["torchao"] is False  # a file that names another optimizer


@NEEDS_THE_HANDLERS
def test_the_torchao_optimizers_are_transformers_own():
    from transformers.trainer_optimizer import _TORCHAO_OPTIMIZERS

    from trainer_memcb.cli.estimate_asked import TORCHAO_OPTIMIZERS

    assert sorted(TORCHAO_OPTIMIZERS) == sorted(str(getattr(name, "value", name)) for name in _TORCHAO_OPTIMIZERS)


@NEEDS_THE_HANDLERS
def test_estimate_loads_the_optimizer_handlers_not_the_trainer(adamw_estimate_loads):
    assert adamw_estimate_loads["transformers"] is True and adamw_estimate_loads["transformers.trainer"] is False


@pytest.mark.parametrize("name", ["adamw_torch", "adafactor", "adamw_bnb_8bit", "sgd", "adagrad", "lion_32bit"])
def test_the_optimizer_handlers_give_what_the_trainer_gives(name):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir="unused", report_to=[], optim=name, learning_rate=3e-4, adam_beta1=0.8,
                             optim_args="eps=1e-7" if name == "adamw_torch" else None)
    model = torch.nn.Linear(4, 2)
    try:
        expected = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as error:  # a library not installed: both must fail alike
        with pytest.raises(type(error)):
            trainer_optimizer_cls_and_kwargs(args, model)
        return
    assert trainer_optimizer_cls_and_kwargs(args, model) == expected


@pytest.mark.slow
def test_estimate_keeps_other_libraries_chatter_off_the_terminal_and_verbose_shows_it():
    command = [sys.executable, "-m", "trainer_memcb", "estimate", TINY_CONFIG, "--optimizers", "adamw,adamw_bnb_8bit"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    quiet = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    verbose = subprocess.run(command + ["--verbose"], env=env, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == verbose.returncode == 0
    assert quiet.stderr == ""
    assert quiet.stdout == verbose.stdout
    assert "adamw_bnb_8bit" in quiet.stdout


def test_quiet_output_drops_c_level_and_python_writes_and_restores_the_stream():
    code = ("import os, sys\n"
            "from trainer_memcb.cli.quiet import quiet_output\n"
            "with quiet_output():\n"
            "    os.write(2, b'from C\\n')\n"
            "    print('from Python', file=sys.stderr)\n"
            "print('after', file=sys.stderr)\n"
            "with quiet_output(enabled=False):\n"
            "    os.write(2, b'shown\\n')\n")
    done = run_python(code)
    assert done.returncode == 0 and done.stderr == "after\nshown\n"


def test_a_missing_model_folder_is_one_line_before_torch_is_imported():
    # Answered from the path alone (it took 11 s of imports when found by the model's builder).
    done = run_python("import sys\nfrom trainer_memcb.cli import main\ncode = main(['estimate', 'no/such/folder/x'])\n"
                      "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
                      "sys.exit(code)")
    assert done.returncode == 1
    assert done.stderr == "trainer-memcb: no/such/folder/x: no such folder (give a folder holding config.json, or a hub name)\n"
    assert done.stdout == "[]\n"


def test_help_imports_no_bitsandbytes_and_writes_nothing_to_stderr():
    # bitsandbytes logs "Failed to load CPU gemm_4bit_forward ..." when imported on a CPU with
    # AVX-512 BF16 (not this one): `--help` must not import it, nor anything of the Trainer.
    script = os.path.join(os.path.dirname(sys.executable), "trainer-memcb")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    done = subprocess.run([script, "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: trainer-memcb")
    assert done.stderr == ""
    code = ("import sys\nfrom trainer_memcb.cli import console_main\nsys.argv = ['trainer-memcb', '--help']\n"
            "try:\n    console_main()\nexcept SystemExit:\n    pass")
    assert loaded_after(code) == dict.fromkeys(HEAVY, False)
