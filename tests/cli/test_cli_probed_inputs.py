"""`trainer-memcb estimate` on inputs found by probing the command: each is refused in one line
with the value and what is allowed (exit 2 for a flag, 1 for a config file), or planned as the
Trainer would run it, and answered before any heavy work where the refusal needs none."""

from __future__ import annotations

import json
from typing import Any, List

import pytest

from helpers import SMALLEST_LLAMA, one_line, smallest_llama, run_estimate, tiny_llama_folder

SAMPLES_MAX = 2**31 - 1  # trainer_memcb.utils.units.MAX_WHOLE_NUMBER


llama = smallest_llama


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: Any) -> str:
    return tiny_llama_folder(tmp_path_factory, "tiny-llama-probed", **SMALLEST_LLAMA)


run = run_estimate


# -- the evaluation's containers are computed without a step per batch ------------------------------


def test_the_most_evaluation_samples_are_planned_at_once(tiny_llama_dir: str, capsys: Any) -> None:
    # 2**31 - 1 samples in 268,435,456 batches of 8 (the last of 7): planned without a step per batch.
    code, out, _ = run([tiny_llama_dir, "--eval-samples", str(SAMPLES_MAX), "--seq-len", "8", "--device-type", "cpu",
                        "--json"], capsys)
    evaluation = json.loads(out)["answers"]["evaluation"]
    assert code == 0
    # Per sample: float32 logits 8 x 96 x 4 = 3,072 bytes, int64 labels 8 x 8 = 64, a float32 loss 4.
    assert evaluation["per_sample_bytes"] == {"preds": 3072, "labels": 64, "losses": 4}
    n = SAMPLES_MAX
    assert evaluation["containers_device_bytes"] == evaluation["containers_host_bytes"] == 3140 * n
    # The last batch's logits concatenation: the losses done (4n), the labels before it (64 x (n - 7)),
    # and the logits before it (n - 7 samples), the last batch's (7) and their concatenation (n).
    assert evaluation["concat_peak_bytes"] == 4 * n + 64 * (n - 7) + 3072 * ((n - 7) + 7 + n) == 13_340_168_414_716


# -- one parser, one range for every whole-number option --------------------------------------------


@pytest.mark.parametrize("option,least", [("--batch-size", 1), ("--seq-len", 1), ("--eval-samples", 1),
                                          ("--eval-batch-size", 1), ("--eval-accumulation-steps", 1),
                                          ("--gradient-accumulation-steps", 1), ("--world-size", 1), ("--nodes", 1),
                                          ("--lora-r", 1), ("--target-len", 1), ("--image-size", 1),
                                          ("--replicate", 1), ("--max-proposals", 1), ("--rank", 0),
                                          ("--padding", 0)])
def test_a_whole_number_past_the_range_is_a_usage_error(tiny_llama_dir: str, capsys: Any, option: str,
                                                        least: int) -> None:
    code, out, err = run([tiny_llama_dir, "--seq-len", "8", option, "99999999999999999999999"], capsys)
    assert one_line(err) == (f"trainer-memcb: error: argument {option}: '99999999999999999999999' is too large: give a "
                             f"whole number from {least} to 2,147,483,647")
    assert (code, out) == (2, "")


def test_the_largest_batch_taken_is_planned_and_one_more_refused(tiny_llama_dir: str, capsys: Any) -> None:
    code, _, err = run([tiny_llama_dir, "--seq-len", "8", "--batch-size", str(2**31)], capsys)
    assert (code, one_line(err)) == (2, "trainer-memcb: error: argument --batch-size: '2147483648' is too large: give "
                                        "a whole number from 1 to 2,147,483,647")
    code, _, err = run([tiny_llama_dir, "--seq-len", "8", "--batch-size", "0"], capsys)
    assert (code, one_line(err)) == (2, "trainer-memcb: error: argument --batch-size: '0' is not a positive integer, "
                                        "e.g. 8")


