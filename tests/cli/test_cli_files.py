"""Every file the command reads is refused at once when it is not a regular file or is too large:
a named pipe would block the read until a writer came (forever), `/dev/zero` would be read until
memory ran out. One line on stderr and an exit code, in the console script's own process (so that a
hang is caught by the subprocess' timeout, not by this test process hanging).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List

import pytest

from trainer_memcb.plan.settings.step_settings import MAX_SETTINGS_FILE_BYTES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CONFIG = os.path.join(REPO_ROOT, "examples", "models", "tiny-distilbert")
# Far more than the command needs to refuse a file; a read that blocks never ends at all.
TIMEOUT_S = 240


def run_command(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "trainer_memcb", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hostile")
    fifo = folder / "settings.json"
    os.mkfifo(fifo)  # nobody ever writes to it
    oversized = folder / "oversized.json"
    with open(oversized, "wb") as handle:  # sparse: its size is what counts, not its bytes on disk
        handle.truncate(MAX_SETTINGS_FILE_BYTES + 1)
    return {"a named pipe": (str(fifo), "is not a regular file"),
            "/dev/zero": ("/dev/zero", "is not a regular file"),
            "an oversized file": (str(oversized), f"is larger than {MAX_SETTINGS_FILE_BYTES:,} bytes")}


STEP = ["estimate", TINY_CONFIG, "--batch-size", "2", "--seq-len", "8"]


@pytest.mark.parametrize("kind", ["a named pipe", "/dev/zero", "an oversized file"])
@pytest.mark.parametrize("argv", [STEP + ["--training-args"], STEP + ["--deepspeed"], STEP + ["--fsdp-config"],
                                  ["estimate", TINY_CONFIG, "--eval-samples", "8", "--seq-len", "8", "--training-args"]],
                         ids=["training-args", "deepspeed", "fsdp-config", "eval-training-args"])
def test_a_settings_file_that_is_no_regular_file_or_too_large_is_refused_at_once(
        hostile_files: dict, kind: str, argv: List[str]) -> None:
    path, reason = hostile_files[kind]
    done = run_command(*argv, path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("trainer-memcb: error: ") and f"{path} {reason}" in line and argv[-1] in line


def test_a_run_file_that_is_a_named_pipe_is_refused_at_once(tmp_path) -> None:
    os.mkfifo(tmp_path / "trainer_state.json")
    for argv in (["report", str(tmp_path), "--no-plot"], ["compare", str(tmp_path)]):
        started = time.perf_counter()
        done = run_command(*argv)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.splitlines() == [f"trainer-memcb: {tmp_path}/trainer_state.json is not a regular file; not read"]
        assert time.perf_counter() - started < TIMEOUT_S


def test_a_hub_name_that_cannot_be_read_offline_says_to_give_a_folder() -> None:
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", "no-such-org/no-such-model"],
                          cwd=REPO_ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("trainer-memcb: no-such-org/no-such-model: could not read a model config (")
    assert line.endswith("; without the hub, give a folder holding the model's config.json instead (its config.json "
                         "alone is read; examples/models/ holds some)")
