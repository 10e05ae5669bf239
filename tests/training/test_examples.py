"""The examples, run for a few steps offline, and their outputs read back.

The tiny-model runs call each script's `main(argv)` in this process (the examples folder goes on
`sys.path`, as it does for `python examples/<script>.py`); the distilbert-base-cased runs are real
`python examples/compare_optimizers.py` subprocesses with `HF_HUB_OFFLINE=1`, so the offline build
of the architecture is what runs: the README's main job (its tiny part cut to one step) on a
pseudo-terminal, whose lesson's table must be the one docs/getting-started.md shows, and the
`--model distilbert-base-cased` run of the guide. Nothing is mocked but bitsandbytes' kernel
notice, which this CPU does not make (its test says how it is sent instead).
"""

from __future__ import annotations

import fcntl
import filecmp
import json
import math
import os
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import read_until_closed
from test_accelerate_loop import tensorboard_scalars
from test_docs import output_differs, parse_blocks
from trainer_memcb.training.figures import ESTIMATE_BYTES, MEASURED_BYTES, TRAINABLE_PARAMS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, EXAMPLES)

import compare_optimizers  # noqa: E402
import train_with_accelerate  # noqa: E402
import train_with_trainer  # noqa: E402
from text_classification import MODELS_DIR, TINY_MODEL  # noqa: E402

TINY_RUN = ["--model", TINY_MODEL, "--train-samples", "48", "--eval-samples", "32", "--batch-size", "8",
            "--logging-steps", "1"]
SEED_PARAMS = 65_783_042  # distilbert-base-cased with a 2-label head, as the lesson counts it
SEED_ADAMW_BYTES = 526_264_752  # 8 x 65,783,042 + 4 x 104 step tensors
# The lesson's other two, as README.md and docs/getting-started.md give them (worked out in the
# guide: Adafactor's rows and columns; 8-bit codes, with the Trainer's 32-bit embeddings).
SEED_ADAFACTOR_BYTES = 714_432
SEED_ADAMW_8BIT_BYTES = 269_269_008

# Each test makes its own Accelerator (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def tiny_model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(str(MODELS_DIR / TINY_MODEL), num_labels=2)
    return AutoModelForSequenceClassification.from_config(config)


