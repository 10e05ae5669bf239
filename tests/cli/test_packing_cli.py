"""`estimate --packing TOKENS`: the packed row and its padded equivalent, in the table and the JSON."""

from __future__ import annotations

import json

import pytest

from helpers import tiny_llama_folder
from trainer_memcb.cli import main

pytest.importorskip("transformers")


def test_the_packed_row_is_reported_beside_its_padded_equivalent(tmp_path_factory, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "packing")
    argv = ["estimate", folder, "--batch-size", "1", "--seq-len", "16", "--packing", "40", "--attn-implementation",
            "sdpa", "--device-type", "cpu"]
    assert main(argv + ["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["settings"]["packing"] == {"tokens": 40, "sequences": 3, "padded_batch_size": 2, "padded_tokens": 32}
    assert ["packing", 40, "flag"] in document["settings"]["used"]
    assert document["step"]["problem"] is None
    assert main(argv) == 0
    assert ("1 x 40 packed: 3 sequences of at most 16 tokens, 40 tokens per micro-batch (padded: 2 x 16, 32 tokens)"
            in capsys.readouterr().out)
    # A batch of rows writes no packing key: the documents of before are unchanged.
    assert main(["estimate", folder, "--batch-size", "1", "--seq-len", "16", "--device-type", "cpu", "--json"]) == 0
    assert "packing" not in json.loads(capsys.readouterr().out)["settings"]


@pytest.mark.parametrize("more,line", [
    (["--batch-size", "2"], "batch_size=2 has no meaning with it"),
    (["--batch-size", "1", "--attn-implementation", "flex_attention"], "packed rows are planned with sdpa, eager"),
    (["--batch-size", "1", "--padding", "2"], "is a padding-free batch: padding=2"),
])
def test_a_packed_row_that_cannot_be_planned_is_a_usage_error(tmp_path_factory, capsys, more, line) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "packing-refused")
    assert main(["estimate", folder, "--seq-len", "16", "--packing", "40"] + more) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0]
