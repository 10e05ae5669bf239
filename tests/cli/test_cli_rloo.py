"""`trainer-memcb estimate MODEL --trainer rloo --training-args RLOOCONFIG.json`: TRL's RLOO step
planned from the user's RLOOConfig, the same bytes as the Python plan of
`tests/plan/test_rloo_step.py` (checked there against a real RLOOTrainer step), and a bad config
refused in one line."""

from __future__ import annotations

import json
from typing import Any, List

import pytest

from helpers import loaded_trl_config, requires_version, valid_estimate_document

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "RLOOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> dict:
    from plan.test_grpo_step import _config
    from plan.test_rloo_step import _rloo_config

    folder = tmp_path_factory.mktemp("rloo-cli")
    _config().save_pretrained(folder / "llama")
    paths = {"model": str(folder / "llama")}
    for beta in (0.0, 0.1):
        (folder / f"rloo{beta}.json").write_text(_rloo_config(str(folder / "out"), beta).to_json_string())
        paths[f"rloo{beta}"] = str(folder / f"rloo{beta}.json")
    # Micro-batches of 4 accumulated twice, one generation of 8 a step (steps_per_generation 2).
    fit = _rloo_config(str(folder / "out"), 0.1, gradient_accumulation_steps=2, steps_per_generation=2)
    (folder / "fit.json").write_text(fit.to_json_string())  # both generation keys, as TRL writes them
    paths["fit"] = str(folder / "fit.json")
    bad = {"odd": {"num_generations": 3, "per_device_train_batch_size": 4},
           "one": {"num_generations": 1},
           "sync": {"num_generations": 2, "beta": 0.0, "sync_ref_model": True},
           "paged": {"num_generations": 2, "use_transformers_paged": True},
           "grpo": {"num_generations": 2, "loss_type": "dapo"},
           "typo": {"num_generation": 2}}
    for name, values in bad.items():
        (folder / f"{name}.json").write_text(json.dumps(values))
        paths[name] = str(folder / f"{name}.json")
    return paths


def _argv(files: dict, config: str, *more: str) -> List[str]:
    return ["estimate", files["model"], "--trainer", "rloo", "--training-args", files[config], "--seq-len", "10",
            "--device-type", "cpu", "--attn-implementation", "sdpa", "--optimizers", "adamw_torch", *more]


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_command_plans_the_python_plans_rloo_step(files: dict, capsys: Any, tmp_path: Any, beta: float) -> None:
    from plan.test_rloo_step import _planned

    from trainer_memcb.cli import main

    assert main(_argv(files, f"rloo{beta}", "--json")) == 0
    document = json.loads(capsys.readouterr().out)
    planned = _planned(beta, str(tmp_path)).step
    assert document["step"]["peak_bytes"] == planned.peak_bytes == {0.0: 5_123_540, 0.1: 5_214_804}[beta]
    assert document["step"]["phases"] == planned.phases == [
        {"phase": "generation", "peak_bytes": {0.0: 4_828_120, 0.1: 4_919_384}[beta]},
        {"phase": "training", "peak_bytes": planned.peak_bytes}]
    assert document["settings"]["preference"] == {
        "trainer": "rloo", "reference": "model" if beta else "none", "beta": beta, "loss_type": ["rloo"],
        "generation": {"num_generations": 4, "generation_rows": 4, "prompts": 1, "steps_per_generation": 1,
                       "prompt_tokens": 10, "completion_tokens": 8, "engine": "transformers",
                       "vllm_gpu_memory_utilization": None, "old_log_probs": True}}
    [states] = document["model_states"]["optimizers"]
    assert states["reference_model_bytes"] == (91_264 if beta else 0)


@pytest.mark.parametrize("config,code,line", [
    ("odd", 2, "trainer-memcb: error: --trainer rloo: RLOOConfig {odd!r}: generation_batch_size 4: TRL requires a "
               "multiple of num_generations (3)"),
    ("one", 2, "trainer-memcb: error: --trainer rloo: RLOOConfig {one!r}: num_generations 1: RLOO requires at least 2 "
               "generations per prompt"),
    ("sync", 2, "trainer-memcb: error: --trainer rloo: RLOOConfig {sync!r}: sync_ref_model with beta 0: TRL makes no "
                "reference model to synchronize; set beta above 0"),
    ("paged", 2, "trainer-memcb: error: --trainer rloo: RLOOConfig {paged!r}: use_transformers_paged True: the RLOO "
                 "step is planned with its default so far"),
    ("grpo", 1, "trainer-memcb: RLOOConfig {grpo!r}: 'loss_type' is not a RLOOConfig field (RLOOConfig(**args) raises "
                "TypeError)"),
    ("typo", 1, "trainer-memcb: RLOOConfig {typo!r}: 'num_generation' is not a RLOOConfig field (RLOOConfig(**args) "
                "raises TypeError); did you mean 'num_generations'?"),
])
def test_a_file_that_is_not_a_good_rlooconfig_is_one_line(files: dict, capsys: Any, config: str, code: int,
                                                          line: str) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, config, "--batch-size", "4")) == code
    assert capsys.readouterr().err.splitlines() == [line.format(**files)]


