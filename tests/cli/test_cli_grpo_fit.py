"""`trainer-memcb estimate MODEL --trainer grpo --training-args GRPOCONFIG.json --fit`: what TRL's
GRPOConfig offers that lowers the step's peak (a smaller generation_batch_size, the batch with the
generation batch kept, a lower colocated vllm_gpu_memory_utilization, PEFT's reference) beside the
search's own proposals, each judged as the step plan judges it; the GRPOConfig written back loads in
`GRPOConfig` and planned again gives the proposal's figures to the byte. The generation batch's
phase against a real GRPOTrainer run is `tests/plan/test_grpo_step.py`'s
(`test_a_generation_inside_the_accumulation_holds_the_first_micro_batchs_gradients`)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from helpers import requires_version

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "GRPOTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

# The user's GRPOConfig: beta 0.1 (a frozen reference), micro-batches of 4 completions accumulated
# twice, one generation of 8 a step (steps_per_generation 2, on policy). Its step peaks in training
# at 5,307,484 bytes; a generation batch of 4 (TRL then generates before each micro-batch) holds
# 1,296 bytes less there (the smaller buffered batch).
OWN_PEAK, GENERATION_4_PEAK = 5_307_484, 5_306_188


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> Dict[str, Any]:
    from plan.test_grpo_step import _config, _grpo_config

    folder = tmp_path_factory.mktemp("grpo-fit")
    _config().save_pretrained(folder / "llama")
    paths: Dict[str, Any] = {"model": str(folder / "llama"), "out": str(folder / "out")}
    config = _grpo_config(str(folder / "out"), 0.1, gradient_accumulation_steps=2, steps_per_generation=2)
    paths["config"] = config
    (folder / "grpo.json").write_text(config.to_json_string())  # both generation keys, as TRL writes them
    vllm = _grpo_config(str(folder / "out"), 0.0, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    (folder / "vllm.json").write_text(vllm.to_json_string())
    paths.update(grpo=str(folder / "grpo.json"), vllm=str(folder / "vllm.json"))
    return paths


def _argv(files: Dict[str, Any], config: str, *more: str) -> List[str]:
    return ["estimate", files["model"], "--trainer", "grpo", "--training-args", files[config], "--seq-len", "10",
            "--attn-implementation", "sdpa", *more]


def _planned_again(files: Dict[str, Any], path: str, capsys: Any, *more: str) -> Dict[str, Any]:
    from trainer_memcb.cli import main

    assert main(["estimate", files["model"], "--trainer", "grpo", "--training-args", path, "--seq-len", "10",
                 "--attn-implementation", "sdpa", *more, "--json"]) in (0, 3)
    return json.loads(capsys.readouterr().out)


def _loaded(document: Dict[str, Any], tmp_path: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(**dict(document, output_dir=str(tmp_path / "out")))


@pytest.mark.slow  # eleven GRPO steps traced, each with its generation
def test_fit_proposes_a_smaller_generation_batch_and_writes_a_grpoconfig_that_replans_to_it(
        files: Dict[str, Any], capsys: Any, tmp_path: Any) -> None:
    from trainer_memcb.cli import main

    written = str(tmp_path / "fitted.json")
    argv = _argv(files, "grpo", "--device-type", "cpu", "--device-memory", "5306500B", "--reserve", "0B", "--fit",
                 "--write-training-args", written, "--json")
    assert main(argv) == 0
    fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
    assert (fit["fits_as_is"], fit["own"]["peak_bytes"]) == (False, OWN_PEAK)
    by_change = {json.dumps(c["changes"], sort_keys=True): c for c in fit["candidates"]}
    smaller = by_change['{"generation_batch_size": 4}']
    assert (smaller["peak_bytes"], smaller["fits"], smaller["effective_batch"]) == (GENERATION_4_PEAK, True, 8)
    # TRL takes one of the two generation keys: the proposal holds generation_batch_size alone.
    assert "steps_per_generation" not in smaller["training_args"]
    # The batch search: micro-batches of 2 accumulated 4 times, the generation of 8 kept
    # (steps_per_generation 4, as GRPOConfig resolves it from generation_batch_size).
    halved = by_change['{"gradient_accumulation_steps": 4, "per_device_train_batch_size": 2}']
    assert (halved["peak_bytes"], halved["fits"], halved["training_args"]["generation_batch_size"]) == (
        2_908_176, True, 8)
    assert by_change['{"gradient_checkpointing": true}']["peak_bytes"] == 5_062_508
    # Each proposal's GRPOConfig loads, and planned again from it gives the proposal's bytes.
    for candidate in (smaller, halved):
        config = _loaded(candidate["training_args"], tmp_path)
        assert config.generation_batch_size == candidate["training_args"]["generation_batch_size"]
        path = str(tmp_path / "proposal.json")
        with open(path, "w") as handle:
            json.dump(candidate["training_args"], handle)
        again = _planned_again(files, path, capsys, "--device-type", "cpu")
        assert again["step"]["peak_bytes"] == candidate["peak_bytes"]
    with open(written) as handle:
        document = json.load(handle)
    assert document == fit["candidates"][0]["training_args"] and fit["candidates"][0]["fits"]
    _loaded(document, tmp_path)
    again = _planned_again(files, written, capsys, "--device-type", "cpu")
    assert again["step"]["peak_bytes"] == fit["candidates"][0]["peak_bytes"]


@pytest.mark.slow  # the GRPO step traced with its generation
def test_a_fitting_own_setting_writes_the_users_own_grpoconfig(files: Dict[str, Any], capsys: Any,
                                                               tmp_path: Any) -> None:
    from trainer_memcb.cli import main

    written = str(tmp_path / "own.json")
    argv = _argv(files, "grpo", "--device-type", "cpu", "--device-memory", "1GiB", "--reserve", "0B", "--fit",
                 "--max-proposals", "1", "--write-training-args", written)
    assert main(argv) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"trainer-memcb: wrote {written}: GRPOConfig of your own setting")
    with open(written) as handle:
        document = json.load(handle)
    # Every field as the user's GRPOConfig has it; of the two generation keys TRL's JSON holds, the
    # one GRPOConfig(**values) takes alone.
    assert "steps_per_generation" not in document
    assert _loaded(document, tmp_path).to_dict() == _loaded(json.loads(files["config"].to_json_string()) | {
        "steps_per_generation": None}, tmp_path).to_dict() == dict(files["config"].to_dict(),
                                                                    output_dir=str(tmp_path / "out"))


def test_fit_with_vllm_colocated_proposes_a_smaller_share_without_tracing_again(
        files: Dict[str, Any], capsys: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """vLLM colocated takes 0.3 of the device's 650 MiB by its rule: what is left, less the CUDA
    context, is short of what the training step reserves; a share that leaves it fits, judged by
    the same allocator replay, from the same trace (vLLM's share is not in the step traced)."""
    from trainer_memcb.cli import main
    from trainer_memcb.plan.step import trace

    traced: List[float] = []
    once = trace.trace_step_once
    monkeypatch.setattr(trace, "trace_step_once", lambda meta, settings, **k: traced.append(
        settings.preference.vllm_gpu_memory_utilization) or once(meta, settings, **k))
    shared: List[int] = []
    another = trace._another_optimizer
    monkeypatch.setattr(trace, "_another_optimizer", lambda *a, **k: shared.append(1) or another(*a, **k))
    written = str(tmp_path / "vllm-fit.json")
    argv = _argv(files, "vllm", "--device-type", "cuda", "--device-memory", "650MiB", "--reserve", "0B", "--fit",
                 "--max-proposals", "3", "--write-training-args", written, "--json")
    assert main(argv) == 0
    fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
    assert fit["fits_as_is"] is False
    [share] = [c for c in fit["candidates"] if "vllm_gpu_memory_utilization" in c["changes"]]
    assert share["changes"] == {"vllm_gpu_memory_utilization": 0.27}
    assert (share["fits"], share["reserved_peak_bytes"]) == (True, fit["own"]["reserved_peak_bytes"])
    assert share["margin_bytes"] - fit["own"]["margin_bytes"] == int(0.3 * 650 * 2**20) - int(0.27 * 650 * 2**20)
    # The own step traced, the share from its trace, checkpointing traced, 8-bit AdamW stepped from
    # the own step kept.
    assert [sorted(c["changes"]) for c in fit["candidates"]][1:] == [["gradient_checkpointing"], ["optim"]]
    # (Where no optimizer phase is shared, `_shares_optimizer_phases`, the optimizer's step is traced.)
    sharing = trace._shares_optimizer_phases()
    assert 0.27 not in traced and (traced.count(0.3), len(shared)) == ((2, 1) if sharing else (3, 0))
    assert fit["candidates"][0] == share  # the same step time, planned first
    with open(written) as handle:
        document = json.load(handle)
    assert _loaded(document, tmp_path).vllm_gpu_memory_utilization == 0.27
    again = _planned_again(files, written, capsys, "--device-type", "cuda", "--device-memory", "650MiB", "--reserve", "0B")
    assert again["device"]["reserved_peak_bytes"] == share["reserved_peak_bytes"]
    assert (again["answers"]["fits"], again["answers"]["margin_bytes"]) == (True, share["margin_bytes"])


@pytest.mark.parametrize("more,line", [
    (["--fit", "--device-memory", "1GiB", "--write-deepspeed", "ds.json"],
     "trainer-memcb: error: --write-deepspeed with --trainer grpo: the GRPO step is planned on one process without "
     "DeepSpeed, so --fit proposes none; write the GRPOConfig with --write-training-args"),
    (["--fit"], "trainer-memcb: error: --fit needs --device-memory (the accelerator's memory per process, e.g. 80GiB)"),
])
def test_bad_fit_combinations_are_one_line(files: Dict[str, Any], capsys: Any, more: List[str], line: str) -> None:
    from trainer_memcb.cli import main

    assert main(_argv(files, "grpo", "--device-type", "cpu", *more)) == 2
    assert capsys.readouterr().err.splitlines() == [line]


@pytest.mark.slow  # the GRPO step traced with its generation, with and without adapters
def test_allow_lora_proposes_adapters_with_peft_s_reference(files: Dict[str, Any], capsys: Any) -> None:
    """With `--allow lora`, LoRA adapters whose reference is the policy with its adapters disabled
    (TRL makes no reference model under PEFT): the proposal is the step `--lora-r 16` plans."""
    from trainer_memcb.cli import main

    argv = _argv(files, "grpo", "--device-type", "cpu", "--device-memory", "1GiB", "--reserve", "0B", "--fit",
                 "--allow", "lora", "--json")
    assert main(argv) == 0
    fit = json.loads(capsys.readouterr().out)["answers"]["fit"]
    [lora] = [c for c in fit["candidates"] if c["changes"] == {"lora_r": 16}]
    assert lora["alters_training"] is True and lora["peak_bytes"] < fit["own"]["peak_bytes"] == OWN_PEAK
    again = _planned_again(files, files["grpo"], capsys, "--device-type", "cpu", "--lora-r", "16")
    assert again["step"]["peak_bytes"] == lora["peak_bytes"]
    assert again["settings"]["preference"]["reference"] == "adapters-disabled"
    assert "reference_model" not in again["step"]["peak_parts"] or again["step"]["peak_parts"]["reference_model"] == 0


def test_the_fit_table_names_each_grpo_proposal_and_vllms_share_in_its_limit(files: Dict[str, Any],
                                                                             capsys: Any) -> None:
    from trainer_memcb.cli import main

    argv = _argv(files, "vllm", "--device-type", "cuda", "--device-memory", "650MiB", "--reserve", "0B", "--fit",
                 "--max-proposals", "2")
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    [title] = [line for line in lines if line.startswith("Settings that fit in ")]
    assert title.startswith("Settings that fit in 224.0 MiB per process (the device's memory less the CUDA context "
                            "and the reserve) less each setting's share for colocated vLLM (its "
                            "vllm_gpu_memory_utilization x the device's memory), fastest first")
    rows = lines[lines.index(title) + 3:]
    assert [row.split("  ")[0].strip() for row in rows[:3]] == ["own", "1", "2"]
    assert rows[1].split(None, 1)[1].startswith("vLLM's share 0.27 (TRL's vllm_gpu_memory_utilization)")
    assert "  yes  " in rows[1] and "  no  " in rows[0]
