"""`trainer-memcb estimate MODEL --trainer sft --training-args SFTCONFIG.json`: TRL's SFT step
planned from the user's SFTConfig, the same bytes as the Python plan of `tests/plan/test_sft_step.py`
(whose real `SFTTrainer` steps they are checked against)."""

from __future__ import annotations

import json
from typing import Any, List

import pytest

from helpers import loaded_trl_config, requires_version, trl_config_files, valid_estimate_document

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              requires_version("trl", "1.16", "SFTTrainer's fused LM head (add_fused_lm_head), whose step is planned")]

trl = pytest.importorskip("trl", reason="TRL is in the test extra")

# Each bad SFTConfig, by name: its own fields.
BAD = {"loss": {"loss_type": "sigmoid"}, "unbounded": {"max_length": None},
       "offload": {"max_length": 32, "activation_offloading": True},
       "free": {"max_length": 32, "padding_free": True}, "wrapped": {"packing": True, "packing_strategy": "wrapped"},
       "pad": {"pad_to_multiple_of": 64}, "moe": {"router_aux_loss_coef": 0.01}, "typo": {"max_lenght": 32},
       "trainer": {"per_device_train_batch_size": 2}, "short": {"max_length": 16},
       "liger": {"max_length": 32, "use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}}}


@pytest.fixture(scope="module")
def files(tmp_path_factory: Any) -> dict:
    from plan.test_sft_step import BATCH, MAX_LENGTH
    from trl import SFTConfig

    return trl_config_files(tmp_path_factory, "sft-cli", SFTConfig, BATCH, MAX_LENGTH,
                            {"sft": {}, "packing": {"packing": True}}, BAD)


def sft_argv(files: dict, config: str, *more: str) -> List[str]:
    return ["estimate", files["model"], "--trainer", "sft", "--training-args", files[config], "--seq-len", "32",
            "--device-type", "cpu", "--attn-implementation", "sdpa", *more]


@pytest.mark.parametrize("case,config,more", [
    ("plain", "sft", ["--batch-size", "2"]), ("packing", "packing", ["--batch-size", "2"]),
    ("lora", "sft", ["--batch-size", "2", "--lora-r", "4", "--lora-target-modules", "q_proj,v_proj"])])
def test_the_command_plans_the_real_sft_steps_peak(files: dict, capsys: Any, case: str, config: str,
                                                   more: List[str]) -> None:
    from trainer_memcb.cli import main

    assert main(sft_argv(files, config, *more, "--json")) == 0
    document = json.loads(capsys.readouterr().out)
    # tests/plan/test_sft_step.py's plans, each 4 bytes under its real SFTTrainer step (36 with LoRA).
    assert document["step"]["peak_bytes"] == {"plain": 8_802_244, "packing": 8_971_838, "lora": 8_533_136}[case]
    assert document["settings"]["preference"] == {"trainer": "sft", "reference": "none", "beta": None,
                                                  "loss_type": ["nll"], "generation": None}
    # Padding-free, the micro-batch is one row of its 2 x 32 tokens.
    settings = document["settings"]
    assert (settings["batch_size"], settings["seq_len"]) == ((1, 32) if case == "packing" else (2, 32))
    assert settings.get("packing") == ({"tokens": 64, "sequences": 2, "padded_batch_size": 2, "padded_tokens": 64}
                                       if case == "packing" else None)
    [note] = [note for note in document["step"]["notes"] if note.startswith("TRL's SFT step traced")]
    assert ("one padding-free row of 64 tokens" if case == "packing" else "2 rows of 32 tokens") in note


@pytest.mark.parametrize("config,more,line", [
    ("loss", [], "--trainer sft: SFTConfig {loss!r}: loss_type 'sigmoid': TRL's SFTTrainer takes nll, dft"),
    ("unbounded", [], "--trainer sft: SFTConfig {unbounded!r}: max_length None: the SFT step is planned at max_length "
                      "tokens a row; give one"),
    ("offload", [], "--trainer sft: SFTConfig {offload!r}: activation_offloading true: the SFT step is planned "
                    "without offloading activations (its OffloadActivations hooks move saved tensors to the CPU by "
                    "data-dependent rules)"),
    ("free", [], "--trainer sft: SFTConfig {free!r}: padding_free true without packing: TRL refuses it with a "
                 "max_length (\"max_length is not enforced\"); give packing true (strategy bfd) or padding_free false"),
    ("wrapped", [], "--trainer sft: SFTConfig {wrapped!r}: packing true with packing_strategy 'wrapped': the SFT step "
                    "is planned for bfd and bfd_split packing (padding-free rows) so far"),
    ("pad", [], "--trainer sft: SFTConfig {pad!r}: pad_to_multiple_of 64: the SFT step is planned at max_length "
                "tokens unpadded ('auto' or null)"),
    ("moe", [], "--trainer sft: SFTConfig {moe!r}: router_aux_loss_coef 0.01: the SFT step is planned without a "
                "Mixture-of-Experts auxiliary loss"),
    ("trainer", [], "--trainer sft: SFTConfig {trainer!r} names none of SFTConfig's own fields (max_length, packing, "
                    "padding_free, loss_type, ...): it is not a SFTConfig's JSON (write one with "
                    "SFTConfig(...).to_json_string())"),
    ("short", [], "--seq-len 32 is longer than SFTConfig {short!r}'s max_length 16: SFTTrainer cuts every row to "
                  "max_length; give --seq-len at most it"),
    ("liger", [], "liger_kernel_config={{\"fused_linear_cross_entropy\": true}} with TRL's SFT step: TRL refuses it "
                  "(\"it replaces the model's forward, which this trainer patches with a fused LM head\"); leave it "
                  "out, TRL applies the layer kernels alone"),
    ("sft", ["--packing", "64"], "--packing 64 with --trainer sft: SFTConfig {sft!r} makes padded rows (neither "
                                 "padding_free nor packing with a bfd strategy); leave --packing out or set packing true"),
    ("packing", ["--fit", "--device-memory", "1GiB", "--packing", "64"], "--packing 64 with --fit and --trainer sft: "
                "--fit resizes SFTConfig {packing!r}'s padding-free row as per_device_train_batch_size x --seq-len "
                "tokens; leave --packing out"),
    ("packing", ["--max-batch-size", "--device-memory", "1GiB", "--packing", "64"], "--max-batch-size searches the "
                "rows of a batch; --packing makes one row of TOKENS tokens: plan each TOKENS with --batch-size 1"),
    ("sft", ["--reference-model"], "--reference-model with --trainer sft: SFTTrainer makes no reference model; "
                                   "leave it out"),
])
def test_a_bad_sftconfig_or_option_is_one_usage_line(files: dict, capsys: Any, config: str, more: List[str],
                                                     line: str) -> None:
    from trainer_memcb.cli import main

    assert main(sft_argv(files, config, "--batch-size", "2", *more)) == 2
    assert capsys.readouterr().err.splitlines() == ["trainer-memcb: error: " + line.format(**files)]


def test_a_misspelt_field_is_named_with_the_one_meant(files: dict, capsys: Any) -> None:
    from trainer_memcb.cli import main

    assert main(sft_argv(files, "typo", "--batch-size", "2")) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"trainer-memcb: SFTConfig {files['typo']!r}: 'max_lenght' is not a SFTConfig field (SFTConfig(**args) raises "
        "TypeError); did you mean 'max_length'?"]


def test_the_installed_console_script_plans_the_sft_step(files: dict) -> None:
    from cli.test_console_script import run_script

    done = run_script(*sft_argv(files, "packing", "--batch-size", "2"))
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 1)[1].strip() for line in done.stdout.splitlines() if line.startswith("trainer ")]
    assert rows == ["TRL SFTTrainer, its fused LM head (no full logits), loss nll"]
    [peak] = [line for line in done.stdout.splitlines() if line.startswith("step peak ")]
    assert peak.split(None, 2)[2].strip() == "8.6 MiB (8,971,838), in the backward"


