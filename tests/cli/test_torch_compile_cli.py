"""`torch_compile=True` (--training-args or --torch-compile): the step is traced compiled, what its
forward saves for backward chosen by AOTAutograd's min-cut partitioner, and the plan's "not counted"
line names what that trace leaves out (Inductor's fusion, its buffers); where the compiled step
cannot be traced (a sharded step, a torch whose dynamo cannot compile on fake tensors), the eager
step is traced and the plan says so in its "not counted" line and its notes."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_llama_folder
from trainer_memcb.cli import main
from trainer_memcb.plan.answers.step_memory import COMPILED_NOT_COUNTED, COMPILED_STEP, NOT_COUNTED

pytest.importorskip("transformers")

# torch 2.6's AOTAutograd asserts that the tracing context's fake mode is the inputs' own: there
# the compiled step cannot be traced on the plan's fake tensors, and the eager step is.
COMPILES = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _estimate(capsys, *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # two compiled plans: dynamo compiles each (about 19 s here)
def test_a_compiled_step_is_planned_from_the_min_cut_partition(tmp_path_factory, tmp_path, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "compiled")
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"torch_compile": True, "per_device_train_batch_size": 2}))
    compiled = _estimate(capsys, folder, "--seq-len", "16", "--training-args", str(args))
    eager = _estimate(capsys, folder, "--seq-len", "16", "--batch-size", "2")
    assert ["torch_compile", True, "training args"] in compiled["settings"]["used"]
    assert COMPILED_STEP not in eager["device"]["not_counted"] and COMPILED_NOT_COUNTED not in eager["device"]["not_counted"]
    if COMPILES:
        assert compiled["device"]["not_counted"] == list(NOT_COUNTED["cuda"]) + [COMPILED_NOT_COUNTED]
        assert any(note.startswith("torch_compile=True: traced compiled") for note in compiled["step"]["notes"])
        # The partition saves 284,808 bytes for backward where the eager step saves 357,512; the
        # peak, in the optimizer step here, is the same.
        assert (compiled["step"]["activations_bytes"], eager["step"]["activations_bytes"]) == (284808, 357512)
        assert compiled["step"]["peak_bytes"] == eager["step"]["peak_bytes"] == 2299800
    else:
        assert compiled["device"]["not_counted"] == list(NOT_COUNTED["cuda"]) + [COMPILED_STEP]
        assert any(note.startswith("torch_compile=True: the compiled step could not be traced")
                   for note in compiled["step"]["notes"])
        assert compiled["step"]["activations_bytes"] == eager["step"]["activations_bytes"]
    # The flag says the same, in the table.
    assert main(["estimate", folder, "--seq-len", "16", "--batch-size", "2", "--torch-compile"]) == 0
    table = capsys.readouterr().out
    assert ("traced with AOTAutograd's min-cut partition" in table) == COMPILES
    # torch_compile=false (a dumped TrainingArguments names it) changes nothing, and is not listed.
    args.write_text(json.dumps({"torch_compile": False, "per_device_train_batch_size": 2}))
    off = _estimate(capsys, folder, "--seq-len", "16", "--training-args", str(args))
    assert "torch_compile" not in [row[0] for row in off["settings"]["used"]]
    assert off["device"]["not_counted"] == list(NOT_COUNTED["cuda"])


def test_a_sharded_compiled_step_is_said_to_be_planned_as_the_eager_one(tmp_path_factory, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "compiled-ddp")
    shape = ("--seq-len", "16", "--batch-size", "2", "--sharding", "ddp", "--world-size", "2")
    compiled = _estimate(capsys, folder, *shape, "--torch-compile")
    eager = _estimate(capsys, folder, *shape)
    assert compiled["device"]["not_counted"] == list(NOT_COUNTED["cuda"]) + [COMPILED_STEP]
    assert "torch_compile=True: the compiled step is traced on one process without sharding only" in \
        compiled["step"]["notes"]
    assert any(note.startswith("torch_compile=True: traced as the eager step") for note in compiled["step"]["notes"])
    assert compiled["step"]["peak_bytes"] == eager["step"]["peak_bytes"]
    assert compiled["step"]["activations_bytes"] == eager["step"]["activations_bytes"]
