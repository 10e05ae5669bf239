"""The command under hostile run folders and configs: each case answers with figures, or with one
line on stderr and an exit code; never a traceback, never a hang, never a write through a link,
never code from a config.

Run in-process through `main(argv)`, against real files: run folders written by a real Trainer
(checkpoints and TensorBoard events), and files written here with the exact bad value a case needs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Dict, List

import pytest
from PIL import Image
from transformers import Trainer

from helpers import TinyDataset, accuracy_and_f1, drawn_on_a_terminal, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main
from trainer_memcb.cli.output import TextTable, print_json, print_tables

MEASURED = "optimizer_state_bytes"
ESTIMATE = "optimizer_state_estimate_bytes"
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "trainer_memcb")


def _cli(argv: List[str], capsys) -> tuple:
    """Run the command; stderr holds at most one line and never a traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    assert len(captured.err.splitlines()) <= 1, captured.err
    return code, captured.out, captured.err


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _write(path, document: Any) -> str:
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(document if isinstance(document, str) else json.dumps(document))
    return path


def _history(*extra: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Two good training steps and one evaluation around the entries a case adds."""
    return [
        {"step": 1, "loss": 0.7, MEASURED: 88, ESTIMATE: 88, "optimizer_trainable_params": 10},
        *extra,
        {"step": 2, "eval_accuracy": 0.5, "eval_f1": 0.25, f"eval_{MEASURED}": 88},
        {"step": 3, "loss": 0.6, MEASURED: 96, ESTIMATE: 88},
    ]


def _report_json(run_dir: str, capsys, *options: str) -> tuple:
    code, out, err = _cli(["report", run_dir, "--json", "--no-plot", *options], capsys)
    return code, (_strict_json(out) if code == 0 else None), err


def _steps(document: Dict[str, Any]) -> List[tuple]:
    return [(s["step"], s["measured_bytes"], s["estimate_bytes"]) for s in document["steps"]]


# -- values of the wrong type in trainer_state.json ------------------------------------------------


@pytest.mark.parametrize("bad_step, shown", [
    (None, "None"),
    ("two", "'two'"),
    (float("nan"), "nan"),
    (float("inf"), "inf"),
    (2.5, "2.5"),
    (-1, "-1"),
    (True, "True"),
    ([2], "[2]"),
])
def test_an_entry_whose_step_is_not_a_whole_number_is_skipped_with_one_warning(tmp_path, capsys, bad_step, shown):
    # Before: int(None), int("two"), int(nan) raised out of `report` as tracebacks.
    state = _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history({"step": bad_step, MEASURED: 5})})
    code, document, err = _report_json(str(tmp_path / "run"), capsys)
    assert code == 0
    assert _steps(document) == [(1, 88, 88), (3, 96, 88)]
    assert err == (f"trainer-memcb: warning: {state}: skipped 1 value that a run does not log "
                   f"(log_history[1].step = {shown}: not a whole number >= 0)\n")


def test_a_figure_that_is_a_string_is_skipped_and_the_rest_of_its_entry_kept(tmp_path, capsys):
    state = _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history(
        {"step": 2, MEASURED: "88", ESTIMATE: 88, f"{MEASURED}_by_key/exp_avg": 40.5},
    )})
    code, document, err = _report_json(str(tmp_path / "run"), capsys)
    assert code == 0
    assert _steps(document) == [(1, 88, 88), (2, None, 88), (3, 96, 88)]
    assert document["measured_bytes"] == 96 and document["peak_measured_bytes"] == 96
    assert err == (f"trainer-memcb: warning: {state}: skipped 2 values that a run does not log "
                   f"(log_history[1].{MEASURED} = '88': not a whole number >= 0)\n")


def test_the_table_output_survives_the_same_values(tmp_path, capsys):
    # Before: f"{'88':,}" in bytes_cell raised ValueError while printing the table.
    _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history(
        {"step": None}, {"step": 2, MEASURED: "88", "eval_accuracy": "high"},
    )})
    code, out, err = _cli(["report", str(tmp_path / "run"), "--no-plot"], capsys)
    assert code == 0
    assert out.startswith("Run run\n")
    assert "skipped 3 values" in err


def test_metrics_not_shown_may_hold_anything(tmp_path, capsys):
    # A run may log a confusion matrix; only the metrics the command shows are checked.
    _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history(
        {"step": 2, "eval_confusion_matrix": [[3, 1], [0, 4]], "eval_accuracy": 0.875},
    )})
    code, document, err = _report_json(str(tmp_path / "run"), capsys)
    assert code == 0 and err == ""
    assert [e["metrics"] for e in document["evals"]] == [{"accuracy": 0.875}, {"accuracy": 0.5, "f1": 0.25}]
    code, document, err = _report_json(str(tmp_path / "run"), capsys, "--metrics", "confusion_matrix")
    assert code == 0
    assert err == (f"trainer-memcb: warning: {tmp_path / 'run' / 'trainer_state.json'}: skipped 1 value that a run "
                   "does not log (log_history[1].eval_confusion_matrix = [[3, 1], [0, 4]]: not a number)\n")


def test_compare_names_the_one_run_it_cannot_read_and_shows_the_others(tmp_path, capsys):
    _write(tmp_path / "good" / "trainer_state.json", {"log_history": _history()})
    bad = _write(tmp_path / "bad" / "trainer_state.json", "[" * 100_000)
    code, out, err = _cli(["compare", str(tmp_path / "good"), str(tmp_path / "bad"), "--json"], capsys)
    assert code == 1  # a run left out
    assert [row["run_dir"] for row in json.loads(out)["runs"]] == [str(tmp_path / "good")]
    assert err == f"trainer-memcb: warning: {bad} is nested deeper than 64 levels; left out\n"
    # When no run can be read, the failure is the answer, in one line.
    code, out, err = _cli(["compare", str(tmp_path / "bad")], capsys)
    assert code == 1 and out == ""
    assert err == f"trainer-memcb: {bad} is nested deeper than 64 levels\n"


def test_a_history_that_is_not_a_list_of_entries_is_refused(tmp_path, capsys):
    state = _write(tmp_path / "trainer_state.json", {"log_history": [{"step": 1}, 3]})
    code, out, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1 and out == ""
    assert err == (f"trainer-memcb: {state} has no 'log_history' list of entries; "
                   "is it a Trainer's trainer_state.json?\n")


# -- the summary: sections of the wrong shape -----------------------------------------------------


def _summary(**sections: Any) -> Dict[str, Any]:
    document = {
        "format_version": 1, "optimizer_class": "torch.optim.adamw.AdamW", "global_step": 3,
        "measured": {"num_bytes": 96, "bytes_by_key": {"exp_avg": 44, "exp_avg_sq": 44, "step": 8},
                     "bytes_by_dtype": {"float32": 96}},
        "estimate": {"num_bytes": 88, "num_params": 10, "optimizer_class": "torch.optim.adamw.AdamW",
                     "bytes_by_key": {"exp_avg": 40, "exp_avg_sq": 40, "step": 8}},
        "peak_measured_bytes": 96,
        "what_if": {"trainable_params": 10, "optimizers": [
            {"name": "adamw_torch", "estimate": {"num_bytes": 88}, "problem": None},
            {"name": "adamw_bnb_8bit", "estimate": None, "problem": "bitsandbytes is not installed"},
        ]},
    }
    document.update(sections)
    return document


@pytest.mark.parametrize("sections, where, skipped", [
    ({"measured": [96]}, "measured = [96]: not an object", 1),
    ({"estimate": "88"}, "estimate = '88': not an object", 1),
    ({"measured": {"num_bytes": "96", "bytes_by_key": [1, 2]}}, "measured.num_bytes = '96': not a whole number >= 0", 2),
    ({"estimate": {"num_bytes": 88, "bytes_by_key": {"exp_avg": "40", "step": 8}}},
     "estimate.bytes_by_key.exp_avg = '40': not a whole number >= 0", 1),
    ({"what_if": []}, "what_if = []: not an object", 1),
    ({"what_if": {"trainable_params": 10, "optimizers": 3}}, "what_if.optimizers = 3: not a list", 1),
    ({"what_if": {"trainable_params": 10, "optimizers": [7, {"name": 5, "estimate": {"num_bytes": -1}}]}},
     "what_if.optimizers[0] = 7: not an object", 3),
    ({"peak_measured_bytes": float("inf")}, "peak_measured_bytes = inf: not a whole number >= 0", 1),
    ({"optimizer_class": ["torch"]}, "optimizer_class = ['torch']: not a string", 1),
])
def test_a_summary_section_of_the_wrong_shape_is_skipped_with_one_warning(tmp_path, capsys, sections, where, skipped):
    # Before: dict([1, 2]), "what_if".get on a list, f"{'96':,}": tracebacks.
    run = tmp_path / "run"
    _write(run / "trainer_state.json", {"log_history": _history()})
    summary = _write(run / "optimizer_memory.json", _summary(**sections))
    code, document, err = _report_json(str(run), capsys)
    assert code == 0
    assert _steps(document) == [(1, 88, 88), (3, 96, 88)]
    plural = "value" if skipped == 1 else "values"
    assert err == (f"trainer-memcb: warning: {summary}: skipped {skipped} {plural} that a summary "
                   f"does not hold ({where})\n")
    code, out, err = _cli(["report", str(run), "--no-plot"], capsys)  # the tables too
    assert code == 0 and out.startswith("Run run\n") and err.count("\n") == 1


def test_a_summary_without_its_sections_is_refused(tmp_path, capsys):
    summary = _write(tmp_path / "optimizer_memory.json", {"measured": None})
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {summary} is not a trainer_memcb summary (no 'measured' and 'estimate')\n"


# -- JSON: depth, size, count, numbers ------------------------------------------------------------


@pytest.mark.parametrize("file_name", ["trainer_state.json", "optimizer_memory.json"])
def test_json_nested_past_the_recursion_limit_is_refused(tmp_path, capsys, file_name):
    # Before: json.load raised RecursionError, a traceback.
    depth = 100_000
    path = _write(tmp_path / file_name, '{"log_history": ' + "[" * depth + "]" * depth + "}")
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {path} is nested deeper than 64 levels\n"


def test_json_nested_deeper_than_the_bound_but_readable_is_refused(tmp_path, capsys):
    path = _write(tmp_path / "trainer_state.json", '{"log_history": [{"step": 1, "x": ' + "[" * 70 + "]" * 70 + "}]}")
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {path} is nested deeper than 64 levels\n"


def test_an_integer_too_long_for_python_is_refused(tmp_path, capsys):
    # Before: json raised ValueError (Exceeds the limit for integer string conversion), a traceback.
    path = _write(tmp_path / "trainer_state.json", '{"log_history": [{"step": ' + "7" * 5000 + "}]}")
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err.startswith(f"trainer-memcb: {path} is not valid JSON (")


def test_a_file_larger_than_the_bound_is_refused_unread(tmp_path, capsys):
    path = str(tmp_path / "trainer_state.json")
    with open(path, "wb") as handle:
        handle.truncate(128 * 1024 * 1024 + 1)  # sparse: nothing is written to disk
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {path} is larger than 134,217,728 bytes (128.0 MiB); not read\n"


def test_a_history_with_more_entries_than_the_bound_is_refused(tmp_path, capsys):
    path = _write(tmp_path / "trainer_state.json", '{"log_history": [' + ",".join(["{}"] * 1_000_001) + "]}")
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {path} holds more than 1,000,000 log entries; not read\n"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_in_place_of_a_file_is_refused_without_waiting(tmp_path, capsys):
    # Before: open() waited forever for a writer.
    path = str(tmp_path / "trainer_state.json")
    os.mkfifo(path)
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {path} is not a regular file; not read\n"


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_link_to_an_endless_device_is_refused(tmp_path, capsys):
    path = str(tmp_path / "trainer_state.json")
    os.symlink("/dev/zero", path)
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {path} is not a regular file; not read\n"


@pytest.mark.parametrize("file_name", ["trainer_state.json", "optimizer_memory.json"])
def test_a_folder_in_place_of_a_file_is_refused(tmp_path, capsys, file_name):
    os.makedirs(tmp_path / file_name)
    code, _, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {tmp_path / file_name} is not a regular file; not read\n"


def test_a_plot_into_a_missing_folder_is_one_line(tmp_path, capsys):
    _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history()})
    plot = str(tmp_path / "missing" / "plot.png")
    code, out, err = _cli(["report", str(tmp_path / "run"), "--plot", plot], capsys)
    assert code == 1 and out.startswith("Run run\n")
    assert err == f"trainer-memcb: no plot: could not write the plot to {plot} (No such file or directory)\n"


def test_report_json_is_strict_json_with_null_for_non_finite_numbers(tmp_path, capsys):
    # Before: `report --json` printed NaN and Infinity, which no strict parser reads.
    _write(tmp_path / "trainer_state.json", {"log_history": [
        {"step": 1, MEASURED: 88, ESTIMATE: 88},
        {"step": 2, "eval_accuracy": float("nan"), "eval_f1": float("-inf"), "eval_loss": float("inf")},
    ]})
    code, document, err = _report_json(str(tmp_path), capsys)
    assert code == 0 and err == ""
    assert document["evals"] == [{"step": 2, "metrics": {"accuracy": None, "f1": None}, "measured_bytes": None}]
    stream = io.StringIO()
    print_json({"a": [float("nan"), 1.5, {"b": float("inf")}], "c": 3}, stream)
    assert _strict_json(stream.getvalue()) == {"a": [None, 1.5, {"b": None}], "c": 3}


# -- real runs: checkpoints, TensorBoard, links ----------------------------------------------------


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real Trainer run: checkpoints at steps 2 and 4 and TensorBoard events, no top-level state."""
    output_dir = str(tmp_path_factory.mktemp("real") / "adamw")
    trainer = Trainer(
        model=tiny_classifier(), args=training_args(output_dir, eval_strategy="steps", eval_steps=2,
                                                    save_strategy="steps", save_steps=2, report_to=["tensorboard"]),
        train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1), compute_metrics=accuracy_and_f1,
        callbacks=[OptimizerMemoryCallback()],
    )
    trainer.train()
    history = list(trainer.state.log_history)
    steps = [(e["step"], e[MEASURED], e[ESTIMATE]) for e in history if MEASURED in e and "loss" in e]
    assert [step for step, _, _ in steps] == [1, 2, 3, 4]
    return output_dir, steps


