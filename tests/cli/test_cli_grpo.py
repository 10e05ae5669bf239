"""`trainer-memcb estimate MODEL --trainer grpo --training-args GRPOCONFIG.json`: TRL's GRPO step
planned from the user's GRPOConfig, the same bytes as the Python plan of
`tests/plan/test_grpo_step.py` (checked there against a real GRPOTrainer step), and a bad config
refused in one line."""

from __future__ import annotations

import json
from typing import Any, List

import pytest

from helpers import requires_version

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "GRPOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> dict:
    from plan.test_grpo_step import _config, _grpo_config

    folder = tmp_path_factory.mktemp("grpo-cli")
    _config().save_pretrained(folder / "llama")
    paths = {"model": str(folder / "llama")}
    for beta in (0.0, 0.1):
        (folder / f"grpo{beta}.json").write_text(_grpo_config(str(folder / "out"), beta).to_json_string())
        paths[f"grpo{beta}"] = str(folder / f"grpo{beta}.json")
    bad = {"odd": {"num_generations": 3, "per_device_train_batch_size": 4},
           "one": {"num_generations": 1},
           "both": {"num_generations": 2, "generation_batch_size": 8, "steps_per_generation": 4},
           "entropy": {"num_generations": 2, "top_entropy_quantile": 0.5},
           "typo": {"num_generation": 2}}
    for name, values in bad.items():
        (folder / f"{name}.json").write_text(json.dumps(values))
        paths[name] = str(folder / f"{name}.json")
    return paths


def _argv(files: dict, config: str, *more: str) -> List[str]:
    return ["estimate", files["model"], "--trainer", "grpo", "--training-args", files[config], "--seq-len", "10",
            "--device-type", "cpu", "--attn-implementation", "sdpa", "--optimizers", "adamw_torch", *more]


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_command_plans_the_python_plans_grpo_step(files: dict, capsys: Any, tmp_path: Any, beta: float) -> None:
    from plan.test_grpo_step import _planned

    from trainer_memcb.cli import main

    assert main(_argv(files, f"grpo{beta}", "--json")) == 0
    document = json.loads(capsys.readouterr().out)
    planned = _planned(beta, str(tmp_path)).step
    assert document["step"]["peak_bytes"] == planned.peak_bytes == {0.0: 5_123_532, 0.1: 5_214_924}[beta]
    assert document["step"]["phases"] == planned.phases == [
        {"phase": "generation", "peak_bytes": {0.0: 352_388, 0.1: 4_919_120}[beta]},
        {"phase": "training", "peak_bytes": planned.peak_bytes}]
    assert document["settings"]["preference"] == {
        "trainer": "grpo", "reference": "model" if beta else "none", "beta": beta, "loss_type": ["dapo"],
        "generation": {"num_generations": 4, "generation_rows": 4, "prompts": 1, "steps_per_generation": 1, "prompt_tokens": 10,
                       "completion_tokens": 8, "engine": "transformers", "vllm_gpu_memory_utilization": None,
                       "old_log_probs": False}}


@pytest.mark.parametrize("config,code,line", [
    ("odd", 2, "trainer-memcb: error: --trainer grpo: GRPOConfig {odd!r}: generation_batch_size 4: TRL requires a "
               "multiple of num_generations (3)"),
    ("one", 2, "trainer-memcb: error: --trainer grpo: GRPOConfig {one!r}: num_generations 1: GRPO requires at least 2 "
               "generations per prompt"),
    ("both", 2, "trainer-memcb: error: --trainer grpo: GRPOConfig {both!r}: generation_batch_size 8 and "
                "steps_per_generation 4: TRL refuses both at once; give one"),
    ("entropy", 2, "trainer-memcb: error: --trainer grpo: GRPOConfig {entropy!r}: top_entropy_quantile 0.5: the "
                   "GRPO step is planned with its default so far"),
    ("typo", 1, "trainer-memcb: GRPOConfig {typo!r}: 'num_generation' is not a GRPOConfig field (GRPOConfig(**args) "
                "raises TypeError); did you mean 'num_generations'?"),
])
def test_a_file_that_is_not_a_good_grpoconfig_is_one_line(files: dict, capsys: Any, config: str, code: int,
                                                           line: str) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, config, "--batch-size", "4")) == code
    assert capsys.readouterr().err.splitlines() == [line.format(**files)]


def test_a_batch_size_of_no_whole_groups_is_one_line(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "grpo0.0", "--batch-size", "3")) == 2
    assert capsys.readouterr().err.splitlines() == [
        "trainer-memcb: error: batch_size 3: GRPO generates batch_size x steps_per_generation (1) = 3 completions, "
        "and TRL requires whole groups of num_generations (4)"]


@pytest.mark.parametrize("case,message", [
    (["--zero", "2"], "--trainer grpo is planned on one process without sharding so far"),
    (["--reference-model"], "--reference-model with --trainer grpo"),
    (["--max-batch-size"], "--max-batch-size needs --device-memory"),
])
def test_refusals_before_the_file(files: dict, capsys: Any, case: List[str], message: str) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "grpo0.0") + case) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("trainer-memcb: error: " + message), line


def test_the_table_names_the_trainer_its_generation_and_each_phases_peak(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "grpo0.1")) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {name: line[len(name):].strip() for line in lines for name in ("trainer", "phase peaks", "step peak")
            if line.startswith(name + " ")}
    assert rows == {
        "trainer": "TRL GRPOTrainer, reference a frozen copy of the model, 89.1 KiB (91,264) of the peak; generation "
                   "of 4 completions (4 a prompt) of 8 tokens by transformers",
        "phase peaks": "generation 4.7 MiB (4,919,120), training 5.0 MiB (5,214,924)",
        "step peak": "5.0 MiB (5,214,924), in the backward"}
