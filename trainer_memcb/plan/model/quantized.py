"""QLoRA's base model in the step plan: linear layers loaded in 4-bit or 8-bit by bitsandbytes.

`from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))` replaces
every `nn.Linear` (and `Conv1D`, GPT-2's, its weight transposed) but the output head (transformers'
`replace_with_bnb_linear`, skipping `get_keys_to_not_convert`: the output embeddings) by
bitsandbytes' `Linear4bit`, whose weight is a `Params4bit` holding what
`bitsandbytes.functional.quantize_4bit` returns for the weight in the loading dtype:

- the packed values: uint8, `(N + 1) // 2` bytes (two 4-bit codes per byte);
- the absmax per block of `blocksize` (64) values: fp32, 4 bytes per block; with double
  quantization (`bnb_4bit_use_double_quant=True`) uint8 instead (1 byte per block), plus the
  nested state: an fp32 absmax per 256 blocks, an fp32 offset (0-dim), and the 256-entry fp32
  dynamic map, one tensor shared by every layer (`name2qmap["dynamic"]`);
- the 4-bit code: 16 fp32 values (`get_4bit_type`, one per layer).

`quantize_linear_layers(model, mode, ...)` does the same to a fake model under the step plan: it
runs `quantize_4bit` itself on each fake weight (so the shapes and dtypes are bitsandbytes' own;
its one value read, making the dynamic map, is answered by a fake map of the same shape), and
puts a `PlannedLinear4bit` in the layer's place. That stand-in exists because `Params4bit` cannot
wrap a fake tensor (`_make_subclass` refuses a tensor already owned by `FakeTensor`): it holds the
packed values as its (frozen) weight, the quantization state as non-persistent buffers (so the
plan counts them, under "batch and buffers"), and its forward is `Linear4bit.forward`'s:
`bnb.matmul_4bit(x in the compute dtype, weight, bias, quant_state)`, whose fake kernels are
bitsandbytes' own (`bitsandbytes/_ops.py`). Forward dequantizes the weight (a temporary in the
quantization's dtype), and `MatMul4Bit.backward` dequantizes it again for the input's gradient:
those copies are counted where they are alive, as every other temporary is.

On CUDA, the kernel behind `gemm_4bit` (bitsandbytes 0.50, `backends/cuda/ops.py`) multiplies
more than `_gemm_4bit_custom_max_m` (1536) input rows, as a training step's batch always has,
by `_dequant_linear_fallback`: the weight dequantized into a temporary in the input's dtype (with
double quantization, after two fp32 temporaries of the absmax per block), then `F.linear`. The
fake kernel makes the output only, so for a CUDA run `PlannedLinear4bit` holds those temporaries
(`cuda_gemm_scratch`) while the product is made. At 1536 rows and fewer a per-architecture rule
picks the fused kernel or the same fallback: planned as the fused kernel, with no temporary.

8-bit (`BitsAndBytesConfig(load_in_8bit=True)`, LLM.int8): transformers puts bitsandbytes'
`Linear8bitLt(has_fp16_weights=False, threshold=llm_int8_threshold)` in the same places, whose
weight is an `Int8Params` holding what `bitsandbytes.functional.int8_vectorwise_quant` returns
for the weight in fp16 (`Int8Params._quantize`): int8 codes, one byte per value (the weight's
data, and the layer's `state.CB` after its first forward), and `SCB`, one fp32 scale per output
row. `PlannedLinear8bit` holds the codes as its frozen weight and the scales as a non-persistent
buffer, and its forward is `Linear8bitLt.forward`'s, `bnb.matmul(x, weight, bias, state)`:

- training on the CPU, `bnb.matmul` takes `MatMul8bitFp` (`bitsandbytes/autograd/_functions.py`):
  forward dequantizes the weight to the input's dtype (`CB.to(A.dtype).mul_(SCB / 127)`), runs
  `F.linear`, and keeps the input as `ctx.A`; backward dequantizes again for the input's gradient.
  Traced as is: the same operations run on the fake tensors.
- on CUDA it takes `MatMul8bitLt`: the input is quantized to int8 by rows
  (`int8_vectorwise_quant` of an fp16 copy), multiplied by `int8_scaled_mm`, and kept as
  `ctx.tensors`; with a threshold above 0 (transformers' default 6.0) the input's columns holding
  a value above it (the outliers) are kept in fp16 besides (`int8_mixed_scaled_mm`'s `subA`),
  a number of columns the values decide, which a fake tensor has not: the trace takes the
  threshold-0 path, the outliers planned as none (each outlier column adds 2 bytes per input row
  to what backward holds), and says so.

The input that both keep for backward is a context attribute, not a tensor saved through
autograd: it counts in the live bytes (the peak), not in the saved-for-backward figure, as in a
real run's saved-tensor walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["Quantization", "PlannedLinear4bit", "cuda_gemm_scratch", "CUDA_GEMM_4BIT_FUSED_MAX_ROWS",
           "PlannedLinear8bit", "quantize_linear_layers", "QUANT_TYPES"]

QUANT_TYPES = ("nf4", "fp4")
# bitsandbytes' `quantize_4bit` default blocksize, which transformers' BitsAndBytesConfig keeps.
BLOCKSIZE = 64
# transformers' BitsAndBytesConfig default `llm_int8_threshold`.
INT8_THRESHOLD = 6.0
BITS = (4, 8)
# bitsandbytes' backends/cuda/ops.py, `_gemm_4bit_custom_max_m` (CUDA; 256 on ROCm): above it,
# gemm_4bit dequantizes the weight and calls F.linear.
CUDA_GEMM_4BIT_FUSED_MAX_ROWS = 1536


@dataclass(frozen=True)
class Quantization:
    """How the base model is loaded (transformers' `BitsAndBytesConfig`).

    Attributes:
        bits: 4 (`load_in_4bit`) or 8 (`load_in_8bit`).
        quant_type: `bnb_4bit_quant_type`, "nf4" or "fp4" (4-bit).
        double_quant: `bnb_4bit_use_double_quant` (4-bit).
        compute_dtype: `bnb_4bit_compute_dtype` (4-bit; transformers' default float32).
        threshold: `llm_int8_threshold` (8-bit; transformers' default 6.0).
    """

    bits: int = 4
    quant_type: str = "nf4"
    double_quant: bool = False
    compute_dtype: torch.dtype = torch.float32
    threshold: float = INT8_THRESHOLD

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits={self.bits!r} is not one of: 4, 8")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise ValueError(f"threshold={self.threshold!r}: expected a number of at least 0")
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"quant_type={self.quant_type!r} is not one of: {', '.join(QUANT_TYPES)}")


class PlannedLinear4bit(nn.Module):
    """bitsandbytes' `Linear4bit` under fake tensors (see the module docstring)."""

    def __init__(self, packed: torch.Tensor, quant_state: Any, bias: Optional[nn.Parameter],
                 compute_dtype: torch.dtype, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = bias
        self.quant_state = quant_state
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = quant_state.shape[1], quant_state.shape[0]
        for name, tensor in _state_tensors(quant_state).items():
            self.register_buffer(name, tensor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        scratch = cuda_gemm_scratch(x, self.quant_state) if self.device_type == "cuda" else []
        out = bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=self.quant_state)
        del scratch  # freed as the kernel returns
        return out.to(inp_dtype)


def cuda_gemm_scratch(x: torch.Tensor, quant_state: Any) -> List[torch.Tensor]:
    """The temporaries bitsandbytes' CUDA `gemm_4bit` holds while it multiplies `x` by a 4-bit
    weight (`backends/cuda/ops.py`: the `gemm_4bit` kernel for "cuda", `_dequant_linear_fallback`):
    above `CUDA_GEMM_4BIT_FUSED_MAX_ROWS` rows of `x`, or with an inner dimension that is not a
    multiple of the block size, the absmax dequantized to fp32 and that plus the offset (double
    quantization), and the weight dequantized in `x`'s dtype; none for the fused kernel."""
    inner = x.shape[-1]
    rows = x.numel() // inner if inner else 0
    if rows <= CUDA_GEMM_4BIT_FUSED_MAX_ROWS and inner % quant_state.blocksize == 0:
        return []
    scratch = []
    if getattr(quant_state, "nested", False):
        absmax = torch.empty(quant_state.absmax.shape, dtype=torch.float32, device=x.device)
        scratch += [absmax, torch.empty_like(absmax)]  # absmax_dq, then absmax_dq + absmax_offset
    scratch.append(torch.empty(tuple(quant_state.shape), dtype=x.dtype, device=x.device))
    return scratch


class PlannedLinear8bit(nn.Module):
    """bitsandbytes' `Linear8bitLt` (has_fp16_weights=False) under fake tensors (module docstring)."""

    def __init__(self, codes: torch.Tensor, row_scales: torch.Tensor, bias: Optional[nn.Parameter],
                 threshold: float, device_type: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.register_buffer("SCB", row_scales, persistent=False)
        self.bias = bias
        self.threshold = threshold
        self.device_type = device_type
        self.out_features, self.in_features = codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb
        from bitsandbytes.autograd._functions import MatMul8bitFp, MatMul8bitLt

        state = bnb.MatmulLtState()
        state.CB, state.SCB = self.weight.data, self.SCB
        state.has_fp16_weights, state.is_training = False, self.training
        if self.bias is not None and self.bias.dtype != x.dtype:  # Linear8bitLt.forward casts its bias in place
            self.bias.data = self.bias.data.to(x.dtype)
        if self.device_type == "cpu" and self.training:  # bnb.matmul's choice for a CPU input in training
            return MatMul8bitFp.apply(x, self.weight, None, self.bias, state)
        state.threshold = 0.0  # the outlier columns are data (module docstring): planned as none
        return MatMul8bitLt.apply(x, self.weight, None, self.bias, state)


def _state_tensors(state: Any) -> Dict[str, torch.Tensor]:
    tensors = {"quant_absmax": state.absmax, "quant_code": state.code}
    if getattr(state, "offset", None) is not None:
        tensors["quant_offset"] = state.offset
    nested = getattr(state, "state2", None)
    if nested is not None:
        tensors["quant_nested_absmax"] = nested.absmax
        tensors["quant_nested_code"] = nested.code
    return tensors


def _not_converted(model: nn.Module) -> Tuple[str, ...]:
    """transformers' `get_keys_to_not_convert`: the output embeddings (and what they are tied to)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return tuple(name for name, module in model.named_modules() if head is not None and module is head)


def _parent(model: nn.Module, name: str) -> Tuple[nn.Module, str, nn.Module]:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return parent, child, getattr(parent, child)


def quantize_linear_layers(model: nn.Module, mode: Any, quantization: Quantization, device_type: str = "cuda") -> int:
    """Load `model`'s linear layers in 4-bit or 8-bit, in place, as bitsandbytes does (module docstring).

    Args:
        model: a fake model (PEFT adapters and the output head are left in their dtype).
        mode: the FakeTensorMode its tensors belong to.
        quantization: the quantization settings.
        device_type: "cuda" or "cpu", the device the run will use (8-bit's matmul differs).

    Returns:
        The number of layers quantized.
    """
    import bitsandbytes.functional as bnb_functional
    from transformers.pytorch_utils import Conv1D

    skipped = set(_not_converted(model))
    # PEFT's adapters (lora_A, lora_B) are linear layers too: they stay in their dtype. transformers'
    # `_replace_with_bnb_linear` (integrations/bitsandbytes.py) also loads `Conv1D` layers (GPT-2's),
    # whose (in, out) weight it transposes to a linear layer's (out, in) before quantizing it.
    targets = [name for name, module in model.named_modules()
               if (type(module) is nn.Linear or isinstance(module, Conv1D)) and "lora_" not in name
               and name not in skipped]

    def weight_of(layer: nn.Module) -> torch.Tensor:
        weight = layer.weight.detach()
        return weight.t().contiguous() if isinstance(layer, Conv1D) else weight

    if quantization.bits == 8:
        with mode:
            for name in targets:
                parent, child, linear = _parent(model, name)
                # Int8Params._quantize: the weight in fp16, quantized by rows.
                codes, row_scales, _ = bnb_functional.int8_vectorwise_quant(weight_of(linear).to(torch.float16))
                setattr(parent, child, PlannedLinear8bit(codes, row_scales, linear.bias, quantization.threshold,
                                                         device_type))
        return len(targets)
    maps = bnb_functional.name2qmap
    saved = maps.get("dynamic")
    with mode:
        maps["dynamic"] = torch.empty(256, dtype=torch.float32)  # create_dynamic_map's shape; its values are read
        try:
            for name in targets:
                parent, child, linear = _parent(model, name)
                packed, state = bnb_functional.quantize_4bit(
                    weight_of(linear), blocksize=BLOCKSIZE, compress_statistics=quantization.double_quant,
                    quant_type=quantization.quant_type, quant_storage=torch.uint8)
                setattr(parent, child, PlannedLinear4bit(packed, state, linear.bias, quantization.compute_dtype,
                                                         device_type))
        finally:
            if saved is None:
                maps.pop("dynamic", None)
            else:
                maps["dynamic"] = saved
    return len(targets)
