"""While an estimate works, a terminal's stderr shows what it is doing; stdout never does, and
a stderr that is no terminal gets not one byte.

The console script runs in a process of its own with its stderr on a pseudo-terminal (`pty`), as
a user's terminal, and the test reads what the terminal received.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from typing import List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join("examples", "models", "tiny-distilbert")
# The step plan's batch search on a tiny model, as JSON: every phase of a long estimate.
SEARCH = ["estimate", TINY, "--optimizers", "adamw", "--max-batch-size", "--seq-len", "16",
          "--device-type", "cpu", "--device-memory", "40MiB", "--reserve", "0B", "--eval-samples", "16", "--json"]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT, COLUMNS="200", TERM="xterm")
# Erasing the line, moving the cursor, colours: what a terminal gets beside the text.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def run_on_a_terminal(argv: List[str]) -> Tuple[int, str, str]:
    """(exit code, stdout through a pipe, what stderr's terminal received)."""
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "trainer_memcb", *argv], cwd=REPO_ROOT, env=ENV,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    received = bytearray()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the process closed its end
                break
            if not chunk:
                break
            received += chunk
        elif process.poll() is not None:
            break
    stdout = process.stdout.read().decode()
    code = process.wait(timeout=60)
    os.close(master)
    return code, stdout, received.decode(errors="replace")


def test_a_terminal_is_shown_each_phase_and_each_traced_batch_and_stdout_gets_none_of_it():
    code, stdout, terminal = run_on_a_terminal(SEARCH)
    assert code == 0, terminal
    document = json.loads(stdout)  # stdout is the JSON alone
    batches = [entry["batch_size"] for entry in document["answers"]["largest_batch"]["searched"]]
    assert len(batches) >= 3
    text = _CONTROL.sub("\n", terminal)
    for phase in ["importing torch and transformers", f"building {TINY} on the meta device", "planning the model states"] \
            + [f"tracing the step at batch {batch} (searching the largest batch)" for batch in batches] \
            + ["tracing the evaluation forward at batch 8"]:
        assert phase in text, (phase, text)
    assert "tracing" not in stdout and "\x1b" not in stdout


def test_no_byte_of_progress_when_stderr_is_no_terminal():
    env = dict(ENV)
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", *SEARCH], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0
    assert done.stderr == ""
    assert "tracing" not in done.stdout and "\x1b" not in done.stdout
    json.loads(done.stdout)
