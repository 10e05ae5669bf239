"""What every script run by torchrun in the tests shares: where it writes, how it records warnings.

Each process writes one JSON file, `rank<N>.json`, into the directory given as the first argument,
so that the test can assert exact numbers per process.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Dict, List

# The scripts import the tests' helpers (tiny models, data) and the package from this checkout.
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.join(TESTS_DIR, "training"))  # the Trainer tests' fixtures and optimizers
sys.path.insert(0, os.path.dirname(TESTS_DIR))

# Libraries that are installed (the test extra) but that no step here uses, kept out of each process
# as the estimate command keeps them out (`trainer_memcb.cli.estimate_command.prepare_process`): a
# None in sys.modules reads as not installed to `importlib.util.find_spec`, which transformers' and
# peft's availability checks ask, and as an ImportError to DeepSpeed's optional `import mlflow`
# (its autotuner). Importing them is seconds of each process's start (mlflow about 2 s, torchao
# about 2 s, peft with bitsandbytes about 1 s), times every process of every launch; the steps
# are those of plain models with torch's optimizers, which none of them changes.
for _unused in ("mlflow", "torchao", "peft", "bitsandbytes"):
    sys.modules.setdefault(_unused, None)  # type: ignore[arg-type]


def rank() -> int:
    return int(os.environ["RANK"])


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def write_result(out_dir: str, result: Dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{rank()}.json")
    with open(f"{path}.partial", "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)
    os.replace(f"{path}.partial", path)


def memcb_warnings(caught: List[warnings.WarningMessage]) -> List[str]:
    return [str(warning.message) for warning in caught if str(warning.message).startswith("trainer_memcb")]