def test_the_package_has_one_whole_number_parser() -> None:
    import argparse
    import pathlib

    import trainer_memcb.cli
    from trainer_memcb.cli.choices import non_negative_int, positive_int
    from trainer_memcb.cli.estimate_options import add_estimate_arguments

    for path in pathlib.Path(trainer_memcb.cli.__file__).parent.glob("*.py"):
        assert "int(text)" not in path.read_text(), path.name  # no parser of its own
    parser = argparse.ArgumentParser()
    add_estimate_arguments(parser)
    types = {action.dest: action.type for action in parser._actions}
    assert {name for name, kind in types.items() if kind in (positive_int, non_negative_int)} == {
        "batch_size", "seq_len", "eval_samples", "eval_batch_size", "eval_accumulation_steps",
        "gradient_accumulation_steps", "world_size", "nodes", "lora_r", "target_len", "image_size", "replicate",
        "max_proposals", "rank", "padding", "packing"}


# -- sizes: a byte count is whole -----------------------------------------------------------------


@pytest.mark.parametrize("option,text", [("--device-memory", "1.5B"), ("--reserve", "0.5B"), ("--device-memory", "1.5 b")])
def test_a_fraction_of_a_byte_is_refused(tiny_llama_dir: str, capsys: Any, option: str, text: str) -> None:
    argv = [tiny_llama_dir, "--device-memory", "80GiB", option, text] if option == "--reserve" else [tiny_llama_dir, option, text]
    code, out, err = run(argv, capsys)
    assert one_line(err) == (f"trainer-memcb: error: argument {option}: size {text!r} is not a whole number of bytes: "
                             "write a whole count of B, or a larger unit such as 1.5GiB, 40GB or 512KiB (units: B, KiB, "
                             "MiB, GiB, TiB, KB, MB, GB, TB)")
    assert (code, out) == (2, "")


def test_a_fraction_of_a_larger_unit_keeps_working(tiny_llama_dir: str, capsys: Any) -> None:
    code, out, _ = run([tiny_llama_dir, "--device-memory", "1.5GiB", "--reserve", "12B", "--optimizers", "adamw",
                        "--json"], capsys)
    document = json.loads(out)
    assert code == 0
    assert (document["device_memory_bytes"], document["reserve_bytes"]) == (1_610_612_736, 12)


# -- a config's architectures entry: the class it names, or a refusal ---------------------------------


@pytest.mark.parametrize("plan", [[], ["--batch-size", "2", "--seq-len", "8"], ["--eval-samples", "4", "--seq-len", "8"]])
def test_a_misspelled_architecture_is_refused_with_the_close_classes(tmp_path: Any, capsys: Any,
                                                                     plan: List[str]) -> None:
    import transformers

    llama(architectures=["LlamaForCausalLN"]).save_pretrained(tmp_path)
    code, out, err = run([str(tmp_path)] + plan, capsys)
    line = one_line(err)
    assert line.startswith(f"trainer-memcb: {tmp_path}: the config's architectures names 'LlamaForCausalLN', which "
                           f"transformers {transformers.__version__} has no class of (close: LlamaForCausalLM")
    assert line.endswith("): correct it, or give --architecture CLASS")
    assert (code, out) == (1, "")
    # --architecture names the class instead; the config's own is then not read.
    code, out, _ = run([str(tmp_path), "--architecture", "LlamaForCausalLM", "--json"], capsys)
    assert code == 0 and json.loads(out)["total_params"] == 16480


# -- a config's counts and sizes ----------------------------------------------------------------------


@pytest.mark.parametrize("key,value,least", [("num_hidden_layers", -2, 1), ("num_hidden_layers", 0, 1),
                                             ("num_attention_heads", -1, 1), ("intermediate_size", -64, 0)])