def _copy(real_run, tmp_path, name: str = "run") -> str:
    target = str(tmp_path / name)
    shutil.copytree(real_run[0], target, symlinks=True)
    return target


def test_a_half_written_newest_checkpoint_falls_back_to_the_newest_complete_one(real_run, tmp_path, capsys):
    # Before: the truncated checkpoint-4 state was refused (exit 1) although checkpoint-2 was whole.
    run = _copy(real_run, tmp_path)
    newest = os.path.join(run, "checkpoint-4", "trainer_state.json")
    with open(newest, "r+", encoding="utf-8") as handle:
        handle.truncate(len(handle.read()) // 2)
    os.makedirs(os.path.join(run, "checkpoint-6"))  # a save that had only made its folder
    code, document, err = _report_json(run, capsys)
    assert code == 0
    assert document["history_source"] == os.path.join(run, "checkpoint-2", "trainer_state.json")
    assert _steps(document) == real_run[1][:2]
    assert err == (f"trainer-memcb: warning: {os.path.join(run, 'checkpoint-6')} and "
                   f"{os.path.join(run, 'checkpoint-4')} are incomplete (no readable trainer_state.json); "
                   f"read {os.path.join(run, 'checkpoint-2')}\n")


def test_a_half_written_top_level_state_falls_back_to_a_complete_checkpoint(real_run, tmp_path, capsys):
    # Before: refused (exit 1) although checkpoint-4 was whole.
    run = _copy(real_run, tmp_path)
    state = _write(os.path.join(run, "trainer_state.json"), '{"log_history": [{"step": 1, ')
    code, document, err = _report_json(run, capsys)
    assert code == 0
    assert document["history_source"] == os.path.join(run, "checkpoint-4", "trainer_state.json")
    assert _steps(document) == real_run[1]
    assert err == (f"trainer-memcb: warning: {state} is not valid JSON (Expecting property name enclosed in double "
                   f"quotes: line 1 column 30 (char 29)); read {document['history_source']} instead\n")


def test_only_incomplete_checkpoints_fall_back_to_the_event_files(real_run, tmp_path, capsys):
    run = _copy(real_run, tmp_path)
    for step in (2, 4):
        os.remove(os.path.join(run, f"checkpoint-{step}", "trainer_state.json"))
    code, document, err = _report_json(run, capsys)
    assert code == 0
    assert document["history_source"].startswith(os.path.join(run, "runs") + os.sep)
    assert _steps(document) == real_run[1]
    assert err.startswith("trainer-memcb: warning: ") and "are incomplete" in err


def _events_only(real_run, tmp_path) -> str:
    run = _copy(real_run, tmp_path)
    for step in (2, 4):
        shutil.rmtree(os.path.join(run, f"checkpoint-{step}"))
    return run


def test_links_to_the_folder_itself_and_to_usr_are_not_followed(real_run, tmp_path, capsys):
    # Before: glob("**") followed a -> . and b -> . (2**40 paths) and /usr: minutes, a hang.
    run = _events_only(real_run, tmp_path)
    os.symlink(".", os.path.join(run, "a"))
    os.symlink(".", os.path.join(run, "b"))
    os.symlink("/usr", os.path.join(run, "usr"))
    os.symlink(os.path.join(run, "runs"), os.path.join(run, "runs_again"))
    code, document, err = _report_json(run, capsys)
    assert code == 0 and err == ""
    assert document["history_source"].startswith(os.path.join(run, "runs") + os.sep)
    assert _steps(document) == real_run[1]


def test_an_event_file_that_is_a_link_is_not_read(real_run, tmp_path, capsys):
    run = _events_only(real_run, tmp_path)
    (events,) = [os.path.join(folder, name) for folder, _, names in os.walk(os.path.join(run, "runs"))
                 for name in names if name.startswith("events.out.tfevents.") and not name.endswith(".trainer_memcb")]
    os.replace(events, os.path.join(str(tmp_path), "elsewhere"))
    os.symlink(os.path.join(str(tmp_path), "elsewhere"), events)
    code, document, err = _report_json(run, capsys)  # the callback's summary is still there
    assert code == 0 and err == ""
    assert document["history_source"] is None and document["steps"] == []
    assert document["measured_bytes"] == real_run[1][-1][1]


def test_a_truncated_event_file_gives_what_it_holds_or_one_line(real_run, tmp_path, capsys):
    run = _events_only(real_run, tmp_path)
    (events,) = [os.path.join(folder, name) for folder, _, names in os.walk(os.path.join(run, "runs"))
                 for name in names if name.startswith("events.out.tfevents.") and not name.endswith(".trainer_memcb")]
    size = os.path.getsize(events)
    with open(events, "r+b") as handle:
        handle.truncate(size - 7)
    code, document, err = _report_json(run, capsys)
    assert code == 0
    assert _steps(document)[:3] == real_run[1][:3]
    assert err == ""


def test_a_folder_deeper_than_the_bound_is_not_searched(real_run, tmp_path, capsys):
    run = _events_only(real_run, tmp_path)
    deep = os.path.join(run, *["d"] * 20)
    shutil.move(os.path.join(run, "runs"), deep)
    code, document, err = _report_json(run, capsys)
    assert code == 0 and err == ""
    assert document["history_source"] is None and document["steps"] == []
    os.remove(os.path.join(run, "optimizer_memory.json"))
    code, _, err = _cli(["report", run, "--no-plot"], capsys)
    assert code == 1
    assert err.startswith(f"trainer-memcb: {run}: no logs found.")


# -- plots: run names, extensions, links, partial files -------------------------------------------


@pytest.mark.parametrize("name", ["r$\\frac{$", "cost $5 or $6", "a$b$c", "$", "x_{$}^$"])
def test_a_run_name_with_dollar_signs_is_plotted_as_written(tmp_path, capsys, name):
    # Before: matplotlib parsed the name as mathtext: "r$\frac{$" raised ParseSyntaxException.
    run = tmp_path / name
    _write(run / "trainer_state.json", {"log_history": _history()})
    _write(run / "optimizer_memory.json", _summary(optimizer_class="my$opt", estimate={"num_bytes": 88, "optimizer_class": "a$b"}))
    code, out, err = _cli(["report", str(run)], capsys)
    assert code == 0 and err == ""
    with Image.open(run / "optimizer_memory.png") as image:
        assert image.format == "PNG" and image.size == (900, 500)
    plot = str(tmp_path / "compare.png")
    code, out, err = _cli(["compare", str(run), str(run), "--plot", plot, "--metrics", "acc$"], capsys)
    assert code == 0 and err == ""
    with Image.open(plot) as image:
        assert image.format == "PNG"


def test_the_title_holds_the_run_name_literally(tmp_path):
    from trainer_memcb.cli.plots import report_figure
    from trainer_memcb.cli.report import run_report
    from trainer_memcb.runs.run_logs import load_run

    run = tmp_path / "a$b$c"
    _write(run / "trainer_state.json", {"log_history": _history()})
    figure = report_figure(run_report(load_run(str(run))), ["accuracy"])
    title = figure.axes[0].title
    assert title.get_text() == "a$b$c: optimizer state"
    figure.canvas.draw()  # drawn as plain text: no mathtext parse
    assert not title._preprocess_math(title.get_text())[1]


@pytest.mark.parametrize("plot", ["out.xyz", "out.PNG.exe", "out.pgf", "out."])
def test_a_plot_path_with_an_unknown_extension_is_refused_before_any_work(tmp_path, capsys, plot):
    # Before: matplotlib raised ValueError("Format 'xyz' is not supported"), a traceback.
    _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history()})
    path = str(tmp_path / plot)
    for argv in (["report", str(tmp_path / "run"), "--plot", path], ["compare", str(tmp_path / "run"), "--plot", path]):
        code, out, err = _cli(argv, capsys)
        assert code == 2 and out == ""
        assert err == (f"trainer-memcb: error: --plot {path}: the extension must be .png, .pdf or .svg "
                       "(none means .png)\n")
    assert sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.parametrize("plot, kind", [("out.pdf", b"%PDF"), ("out.svg", b"<?xml"), ("out", b"\x89PNG"),
                                        ("out.PNG", b"\x89PNG")])
