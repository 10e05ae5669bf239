"""`--trainer dpo` on a TRL older than the one whose step is planned (1.16, its DPOTrainer's fused LM
head): one usage line that says so, before anything is traced. Runs where such a TRL is installed
(the oldest releases' pass); skips where TRL is 1.16 or newer."""

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


def test_an_older_trl_is_named_in_one_usage_line(tmp_path: Any, capsys: Any) -> None:
    config = tmp_path / "dpo.json"
    config.write_text(json.dumps({"beta": 0.1, "per_device_train_batch_size": 2}))
    llama = os.path.join(REPO_ROOT, "tests", "data", "golden", "tiny-llama")
    code, out, err = run_estimate([llama, "--trainer", "dpo", "--training-args", str(config), "--seq-len", "8"], capsys)
    assert (code, out) == (2, "")
    assert err == ("trainer-memcb: error: --trainer dpo needs trl 1.16 or newer (the step planned is its DPOTrainer's, "
                   f"with the fused LM head); installed: trl {importlib.metadata.version('trl')}\n")
