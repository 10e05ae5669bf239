"""`trainer-memcb estimate MODEL --eval-samples N --seq-len S`: the evaluation plan on the command
line, equal to what a real Trainer run with the same settings logs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from helpers import TRANSFORMERS_4
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main

KEYS = ("forward_peak_bytes", "containers_device_bytes", "containers_host_bytes", "concat_peak_bytes",
        "host_concat_peak_bytes")


def config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                       architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: Any) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-eval")
    config().save_pretrained(folder)
    return str(folder)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.ids = torch.randint(0, 96, (size, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Any:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16_full_eval"])
def test_the_plan_through_training_args_equals_a_real_run_to_the_byte(tiny_llama_dir: str, tmp_path: Any,
                                                                      capsys: Any, precision: str) -> None:
    # bf16: accelerate runs the evaluation forward under autocast too (its casts are the forward's
    # storages) and hands the containers float32 logits; fp16: not on the CPU (no native amp there);
    # bf16_full_eval: only an evaluate() outside train() casts the model to bf16 first; with
    # --training-args the command plans the training step too, and evaluation inside train(), where
    # the model keeps its dtype: the run below is planned from the file without the cast
    # (tests/plan/test_eval_memory.py holds the cast against a real evaluate()).
    mixed = {precision: True} if precision != "fp32" else {}
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, per_device_eval_batch_size=4,
                             eval_accumulation_steps=2, report_to=[], disable_tqdm=True, **mixed)
    (tmp_path / "args.json").write_text(args.to_json_string())
    model_config = config()
    model_config._attn_implementation = "eager"
    trainer = Trainer(model=LlamaForCausalLM(model_config), args=args, eval_dataset=Tokens(10),
                      compute_metrics=lambda p: {"seen": float(len(p.label_ids))},
                      callbacks=[OptimizerMemoryCallback(eval_keys="all")])
    logged = trainer.evaluate()
    capsys.readouterr()  # what the run printed (accelerate, DeepSpeed's accelerator line)
    assert main(["estimate", tiny_llama_dir, "--eval-samples", "10", "--seq-len", "12", "--attn-implementation",
                 "eager", "--training-args", str(tmp_path / "args.json"), "--device-type", "cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["evaluation"]
    assert planned["settings"]["batch_size"] == 4 and planned["settings"]["accumulation_steps"] == 2
    assert planned["settings"]["autocast"] == (precision if precision in ("bf16", "fp16") else None)
    assert planned["settings"]["model_dtype"] is None
    if precision == "bf16_full_eval":
        # The real evaluate() here runs outside train(): the cast model holds about half.
        assert logged["eval_forward_peak_bytes"] < planned["forward_peak_bytes"]
        return
    assert {key: planned[key] for key in KEYS} == {key: logged[f"eval_{key}"] for key in KEYS}
    # Measured here: the forward's peak is 63,840 bytes in fp32 and in fp16 on the CPU, 79,656
    # under bf16 autocast (the bf16 copies of the weights and of the activations it casts); on
    # transformers 4.57, whose forward builds its masks otherwise, 76,128 and 91,944.
    fp32_peak = 76128 if TRANSFORMERS_4 else 63840
    assert planned["forward_peak_bytes"] == fp32_peak + (15816 if precision == "bf16" else 0)


def test_too_much_for_the_device_says_why_and_what_would_fit(tiny_llama_dir: str, capsys: Any) -> None:
    # --device-type cpu: fits? from the device peak itself (on CUDA, from the allocator replay:
    # test_the_evaluation_on_cuda_is_answered_by_the_allocator_replay).
    argv = ["estimate", tiny_llama_dir, "--eval-samples", "64", "--seq-len", "12", "--eval-batch-size", "4",
            "--attn-implementation", "eager", "--device-type", "cpu"]
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["evaluation"]
    memory = plan["device_peak_bytes"] - 1
    assert main(argv + ["--device-memory", f"{memory}B", "--reserve", "0B", "--host-memory", "1GiB", "--json"]) == 3  # does not fit
    short = json.loads(capsys.readouterr().out)["evaluation"]
    assert (short["fits_device"], short["fits_host"]) == (False, True)
    assert short["device_peak_bytes"] - short["device_memory_bytes"] == 1
    assert main(argv + ["--device-memory", f"{memory}B", "--reserve", "0B", "--host-memory", "1GiB"]) == 3
    out = capsys.readouterr().out
    assert "does not fit, " in out and "fits, " in out
    why = [line for line in out.splitlines() if line.startswith("Why: ")]
    assert len(why) == 1
    assert "eval_accumulation_steps=" in why[0] and "preprocess_logits_for_metrics" in why[0]
    assert main(argv + ["--device-memory", f"{memory}B", "--reserve", "0B", "--eval-accumulation-steps", "1", "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)["evaluation"]
    assert fixed["fits_device"] is True and fixed["advice"] == []
    # full logits: 64 x 12 x 96 x 4 bytes; argmax keeps 64 x 12 int64
    assert plan["containers_device_bytes"] == 64 * 12 * 96 * 4 + 64 * 12 * 8 + 64 * 4
    assert main(argv + ["--eval-logits", "argmax", "--json"]) == 0
    argmax = json.loads(capsys.readouterr().out)["evaluation"]
    assert argmax["containers_device_bytes"] == 64 * 12 * 8 + 64 * 12 * 8 + 64 * 4


@pytest.mark.parametrize("argv,message", [
    (["--eval-samples", "10"], "--eval-samples needs --seq-len"),
    (["--eval-samples", "10", "--seq-len", "8", "--training-args", "no/such/file.json"], "no/such/file.json could not be read"),
    (["--eval-samples", "10", "--seq-len", "8", "--host-memory", "lots"], "lots"),
])
def test_bad_evaluation_options_are_one_line_and_exit_2(tiny_llama_dir: str, capsys: Any, argv: Any,
                                                         message: str) -> None:
    assert main(["estimate", tiny_llama_dir] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_evaluation_on_cuda_is_answered_by_the_allocator_replay(tiny_llama_dir: str, capsys: Any) -> None:
    argv = ["estimate", tiny_llama_dir, "--eval-samples", "64", "--seq-len", "12", "--eval-batch-size", "4",
            "--attn-implementation", "eager", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["evaluation"]
    context = plan["cuda_context_bytes"]
    assert context == 446_693_376 and plan["device_total_bytes"] == plan["reserved_peak_bytes"] + context
    room = context + plan["reserved_peak_bytes"]
    assert main(argv + ["--device-memory", f"{room}B"]) == 0
    assert json.loads(capsys.readouterr().out)["evaluation"]["fits_device"] is True
    # Room for the device peak beside the context, not for the segments it needs: does not fit.
    assert plan["device_peak_bytes"] < 2 * 1024 ** 2 <= plan["reserved_peak_bytes"]
    assert main(argv + ["--device-memory", f"{context + plan['device_peak_bytes']}B"]) == 3
    assert json.loads(capsys.readouterr().out)["evaluation"]["fits_device"] is False
