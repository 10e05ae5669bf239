"""`torch_compile=True` (--training-args or --torch-compile): the step is traced eagerly, and the
plan says so in its "not counted" line and a note rather than printing the eager figure as the
compiled step's."""

from __future__ import annotations

import json

import pytest

from helpers import tiny_llama_folder
from trainer_memcb.cli import main
from trainer_memcb.plan.answers.step_memory import COMPILED_STEP, NOT_COUNTED

pytest.importorskip("transformers")


def test_a_compiled_step_is_said_to_be_planned_as_the_eager_one(tmp_path_factory, tmp_path, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "compiled")
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"torch_compile": True, "per_device_train_batch_size": 2}))
    assert main(["estimate", folder, "--seq-len", "16", "--training-args", str(args), "--json"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["device"]["not_counted"] == list(NOT_COUNTED["cuda"]) + [COMPILED_STEP]
    assert any(note.startswith("torch_compile=True: traced as the eager step") for note in compiled["step"]["notes"])
    assert ["torch_compile", True, "training args"] in compiled["settings"]["used"]
    # The flag says the same; the figures are the eager step's, which they are said to be.
    assert main(["estimate", folder, "--seq-len", "16", "--batch-size", "2", "--torch-compile"]) == 0
    table = capsys.readouterr().out
    assert "torch_compile=True: the compiled step is not traced" in table and "traced as the eager step" in table
    assert main(["estimate", folder, "--seq-len", "16", "--batch-size", "2", "--json"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert eager["step"]["peak_bytes"] == compiled["step"]["peak_bytes"]
    assert COMPILED_STEP not in eager["device"]["not_counted"]
    # torch_compile=false (a dumped TrainingArguments names it) changes nothing, and is not listed.
    args.write_text(json.dumps({"torch_compile": False, "per_device_train_batch_size": 2}))
    assert main(["estimate", folder, "--seq-len", "16", "--training-args", str(args), "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert "torch_compile" not in [row[0] for row in off["settings"]["used"]]
    assert off["device"]["not_counted"] == list(NOT_COUNTED["cuda"])
