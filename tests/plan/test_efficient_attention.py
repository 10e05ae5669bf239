"""What SDPA's memory-efficient backward allocates on a GPU (plan/device/efficient_attention.py): the
cutlass kernel `dispatch_cutlassB` takes and its `delta` and workspace, each figure derived here from
`attention_backward.cu` (`launchKernel`) and `kernel_backward.h` (`Params::workspace_size`). No GPU
here: the functions are checked against the sources' formulas, shape by shape."""

from __future__ import annotations

import doctest

import pytest

from trainer_memcb.plan.device.efficient_attention import efficient_backward_allocations, efficient_backward_kernel

A100, A10G, V100 = (8, 0), (8, 6), (7, 0)


def blocks(dtype: str, head_dim: int, cc, dropout: bool = False):
    kernel = efficient_backward_kernel(dtype, head_dim, cc, dropout=dropout)
    return kernel.block_i, kernel.block_j, kernel.max_k


def test_the_first_kernel_of_dispatch_cutlassB_that_takes_the_head_dimension():
    # dispatch_cutlassB_f32_sm80: 64x64 k32, 64x64 k64, 128x64 k128, 64x64 k128, 128x64 k65536, ...
    assert [blocks("float32", d, A100) for d in (16, 64, 128, 256)] == [
        (64, 64, 32), (64, 64, 64), (128, 64, 128), (128, 64, 65536)]
    # dispatch_cutlassB_bf16_sm80: 128x64 k96 on sm86 and sm89 only, then 128x128 k128 (seqaligned first,
    # the same blocks); with dropout no k96 kernel.
    assert blocks("bfloat16", 96, A10G) == (128, 64, 96)
    assert blocks("bfloat16", 96, A100) == blocks("bfloat16", 96, A10G, dropout=True) == (128, 128, 128)
    assert blocks("float16", 128, V100) == (128, 64, 128)  # dispatch_cutlassB_f16_sm70
    with pytest.raises(ValueError, match="bfloat16 has no memory-efficient kernel before compute capability 8.0"):
        efficient_backward_kernel("bfloat16", 64, (7, 5))


def test_float32_computes_delta_with_temporaries_and_accumulates_grad_q_only():
    b, h, m, d = 2, 2, 16, 16
    rows = b * m * h
    # kKernelComputesDelta is false for float32: (grad_out * out).sum(-1).transpose(-2, -1).contiguous(), the
    # product [B, M, H, Dv] and the sum [B, M, H] freed at the statement's end, the copy [B, H, M] kept.
    # kNeedsAccumGradQ (split keys, sm70+): one GradQTempStorage per 64-query block and 64-column block of D:
    # 4 int32 + a 64x64 float tile. kNeedsAccumGradK/V: false (a float32 output needs no float32 accumulator).
    workspace = b * h * (1 * 1 * (4 + 64 * 64)) * 4
    assert efficient_backward_allocations(batch=b, heads=h, seq_len_q=m, seq_len_k=m, head_dim=d, head_dim_v=d,
                                          dtype="float32", compute_capability=A100) == [
        ("product", rows * d * 4), ("sum", rows * 4), ("delta", rows * 4), ("~product", 0), ("~sum", 0),
        ("workspace", workspace)]
    assert workspace == 65_600
    # One head: the transposed sum is contiguous already, and is delta.
    one_head = efficient_backward_allocations(batch=b, heads=1, seq_len_q=m, seq_len_k=m, head_dim=d, head_dim_v=d,
                                              dtype="float32", compute_capability=A100)
    assert [name for name, _ in one_head] == ["product", "delta", "~product", "workspace"]


def test_sixteen_bit_kernels_compute_delta_and_accumulate_dk_dv_above_their_query_block():
    # bf16, D=128 on sm80: 128x128 k128 keeps dK, dV in registers (kMaxK <= kBlockSizeI): delta empty [B, H, M]
    # float32 and the dQ storage of ceil(512/128) query blocks x ceil(128/128) columns.
    assert efficient_backward_allocations(batch=1, heads=8, seq_len_q=512, seq_len_k=512, head_dim=128,
                                          head_dim_v=128, dtype="bfloat16", compute_capability=A100) == [
        ("delta", 512 * 8 * 4), ("workspace", 8 * 4 * 1 * (4 + 128 * 128) * 4)]
    # D=256: 128x64 k65536, dK and dV in float32 workspaces of splits x kBlockSizeJ x align_up(D, kBlockSizeI);
    # splits = ceil(1024/64) = 16, at most 200 // (B*H) = 100.
    gk = gv = 16 * 64 * 256
    gq = (1024 // 128) * (256 // 64) * (4 + 128 * 64)
    assert efficient_backward_allocations(batch=1, heads=2, seq_len_q=1024, seq_len_k=1024, head_dim=256,
                                          head_dim_v=256, dtype="bfloat16", compute_capability=A100) == [
        ("delta", 1024 * 2 * 4), ("workspace", 2 * (gk + gv + gq) * 4)]
    # B*H >= 256 and Lk <= 2 * kBlockSizeJ: one split.
    one_split = efficient_backward_allocations(batch=32, heads=8, seq_len_q=128, seq_len_k=128, head_dim=256,
                                               head_dim_v=256, dtype="bfloat16", compute_capability=A100)
    assert one_split[-1] == ("workspace", 256 * (64 * 256 * 2 + 1 * 4 * (4 + 128 * 64)) * 4)


def test_sm70_kernels_outside_registers_compute_delta_with_float32_copies():
    # kKernelComputesDelta = kIsHalf && (kOutputInRF || arch != 70): the 128x64 k65536 kernel on sm70 does not.
    made = efficient_backward_allocations(batch=1, heads=2, seq_len_q=64, seq_len_k=64, head_dim=160, head_dim_v=160,
                                          dtype="float16", compute_capability=V100)
    rows = 64 * 2
    assert made[:4] == [("grad_out_float", rows * 160 * 4), ("out_float", rows * 160 * 4), ("product", rows * 160 * 4),
                        ("sum", rows * 4)]


def test_bad_shapes_are_value_errors_that_name_them():
    with pytest.raises(ValueError, match="seq_len_q=0"):
        efficient_backward_allocations(batch=1, heads=1, seq_len_q=0, seq_len_k=1, head_dim=8, head_dim_v=8,
                                       dtype="float32", compute_capability=A100)


def test_docstring_examples_run():
    from trainer_memcb.plan.device import efficient_attention

    result = doctest.testmod(efficient_attention)
    assert result.attempted == 3 and result.failed == 0
