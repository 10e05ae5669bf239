"""Two LitGPT QLoRA runs against the step plan (docs/published-runs.md, "Two LitGPT QLoRA rows").

LitGPT's resource tables measure `finetune/lora.py`, not the Trainer. This script gives the two
figures the guide sets beside theirs:

- `plan-old-bnb ESTIMATE_ARGS...`: `trainer-memcb estimate` as is, but with bitsandbytes'
  `MatMul4Bit` keeping its input `A` until backward, as bitsandbytes 0.41.1 to 0.43.1 did
  (`bitsandbytes/autograd/_functions.py`, `MatMul4Bit.forward`: `ctx.tensors = (A, B)`; commit
  9e753741, "fix QLoRA mem bug: delete useless buffered activation", 0.43.2, made it `(None, B)`).
  The plan otherwise follows the installed bitsandbytes.
- `trace-litgpt --source DIR ...`: one micro-step of LitGPT's own model code (the `lit_gpt/` of
  commit 8641822 or the `litgpt/` of fd71063c, extracted into DIR), traced under fake tensors with
  the planner's `LiveStorages`: bf16 weights, LoRA on the query and value of the fused qkv
  (`mark_only_lora_as_trainable`), `model(x, lm_head_chunk_size=128)`, the chunks cast to fp32 as
  Fabric's `_FabricModule.forward` does (`convert_output` to the default dtype), the last chunk
  shifted and `chunked_cross_entropy`, then backward. With `--quantize`, every `nn.Linear` (the
  output head too) in 4-bit, as Lightning's `BitsandbytesPrecision` makes them
  (`_Linear4bit._quantize_weight`: the weight cast to fp16, then `quantize_4bit`), and
  `MatMul4Bit` as bitsandbytes 0.41/0.42 runs it: the weight dequantized (fp16) and cast to the
  input's dtype, `F.linear`, the input kept (`--no-kept-input`: not kept). Printed: the bytes
  before the step (weights, buffers, batch), at the end of forward and at the peak. Not traced:
  the optimizer step (bitsandbytes' `PagedAdamW` keeps its state in managed memory, outside
  the allocator), evaluation, generation, the CUDA kernels' workspaces.

    python benchmarks/litgpt_qlora.py plan-old-bnb examples/models/llama-2-7b --dtype bfloat16 ...
    python benchmarks/litgpt_qlora.py trace-litgpt --source /tmp/lit23 --model Llama-2-7b-hf \\
        --lora-r 8 --batch-size 1 --seq-len 1304 --quantize nf4

LitGPT imports `lightning` for its Fabric helpers, which the traced code never calls: empty
stand-ins are registered in `sys.modules` for them, so `lightning` need not be installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any, List, Optional, Sequence

import torch

# What LitGPT's model and utils modules import from lightning at import time (lit_gpt/utils.py,
# litgpt/utils.py, lit_gpt/model.py's flash-attn check), none of it called by a forward.
_LIGHTNING_STUBS = ("lightning", "lightning.fabric", "lightning.fabric.strategies", "lightning.fabric.utilities",
                    "lightning.fabric.utilities.load", "lightning.fabric.loggers", "lightning.pytorch",
                    "lightning.pytorch.loggers", "lightning.pytorch.cli", "lightning_utilities",
                    "lightning_utilities.core", "lightning_utilities.core.imports")
# finetune/lora.py: `model(input_ids, lm_head_chunk_size=128)`.
LM_HEAD_CHUNK = 128


def keep_matmul4bit_input(keep: bool = True) -> None:
    """Make bitsandbytes' `MatMul4Bit.forward` what 0.41.1-0.43.1 ran: the weight dequantized in
    its quantization dtype and cast to the input's (`F.dequantize_4bit(B, state).to(A.dtype)`),
    `F.linear`, and, where a gradient is needed, `ctx.tensors = (A, B)`: the input kept."""
    import bitsandbytes.autograd._functions as functions
    import bitsandbytes.functional as F

    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, out: Any = None, bias: Any = None,
                quant_state: Any = None) -> torch.Tensor:
        ctx.is_empty = False
        B = B.view(-1, 1)  # 0.50's canonical packed layout, which its backward reads
        output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype), bias)
        ctx.state = quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        needed = any(ctx.needs_input_grad[:2])
        ctx.tensors = ((A if keep else None), B) if needed else (None, None)
        return output

    functions.MatMul4Bit.forward = staticmethod(forward)


def plan_old_bnb(argv: Sequence[str]) -> int:
    """`trainer-memcb estimate ARGV` with `MatMul4Bit` keeping its input (bitsandbytes <= 0.43.1)."""
    import bitsandbytes.autograd._functions as functions

    original = functions.MatMul4Bit.forward

    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, out: Any = None, bias: Any = None,
                quant_state: Any = None) -> torch.Tensor:
        output = original(ctx, A, B, out, bias, quant_state)
        if any(ctx.needs_input_grad[:2]):
            ctx.kept_input = A  # 0.41-0.43.1: ctx.tensors = (A, B)
        return output

    functions.MatMul4Bit.forward = staticmethod(forward)
    from trainer_memcb.cli import main

    return main(["estimate", *argv])


def _import_litgpt(source: str) -> Any:
    """LitGPT's `lora` and `utils` modules from `source` (holding `lit_gpt/` or `litgpt/`)."""
    for name in _LIGHTNING_STUBS:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["lightning"].Fabric = object
    sys.modules["lightning.fabric.strategies"].FSDPStrategy = type("FSDPStrategy", (), {})
    sys.modules["lightning.fabric.utilities.load"]._lazy_load = None
    sys.modules["lightning.fabric.loggers"].CSVLogger = object
    sys.modules["lightning.fabric.loggers"].TensorBoardLogger = object
    sys.modules["lightning.pytorch.loggers"].WandbLogger = object
    sys.modules["lightning.pytorch.cli"].instantiate_class = None
    # flash-attn is not in Lit-GPT's requirements: its model then takes torch's SDPA
    sys.modules["lightning_utilities.core.imports"].RequirementCache = lambda *args, **kwargs: False
    package = "lit_gpt" if os.path.isdir(os.path.join(source, "lit_gpt")) else "litgpt"
    # The package's own __init__ imports its tokenizer and API (and checks lightning): a bare one
    # in its place, importing the model before the config as the original does.
    init = types.ModuleType(package)
    init.__path__ = [os.path.join(source, package)]
    sys.modules[package] = init
    sys.path.insert(0, source)
    __import__(package + ".model")
    return __import__(package + ".lora", fromlist=["GPT"]), __import__(package + ".utils", fromlist=["x"])