def test_the_allowed_extensions_write_that_format_at_that_exact_path(tmp_path, capsys, plot, kind):
    _write(tmp_path / "run" / "trainer_state.json", {"log_history": _history()})
    code, out, err = _cli(["report", str(tmp_path / "run"), "--plot", str(tmp_path / plot)], capsys)
    assert code == 0 and err == ""
    with open(tmp_path / plot, "rb") as handle:
        assert handle.read(len(kind)) == kind
    assert sorted(os.listdir(tmp_path)) == sorted(["run", plot])


def test_a_planted_link_in_place_of_the_plot_is_refused_and_its_target_kept(tmp_path, capsys):
    # Before: `report` wrote the PNG through the link, over the file outside the run folder.
    run = tmp_path / "run"
    _write(run / "trainer_state.json", {"log_history": _history()})
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = str(run / "optimizer_memory.png")
    os.symlink(str(target), link)
    code, out, err = _cli(["report", str(run), "--json", "--plot", link], capsys)
    assert code == 1 and _strict_json(out)["plot"] is None
    assert err == f"trainer-memcb: no plot: {link} is a symbolic link; not writing through it\n"
    code, out, err = _cli(["report", str(run), "--json"], capsys)  # the default plot: a warning
    assert code == 0 and _strict_json(out)["plot"] is None
    assert err == f"trainer-memcb: no plot: {link} is a symbolic link; not writing through it\n"
    assert target.read_text() == "keep me"
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert sorted(os.listdir(run)) == ["optimizer_memory.png", "trainer_state.json"]


