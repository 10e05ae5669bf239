"""`trainer-memcb estimate` answers exactly or refuses in one line: sizes, process counts, options
without effect, a step that cannot be traced, the exit status of "fits?", --reserve and what the
step plan does not count.

Each case runs `main([...])` in this process (the console script's own behaviour, the usage lines
and Ctrl-C, is in test_console_script.py) and asserts the exact line and exit code.
"""

from __future__ import annotations

import json
import sys
from typing import List, Tuple

import pytest
import torch
from transformers import LlamaConfig

from helpers import made_step_plan, requires_transformers, tiny_llama_folder

from trainer_memcb.cli import main
from trainer_memcb.plan.answers.step_memory import NOT_COUNTED, StepMemoryPlan
from trainer_memcb.plan.answers.max_batch import max_batch_size
from trainer_memcb.utils.name_lists import name_list
from trainer_memcb.utils.units import parse_size

TINY_DISTILBERT = "examples/models/tiny-distilbert"


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    # A vocabulary large beside the rest: at one token the step's peak is in the optimizer step.
    return tiny_llama_folder(tmp_path_factory, "tiny-llama", vocab_size=1024)


@pytest.fixture(scope="module")
def untraceable_dir(tmp_path_factory) -> str:
    # Dynamic NTK rope scaling compares the largest position with the cached length, a value read
    # that fake tensors cannot answer, so the fake step fails today. Should a release trace it, the
    # tests below fail at their first assertion and need another untraceable model.
    folder = tmp_path_factory.mktemp("tiny-dynamic-rope")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


def run(argv: List[str], capsys) -> Tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(argv: List[str], capsys, expected_code: int = 0) -> dict:
    code, out, err = run(argv + ["--json"], capsys)
    assert code == expected_code, err
    return json.loads(out)


# -- a step that cannot be traced -------------------------------------------------------------------


def test_max_batch_size_of_a_step_that_cannot_be_traced_says_so_and_why(untraceable_dir, capsys):
    argv = ["estimate", untraceable_dir, "--optimizers", "adamw", "--max-batch-size", "--seq-len", "8",
            "--device-memory", "1GiB", "--reserve", "0B"]
    document = run_json(argv, capsys, expected_code=5)
    problem = document["answers"]["largest_batch"]["problem"]
    assert problem.startswith("at batch 1 the step cannot run under fake tensors (DataDependentOutputException: "
                              "aten._local_scalar_dense.default)")
    assert document["answers"]["largest_batch"]["max_batch_size"] is None
    assert document["answers"]["largest_batch"]["searched"] == [{"batch_size": 1, "peak_bytes": None, "reserved_peak_bytes": None,
                                     "device_total_bytes": None, "fits": None}]
    code, out, err = run(argv, capsys)
    assert (code, err) == (5, "")
    assert f"No largest batch: {problem}; only the model states are planned" in out.splitlines()
    assert "No batch fits" not in out


def _plan(batch: int, peak) -> StepMemoryPlan:
    return made_step_plan(batch, peak, activations_peak_bytes=None if peak is None else batch,
                          problem="the step cannot run under fake tensors (X)" if peak is None else None)


def test_a_missing_peak_is_never_read_as_does_not_fit():
    # Batches 1 and 2 trace, batch 3 and above do not (as a data-dependent shape might): the search
    # stops at the first plan without a peak and gives no answer, rather than "2 is the largest".
    found, plans = max_batch_size(lambda batch: _plan(batch, 100 * batch if batch < 3 else None), 10**6, limit=64)
    assert found is None
    assert plans[-1].step.problem is not None and all(plan.step.peak_bytes is not None for plan in plans[:-1])


@pytest.mark.parametrize("first,unit,largest", [(1, 1, 1000), (2, 1, 1000), (4, 4, 1000), (6, 6, 996), (2, 3, 998)])
def test_the_search_plans_only_the_batches_the_trainer_takes(first, unit, largest):
    """A peak of 10 bytes a sample in 10,000: the largest batch of `first`, `first + unit`, ... that
    fits, every batch planned one of them (TRL's KTO from 2, GRPO's and RLOO's whole groups)."""
    asked = []

    def plan_at(batch):
        asked.append(batch)
        return _plan(batch, 10 * batch)

    found, plans = max_batch_size(plan_at, 10_000, first=first, unit=unit)
    assert found == largest
    assert asked[0] == first and all((batch - first) % unit == 0 for batch in asked)
    assert [plan.settings.batch_size for plan in plans] == sorted(set(asked))
    assert found + unit in asked  # the batch above it was planned, and does not fit


