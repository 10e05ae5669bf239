"""flash_attention_3 planned without the flash-attn-3 package (plan/step/flash_attn3.py): the stand-ins'
values against SDPA on real tensors, what their fake kernels save and allocate against flash-attn
3.0.0's hopper/flash_api.cpp (`mha_fwd`, `mha_bwd`: shapes and dtypes read there, bytes derived
here), transformers' unpadding path and the varlen path of a packed row, and tiny Llamas planned on
an H100 against SDPA and flash_attention_2.

Not run here: flash-attn 3 itself (it builds only with CUDA, for sm80 and sm90a); its kernels are
stood in for by the module's ops, whose CPU implementations compute the attention in float32 (so
values are compared with a tolerance, bytes exactly)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trainer_memcb.plan.settings.attention import fa3_refusal
from trainer_memcb.plan.step import flash_attn, flash_attn3
from trainer_memcb.plan.step.flash_attn import flash_attention_as_cuda
from trainer_memcb.plan.step.live_storages import LiveStorages

transformers = pytest.importorskip("transformers")
from helpers import flash_forward_saved_bytes, tiny_bf16_llama  # noqa: E402

B, L, H, HKV, D = 2, 40, 4, 2, 16


def fa3(gpu=(9, 0), padding=0):
    return flash_attention_as_cuda(gpu, "H100", padding, "flash_attention_3")


def qkv(dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(B, L, heads, D, generator=generator).to(dtype).requires_grad_() for heads in (H, HKV, HKV)]


def reference(q, k, v, grad):
    """SDPA in float32 over [B, H, L, D], k and v's heads repeated: the output and q, k, v's gradients."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q32.transpose(1, 2), k32.transpose(1, 2).repeat_interleave(H // HKV, 1),
                                         v32.transpose(1, 2).repeat_interleave(H // HKV, 1), is_causal=True)
    out.transpose(1, 2).backward(grad.float())
    return [out.transpose(1, 2).detach()] + [t.grad for t in (q32, k32, v32)]


def test_values_and_gradients_equal_sdpa_on_real_tensors():
    q, k, v = qkv()
    grad = torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with fa3() as run:
        out = flash_attn3.flash_attn_func(q, k, v, causal=True)
    out.backward(grad)
    assert run.calls == {"flash_attn_func": 1}
    for got, want in zip([out.detach()] + [t.grad for t in (q, k, v)], reference(q, k, v, grad)):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_varlen_values_and_gradients_equal_sdpa_sequence_by_sequence():
    q, k, v = qkv()
    grad = torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    # The batch's two rows as two sequences of one packed row.
    flat = [t.detach().reshape(B * L, *t.shape[2:]).requires_grad_() for t in (q, k, v)]
    bounds = torch.tensor([0, L, 2 * L], dtype=torch.int32)
    with fa3():
        out = flash_attn3.flash_attn_varlen_func(*flat, bounds, bounds, L, L, causal=True)
    out.backward(grad.reshape(B * L, H, D))
    ours = [out.detach()] + [t.grad for t in flat]
    for got, want in zip(ours, reference(q, k, v, grad)):
        torch.testing.assert_close(got.float().reshape(want.shape), want, atol=3e-2, rtol=3e-2)


def test_forward_saves_and_allocates_what_mha_fwd_does():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), fa3():
        q, k, v = (torch.empty(4, 768, heads, 128, dtype=torch.bfloat16, requires_grad=True) for heads in (24, 8, 8))
        with LiveStorages() as tracker:
            before = tracker.alive_bytes
            out = flash_attn3.flash_attn_func(q, k, v, causal=True)
            forward_peak, after = tracker.peak_bytes - before, tracker.alive_bytes - before
        saved = out.grad_fn.saved_tensors
    # FlashAttnFunc.forward: ctx.save_for_backward(q, k, v, out, softmax_lse): no RNG state, nothing padded.
    assert len(saved) == 5 and saved[0].shape == q.shape and saved[1].shape == k.shape
    out_, lse = saved[3], saved[4]
    # out = torch::empty({b, s_q, h, dv}) bf16: 4 * 768 * 24 * 128 * 2
    assert out_.shape == (4, 768, 24, 128) and out_.untyped_storage().nbytes() == 18_874_368
    # softmax_lse = torch::empty({b, h, s_q}, kFloat): 4 * 24 * 768 * 4
    assert lse.shape == (4, 24, 768) and lse.dtype == torch.float32 and lse.untyped_storage().nbytes() == 294_912
    assert after == 18_874_368 + 294_912
    # tile_count_semaphore, causal on sm90 with one split: int32 of 1 + round(4, 4) * 2 (sorted batches, head
    # swizzle), freed when mha_fwd returns: 36 bytes held with out and softmax_lse.
    assert forward_peak == after + (1 + 4 * 2) * 4


