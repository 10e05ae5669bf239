"""The benchmarks run end to end and print what they measure (`--quick`, a short timeline; no timing is judged)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "overhead.py")

# AdamW on distilbert-base-cased with 2 labels: 65,783,042 parameters x 2 fp32 moments x 4 bytes,
# plus a 4-byte `step` for each of its 104 parameter tensors.
DISTILBERT_ADAMW_STATE_BYTES = 65_783_042 * 2 * 4 + 104 * 4


@pytest.mark.slow
def test_quick_benchmark_prints_both_ratios():
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    completed = subprocess.run(
        [sys.executable, SCRIPT, "--quick"], cwd=REPO_ROOT, env=environment,
        capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    out = completed.stdout

    step_ratio = re.search(r"^  \(a\) step time with / without callback: (\d+\.\d{4}) .*-> target (met|NOT met) \(<= 1\.01\)$",
                           out, re.MULTILINE)
    cpu_step_ratio = re.search(r"^      same, in CPU time: (\d+\.\d{4}) .*-> target (met|NOT met) \(<= 1\.01\)$",
                               out, re.MULTILINE)
    speedup = re.search(r"^  \(b\) naive / measure_optimizer_state: (\d+)x -> target (met|NOT met) \(>= 600x\)$",
                        out, re.MULTILINE)
    assert step_ratio is not None, out
    assert cpu_step_ratio is not None, out
    assert speedup is not None, out
    assert float(step_ratio.group(1)) > 0
    assert float(cpu_step_ratio.group(1)) > 0
    assert int(speedup.group(1)) > 0
    # Both methods are timed on the same, real state, and agree on its size to the byte.
    assert (f"65,783,042 parameters, 312 state tensors; measure_optimizer_state "
            f"{DISTILBERT_ADAMW_STATE_BYTES:,} bytes (501.9 MiB), naive {DISTILBERT_ADAMW_STATE_BYTES:,} bytes") in out
    # The quick setting times one training run.
    run_line = (r"^  run  1: median step with / without callback: wall \d+\.\d{4} / \d+\.\d{4} ms = \d+\.\d{4}; "
                r"CPU \d+\.\d{4} / \d+\.\d{4} ms = \d+\.\d{4}$")
    assert len(re.findall(run_line, out, re.MULTILINE)) == 1, out
    # The activations: the small model's (a) ratio and (c), each held to 1.02.
    assert re.search(r"^      with the activations measured \(the callback's default\): \d+\.\d{4} "
                     r"-> target (met|NOT met) \(<= 1\.02\)$", out, re.MULTILINE), out
    assert re.search(r"^  \(c\) small model, step time with / without measuring the activations: \d+\.\d{4} .*"
                     r"-> target (met|NOT met) \(<= 1\.02\)$", out, re.MULTILINE), out


ALLOCATOR_SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "allocator_replay.py")


def test_allocator_replay_benchmark_prints_a_rate_per_setting():
    completed = subprocess.run([sys.executable, ALLOCATOR_SCRIPT, "--events", "2000"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    rates = re.findall(r"^(\S+) +([\d,]+) events/s  \(", completed.stdout, re.MULTILINE)
    assert [setting for setting, _ in rates] == [
        "defaults", "expandable_segments:True", "max_split_size_mb:128,roundup_power2_divisions:4"]
    assert all(int(rate.replace(",", "")) > 0 for _, rate in rates)