# -- sizes, process counts ------------------------------------------------------------------------

UNITS = "(units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"


@pytest.mark.parametrize("option", ["--device-memory", "--reserve"])
@pytest.mark.parametrize("text,line", [
    ("80", f"size '80' has no unit: write 80GiB, 80GB, or 80B for bytes {UNITS}"),
    ("1e400GiB", "size '1e400GiB' is larger than any device: at most 16 EiB (18,446,744,073,709,551,616 bytes)"),
    ("1e999999999999TB", "size '1e999999999999TB' is larger than any device: at most 16 EiB "
                         "(18,446,744,073,709,551,616 bytes)"),
    ("-1GiB", "size '-1GiB' is negative: give a size of at least 0B"),
    ("infGiB", f"size 'infGiB' is not a size such as 80GiB, 40GB or 512B {UNITS}"),
    ("80 apples", f"size '80 apples' is not a size such as 80GiB, 40GB or 512B {UNITS}"),
])
def test_a_size_without_a_unit_or_out_of_range_is_one_line(option, text, line, capsys):
    # OPTION=VALUE, so that argparse reads "-1GiB" as the option's value rather than as an option.
    code, out, err = run(["estimate", TINY_DISTILBERT, "--device-memory", "80GiB", f"{option}={text}"], capsys)
    assert (code, out, err) == (2, "", f"trainer-memcb: error: argument {option}: {line}\n")


def test_every_size_follows_the_same_rule_in_python():
    from trainer_memcb.utils.units import parse_bytes

    assert parse_size("80GiB") == parse_bytes("80GiB") == 80 * 2**30 and parse_size(4096) == parse_bytes(4096) == 4096
    assert parse_size("0.5KiB") == 512 and parse_size("1.1GiB") == 1_181_116_006  # fractions of a byte dropped
    for text in ("4096", "nan", "1e400GiB"):
        with pytest.raises(ValueError, match=repr(text)):
            parse_bytes(text)


@pytest.mark.parametrize("option,value", [("--world-size", "0"), ("--nodes", "0"), ("--world-size", "-1"),
                                          ("--nodes", "two")])
def test_zero_processes_are_refused_like_negative_ones(option, value, capsys):
    code, out, err = run(["estimate", TINY_DISTILBERT, f"{option}={value}"], capsys)
    assert (code, out, err) == (2, "", f"trainer-memcb: error: argument {option}: {value!r} is not a positive "
                                       "integer, e.g. 8\n")


# -- models ---------------------------------------------------------------------------------------