def test_max_batch_size_searches_the_padded_sft_step(files: dict, capsys: Any) -> None:
    """Rows of 32 tokens in 20 MiB: 4 fit (17,322,088 bytes), 5 do not; batch 2 is the step the real
    SFTTrainer step holds (tests/plan/test_sft_step.py, 4 bytes above)."""
    from trainer_memcb.cli import main

    argv = sft_argv(files, "sft", "--device-memory", "20MiB", "--reserve", "0B", "--max-batch-size", "--json")
    assert main(argv) == 0
    largest = json.loads(capsys.readouterr().out)["answers"]["largest_batch"]
    assert largest["max_batch_size"] == 4
    assert [(b["batch_size"], b["peak_bytes"], b["fits"]) for b in largest["searched"]] == [
        (1, 4_542_450, True), (2, 8_802_244, True), (4, 17_322_088, True), (5, 21_582_010, False)]


def test_fit_writes_an_sftconfig_that_plans_the_proposal_again(files: dict, tmp_path: Any, capsys: Any) -> None:
    from trainer_memcb.cli import main

    written = str(tmp_path / "fit.json")
    # 8 MiB: the own step (8,802,244 bytes) does not fit; two rows accumulated twice do.
    assert main(sft_argv(files, "sft", "--batch-size", "2", "--device-memory", "8MiB", "--fit",
                         "--write-training-args", written)) == 0
    said = capsys.readouterr()
    assert f"trainer-memcb: wrote {written}: SFTConfig of batch 1 x accumulation 2" in said.out + said.err
    with open(written, encoding="utf-8") as handle:
        values = json.load(handle)
    assert (values["per_device_train_batch_size"], values["gradient_accumulation_steps"], values["max_length"]) == (1, 2, 32)
    assert main(["estimate", files["model"], "--trainer", "sft", "--training-args", written, "--seq-len", "32",
                 "--batch-size", "1", "--device-type", "cpu", "--attn-implementation", "sdpa", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"]["peak_bytes"] == 4_634_482  # the proposal's, to the byte


def test_max_batch_size_resizes_the_padding_free_row(files: dict, capsys: Any) -> None:
    """Packed (bfd), each per_device_train_batch_size is one row of batch x 32 tokens: in 20 MiB 4
    fit (17,863,110 bytes, above the padded 4 rows' 17,322,088), 5 do not; batch 2, the config's own
    (no --batch-size), is the step the real SFTTrainer step holds (tests/plan/test_sft_step.py)."""
    from trainer_memcb.cli import main

    argv = sft_argv(files, "packing", "--device-memory", "20MiB", "--reserve", "0B", "--max-batch-size", "--json")
    assert main(argv) == 0
    document = valid_estimate_document(json.loads(capsys.readouterr().out))
    largest = document["answers"]["largest_batch"]
    assert (largest["max_batch_size"], largest["problem"]) == (4, None)
    assert [(b["batch_size"], b["peak_bytes"], b["fits"]) for b in largest["searched"]] == [
        (1, 4_550_778, True), (2, 8_971_838, True), (4, 17_863_110, True), (5, 22_333_322, False)]
    assert (document["step"]["peak_bytes"], document["settings"]["batch_size"]) == (8_971_838, 1)
    assert document["settings"]["packing"] == {"tokens": 64, "sequences": 2, "padded_batch_size": 2, "padded_tokens": 64}


def test_fit_resizes_the_padding_free_row_and_writes_an_sftconfig_that_plans_it(files: dict, tmp_path: Any,
                                                                               capsys: Any) -> None:
    """8 MiB: the config's own packed row of 2 x 32 tokens (8,971,838 bytes) does not fit; one row of
    32 tokens accumulated twice does, and the SFTConfig written (TRL loads it) plans it again, to the byte."""
    from trl import SFTConfig

    from trainer_memcb.cli import main

    written = str(tmp_path / "fit.json")
    argv = sft_argv(files, "packing", "--device-memory", "8MiB", "--reserve", "0B", "--fit",
                    "--write-training-args", written, "--json")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    fit = valid_estimate_document(json.loads(out))["answers"]["fit"]
    assert (fit["fits_as_is"], fit["own"]["peak_bytes"], fit["own"]["training_args"]["per_device_train_batch_size"]) == (
        False, 8_971_838, 2)
    smaller = next(c for c in fit["candidates"] if c["fits"])
    assert (smaller["changes"], smaller["peak_bytes"], smaller["effective_batch"]) == (
        {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}, 4_642_946, 2)
    assert err.splitlines()[-1] == f"trainer-memcb: wrote {written}: SFTConfig of batch 1 x accumulation 2"
    document, config = loaded_trl_config(written, SFTConfig, str(tmp_path / "out"))
    assert document == smaller["training_args"]
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.packing) == (1, 2, True)
    assert main(["estimate", files["model"], "--trainer", "sft", "--training-args", written, "--seq-len", "32",
                 "--device-type", "cpu", "--attn-implementation", "sdpa", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["step"]["peak_bytes"], again["settings"]["packing"]["tokens"]) == (4_642_946, 32)
