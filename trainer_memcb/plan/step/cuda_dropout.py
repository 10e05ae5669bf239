"""Dropout as CUDA runs it, on the CPU trace: a 1-byte mask saved for backward.

`torch.nn.functional.dropout` is `aten::dropout`, a composite op (`aten/src/ATen/native/Dropout.cpp`,
`dropout`) that takes one of two paths by the device:

- on CUDA (`is_fused_kernel_acceptable`: a CUDA, XPU, lazy or privateuse1 tensor, 0 < p < 1, not
  empty): `native_dropout`, whose kernel (`native/cuda/Dropout.cu`, `dropout_cuda`) returns the
  output and a **bool** mask, and whose backward (`NativeDropoutBackward0`,
  `native_dropout_backward`) saves that mask: 1 byte per element;
- anywhere else (the CPU): `_dropout_impl`, a noise tensor **in the input's dtype**
  (`empty_like(input).bernoulli_(1 - p).div_(1 - p)`) multiplied into the input, the
  multiplication saving the noise: 2 or 4 bytes per element.

A trace on fake CPU tensors takes the second path, so for a CUDA run it saves 1 to 3 bytes more
per element of every dropout (attention probabilities included: 4 x 16 x 512 x 512 per layer in a
bert-large step at batch 4 x 512). `dropout_as_cuda()` makes the trace take CUDA's path: for
its duration `aten::dropout`'s composite kernel is replaced by one that calls `native_dropout`
where CUDA would (and returns the input, as `_dropout_impl` does, with `train=False` or `p=0`;
`p=1` multiplies by zero, as it does), so autograd records `NativeDropoutBackward0` with its bool
mask, as on the GPU. The in-place `dropout_` and the feature and alpha dropouts take the composite
path on CUDA too and are left as they are.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

__all__ = ["dropout_as_cuda"]


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    # Dropout.cpp, dropout: is_fused_kernel_acceptable(input, p) -> native_dropout; else
    # _dropout_impl: the input itself when p == 0 or not training or empty, zeros when p == 1.
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))


@contextlib.contextmanager
def dropout_as_cuda() -> Iterator[None]:
    """Within: `aten::dropout` takes CUDA's `native_dropout` path on any tensor (module docstring)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            library.impl("dropout", _dropout, "CompositeImplicitAutograd")
        yield
    finally:
        library._destroy()