def test_a_parameter_count_cannot_be_traced(capsys, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):  # the step of a count must be refused before any config is looked up
        raise AssertionError(f"a config was looked up: {args}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    code, out, err = run(["estimate", "7.5e9", "--batch-size", "2", "--seq-len", "8"], capsys)
    assert (code, out) == (2, "")
    assert err == ("trainer-memcb: error: a parameter count (7,500,000,000) cannot be traced: the step plan "
                   "(--batch-size, --max-batch-size) runs the model's forward and backward, so it needs a model "
                   "config, a folder holding config.json\n")


def test_a_config_whose_architectures_is_not_a_model_class_is_one_line(tmp_path, capsys):
    with open(f"{TINY_DISTILBERT}/config.json") as handle:
        config = json.load(handle)
    config["architectures"] = ["TextStreamer"]  # a transformers class, not a model
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run(["estimate", str(tmp_path)], capsys)
    assert (code, out) == (1, "")
    assert err == (f"trainer-memcb: {tmp_path}: the config's architectures names TextStreamer, which is not a model "
                   "class (a subclass of transformers.PreTrainedModel): give --architecture CLASS, e.g. "
                   "LlamaForCausalLM\n")


def test_a_config_json_path_is_read_as_its_folder(capsys):
    folder = run_json(["estimate", TINY_DISTILBERT, "--optimizers", "adamw"], capsys)
    file = run_json(["estimate", f"{TINY_DISTILBERT}/config.json", "--optimizers", "adamw"], capsys)
    assert file["model"] == f"{TINY_DISTILBERT}/config.json"
    assert {**file, "model": folder["model"]} == folder
    assert folder["total_params"] == 454_530


# -- options without effect -------------------------------------------------------------------------


@pytest.mark.parametrize("argv,line", [
    (["--seq-len", "2048"], "--seq-len has no effect without --batch-size, --max-batch-size (the step plan) or --eval-samples"),
    (["--gradient-checkpointing"], "--gradient-checkpointing has no effect without --batch-size or --max-batch-size "
                                   "(the step plan)"),
    (["--attn-implementation", "eager"], "--attn-implementation has no effect without --batch-size, "
                                         "--max-batch-size (the step plan) or --eval-samples"),
    (["--device-type", "cpu"], "--device-type has no effect without --batch-size, --max-batch-size (the step plan) "
                               "or --eval-samples"),
    (["--reserve", "1GiB"], "--reserve has no effect without --device-memory (the reserve is taken from it)"),
    (["--world-size", "2", "--reserve", "1GiB"], "--reserve has no effect without --device-memory (the reserve is "
                                                 "taken from it)"),
    (["--device-memory", "256MiB"], "the CUDA context of 426.0 MiB leaves nothing of --device-memory 256.0 MiB: give "
                                    "a smaller --reserve (0B for none)"),
    # A context exactly as large as the memory leaves 0 bytes: refused too, never "fits? against 0 B".
    (["--device-memory", "426MiB"], "the CUDA context of 426.0 MiB leaves nothing of --device-memory 426.0 MiB: give "
                                    "a smaller --reserve (0B for none)"),
    (["--device-memory", "430MiB", "--reserve", "4MiB"], "--reserve 4.0 MiB with the CUDA context leaves nothing of "
                                                          "--device-memory 430.0 MiB: give a smaller --reserve (0B for "
                                                          "none)"),
    # With --eval-samples, --seq-len and --attn-implementation shape the evaluation's batches; the
    # training step's own options still need the step plan.
    (["--eval-samples", "8", "--seq-len", "8", "--gradient-checkpointing"],
     "--gradient-checkpointing has no effect without --batch-size or --max-batch-size (the step plan)"),
])
def test_options_without_effect_are_refused(argv, line, capsys):
    code, out, err = run(["estimate", TINY_DISTILBERT, *argv], capsys)
    assert (code, out, err) == (2, "", f"trainer-memcb: error: {line}\n")


# -- list-or-string arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [{"optimizer_state_bytes": 1}, {"optimizer_state_bytes"}, 3])
def test_a_dict_or_a_set_is_not_a_list_of_names(value):
    with pytest.raises(ValueError, match=r"expected some of .* \(a list or tuple, or one comma-separated string\)"):
        name_list(value, "eval_keys", ["optimizer_state_bytes"])


def test_the_callback_refuses_a_dict_of_keys():
    from trainer_memcb import OptimizerMemoryCallback

    for argument in ("eval_keys", "train_keys", "what_if", "breakdown"):
        with pytest.raises(ValueError, match=f"^{argument}="):
            OptimizerMemoryCallback(**{argument: {"optimizer_state_bytes": 1}})


def test_optimizer_names_refuse_a_dict():
    from trainer_memcb.plan.optimizers.whatif import resolve_optimizer_names

    with pytest.raises(ValueError, match=r"^optimizers=\{'adamw': 1\}: expected optimizer names"):
        resolve_optimizer_names({"adamw": 1})


# -- packages -------------------------------------------------------------------------------------


def test_a_missing_peft_exits_4_naming_the_extra(capsys, monkeypatch):
    # peft is installed here; `None` in sys.modules makes `import peft` fail as if it were not.
    monkeypatch.setitem(sys.modules, "peft", None)
    code, out, err = run(["estimate", TINY_DISTILBERT, "--lora-r", "8"], capsys)
    assert (code, out) == (4, "")
    assert err == 'trainer-memcb: LoRA adapters need the peft package, not installed here: pip install "trainer_memcb[peft]"\n'


@requires_transformers("5.0", "transformers.trainer_optimizer, whose torchao check the test makes fail")
def test_the_8bit_torchao_optimizer_gets_its_own_reason(monkeypatch):
    # torchao is installed here: its absence is simulated for transformers' check and for the import.
    import transformers.trainer_optimizer as handlers
    from transformers import TrainingArguments

    from trainer_memcb.plan.model.stand_ins import meta_stand_in
    from trainer_memcb.plan.optimizers.trainer_optimizers import OptimizerUnavailable, build_trainer_optimizer

    monkeypatch.setattr(handlers, "is_torchao_available", lambda *args, **kwargs: False)
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(OptimizerUnavailable) as raised:
        build_trainer_optimizer("adamw_torch_8bit", TrainingArguments("unused", report_to=[]),
                                meta_stand_in(torch.nn.Linear(4, 2)))
    assert raised.value.problem.startswith("needs the torchao package, not installed here (You need to have "
                                           "`torchao>=0.4.0` in order to use torchao's 8-bit AdamW (adamw_torch_8bit).")
    assert "4-bit" not in raised.value.problem


# -- fits? as the exit status, the reserve, what is not counted ---------------------------------------


def test_the_exit_status_answers_fits_for_the_model_states(capsys):
    # tiny-distilbert with AdamW: 7,272,640 bytes of model states; Adafactor 3,673,536. The CUDA
    # context (426 MiB without --gpu, 446,693,376 bytes) is taken from the memory first.
    context = 446_693_376
    base = ["estimate", TINY_DISTILBERT, "--optimizers", "adamw", "--device-memory"]
    assert run_json(base + [f"{context + 7272640}B"], capsys)["optimizers"][0]["margin_bytes"] == 0
    document = run_json(base + [f"{context + 7272640}B", "--reserve", "1B"], capsys, expected_code=3)
    assert (document["device_memory_bytes"], document["reserve_bytes"]) == (context + 7_272_640, 1)
    assert document["cuda_context_bytes"] == context
    assert document["optimizers"][0]["margin_bytes"] == -1
    # Several optimizers: 3 when any of them does not fit.
    code, out, _ = run(["estimate", TINY_DISTILBERT, "--optimizers", "adamw,adafactor", "--device-memory", "431MiB"],
                       capsys)
    assert code == 3 and "fits, 1.5 MiB (1,569,344) to spare" in out and "does not fit, 1.9 MiB (2,029,760) short" in out
    # Without --device-memory no question is asked: 0.
    assert run(["estimate", TINY_DISTILBERT, "--world-size", "2"], capsys)[0] == 0


def test_the_step_plan_answers_fits_against_the_memory_less_the_reserve(tiny_llama_dir, capsys):
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw", "--batch-size", "1", "--seq-len", "1",
            "--attn-implementation", "eager", "--device-type", "cpu"]
    document = run_json(argv, capsys)
    peak = document["step"]["peak_bytes"]
    assert (document["device"]["reserve_bytes"], document["device"]["not_counted"]) == (None, list(NOT_COUNTED["cpu"]))
    fits = run_json(argv + ["--device-memory", f"{peak + 100}B", "--reserve", "100B"], capsys)
    assert (fits["answers"]["fits"], fits["answers"]["margin_bytes"], fits["device"]["reserve_bytes"],
            fits["device"]["device_memory_bytes"]) == (True, 0, 100, peak + 100)
    short = run_json(argv + ["--device-memory", f"{peak + 100}B", "--reserve", "101B"], capsys, expected_code=3)
    assert (short["answers"]["fits"], short["answers"]["margin_bytes"]) == (False, -1)
    # With --device-type cpu the default reserve is 0.
    assert run_json(argv + ["--device-memory", f"{peak}B"], capsys)["device"]["reserve_bytes"] == 0