def _lora_config(lora: Any, name: str, rank: int) -> Any:
    """finetune/lora.py's Config: LoRA on query and value, alpha 16, dropout 0.05 (both runs)."""
    if "r" in lora.Config.__dataclass_fields__:  # lit_gpt (2023)
        return lora.Config.from_name(name, r=rank, alpha=16, dropout=0.05, to_query=True, to_key=False,
                                     to_value=True, to_projection=False, to_mlp=False, to_head=False)
    return lora.Config.from_name(name, lora_r=rank, lora_alpha=16, lora_dropout=0.05, lora_query=True,
                                 lora_key=False, lora_value=True, lora_projection=False, lora_mlp=False,
                                 lora_head=False)


def _quantize_as_lightning(model: torch.nn.Module, mode: Any, quant_type: str) -> int:
    """Every `nn.Linear` in 4-bit, quantized from fp16 (Lightning's `_Linear4bit`), head included."""
    import bitsandbytes.functional as F

    from trainer_memcb.plan.model.quantized import Quantization, quantize_linear_layers

    original = F.quantize_4bit
    F.quantize_4bit = lambda A, *args, **kwargs: original(A.to(torch.float16), *args, **kwargs)
    try:
        quantization = Quantization(quant_type="nf4", double_quant=quant_type == "nf4-dq",
                                    compute_dtype=torch.bfloat16)
        # LitGPT's GPT has no get_output_embeddings: nothing is left out, the head is quantized
        return quantize_linear_layers(model, mode, quantization, "cpu")
    finally:
        F.quantize_4bit = original


def trace_litgpt(args: argparse.Namespace) -> List[int]:
    """Bytes alive before the step, at the end of forward and at the peak of one LitGPT micro-step."""
    from trainer_memcb.plan.step.fake_mode import fake_tensor_mode
    from trainer_memcb.plan.step.live_storages import LiveStorages
    from trainer_memcb.plan.step.trace import fake_copy

    lora, utils = _import_litgpt(args.source)
    keep_matmul4bit_input(keep=args.kept_input)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # bf16-true: Fabric's init_module dtype
    try:
        with torch.device("meta"):
            model = lora.GPT(_lora_config(lora, args.model, args.lora_r))
        lora.mark_only_lora_as_trainable(model)
        mode = fake_tensor_mode(allow_non_fake_inputs=False)
        fake_copy(model, mode, "cpu", torch.bfloat16)
        with mode:
            model.max_seq_length = args.seq_len  # RoPE cache resized, as finetune/lora.py's fit does
        if args.quantize:
            _quantize_as_lightning(model, mode, args.quantize)
        model.train()
        tracker = LiveStorages()
        with mode:
            ids = torch.zeros((args.batch_size, args.seq_len), dtype=torch.int64)
            targets = torch.zeros((args.batch_size, args.seq_len), dtype=torch.int64)
        for tensor in list(model.parameters()) + list(model.buffers()) + [ids, targets]:
            tracker.add(tensor)
        before = tracker.alive_bytes
        with mode, tracker:
            logits = [chunk.to(torch.float32) for chunk in model(ids, lm_head_chunk_size=LM_HEAD_CHUNK)]
            logits[-1] = logits[-1][..., :-1, :]
            loss = utils.chunked_cross_entropy(logits, targets[..., 1:])
            forward_end = tracker.alive_bytes
            del logits
            loss.backward()
        return [before, forward_end, tracker.peak_bytes]
    finally:
        torch.set_default_dtype(default)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plan-old-bnb", help="trainer-memcb estimate with MatMul4Bit keeping its input",
                        add_help=False)
    trace = commands.add_parser("trace-litgpt", help="one micro-step of LitGPT's own code")
    trace.add_argument("--source", required=True, help="a directory holding lit_gpt/ (8641822) or litgpt/ (fd71063c)")
    trace.add_argument("--model", required=True, help="LitGPT's config name, e.g. Llama-2-7b-hf, Llama-3.1-8B")
    trace.add_argument("--lora-r", type=int, required=True)
    trace.add_argument("--batch-size", type=int, required=True)
    trace.add_argument("--seq-len", type=int, required=True)
    trace.add_argument("--quantize", choices=("nf4", "nf4-dq"), help="bnb.nf4 or bnb.nf4-dq (default: bf16)")
    trace.add_argument("--no-kept-input", dest="kept_input", action="store_false",
                       help="MatMul4Bit as bitsandbytes >= 0.43.2: its input not kept")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan-old-bnb"]:
        return plan_old_bnb(argv[1:])
    args = parser().parse_args(argv)
    before, forward_end, peak = trace_litgpt(args)
    print(f"before the step {before:,} B, end of forward {forward_end:,} B, peak {peak:,} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
