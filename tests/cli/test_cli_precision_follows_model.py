"""The precision follows the model (issue 37, item 6): a --training-args file that names no mixed
precision keeps --dtype's (the Trainer never upcasts a bf16 model), and bf16/fp16 in the file over
a bf16 model run as the Trainer runs them (autocast over the bf16 parameters: accelerate casts no
parameter; the GradScaler unscales bf16 gradients). One case per entry of the guide's `--precision`
row (docs/will-it-fit.md), through the command line, on a tiny Llama; no mocks."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from trainer_memcb.cli import main  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


def plan(tmp_path: Path, *options: str, training_args=None):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    extra = []
    if training_args is not None:
        path = tmp_path / "args.json"
        path.write_text(json.dumps(dict(per_device_train_batch_size=2, **training_args)))
        extra = ["--training-args", str(path)]
    # In this process (the command's own entry, `main`): the console script's start is held by
    # tests/cli/test_console_script.py, and here it was most of each case's 7 s.
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["estimate", str(tmp_path), "--seq-len", "16", "--batch-size", "2", "--optimizers", "adamw_torch",
                     "--json", *options, *extra])
    assert code == 0, err.getvalue() + out.getvalue()[-2000:]
    document = json.loads(out.getvalue())
    settings = document["settings"]
    source = dict((name, source) for name, _, source in settings["used"])["precision"]
    return settings["precision"], settings["param_dtype"], source, document["step"]["peak_bytes"]


@pytest.fixture(scope="module")
def bf16_model_alone(tmp_path_factory):
    """The plan of `--dtype bfloat16` with no training args: the default row, --dtype's precision."""
    return plan(tmp_path_factory.mktemp("bf16-alone"), "--dtype", "bfloat16")


@pytest.mark.parametrize("training_args", [{}, {"bf16": False, "fp16": False}])
def test_file_without_mixed_precision_keeps_the_bf16_model(tmp_path, training_args, bf16_model_alone):
    precision, dtype, source, peak = plan(tmp_path, "--dtype", "bfloat16", training_args=training_args)
    assert (precision, dtype) == ("bf16", "bfloat16")
    assert source == "--dtype (no mixed precision in the training args)"
    # the same plan as --dtype bfloat16 alone
    assert (precision, dtype, peak) == (bf16_model_alone[0], bf16_model_alone[1], bf16_model_alone[3])
    assert bf16_model_alone[2] == "flag"


def test_default_row_fp32_model_stays_fp32(tmp_path):
    assert plan(tmp_path, training_args={})[:2] == ("fp32", "float32")
    assert plan(tmp_path)[:3] == ("fp32", "float32", "flag")


def test_autocast_bf16_row_bf16_true_over_a_bf16_model_keeps_its_parameters(tmp_path):
    precision, dtype, source, _ = plan(tmp_path, "--dtype", "bfloat16", training_args={"bf16": True})
    assert (precision, dtype, source) == ("autocast-bf16", "bfloat16", "training args")


def test_autocast_fp16_over_a_bf16_model_runs_as_the_trainer_runs_it(tmp_path):
    # transformers' Trainer neither raises nor warns for fp16=True over a bf16 model (trainer.py has no such
    # check); accelerate autocasts to fp16 and its GradScaler unscales bf16 gradients (only fp16 ones are refused).
    precision, dtype, source, _ = plan(tmp_path, "--dtype", "bfloat16", training_args={"fp16": True})
    assert (precision, dtype, source) == ("autocast-fp16", "bfloat16", "training args")


def test_pure_16_bit_rows_and_the_flag_over_the_file(tmp_path):
    assert plan(tmp_path, "--dtype", "float16", training_args={})[:2] == ("fp16", "float16")
    assert plan(tmp_path, "--precision", "bf16", training_args={})[:3] == ("bf16", "bfloat16", "flag")