@pytest.mark.parametrize("plan", [[], ["--batch-size", "2", "--seq-len", "8"]])
def test_a_config_of_no_layers_or_a_negative_size_is_refused(tmp_path: Any, capsys: Any, key: str, value: int,
                                                             least: int, plan: List[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    document = llama().to_dict()
    document[key] = value
    (folder / "config.json").write_text(json.dumps(document))
    code, out, err = run([str(folder)] + plan, capsys)
    why = " (a model of no layers, heads or width is no model)" if least else " (a count or a size is never negative)"
    assert one_line(err) == (f"trainer-memcb: {folder}: its config has {key}={value}: expected a whole number of at "
                             f"least {least}{why}")
    assert (code, out) == (1, "")


# -- a negative margin keeps its sign in both figures -------------------------------------------------


def test_the_fit_tables_negative_margin_is_signed_in_both_figures(tiny_llama_dir: str, capsys: Any) -> None:

    argv = [tiny_llama_dir, "--optimizers", "adamw_torch", "--seq-len", "8", "--device-type", "cpu", "--batch-size", "2",
            "--device-memory", "100KiB", "--fit", "--max-proposals", "2"]
    code, out, _ = run(argv + ["--json"], capsys)
    own = json.loads(out)["answers"]["fit"]["own"]
    assert own["fits"] is False and own["margin_bytes"] < 0
    code, out, _ = run(argv, capsys)
    [row] = [line for line in out.splitlines() if line.startswith("own ")]
    margin = own["margin_bytes"]
    from trainer_memcb.utils.units import format_bytes

    assert f"{format_bytes(margin)} ({margin:,})" in row and format_bytes(margin).startswith("-")
    assert f"({-margin:,})" not in row


# -- where --write-training-args cannot write is found before any planning ----------------------------


def _no_planning(monkeypatch: Any) -> None:
    # Every module that binds `estimate_model` at its import, imported first: a module imported for
    # the first time under the patch would keep the patched function after the test.
    import trainer_memcb.cli.estimate_model as model_module
    import trainer_memcb.cli.estimate_states as states_module
    import trainer_memcb.cli.estimate_step as step_module

    def planned(*_: Any, **__: Any) -> Any:
        raise AssertionError("planned before the destination was checked")

    monkeypatch.setattr(step_module, "estimate_step", planned)
    for module in (model_module, states_module, step_module):
        monkeypatch.setattr(module, "estimate_model", planned)


@pytest.mark.parametrize("option", ["--write-training-args", "--write-deepspeed"])
def test_a_folder_that_refuses_files_is_a_usage_error_before_planning(tiny_llama_dir: str, capsys: Any,
                                                                      monkeypatch: Any, option: str) -> None:
    import os

    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc, a folder no file can be made in")
    _no_planning(monkeypatch)
    code, out, err = run([tiny_llama_dir, "--seq-len", "8", "--batch-size", "2", "--device-memory", "1GiB", "--fit",
                          option, "/proc/args.json"], capsys)
    assert one_line(err) == ("trainer-memcb: error: /proc/args.json: cannot write in the folder /proc (No such file or "
                             "directory)")
    assert (code, out) == (2, "")


def test_a_folder_without_write_permission_is_a_usage_error_before_planning(tiny_llama_dir: str, tmp_path: Any,
                                                                            capsys: Any, monkeypatch: Any) -> None:
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes in any folder")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    _no_planning(monkeypatch)
    code, _, err = run([tiny_llama_dir, "--seq-len", "8", "--batch-size", "2", "--device-memory", "1GiB", "--fit",
                        "--write-training-args", str(folder / "args.json")], capsys)
    assert one_line(err) == (f"trainer-memcb: error: {folder / 'args.json'}: cannot write in the folder {folder} "
                             "(Permission denied)")
    assert code == 2
    assert os.listdir(folder) == []


# -- the settings files' values are checked before the model is built ---------------------------------


@pytest.mark.parametrize("content,plan,line", [
    ({"per_device_train_batch_size": -3}, ["--world-size", "2"],
     "training args {path!r}: per_device_train_batch_size=-3: expected a whole number of at least 1"),
    ({"per_device_train_batch_size": 2, "ddp_bucket_cap_mb": -1}, ["--world-size", "2"],
     "training args: ddp_bucket_cap_mb=-1: expected a finite number of megabytes above 0 (DDP makes buckets of "
     "int(bucket_cap_mb * 2**20) bytes)"),
    ({"per_device_train_batch_size": 2, "per_device_eval_batch_size": 0}, ["--eval-samples", "4"],
     "training args {path!r}: per_device_eval_batch_size=0: expected a whole number of at least 1"),
    ({"per_device_train_batch_size": 2, "eval_accumulation_steps": 0}, ["--eval-samples", "4"],
     "training args {path!r}: eval_accumulation_steps=0: expected a whole number of at least 1"),
])
def test_a_bad_training_args_value_is_refused_before_the_model_is_built(tiny_llama_dir: str, tmp_path: Any,
                                                                        capsys: Any, monkeypatch: Any, content: Any,
                                                                        plan: List[str], line: str) -> None:
    path = tmp_path / "args.json"
    path.write_text(json.dumps(content))
    _no_planning(monkeypatch)
    code, out, err = run([tiny_llama_dir, "--seq-len", "8", "--training-args", str(path)] + plan, capsys)
    assert one_line(err) == "trainer-memcb: " + line.format(path=str(path))
    assert (code, out) == (1, "")


def test_a_bad_deepspeed_value_is_refused_before_the_model_is_built(tiny_llama_dir: str, tmp_path: Any, capsys: Any,
                                                                    monkeypatch: Any) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}))
    _no_planning(monkeypatch)
    code, _, err = run([tiny_llama_dir, "--batch-size", "2", "--seq-len", "8", "--world-size", "2", "--deepspeed",
                        str(path)], capsys)
    assert one_line(err) == ("trainer-memcb: deepspeed config: zero_optimization.reduce_bucket_size=-5: expected a whole "
                             "number of at least 1, as DeepSpeedZeroConfig's reduce_bucket_size field takes")
    assert code == 1