def test_the_default_reserve_on_cuda_and_the_step_table_say_what_is_not_counted(tiny_llama_dir, capsys):
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw", "--batch-size", "1", "--seq-len", "1",
            "--device-memory", "2GiB"]
    document = run_json(argv, capsys)
    device = document["device"]
    assert (document["settings"]["device_type"], device["reserve_bytes"], device["cuda_context_bytes"]) == \
        ("cuda", 0, 446_693_376)
    assert document["answers"]["margin_bytes"] == 2**30 * 2 - 446_693_376 - device["reserved_peak_bytes"]
    assert device["not_counted"] == list(NOT_COUNTED["cuda"])
    code, out, _ = run(argv, capsys)
    lines = out.splitlines()
    assert code == 0
    assert ("Not counted, left to --reserve: " + "; ".join(NOT_COUNTED["cuda"])) in lines
    assert [line.split() for line in lines if line.startswith(("reserve", "fits? against", "device memory",
                                                               "CUDA context"))][:4] == [
        ["device", "memory", "2.00", "GiB", "(2,147,483,648)"], ["CUDA", "context", "426.0", "MiB", "(446,693,376)"],
        ["reserve", "(--reserve)", "0", "B", "(0)"], ["fits?", "against", "1.58", "GiB", "(1,700,790,272)"]]


