"""`trainer-memcb estimate` against accelerate's `estimate-memory`, start to finish, on Llama-2-7B.

    python benchmarks/startup.py             # 10 pairs, about 4 minutes on 2 busy cores
    python benchmarks/startup.py --runs 3

Each side is a fresh Python process, as a user runs it, and the pairs alternate (ABBA) so that a
shared machine's drifting load falls on both. Wall time is measured around the process, peak
memory is the child's own peak resident set (`os.wait4`'s `ru_maxrss`). Ours runs twice: with
`--optimizers adamw`, the question accelerate answers, and with the default three optimizers. It
prints the medians and the paired medians of the ratios (ours / accelerate's); the target is at
most 1.0 for both.

accelerate's `estimate-memory` asks the Hugging Face Hub for the model's metadata first
(`verify_on_hub`), so offline it cannot run on a local config. Its side here is a script doing
what `accelerate.commands.estimate.gather_data` does after that call: read the config, build
`AutoModel` under `init_empty_weights` in float32, `calculate_maximum_sizes`, and
`estimate_training_usage`, then print the "Training using Adam" figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_2_7B = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")

ACCELERATE_SIDE = """
import sys, torch
from accelerate import init_empty_weights
from accelerate.commands.estimate import estimate_training_usage
from accelerate.utils import calculate_maximum_sizes, convert_bytes
from transformers import AutoConfig, AutoModel
config = AutoConfig.from_pretrained(sys.argv[1])
with init_empty_weights():
    model = AutoModel.from_config(config, dtype=torch.float32)
total_size, largest_layer = calculate_maximum_sizes(model)
print("Training using Adam:", convert_bytes(max(estimate_training_usage(total_size, "float32").values())))
"""


def run_once(command: List[str]) -> Tuple[float, int]:
    """(wall seconds, peak resident bytes) of one process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit code {process.returncode}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="pairs of runs (default 10)")
    parser.add_argument("--model", default=LLAMA_2_7B, help="a folder holding config.json (default: Llama-2-7B's)")
    args = parser.parse_args()
    commands = {
        # The question accelerate answers: Adam's state for the model.
        "trainer-memcb --optimizers adamw": [sys.executable, "-m", "trainer_memcb", "estimate", args.model,
                                             "--optimizers", "adamw"],
        # The default: AdamW, Adafactor and 8-bit AdamW (bitsandbytes imported to build it).
        "trainer-memcb (default 3 optim.)": [sys.executable, "-m", "trainer_memcb", "estimate", args.model],
        "accelerate estimate-memory": [sys.executable, "-c", ACCELERATE_SIDE, args.model],
    }
    results = {name: [] for name in commands}
    for index in range(args.runs):
        order = list(commands.items())
        for name, command in (order if index % 2 == 0 else order[::-1]):
            results[name].append(run_once(command))
        print(f"round {index + 1}/{args.runs}: " + ", ".join(f"{name} {runs[-1][0]:.2f} s" for name, runs in results.items()),
              flush=True)
    print(f"\n{'':<36}{'wall s (median)':>16}{'peak MiB (median)':>20}")
    for name in results:
        walls = [wall for wall, _ in results[name]]
        peaks = [peak for _, peak in results[name]]
        print(f"{name:<36}{statistics.median(walls):>16.2f}{statistics.median(peaks) / 2**20:>20.0f}")
    theirs = results["accelerate estimate-memory"]
    print()
    for name in list(commands)[:2]:
        pairs = list(zip(results[name], theirs))
        wall_ratio = statistics.median(ours_run[0] / their_run[0] for ours_run, their_run in pairs)
        peak_ratio = statistics.median(ours_run[1] / their_run[1] for ours_run, their_run in pairs)
        print(f"ratio {name} / accelerate (paired median of {len(pairs)}): wall time {wall_ratio:.2f}x, "
              f"peak memory {peak_ratio:.2f}x (target: at most 1.0x each)")


if __name__ == "__main__":
    main()
