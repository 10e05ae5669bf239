"""Rules for torchao's low-bit Adam/AdamW (torchao/optim/adam.py).

Registered by `"module:ClassName"`, so nothing here imports torchao: a rule is only resolved once
the user has imported `torchao.optim`.
"""

from __future__ import annotations

from typing import Any, Mapping

from trainer_memcb.state.registry import ParamInfo, register_estimate_rule
from trainer_memcb.state.rules._common import step_and_buffers

# _AdamBase._new_buffer: "follow bitsandbytes, only quantize tensors >= 4096 values".
_MIN_QUANTIZED_NUMEL = 4096


def _quantized(codes_bits: int, qmap_len: int):
    """Bytes of one buffer made by `_AdamBase._new_buffer`: a quantized tensor subclass holding
    `codes` (`codes_bits` per value), `scale` (one fp32 per block) and its own fp32 `qmap` of
    `qmap_len` values, when the local tensor has >= 4096 values and a whole number of blocks;
    else `zeros_like(p)` in the parameter's dtype."""

    def buffer_bytes(param: ParamInfo, group: Mapping[str, Any], optimizer: Any) -> int:
        block_size = optimizer.block_size
        numel = param.numel
        if numel < _MIN_QUANTIZED_NUMEL or numel % block_size != 0:
            return param.num_bytes
        return numel * codes_bits // 8 + 4 * (numel // block_size) + 4 * qmap_len

    return buffer_bytes


# (class names, codes bits, qmap length, source of the subclass's zeros())
_VARIANTS = [
    # subclass_8bit.py OptimState8bit.zeros: uint8 codes, qmap = create_dynamic_map(signed): 256.
    (("Adam8bit", "AdamW8bit"), 8, 256, "torchao/optim/subclass_8bit.py OptimState8bit.zeros"),
    # subclass_4bit.py OptimState4bit.zeros: uint8 codes[n // 2], qmap of 16 values.
    (("Adam4bit", "AdamW4bit"), 4, 16, "torchao/optim/subclass_4bit.py OptimState4bit.zeros"),
    # subclass_fp8.py OptimStateFp8.zeros: float8_e4m3fn codes, no qmap.
    (("AdamFp8", "AdamWFp8"), 8, 0, "torchao/optim/subclass_fp8.py OptimStateFp8.zeros"),
]

for _names, _bits, _qmap_len, _zeros_source in _VARIANTS:
    # _AdamBase.step: step = torch.tensor(0.0) (default dtype), exp_avg, exp_avg_sq, and
    # max_exp_avg_sq with amsgrad, each from _new_buffer.
    _rule = step_and_buffers(
        ("step",),
        {"exp_avg": None, "exp_avg_sq": None, "max_exp_avg_sq": "amsgrad"},
        buffer_bytes=_quantized(_bits, _qmap_len),
    )
    for _name in _names:
        register_estimate_rule(
            f"torchao.optim.adam:{_name}",
            _rule,
            source=f"torchao/optim/adam.py _AdamBase.step, _new_buffer; {_zeros_source}",
        )