def test_a_dangling_link_in_place_of_the_plot_is_refused_too(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run / "trainer_state.json", {"log_history": _history()})
    link = str(run / "optimizer_memory.png")
    os.symlink(str(tmp_path / "created_outside.png"), link)
    code, _, err = _cli(["report", str(run)], capsys)
    assert code == 0 and "is a symbolic link; not writing through it" in err
    assert not os.path.exists(tmp_path / "created_outside.png")


def test_a_plot_that_cannot_be_put_in_place_leaves_no_partial_file(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run / "trainer_state.json", {"log_history": _history()})
    os.makedirs(run / "optimizer_memory.png")  # a folder where the plot goes
    code, _, err = _cli(["report", str(run), "--plot", str(run / "optimizer_memory.png")], capsys)
    assert code == 1
    assert err == f"trainer-memcb: no plot: {run / 'optimizer_memory.png'} is not a regular file; not replacing it\n"
    assert sorted(os.listdir(run)) == ["optimizer_memory.png", "trainer_state.json"]


def test_a_failed_write_removes_its_temporary_file_and_keeps_the_old_one(tmp_path):
    from trainer_memcb.utils.safe_io import atomic_write

    path = str(tmp_path / "out.png")
    with open(path, "wb") as handle:
        handle.write(b"old")

    def half_then_fail(handle) -> None:
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert os.listdir(tmp_path) == ["out.png"]
    with open(path, "rb") as handle:
        assert handle.read() == b"old"
    atomic_write(path, lambda handle: handle.write(b"new"))
    with open(path, "rb") as handle:
        assert handle.read() == b"new"
    assert os.listdir(tmp_path) == ["out.png"]
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- estimate: configs that ask for code -----------------------------------------------------------


