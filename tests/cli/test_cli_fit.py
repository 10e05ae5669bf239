"""`trainer-memcb estimate ... --fit`: the proposals on the command line, the first one written as
TrainingArguments JSON and a DeepSpeed config, and planned again from those files to the byte."""

from __future__ import annotations

import json
import os

import pytest

from helpers import requires_transformers, rotary_buffers_beyond_transformers_5s, tiny_llama_folder
from trainer_memcb.cli import main

COMMON = ["--optimizers", "adamw_torch", "--seq-len", "64", "--device-type", "cpu"]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-fit")


def rotary_buffers(folder: str) -> int:
    """The figures are transformers 5's; what the installed release's buffers add (helpers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return rotary_buffers_beyond_transformers_5s(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)))


def test_fit_proposes_writes_and_the_files_plan_the_same_figure(tiny_llama_dir, tmp_path, capsys):
    written = str(tmp_path / "training_args.json")
    code = main(["estimate", tiny_llama_dir, *COMMON, "--batch-size", "16", "--device-memory", "6MiB", "--fit",
                 "--max-proposals", "6", "--write-training-args", written, "--json"])
    captured = capsys.readouterr()
    assert code == 0  # the own step does not fit, a proposal does
    fit = json.loads(captured.out)["answers"]["fit"]
    assert fit["fits_as_is"] is False and fit["own"]["peak_bytes"] == 14_835_616 + rotary_buffers(tiny_llama_dir)
    first = fit["candidates"][0]
    assert first["fits"] is True and first["effective_batch"] == 16
    assert f"wrote {written}" in captured.err
    with open(written) as handle:
        assert json.load(handle) == first["training_args"]
    # Loaded as TrainingArguments, and planned again from the file: the same figure to the byte.
    from transformers import TrainingArguments

    loaded = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], **first["training_args"])
    assert loaded.per_device_train_batch_size == first["training_args"]["per_device_train_batch_size"]
    code = main(["estimate", tiny_llama_dir, *COMMON[2:], "--device-memory", "6MiB", "--training-args", written,
                 "--json"])
    again = json.loads(capsys.readouterr().out)["step"]
    assert code == 0 and again["peak_bytes"] == first["peak_bytes"]
    # Never over a file without --force, never through a link.
    code = main(["estimate", tiny_llama_dir, *COMMON, "--batch-size", "16", "--device-memory", "6MiB", "--fit",
                 "--write-training-args", written])
    assert code == 2 and "exists; not replacing it without --force" in capsys.readouterr().err
    link = str(tmp_path / "link.json")
    os.symlink(str(tmp_path / "elsewhere.json"), link)
    code = main(["estimate", tiny_llama_dir, *COMMON, "--batch-size", "16", "--device-memory", "6MiB", "--fit",
                 "--write-training-args", link, "--force"])
    assert code == 2 and "is a symbolic link" in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "elsewhere.json"))


def test_nothing_fits_exits_3_naming_the_nearest_miss(tiny_llama_dir, capsys):
    code = main(["estimate", tiny_llama_dir, *COMMON, "--batch-size", "2", "--device-memory", "1MiB", "--fit",
                 "--max-proposals", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert err[-1].startswith("trainer-memcb: nothing fits: the nearest is ") and " over 1.0 MiB" in err[-1]


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "2", "--fit"], "--fit needs --device-memory"),
    (["--batch-size", "2", "--allow", "lora"], "--allow has no effect without --fit"),
    (["--batch-size", "2", "--fit", "--device-memory", "1GiB", "--allow", "adapters"], "'adapters' is not one of"),
])
def test_bad_fit_options_are_one_line(tiny_llama_dir, capsys, argv, message):
    code = main(["estimate", tiny_llama_dir, *COMMON, *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@requires_transformers("5.0", "the evaluation's forward was measured on transformers 5.24; 4.57's attention-mask "
                       "path holds a causal mask more (tests/plan/test_eval_memory.py)")
def test_fit_with_the_evaluation_plan_proposes_eval_batches_and_accumulation(tiny_llama_dir, capsys):
    code = main(["estimate", tiny_llama_dir, "--eval-samples", "64", "--seq-len", "64", "--eval-batch-size", "16",
                 "--device-type", "cpu", "--device-memory", "3MiB", "--reserve", "0B", "--fit", "--max-proposals", "4", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0  # the own evaluation does not fit, a proposal does
    fit = document["answers"]["evaluation_fit"]
    assert fit["fits_as_is"] is False and fit["own"]["peak_bytes"] == document["answers"]["evaluation"]["device_peak_bytes"]
    first = fit["candidates"][0]
    assert first["training_args"] == {"per_device_eval_batch_size": 8, "eval_accumulation_steps": 1}
    assert (first["peak_bytes"], first["fits"]) == (2_307_936, True) and len(fit["candidates"]) == 4
