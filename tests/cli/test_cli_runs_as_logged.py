"""`report` and `compare` on the runs users have: metrics as the run logged them, runs made without
the callback, `compare --no-plot`, and tables in narrow terminals (a real pseudo-terminal, the
installed console script)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
from typing import Any, Dict

import numpy as np
import pytest
from transformers import Trainer

from helpers import TinyDataset, drawn_on_a_terminal, read_until_closed, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main
from trainer_memcb.cli.compare import compare_runs
from trainer_memcb.cli.output import TextTable, print_tables
from trainer_memcb.cli.plots import compare_figure, report_figure
from trainer_memcb.cli.report import logged_metrics, run_report
from trainer_memcb.runs.run_logs import load_run

SCRIPT = os.path.join(os.path.dirname(sys.executable), "trainer-memcb")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG_NAME = "nb_with_callback_adamw_torch_fused"
# Escape sequences a terminal acts on (colours, bold), not text.
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def accuracy_only(eval_prediction: Any) -> Dict[str, float]:
    predictions = np.argmax(eval_prediction.predictions, axis=-1)
    return {"accuracy": float((predictions == eval_prediction.label_ids).mean())}


def _train(output_dir: str, callback: bool, compute_metrics=None, **overrides: Any) -> str:
    trainer = Trainer(
        model=tiny_classifier(), args=training_args(output_dir, max_steps=2, eval_strategy="steps", eval_steps=2,
                                                    **overrides),
        train_dataset=TinyDataset(8), eval_dataset=TinyDataset(8, seed=1), compute_metrics=compute_metrics,
        callbacks=[OptimizerMemoryCallback(what_if=())] if callback else [],
    )
    trainer.train()
    trainer.save_state()
    return output_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("as_logged")
    return {
        # Accuracy, no F1; a long name, the Trainer's default fused AdamW.
        "accuracy": _train(str(root / LONG_NAME), True, accuracy_only, optim="adamw_torch_fused"),
        # No compute_metrics, as TRL's trainers evaluate: eval_loss only.
        "loss": _train(str(root / "loss_only"), True),
        # The same Trainer without the callback.
        "plain": _train(str(root / "plain"), False, accuracy_only),
    }


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out else None), captured.err


# -- metrics as logged ---------------------------------------------------------------------------


def test_report_shows_the_metrics_the_run_logged(runs, capsys):
    code, document, err = run_json(capsys, "report", runs["accuracy"], "--no-plot")
    assert (code, err) == (0, "")
    assert document["metrics"] == ["accuracy"]
    assert [sorted(evaluation["metrics"]) for evaluation in document["evals"]] == [["accuracy"]]
    code, document, err = run_json(capsys, "report", runs["loss"], "--no-plot")
    assert (code, err, document["metrics"]) == (0, "", ["loss"])
    # The table: no column of "-" for F1, which the run never logged.
    assert main(["report", runs["accuracy"], "--no-plot"]) == 0
    table = capsys.readouterr().out.split("Evaluations\n")[1].splitlines()
    assert table[0].split() == ["step", "accuracy", "state", "measured"]
    # Asked for, a metric is shown as asked, logged or not.
    code, document, err = run_json(capsys, "report", runs["accuracy"], "--no-plot", "--metrics", "accuracy,f1")
    assert code == 0 and document["metrics"] == ["accuracy", "f1"]


def test_the_plot_draws_a_metric_axis_only_for_metrics_the_run_logged(runs):
    run = load_run(runs["accuracy"], ())
    assert logged_metrics([run]) == ["accuracy"]
    with_accuracy = report_figure(run_report(run, ["accuracy"]), ["accuracy"])
    assert len(with_accuracy.axes) == 2 and with_accuracy.axes[1].get_ylim() == (0.0, 1.05)
    without = report_figure(run_report(run, ["f1"]), ["f1"])  # an evaluation, but no F1 in it
    assert len(without.axes) == 1
    loss = load_run(runs["loss"], ())
    loss_figure = report_figure(run_report(loss, ["loss"]), ["loss"])
    (value,) = [e.metrics["loss"] for e in run_report(loss, ["loss"]).evals]
    assert len(loss_figure.axes) == 2 and loss_figure.axes[1].get_ylim()[1] >= value  # a loss has its own scale
    assert len(compare_figure(compare_runs([run, loss], ["f1"]), ["f1"]).axes) == 1
    both = ["accuracy", "loss"]
    assert len(compare_figure(compare_runs([run, loss], both), both).axes) == 2


def test_compare_shows_the_metrics_any_run_logged(runs, capsys):
    code, document, err = run_json(capsys, "compare", runs["accuracy"], runs["loss"])
    assert (code, err) == (0, "")
    assert document["metrics"] == ["accuracy"]  # accuracy and F1 first, where a run logged them
    code, document, err = run_json(capsys, "compare", runs["loss"])
    assert document["metrics"] == ["loss"] and [row["final_metrics"] for row in document["runs"]][0].keys() == {"loss"}


# -- runs made without the callback -------------------------------------------------------------


def test_report_on_a_run_without_the_callback_says_so_and_writes_no_plot(runs, capsys):
    plot = os.path.join(runs["plain"], "optimizer_memory.png")
    assert main(["report", runs["plain"]]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"trainer-memcb: {runs['plain']}: no optimizer memory figures in "
                            f"{os.path.join(runs['plain'], 'trainer_state.json')}: the run was made without "
                            "OptimizerMemoryCallback (or OptimizerMemoryLogger)\n")
    assert not os.path.exists(plot)


def test_compare_with_a_run_without_the_callback_warns_and_shows_the_others(runs, capsys, tmp_path):
    plot = str(tmp_path / "compare.png")
    assert main(["compare", runs["plain"], runs["accuracy"], "--plot", plot]) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"trainer-memcb: warning: {runs['plain']}: no optimizer memory figures in "
                            f"{os.path.join(runs['plain'], 'trainer_state.json')}: the run was made without "
                            "OptimizerMemoryCallback (or OptimizerMemoryLogger); left out\n")
    rows = [line.split()[0] for line in captured.out.splitlines()[3:] if line.strip() and not line.startswith("Plot")]
    assert rows == [LONG_NAME] and os.path.exists(plot)
    assert main(["compare", runs["plain"]]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("trainer-memcb: no run holds optimizer memory figures: they were made without "
                       "OptimizerMemoryCallback (or OptimizerMemoryLogger)") and len(err) == 2


def test_compare_no_plot(runs, capsys, tmp_path):
    code, document, _ = run_json(capsys, "compare", runs["accuracy"], "--no-plot")
    assert code == 0 and document["plot"] is None
    assert main(["compare", runs["accuracy"], "--no-plot", "--plot", str(tmp_path / "x.png")]) == 2
    assert "argument --plot: not allowed with argument --no-plot" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.png")


# -- narrow terminals -----------------------------------------------------------------------------


def on_a_terminal(columns: int, *argv: str, env_columns: str = "") -> str:
    """The installed script's output on a real pseudo-terminal `columns` wide."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    if env_columns:
        env["COLUMNS"] = env_columns
    env["HF_HUB_OFFLINE"] = "1"
    process = subprocess.Popen([SCRIPT, *argv], stdout=follower, stderr=subprocess.PIPE, cwd=REPO_ROOT, env=env)
    os.close(follower)
    drawn = read_until_closed(leader)
    assert process.wait(timeout=600) == 0, process.stderr.read().decode()
    process.stderr.close()
    return ANSI.sub("", drawn.decode("utf-8"))


