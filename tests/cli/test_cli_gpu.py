"""`trainer-memcb estimate --gpu NAME --alloc-conf CONF`: the GPU presets and the allocator replay,
through the console script in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from trainer_memcb.plan.device.gpus import gpu_presets

# The exact figures here were counted on torch 2.13 and transformers 5. On transformers 4.57 the
# models hold 16 to 32 bytes of buffers more or less (rotary's original_inv_freq is an attribute
# there) and torch 2.6's fake process group cannot run FSDP2's all-gather, so the oldest pass does
# not hold these figures (tests/plan/test_engines.py computes that difference for its own).
pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
    or int(transformers.__version__.split(".")[0]) < 5,
    reason="figures counted on torch 2.13 and transformers 5; the oldest releases differ by model buffers")


SCRIPT = os.path.join(os.path.dirname(sys.executable), "trainer-memcb")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(*argv: str, env=None) -> subprocess.CompletedProcess:
    assert os.path.isfile(SCRIPT), f"{SCRIPT}: the console script is not installed (pip install -e .)"
    environment = dict(os.environ, HF_HUB_OFFLINE="1")
    environment.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    environment.update(env or {})
    return subprocess.run([SCRIPT, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=environment)


def test_gpu_list_prints_every_preset():
    done = run_script("estimate", "--gpu", "LIST")
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()[3:] if line.strip()]
    assert names == [preset.name for preset in gpu_presets()]
    assert "85,045,477,376" in done.stdout  # H100's total, as mem_get_info reports it


@pytest.mark.parametrize("argv, said", [
    (["--gpu", "h1000"], "argument --gpu: unknown GPU 'h1000'; choose one of H100, H200,"),
    (["--gpu", "A100"], "argument --gpu: GPU 'A100' is ambiguous: choose one of A100-40GB, A100-80GB"),
    (["--alloc-conf", "expandable_segments:maybe"], "argument --alloc-conf:"),
])
def test_a_bad_gpu_or_alloc_conf_is_one_line_and_exit_2(tiny_llama_dir, argv, said):
    done = run_script("estimate", tiny_llama_dir, "--batch-size", "2", "--seq-len", "16", *argv)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1 and said in done.stderr


def test_a_bad_alloc_conf_in_the_environment_is_one_line_and_exit_2(tiny_llama_dir):
    done = run_script("estimate", tiny_llama_dir, "--batch-size", "2", "--seq-len", "16",
                      env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:1"})
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "PYTORCH_CUDA_ALLOC_CONF in the environment" in done.stderr


def test_gpu_h100_json_has_the_allocator_figures(tiny_llama_dir):
    done = run_script("estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
                      "--gpu", "h100", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    step, answers = document["device"], document["answers"]
    assert (step["gpu"], step["device_memory_bytes"], step["cuda_context_bytes"]) == ("H100", 85_045_477_376, 446_693_376)
    assert step["reserved_peak_bytes"] == 73_400_320  # 2 x (32 MiB cuBLAS + 1 MiB cuBLASLt) on sm90, in 2 segments
    assert step["device_total_bytes"] == 73_400_320 + 446_693_376
    assert (step["allocator_allocated_peak_bytes"], step["fragmentation_bytes"]) == (71_523_840, 1_876_480)  # fragmentation: reserved peak less allocated peak
    assert answers["margin_bytes"] == 85_045_477_376 - 446_693_376 - 73_400_320 and answers["fits"] is True
    assert step["alloc_conf"] == "" and step["out_of_memory_at"] is None


def test_fragmentation_is_the_reserved_peak_less_the_allocated_peak(tiny_llama_dir, capsys):
    # Peak against peak: what the cache holds beyond the most ever allocated (2,113,536 bytes, reserved
    # less allocated at the first moment of the reserved peak, was said before).
    from trainer_memcb.cli import main

    argv = ["estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
            "--gpu", "h100"]
    assert main(argv + ["--json"]) == 0
    step = json.loads(capsys.readouterr().out)["device"]
    assert (step["reserved_peak_bytes"], step["allocator_allocated_peak_bytes"]) == (73_400_320, 71_523_840)
    assert step["fragmentation_bytes"] == 73_400_320 - 71_523_840 == 1_876_480
    assert main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("reserved peak"))
    assert row.endswith("70.0 MiB (73,400,320), 1.8 MiB (1,876,480) of it cached, not allocated (reserved peak less "
                        "allocated peak)")


def test_device_memory_overrides_the_gpu_and_alloc_conf_changes_the_replay(tiny_llama_dir):
    done = run_script("estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
                      "--gpu", "h100", "--device-memory", "600MiB", "--alloc-conf", "expandable_segments:True", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    device = document["device"]
    assert (device["device_memory_bytes"], device["gpu"], device["alloc_conf"]) == (600 * 2 ** 20, "H100",
                                                                                  "expandable_segments:True")
    assert document["answers"]["margin_bytes"] == 600 * 2 ** 20 - 446_693_376 - device["reserved_peak_bytes"]


def test_the_table_shows_reserved_and_total_beside_the_allocated_peak(tiny_llama_dir):
    done = run_script("estimate", tiny_llama_dir, "--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16",
                      "--gpu", "rtx-3090")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    labels = [line.split("  ")[0] for line in lines]
    at = labels.index("step peak")
    assert labels[at + 1:at + 4] == ["allocated peak (caching allocator)", "reserved peak (two steps replayed)",
                                     "device total (nvidia-smi)"]
    assert "CUDA context 256.0 MiB (268,435,456), RTX-3090" in lines[at + 3]
