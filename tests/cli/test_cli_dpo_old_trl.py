"""`--trainer sft`, `dpo`, `kto`, `grpo` and `rloo` on a TRL older than the one whose step is planned (1.16,
its trainers' fused LM head): one usage line that says so, before anything is traced. Runs where such a
TRL is installed (the oldest releases' pass: TRL 1.14.2 has a KTOTrainer and an RLOOTrainer, without the
fused LM head); skips where TRL is 1.16 or newer."""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any

import pytest

from helpers import installed_version, run_estimate

TRL = installed_version("trl")
pytestmark = pytest.mark.skipif(TRL is None or TRL >= (1, 16), reason="needs a TRL older than 1.16 installed "
                                f"(installed: {TRL})")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("trainer,name,values", [("sft", "SFTTrainer", {"max_length": 8}),
                                                 ("dpo", "DPOTrainer", {"beta": 0.1}),
                                                 ("kto", "KTOTrainer", {"desirable_weight": 1.0}),
                                                 ("grpo", "GRPOTrainer", {"num_generations": 2}),
                                                 ("rloo", "RLOOTrainer", {"num_generations": 2})])
def test_an_older_trl_is_named_in_one_usage_line(tmp_path: Any, capsys: Any, trainer: str, name: str,
                                                 values: dict) -> None:
    config = tmp_path / f"{trainer}.json"
    config.write_text(json.dumps(dict(values, per_device_train_batch_size=2)))
    llama = os.path.join(REPO_ROOT, "tests", "data", "golden", "tiny-llama")
    code, out, err = run_estimate([llama, "--trainer", trainer, "--training-args", str(config), "--seq-len", "8"],
                                  capsys)
    assert (code, out) == (2, "")
    assert err == (f"trainer-memcb: error: --trainer {trainer} needs trl 1.16 or newer (the step planned is its "
                   f"{name}'s, with the fused LM head); installed: trl {importlib.metadata.version('trl')}\n")