def test_the_model_states_table_alone_shows_the_cuda_context_its_fits_is_answered_without(tiny_llama_dir, capsys):
    code, out, _ = run(["estimate", tiny_llama_dir, "--optimizers", "adamw", "--device-memory", "2GiB"], capsys)
    assert code == 0
    assert [line.split() for line in out.splitlines() if line.startswith(("reserve", "fits? against", "device memory",
                                                                          "CUDA context"))] == [
        ["device", "memory", "2.00", "GiB", "(2,147,483,648)"], ["CUDA", "context", "426.0", "MiB", "(446,693,376)"],
        ["reserve", "(--reserve)", "0", "B", "(0)"], ["fits?", "against", "1.58", "GiB", "(1,700,790,272)"]]


def test_max_batch_size_exits_3_when_no_batch_fits(tiny_llama_dir, capsys):
    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw", "--max-batch-size", "--seq-len", "1",
            "--device-memory", "427MiB"]  # 1 MiB beside the CUDA context: not the cuBLAS workspaces
    document = run_json(argv, capsys, expected_code=3)
    assert (document["answers"]["largest_batch"]["max_batch_size"], document["answers"]["largest_batch"]["problem"]) == (None, None)
    code, out, _ = run(argv, capsys)
    assert code == 3 and "No batch fits (not even 1)" in out.splitlines()


def test_max_batch_size_is_answered_against_the_memory_less_the_reserve(tiny_llama_dir, capsys):
    # At 8 tokens the peak is in the optimizer step and grows by the batch's 192 bytes per sample
    # (input ids, labels and mask: 3 x 8 x int64): batch 2's peak plus a 1,000-byte reserve.
    step = ["estimate", tiny_llama_dir, "--optimizers", "adamw", "--seq-len", "8", "--attn-implementation", "eager",
            "--device-type", "cpu"]
    two = run_json(step + ["--batch-size", "2"], capsys)["step"]["peak_bytes"]
    three = run_json(step + ["--batch-size", "3"], capsys)["step"]["peak_bytes"]
    assert three - two == 192
    search = step + ["--max-batch-size", "--device-memory", f"{two + 1000}B"]
    reserved = run_json(search + ["--reserve", "1000B"], capsys)
    assert reserved["answers"]["largest_batch"]["max_batch_size"] == 2
    searched = {plan["batch_size"]: plan["fits"] for plan in reserved["answers"]["largest_batch"]["searched"]}
    assert (searched[2], searched[3]) == (True, False)
    # Without the reserve the same memory holds 1,000 // 192 = 5 more samples.
    assert run_json(search + ["--reserve", "0B"], capsys)["answers"]["largest_batch"]["max_batch_size"] == 7


def test_the_step_plans_optimizer_state_is_the_model_states_tables(tiny_llama_dir, capsys):
    # bf16, one token: the peak is in the optimizer step, where all of the state is alive.
    document = run_json(["estimate", tiny_llama_dir, "--precision", "bf16", "--optimizers", "adamw", "--batch-size",
                         "1", "--seq-len", "1"], capsys)
    step, states = document["step"], document["model_states"]["optimizers"][0]
    assert step["peak_phase"] == "optimizer step"
    # 213,312 bf16 parameters x 2 moments x 2 bytes, and 21 fp32 `step` tensors. Before, the first
    # fake step's peak came before the no-decay group's state was made: 5 norm weights x 64 x 4 + 5 x 4
    # = 1,300 bytes less (for Llama-2-7B at 1 x 2048, 1,065,220 bytes: 65 norm weights of 4096).
    assert step["peak_parts"]["optimizer_state"] == states["optimizer_state_bytes"] == 213_312 * 4 + 21 * 4 == 853_332
