"""The golden plans: the `--json` of representative `trainer-memcb estimate` commands (every
engine, optimizer family, precision, LoRA and QLoRA, the evaluation plan, `--fit`,
`--max-batch-size`, the allocator replay's options), recorded once on the newest releases, so that
a change that only moves code can be shown to give every figure it gave before, to the byte.

    python tests/golden_plans.py            # compare each command with its recording
    python tests/golden_plans.py --write    # record them again (after a change meant to alter figures)

`tests/test_golden_plans.py` runs the comparison. Run from anywhere: the commands run from the
repository's root, with its relative model paths.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any, Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_FILE = os.path.join(REPO_ROOT, "tests", "data", "golden", "plans.json")
DISTILBERT = os.path.join("examples", "models", "tiny-distilbert")
LLAMA = os.path.join("tests", "data", "golden", "tiny-llama")
LLAMA_7B = os.path.join("examples", "models", "llama-2-7b")
ARGS_FILE = os.path.join("tests", "data", "golden", "training_args.json")
STEP = [DISTILBERT, "--batch-size", "2", "--seq-len", "8"]
LLAMA_STEP = [LLAMA, "--batch-size", "2", "--seq-len", "16"]

# name -> the arguments of `trainer-memcb estimate` (`--json` added).
COMMANDS: Dict[str, List[str]] = {
    "what-if, every default optimizer": [DISTILBERT],
    "model states, ZeRO-3 on 4 processes, 16 GiB": [DISTILBERT, "--world-size", "4", "--zero", "3",
                                                    "--device-memory", "16GiB"],
    "step, CUDA, fp32 AdamW": STEP + ["--device-memory", "1GiB"],
    "step, CPU": STEP + ["--device-type", "cpu", "--device-memory", "64MiB"],
    "step, bf16": STEP + ["--precision", "bf16", "--gpu", "h100"],
    "step, autocast-bf16 with checkpointing": LLAMA_STEP + ["--precision", "autocast-bf16",
                                                           "--gradient-checkpointing", "--gpu", "a100-40gb"],
    "step, Adafactor": STEP + ["--optimizers", "adafactor"],
    "step, 8-bit AdamW (its rule's state)": STEP + ["--optimizers", "adamw_bnb_8bit"],
    "step, gradient accumulation 4": LLAMA_STEP + ["--gradient-accumulation-steps", "4"],
    "step, DDP on 2": STEP + ["--world-size", "2", "--sharding", "ddp"],
    "step, ZeRO-1 on 2": STEP + ["--world-size", "2", "--zero", "1"],
    "step, ZeRO-2 on 2, optimizer offloaded": STEP + ["--world-size", "2", "--zero", "2", "--offload-optimizer"],
    "step, ZeRO-3 on 2": LLAMA_STEP + ["--world-size", "2", "--zero", "3"],
    "step, FSDP2 full shard on 2": LLAMA_STEP + ["--world-size", "2", "--sharding", "fsdp-full-shard"],
    "step, LoRA r=4": LLAMA_STEP + ["--lora-r", "4"],
    "step, QLoRA r=4 nf4": LLAMA_STEP + ["--lora-r", "4", "--load-in-4bit"],
    "step, a TrainingArguments file": [LLAMA, "--seq-len", "16", "--training-args", ARGS_FILE, "--gpu", "t4"],
    "replay, expandable segments": STEP + ["--alloc-conf", "expandable_segments:True", "--gpu", "h100"],
    "replay, reserve and a tight device": STEP + ["--device-memory", "446MiB", "--reserve", "1MiB"],
    "fit, nothing fits": STEP + ["--device-memory", "446MiB", "--fit"],
    "fit, several processes": LLAMA_STEP + ["--world-size", "2", "--device-memory", "440MiB", "--fit"],
    "largest batch": [DISTILBERT, "--seq-len", "8", "--device-memory", "500MiB", "--max-batch-size"],
    "evaluation": [LLAMA, "--seq-len", "16", "--eval-samples", "64", "--eval-batch-size", "8",
                   "--device-memory", "1GiB"],
    "evaluation with the step, its fit": LLAMA_STEP + ["--eval-samples", "64", "--eval-batch-size", "8",
                                                       "--device-memory", "440MiB", "--fit"],
    "step, Llama-2-7B bf16 on an H100": [LLAMA_7B, "--precision", "bf16", "--optimizers", "adamw_torch",
                                         "--batch-size", "1", "--seq-len", "512", "--gpu", "h100"],
}


def run(argv: List[str]) -> Tuple[int, Any]:
    """The command's exit code and its `--json` document, run in this process from the repository's root."""
    from trainer_memcb.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["estimate", *argv, "--json"])
    finally:
        os.chdir(here)
    try:
        return code, json.loads(out.getvalue())
    except ValueError:
        return code, {"stdout": out.getvalue(), "stderr": err.getvalue()}


def versions() -> Dict[str, str]:
    """The releases the figures depend on (the golden file is compared only on the same)."""
    import torch
    import transformers

    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}


def recorded() -> Dict[str, Any]:
    with open(GOLDEN_FILE, encoding="utf-8") as handle:
        return json.load(handle)


def write() -> None:
    plans = {}
    for name, argv in COMMANDS.items():
        code, document = run(argv)
        plans[name] = {"argv": argv, "exit": code, "json": document}
        print(f"{name}: exit {code}", file=sys.stderr)
    data = json.dumps({"versions": versions(), "plans": plans}, indent=1, sort_keys=True) + "\n"
    with open(GOLDEN_FILE + ".partial", "w", encoding="utf-8") as handle:
        handle.write(data)
    os.replace(GOLDEN_FILE + ".partial", GOLDEN_FILE)


def compare() -> int:
    golden = recorded()
    differ = 0
    for name, entry in golden["plans"].items():
        code, document = run(entry["argv"])
        same = (code, document) == (entry["exit"], entry["json"])
        differ += not same
        print(f"{'same' if same else 'DIFFERS'}: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the plans again")
    if parser.parse_args().write:
        write()
    else:
        sys.exit(compare())
