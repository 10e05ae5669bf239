"""`trainer-memcb estimate MODEL --trainer dpo --training-args DPOCONFIG.json`: TRL's DPO step
planned from the user's DPOConfig, the same bytes as the Python plan of `tests/plan/test_dpo_step.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, List

import pytest

from helpers import requires_version, trl_config_files, valid_estimate_document

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "DPOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> dict:
    from plan.test_dpo_step import BATCH, MAX_LENGTH
    from trl import DPOConfig

    return trl_config_files(tmp_path_factory, "dpo-cli", DPOConfig, BATCH, MAX_LENGTH,
                            {"dpo": {}, "precomputed": {"precompute_ref_log_probs": True}},
                            {"trainer": {"per_device_train_batch_size": 2}, "typo": {"betta": 0.1},
                             "beta0": {"beta": 0.0}})


def _argv(files: dict, config: str, *more: str) -> List[str]:
    return ["estimate", files["model"], "--trainer", "dpo", "--training-args", files[config], "--seq-len", "32",
            "--device-type", "cpu", "--attn-implementation", "sdpa", *more]


@pytest.mark.parametrize("reference,config,more", [
    ("model", "dpo", []), ("precomputed", "precomputed", []),
    ("adapters-disabled", "dpo", ["--lora-r", "4", "--lora-target-modules", "q_proj,v_proj"])])
def test_the_command_plans_the_python_plans_dpo_step(files: dict, capsys: Any, reference: str, config: str,
                                                     more: List[str]) -> None:
    from plan.test_dpo_step import _planned

    from trainer_memcb.cli import main

    assert main(_argv(files, config, *more, "--json")) == 0
    document = json.loads(capsys.readouterr().out)
    planned = _planned(reference).step
    assert document["step"]["peak_bytes"] == planned.peak_bytes
    assert document["step"]["peak_parts"] == dict(planned.peak_parts)
    assert document["settings"]["preference"] == {"trainer": "dpo", "reference": reference, "beta": 0.1,
                                                  "loss_type": ["sigmoid"], "generation": None}
    assert document["step"]["peak_bytes"] == {"model": 17_413_348, "precomputed": 17_322_100,
                                              "adapters-disabled": 16_958_512}[reference]
    # DPO's step is one phase, training, as GRPO's JSON names each of its two.
    assert document["step"]["phases"] == [{"phase": "training", "peak_bytes": document["step"]["peak_bytes"]}]
    valid_estimate_document(document)


def test_the_table_names_the_trainer_and_the_references_share(files: dict) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", *_argv(files, "dpo")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 1) for line in done.stdout.splitlines() if line.startswith("trainer ")]
    assert [row[1].strip() for row in rows] == [
        "TRL DPOTrainer, reference a frozen copy of the model, 89.1 KiB (91,264) of the peak"]
    [peak] = [line for line in done.stdout.splitlines() if line.startswith("step peak ")]
    assert peak.split(None, 2)[2].strip() == "16.6 MiB (17,413,348), in the backward"


@pytest.mark.parametrize("case,code,message", [
    (["--zero", "2"], 2, "--trainer dpo is planned on one process without sharding so far"),
    (["--reference-model"], 2, "--reference-model with --trainer dpo"),
])
def test_refusals_before_the_file(files: dict, capsys: Any, case: List[str], code: int, message: str) -> None:
    from trainer_memcb.cli import main

    argv = ["estimate", files["model"], "--trainer", "dpo", "--training-args", files["dpo"], "--device-type", "cpu"]
    assert main(argv + ["--seq-len", "32"] + case) == code
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("trainer-memcb: error: " + message), line


@pytest.mark.parametrize("config,code,line", [
    ("trainer", 2, "trainer-memcb: error: --trainer dpo: DPOConfig {trainer!r} names none of DPOConfig's own fields "
                   "(beta, max_length, loss_type, precompute_ref_log_probs, ...): it is not a DPOConfig's JSON (write "
                   "one with DPOConfig(...).to_json_string())"),
    ("typo", 1, "trainer-memcb: DPOConfig {typo!r}: 'betta' is not a DPOConfig field (DPOConfig(**args) raises "
                "TypeError); did you mean 'beta'?"),
    ("beta0", 2, "trainer-memcb: error: --trainer dpo: DPOConfig {beta0!r}: beta 0.0: expected a number above 0 "
                 "(DPO's loss divides by it)"),
])
def test_a_file_that_is_not_a_good_dpoconfig_is_one_line(files: dict, capsys: Any, config: str, code: int,
                                                         line: str) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, config, "--batch-size", "2")) == code
    assert capsys.readouterr().err.splitlines() == [line.format(**files)]


def test_fit_proposes_precomputed_reference_log_probs_and_writes_the_dpoconfig_back(files: dict, capsys: Any,
                                                                                 tmp_path: Any) -> None:
    from trl import DPOConfig

    from trainer_memcb.cli import main

    # Between the step with its frozen reference (17,413,348 bytes) and without it (17,322,100).
    written = str(tmp_path / "fitted.json")
    argv = _argv(files, "dpo", "--device-memory", "17350000B", "--reserve", "0B", "--fit", "--max-proposals", "3")
    assert main(argv + ["--write-training-args", written, "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
    assert (fit["fits_as_is"], fit["own"]["peak_bytes"]) == (False, 17_413_348)
    [precomputed] = [c for c in fit["candidates"] if c["changes"] == {"precompute_ref_log_probs": True}]
    assert (precomputed["peak_bytes"], precomputed["fits"]) == (17_322_100, True)
    assert fit["candidates"][0] == precomputed  # the fastest that fits: no reference forward in the step
    assert precomputed["relative_step_time"] < 1
    # The file written is the user's DPOConfig with the change: DPOConfig loads it, and planned
    # again from it, the step is the proposal's, to the byte.
    with open(written) as handle:
        document = json.load(handle)
    assert document["precompute_ref_log_probs"] is True and document["beta"] == 0.1 and document["max_length"] == 32
    assert DPOConfig(**dict(document, output_dir=str(tmp_path / "out"))).precompute_ref_log_probs is True
    assert main(["estimate", files["model"], "--trainer", "dpo", "--training-args", written, "--seq-len", "32",
                 "--device-type", "cpu", "--attn-implementation", "sdpa", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step"]["peak_bytes"] == 17_322_100 and again["settings"]["preference"]["reference"] == "precomputed"


def test_fit_proposes_no_liger_kernels_for_trls_own_fused_head(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    argv = ["estimate", files["model"], "--trainer", "dpo", "--training-args", files["dpo"], "--seq-len", "32",
            "--device-type", "cuda", "--device-memory", "1GiB", "--fit", "--max-proposals", "3", "--json"]
    assert main(argv) in (0, 3)
    changes = [c["changes"] for c in json.loads(capsys.readouterr().out)["answers"]["fit"]["candidates"]]
    assert {"precompute_ref_log_probs": True} in changes and {"use_liger_kernel": True} not in changes
