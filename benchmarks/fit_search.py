"""`trainer-memcb estimate --fit` on Llama-2-7B: how long the search of up to 12 proposals takes,
and, on a small Llama on this CPU, each proposal's relative step time against the real one.

    python benchmarks/fit_search.py            # both parts (the 7B search: about 18 s here)
    python benchmarks/fit_search.py --times    # the step times only
    python benchmarks/fit_search.py --search   # the 7B search only

(1) The 7B search: bf16, batch 8 x 2048, 80 GiB per process, one process: the own step does not
fit; wall and CPU time of `main([... "--fit"])` (its table not printed), the whole traces it ran and
the optimizer steps it ran from a trace made before (a proposal that changes the optimizer alone),
each with its seconds, and the load average beside them; target at most 10 s.

(2) Relative step times: a Llama of hidden 256, 2 layers, seq 256, batch 8, on one CPU thread; each
proposal of the batch (with accumulation), checkpointing and Adafactor timed as a real step
(median of 5 after 2 warm-up steps, forward, backward, clipping, the optimizer), the ratio to the
own step's real time beside the plan's `relative_step_time`; target: within 25 %.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


FIT_7B = ["estimate", os.path.join(ROOT, "examples", "models", "llama-2-7b"), "--optimizers", "adamw_torch",
          "--batch-size", "8", "--seq-len", "2048", "--precision", "bf16", "--device-memory", "80GiB", "--fit",
          "--max-proposals", "12"]


def console_seconds(argv: list) -> tuple:
    """Wall and CPU seconds of `trainer-memcb ARGV` in a process of its own, as a user runs it
    (its imports included), and its exit code."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "trainer_memcb", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)


def search_7b() -> None:
    import argparse as _argparse

    import trainer_memcb.plan.step.trace as trace
    from trainer_memcb.cli import main
    from trainer_memcb.cli.estimate_command import prepare_process

    load = os.getloadavg()[0]
    wall, cpu, code = console_seconds(FIT_7B)
    print(f"(1) trainer-memcb {' '.join(FIT_7B[2:])} (Llama-2-7B), a process of its own: {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU (exit {code}); load average {load:.2f} -> {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores -> target {'met' if wall <= 10 else 'NOT met'} (<= 10 s on a quiet 2-core machine)")
    # The same search in this process, its traces counted: the whole traces (forward, backward and
    # the optimizer step) and the optimizer phases run from a step traced before (a proposal that
    # changes the optimizer alone), each with its seconds. The process is prepared as the console
    # script prepares its own (peft kept out).
    prepare_process(_argparse.Namespace(command="estimate", batch_size=8, max_batch_size=False, lora_r=None))
    traced: list = []
    shared: list = []
    once, another = trace.trace_step_once, trace._another_optimizer

    def timed(into: list, run):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - start)
        return call

    trace.trace_step_once, trace._another_optimizer = timed(traced, once), timed(shared, another)
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(FIT_7B)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    trace.trace_step_once, trace._another_optimizer = once, another
    print(f"    in this process: {wall:.1f} s wall, {cpu:.1f} s CPU (exit {code}); {len(traced)} traces "
          f"({', '.join(f'{t:.1f}' for t in traced)} s), {len(shared)} optimizer steps from a shared trace "
          f"({', '.join(f'{t:.1f}' for t in shared)} s)")


def step_times() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from trainer_memcb.plan.answers.fit import search_fits, step_planner
    from trainer_memcb.plan.model.trainer_model import prepare_like_trainer
    from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer

    torch.set_num_threads(1)
    seq = 256
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=1024, max_position_embeddings=seq)
    config._attn_implementation = "sdpa"

    def build():
        with torch.device("meta"):
            return LlamaForCausalLM(config)

    own = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "optim": "adamw_torch",
           "gradient_checkpointing": False, "max_grad_norm": 1.0, "bf16": False, "fp16": False}
    found = search_fits(step_planner(build, seq, device_type="cpu"), own, 1 << 40, device_type="cpu",
                        optimizers=("adafactor",), max_candidates=6)
    chosen = [c for c in found.candidates if set(c.changes) <= {"per_device_train_batch_size",
                                                                 "gradient_accumulation_steps", "gradient_checkpointing",
                                                                 "optim"}]

    def real_seconds(args) -> float:
        torch.manual_seed(0)
        model = prepare_like_trainer(LlamaForCausalLM(config), gradient_checkpointing=args["gradient_checkpointing"])
        optimizer = build_trainer_optimizer(args["optim"], TrainingArguments("unused", report_to=[]), model)
        batch, micro = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
        batches = [torch.randint(0, 1024, (batch, seq)) for _ in range(micro)]

        def step():
            for ids in batches:
                model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        times = []
        for index in range(7):
            start = time.perf_counter()
            step()
            if index >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    base = real_seconds(own)
    print(f"(2) relative step times, a Llama of hidden 256 at batch 8 x {seq} on one CPU thread "
          f"(own: {base:.3f} s per step)")
    for candidate in chosen[:6]:
        real = real_seconds(candidate.training_args) / base
        ratio = candidate.relative_step_time / real
        print(f"    {candidate.label:<50} planned {candidate.relative_step_time:.2f}x, real {real:.2f}x: "
              f"ratio {ratio:.2f} -> target {'met' if 0.75 <= ratio <= 1.25 else 'NOT met'} (within 25 %)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", action="store_true", help="the relative step times only")
    parser.add_argument("--search", action="store_true", help="the 7B search only")
    options = parser.parse_args()
    if not options.times:
        search_7b()
    if not options.search:
        step_times()
