"""QLoRA in the step plan, against a real bitsandbytes 4-bit and 8-bit model on the CPU.

The real model: a tiny Llama's weights saved and loaded with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`
or `BitsAndBytesConfig(load_in_8bit=True)` (bitsandbytes runs both on the CPU: 8-bit training
through `MatMul8bitFp`), LoRA adapters on q_proj and v_proj. The plan builds the same config on
the meta device and loads its linear layers in 4-bit or 8-bit under fake tensors
(`trainer_memcb.plan.model.quantized`).
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from helpers import independent_saved_bytes, requires_transformers, tiny_llama_config
from trainer_memcb.plan.model.quantized import PlannedLinear4bit, PlannedLinear8bit, Quantization, quantize_linear_layers
from trainer_memcb.plan.step.trace import fake_copy
from trainer_memcb.plan.answers.step_memory import plan_step_memory

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = requires_transformers("5.0", "loading in 4-bit on the CPU through transformers 5's quantizer")

B, S = 2, 16
TARGETS = ["q_proj", "v_proj"]


def config() -> LlamaConfig:
    return tiny_llama_config("eager")


def real_qlora(folder: str, double_quant: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    LlamaForCausalLM(config()).save_pretrained(folder)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.float32,
                                             device_map="cpu", attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS))
    model.config.use_cache = False  # as the Trainer sets it
    return model.train()


def build() -> torch.nn.Module:
    from trainer_memcb.plan.model.lora import add_lora_adapters

    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    return add_lora_adapters(model, 4, TARGETS)


def storages(tensors) -> Dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_4bit_base_weights_are_counted_as_bitsandbytes_stores_them(tmp_path, double_quant: bool) -> None:
    real = real_qlora(str(tmp_path), double_quant)
    real_layers = [m for m in real.modules() if isinstance(m, bnb.nn.Linear4bit)]
    held = []
    for layer in real_layers:
        state = layer.weight.quant_state
        held += [layer.weight.data, state.absmax, state.code]
        if double_quant:
            held += [state.offset, state.state2.absmax, state.state2.code]
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = fake_copy(build(), mode)
    assert quantize_linear_layers(fake, mode, Quantization(double_quant=double_quant)) == len(real_layers) == 14
    planned = [t for m in fake.modules() if isinstance(m, PlannedLinear4bit) for t in [m.weight, *m.buffers()]]
    # Packed values (N/2 uint8) and the absmax per 64 values: fp32, or uint8 plus the nested absmax,
    # offset and dynamic map with double quantization; 16 fp32 for the code. Measured: 57,584 bytes
    # in 84 storages with double quantization, 46,976 bytes in 42 without.
    assert sum(storages(planned).values()) == sum(storages(held).values()) == (57584 if double_quant else 46976)
    assert len(storages(planned)) == len(storages(held))


def test_a_qlora_steps_activations_equal_a_real_4bit_models(tmp_path) -> None:
    model = real_qlora(str(tmp_path), True)
    ids = torch.randint(0, 128, (B, S))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
              "num_items_in_batch": torch.tensor(float(ids.numel()))}
    real = independent_saved_bytes(model, inputs)
    plan, _ = plan_step_memory(build, batch_size=B, seq_len=S, optimizer="adamw_torch", model_states=False, device_type="cpu",
                               quantization=Quantization(double_quant=True))
    assert plan.step.problem is None
    assert plan.step.activations_bytes == real == 226056
    # The frozen base's packed weights are parameters (uint8: no gradient, no state); the adapters'
    # AdamW state: 2,048 fp32 values, twice, plus a step per tensor.
    assert plan.step.peak_parts["optimizer_state"] == 2 * 2048 * 4 + 8 * 4


def test_quantization_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^quant_type='int4' is not one of: nf4, fp4$"):
        Quantization(quant_type="int4")
    with pytest.raises(ValueError, match=r"^bits=3 is not one of: 4, 8$"):
        Quantization(bits=3)
    with pytest.raises(ValueError, match=r"^threshold=-1.0: expected a number of at least 0$"):
        Quantization(bits=8, threshold=-1.0)


def test_a_qlora_steps_peak_against_the_profilers_live_bytes(tmp_path) -> None:
    from helpers import training_args
    from test_step_families import profiled_peak

    model = real_qlora(str(tmp_path), True)
    trainer = transformers.Trainer(model=model, args=training_args(str(tmp_path / "out"), optim="adamw_torch"))
    trainer.create_optimizer()
    model.train()
    ids = torch.randint(0, 128, (B, S))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
              "num_items_in_batch": torch.tensor(float(ids.numel()))}
    # The quantization state is neither a parameter nor a buffer of the real model: alive all along.
    state = []
    for layer in (m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)):
        quant = layer.weight.quant_state
        state += [quant.absmax, quant.code, quant.offset, quant.state2.absmax, quant.state2.code]
    real = profiled_peak(trainer, inputs) + sum(storages(state).values())
    plan, _ = plan_step_memory(build, batch_size=B, seq_len=S, optimizer="adamw_torch", model_states=False, device_type="cpu",
                               quantization=Quantization(double_quant=True))
    # Measured: 427,140 real, 408,412 planned (18,728 bytes, 4.4%, in the backward). bitsandbytes'
    # CPU dequantization (backends/default/ops.py, `_dequantize_4bit_compute`) makes int32 codes
    # and an fp32 lookup of the whole layer before its output: scratch inside the kernel, which
    # the fake kernel (making the output only) and CUDA's kernel (writing the output directly) do
    # not allocate; at most 8 bytes per value of the largest layer (8,192 values here).
    assert plan.step.peak_phase == "backward"
    assert 0 < real - plan.step.peak_bytes <= 8 * 8192
    # And the plan says so, in its note.
    [note] = [note for note in plan.step.notes if "loaded in 4-bit" in note]
    assert note.endswith("which the trace cannot see: up to 8 bytes per value of the largest 4-bit layer, not counted")


# -- 8-bit (LLM.int8) ---------------------------------------------------------------------------------


def real_8bit(folder: str) -> torch.nn.Module:
    torch.manual_seed(0)
    LlamaForCausalLM(config()).save_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                             dtype=torch.float32, device_map="cpu", attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS))
    model.config.use_cache = False  # as the Trainer sets it
    return model.train()


def collated() -> Dict[str, torch.Tensor]:
    """A causal LM collator's batch: the labels a copy of the input ids, not the same tensor."""
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
            "num_items_in_batch": torch.tensor(float(ids.numel()))}