def _backward_workspace(q, k, varlen=None, deterministic=False, arch=90, causal=True):
    """The bytes alive in the stand-in backward op beyond dq, dk, dv (fake tensors) on a GPU of `arch`."""
    shapes = flash_attn3._Shapes(q, k, k, *(varlen or (None, None, None)))
    allocations = flash_attn3._backward_allocations(q, shapes, causal, (-1, -1), 0.0, deterministic, arch)
    return [a.untyped_storage().nbytes() for a in allocations]


def test_backward_workspaces_as_mha_bwd_allocates():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(4, 768, 24, 128, dtype=torch.bfloat16), torch.empty(4, 768, 8, 128, dtype=torch.bfloat16)
        dense = _backward_workspace(q, k)
        deterministic = _backward_workspace(q, k, deterministic=True)
        # varlen: 2 sequences of 700 and 568 tokens
        flat_q, flat_k = torch.empty(1268, 24, 128, dtype=torch.bfloat16), torch.empty(1268, 8, 128, dtype=torch.bfloat16)
        varlen = _backward_workspace(flat_q, flat_k, (torch.empty(3, dtype=torch.int32), 700, 700))
    # hdim 128 causal on sm90: kBlockM 64, kBlockN 128 (mha_bwd); 768 rounds to itself.
    assert flash_attn3.bwd_block_sizes(128, True, False, 0.0, (9, 0)) == (64, 128)
    assert flash_attn3.bwd_block_sizes(128, False, False, 0.0, (9, 0)) == (80, 128)
    # softmax_d, softmax_lse_log2 fp32 [4, 24, 768]; dq_accum fp32 [4, 24, 768 * 128]; dk_accum, dv_accum fp32
    # [4, 8, 768 * 128] (grouped heads); dq_semaphore int32 [12, 4, 24]; no dk/dv semaphores unless deterministic.
    assert dense == [294_912, 294_912, 37_748_736, 12_582_912, 12_582_912, 4_608, 0, 0]
    assert deterministic[6:] == [6 * 4 * 8 * 4] * 2  # int32 [ceil(768 / 128), 4, 8]
    # varlen: (total_q + B * kBlockM) rounded to kBlockM = 1408 rows, (total_k + B * kBlockN) to kBlockN = 1536;
    # dq_semaphore [ceil(700 / 64), 2, 24].
    assert varlen == [24 * 1408 * 4, 24 * 1408 * 4, 24 * 1408 * 128 * 4, 8 * 1536 * 128 * 4, 8 * 1536 * 128 * 4,
                      11 * 2 * 24 * 4, 0, 0]


def _causal_backward_peak(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The most bytes a causal FA3 attention's backward holds above what was alive before it (the
    inputs, the output's gradient and what the forward saved, kept as in a step)."""
    out = flash_attn3.flash_attn_func(q, k, v, causal=True)
    dout = torch.empty_like(out)
    with LiveStorages() as tracker:
        saved = out.grad_fn.saved_tensors
        for tensor in (q, k, v, dout, *saved):
            tracker.add(tensor)
        before = tracker.alive_bytes
        out.backward(dout)
        return tracker.peak_bytes - before


def test_backward_holds_the_gradients_and_the_workspace_while_it_runs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), fa3():
        q, k, v = (torch.empty(4, 768, heads, 128, dtype=torch.bfloat16, requires_grad=True) for heads in (24, 8, 8))
        peak = _causal_backward_peak(q, k, v)
    # dq, dk, dv (bf16, as q, k, v): 18,874,368 + 2 * 6,291,456, and the workspace above
    assert peak == 18_874_368 + 2 * 6_291_456 + 2 * 294_912 + 37_748_736 + 2 * 12_582_912 + 4_608
    # flash-attn 2 holds dq_accum fp32 [4, 768, 24, 128], dk/dv expanded bf16 [4, 768, 24, 128] and softmax_d
    # [4, 24, 768]: 75,792,384 bytes of workspace; FA3 63,508,992 (its grouped heads' accumulators are fp32 but not
    # expanded to the query heads).
    with FakeTensorMode():
        q, k = torch.empty(4, 768, 24, 128, dtype=torch.bfloat16), torch.empty(4, 768, 8, 128, dtype=torch.bfloat16)
        fa2 = (flash_attn._backward_workspace(q, k, None).untyped_storage().nbytes()
               + flash_attn._softmax_d_like(q, None).untyped_storage().nbytes())
    assert fa2 == 75_792_384 and peak - 18_874_368 - 2 * 6_291_456 == 63_508_992


