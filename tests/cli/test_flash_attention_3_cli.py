"""`estimate --attn-implementation flash_attention_3`: planned on Ampere, Ada and Hopper by flash-attn
3's stand-in kernels (plan/step/flash_attn3.py) with each one's backward tile sizes, a packed row
through its varlen kernel, and what FA3 refuses said on one line. flash-attn 3 itself is not run (no
GPU here, and it builds only with CUDA)."""

from __future__ import annotations

import json

import pytest

from helpers import run_estimate, tiny_llama_folder
from test_console_script import run_script

transformers = pytest.importorskip("transformers")

PLANNED_ON = ("; it is planned on Ampere, Ada and Hopper (compute capability 8.x and 9.0): give the --gpu of one "
              "(a100-80gb, a10g, l40s, h100, ...), or flash_attention_2, sdpa or eager\n")


@pytest.mark.parametrize("gpu,said", [
    ("t4", "compute capability 7.5 (--gpu T4): flash-attn 3 refuses it (\"FlashAttention only supports Ampere GPUs "
           "or newer.\", flash_api.cpp)"),
    ("v100-32gb", "compute capability 7.0 (--gpu V100-32GB): flash-attn 3 refuses it (\"FlashAttention only supports "
                  "Ampere GPUs or newer.\", flash_api.cpp)"),
])
def test_a_gpu_before_ampere_is_a_usage_error_before_any_trace(tmp_path_factory, capsys, gpu, said):
    folder = tiny_llama_folder(tmp_path_factory, "fa3-refused-why")
    code, out, err = run_estimate([folder, "--batch-size", "2", "--seq-len", "16", "--dtype", "bfloat16", "--gpu", gpu,
                                   "--attn-implementation", "flash_attention_3"], capsys)
    assert (code, out) == (2, "")
    assert err == f"trainer-memcb: error: --attn-implementation 'flash_attention_3' on {said}{PLANNED_ON}"


def test_the_console_script_says_the_refusal_on_one_line(tmp_path_factory):
    folder = tiny_llama_folder(tmp_path_factory, "fa3-refused")
    run = run_script("estimate", folder, "--batch-size", "2", "--seq-len", "16", "--dtype", "bfloat16",
                     "--attn-implementation", "flash_attention_3", "--gpu", "t4")
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == ("trainer-memcb: error: --attn-implementation 'flash_attention_3' on compute capability 7.5 "
                          "(--gpu T4): flash-attn 3 refuses it (\"FlashAttention only supports Ampere GPUs or newer.\", "
                          f"flash_api.cpp){PLANNED_ON}")


# The plan's peak on an A100 on the newest releases; transformers 4.57 holds 128 bytes fewer, its rotary
# `original_inv_freq` (64 elements here) being `inv_freq` itself where transformers 5 copies it to a buffer.
A100_PEAK = 71_070_972 if int(transformers.__version__.split(".")[0]) >= 5 else 71_070_972 - 128


def _grouped_step(folder: str, capsys, *gpu: str) -> dict:
    code, out, err = run_estimate([folder, "--batch-size", "2", "--seq-len", "200", "--dtype", "bfloat16",
                                   "--attn-implementation", "flash_attention_3", *gpu, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)["step"]


def test_ampere_and_ada_are_planned_with_their_backward_tile_sizes(tmp_path_factory, capsys):
    # One layer of 32 query heads and 2 key/value heads of 128, B=2, L=200, bf16: the step's peak is in the
    # attention's backward, where mha_bwd holds dk_accum and dv_accum fp32 [2, 2, 200↑kBlockN · 128].
    folder = tiny_llama_folder(tmp_path_factory, "fa3-ampere", hidden_size=512, intermediate_size=1024,
                               num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                               max_position_embeddings=256)
    steps = {gpu: _grouped_step(folder, capsys, "--gpu", gpu) for gpu in ("a100-80gb", "a10g", "l40s", "h100")}
    assert steps["a100-80gb"]["peak_bytes"] == A100_PEAK
    assert any("Ampere/Ada kernels of its sm80 build, with sm80 tile sizes" in note and "flash_attn_func (1 calls)" in note
               for note in steps["a100-80gb"]["notes"])
    assert any("with sm86 tile sizes" in note for note in steps["l40s"]["notes"])
    # kBlockN: 128 on sm80 (and sm90, causal), 96 on sm86 and on Ada (8.9, the sm86 tile sizes): 200 rounds to 256
    # or to 288 keys, 2 * (2 * 2 * 32 * 128 * 4) = 131,072 bytes more on the A10G and the L40S.
    assert steps["a10g"]["peak_bytes"] - steps["a100-80gb"]["peak_bytes"] == 2 * (2 * 2 * 32 * 128 * 4) == 131_072
    assert steps["l40s"]["peak_bytes"] == steps["a10g"]["peak_bytes"]
    assert steps["h100"]["peak_bytes"] == steps["a100-80gb"]["peak_bytes"]
    # No --gpu: the sm80 GPU a plan assumes, planned as the A100.
    assert _grouped_step(folder, capsys)["peak_bytes"] == A100_PEAK


def test_an_ampere_plan_through_the_console_script(tmp_path_factory):
    """The installed `trainer-memcb`: the same A100 peak as through `main()` above."""
    folder = tiny_llama_folder(tmp_path_factory, "fa3-ampere-script", hidden_size=512, intermediate_size=1024,
                               num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                               max_position_embeddings=256)
    run = run_script("estimate", folder, "--batch-size", "2", "--seq-len", "200", "--dtype", "bfloat16",
                     "--attn-implementation", "flash_attention_3", "--gpu", "a100-80gb", "--json")
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    assert json.loads(run.stdout)["step"]["peak_bytes"] == A100_PEAK


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
