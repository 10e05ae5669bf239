"""The model-states plan beside the references: the ZeRO paper, DeepSpeed's estimators, accelerate.

    python benchmarks/references.py          # prints the guide's comparison tables (docs/will-it-fit.md) (about a minute)
    python benchmarks/references.py --families   # the step plan per family (docs/step-memory.md), timed

- The ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", Table 1): per-device model states of a 7.5B-parameter model with mixed-precision
  Adam, (2 + 2 + K) Psi with K = 12, in GB (10**9 bytes), per data-parallel degree Nd.
- DeepSpeed's `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) and
  `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py), which the
  `..._all_cold` functions print for every offload setting with `additional_buffer_factor=1.5`: the
  installed functions, called by tests/plan/zero_reference.py, beside the engine-traced step plan.
- LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
  Resources", Table 1): LLaMA-7B trained in fp16 with LOMO holds its parameters, one gradient at a
  time (the largest parameter's, the 32000 x 4096 embedding: 0.24 GB) and no optimizer state.
  The paper's "GB" are GiB (12.55 = 6,738,415,616 x 2 / 2**30).
- accelerate's `estimate-memory` "Training using Adam" in float32 (accelerate/commands/estimate.py
  `estimate_training_usage`): 4 x the model size, where the size is `calculate_maximum_sizes` of the
  bare `AutoModel`, buffers included.
- LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
  Resources", Table 1): LLaMA-7B in fp16, batch 8 x 512: activations 45.61 GB, 1.79 GB with
  activation checkpointing, against the step plan's activations on Llama-2-7B's config.
- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
  section 4): activation memory per transformer layer, 16-bit, s*b*h*(34 + 5*a*s/h) bytes with
  dropout and no recomputation, against the step plan on a GPT-2-style model with dropout.
"""

from __future__ import annotations

import os
import sys
from decimal import ROUND_HALF_UP, Decimal
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from trainer_memcb.plan.answers.model_states import plan_model_states  # noqa: E402
from trainer_memcb.plan.settings.setup import Setup  # noqa: E402

# -- the ZeRO paper, Table 1, 7.5B model column (GB) ------------------------------------------------
PAPER_PSI = 7_500_000_000
# Nd -> (baseline, P_os, P_os+g, P_os+g+p), as printed.
PAPER_TABLE_1 = {
    1: ("120", "120", "120", "120"),
    4: ("120", "52.5", "41.3", "30"),
    16: ("120", "35.6", "21.6", "7.5"),
    64: ("120", "31.4", "16.6", "1.88"),
    256: ("120", "30.4", "15.4", "0.47"),
    1024: ("120", "30.1", "15.1", "0.12"),
}
PAPER_SHARDINGS = ("ddp", "zero1", "zero2", "zero3")  # baseline DP, P_os, P_os+g, P_os+g+p


def as_printed(num_bytes: int, printed: str) -> str:
    """GB rounded half up to the digits the paper printed."""
    digits = len(printed.split(".")[1]) if "." in printed else 0
    quantum = Decimal(1).scaleb(-digits)
    return str((Decimal(num_bytes) / Decimal(10**9)).quantize(quantum, rounding=ROUND_HALF_UP))


def paper_rows() -> List[Tuple[int, List[int], Tuple[str, ...]]]:
    """(Nd, our four model-states figures in bytes, the paper's printed GB)."""
    rows = []
    for nd, printed in PAPER_TABLE_1.items():
        ours = [plan_model_states(PAPER_PSI, "adamw", Setup(world_size=nd, sharding=sharding,
                                                           precision="deepspeed-fp16")).optimizers[0].model_states_bytes
                for sharding in PAPER_SHARDINGS]
        rows.append((nd, ours, printed))
    return rows


# -- DeepSpeed's estimators ---------------------------------------------------------------------------
# The installed DeepSpeed's own functions beside the engine-traced ZeRO step plan, term by term:
# tests/plan/zero_reference.py (held by tests/plan/test_engine_references_7b.py).