def test_varlen_forward_semaphore_holds_the_prepared_batches():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1268, 24, 128, dtype=torch.bfloat16), torch.empty(1268, 8, 128, dtype=torch.bfloat16)
        shapes = flash_attn3._Shapes(q, k, k, torch.empty(3, dtype=torch.int32), 700, 700)
        out, lse, semaphore, out_accum, lse_accum = flash_attn3._forward_allocations(q, shapes, True, (-1, -1), 1, 90)
        split = flash_attn3._forward_allocations(q, shapes, True, (-1, -1), 3, 90)
    assert out.shape == (1268, 24, 128) and lse.shape == (24, 1268)
    # varlen causal: 1 + round(2, 4) * (2 prepared + sorted + swizzle) int32
    assert semaphore.shape == (1 + 4 * 4,) and out_accum.numel() == lse_accum.numel() == 0
    # num_splits 3 (asked for): out_accum fp32 [3, 24, 1268, 128], softmax_lse_accum [3, 24, 1268]
    assert split[3].shape == (3, 24, 1268, 128) and split[4].shape == (3, 24, 1268)


def test_refuses_what_flash_attn_3_refuses():
    q, k, v = qkv()
    with fa3((10, 0)), pytest.raises(RuntimeError, match="no kernels for it"):
        flash_attn3.flash_attn_func(q, k, v)
    with fa3((7, 5)), pytest.raises(RuntimeError, match="Ampere GPUs or newer"):
        flash_attn3.flash_attn_func(q, k, v)
    with fa3(), pytest.raises(RuntimeError, match="fp16, bf16, and fp8_e4m3"):
        flash_attn3.flash_attn_func(*(t.float() for t in (q, k, v)))
    odd = [torch.zeros(1, 4, 2, 20, dtype=torch.bfloat16) for _ in range(3)]  # FA2 pads 20 to 24; FA3 refuses
    with fa3(), pytest.raises(RuntimeError, match="multiple of 8"):
        flash_attn3.flash_attn_func(*odd)
    assert fa3_refusal((9, 0)) is None and "no kernels" in fa3_refusal((10, 0))


# mha_bwd's tile sizes off Hopper (kBlockM_sm80/kBlockN_sm80 and kBlockM_sm86/kBlockN_sm86, the same as
# flash_bwd_launch_template.h's run_mha_bwd_hdim*), by rounded head dimension: neither reads causal.
SM80_BLOCKS = {64: (128, 128), 96: (64, 128), 128: (64, 128), 192: (64, 80), 256: (64, 64)}
SM86_BLOCKS = {64: (64, 128), 96: (64, 128), 128: (64, 96), 192: (64, 64), 256: (32, 64)}


@pytest.mark.parametrize("gpu,blocks", [("A100-80GB", SM80_BLOCKS), ("A10G", SM86_BLOCKS), ("L40S", SM86_BLOCKS)])
def test_ampere_and_ada_take_mha_bwds_sm80_and_sm86_tile_sizes(gpu, blocks):
    from trainer_memcb.plan.device.gpus import gpu_preset

    capability = gpu_preset(gpu).compute_capability
    for head_dim, expected in blocks.items():
        for causal, local in ((True, False), (False, False), (False, True)):
            assert flash_attn3.bwd_block_sizes(head_dim, causal, local, 0.0, capability) == expected
    # sm90's kBlockM reads causal: 80 for a head dimension of 128 without it, where sm80 keeps 64.
    assert flash_attn3.bwd_block_sizes(128, False, False, 0.0, (9, 0)) == (80, 128)


# B=2, H=4, Hkv=2 (grouped), L=200, D=128 bf16, causal.
GB, GL, GH, GHKV, GD = 2, 200, 4, 2, 128