def _remote_code_config(folder, **config: Any) -> str:
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(str(folder), "code_ran")
    with open(os.path.join(str(folder), "configuration_evil.py"), "w", encoding="utf-8") as handle:
        handle.write(
            "from transformers import PretrainedConfig\n"
            f"open({marker!r}, 'w').write('ran')\n"
            "class EvilConfig(PretrainedConfig):\n"
            "    model_type = 'evil'\n"
        )
    _write(os.path.join(str(folder), "config.json"), {
        "model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}, **config,
    })
    return marker


@pytest.mark.parametrize("config", [{}, {"model_type": "llama"}])
def test_estimate_refuses_a_config_that_asks_to_run_its_code_even_when_told_yes(tmp_path, capsys, monkeypatch, config):
    # Before: AutoConfig.from_pretrained asked on stdin, and "y" ran configuration_evil.py.
    folder = tmp_path / "evil"
    marker = _remote_code_config(folder, **config)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = _cli(["estimate", str(folder)], capsys)
    assert code == 1 and out == ""
    assert err == (f"trainer-memcb: {folder}: its config.json asks to run code from the model's files "
                   "(auto_map); that code is never run\n")
    assert not os.path.exists(marker)


def test_estimate_errors_are_one_line(tmp_path, capsys):
    # Before: transformers' message for an unknown model_type spanned three lines.
    folder = tmp_path / "unknown"
    _write(folder / "config.json", {"model_type": "nosuchmodel"})
    code, out, err = _cli(["estimate", str(folder)], capsys)
    assert code == 1 and out == ""
    assert err.startswith(f"trainer-memcb: {folder}: could not read a model config (The checkpoint you are trying")
    for bad in ('{"model_type": ', "[" * 100_000 + "]" * 100_000):
        _write(folder / "config.json", bad)
        code, out, err = _cli(["estimate", str(folder)], capsys)
        assert code == 1
        assert err.startswith(f"trainer-memcb: {folder}: could not read a model config ({folder / 'config.json'} is ")