def expected_state_bytes(model: torch.nn.Module) -> Dict[str, int]:
    """Each optimizer's state for `model` after a step, worked out from the shapes alone."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    params = list(model.parameters())
    adamw = sum(8 * p.numel() + 4 for p in params)  # exp_avg, exp_avg_sq fp32 + a 0-dim fp32 step
    # transformers Adafactor, beta1=None: a fp32 row and column second moment for a matrix, a full
    # one for a vector, and a 0-dim fp32 RMS per tensor; `step` is an int.
    adafactor = sum(4 + 4 * (p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel()) for p in params)
    # bitsandbytes 8-bit AdamW through the Trainer: embeddings are registered for 32-bit state, and
    # tensors under 4,096 values stay 32-bit; 8-bit ones hold uint8 codes plus an fp32 scale per
    # 256 values for each of the two states; the two 256-entry fp32 quantization maps are shared.
    adamw_8bit = 2 * 256 * 4 + sum(
        8 * p.numel() if id(p) in embeddings or p.numel() < 4096 else 2 * (p.numel() + 4 * math.ceil(p.numel() / 256))
        for p in params
    )
    return {"adamw": adamw, "adafactor": adafactor, "adamw_8bit": adamw_8bit}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    output_dir = str(tmp_path_factory.mktemp("compare"))
    assert compare_optimizers.main(TINY_RUN + ["--max-steps", "3", "--no-lesson", "--output-dir", output_dir]) == 0
    with open(os.path.join(output_dir, compare_optimizers.COMPARISON_FILE_NAME), encoding="utf-8") as handle:
        return {"output_dir": output_dir, **json.load(handle)}


def test_comparison_rows_measured_equals_estimate_for_all_three(comparison):
    model = tiny_model()
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params == 454_530
    expected = expected_state_bytes(model)
    assert expected == {"adamw": 3_636_400, "adafactor": 37_296, "adamw_8bit": 1_193_488}
    rows: List[Dict[str, Any]] = comparison["rows"]
    assert [row["optimizer"] for row in rows] == ["adamw", "adafactor", "adamw_8bit"]
    for row in rows:
        assert row["measured_bytes"] == row["estimate_bytes"] == expected[row["optimizer"]], row["optimizer"]
        assert row["trainable_params"] == row["model_params"] == num_params
        assert row["steps"] == 3
        assert 0.0 <= row["eval_accuracy"] <= 1.0 and 0.0 <= row["eval_f1"] <= 1.0
        assert row["seconds_per_step"] > 0
    assert [row["optimizer_class"] for row in rows] == [
        "torch.optim.adamw.AdamW", "transformers.optimization.Adafactor", "bitsandbytes.optim.adamw.AdamW"
    ]
    assert rows[2]["measured_bytes_by_key"].keys() == {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}


def test_comparison_tensorboard_runs_overlay_under_one_folder(comparison):
    tensorboard_dir = os.path.join(comparison["output_dir"], "tensorboard")
    assert sorted(os.listdir(tensorboard_dir)) == ["adafactor", "adamw", "adamw_8bit"]
    assert tensorboard_runs(tensorboard_dir) == ["adafactor", "adamw", "adamw_8bit"]  # as TensorBoard lists them
    for row in comparison["rows"]:
        scalars = tensorboard_scalars(os.path.join(tensorboard_dir, row["optimizer"]))
        # Float32 in TensorBoard: these sizes are below 2**24, so they come back exact.
        assert scalars[f"train/{MEASURED_BYTES}"] == [(step, float(row["measured_bytes"])) for step in (1, 2, 3)]
        assert scalars[f"train/{ESTIMATE_BYTES}"][-1] == (3, float(row["estimate_bytes"]))
        assert scalars[f"eval/{MEASURED_BYTES}"] == [(3, float(row["measured_bytes"]))]
        assert scalars["eval/accuracy"] == [(3, pytest.approx(row["eval_accuracy"]))]
        assert scalars["eval/f1"] == [(3, pytest.approx(row["eval_f1"]))]
        # The callback's view, in the folder of the example's own TensorBoardCallback(SummaryWriter(...)).
        events = EventAccumulator(os.path.join(tensorboard_dir, row["optimizer"]), size_guidance={"tensors": 0})
        events.Reload()
        assert {"custom_scalars__config__", "optimizer_memory/text_summary"} <= set(events.Tags()["tensors"])
        [text] = events.Tensors("optimizer_memory/text_summary")
        assert f"({row['measured_bytes']:,} bytes)" in text.tensor_proto.string_val[0].decode("utf-8")


def test_comparison_run_folders_feed_trainer_memcb_compare(comparison):
    from trainer_memcb.cli.compare import compare_runs
    from trainer_memcb.runs.run_logs import load_run

    rows = {row["optimizer"]: row for row in comparison["rows"]}
    runs = [load_run(os.path.join(comparison["output_dir"], name)) for name in rows]
    assert all(run.history_file is not None for run in runs)  # each run saved its trainer_state.json
    for compared in compare_runs(runs):
        row = rows[compared.name]
        assert compared.measured_bytes == compared.estimate_bytes == row["measured_bytes"]
        assert compared.final_metrics == {"accuracy": row["eval_accuracy"], "f1": row["eval_f1"]}


def test_the_closing_lines_name_the_runs_and_the_lessons_runs_as_the_command_takes_them(comparison, capsys):
    from trainer_memcb.cli import main

    output_dir = comparison["output_dir"]
    names = [row["optimizer"] for row in comparison["rows"]]
    assert names == ["adamw", "adafactor", "adamw_8bit"]
    with_lesson = {**comparison, "lesson": {"rows": comparison["rows"]}}
    folder, lesson = output_dir, os.path.join(output_dir, "lesson")
    assert compare_optimizers.closing_lines(output_dir, with_lesson) == [
        f"Rows: {os.path.join(output_dir, 'comparison.json')}",
        f"The runs: trainer-memcb compare {' '.join(os.path.join(folder, name) for name in names)}",
        f"The runs in TensorBoard: tensorboard --logdir {os.path.join(folder, 'tensorboard')}",
        f"The lesson's runs: trainer-memcb compare {' '.join(os.path.join(lesson, name) for name in names)}",
        f"The lesson's runs in TensorBoard: tensorboard --logdir {os.path.join(lesson, 'tensorboard')}",
    ]
    # The command as printed compares the runs the example made.
    [runs_line] = [line for line in compare_optimizers.closing_lines(output_dir, comparison)
                   if line.startswith("The runs: ")]
    assert main(runs_line.split(": ", 1)[1].split()[1:] + ["--json"]) == 0
    assert sorted(row["name"] for row in json.loads(capsys.readouterr().out)["runs"]) == sorted(names)


def test_the_examples_import_without_other_libraries_import_notices():
    """torchao's kernels built for another Python, torch's deprecation of registering enums, ...:
    none of it is printed; another warning of the same loggers still is."""
    code = ("import logging, sys\n"
            f"sys.path.insert(0, {EXAMPLES!r})\n"
            "import compare_optimizers, train_with_trainer, train_with_accelerate\n"
            "logging.getLogger('torchao').warning('another torchao warning')\n")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Printed by logging's last-resort handler, or by the handler of a library that configured
    # logging (`logging.basicConfig`) on import, as the oldest releases' pass meets.
    assert done.stderr in ("another torchao warning\n", "WARNING:torchao:another torchao warning\n")


def test_comparison_table_prints_exact_bytes_and_mib(comparison):
    table = compare_optimizers.comparison_table(comparison["rows"]).splitlines()
    assert table[0].split() == ["optimizer", "trainable", "params", "measured", "state", "estimate", "eval",
                                "accuracy", "eval", "F1", "s/step"]
    assert table[2].split()[:4] == ["adamw", "454,530", "3,636,400", "(3.5"]


def tensorboard_runs(log_dir: str) -> List[str]:
    """The runs TensorBoard lists for `--logdir log_dir`: its own discovery (each folder holding
    event files, named by its path under `log_dir`, the folder itself ".")."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    return sorted(EventMultiplexer().AddRunsFromDirectory(log_dir).Runs())