def assert_whole(drawn: str, *words: str) -> int:
    """Every word whole in `drawn` (no ellipsis, no word cut at a line's end); returns the widest line."""
    assert "…" not in drawn, drawn
    widest = max(len(line) for line in drawn.splitlines())
    for word in words:
        assert re.search(rf"(?<![\w,.]){re.escape(word)}(?![\w,])", drawn), (word, drawn)
    return widest


@pytest.mark.parametrize("columns, env_columns", [(120, ""), (120, "80")])
def test_tables_fold_in_a_narrow_terminal_and_keep_names_and_byte_counts_whole(runs, columns, env_columns):
    width = int(env_columns or columns)
    drawn = on_a_terminal(columns, "compare", runs["accuracy"], runs["loss"], env_columns=env_columns)
    document = load_run(runs["accuracy"], ())
    counts = {f"({entry['optimizer_state_bytes']:,})" for entry in document.log_history if "optimizer_state_bytes" in entry}
    assert assert_whole(drawn, LONG_NAME, "loss_only", "torch.optim.adamw.AdamW", *counts) <= width
    estimate = on_a_terminal(columns, "estimate", "examples/models/llama-2-7b", "--world-size", "64", "--zero", "3",
                             "--precision", "deepspeed-bf16", "--optimizers", "adamw_torch_fused,adafactor,adamw_8bit",
                             "--device-memory", "80GiB", "--reserve", "0B", env_columns=env_columns)
    assert assert_whole(estimate, "adamw_torch_fused", "adafactor", "adamw_8bit", "(842,301,960)", "(210,575,488)",
                        "(83,768,048,632)") <= width


def test_a_table_too_wide_for_the_terminal_turns_on_its_side_or_shows_one_row_at_a_time(monkeypatch):
    long_cell = "transformers.optimization.Adafactor"
    table = TextTable("Plan", ["optimizer", "parameters", "gradients", "optimizer state", "class"],
                      [[name, "200.8 MiB (210,575,488)", "200.8 MiB (210,575,488)", "803.3 MiB (842,301,956)", long_cell]
                       for name in ("adamw_torch_fused", "adafactor")])
    monkeypatch.setenv("COLUMNS", "200")
    wide = ANSI.sub("", drawn_on_a_terminal(lambda terminal: print_tables([table], terminal)))
    assert re.search(r"┃ optimizer\s+┃\s+parameters\s+┃", wide)  # as it is
    monkeypatch.setenv("COLUMNS", "90")
    side = ANSI.sub("", drawn_on_a_terminal(lambda terminal: print_tables([table], terminal)))
    assert re.search(r"┃ optimizer\s+┃ adamw_torch_fused\s+┃ adafactor\s+┃", side)  # one column per row
    monkeypatch.setenv("COLUMNS", "60")
    records = ANSI.sub("", drawn_on_a_terminal(lambda terminal: print_tables([table], terminal)))
    assert len(re.findall(r"┃ optimizer\s+┃ (adamw_torch_fused|adafactor)\s+┃", records)) == 2  # one table per row
    for drawn, width in ((wide, 200), (side, 90), (records, 60)):
        assert assert_whole(drawn, "adamw_torch_fused", "(842,301,956)", long_cell) <= width