@pytest.mark.parametrize("gpu,expected", [
    # sm80, hdim 128: kBlockM 64, kBlockN 128. Lq 200 rounds to 256 rows, Lk to 256: softmax_d and
    # softmax_lse_log2 fp32 [2, 4, 256] = 8,192 bytes each; dq_accum fp32 [2, 4, 256 * 128] = 1,048,576;
    # dk_accum, dv_accum fp32 [2, 2, 256 * 128] = 524,288 each; dq_semaphore int32 [ceil(200 / 64) = 4, 2, 4] = 128.
    ("A100-80GB", [8_192, 8_192, 1_048_576, 524_288, 524_288, 128]),
    # sm86 (A10G, 8.6) and its tile sizes on Ada (L40S, 8.9): kBlockM 64, kBlockN 96. Lk 200 rounds to 288:
    # dk_accum, dv_accum fp32 [2, 2, 288 * 128] = 589,824 each; the rest as sm80's.
    ("A10G", [8_192, 8_192, 1_048_576, 589_824, 589_824, 128]),
    ("L40S", [8_192, 8_192, 1_048_576, 589_824, 589_824, 128]),
])
def test_backward_on_ampere_and_ada_allocates_what_mha_bwd_does_there(gpu, expected):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer_memcb.plan.device.gpus import gpu_preset

    capability = gpu_preset(gpu).compute_capability
    with FakeTensorMode(), flash_attention_as_cuda(capability, gpu, 0, "flash_attention_3"):
        q, k, v = (torch.empty(GB, GL, heads, GD, dtype=torch.bfloat16, requires_grad=True)
                   for heads in (GH, GHKV, GHKV))
        workspace = _backward_workspace(q, k, arch=flash_attn3.fa3_arch(capability))
        deterministic = _backward_workspace(q, k, deterministic=True, arch=flash_attn3.fa3_arch(capability))
        peak = _causal_backward_peak(q, k, v)
    assert workspace == expected + [0, 0]
    # deterministic with grouped heads: dk_semaphore, dv_semaphore int32 [ceil(200 / kBlockN), 2, 2]
    block_n = 128 if gpu == "A100-80GB" else 96
    assert deterministic[6:] == [-(-GL // block_n) * GB * GHKV * 4] * 2 == ([32] * 2 if block_n == 128 else [48] * 2)
    # Through the autograd function (the capability reaching the op): dq bf16 [2, 200, 4, 128] = 409,600, dk and
    # dv [2, 200, 2, 128] = 204,800 each, held with the whole workspace.
    assert peak == 409_600 + 2 * 204_800 + sum(expected)


def test_forward_semaphore_on_ampere_and_ada_only_for_causal_or_split_varlen():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(GB, GL, GH, GD, dtype=torch.bfloat16), torch.empty(GB, GL, GHKV, GD, dtype=torch.bfloat16)
        dense = flash_attn3._Shapes(q, k, k, None, None, None)
        flat_q, flat_k = q.reshape(GB * GL, GH, GD), k.reshape(GB * GL, GHKV, GD)
        varlen = flash_attn3._Shapes(flat_q, flat_k, flat_k, torch.empty(3, dtype=torch.int32), GL, GL)

        def semaphore(arch, shapes, window=(-1, -1), causal=True, query=q):
            return flash_attn3._forward_allocations(query, shapes, causal, window, 1, arch)[2].numel()

        sizes = {arch: (semaphore(arch, dense), semaphore(arch, dense, causal=False),
                        semaphore(arch, dense, (50, 0), causal=False), semaphore(arch, varlen, query=flat_q))
                 for arch in (80, 86, 90)}
    # mha_fwd's scheduler_needs_semaphore: sm90 for causal or local with one split, or varlen; sm8x for causal
    # (not varlen) or a split varlen. The int32 tensor holds it (1) and round(B, 4) = 4 elements per vector:
    # causal 2 (sorted batches, head swizzle), local 1 (head swizzle), varlen 2 more (prepared batches).
    assert sizes[90] == (1 + 4 * 2, 0, 1 + 4 * 1, 1 + 4 * 4)
    assert sizes[80] == sizes[86] == (1 + 4 * 2, 0, 0, 4 * 4)


def test_ampere_and_ada_refuse_what_mha_fwd_refuses_off_hopper():
    q, k, v = qkv()
    with fa3((8, 6)), pytest.raises(RuntimeError, match="Ampere/Ada cards only supports fp16 and bf16"):
        flash_attn3.flash_attn_func(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)))
    wide_v = torch.zeros(B, L, HKV, 2 * D, dtype=torch.bfloat16)
    with fa3((8, 0)), pytest.raises(RuntimeError, match="Only Hopper supports different V headdim"):
        flash_attn3.flash_attn_func(q, k, wide_v)
    # What stays refused before any trace: older than Ampere, and what the build has no machine code for.
    assert [fa3_refusal(cc) is None for cc in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))] == [
        False, True, True, True, True, False, False]
    assert "Ampere GPUs or newer" in fa3_refusal((7, 0)) and "no kernels" in fa3_refusal((12, 0))


def test_transformers_reads_fa3_keywords_from_the_signature():
    # _lazy_define_process_function reads the varlen function's parameters: FA3 takes no dropout_p, so transformers
    # never passes one, and takes window_size, softcap, deterministic and max_seqlen_q as FA3 does.
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    supports = _lazy_define_process_function(flash_attn3.flash_attn_varlen_func).keywords["supports_mapping"]
    assert supports["dropout_p"] is False
    assert all(supports[name] for name in ("window_size", "softcap", "deterministic"))  # 4.57 passes max_seqlen_* itself


