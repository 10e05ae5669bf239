"""flash_attention_2 planned without the flash-attn package (plan/step/flash_attn.py): the stand-ins'
values against SDPA on real tensors, what their fake kernels save and allocate against
flash-attn 2.8.4's flash_api.cpp (shapes and dtypes read there, bytes derived here), transformers'
unpadding path for a padded batch against a real CPU run of the same path, and the Llama-3.2-3B
plan on an L40S against SDPA's.

Not run here: flash-attn itself (it builds only with CUDA); its kernels are stood in for by the
module's ops, whose CPU implementations compute the attention in float32 (so values are compared
with a tolerance, bytes exactly)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer_memcb.plan.step import flash_attn
from trainer_memcb.plan.step.flash_attn import flash_attention_2_as_cuda, flash_attn_func, num_splits_heuristic

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

from helpers import flash_forward_saved_bytes, tiny_bf16_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
B, L, H, HKV, D = 2, 40, 4, 2, 16


def qkv(dtype: torch.dtype = torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, D, generator=generator).to(dtype).requires_grad_()
    k = torch.randn(B, L, HKV, D, generator=generator).to(dtype).requires_grad_()
    v = torch.randn(B, L, HKV, D, generator=generator).to(dtype).requires_grad_()
    return q, k, v


def test_values_and_gradients_equal_sdpa_on_real_tensors():
    q, k, v = qkv()
    grad = torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with flash_attention_2_as_cuda((8, 0)):
        out = flash_attn_func(q, k, v, causal=True)
    out.backward(grad)
    ours = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2).repeat_interleave(2, 1),
                                         v.float().transpose(1, 2).repeat_interleave(2, 1), is_causal=True)
    ref.transpose(1, 2).backward(grad.float())
    expected = [ref.transpose(1, 2).detach()] + [t.grad.float() for t in (q, k, v)]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_forward_saves_out_softmax_lse_and_rng_state_as_mha_fwd_allocates():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), flash_attention_2_as_cuda((8, 9), "L40S"):
        q, k, v = (torch.empty(4, 768, heads, 128, dtype=torch.bfloat16, requires_grad=True)
                   for heads in (24, 8, 8))
        out = flash_attn_func(q, k, v, causal=True)
        saved = out.grad_fn.saved_tensors
    # FlashAttnFunc.forward: ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
    q_, k_, v_, out_padded, lse, rng_state = saved
    assert (q_ is q or q_.shape == q.shape) and k_.shape == k.shape
    # mha_fwd: out = torch::empty_like(q): 4 * 768 * 24 * 128 bf16
    assert out_padded.shape == (4, 768, 24, 128) and out_padded.untyped_storage().nbytes() == 18_874_368
    # softmax_lse = torch::empty({batch_size, num_heads, seqlen_q}, kFloat): 4 * 24 * 768 * 4
    assert lse.shape == (4, 24, 768) and lse.dtype == torch.float32 and lse.untyped_storage().nbytes() == 294_912
    # rng_state = torch::empty({2}, kInt64), allocated even without dropout
    assert rng_state.shape == (2,) and rng_state.dtype == torch.int64 and rng_state.untyped_storage().nbytes() == 16


def test_backward_workspaces_as_mha_bwd_allocates():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(4, 768, 24, 128, dtype=torch.bfloat16)
        k = torch.empty(4, 768, 8, 128, dtype=torch.bfloat16)
        workspace = flash_attn._backward_workspace(q, k, None)
        softmax_d = flash_attn._softmax_d_like(q, None)
        # varlen: 2 rows of 700 and 568 tokens
        varlen_q, varlen_k = torch.empty(1268, 24, 128, dtype=torch.bfloat16), torch.empty(1268, 8, 128,
                                                                                            dtype=torch.bfloat16)
        varlen_workspace = flash_attn._backward_workspace(varlen_q, varlen_k, 2)
        varlen_softmax_d = flash_attn._softmax_d_like(varlen_q, 2)
    # dq_accum fp32 [B, round(Lq, 128), H, round(D, 32)] = 4 * 768 * 24 * 128 * 4 = 37,748,736;
    # dk_expanded, dv_expanded [B, Lk, H, D] bf16 = 2 * 4 * 768 * 24 * 128 * 2 = 37,748,736
    assert workspace.untyped_storage().nbytes() == 37_748_736 + 37_748_736
    # softmax_d fp32 [B, H, round(Lq, 128)] = 4 * 24 * 768 * 4
    assert softmax_d.shape == (4, 24, 768) and softmax_d.untyped_storage().nbytes() == 294_912
    # mha_varlen_bwd: dq_accum fp32 [total_q + 128 B, H, D'], dk/dv_expanded [total_k, H, D]
    assert varlen_workspace.untyped_storage().nbytes() == (1268 + 256) * 24 * 128 * 4 + 2 * 1268 * 24 * 128 * 2
    # softmax_d fp32 [H, total_q + 128 B]
    assert varlen_softmax_d.shape == (24, 1268 + 256)


def test_split_kv_heuristic_follows_flash_api():
    # "batch * n_heads = 48 and we have 108 SMs, having 2 splits (efficiency = 0.89)" (flash_api.cpp's comment;
    # one m-block each, 216 "SMs" as mha_fwd passes num_sm * 2 for 128 threads a block)
    assert num_splits_heuristic(48, 108, 4, 128) == 2
    assert num_splits_heuristic(1152, 284, 6, 128) == 1  # the 3B at 4 x 768: enough blocks, no split


def test_refuses_what_flash_attn_refuses():
    q, k, v = qkv()
    with flash_attention_2_as_cuda((7, 5), "T4"), pytest.raises(RuntimeError, match="Ampere GPUs or newer"):
        flash_attn_func(q, k, v)
    with flash_attention_2_as_cuda((8, 0)), pytest.raises(RuntimeError, match="fp16 and bf16"):
        flash_attn_func(*(t.float() for t in (q, k, v)))


def test_transformers_state_restored_after_the_trace():
    from transformers import modeling_flash_attention_utils as utils

    before = (utils._lazy_imports, utils._get_unpad_data, getattr(utils, "_flash_fn", None))
    with flash_attention_2_as_cuda((8, 0), padding=3):
        assert utils._lazy_imports is not before[0]
    assert (utils._lazy_imports, utils._get_unpad_data, getattr(utils, "_flash_fn", None)) == before


def _real_saved_bytes(padding: int) -> int:
    return flash_forward_saved_bytes("flash_attention_2", padding, flash_attention_2_as_cuda((8, 9), "L40S", padding))[0]


def _planned_activations(padding: int) -> int:
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.step.trace import trace_step_once

    with torch.device("meta"):
        meta = LlamaForCausalLM(tiny_bf16_llama().config).to(torch.bfloat16)
    meta.config._attn_implementation = "flash_attention_2"
    settings = dataclasses.replace(resolve_settings(batch_size=2, optimizer="adamw_torch", padding=padding),
                                   device_type="cuda", seq_len=256, gpu="L40S")
    timeline = trace_step_once(meta, settings, args=None, step_dtype=torch.bfloat16)
    kernel = "flash_attn_varlen_func" if padding else "flash_attn_func"
    assert any(f"{kernel} (1 calls)" in note for note in timeline.notes), timeline.notes
    return timeline.activations_bytes


def test_unpadding_path_saves_what_a_real_run_of_it_saves():
    # transformers' _upad_input: the unpadded copies of q, k, v, the indices and cu_seqlens per layer, then
    # bert_padding's pad_input; the plan's padded step over its unpadded one equals a real CPU run's.
    real = _real_saved_bytes(4) - _real_saved_bytes(0)
    planned = _planned_activations(4) - _planned_activations(0)
    assert planned == real == 66_380


LLAMA_3B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 128, "tie_word_embeddings": True,
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


@pytest.mark.slow
def test_llama_3b_on_l40s_flash_attention_2_within_one_percent_of_sdpa(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3B))
    peaks, notes = {}, {}
    for attn in ("flash_attention_2", "sdpa"):
        run = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", str(tmp_path), "--dtype", "bfloat16",
                              "--batch-size", "4", "--seq-len", "768", "--gpu", "l40s", "--optimizers", "adamw_torch",
                              "--attn-implementation", attn, "--json"], capture_output=True, text=True, cwd=ROOT)
        assert run.returncode in (0, 3), run.stderr
        plan = json.loads(run.stdout)
        peaks[attn], notes[attn] = plan["step"]["peak_bytes"], plan["step"]["notes"]
    assert abs(peaks["flash_attention_2"] - peaks["sdpa"]) <= 0.01 * peaks["sdpa"]
    # SDPA on sm89 takes flash, saving what FA2 saves but the 16-byte rng_state of each of the 28 layers
    assert peaks["flash_attention_2"] - peaks["sdpa"] == 28 * 16
    assert any("flash_attn_func (28 calls)" in note for note in notes["flash_attention_2"])


def test_flash_attention_off_cuda_is_refused_before_anything_is_traced():
    # transformers would fetch a kernel from the hub for it; flash-attn's kernels run on CUDA alone.
    llama = str(ROOT / "tests" / "data" / "golden" / "tiny-llama")
    run = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", llama, "--batch-size", "2", "--seq-len", "16", "--attn-implementation", "flash_attention_2",
                          "--device-type", "cpu"], capture_output=True, text=True, cwd=ROOT)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == ("trainer-memcb: error: --attn-implementation 'flash_attention_2' runs on CUDA only "
                          "(flash-attn's kernels), not on cpu: give --device-type cuda, or sdpa or eager\n")


def test_one_row_is_planned_as_one_sequence(tmp_path):
    # At batch size 1 transformers' flash path asks whether the row packs several sequences
    # (`_is_packed_sequence`, a value read): the plan's unpacked row is one sequence, as a real one.
    # Before, the step ended untraced (aten._local_scalar_dense).
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
        "max_position_embeddings": 256}))
    steps = {}
    for attn in ("flash_attention_2", "sdpa"):
        run = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", str(tmp_path), "--batch-size", "1",
                              "--seq-len", "16", "--attn-implementation", attn, "--dtype", "bfloat16", "--gpu",
                              "a100-40gb", "--json"], capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        steps[attn] = json.loads(run.stdout)["step"]
    assert steps["flash_attention_2"]["problem"] is None
    assert any("flash_attn_func (2 calls)" in note for note in steps["flash_attention_2"]["notes"])
    # What SDPA's flash backend saves, and each layer's 16-byte rng_state beside it.
    assert steps["flash_attention_2"]["activations_bytes"] - steps["sdpa"]["activations_bytes"] == 2 * 16