def test_trainer_example_logs_the_figures_to_tensorboard_and_the_summary(tmp_path):
    argv = TINY_RUN + ["--optim", "adafactor", "--max-steps", "2", "--output-dir", str(tmp_path)]
    assert train_with_trainer.main(argv) == 0
    with open(tmp_path / "optimizer_memory.json", encoding="utf-8") as handle:
        summary = json.load(handle)
    expected = expected_state_bytes(tiny_model())["adafactor"]
    assert summary["measured"]["num_bytes"] == summary["estimate"]["num_bytes"] == expected
    # The run is named for its optimizer, under the printed --logdir and under the output folder.
    assert tensorboard_runs(str(tmp_path / "tensorboard")) == ["adafactor"]
    assert tensorboard_runs(str(tmp_path)) == ["tensorboard/adafactor"]
    scalars = tensorboard_scalars(str(tmp_path / "tensorboard" / "adafactor"))
    assert scalars[f"train/{MEASURED_BYTES}"] == [(1, float(expected)), (2, float(expected))]
    assert scalars[f"train/{TRAINABLE_PARAMS}"] == [(1, 454_530.0), (2, 454_530.0)]
    assert [step for step, _ in scalars["eval/accuracy"]] == [2]


def test_accelerate_example_logs_the_figures_each_optimizer_step(tmp_path):
    argv = TINY_RUN + ["--max-steps", "3", "--gradient-accumulation-steps", "2", "--output-dir", str(tmp_path)]
    assert train_with_accelerate.main(argv) == 0
    expected = expected_state_bytes(tiny_model())["adamw"]
    # The tracker's run is named for its optimizer (not "tensorboard"), as the Trainer example's.
    assert tensorboard_runs(str(tmp_path / "tensorboard")) == ["adamw"]
    assert tensorboard_runs(str(tmp_path)) == ["tensorboard/adamw"]
    scalars = tensorboard_scalars(str(tmp_path / "tensorboard" / "adamw"))
    assert scalars[MEASURED_BYTES] == scalars[ESTIMATE_BYTES] == [(step, float(expected)) for step in (1, 2, 3)]
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3]
    assert [step for step, _ in scalars["eval_accuracy"]] == [step for step, _ in scalars["eval_f1"]] == [3]
    with open(tmp_path / "optimizer_memory.json", encoding="utf-8") as handle:
        summary = json.load(handle)
    assert (summary["global_step"], summary["measured"]["num_bytes"]) == (3, expected)