def _real_saved_bytes(attn: str, padding: int) -> int:
    saved, run = flash_forward_saved_bytes(attn, padding, flash_attention_as_cuda((9, 0), "H100", padding, attn))
    assert run.calls == {"flash_attn_varlen_func" if padding else "flash_attn_func": 1}
    return saved


def _planned_activations(attn: str, padding: int = 0, heads_k: int = 2, layers: int = 1) -> int:
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.step.trace import trace_step_once

    with torch.device("meta"):
        meta = tiny_bf16_llama(heads_k, layers)
    meta.config._attn_implementation = attn
    settings = dataclasses.replace(resolve_settings(batch_size=2, optimizer="adamw_torch", padding=padding,
                                                    attn_implementation=attn),
                                   device_type="cuda", seq_len=256, gpu="H100")
    timeline = trace_step_once(meta, settings, args=None, step_dtype=torch.bfloat16)
    if attn.startswith("flash"):
        kernel = "flash_attn_varlen_func" if padding else "flash_attn_func"
        assert any(f"{kernel} ({layers} calls)" in note for note in timeline.notes), timeline.notes
    return timeline.activations_bytes


def test_unpadding_path_saves_what_a_real_run_of_it_saves():
    # transformers' _upad_input (the unpadded copies of q, k, v, the indices, cu_seqlens) and, for FA3, its own
    # _pad_input (an index_put that saves the indices) in place of flash-attn 2's bert_padding.pad_input: the
    # plan's padded step over its unpadded one equals a real CPU run of the same path, and FA2's.
    real = _real_saved_bytes("flash_attention_3", 4) - _real_saved_bytes("flash_attention_3", 0)
    planned = _planned_activations("flash_attention_3", 4) - _planned_activations("flash_attention_3", 0)
    assert planned == real == 66_380


@pytest.mark.parametrize("heads_k", [4, 2])  # one head of keys per query head, and grouped heads
def test_tiny_llama_on_h100_saves_what_sdpa_saves_and_fa2_more(heads_k):
    layers = 2
    fa3_bytes = _planned_activations("flash_attention_3", heads_k=heads_k, layers=layers)
    # On sm90 SDPA takes cuDNN (torch 2.13, cuDNN > 9.15: `sdpa_backend`), which saves what its flash backend
    # saves, q, k, v, the output and a float32 logsumexp [B, H, L]: what FA3's FlashAttnFunc saves.
    assert fa3_bytes == _planned_activations("sdpa", heads_k=heads_k, layers=layers)
    # flash-attn 2 saves its rng_state too (int64 [2], allocated even without dropout): 16 bytes a layer.
    assert _planned_activations("flash_attention_2", heads_k=heads_k, layers=layers) - fa3_bytes == 16 * layers


@pytest.mark.slow
def test_llama_3b_on_h100_flash_attention_3_against_sdpa_and_flash_attention_2(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_flash_attn import LLAMA_3B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3B))
    plans = {}
    for attn in ("flash_attention_3", "flash_attention_2", "sdpa"):
        run = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", str(tmp_path), "--dtype", "bfloat16",
                              "--batch-size", "4", "--seq-len", "768", "--gpu", "h100", "--optimizers", "adamw_torch",
                              "--attn-implementation", attn, "--json"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
        assert run.returncode in (0, 3), run.stderr
        plans[attn] = json.loads(run.stdout)
    peaks = {attn: plan["step"]["peak_bytes"] for attn, plan in plans.items()}
    # The step's peak is in the backward past the attention's: FA3's workspace (63.5 MB a layer) is freed by then.
    # What is held there is what each saves: FA3 and SDPA (cuDNN on sm90) the same, FA2 its 28 rng_states more,
    # each a 512-byte block of the caching allocator in the replay.
    assert peaks["flash_attention_3"] == peaks["sdpa"] and peaks["flash_attention_2"] - peaks["sdpa"] == 28 * 16
    allocated = {attn: plan["device"]["allocator_allocated_peak_bytes"] for attn, plan in plans.items()}
    assert allocated["flash_attention_2"] - allocated["flash_attention_3"] == 28 * 512
    assert any("flash_attn_func (28 calls)" in note for note in plans["flash_attention_3"]["step"]["notes"])


def test_docstring_examples_run():
    import doctest

    from trainer_memcb.plan.settings import attention

    for module in (flash_attn3, attention):
        result = doctest.testmod(module)
        assert result.attempted >= 2 and result.failed == 0, module.__name__
