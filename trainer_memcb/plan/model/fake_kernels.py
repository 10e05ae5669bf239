"""Fake kernels the step plan needs where torch's own refuse what the real kernel runs.

`torch._grouped_mm` is transformers' default MoE path (`integrations/moe.py`, `_grouped_mm`,
taken whenever `_can_use_grouped_mm` says so, on the CPU too). Its meta kernel
(`torch/_meta_registrations.py`, `_meta_grouped_mm_common`) checks the CUDA kernel's rule,
"Expected inputs of BF16 type", while the CPU kernel multiplies fp32 (and fp16) as well: under
fake tensors an fp32 Mixtral or Qwen3-MoE could not be traced although a real CPU step runs.

`grouped_mm_any_dtype()` is a context manager that, while it is active, answers
`aten._grouped_mm` under fake tensors with the output the meta kernel makes for bf16 inputs of
the same shapes, in the inputs' dtype (the output's shape does not depend on the dtype). It is
registered in FakeTensorMode's table of op implementations
(`torch._subclasses.fake_impls.op_implementations_dict`) and removed on exit; bf16 inputs go to
torch's own meta kernel unchanged. The model's forward is the one the real run takes
(`grouped_mm`), so the tensors autograd saves are the same.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["grouped_mm_any_dtype"]


def _grouped_mm_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch._meta_registrations import meta_grouped_mm
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    mat_a, mat_b = args[0], args[1]
    rest = args[2:]
    out_dtype = kwargs.pop("out_dtype", None)
    dtype = out_dtype or mat_a.dtype
    with in_kernel_invocation_manager(fake_mode):
        a = torch.empty_strided(mat_a.shape, mat_a.stride(), dtype=torch.bfloat16, device="meta")
        b = torch.empty_strided(mat_b.shape, mat_b.stride(), dtype=torch.bfloat16, device="meta")
        others = [torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t for t in rest]
        kw = {k: (torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        out = meta_grouped_mm(a, b, *others, **kw)
        out = torch.empty(out.shape, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, out, mat_a.device)


@contextlib.contextmanager
def grouped_mm_any_dtype() -> Iterator[None]:
    """While active, fake `torch._grouped_mm` takes any floating dtype (see the module docstring)."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None:  # a torch without grouped_mm: transformers takes its fallback
        yield
        return
    from torch._subclasses import fake_impls

    overload = op.default
    table = fake_impls.op_implementations_dict
    if overload in table:  # another registration (a newer torch's own): leave it
        yield
        return
    table[overload] = _grouped_mm_fake
    try:
        yield
    finally:
        table.pop(overload, None)
