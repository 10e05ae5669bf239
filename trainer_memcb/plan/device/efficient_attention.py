"""What SDPA's memory-efficient backward allocates on a GPU beside the gradients.

`_efficient_attention_backward` (`aten/src/ATen/native/transformers/cuda/attention_backward.cu`)
runs the first of the cutlass backward kernels `dispatch_cutlassB` lists for the dtype and the
compute capability (`mem_eff_attention/kernels/cutlassB.h`) that takes the call: its `kMaxK` at
least the head dimension, dropout if dropout is on, queries and keys a multiple of its blocks for a
"seqaligned" one, its shared memory within the GPU's. Each kernel is an `AttentionBackwardKernel`
(`mem_eff_attention/kernel_backward.h`) of blocks kBlockSizeI x kBlockSizeJ (queries x keys).
Before it runs, `launchKernel` allocates, freed when it returns:

- `delta`, float32 [B, H, Lq]: `at::empty` where the kernel computes it (`kKernelComputesDelta`:
  16-bit, except on sm70 where only kernels that keep their output in registers do); otherwise
  `(grad_out.to(float) * out.to(float)).sum(-1).transpose(-2, -1).contiguous()`, whose
  temporaries (the float32 copies of 16-bit inputs, the product [B, Lq, H, Dv], the sum
  [B, Lq, H]) live to the end of the statement, as C++ temporaries do;
- the workspace, float32 per (batch, head), `align_up(gk + gv + gq, 4)` elements
  (`Params::workspace_size`): gq = ceil(Lq/I) * ceil(D/J) * (4 + I*J) (`GradQTempStorage`: a
  lock, a counter, two pads and an I x J tile), needed by every kernel that splits its keys (sm70
  and newer: `kNeedsAccumGradQ`); gk and gv = splits * J * align_up(D, I) (and Dv), only for a
  16-bit kernel that does not keep its output in registers (`kNeedsAccumGradK/V`:
  `kMaxK > kBlockSizeI`). The key splits: ceil(Lk/J), 1 when B*H >= 256 and Lk <= 2J, at most
  200 // (B*H) when gk or gv is needed, at least 1 (`launchKernel`'s heuristic; deterministic
  mode takes 1); a workspace of no bytes is not allocated.

Which kernel fits the GPU's shared memory (`sizeof(SharedStorage)` against
`sharedMemPerBlockOptin`) cannot be computed here without cutlass's types: the first kernel of
the list that the other checks take is planned. The lists are torch's main branch's (sm80 kernels
for compute capability 8.0 up to 12.x, sm75, sm70, sm50); notaligned kernels, taken only where an
aligned one is refused for its shared memory, have the same blocks as the aligned ones before them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["EfficientBackwardKernel", "efficient_backward_kernel", "efficient_backward_allocations"]

_FLOAT32_BYTES = 4
_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

# (kBlockSizeI, kBlockSizeJ, kMaxK) of each kernel in dispatch order. The lists of fp32 on every
# arch and of fp16 before sm80 (their seqaligned kernels on sm70 have the same blocks as the
# next one): the kernels without dropout, then the same with dropout.
_GENERIC = ((64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))
# dispatch_cutlassB_bf16_sm80 and _f16_sm80: the 128x64 k96 kernel only on sm86 and sm89; the
# dropout kernels have no k96 one.
_HALF_SM80 = ((64, 64, 32), (64, 64, 64), (128, 64, 96), (128, 128, 128), (64, 64, 128), (128, 64, 65536),
              (64, 64, 65536))
_HALF_SM80_DROPOUT = ((64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))


@dataclass(frozen=True)
class EfficientBackwardKernel:
    """The cutlass backward kernel taken: its blocks, `kMaxK`, the arch it is built for (its
    `kMinComputeCapability`: 80, 75, 70 or 50) and whether its inputs are 16-bit."""

    block_i: int
    block_j: int
    max_k: int
    arch: int
    half: bool

    @property
    def output_in_registers(self) -> bool:
        """`kOutputInRF`: a 16-bit kernel whose head dimension fits its query block keeps dK, dV in registers."""
        return self.half and self.max_k <= self.block_i

    @property
    def computes_delta(self) -> bool:
        """`kKernelComputesDelta`."""
        return self.half and (self.output_in_registers or self.arch != 70)

    @property
    def accumulates_grad_kv(self) -> bool:
        """`kNeedsAccumGradK` and `kNeedsAccumGradV`: float32 accumulators for a 16-bit output."""
        return self.half and not self.output_in_registers


def _arch(compute_capability: Tuple[int, int]) -> int:
    cc = compute_capability[0] * 10 + compute_capability[1]
    for arch in (80, 75, 70, 50):
        if cc >= arch:
            return arch
    raise ValueError(f"compute capability {compute_capability}: the memory-efficient kernels need 5.0 or newer")


def efficient_backward_kernel(dtype: str, head_dim: int, compute_capability: Tuple[int, int], *,
                              dropout: bool = False) -> EfficientBackwardKernel:
    """The first kernel of `dispatch_cutlassB`'s list for `dtype` on `compute_capability` that takes
    `head_dim` (the larger of q's and v's) and `dropout` (shared memory taken as fitting: the module
    docstring).

    Examples:
        >>> efficient_backward_kernel("float32", 16, (8, 0))
        EfficientBackwardKernel(block_i=64, block_j=64, max_k=32, arch=80, half=False)
        >>> efficient_backward_kernel("bfloat16", 128, (8, 0)).block_j
        128
    """
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_ELEMENT_BYTES)}")
    arch, half = _arch(compute_capability), dtype != "float32"
    if dtype == "bfloat16" and arch < 80:
        raise ValueError(f"bfloat16 has no memory-efficient kernel before compute capability 8.0, not {compute_capability}")
    cc = compute_capability[0] * 10 + compute_capability[1]
    if half and arch == 80:
        kernels: List[Tuple[int, int, int]] = list(_HALF_SM80_DROPOUT if dropout else _HALF_SM80)
        if cc not in (86, 89) and not dropout:
            kernels.remove((128, 64, 96))
    else:
        kernels = list(_GENERIC)
    for block_i, block_j, max_k in kernels:
        if max_k >= head_dim:
            return EfficientBackwardKernel(block_i, block_j, max_k, arch, half)
    raise ValueError(f"head dimension {head_dim}: no memory-efficient backward kernel takes it")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _key_splits(kernel: EfficientBackwardKernel, batch: int, heads: int, seq_len_k: int) -> int:
    """`launchKernel`'s split-keys heuristic (`num_splits_key` not given, not deterministic)."""
    splits = _ceil_div(seq_len_k, kernel.block_j)
    if batch * heads >= 256 and seq_len_k <= 2 * kernel.block_j:
        splits = 1
    if kernel.accumulates_grad_kv:
        splits = min(splits, 200 // (batch * heads))
    return max(splits, 1) if kernel.arch >= 70 else 1  # kEnableSplitKeys = kMinSm >= 70


def _delta_allocations(kernel: EfficientBackwardKernel, dtype: str, rows: int, heads: int, seq_len_q: int,
                       head_dim_v: int) -> List[Tuple[str, int]]:
    """`delta`'s allocations: `at::empty` where the kernel computes it; else the statement's
    temporaries, freed at its end, the contiguous copy of the transposed sum kept (the sum itself
    where the transpose is already contiguous: one head or one query)."""
    if kernel.computes_delta:
        return [("delta", rows * _FLOAT32_BYTES)]
    made = []
    if dtype != "float32":  # .to(at::kFloat) copies a 16-bit tensor and returns a float32 one as it is
        made += [("grad_out_float", rows * head_dim_v * _FLOAT32_BYTES), ("out_float", rows * head_dim_v * _FLOAT32_BYTES)]
    made.append(("product", rows * head_dim_v * _FLOAT32_BYTES))
    copied = heads > 1 and seq_len_q > 1
    made.append(("sum" if copied else "delta", rows * _FLOAT32_BYTES))
    if copied:
        made.append(("delta", rows * _FLOAT32_BYTES))
    return made + [("~" + name, 0) for name, _ in made if name != "delta"]


def efficient_backward_allocations(*, batch: int, heads: int, seq_len_q: int, seq_len_k: int, head_dim: int,
                                   head_dim_v: int, dtype: str, compute_capability: Tuple[int, int],
                                   dropout: bool = False) -> List[Tuple[str, int]]:
    """The backward's allocations beside the gradients, in `launchKernel`'s order, as
    (name, bytes); a name "~name" frees that allocation. What is left (`delta`, the workspace) is
    freed when the kernel returns (the module docstring).

    Examples:
        >>> efficient_backward_allocations(batch=2, heads=2, seq_len_q=16, seq_len_k=16, head_dim=16, head_dim_v=16,
        ...                                dtype="bfloat16", compute_capability=(8, 0))
        [('delta', 256), ('workspace', 65600)]
    """
    for name, value in (("batch", batch), ("heads", heads), ("seq_len_q", seq_len_q), ("seq_len_k", seq_len_k),
                        ("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
    kernel = efficient_backward_kernel(dtype, max(head_dim, head_dim_v), compute_capability, dropout=dropout)
    made = _delta_allocations(kernel, dtype, batch * seq_len_q * heads, heads, seq_len_q, head_dim_v)
    splits = _key_splits(kernel, batch, heads, seq_len_k)
    block_i, block_j = kernel.block_i, kernel.block_j
    grad_kv = (splits * block_j * (_ceil_div(head_dim, block_i) + _ceil_div(head_dim_v, block_i)) * block_i
               if kernel.accumulates_grad_kv else 0)
    # kNeedsAccumGradQ: kernels that split their keys (sm70 and newer) and those of a 16-bit output.
    needs_grad_q = kernel.arch >= 70 or kernel.half
    grad_q = _ceil_div(seq_len_q, block_i) * _ceil_div(head_dim, block_j) * (4 + block_i * block_j) if needs_grad_q else 0
    workspace = batch * heads * _ceil_div(grad_kv + grad_q, 4) * 4 * _FLOAT32_BYTES
    return made + ([("workspace", workspace)] if workspace else [])
