"""`trainer-memcb estimate MODEL --eval-samples N --seq-len S`: the evaluation plan on the command
line, equal to what a real Trainer run with the same settings logs."""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from helpers import TRANSFORMERS_4
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main
from trainer_memcb.utils.units import format_bytes

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
    planned = json.loads(capsys.readouterr().out)["answers"]["evaluation"]
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
    plan = json.loads(capsys.readouterr().out)["answers"]["evaluation"]
    memory = plan["device_peak_bytes"] - 1
    assert main(argv + ["--device-memory", f"{memory}B", "--reserve", "0B", "--host-memory", "1GiB", "--json"]) == 3  # does not fit
    short = json.loads(capsys.readouterr().out)["answers"]["evaluation"]
    assert (short["fits_device"], short["fits_host"]) == (False, True)
    assert short["device_peak_bytes"] - short["device_memory_bytes"] == 1
    assert main(argv + ["--device-memory", f"{memory}B", "--reserve", "0B", "--host-memory", "1GiB"]) == 3
    out = capsys.readouterr().out
    assert "does not fit, " in out and "fits, " in out
    why = [line for line in out.splitlines() if line.startswith("Why: ")]
    assert len(why) == 1
    assert "eval_accumulation_steps=" in why[0] and "preprocess_logits_for_metrics" in why[0]
    assert main(argv + ["--device-memory", f"{memory}B", "--reserve", "0B", "--eval-accumulation-steps", "1", "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)["answers"]["evaluation"]
    assert fixed["fits_device"] is True and fixed["advice"] == []
    # full logits: 64 x 12 x 96 x 4 bytes; argmax keeps 64 x 12 int64
    assert plan["containers_device_bytes"] == 64 * 12 * 96 * 4 + 64 * 12 * 8 + 64 * 4
    assert main(argv + ["--eval-logits", "argmax", "--json"]) == 0
    argmax = json.loads(capsys.readouterr().out)["answers"]["evaluation"]
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
    plan = json.loads(capsys.readouterr().out)["answers"]["evaluation"]
    context = plan["cuda_context_bytes"]
    assert context == 446_693_376 and plan["device_total_bytes"] == plan["reserved_peak_bytes"] + context
    room = context + plan["reserved_peak_bytes"]
    assert main(argv + ["--device-memory", f"{room}B"]) == 0
    assert json.loads(capsys.readouterr().out)["answers"]["evaluation"]["fits_device"] is True
    # Room for the device peak beside the context, not for the segments it needs: does not fit.
    assert plan["device_peak_bytes"] < 2 * 1024 ** 2 <= plan["reserved_peak_bytes"]
    assert main(argv + ["--device-memory", f"{context + plan['device_peak_bytes']}B"]) == 3
    assert json.loads(capsys.readouterr().out)["answers"]["evaluation"]["fits_device"] is False


# -- one answer to fits?: the evaluation plan, its Why: line and --fit's table ---------------------

# 2,000 samples of 12 tokens at eval batch 16 (18,946,912 bytes at the device peak; the allocator
# reserves 20,971,520) on a device of 440 MiB: 14,680,064 bytes left beside the CUDA context
# (446,693,376, the default's).
FIT = ["--eval-samples", "2000", "--seq-len", "12", "--attn-implementation", "eager", "--eval-batch-size", "16"]
USABLE_440 = 440 * 2**20 - 446_693_376


def _json(argv: Any, capsys: Any, code: Optional[int]) -> Any:
    returned = main(argv + ["--json"])
    assert code is None or returned == code
    return json.loads(capsys.readouterr().out)


def test_the_fit_tables_own_row_is_the_evaluation_plans_fits(tiny_llama_dir: str, capsys: Any) -> None:
    # Before, --fit's own row compared the device peak with the memory less the reserve only:
    # "yes", 442,413,568 bytes to spare, where the plan said does not fit, 6,291,456 short.
    argv = ["estimate", tiny_llama_dir] + FIT + ["--device-memory", "440MiB", "--fit"]
    found = _json(argv, capsys, 0)
    plan, fit = found["answers"]["evaluation"], found["answers"]["evaluation_fit"]
    assert USABLE_440 == 14_680_064
    assert (plan["fits_device"], plan["usable_device_bytes"], plan["reserved_peak_bytes"]) == (False, USABLE_440, 20_971_520)
    assert plan["device_margin_bytes"] == USABLE_440 - 20_971_520 == -6_291_456
    assert fit["usable_bytes"] == USABLE_440
    assert (fit["own"]["fits"], fit["own"]["peak_bytes"], fit["own"]["margin_bytes"]) == (False, 20_971_520, -6_291_456)
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.startswith("fits on the device?")).endswith(
        "does not fit, 6.0 MiB (6,291,456) short")
    assert next(line for line in lines if line.startswith("own ")).split()[-6:-2] == [
        "no", "-6.0", "MiB", "(-6,291,456)"]


@pytest.mark.parametrize("step", [[], ["--batch-size", "1"]], ids=["alone", "inside-train"])
def test_each_proposal_said_to_fit_fits_when_planned_on_its_own(tiny_llama_dir: str, capsys: Any, step: Any) -> None:
    # Before, on 440 MiB every proposal was "yes" (its device peak under the memory, the context
    # ignored); now each row is its own evaluation plan's answer, inside train() too (--batch-size:
    # the optimizer state stays alive beside it).
    argv = ["estimate", tiny_llama_dir] + FIT + ["--device-memory", "440MiB"] + step
    # Inside train() the exit status is the training search's too: no training setting fits 440 MiB.
    fit = _json(argv + ["--fit"], capsys, 3 if step else 0)["answers"]["evaluation_fit"]
    said = {json.dumps(c["training_args"], sort_keys=True): (c["fits"], c["margin_bytes"]) for c in fit["candidates"]}
    assert sum(fits for fits, _ in said.values()) == 7 and len(said) == 12
    for candidate in fit["candidates"]:
        settings = candidate["training_args"]
        flags = ["--eval-batch-size", str(settings["per_device_eval_batch_size"])]
        if "eval_accumulation_steps" in settings:
            flags += ["--eval-accumulation-steps", str(settings["eval_accumulation_steps"])]
        # Inside train() the exit status is the training step's too (it does not fit 14 MiB).
        plan = _json(argv + flags, capsys, (0 if candidate["fits"] else 3) if not step else 3)["answers"]["evaluation"]
        assert (plan["fits_device"], plan["device_margin_bytes"]) == (candidate["fits"], candidate["margin_bytes"])
    first = fit["candidates"][0]
    assert (first["changes"], first["fits"], first["peak_bytes"], first["margin_bytes"]) == (
        {"eval_accumulation_steps": 4}, True, 2_097_152, USABLE_440 - 2_097_152)


def test_when_nothing_fits_it_says_so_and_writes_nothing(tiny_llama_dir: str, capsys: Any, tmp_path: Any) -> None:
    # 427 MiB leaves 1 MiB beside the context: not even one 2 MiB segment. Before, every proposal
    # was "yes" and the first was written.
    written = tmp_path / "eval-args.json"
    argv = ["estimate", tiny_llama_dir] + FIT + ["--device-memory", "427MiB", "--fit", "--write-training-args", str(written)]
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert "  yes  " not in captured.out and not written.exists()
    assert captured.err.splitlines() == [
        "trainer-memcb: nothing written: no proposal fits",
        "trainer-memcb: nothing fits: the nearest is eval_accumulation_steps 1, at 2.0 MiB per process, 1.0 MiB over "
        "1.0 MiB"]
    why = next(line for line in captured.out.splitlines() if line.startswith("Why: "))
    assert why.endswith("; no eval setting alone makes it fit.")


def test_the_why_line_names_the_figures_the_table_shows(tiny_llama_dir: str, capsys: Any) -> None:
    # Before: "evaluation needs 18.07 MiB ..., more than 12.07 MiB", a limit shown nowhere.
    assert main(["estimate", tiny_llama_dir] + FIT + ["--device-memory", "440MiB", "--fit"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split("  ")[-1].strip() for line in out.splitlines() if "  " in line}
    assert rows["device memory"] == "440.0 MiB (461,373,440)"
    assert rows["CUDA context"] == "426.0 MiB (446,693,376)"
    assert rows["reserve (your own margin)"] == "0 B (0)"
    assert rows["reserved peak (caching allocator)"] == "20.0 MiB (20,971,520)"
    assert rows["usable (device memory less CUDA context and reserve)"] == "14.0 MiB (14,680,064)"
    why = next(line for line in out.splitlines() if line.startswith("Why: "))
    assert why.startswith("Why: evaluation's reserved peak is 20.0 MiB, 6.0 MiB more than the 14.0 MiB usable (device "
                          "memory less CUDA context and reserve): ")
    assert ("Evaluation settings that fit in 14.0 MiB per process, the usable (device memory less CUDA context and "
            "reserve); peak: the reserved peak (caching allocator)") in out
    # On the CPU: the device peak against the memory less the reserve, one byte short of it (18,946,912
    # bytes on transformers 5).
    cpu = ["estimate", tiny_llama_dir] + FIT + ["--device-type", "cpu", "--reserve", "0B"]
    peak = _json(cpu + ["--device-memory", "1GiB"], capsys, 0)["answers"]["evaluation"]["device_figure_bytes"]
    memory = peak - 1
    assert main(cpu + ["--device-memory", f"{memory}B"]) == 3
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("usable (device memory less reserve)  "))
    assert row.endswith(f"{format_bytes(memory)} ({memory:,})")
    assert (f"Why: evaluation's device peak is {format_bytes(peak)}, 1 B more than the {format_bytes(memory)} usable "
            "(device memory less reserve): ") in out


def test_the_written_training_args_given_back_alone_plan_the_proposal(tiny_llama_dir: str, capsys: Any,
                                                                       tmp_path: Any) -> None:
    # Before, the written file held no per_device_train_batch_size, and --training-args asked for
    # the step plan: "--batch-size is needed", exit 2. The user's own file's other keys are kept.
    mine, written = tmp_path / "mine.json", tmp_path / "eval-args.json"
    mine.write_text(json.dumps({"per_device_eval_batch_size": 16, "eval_do_concat_batches": True}))
    common = ["estimate", tiny_llama_dir, "--eval-samples", "2000", "--seq-len", "12", "--attn-implementation", "eager",
              "--device-memory", "440MiB"]
    fit = _json(common + ["--training-args", str(mine), "--fit", "--write-training-args", str(written)], capsys,
                0)["answers"]["evaluation_fit"]
    first = fit["candidates"][0]
    assert json.loads(written.read_text()) == first["training_args"] == {
        "per_device_eval_batch_size": 16, "eval_do_concat_batches": True, "eval_accumulation_steps": 4}
    again = _json(common + ["--training-args", str(written)], capsys, 0)
    assert "step" not in again
    plan = again["answers"]["evaluation"]
    assert (plan["settings"]["batch_size"], plan["settings"]["accumulation_steps"]) == (16, 4)
    assert (plan["fits_device"], plan["device_figure_bytes"], plan["device_margin_bytes"]) == (
        True, first["peak_bytes"], first["margin_bytes"]) == (True, 2_097_152, USABLE_440 - 2_097_152)