def deepspeed_rows(worlds: Tuple[int, ...] = (8, 64)) -> List[Dict[str, object]]:
    """For Llama-2-7B (bf16, batch 1 x 512) at 8 GPUs (1 node) and 64 GPUs (8 nodes of 8), each
    ZeRO setting DeepSpeed's `..._all_cold` prints: the plan and DeepSpeed's figures, and their terms."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "plan"))
    import torch
    from zero_reference import ZERO_ROWS, plan_row

    from trainer_memcb.plan.optimizers.whatif import build_meta_model

    path = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")
    return [plan_row(lambda: build_meta_model(path, torch.bfloat16), label, stage, offload_optimizer, offload_param, world)
            for world in worlds for label, stage, offload_optimizer, offload_param in ZERO_ROWS]


# -- LOMO, Table 1 --------------------------------------------------------------------------------------
# The LOMO row, as printed (GiB, though the paper writes GB).
LOMO_TABLE_1 = {"params_bytes": "12.55", "grads_bytes": "0.24", "optimizer_state_bytes": "0.00"}


def lomo_row() -> Dict[str, object]:
    """LLaMA-7B (Llama-2-7B's shapes) in fp16 with `optim="lomo"`, one process: our figures beside
    LOMO's Table 1."""
    import torch

    from trainer_memcb.plan.optimizers.whatif import build_meta_model

    model = build_meta_model(os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b"), torch.float16)
    plan = plan_model_states(model, "lomo", Setup(precision="fp16"))
    entry = plan.optimizers[0]
    largest = max(model.named_parameters(), key=lambda item: item[1].numel())[0]
    return {"ours": {key: getattr(entry, key) for key in LOMO_TABLE_1}, "printed": dict(LOMO_TABLE_1),
            "largest": largest, "notes": plan.notes}


# -- accelerate ----------------------------------------------------------------------------------------

ACCELERATE_BERT_BASE_CASED = 1_732_997_120  # "Training using Adam", float32, as the issue measured it


def accelerate_row() -> Dict[str, int]:
    from transformers import AutoConfig, AutoModel
    import torch

    config = AutoConfig.from_pretrained(os.path.join(REPO_ROOT, "examples", "models", "bert-base-cased"))
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    ours = plan_model_states(model, "adamw", Setup()).optimizers[0]
    return {"accelerate": ACCELERATE_BERT_BASE_CASED, "ours": ours.model_states_bytes, "buffers_bytes": buffers,
            "param_tensors": len(list(model.parameters())), "params": sum(p.numel() for p in model.parameters())}


# -- activations: LOMO Table 1 and Korthikanti et al. 2022 -------------------------------------------
LOMO_GB = {"activations": "45.61", "with checkpointing": "1.79"}  # LLaMA-7B, fp16, batch 8 x 512
LOMO_BATCH, LOMO_SEQ = 8, 512


def _llama_7b_layers(layers: int, attn: str):
    def build():
        import torch
        from transformers import AutoConfig, LlamaForCausalLM

        config = AutoConfig.from_pretrained(os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b"))
        config.num_hidden_layers = layers
        config._attn_implementation = attn
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return build


def step_activations(build, batch: int, seq: int, checkpointing: bool = False) -> int:
    """The step plan's activations in fp16 (a model loaded in fp16 and trained so)."""
    import torch

    from trainer_memcb.plan.answers.step_memory import plan_step_memory

    plan, _ = plan_step_memory(build, batch_size=batch, seq_len=seq, precision="bf16",
                               dtype=torch.float16, gradient_checkpointing=checkpointing, model_states=False)
    if plan.step.problem:
        raise RuntimeError(plan.step.problem)
    return plan.step.activations_bytes


def lomo_rows(layers: int = 32, attns: Tuple[str, ...] = ("eager", "sdpa")) -> List[Dict[str, object]]:
    """Per attention path and checkpointing: the activations of Llama-2-7B's config, split into the
    part outside the layers and the bytes per layer (traces of 1 and 2 layers), and the total for
    `layers` layers (the total is exactly outside + layers x per layer: every layer is the same)."""
    rows = []
    for attn in attns:
        for checkpointing in (False, True):
            one = step_activations(_llama_7b_layers(1, attn), LOMO_BATCH, LOMO_SEQ, checkpointing)
            two = step_activations(_llama_7b_layers(2, attn), LOMO_BATCH, LOMO_SEQ, checkpointing)
            per_layer = two - one
            outside = one - per_layer
            rows.append({"attn": attn, "checkpointing": checkpointing, "per_layer": per_layer, "outside": outside,
                         "total": outside + layers * per_layer})
    return rows


KORTHIKANTI = {"s": 512, "b": 4, "h": 1024, "a": 16}


def _gpt2_layers(layers: int):
    def build():
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        k = KORTHIKANTI
        # GPT-2's shape with dropout everywhere (attention, residual, embeddings) and a GeLU that saves
        # only its input (the formula's assumption; gelu_new's Python formula saves more).
        config = GPT2Config(n_embd=k["h"], n_head=k["a"], n_layer=layers, n_positions=k["s"], vocab_size=1024,
                            activation_function="gelu_pytorch_tanh", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1,
                            bos_token_id=0, eos_token_id=0)
        config._attn_implementation = "eager"
        with torch.device("meta"):
            return GPT2LMHeadModel(config)
    return build


def korthikanti_row() -> Dict[str, int]:
    """One GPT-2-style layer in fp16, eager attention, dropout on, planned for CUDA: the plan against
    the formula, and the difference (see the guide)."""
    k = KORTHIKANTI
    s, b, h, a = k["s"], k["b"], k["h"], k["a"]
    one = step_activations(_gpt2_layers(1), b, s)
    two = step_activations(_gpt2_layers(2), b, s)
    return {
        "per_layer": two - one,
        "formula": s * b * h * 34 + 5 * a * s * s * b,
        # The dropout masks: 1 byte in the formula and in the plan (CUDA's native_dropout saves a
        # bool mask, trainer_memcb.plan.step.cuda_dropout); the CPU kernels' would be 2 bytes.
        # Each LayerNorm saves its mean and reciprocal standard deviation, (b, s, 1) in 16 bits here;
        # the formula leaves them out: 2 norms x 2 tensors x 2 bytes x s*b.
        "layer_norm_statistics": 8 * s * b,
    }


# -- the step plan of one 7B-class config per family ------------------------------------------------
# (folder under examples/models, batch, sequence length, target length, attention): each planned in
# bf16 with the Trainer's AdamW, timed; the ratio is to the Llama-2-7B plan's time (the first row,
# which also pays the first use of torch's and transformers' modules). Gemma 2's logit soft-capping
# has no SDPA path in transformers: eager, as its model card says.
FAMILY_CONFIGS = [
    ("llama-2-7b", 1, 2048, None, "sdpa"),
    ("mistral-7b", 1, 2048, None, "sdpa"),
    ("qwen2-7b", 1, 2048, None, "sdpa"),
    ("gemma-2-9b", 1, 2048, None, "eager"),
    ("mixtral-8x7b", 1, 2048, None, "sdpa"),
    ("t5-xl", 1, 512, 128, "sdpa"),
    ("vit-large-patch16-224", 32, None, None, "sdpa"),
]


def family_rows() -> List[Dict[str, object]]:
    """The step plan of each family's config (FAMILY_CONFIGS) and the seconds it took."""
    import time

    import torch

    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.optimizers.whatif import build_meta_model

    rows: List[Dict[str, object]] = []
    for folder, batch, seq_len, target_len, attention in FAMILY_CONFIGS:
        path = os.path.join(REPO_ROOT, "examples", "models", folder)
        start, cpu_start = time.perf_counter(), time.process_time()
        plan, _ = plan_step_memory(lambda: build_meta_model(path, torch.bfloat16), batch_size=batch, seq_len=seq_len,
                                   target_len=target_len, precision="bf16", optimizer="adamw_torch",
                                   attn_implementation=attention, model_states=False)
        rows.append({"model": folder, "attention": attention, "batch": batch, "seq_len": seq_len, "target_len": target_len, "plan": plan,
                     "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start})
    return rows


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f}"


def print_families() -> None:
    rows = family_rows()
    base = rows[0]["cpu_seconds"]
    print("\nThe step plan per family, bf16, AdamW (GiB; CPU seconds of the plan and their ratio to Llama-2-7B's, and wall seconds on this machine)\n")
    print("| config | micro-batch | attention | parameters | activations | step peak | peak in | CPU s | ratio | wall s |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    for row in rows:
        plan = row["plan"]
        size = f"{row['batch']} x {row['seq_len']}" if row["seq_len"] else f"{row['batch']} images"
        if row["target_len"]:
            size += f" -> {row['target_len']}"
        if plan.step.problem is not None:
            print(f"| {row['model']} | {size} | {row['attention']} | - | - | - | {plan.step.problem} | {row['cpu_seconds']:.1f} | - | {row['seconds']:.1f} |")
            continue
        print(f"| {row['model']} | {size} | {row['attention']} | {_gib(plan.step.peak_parts['parameters'])} | {_gib(plan.step.activations_bytes)} | "
              f"{_gib(plan.step.peak_bytes)} | {plan.step.peak_phase} | {row['cpu_seconds']:.1f} | "
              f"{row['cpu_seconds'] / base:.2f} | {row['seconds']:.1f} |")


def main() -> None:
    if "--families" in sys.argv[1:]:
        print_families()
        return
    print("ZeRO paper, Table 1, 7.5B model, GB per device (ours: rounded half up to the paper's digits)\n")
    print("| Nd | baseline (paper / ours) | P_os | P_os+g | P_os+g+p |")
    print("|---|---|---|---|---|")
    for nd, ours, printed in paper_rows():
        cells = [f"{paper} / {as_printed(value, paper)}" for value, paper in zip(ours, printed)]
        print(f"| {nd} | " + " | ".join(cells) + " |")

    from zero_reference import legend_lines, summary_lines, term_lines  # put on the path by deepspeed_rows

    rows = deepspeed_rows()
    print("\nDeepSpeed's estimators for Llama-2-7B beside the engine-traced ZeRO plan (GiB; DeepSpeed prints GiB as 'GB')\n")
    print("\n".join(summary_lines(rows)))
    print("\nTerm by term, 8 GPUs (bytes)\n")
    print("\n".join(term_lines([row for row in rows if row["world"] == 8])))
    print()
    print("\n".join(legend_lines()))
    print("\nTerm by term, 64 GPUs (bytes)\n")
    print("\n".join(term_lines([row for row in rows if row["world"] == 64])))

    print("\nLOMO Table 1, LLaMA-7B fp16, batch 8 x 512: activations (bytes; GB = 10**9 bytes)\n")
    print("| attention | checkpointing | outside the layers | per layer | 32 layers | GB | LOMO GB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in lomo_rows():
        lomo = LOMO_GB["with checkpointing" if row["checkpointing"] else "activations"]
        print(f"| {row['attn']} | {'on' if row['checkpointing'] else 'off'} | {row['outside']:,} | {row['per_layer']:,} | "
              f"{row['total']:,} | {row['total'] / 1e9:.2f} | {lomo} |")
    k = korthikanti_row()
    print("\nKorthikanti et al. 2022, one GPT-2-style layer (s=512, b=4, h=1024, a=16), fp16, dropout on (bytes)\n")
    print("| plan per layer | formula s*b*h*(34 + 5*a*s/h) | LayerNorm mean and rstd | formula + them |")
    print("|---:|---:|---:|---:|")
    print(f"| {k['per_layer']:,} | {k['formula']:,} | {k['layer_norm_statistics']:,} | "
          f"{k['formula'] + k['layer_norm_statistics']:,} |")

    row = lomo_row()
    print("\nLOMO, Table 1, LLaMA-7B in fp16 with LOMO (GiB; the paper prints GiB as 'GB')\n")
    print("| | parameters | gradients | optimizer state |")
    print("|---|---|---|---|")
    print("| LOMO | " + " | ".join(row["printed"][key] for key in LOMO_TABLE_1) + " |")
    print("| ours | " + " | ".join(f"{_gib(row['ours'][key])} ({row['ours'][key]:,} bytes)" for key in LOMO_TABLE_1) + " |")
    print(f"(the one gradient: {row['largest']}'s)")

    row = accelerate_row()
    print(f"\naccelerate, bert-base-cased, float32 AdamW: accelerate {row['accelerate']:,} bytes, ours "
          f"{row['ours']:,} bytes ({row['params']:,} parameters in {row['param_tensors']} tensors, "
          f"{row['buffers_bytes']:,} bytes of buffers)")
    print_families()


if __name__ == "__main__":
    main()
