"""`estimate --attn-implementation flash_attention_3`: planned on Hopper by flash-attn 3's stand-in
kernels (plan/step/flash_attn3.py), a packed row through its varlen kernel, and what FA3 refuses
said on one line. flash-attn 3 itself is not run (no GPU here, and it builds only with CUDA)."""

from __future__ import annotations

import json

import pytest

from helpers import run_estimate, tiny_llama_folder
from test_console_script import run_script

pytest.importorskip("transformers")

HOPPER_ONLY = "; it is planned on Hopper: give --gpu h100 or h200, or flash_attention_2, sdpa or eager\n"


@pytest.mark.parametrize("gpu,said", [
    (["--gpu", "a100-80gb"], "compute capability 8.0 (--gpu A100-80GB): flash-attn 3 runs its Ampere/Ada kernels "
                             "there (sm80 builds), whose tile sizes are not planned"),
    ([], "compute capability 8.0 (no --gpu: an sm80 GPU assumed): flash-attn 3 runs its Ampere/Ada kernels there "
         "(sm80 builds), whose tile sizes are not planned"),
])
def test_off_hopper_flash_attention_3_is_a_usage_error_before_any_trace(tmp_path_factory, gpu, said):
    folder = tiny_llama_folder(tmp_path_factory, "fa3-refused")
    run = run_script("estimate", folder, "--batch-size", "2", "--seq-len", "16", "--dtype", "bfloat16",
                     "--attn-implementation", "flash_attention_3", *gpu)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"trainer-memcb: error: --attn-implementation 'flash_attention_3' on {said}{HOPPER_ONLY}"


@pytest.mark.parametrize("gpu,said", [
    ("l40s", "compute capability 8.9 (--gpu L40S): flash-attn 3 runs its Ampere/Ada kernels there (sm80 builds), "
             "whose tile sizes are not planned"),
    ("t4", "compute capability 7.5 (--gpu T4): flash-attn 3 refuses it (\"FlashAttention only supports Ampere GPUs "
           "or newer.\", flash_api.cpp)"),
])
def test_each_gpu_off_hopper_says_why(tmp_path_factory, capsys, gpu, said):
    folder = tiny_llama_folder(tmp_path_factory, "fa3-refused-why")
    code, out, err = run_estimate([folder, "--batch-size", "2", "--seq-len", "16", "--dtype", "bfloat16", "--gpu", gpu,
                                   "--attn-implementation", "flash_attention_3"], capsys)
    assert (code, out) == (2, "")
    assert err == f"trainer-memcb: error: --attn-implementation 'flash_attention_3' on {said}{HOPPER_ONLY}"


def test_what_the_kernel_refuses_is_said_in_the_plan(tmp_path_factory, capsys):
    # A head dimension of 20: flash-attn 2 pads it to 24 and runs, flash-attn 3 refuses it (mha_fwd,
    # "head_size should be a multiple of 8"); float32 neither takes.
    folder = tiny_llama_folder(tmp_path_factory, "fa3-head-dim", head_dim=20)
    argv = [folder, "--batch-size", "2", "--seq-len", "16", "--gpu", "h100", "--json"]
    code, out, _ = run_estimate(argv + ["--dtype", "bfloat16", "--attn-implementation", "flash_attention_3"], capsys)
    assert code == 5 and "head_size should be a multiple of 8" in json.loads(out)["step"]["problem"]
    code, out, _ = run_estimate(argv + ["--dtype", "bfloat16", "--attn-implementation", "flash_attention_2"], capsys)
    assert code == 0 and json.loads(out)["step"]["problem"] is None
    code, out, _ = run_estimate(argv + ["--dtype", "float32", "--attn-implementation", "flash_attention_3"], capsys)
    assert code == 5 and "fp16, bf16, and fp8_e4m3" in json.loads(out)["step"]["problem"]


def _packed_step(folder: str, attention: str, capsys) -> dict:
    code, out, err = run_estimate([folder, "--batch-size", "1", "--seq-len", "16", "--packing", "40",
                                   "--dtype", "bfloat16", "--gpu", "h100", "--attn-implementation", attention,
                                   "--json"], capsys)
    assert code == 0, err
    return json.loads(out)["step"]


@pytest.mark.parametrize("heads_k", [4, 2])
def test_a_packed_row_runs_the_varlen_kernel(tmp_path_factory, capsys, heads_k):
    folder = tiny_llama_folder(tmp_path_factory, "fa3-packed", num_key_value_heads=heads_k)
    fa3, fa2 = (_packed_step(folder, attention, capsys) for attention in ("flash_attention_3", "flash_attention_2"))
    # The collator's cu_seq_lens and max_length (3 sequences: 16, 16, 8) go to flash_attn_varlen_func in each layer.
    assert any("flash_attn_varlen_func (2 calls)" in note and "flash-attn 3.0.0" in note for note in fa3["notes"])
    # FlashAttnVarlenFunc saves q, k, v, out, softmax_lse [H, 40] and the two cu_seqlens in both releases;
    # flash-attn 2 its rng_state too: int64 [2], 16 bytes a layer.
    assert fa2["activations_bytes"] - fa3["activations_bytes"] == 2 * 16
