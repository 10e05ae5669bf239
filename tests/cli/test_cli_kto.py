"""`trainer-memcb estimate MODEL --trainer kto --training-args KTOCONFIG.json`: TRL's KTO step
planned from the user's KTOConfig, the same bytes as the Python plan of `tests/plan/test_kto_step.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, List

import pytest

from helpers import loaded_trl_config, requires_version, trl_config_files, valid_estimate_document

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "KTOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each bad KTOConfig, by name: its own fields.
BAD = {"loss": {"loss_type": "sigmoid"}, "sampling": {"beta": 0.1, "train_sampling_strategy": "random"},
       "sync": {"sync_ref_model": True, "precompute_ref_log_probs": True}, "beta": {"beta": "high"},
       "offload": {"activation_offloading": True}, "pad": {"pad_to_multiple_of": 64},
       "unbounded": {"max_length": None}, "moe": {"router_aux_loss_coef": 0.01}, "typo": {"desirable_weigth": 1.0},
       "trainer": {"per_device_train_batch_size": 2}, "one": {"beta": 0.1, "per_device_train_batch_size": 1}}


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> dict:
    from plan.test_kto_step import BATCH, MAX_LENGTH
    from trl import KTOConfig

    configs = {"kto": {}, "precomputed": {"precompute_ref_log_probs": True}, "apo": {"loss_type": "apo_zero_unpaired"},
               "synced": {"sync_ref_model": True}}
    return trl_config_files(tmp_path_factory, "kto-cli", KTOConfig, BATCH, MAX_LENGTH, configs, BAD)


def _argv(files: dict, config: str, *more: str) -> List[str]:
    return ["estimate", files["model"], "--trainer", "kto", "--training-args", files[config], "--seq-len", "32",
            "--device-type", "cpu", "--attn-implementation", "sdpa", *more]


@pytest.mark.parametrize("reference,config,more", [
    ("model", "kto", []), ("precomputed", "precomputed", []),
    ("adapters-disabled", "kto", ["--lora-r", "4", "--lora-target-modules", "q_proj,v_proj"])])
def test_the_command_plans_the_python_plans_kto_step(files: dict, capsys: Any, reference: str, config: str,
                                                     more: List[str]) -> None:
    from plan.test_kto_step import _planned

    from trainer_memcb.cli import main

    assert main(_argv(files, config, *more, "--json")) == 0
    document = json.loads(capsys.readouterr().out)
    planned = _planned(reference).step
    peak = {"model": 8_895_042, "precomputed": 8_803_794, "adapters-disabled": 8_534_670}[reference]
    assert document["step"]["peak_bytes"] == planned.peak_bytes == peak
    assert document["step"]["peak_parts"] == dict(planned.peak_parts)
    assert document["step"]["phases"] == planned.phases == [{"phase": "training", "peak_bytes": peak}]
    assert document["settings"]["preference"] == {"trainer": "kto", "reference": reference, "beta": 0.1,
                                                  "loss_type": ["kto"], "generation": None}
    # The frozen reference's parameters, fp32 as the policy's, in the model states.
    [states] = document["model_states"]["optimizers"]
    assert states["reference_model_bytes"] == (91_264 if reference == "model" else 0)


def test_apo_zero_unpaired_plans_no_kl_rows(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "apo", "--json")) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["step"]["peak_bytes"] == 8_893_506  # tests/plan/test_kto_step.py's "apo_zero_unpaired"
    assert document["settings"]["preference"]["loss_type"] == ["apo_zero_unpaired"]
    [note] = [note for note in document["step"]["notes"] if note.startswith("TRL's KTO step traced")]
    assert "no KL rows (loss_type apo_zero_unpaired)" in note


def test_the_table_names_the_trainer_and_the_references_share(files: dict) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", *_argv(files, "kto")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 1) for line in done.stdout.splitlines() if line.startswith("trainer ")]
    assert [row[1].strip() for row in rows] == [
        "TRL KTOTrainer, reference a frozen copy of the model, 89.1 KiB (91,264) of the peak"]
    [peak] = [line for line in done.stdout.splitlines() if line.startswith("step peak ")]
    assert peak.split(None, 2)[2].strip() == "8.5 MiB (8,895,042), in the backward"


@pytest.mark.parametrize("case,message", [
    (["--zero", "2"], "--trainer kto is planned on one process without sharding so far"),
    (["--reference-model"], "--reference-model with --trainer kto"),
    (["--fit"], "--fit needs --device-memory"),
    (["--fit", "--device-memory", "1GiB", "--write-deepspeed", "ds.json"], "--write-deepspeed with --trainer kto: the "
     "KTO step is planned on one process without DeepSpeed, so --fit proposes none; write the KTOConfig with "
     "--write-training-args"),
])
def test_refusals_before_the_file(files: dict, capsys: Any, case: List[str], message: str) -> None:
    from trainer_memcb.cli import main

    argv = ["estimate", files["model"], "--trainer", "kto", "--training-args", files["kto"], "--device-type", "cpu"]
    assert main(argv + ["--seq-len", "32", "--batch-size", "2"] + case) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("trainer-memcb: error: " + message), line


@pytest.mark.parametrize("config,code,line", [
    ("loss", 2, "--trainer kto: KTOConfig {loss!r}: loss_type 'sigmoid': TRL's KTOTrainer takes kto, apo_zero_unpaired"),
    ("sampling", 2, "--trainer kto: KTOConfig {sampling!r}: train_sampling_strategy 'random': TRL requires "
                    "'sequential' with loss_type 'kto' (its KL completions are paired within a fixed-order batch)"),
    ("sync", 2, "--trainer kto: KTOConfig {sync!r}: sync_ref_model and precompute_ref_log_probs: TRL refuses the two "
                "together"),
    ("beta", 2, "--trainer kto: KTOConfig {beta!r}: beta 'high': expected a number"),
    ("offload", 2, "--trainer kto: KTOConfig {offload!r}: activation_offloading true: the KTO step is planned "
                   "without offloading activations"),
    ("pad", 2, "--trainer kto: KTOConfig {pad!r}: pad_to_multiple_of 64: the KTO step is planned at max_length "
               "tokens unpadded ('auto' or null)"),
    ("unbounded", 2, "--trainer kto: KTOConfig {unbounded!r}: max_length None: the KTO step is planned at "
                     "max_length tokens; give one"),
    ("moe", 2, "--trainer kto: KTOConfig {moe!r}: router_aux_loss_coef 0.01: the KTO step is planned without a "
               "Mixture-of-Experts auxiliary loss"),
    ("typo", 1, "KTOConfig {typo!r}: 'desirable_weigth' is not a KTOConfig field (KTOConfig(**args) raises "
                "TypeError); did you mean 'desirable_weight'?"),
    ("trainer", 2, "--trainer kto: KTOConfig {trainer!r} names none of KTOConfig's own fields (beta, max_length, "
                   "loss_type, desirable_weight, ...): it is not a KTOConfig's JSON (write one with "
                   "KTOConfig(...).to_json_string())"),
    ("one", 2, "batch_size 1: TRL's KTOTrainer requires a micro-batch above 1 with loss_type 'kto' (its KL term is "
               "estimated from the batch's other rows)"),
])
def test_a_file_that_is_not_a_good_ktoconfig_is_one_line(files: dict, capsys: Any, config: str, code: int,
                                                         line: str) -> None:
    from trainer_memcb.cli import main

    more = [] if config == "one" else ["--batch-size", "2"]
    assert main(_argv(files, config, *more)) == code
    prefix = "trainer-memcb: error: " if code == 2 else "trainer-memcb: "
    assert capsys.readouterr().err.splitlines() == [prefix + line.format(**files)]


def test_fit_proposes_precomputed_reference_log_probs_and_writes_a_ktoconfig_that_replans_to_it(
        files: dict, capsys: Any, tmp_path: Any) -> None:
    """Between the step with its frozen reference (8,895,042 bytes) and without its forwards
    (8,803,794): TRL's precompute_ref_log_probs is proposed first (no reference forward in the step),
    checkpointing beside it; the KTOConfig written loads in KTOConfig, and planned again from it
    the step is the proposal's, to the byte."""
    from trl import KTOConfig

    from trainer_memcb.cli import main

    written = str(tmp_path / "fitted.json")
    argv = _argv(files, "kto", "--device-memory", "8850000B", "--reserve", "0B", "--fit", "--max-proposals", "2",
                 "--write-training-args", written, "--json")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    fit = valid_estimate_document(json.loads(out))["answers"]["fit"]
    assert (fit["fits_as_is"], fit["own"]["peak_bytes"]) == (False, 8_895_042)
    assert [(c["changes"], c["peak_bytes"], c["fits"]) for c in fit["candidates"]] == [
        ({"precompute_ref_log_probs": True}, 8_803_794, True), ({"gradient_checkpointing": True}, 8_624_834, True)]
    assert fit["candidates"][0]["relative_step_time"] < 1 < fit["candidates"][1]["relative_step_time"]
    assert err.splitlines()[-1] == (
        f"trainer-memcb: wrote {written}: KTOConfig of the reference's log-probs precomputed (TRL's "
        "precompute_ref_log_probs)")
    document, config = loaded_trl_config(written, KTOConfig, str(tmp_path / "out"))
    assert document == fit["candidates"][0]["training_args"]
    assert (config.precompute_ref_log_probs, config.beta, config.max_length) == (True, 0.1, 32)
    assert main(_argv(dict(files, written=written), "written", "--json")) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step"]["peak_bytes"] == 8_803_794 and again["settings"]["preference"]["reference"] == "precomputed"


