"""`trainer-memcb report` and `compare` on real runs made here: two tiny Trainer runs (AdamW with
checkpoints, Adafactor with TensorBoard only), each figure checked against the run's own
`log_history`, never read back from printed text."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np
import pytest
from PIL import Image
from transformers import Trainer

from helpers import (
    TinyDataset,
    accuracy_and_f1,
    drawn_on_a_terminal,
    independent_saved_bytes,
    tiny_classifier,
    training_args,
)
from test_cli_whatif import adafactor_bytes, adamw_bytes  # the byte formulas, written out once
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main
from trainer_memcb.cli.compare import compare_runs
from trainer_memcb.cli.output import TextTable, bytes_cell, print_tables
from trainer_memcb.cli.plots import PLOT_DPI, PLOT_SIZE_INCHES
from trainer_memcb.cli.report import run_report
from trainer_memcb.runs.run_logs import load_run
from trainer_memcb.training.activations_probe import ACTIVATIONS_SUPPORTED

MEASURED = "optimizer_state_bytes"
ESTIMATE = "optimizer_state_estimate_bytes"
PLOT_PIXELS = (int(PLOT_SIZE_INCHES[0] * PLOT_DPI), int(PLOT_SIZE_INCHES[1] * PLOT_DPI))


@dataclass
class Run:
    output_dir: str
    log_history: List[Dict[str, Any]]
    param_shapes: List[tuple]


def _train(output_dir: str, **overrides: Any) -> Run:
    model = tiny_classifier()
    args = training_args(output_dir, eval_strategy="steps", eval_steps=2, **overrides)
    trainer = Trainer(
        model=model, args=args, train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1),
        compute_metrics=accuracy_and_f1, callbacks=[OptimizerMemoryCallback(breakdown=("key", "dtype"))],
    )
    trainer.train()
    shapes = [tuple(param.shape) for param in model.parameters() if param.requires_grad]
    return Run(output_dir, list(trainer.state.log_history), shapes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # AdamW, its history only in checkpoints (save_state is never called), the latest at step 4.
    adamw = _train(str(root / "adamw"), optim="adamw_torch", save_strategy="steps", save_steps=2)
    # Adafactor, its history only in TensorBoard event files.
    adafactor = _train(str(root / "adafactor"), optim="adafactor", report_to=["tensorboard"])
    return {"adamw": adamw, "adafactor": adafactor}


def _steps(log_history):
    return [(e["step"], e.get(MEASURED), e.get(ESTIMATE)) for e in log_history if MEASURED in e or ESTIMATE in e]


def _evals(log_history, as_float32=False):
    cast = (lambda value: float(np.float32(value))) if as_float32 else (lambda value: value)
    return [(e["step"], {"accuracy": cast(e["eval_accuracy"]), "f1": cast(e["eval_f1"])}, e.get(f"eval_{MEASURED}"))
            for e in log_history if "eval_accuracy" in e]


def activations_of_a_batch_of_4() -> int:
    """What the tiny model's forward on a batch of 4 (the runs' batch) saves for backward."""
    model, batch = tiny_classifier(), TinyDataset(4)
    model.train()
    return independent_saved_bytes(model, {"input_ids": batch.input_ids, "labels": batch.labels})


def _report_figures(report):
    steps = [(s.step, s.measured_bytes, s.estimate_bytes) for s in report.steps]
    evals = [(e.step, e.metrics, e.measured_bytes) for e in report.evals]
    return steps, evals


# -- report --------------------------------------------------------------------------------------


def test_report_reads_the_latest_checkpoint_and_matches_the_log_history(runs):
    run = runs["adamw"]
    loaded = load_run(run.output_dir)
    assert loaded.history_file == os.path.join(run.output_dir, "checkpoint-4", "trainer_state.json")
    report = run_report(loaded)
    steps, evals = _report_figures(report)
    assert steps == _steps(run.log_history)
    assert [step for step, _, _ in steps] == [1, 2, 3, 4]
    assert evals == _evals(run.log_history)
    assert [step for step, _, _ in evals] == [2, 4]

    adamw = adamw_bytes(run.param_shapes)
    assert report.optimizer_class == "torch.optim.adamw.AdamW"
    assert not report.history_is_float32
    assert report.estimate_bytes == adamw
    last_train = [e for e in run.log_history if "loss" in e][-1]
    assert report.measured_bytes == report.peak_measured_bytes == last_train[MEASURED] == adamw
    assert report.trainable_params == sum(int(np.prod(shape)) for shape in run.param_shapes)
    assert report.measured_by_key == {"step": 4 * len(run.param_shapes), "exp_avg": (adamw - 4 * len(run.param_shapes)) // 2,
                                      "exp_avg_sq": (adamw - 4 * len(run.param_shapes)) // 2}
    assert report.measured_by_dtype == {"float32": adamw}
    assert report.estimate_by_key == report.measured_by_key
    assert report.final_metrics == evals[-1][1]
    # The step's memory by part, as the last training entry logged it; the activations exact.
    params_bytes = 4 * report.trainable_params
    activations = activations_of_a_batch_of_4()
    assert report.step_memory_step == 4
    assert report.step_memory == {
        "model_params_bytes": params_bytes, "model_grads_bytes": params_bytes,
        MEASURED: adamw, ESTIMATE: adamw,
        "model_states_bytes": 2 * params_bytes + adamw, "model_states_estimate_bytes": 2 * params_bytes + adamw,
        **({"activations_bytes": activations, "activations_peak_bytes": activations} if ACTIVATIONS_SUPPORTED else {}),
    }
    assert {key: last_train[key] for key in report.step_memory} == report.step_memory


def test_report_reads_tensorboard_events_when_there_is_no_state_file(runs):
    run = runs["adafactor"]
    loaded = load_run(run.output_dir)
    assert loaded.history_file is None
    # The reporter's event file; the callback's own beside it (charts and text, no scalars) is not read.
    assert len(loaded.event_files) == 1 and not loaded.event_files[0].endswith(".trainer_memcb")
    assert all(path.startswith(os.path.join(run.output_dir, "runs") + os.sep) for path in loaded.event_files)
    report = run_report(loaded)
    steps, evals = _report_figures(report)
    # Byte counts below 2**24 survive TensorBoard's float32 exactly; the metrics are float32.
    assert steps == _steps(run.log_history)
    assert [step for step, _, _ in steps] == [1, 2, 3, 4]
    assert evals == _evals(run.log_history, as_float32=True)
    assert report.optimizer_class == "transformers.optimization.Adafactor"
    assert report.history_is_float32
    assert report.measured_bytes == report.estimate_bytes == adafactor_bytes(run.param_shapes)


def test_report_command_prints_json_and_writes_the_plot(runs, capsys):
    run = runs["adamw"]
    assert main(["report", run.output_dir, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    plot = os.path.join(run.output_dir, "optimizer_memory.png")
    assert document["plot"] == plot
    assert [(s["step"], s["measured_bytes"], s["estimate_bytes"]) for s in document["steps"]] == _steps(run.log_history)
    assert [(e["step"], e["metrics"], e["measured_bytes"]) for e in document["evals"]] == _evals(run.log_history)
    assert document["what_if"]["optimizers"][0]["estimate"]["num_bytes"] == adamw_bytes(run.param_shapes)
    with Image.open(plot) as image:
        image.load()
        assert image.format == "PNG"
        assert image.size == PLOT_PIXELS == (900, 500)


def test_report_command_prints_tables_and_a_chosen_plot(runs, tmp_path, capsys):
    plot = str(tmp_path / "adafactor.png")
    assert main(["report", runs["adafactor"].output_dir, "--plot", plot]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Run adafactor\n")
    # The step's memory, from TensorBoard's float32 (exact below 2**24), with its parts in order.
    table = out.split("The step's memory by part at step 4 (per process)\n")[1].split("\n\n")[0].splitlines()
    parts = [row.split("  ")[0] for row in table[2:]]
    if not ACTIVATIONS_SUPPORTED:  # torch before 2.8: the model states only
        assert parts == ["parameters", "gradients", "optimizer state", "model states"]
        return
    activations = activations_of_a_batch_of_4()
    assert parts == [
        "parameters", "gradients", "optimizer state", "model states", "activations", "activations, peak",
        "activations: what the step's last micro-batch forward saved for backward (parameters excluded)"]
    assert f"{activations:,}" in table[6] and bytes_cell(activations) in table[6]
    assert f"Plot: {plot}" in out
    with Image.open(plot) as image:
        assert image.size == PLOT_PIXELS


# -- compare -------------------------------------------------------------------------------------


def test_compare_sorts_runs_by_memory_with_their_own_figures(runs, tmp_path, capsys):
    adamw, adafactor = runs["adamw"], runs["adafactor"]
    rows = compare_runs([load_run(adamw.output_dir), load_run(adafactor.output_dir)])
    assert [row.name for row in rows] == ["adafactor", "adamw"]  # the smaller state first
    assert [row.optimizer_class for row in rows] == ["transformers.optimization.Adafactor", "torch.optim.adamw.AdamW"]
    for row, run, as_float32 in ((rows[0], adafactor, True), (rows[1], adamw, False)):
        last_train = [e for e in run.log_history if MEASURED in e][-1]
        assert row.measured_bytes == last_train[MEASURED]
        assert row.estimate_bytes == last_train[ESTIMATE]
        assert row.trainable_params == last_train["optimizer_trainable_params"]
        assert row.final_metrics == _evals(run.log_history, as_float32)[-1][1]
    assert rows[0].measured_bytes < rows[1].measured_bytes

    plot = str(tmp_path / "compare.png")
    assert main(["compare", adamw.output_dir, adafactor.output_dir, "--json", "--plot", plot]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["runs"] == [row.to_dict() for row in rows]
    assert document["plot"] == plot
    with Image.open(plot) as image:
        assert image.size == PLOT_PIXELS


# -- output --------------------------------------------------------------------------------------


def test_tables_are_plain_text_when_piped_and_rich_in_a_terminal():
    table = TextTable("State", ["key", "bytes"], [["exp_avg", bytes_cell(526_264_752)]])
    assert bytes_cell(526_264_752) == "501.9 MiB (526,264,752)"
    assert bytes_cell(None) == "-"

    piped = io.StringIO()
    print_tables([table], piped)
    assert piped.getvalue() == (
        "State\n"
        "key                        bytes\n"
        "-------  -----------------------\n"
        "exp_avg  501.9 MiB (526,264,752)\n"
    )

    # A real pseudo-terminal: rich draws a boxed table there.
    drawn = drawn_on_a_terminal(lambda terminal: print_tables([table], terminal))
    assert "┃" in drawn and "exp_avg" in drawn and "501.9 MiB (526,264,752)" in drawn


# -- bad input -----------------------------------------------------------------------------------


def _fails(argv, capsys, code, *phrases):
    assert main(argv) == code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    for phrase in phrases:
        assert phrase in captured.err, captured.err
    return captured


def test_a_missing_folder_says_so(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    _fails(["report", missing], capsys, 1, f"{missing}: no such folder")
    _fails(["compare", missing], capsys, 1, f"{missing}: no such folder")


def test_a_folder_without_logs_says_where_it_looked(tmp_path, capsys):
    empty = str(tmp_path / "empty")
    os.makedirs(os.path.join(empty, "checkpoint-3"))
    _fails(["report", empty], capsys, 1, f"{empty}: no logs found", os.path.join(empty, "trainer_state.json"),
           "events.out.tfevents.*", os.path.join(empty, "optimizer_memory.json"))


@pytest.mark.parametrize("file_name, text, phrase", [
    ("trainer_state.json", "{not json", "is not valid JSON"),
    ("trainer_state.json", '{"log_history": 3}', "has no 'log_history' list of entries"),
    ("optimizer_memory.json", '{"measured": ', "is not valid JSON"),
    ("optimizer_memory.json", "[]", "is not a trainer_memcb summary"),
])
def test_a_corrupt_json_file_is_named(tmp_path, capsys, file_name, text, phrase):
    path = tmp_path / file_name
    path.write_text(text)
    _fails(["report", str(tmp_path)], capsys, 1, f"{path} {phrase}")


def test_usage_errors_exit_2_and_help_exits_0(capsys):
    _fails([], capsys, 2, "choose a command")
    _fails(["report"], capsys, 2, "the following arguments are required: RUN_DIR")
    _fails(["rapport", "x"], capsys, 2, "invalid choice: 'rapport'")
    _fails(["report", ".", "--plot", "a.png", "--no-plot"], capsys, 2, "not allowed with argument")
    assert main(["--help"]) == 0
    assert "report" in capsys.readouterr().out


def test_the_console_script_declared_in_setup_cfg_is_console_main():
    # `python -m trainer_memcb` is run for real by the 7B what-if test (test_cli_whatif.py).
    import configparser
    import importlib

    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "setup.cfg"))
    scripts = dict(line.split(" = ") for line in setup_cfg["options.entry_points"]["console_scripts"].split("\n") if line)
    module, _, function = scripts["trainer-memcb"].partition(":")
    from trainer_memcb.cli import console_main

    # console_main runs main() in the command's own process (keeping peft out for estimate).
    assert getattr(importlib.import_module(module), function) is console_main


def test_the_docstring_examples_run():
    import doctest

    import trainer_memcb.cli
    import trainer_memcb.runs.run_logs
    import trainer_memcb.plan.optimizers.whatif

    for module in (trainer_memcb.cli, trainer_memcb.runs.run_logs, trainer_memcb.plan.optimizers.whatif):
        outcome = doctest.testmod(module)
        assert outcome.attempted > 0 and outcome.failed == 0, module.__name__