# Modules that turn bytes into live objects (and so can run code on load).
_UNPICKLERS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}


def _unsafe(tree) -> List[str]:
    """What the package must not do, found in its syntax tree (comments and docstrings aside)."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in _UNPICKLERS]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module in _UNPICKLERS or (module == "torch" and any(a.name == "load" for a in node.names)):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            found.append("torch.load")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec"):
            found.append(f"{node.func.id}(")
        elif isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and not (
                isinstance(node.value, ast.Constant) and node.value.value is False):
            found.append("trust_remote_code other than =False")
        elif isinstance(node, ast.Constant) and node.value == "trust_remote_code":
            found.append("trust_remote_code passed by name")
    return found


# The two modules that import pickle, and what of it each uses: a memory snapshot is a pickle, read
# by an unpickler whose `find_class` refuses every global (so a hostile file runs nothing:
# tests/plan/device/test_snapshot_replay.py), and the plan is written as one (`pickle.dumps` of
# dicts, lists, strings and numbers).
_PICKLE_ALLOWED = {os.path.join("plan", "device", "snapshot_file.py"): {"pickle.Unpickler"},
                   os.path.join("cli", "plan_files.py"): {"pickle.dumps"}}


def _pickle_uses(tree) -> set:
    """The names of pickle's that a module uses (`pickle.X`)."""
    import ast

    return {f"pickle.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "pickle"}


def test_the_package_loads_no_pickle_and_runs_no_code():
    import ast

    found, passed_false = [], 0
    for folder, _, names in os.walk(PACKAGE_DIR):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            tree = ast.parse(text)
            relative = os.path.relpath(path, PACKAGE_DIR)
            unsafe = _unsafe(tree)
            if relative in _PICKLE_ALLOWED:  # pickle imported, for what the allowance says and nothing else
                assert "import pickle" in unsafe and _pickle_uses(tree) == _PICKLE_ALLOWED[relative], relative
                unsafe.remove("import pickle")
            found += [f"{path}: {what}" for what in unsafe]
            # The text too, for what the syntax tree would not show as a call (a string passed to a shell).
            found += [f"{path}: {word}" for word in ("torch.load(", "pickle.load(", "pickle.loads(") if word in text]
            passed_false += sum(isinstance(node, ast.keyword) and node.arg == "trust_remote_code"
                                for node in ast.walk(tree))
    assert found == []
    assert passed_false >= 2  # AutoConfig.from_pretrained and the model's from_config both pass False


def test_the_check_for_unsafe_code_finds_each_kind():
    import ast

    planted = ast.parse(
        "import pickle\nfrom torch import load\nimport torch\ntorch.load('x')\neval('1')\nexec('x=1')\n"
        "AutoConfig.from_pretrained('m', trust_remote_code=True)\nf(**{'trust_remote_code': True})\n"
        "model.eval()\nf(trust_remote_code=False)\n"
    )
    assert sorted(_unsafe(planted)) == sorted([
        "import pickle", "from torch import ...", "torch.load", "eval(", "exec(",
        "trust_remote_code other than =False", "trust_remote_code passed by name",
    ])


# -- the last resort --------------------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    # Mocked: the command has no known failure left to trigger for real, so one is planted.
    import trainer_memcb.cli.report as report  # the command imports it when it runs

    def broken(*args, **kwargs):
        raise RuntimeError("planted\nsecond line")

    _write(tmp_path / "trainer_state.json", {"log_history": _history()})
    monkeypatch.setattr(report, "run_report", broken)
    code, out, err = _cli(["report", str(tmp_path), "--no-plot"], capsys)
    assert code == 1
    assert err == ("trainer-memcb: unexpected error: RuntimeError: planted second line "
                   "(run with --debug for the traceback)\n")
    assert main(["--debug", "report", str(tmp_path), "--no-plot"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: planted" in err
    assert main(["report", str(tmp_path), "--no-plot", "--debug"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_message_with_a_newline_in_a_path_stays_one_line(tmp_path, capsys):
    missing = str(tmp_path / "two\nlines")
    code, _, err = _cli(["report", missing], capsys)
    assert code == 1
    assert err == f"trainer-memcb: {tmp_path}/two lines: no such folder\n"


def test_new_breakdown_names_and_old_ones_are_both_read(tmp_path, capsys):
    _write(tmp_path / "new" / "trainer_state.json", {"log_history": [
        {"step": 1, MEASURED: 88, f"{MEASURED}_by_key/exp_avg": 40, f"{MEASURED}_by_key/step": 8,
         f"{MEASURED}_by_dtype/float32": 88},
    ]})
    _write(tmp_path / "old" / "trainer_state.json", {"log_history": [
        {"step": 1, MEASURED: 88, f"{MEASURED}/by_key/exp_avg": 40, f"{MEASURED}/by_key/step": 8,
         f"{MEASURED}/by_dtype/float32": 88},
    ]})
    for name in ("new", "old"):
        code, document, err = _report_json(str(tmp_path / name), capsys)
        assert code == 0 and err == ""
        assert document["measured_by_key"] == {"exp_avg": 40, "step": 8}
        assert document["measured_by_dtype"] == {"float32": 88}


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    # Before: BrokenPipeError as a traceback, then "Exception ignored ... BrokenPipeError".
    _write(tmp_path / "trainer_state.json", {"log_history": _history()})
    process = subprocess.Popen([sys.executable, "-m", "trainer_memcb", "report", str(tmp_path), "--json", "--no-plot"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # as `| head -c 0` would
    err = process.stderr.read().decode()
    assert process.wait() == 1
    # Only our own lines are checked: importing torch and its optional libraries may print here.
    assert "trainer-memcb" not in err and "BrokenPipe" not in err and "Traceback" not in err, err


def test_names_that_look_like_rich_markup_are_printed_as_written():
    # Before: rich read "[/]" as a closing tag and raised MarkupError when stdout was a terminal.
    table = TextTable("Run [/]", ["run", "bytes"], [["[/]", "1"], ["[bold]x", "2"]], note="[link=x]")
    drawn = drawn_on_a_terminal(lambda terminal: print_tables([table], terminal))
    assert "Run [/]" in drawn and "[bold]x" in drawn and "[link=x]" in drawn


def test_the_new_modules_docstring_examples_run():
    import doctest

    import trainer_memcb.cli.output
    import trainer_memcb.cli.plots
    import trainer_memcb.runs.run_values
    import trainer_memcb.utils.safe_io

    for module in (trainer_memcb.utils.safe_io, trainer_memcb.runs.run_values, trainer_memcb.cli.output, trainer_memcb.cli.plots):
        outcome = doctest.testmod(module)
        assert outcome.attempted > 0 and outcome.failed == 0, module.__name__
