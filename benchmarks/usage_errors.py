"""A usage error of `trainer-memcb estimate`, and a model folder that is not there, against
`--version`, start to finish.

    python benchmarks/usage_errors.py            # 10 rounds, about 10 s
    python benchmarks/usage_errors.py --runs 3

Each command is a fresh Python process, as a user runs it (`python -m trainer_memcb`), and the
rounds alternate the order (ABBA) so that a shared machine's drifting load falls on both. It
prints the median wall time of each and the median of the paired ratios (usage error / version);
the target is at most 1.5: the command line is checked before torch and transformers are imported.
`tests/cli/test_cli_fast_usage_errors.py` holds the exact part (nothing heavy imported).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_2_7B = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")
TARGET = 1.5


def wall_seconds(argv: List[str], expected_code: int) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", *argv], env=env, capture_output=True)
    wall = time.perf_counter() - start
    if done.returncode != expected_code:
        raise SystemExit(f"trainer-memcb {' '.join(argv)}: exit {done.returncode}, expected {expected_code}: "
                         f"{done.stderr.decode(errors='replace').strip()}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="rounds (default 10)")
    args = parser.parse_args()
    commands: Dict[str, tuple] = {
        "--version": (["--version"], 0),
        # The case: --seq-len missing for a text model's step plan.
        "estimate 7B --batch-size 4": (["estimate", LLAMA_2_7B, "--batch-size", "4"], 2),
        # A model path with nothing there (exit 1), answered from the path alone.
        "estimate no/such/folder": (["estimate", "no/such/folder"], 1),
    }
    times: Dict[str, List[float]] = {name: [] for name in commands}
    for index in range(args.runs):
        order = list(commands.items())
        for name, (argv, code) in (order if index % 2 == 0 else order[::-1]):
            times[name].append(wall_seconds(argv, code))
    for name, values in times.items():
        print(f"{name:<32} median {statistics.median(values):.3f} s")
    for name in list(commands)[1:]:
        ratio = statistics.median(error / version for error, version in zip(times[name], times["--version"]))
        print(f"{name} / --version: {ratio:.2f} (target <= {TARGET}) {'ok' if ratio <= TARGET else 'OVER'}")


if __name__ == "__main__":
    main()
