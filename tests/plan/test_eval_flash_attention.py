"""An evaluation plan with a flash attention implementation (plan/step/eval_forward.py): the forward
runs flash-attn's stand-in kernels without a gradient, so nothing is saved: each layer's output,
float32 logsumexp and (flash-attn 2) rng_state are made, and all but the output freed as the call
returns. Before, the forward reached transformers' hub fallback for flash_attention_2 and the plan
ended untraced (exit 5)."""

from __future__ import annotations

import json
import pathlib
from collections import Counter
from typing import Any, Dict

import pytest
import torch

from trainer_memcb.cli import main
from trainer_memcb.plan.step.eval_forward import trace_eval_forward

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_LLAMA = str(ROOT / "tests" / "data" / "golden" / "tiny-llama")  # 2 layers, 2 heads of 16
LAYERS, HEADS, BATCH, SEQ = 2, 2, 4, 16
FLASH = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2")


def _evaluation(attn: str, capsys: Any) -> Dict[str, Any]:
    argv = ["estimate", TINY_LLAMA, "--batch-size", "2", "--seq-len", str(SEQ), "--dtype", "bfloat16", "--gpu", "h100",
            "--attn-implementation", attn, "--eval-samples", "8", "--eval-batch-size", str(BATCH), "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["answers"]["evaluation"]


def test_flash_evaluations_plan_what_sdpa_plans(capsys: Any) -> None:
    sdpa = _evaluation("sdpa", capsys)
    assert sdpa["problem"] is None
    for attn in FLASH:
        flash = _evaluation(attn, capsys)
        assert flash["problem"] is None, (attn, flash["problem"])
        # The forward's peak is at the LM head, after every layer's attention: nothing of the
        # kernels outlives its call (a kept output, logsumexp or rng_state per layer would show).
        for key in ("forward_peak_bytes", "device_peak_bytes", "reserved_peak_bytes", "concat_peak_bytes"):
            assert flash[key] == sdpa[key], (attn, key)


def _storages(attn: str) -> Counter:
    """The storages the forward made, counted by (bytes, whether the forward freed it); empty ones left out."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(TINY_LLAMA)).to(torch.bfloat16)
    model.config._attn_implementation = attn
    forward = trace_eval_forward(model, BATCH, SEQ, False, device_type="cuda", compute_capability=(9, 0), gpu="H100")
    freed = {~event for event in forward.events if event < 0}
    return Counter((forward.sizes[event], event in freed) for event in forward.events
                   if event >= 0 and forward.sizes[event])


def test_each_kernel_frees_all_but_its_output_as_sdpa_does() -> None:
    # SDPA on sm90 takes cuDNN, run as the CPU flash kernel: the output and a float32 logsumexp
    # [B, H, Lq] (512 bytes here), what mha_fwd allocates for both flash-attns.
    sdpa = _storages("sdpa")
    assert sdpa[(BATCH * HEADS * SEQ * 4, True)] >= LAYERS
    fa2, fa3 = _storages("flash_attention_2"), _storages("flash_attention_3")
    # Beside them flash-attn 2's mha_fwd (csrc/flash_attn/flash_api.cpp) allocates rng_state, int64 [2]
    # even without dropout; freed as the call returns, since without a gradient nothing is saved.
    assert fa2 - sdpa == Counter({(2 * 8, True): LAYERS}) and not sdpa - fa2
    # flash-attn 3's (hopper/flash_api.cpp) the causal scheduler's int32 tile_count_semaphore of
    # 1 + round(B, 4) * 2 elements (the sorted batches and the head swizzle), freed when mha_fwd returns.
    assert fa3 - sdpa == Counter({((1 + 4 * 2) * 4, True): LAYERS}) and not sdpa - fa3
