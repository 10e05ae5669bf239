"""`trainer-memcb estimate ... --fit`: the proposals on the command line, the first one written as
TrainingArguments JSON and a DeepSpeed config, and planned again from those files to the byte."""

from __future__ import annotations

import json
import os

import pytest

from helpers import TRANSFORMERS_4, requires_transformers, rotary_buffers_beyond_transformers_5s
from trainer_memcb.cli import main

COMMON = ["--optimizers", "adamw_torch", "--seq-len", "64", "--device-type", "cpu"]


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


# The golden plans' tiny Llama (tests/data/golden), the figures below its.
GOLDEN_LLAMA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "golden", "tiny-llama")
FLASH = ["--optimizers", "adamw_torch", "--seq-len", "256", "--batch-size", "4", "--device-type", "cuda",
         "--reserve", "0B"]


def _fit(folder: str, capsys, *argv: str) -> dict:
    code = main(["estimate", folder, *FLASH, *argv, "--fit", "--max-proposals", "2", "--json"])
    assert code in (0, 3)
    return json.loads(capsys.readouterr().out)["answers"]["fit"]


def test_fit_proposes_flash_attention_2_where_eager_attention_runs_in_16_bits_on_cuda(tmp_path, capsys):
    tiny_llama_dir = GOLDEN_LLAMA
    # 470 MiB less the CUDA context (426 MiB) leaves 44 MiB: eager attention's step reserves 50 MiB (each
    # layer's [4, 4, 256, 256] probabilities), flash_attention_2's 28 MiB.
    fit = _fit(tiny_llama_dir, capsys, "--dtype", "bfloat16", "--attn-implementation", "eager",
               "--device-memory", "470MiB")
    first = fit["candidates"][0]
    assert fit["fits_as_is"] is False and fit["own"]["reserved_peak_bytes"] == 50 * 2**20
    assert (first["changes"], first["needs_package"], first["fits"]) == ({"attn_implementation": "flash_attention_2"},
                                                                        "flash-attn", True)
    assert first["reserved_peak_bytes"] == 28 * 2**20 and first["margin_bytes"] == 16 * 2**20
    # The proposal's figures are the plan of the same setting given on the command line, its FLOPs SDPA's
    # (the same two matmuls a layer; flash_attention_2's custom ops are counted by SDPA's formulas).
    for attention in ("flash_attention_2", "sdpa"):
        assert main(["estimate", tiny_llama_dir, *FLASH, "--dtype", "bfloat16", "--attn-implementation", attention,
                     "--device-memory", "470MiB", "--fit", "--max-proposals", "1", "--json"]) == 0
        own = json.loads(capsys.readouterr().out)["answers"]["fit"]["own"]
        assert own["step_flops"] == first["step_flops"]
        if attention == "flash_attention_2":
            # transformers 4.x keeps the rotary embedding's original_inv_freq (16 bytes) out of the buffers
            assert own["peak_bytes"] == first["peak_bytes"] == 4_301_920 - (16 if TRANSFORMERS_4 else 0)
    # The table marks it; the TrainingArguments written cannot hold it, so the command says it.
    written = str(tmp_path / "args.json")
    code = main(["estimate", tiny_llama_dir, *FLASH, "--dtype", "bfloat16", "--attn-implementation", "eager",
                 "--device-memory", "470MiB", "--fit", "--max-proposals", "1", "--write-training-args", written])
    captured = capsys.readouterr()
    assert code == 0 and "flash_attention_2 attention (needs flash-attn)" in captured.out
    assert ("load the model with attn_implementation='flash_attention_2' (a from_pretrained argument; needs "
            "flash-attn)") in captured.err
    with open(written) as handle:
        assert "attn_implementation" not in json.load(handle)


@pytest.mark.parametrize("argv", [
    ["--dtype", "bfloat16", "--attn-implementation", "sdpa"],  # a GPU's SDPA takes its flash backend
    ["--dtype", "float32", "--attn-implementation", "eager"],  # flash-attn takes 16-bit inputs only
], ids=["sdpa", "fp32"])
def test_fit_proposes_no_flash_attention_where_it_saves_nothing_or_cannot_run(capsys, argv):
    fit = _fit(GOLDEN_LLAMA, capsys, *argv, "--device-memory", "1GiB")
    assert fit["candidates"] and all("attn_implementation" not in c["changes"] for c in fit["candidates"])
    assert all(c["needs_package"] != "flash-attn" for c in fit["candidates"])


def test_fit_proposes_liger_kernels_on_cuda_and_writes_them_as_a_training_argument(tmp_path, capsys):
    # 453 MiB less the CUDA context (426 MiB) leaves 27 MiB: SDPA's step reserves 28 MiB (the fp32 logits and
    # their gradient), the step with liger-kernel's fused linear cross-entropy 26 MiB.
    written = str(tmp_path / "args.json")
    code = main(["estimate", GOLDEN_LLAMA, *FLASH, "--dtype", "bfloat16", "--device-memory", "453MiB", "--fit",
                 "--max-proposals", "1", "--write-training-args", written, "--json"])
    fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
    [liger] = fit["candidates"]
    assert code == 0 and fit["own"]["reserved_peak_bytes"] == 28 * 2**20 and fit["own"]["fits"] is False
    assert (liger["changes"], liger["needs_package"], liger["fits"]) == ({"use_liger_kernel": True}, "liger-kernel", True)
    assert liger["reserved_peak_bytes"] == 26 * 2**20 and liger["training_args"]["use_liger_kernel"] is True
    with open(written) as handle:
        assert json.load(handle)["use_liger_kernel"] is True
    # Planned again from the file written, and with the flag: the proposal's step to the byte.
    for more in (["--training-args", written], ["--liger-kernel"]):
        assert main(["estimate", GOLDEN_LLAMA, *FLASH, "--dtype", "bfloat16", *more, "--device-memory", "453MiB",
                     "--json"]) in (0, 3)
        assert json.loads(capsys.readouterr().out)["step"]["peak_bytes"] == liger["peak_bytes"]


def test_fit_proposes_no_liger_kernels_off_cuda_or_where_already_on(capsys):
    for more in (["--device-type", "cpu"], ["--liger-kernel"]):
        argv = [*FLASH, "--dtype", "bfloat16", *more, "--device-memory", "1GiB", "--fit", "--max-proposals", "2",
                "--json"]
        assert main(["estimate", GOLDEN_LLAMA, *argv]) in (0, 3), capsys.readouterr().err
        fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
        assert fit["candidates"] and all("use_liger_kernel" not in c["changes"] for c in fit["candidates"])
