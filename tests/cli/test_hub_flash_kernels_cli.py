"""`estimate --attn-implementation kernels-community/flash-attn2`: a hub kernel of flash-attn 2's planned by
its stand-ins and said so in the plan's notes; other hub kernels refused in one line naming those planned.
The hub and the `kernels` package are not reached (offline; the kernels are CUDA builds)."""

from __future__ import annotations

import json

import pytest

from helpers import one_line, run_estimate, tiny_llama_folder

pytest.importorskip("transformers")


def test_an_unplanned_hub_kernel_is_refused_naming_those_planned(tmp_path_factory, capsys):
    folder = tiny_llama_folder(tmp_path_factory, "hub-refused")
    code, out, err = run_estimate([folder, "--batch-size", "2", "--seq-len", "16", "--gpu", "h100", "--dtype", "bfloat16",
                                   "--attn-implementation", "kernels-community/vllm-flash-attn3"], capsys)
    assert (code, out) == (2, "")
    assert one_line(err) == ("trainer-memcb: error: --attn-implementation 'kernels-community/vllm-flash-attn3': the hub "
                             "kernel kernels-community/vllm-flash-attn3 is not planned; the hub kernels planned are "
                             "kernels-community/flash-attn2, kernels-community/flash-attn (flash-attn 2's kernels)")


def test_a_hub_flash_kernel_runs_on_cuda_only(tmp_path_factory, capsys):
    folder = tiny_llama_folder(tmp_path_factory, "hub-cpu")
    code, _, err = run_estimate([folder, "--batch-size", "2", "--seq-len", "16", "--device-type", "cpu",
                                 "--attn-implementation", "kernels-community/flash-attn2"], capsys)
    assert code == 2 and "runs on CUDA only (flash-attn's kernels), not on cpu" in one_line(err)


def test_a_packed_row_runs_the_hub_kernels_varlen_function(tmp_path_factory, capsys):
    folder = tiny_llama_folder(tmp_path_factory, "hub-packed", num_key_value_heads=2)
    steps = {}
    for attention in ("kernels-community/flash-attn2@v4", "flash_attention_2"):
        code, out, err = run_estimate([folder, "--batch-size", "1", "--seq-len", "16", "--packing", "40", "--dtype",
                                       "bfloat16", "--gpu", "h100", "--attn-implementation", attention, "--json"], capsys)
        assert code == 0, err
        steps[attention] = json.loads(out)["step"]
    hub = steps["kernels-community/flash-attn2@v4"]
    assert any("kernels-community/flash-attn2@v4 runs it, the hub's build of flash-attn 2's kernels" in note
               and "flash_attn_varlen_func (2 calls)" in note for note in hub["notes"]), hub["notes"]
    # The same kernels and the collator's boundaries: what FA2 saves, to the byte.
    assert hub["activations_bytes"] == steps["flash_attention_2"]["activations_bytes"]