def plan_8bit(device_type: str = "cpu") -> object:
    plan, _ = plan_step_memory(build, batch_size=B, seq_len=S, optimizer="adamw_torch", model_states=False,
                               device_type=device_type, quantization=Quantization(bits=8))
    assert plan.step.problem is None, plan.step.problem
    return plan


def test_the_8bit_base_weights_are_counted_as_bitsandbytes_stores_them(tmp_path) -> None:
    real = real_8bit(str(tmp_path))
    layers = [m for m in real.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    # Int8Params: the int8 codes (the weight's data) and SCB, one fp32 scale per output row.
    held = [t for layer in layers for t in (layer.weight.data, layer.weight.SCB)]
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = fake_copy(build(), mode)
    assert quantize_linear_layers(fake, mode, Quantization(bits=8), "cpu") == len(layers) == 14
    planned = [t for m in fake.modules() if isinstance(m, PlannedLinear8bit) for t in [m.weight, *m.buffers()]]
    assert all(m.weight.dtype == torch.int8 and m.SCB.dtype == torch.float32
               for m in fake.modules() if isinstance(m, PlannedLinear8bit))
    # Measured: 81,920 int8 codes plus 1,152 fp32 scales, 86,528 bytes in 28 storages.
    assert sum(storages(planned).values()) == sum(storages(held).values()) == 81920 + 4 * 1152 == 86528
    assert len(storages(planned)) == len(storages(held)) == 28


def test_an_8bit_steps_activations_and_peak_equal_a_real_8bit_models(tmp_path) -> None:
    from helpers import training_args
    from test_step_families import profiled_peak

    plan = plan_8bit("cpu")
    assert any("8-bit (LLM.int8)" in note and "MatMul8bitFp" in note for note in plan.step.notes)
    model = real_8bit(str(tmp_path / "a"))
    # The layers' inputs that MatMul8bitFp keeps for backward are `ctx.A`, not saved tensors: in
    # neither figure, as in the 4-bit case (the same 226,056 bytes).
    assert plan.step.activations_bytes == independent_saved_bytes(model, collated()) == 226056
    model = real_8bit(str(tmp_path / "b"))
    trainer = transformers.Trainer(model=model, args=training_args(str(tmp_path / "out"), optim="adamw_torch"))
    trainer.create_optimizer()
    model.train()
    inputs = collated()
    peak = profiled_peak(trainer, inputs)
    # The row scales are neither parameters nor buffers of the real model (the layer's
    # `state.SCB` after its first forward): alive all along.
    scales = [m.state.SCB for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    real = peak + sum(storages(scales).values())
    # Measured: 502,940 real, 502,892 planned (48 bytes: 0-dim scalars C++ makes outside the
    # dispatcher, as in every family row), at the loss's backward.
    assert plan.step.peak_phase == "backward"
    assert abs(real - plan.step.peak_bytes) <= 64
    # The adapters' AdamW state, as in 4-bit; the int8 codes have no gradient and no state.
    assert plan.step.peak_parts["optimizer_state"] == 2 * 2048 * 4 + 8 * 4


def test_an_8bit_step_on_cuda_is_traced_with_its_outliers_planned_as_none() -> None:
    plan = plan_8bit("cuda")
    note = next(note for note in plan.step.notes if "8-bit (LLM.int8)" in note)
    assert "MatMul8bitLt with the outlier columns (llm_int8_threshold 6) planned as none" in note
    # The layers' inputs are kept as context attributes there too: the same saved-for-backward bytes.
    assert plan.step.activations_bytes == 226056
