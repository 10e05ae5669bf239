"""bitsandbytes' CUDA gemm_4bit in the step plan: the dequantized weight it holds above 1536 rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from trainer_memcb.plan.model.quantized import (
    CUDA_GEMM_4BIT_FUSED_MAX_ROWS, PlannedLinear4bit, Quantization, cuda_gemm_scratch, quantize_linear_layers)
from trainer_memcb.plan.step.live_storages import LiveStorages

pytest.importorskip("bitsandbytes")

OUT, IN = 96, 128


def _layer(device_type: str, double_quant: bool) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        model = nn.Sequential(nn.Linear(IN, OUT, bias=False))
    quantize_linear_layers(model, mode, Quantization(bits=4, double_quant=double_quant, compute_dtype=torch.float16),
                           device_type)
    layer = model[0]
    assert isinstance(layer, PlannedLinear4bit)
    return layer, mode


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_scratch_is_the_dequantized_weight_and_absmax_above_the_fused_kernels_rows(double_quant: bool) -> None:
    layer, mode = _layer("cuda", double_quant)
    with mode:
        many = torch.empty(CUDA_GEMM_4BIT_FUSED_MAX_ROWS + 1, IN, dtype=torch.float16)
        few = torch.empty(CUDA_GEMM_4BIT_FUSED_MAX_ROWS, IN, dtype=torch.float16)
        assert cuda_gemm_scratch(few, layer.quant_state) == []
        scratch = cuda_gemm_scratch(many, layer.quant_state)
    blocks = OUT * IN // 64
    expected = ([(torch.float32, (blocks,))] * 2 if double_quant else []) + [(torch.float16, (OUT, IN))]
    assert [(t.dtype, tuple(t.shape)) for t in scratch] == expected


@pytest.mark.parametrize("rows", [CUDA_GEMM_4BIT_FUSED_MAX_ROWS, 2048])
def test_a_cuda_forward_holds_the_scratch_beside_its_output_and_a_cpu_one_does_not(rows: int) -> None:
    peaks = {}
    for device_type in ("cpu", "cuda"):
        layer, mode = _layer(device_type, double_quant=True)
        with mode:
            x = torch.empty(rows, IN, dtype=torch.float16)
            tracker = LiveStorages()
            tracker.add(x)
            with tracker:
                out = layer(x)
            assert out.shape == (rows, OUT) and out.dtype == torch.float16
        peaks[device_type] = tracker.peak_bytes
    scratch = 2 * (OUT * IN // 64) * 4 + OUT * IN * 2
    assert peaks["cuda"] - peaks["cpu"] == (scratch if rows > CUDA_GEMM_4BIT_FUSED_MAX_ROWS else 0)