def test_accelerate_example_logs_the_last_step_and_eval_figures_beside_eval_accuracy(tmp_path):
    # 3 steps with logging every 5: no logging step comes, and the last step is logged anyway.
    argv = TINY_RUN + ["--max-steps", "3", "--logging-steps", "5", "--output-dir", str(tmp_path)]
    assert train_with_accelerate.main(argv) == 0
    expected = expected_state_bytes(tiny_model())["adamw"]
    scalars = tensorboard_scalars(str(tmp_path / "tensorboard" / "adamw"))
    assert scalars[MEASURED_BYTES] == scalars[ESTIMATE_BYTES] == [(3, float(expected))]
    assert [step for step, _ in scalars["loss"]] == [3]
    assert [step for step, _ in scalars["eval_accuracy"]] == [3]
    assert scalars[f"eval_{MEASURED_BYTES}"] == scalars[f"eval_{ESTIMATE_BYTES}"] == [(3, float(expected))]
    assert scalars[f"eval_{TRAINABLE_PARAMS}"] == [(3, 454_530.0)]


@pytest.mark.slow
def test_the_main_job_shows_progress_and_ends_with_the_lessons_table(tmp_path):
    """The README's main job, `python examples/compare_optimizers.py`, with its tiny part cut to one
    step (the lesson's part is what it always is), on a pseudo-terminal as a person runs it."""
    command = [sys.executable, os.path.join(EXAMPLES, "compare_optimizers.py"), "--max-steps", "1",
               "--train-samples", "8", "--eval-samples", "8", "--output-dir", str(tmp_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    leader, follower = os.openpty()
    # A terminal 40 x 160: with no size, tqdm (dynamic_ncols) has no width to draw its bars in.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen(command, stdout=follower, stderr=follower, cwd=REPO, env=env)
    os.close(follower)
    shown = read_until_closed(leader).decode("utf-8", "replace")
    assert process.wait(timeout=600) == 0, shown[-4000:]
    with open(tmp_path / "comparison.json", encoding="utf-8") as handle:
        lesson = json.load(handle)["lesson"]
    assert lesson["model"] == "distilbert-base-cased"
    assert lesson["origin"].startswith("built from examples/models/distilbert-base-cased/config.json with random weights")
    rows = {row["optimizer"]: row for row in lesson["rows"]}
    assert list(rows) == ["adamw", "adafactor", "adamw_8bit"]
    expected = {"adamw": SEED_ADAMW_BYTES, "adafactor": SEED_ADAFACTOR_BYTES, "adamw_8bit": SEED_ADAMW_8BIT_BYTES}
    for name, row in rows.items():
        assert (row["model_params"], row["trainable_params"], row["steps"]) == (SEED_PARAMS, SEED_PARAMS, 1), name
        assert row["measured_bytes"] == row["estimate_bytes"] == expected[name], name
    assert rows["adamw"]["measured_elements"] == 131_566_188  # the lesson's count: 2 x 65,783,042 + 104
    # The lesson's table at the end, as printed, is the one docs/getting-started.md shows under the
    # main job (up to the paths, which follow --output-dir).
    lesson_table = shown[shown.index("The lesson's numbers"):shown.index("\nRows: ")]
    page = (Path(REPO) / "docs" / "getting-started.md").read_text(encoding="utf-8")
    [shown_on_the_page] = [block.code for block in parse_blocks(page) if block.lang == "text"
                           and block.code.startswith("Model: tiny-distilbert, 454,530 parameters")]
    on_the_page = shown_on_the_page[shown_on_the_page.index("The lesson's numbers"):
                                    shown_on_the_page.index("\nRows: ")]
    assert output_differs(on_the_page, lesson_table) is None, output_differs(on_the_page, lesson_table)
    assert "adamw             65,783,042  526,264,752 (501.9 MiB)  526,264,752 (501.9 MiB)" in lesson_table
    # Progress while it trains: a line per run, and the Trainer's bar reaching its one step; the
    # tokenizer's trainer draws no bar (it read "410 / 0" on a terminal).
    for name in rows:
        assert f"Training distilbert-base-cased with {name} (" in shown
    assert shown.count("1/1 [") >= 6  # each run's training bar, tiny and lesson, at its end
    assert " / 0" not in shown


@pytest.mark.slow
def test_distilbert_base_cased_built_offline_holds_the_lessons_numbers(tmp_path):
    command = [sys.executable, os.path.join(EXAMPLES, "compare_optimizers.py"), "--model", "distilbert-base-cased",
               "--optimizers", "adamw", "--max-steps", "1", "--train-samples", "8", "--eval-samples", "8",
               "--batch-size", "8", "--output-dir", str(tmp_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    completed = subprocess.run(command, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(tmp_path / "comparison.json", encoding="utf-8") as handle:
        comparison = json.load(handle)
    assert "random weights" in comparison["origin"] and "distilbert-base-cased" in comparison["origin"]
    (row,) = comparison["rows"]
    assert (row["model_params"], row["trainable_params"]) == (SEED_PARAMS, SEED_PARAMS)
    assert row["measured_bytes"] == row["estimate_bytes"] == SEED_ADAMW_BYTES
    assert row["measured_elements"] == 131_566_188  # the lesson's count: 2 x 65,783,042 + 104


@pytest.mark.parametrize("script", [compare_optimizers, train_with_trainer, train_with_accelerate])
def test_every_example_has_help_and_the_shared_options(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    options = {word.strip(",") for word in capsys.readouterr().out.split() if word.startswith("--")}
    assert {"--help", "--model", "--max-steps", "--output-dir", "--num-epochs", "--eval-samples"} <= options


def test_the_lesson_follows_the_comparison_unless_it_is_of_the_lessons_model_or_left_out():
    def runs(*argv: str) -> bool:
        return compare_optimizers.runs_the_lesson(compare_optimizers.parser().parse_args(list(argv)))

    assert runs() and runs("--max-steps", "3") and runs("--model", "distilbert-base-cased", "--lesson")
    assert not runs("--no-lesson")
    assert not runs("--model", "distilbert-base-cased")
    assert not runs("--model", str(MODELS_DIR / "distilbert-base-cased"))
    assert compare_optimizers.LESSON_ARGUMENTS["max_steps"] == 1


def test_an_unknown_optimizer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare_optimizers.main(["--optimizers", "adamw,sgd"])
    assert exit_info.value.code == 2
    assert "choose a comma-separated list from adamw, adafactor, adamw_8bit" in capsys.readouterr().err


def test_shipped_reviews_are_what_the_generator_writes(tmp_path):
    sys.path.insert(0, os.path.join(EXAMPLES, "data", "reviews"))
    try:
        import make_reviews
    finally:
        sys.path.pop(0)
    make_reviews.main(str(tmp_path))
    for split in ("train.csv", "validation.csv"):
        assert filecmp.cmp(tmp_path / split, os.path.join(EXAMPLES, "data", "reviews", split), shallow=False), split


def test_a_local_folder_with_weights_loads_them_and_its_tokenizer(tmp_path):
    from text_classification import load_model

    texts = ["the film was superb.", "the plot was dull."]
    built = load_model(TINY_MODEL, texts, seed=3)
    built.model.save_pretrained(str(tmp_path))
    built.tokenizer.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path), texts)
    assert loaded.origin == f"pretrained weights and tokenizer from {tmp_path}"
    assert loaded.tokenizer("the plot was superb.")["input_ids"] == built.tokenizer("the plot was superb.")["input_ids"]
    saved, reloaded = built.model.state_dict(), loaded.model.state_dict()
    assert saved.keys() == reloaded.keys()
    assert all(torch.equal(saved[key], reloaded[key]) for key in saved)


def test_the_examples_drop_bitsandbytes_kernel_notice_and_nothing_else():
    # On a CPU with AVX-512 BF16, importing bitsandbytes logs this warning through its CPU backend's
    # logger (bitsandbytes/backends/cpu/ops.py); this CPU has none, so the same record is sent
    # through the same logger, in a fresh process that imports an example first, as they run.
    code = ("import logging, sys\n"
            f"sys.path.insert(0, {EXAMPLES!r})\n"
            "import train_with_trainer\n"
            "logger = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
            "logger.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
            "already `pip install kernels` and the kernels >= 0.11.1', 'offline')\n"
            "logger.warning('another bitsandbytes warning')\n")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gemm_4bit_forward" not in done.stderr
    assert "another bitsandbytes warning\n" in done.stderr