# -- a 16-bit model under the Trainer's autocast keeps its 16-bit parameters ---------------------------


def test_a_float16_model_under_bf16_autocast_keeps_float16_parameters(tiny_llama_dir: str, capsys: Any) -> None:
    # accelerate's prepare_model casts no parameter under autocast (DDP or one process): 16,480
    # float16 parameters, their float16 gradients and AdamW's float16 moments.
    argv = [tiny_llama_dir, "--dtype", "float16", "--precision", "autocast-bf16", "--optimizers", "adamw_torch"]
    code, out, _ = run(argv + ["--json"], capsys)
    row = json.loads(out)["optimizers"][0]
    assert code == 0
    assert (row["params_bytes"], row["grads_bytes"], row["master_weights_bytes"]) == (16480 * 2, 16480 * 2, 0)
    code, out, _ = run(argv + ["--batch-size", "2", "--seq-len", "8", "--device-type", "cpu", "--json"], capsys)
    assert code == 0 and json.loads(out)["settings"]["param_dtype"] == "float16"
    # Under FSDP the Trainer's accelerate upcasts them to float32 ("FSDP upcast of low precision parameters").
    code, out, _ = run(argv + ["--world-size", "2", "--sharding", "fsdp-full-shard", "--json"], capsys)
    assert json.loads(out)["optimizers"][0]["params_bytes"] == 16480 * 4 // 2


def test_a_float16_model_under_fp16_autocast_is_refused_as_the_grad_scaler_refuses_it(tiny_llama_dir: str,
                                                                                       capsys: Any) -> None:
    code, out, err = run([tiny_llama_dir, "--dtype", "float16", "--precision", "autocast-fp16"], capsys)
    assert one_line(err) == ("trainer-memcb: error: --dtype float16 with --precision autocast-fp16: the Trainer's "
                             "GradScaler refuses float16 gradients (\"Attempting to unscale FP16 gradients.\"); give "
                             "--dtype float32 or bfloat16, --precision autocast-bf16, or --precision fp16 (trained in "
                             "float16 without autocast)")
    assert (code, out) == (2, "")
