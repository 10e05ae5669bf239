"""QLoRA on a model of `Conv1D` layers (GPT-2): transformers loads them in 4-bit and 8-bit too
(`_replace_with_bnb_linear`, the weight transposed), so the plan quantizes them as it does."""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from helpers import requires_transformers
from trainer_memcb.plan.model.quantized import PlannedLinear4bit, Quantization, quantize_linear_layers
from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.step.trace import fake_copy

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
from transformers import BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel  # noqa: E402

pytestmark = requires_transformers("5.0", "loading in 4-bit on the CPU through transformers 5's quantizer")


def config() -> GPT2Config:
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)


def storages(tensors) -> Dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def test_gpt2s_conv1d_layers_are_loaded_in_4bit_as_transformers_loads_them(tmp_path) -> None:
    torch.manual_seed(0)
    GPT2LMHeadModel(config()).save_pretrained(tmp_path)
    real = GPT2LMHeadModel.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
                                           dtype=torch.float32, device_map="cpu")
    real_layers = [m for m in real.modules() if isinstance(m, bnb.nn.Linear4bit)]
    held = [t for layer in real_layers for t in (layer.weight.data, layer.weight.quant_state.absmax,
                                                  layer.weight.quant_state.code)]
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with torch.device("meta"):
        meta = GPT2LMHeadModel(config())
    fake = fake_copy(meta, mode)
    # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of the 2 blocks; the tied head stays.
    assert quantize_linear_layers(fake, mode, Quantization()) == len(real_layers) == 8
    planned = [m for m in fake.modules() if isinstance(m, PlannedLinear4bit)]
    assert [(m.in_features, m.out_features) for m in planned] == \
        [(m.in_features, m.out_features) for m in real_layers]
    tensors = [t for m in planned for t in [m.weight, *m.buffers()]]
    # 8 layers of 64 x 192, 64 x 64, 64 x 256, 256 x 64 values in 2 blocks: 49,152 packed bytes, and
    # an fp32 absmax per 64 values and a 16-value fp32 code per layer.
    assert sum(storages(tensors).values()) == sum(storages(held).values()) == 98304 // 2 + 98304 // 64 * 4 + 8 * 64


def test_a_gpt2_qlora_step_traces_its_base_in_4bit() -> None:
    from trainer_memcb.plan.model.lora import add_lora_adapters

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            model = GPT2LMHeadModel(config())
        return add_lora_adapters(model, 4, None)

    plan, _ = plan_step_memory(build, batch_size=2, seq_len=8, optimizer="adamw_torch", model_states=False,
                               device_type="cpu", quantization=Quantization())
    assert plan.step.problem is None
    assert any(note.startswith("8 linear layers loaded in 4-bit (nf4)") for note in plan.step.notes)