def test_max_batch_size_searches_from_two_the_least_batch_ktos_kl_term_takes(files: dict, capsys: Any) -> None:
    """TRL's KTOTrainer refuses a micro-batch of 1 with its KL term: the search starts at 2 (the
    step of the file's own batch), then 3, which does not fit 10 MiB."""
    from trainer_memcb.cli import main

    argv = _argv(files, "kto", "--device-memory", "10MiB", "--reserve", "0B", "--max-batch-size", "--json")
    assert main(argv) == 0
    largest = valid_estimate_document(json.loads(capsys.readouterr().out))["answers"]["largest_batch"]
    assert largest["max_batch_size"] == 2
    assert [(b["batch_size"], b["peak_bytes"], b["fits"]) for b in largest["searched"]] == [
        (2, 8_895_042, True), (3, 13_155_733, False)]


def test_fit_halves_the_batch_no_further_than_two_and_proposes_peft_s_reference(files: dict, capsys: Any,
                                                                                tmp_path: Any) -> None:
    """At a batch of 4 in 9 MiB: micro-batches of 2 accumulated twice fit (a micro-batch of 1, which
    TRL refuses with the KL term, is never planned: the command would refuse it); with `--allow
    lora`, adapters whose reference is the policy with its adapters disabled, the step `--lora-r 16`
    plans. The KTOConfig written is the halved batch's, and replans to its bytes."""
    from trl import KTOConfig

    from trainer_memcb.cli import main

    written = str(tmp_path / "halved.json")
    argv = _argv(files, "kto", "--batch-size", "4", "--device-memory", "9MiB", "--reserve", "0B", "--fit", "--allow",
                 "lora", "--max-proposals", "8", "--write-training-args", written, "--json")
    assert main(argv) == 0
    fit = valid_estimate_document(json.loads(capsys.readouterr().out))["answers"]["fit"]
    assert fit["own"]["peak_bytes"] == 17_416_424
    by_change = {json.dumps(c["changes"], sort_keys=True): c for c in fit["candidates"]}
    halved = by_change['{"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}']
    assert (halved["peak_bytes"], halved["fits"], halved["effective_batch"]) == (8_989_380, True, 4)
    assert {c["training_args"]["per_device_train_batch_size"] for c in fit["candidates"]} == {2, 4}
    lora = by_change['{"lora_r": 16}']
    assert (lora["peak_bytes"], lora["alters_training"]) == (17_023_028, True)
    assert fit["candidates"][0] == halved  # the one that fits
    document, config = loaded_trl_config(written, KTOConfig, str(tmp_path / "out"))
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (2, 2)
    assert main(_argv(dict(files, written=written), "written", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["step"]["peak_bytes"] == 8_989_380
    assert main(_argv(files, "kto", "--batch-size", "4", "--lora-r", "16", "--json")) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step"]["peak_bytes"] == 17_023_028 and again["settings"]["preference"]["reference"] == "adapters-disabled"


def test_fit_proposes_no_precomputed_log_probs_where_the_reference_model_is_synced(files: dict, capsys: Any) -> None:
    """TRL refuses sync_ref_model beside precompute_ref_log_probs: with a synced reference, the first
    proposal is the search's own (checkpointing)."""
    from trainer_memcb.cli import main

    argv = _argv(files, "synced", "--device-memory", "8850000B", "--reserve", "0B", "--fit", "--max-proposals", "1",
                 "--json")
    assert main(argv) == 0
    fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
    assert fit["own"]["peak_bytes"] == 8_895_042
    assert [(c["changes"], c["peak_bytes"]) for c in fit["candidates"]] == [({"gradient_checkpointing": True}, 8_624_834)]


def test_max_batch_size_where_not_even_two_fits_names_the_least_batch_kto_takes(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "kto", "--device-memory", "1MiB", "--reserve", "0B", "--max-batch-size")) == 3
    lines = capsys.readouterr().out.splitlines()
    title = lines.index("No batch fits (not even 2, the smallest the trainer takes)")
    assert lines[title + 3].split() == ["2", "8.5", "MiB", "(8,895,042)", "-", "does", "not", "fit"]


@pytest.mark.slow  # a search of 8 proposals in a process of its own: half a minute here
def test_fit_with_peft_s_reference_through_the_console_script(files: dict, tmp_path: Any) -> None:
    """The same search as the installed `trainer-memcb` runs it: the script keeps peft out of an
    estimate that asks for no LoRA, and `--allow lora` must bring it back for KTO's adapters."""
    from cli.test_console_script import run_script

    written = str(tmp_path / "halved.json")
    done = run_script(*_argv(files, "kto", "--batch-size", "4", "--device-memory", "9MiB", "--reserve", "0B", "--fit",
                             "--allow", "lora", "--max-proposals", "8", "--write-training-args", written, "--json"))
    assert (done.returncode, done.stderr) == (0, f"trainer-memcb: wrote {written}: KTOConfig of batch 2 x "
                                                 "accumulation 2\n"), done.stderr
    fit = valid_estimate_document(json.loads(done.stdout))["answers"]["fit"]
    assert fit["own"]["peak_bytes"] == 17_416_424
    assert [(c["changes"], c["peak_bytes"], c["fits"]) for c in fit["candidates"]][:1] == [
        ({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}, 8_989_380, True)]
    assert ({"lora_r": 16}, 17_023_028) in [(c["changes"], c["peak_bytes"]) for c in fit["candidates"]]
    with open(written, encoding="utf-8") as handle:
        assert json.load(handle)["per_device_train_batch_size"] == 2
