"""One answer to "fits?" across the step plan, `--fit` and `--max-batch-size`, through the installed
console script: each setting is decided by the verdict its own step plan gives (on CUDA the
allocator replay on the device's memory less the CUDA context and the reserve), never by a figure
of its own."""

from __future__ import annotations

import json
import os

import pytest

from test_console_script import run_script

DISTILBERT = os.path.join("examples", "models", "tiny-distilbert")
SMALL = [DISTILBERT, "--batch-size", "2", "--seq-len", "8"]


def plan_json(*argv: str) -> dict:
    done = run_script("estimate", *argv, "--json")
    assert done.returncode in (0, 3), done.stderr
    return json.loads(done.stdout)


def test_fit_answers_each_setting_as_the_step_plan_answers_it(tmp_path):
    # Before: the step plan said "does not fit, 12.0 MiB short" (the replay reserves 32 MiB of the
    # 20 MiB left beside the CUDA context), while --fit decided on the traced peak (8.7 MiB): the own
    # setting "fits with 11.3 MiB to spare", every proposal fit, exit 0, and the file was written.
    written = tmp_path / "args.json"
    done = run_script("estimate", *SMALL, "--device-memory", "446MiB", "--fit", "--json",
                      "--write-training-args", str(written))
    assert done.returncode == 3, done.stderr
    found = json.loads(done.stdout)
    step, device, answers, fit = found["step"], found["device"], found["answers"], found["answers"]["fit"]
    assert (answers["fits"], answers["margin_bytes"], device["reserved_peak_bytes"]) == (False, -12_582_912, 33_554_432)
    assert fit["usable_bytes"] == 20_971_520 == 446 * 2**20 - device["cuda_context_bytes"]
    own = fit["own"]
    assert (own["fits"], own["margin_bytes"], own["reserved_peak_bytes"], own["peak_bytes"]) == \
        (False, -12_582_912, 33_554_432, step["peak_bytes"])
    assert fit["fits_as_is"] is False
    # Every proposal's margin is the usable bytes less its reserved peak, and none fits.
    assert fit["candidates"] and all(c["margin_bytes"] == 20_971_520 - c["reserved_peak_bytes"] and c["fits"] is False
                                     for c in fit["candidates"])
    by_change = {json.dumps(c["changes"], sort_keys=True): c for c in fit["candidates"]}
    assert by_change['{"optim": "adamw_bnb_8bit"}']["reserved_peak_bytes"] == 27_262_976
    assert not written.exists()
    assert done.stderr.splitlines()[-2:] == [
        "trainer-memcb: nothing written: no proposal fits",
        "trainer-memcb: nothing fits: the nearest is optim adamw_bnb_8bit, reserving 26.0 MiB per process, "
        "6.0 MiB over 20.0 MiB"]


@pytest.mark.slow  # three plans through the console script
def test_a_proposal_planned_alone_gets_the_verdict_the_search_gave_it():
    searched = plan_json(*SMALL, "--device-memory", "446MiB", "--fit")["answers"]["fit"]["candidates"]
    [leaner] = [c for c in searched if c["changes"] == {"optim": "adafactor"}]
    alone = plan_json(*SMALL, "--device-memory", "446MiB", "--optimizers", "adafactor")
    assert (alone["answers"]["fits"], alone["answers"]["margin_bytes"], alone["device"]["reserved_peak_bytes"],
            alone["step"]["peak_bytes"]) == \
        (leaner["fits"], leaner["margin_bytes"], leaner["reserved_peak_bytes"], leaner["peak_bytes"])


def test_a_setting_that_fits_is_written_as_it_is_and_a_rerun_writes_the_same(tmp_path):
    # Before: with the own step fitting, --write-training-args wrote the first proposal (on this
    # model, checkpointing), and each re-run with that file changed one more setting.
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    done = run_script("estimate", *SMALL, "--device-memory", "500MiB", "--fit", "--write-training-args", str(first))
    assert done.returncode == 0, done.stderr
    assert f"wrote {first}: TrainingArguments of your own setting" in done.stderr
    assert json.loads(first.read_text()) == {
        "bf16": False, "fp16": False, "gradient_accumulation_steps": 1, "gradient_checkpointing": False,
        "max_grad_norm": 1.0, "optim": "adamw_torch", "per_device_train_batch_size": 2}
    again = run_script("estimate", DISTILBERT, "--seq-len", "8", "--device-memory", "500MiB", "--training-args",
                       str(first), "--fit", "--write-training-args", str(second))
    assert again.returncode == 0, again.stderr
    assert second.read_text() == first.read_text()


@pytest.mark.slow  # a search and two plans through the console script
def test_the_largest_batch_is_the_last_the_step_plan_says_fits(tmp_path):
    # Before: the search interpolated on the traced peak and decided on the replay, so its upper
    # bound fell by one a trace: 178 traces and 75 s for this answer.
    found = plan_json(DISTILBERT, "--seq-len", "8", "--device-memory", "500MiB", "--max-batch-size")
    best = found["answers"]["largest_batch"]["max_batch_size"]
    assert best == 189  # 276 before the memory-efficient backward's delta and workspace were planned
    assert len(found["answers"]["largest_batch"]["searched"]) <= 13
    at = plan_json(DISTILBERT, "--seq-len", "8", "--device-memory", "500MiB", "--batch-size", str(best))
    above = plan_json(DISTILBERT, "--seq-len", "8", "--device-memory", "500MiB", "--batch-size", str(best + 1))
    assert (at["answers"]["fits"], above["answers"]["fits"]) == (True, False)
    searched = {plan["batch_size"]: plan for plan in found["answers"]["largest_batch"]["searched"]}
    assert (searched[best]["fits"], searched[best + 1]["fits"]) == (True, False)
    assert searched[best]["reserved_peak_bytes"] == at["device"]["reserved_peak_bytes"]