def test_a_batch_size_of_no_whole_groups_is_one_line(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "rloo0.0", "--batch-size", "3")) == 2
    assert capsys.readouterr().err.splitlines() == [
        "trainer-memcb: error: batch_size 3: RLOO generates batch_size x steps_per_generation (1) = 3 completions, "
        "and TRL requires whole groups of num_generations (4)"]


@pytest.mark.parametrize("case,message", [
    (["--zero", "2"], "--trainer rloo is planned on one process without sharding so far"),
    (["--reference-model"], "--reference-model with --trainer rloo"),
    (["--fit"], "--fit needs --device-memory"),
    (["--fit", "--device-memory", "1GiB", "--write-deepspeed", "ds.json"], "--write-deepspeed with --trainer rloo"),
])
def test_refusals_before_the_file(files: dict, capsys: Any, case: List[str], message: str) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "rloo0.0") + case) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("trainer-memcb: error: " + message), line


def test_the_table_names_the_trainer_its_generation_and_each_phases_peak(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "rloo0.1")) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {name: line[len(name):].strip() for line in lines for name in ("trainer", "phase peaks", "step peak")
            if line.startswith(name + " ")}
    assert rows == {
        "trainer": "TRL RLOOTrainer, reference a frozen copy of the model, 89.1 KiB (91,264) of the peak; generation "
                   "of 4 completions (4 a prompt) of 8 tokens by transformers",
        "phase peaks": "generation 4.7 MiB (4,919,384), training 5.0 MiB (5,214,804)",
        "step peak": "5.0 MiB (5,214,804), in the backward"}


def test_fit_proposes_a_smaller_generation_batch_and_writes_an_rlooconfig_that_replans_to_it(
        files: dict, capsys: Any, tmp_path: Any) -> None:
    """As for GRPO (`tests/cli/test_cli_grpo_fit.py`): the step peaks in training, 752 bytes over
    the memory; a generation batch of 4 (TRL generates before each micro-batch) holds 1,184 bytes
    less there. The RLOOConfig written holds generation_batch_size alone (RLOOConfig refuses it
    beside steps_per_generation), loads in RLOOConfig and replans to the proposal's bytes."""
    from trl import RLOOConfig

    from trainer_memcb.cli import main

    written = str(tmp_path / "fitted.json")
    argv = _argv(files, "fit", "--device-memory", "5306500B", "--reserve", "0B", "--fit", "--max-proposals", "1",
                 "--write-training-args", written, "--json")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    fit = valid_estimate_document(json.loads(out))["answers"]["fit"]
    assert (fit["fits_as_is"], fit["own"]["peak_bytes"], fit["own"]["margin_bytes"]) == (False, 5_307_252, -752)
    [smaller] = fit["candidates"]
    assert (smaller["changes"], smaller["peak_bytes"], smaller["fits"], smaller["effective_batch"]) == (
        {"generation_batch_size": 4}, 5_306_068, True, 8)
    assert err.splitlines()[-1] == (f"trainer-memcb: wrote {written}: RLOOConfig of generation batch 4 (TRL's "
                                    "generation_batch_size)")
    document, config = loaded_trl_config(written, RLOOConfig, str(tmp_path / "out"))
    assert "steps_per_generation" not in document and document == smaller["training_args"]
    assert (config.generation_batch_size, config.steps_per_generation, config.gradient_accumulation_steps) == (4, 1, 2)
    assert main(_argv(dict(files, written=written), "written", "--json")) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step"]["peak_bytes"] == 5_306_068
    assert again["settings"]["preference"]["generation"]["generation_rows"] == 4


def test_max_batch_size_steps_by_whole_groups_of_num_generations(files: dict, capsys: Any) -> None:
    """Four generations a prompt, each micro-batch's completions generated two steps at a time: a
    batch of 2 (4 completions) is the least TRL takes, and the search steps by 2."""
    from trainer_memcb.cli import main

    assert main(_argv(files, "fit", "--device-memory", "4MiB", "--reserve", "0B", "--max-batch-size", "--json")) == 3
    document = valid_estimate_document(json.loads(capsys.readouterr().out))
    largest = document["answers"]["largest_batch"]
    assert largest["max_batch_size"] == 2
    assert [(b["batch_size"], b["peak_bytes"], b["fits"]) for b in largest["searched"]] == [
        (2, 2_906_760, True), (4, 5_307_252, False)]
    assert document["step"]["phases"][1] == {"phase": "training", "peak_bytes": 5_307_252}
