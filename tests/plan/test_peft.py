"""PEFT: LoRA with AdamW, and the QLoRA recipe (4-bit base, LoRA, paged 8-bit AdamW), in real Trainer
runs on a tiny Llama: the optimizer holds state for exactly the adapters and the head PEFT trains
in full, measured == estimate == the figure written out here, and `trainer-memcb estimate` with
the same LoRA options (or `--trainable`) gives the run's figure before any weight exists."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, Trainer

from helpers import entries_with, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main

peft = pytest.importorskip("peft")

VOCAB, HIDDEN, LAYERS, RANK = 128, 32, 2, 8
LORA_ARGV = ["--lora-r", str(RANK), "--lora-target-modules", "q_proj,v_proj", "--lora-modules-to-save", "lm_head"]


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def lora_config():
    return peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                           task_type="CAUSAL_LM")


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, size: int = 12) -> None:
        self.input_ids = torch.randint(0, VOCAB, (size, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


# What trains, written out: per layer q_proj and v_proj (32 -> 32) get lora_A (8, 32) and lora_B
# (32, 8); the lm_head copy (128, 32) trains in full.
ADAPTER_SHAPES = [(RANK, HIDDEN), (HIDDEN, RANK)] * 2 * LAYERS
HEAD_SHAPE = (VOCAB, HIDDEN)
TRAINABLE_SHAPES = ADAPTER_SHAPES + [HEAD_SHAPE]
# torch AdamW: two fp32 moments and a 4-byte step per tensor.
ADAMW_BYTES = sum(8 * math.prod(shape) + 4 for shape in TRAINABLE_SHAPES)
# bitsandbytes paged AdamW 8-bit: tensors under 4096 values (the adapters) keep two fp32 states;
# the head (4096 values) two uint8 states, an fp32 absmax per 256 values for each, and the two
# shared 256-value fp32 quantization maps.
PAGED_8BIT_BYTES = (sum(8 * math.prod(shape) for shape in ADAPTER_SHAPES)
                    + 2 * VOCAB * HIDDEN + 2 * 4 * (VOCAB * HIDDEN // 256) + 2 * 256 * 4)


def test_the_hand_written_figures():
    assert sum(math.prod(shape) for shape in TRAINABLE_SHAPES) == 2048 + 4096
    assert (ADAMW_BYTES, PAGED_8BIT_BYTES) == (49_188, 26_752)


def _run(model, output_dir, optim):
    callback = OptimizerMemoryCallback()
    trainer = Trainer(model=model, args=training_args(output_dir, optim=optim, max_steps=3, learning_rate=1e-3),
                      train_dataset=TokenDataset(), callbacks=[callback])
    trainer.train()
    logged = entries_with(trainer.state.log_history, "optimizer_state_bytes")
    with open(os.path.join(output_dir, "optimizer_memory.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    return trainer, logged, summary


def _trainable(model):
    return sorted((name, tuple(param.shape), param.dtype) for name, param in model.named_parameters()
                  if param.requires_grad)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    torch.manual_seed(0)
    model = peft.get_peft_model(LlamaForCausalLM(tiny_llama_config()), lora_config())
    return model, *_run(model, str(tmp_path_factory.mktemp("lora")), "adamw_torch")


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    # The QLoRA recipe: the base loaded in 4-bit NF4 (bitsandbytes quantizes on the CPU here),
    # prepared for k-bit training, LoRA on top, and the paged 8-bit AdamW.
    base_dir = str(tmp_path_factory.mktemp("base"))
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(base_dir)
    quantized = LlamaForCausalLM.from_pretrained(base_dir, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32), device_map="cpu")
    quantized = peft.prepare_model_for_kbit_training(quantized, use_gradient_checkpointing=False)
    model = peft.get_peft_model(quantized, lora_config())
    return model, *_run(model, str(tmp_path_factory.mktemp("qlora")), "paged_adamw_8bit")


def _check_run(model, trainer, logged, summary, expected_bytes):
    trainable = _trainable(model)
    assert len(trainable) == 9
    assert {dtype for _, _, dtype in trainable} == {torch.float32}
    assert sorted(shape for _, shape, _ in trainable) == sorted(TRAINABLE_SHAPES)
    assert sum(1 for name, _, _ in trainable if ".lora_" in name) == 8
    assert [name for name, _, _ in trainable if ".lora_" not in name] == [
        "base_model.model.lm_head.modules_to_save.default.weight"]
    assert len(logged) == 3
    for entry in logged:
        assert entry["optimizer_state_bytes"] == entry["optimizer_state_estimate_bytes"] == expected_bytes
        assert entry["optimizer_trainable_params"] == 6144
    # Only the trainable tensors have state: nothing for the frozen base.
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert len(optimizer.state) == 9
    assert summary["measured"]["num_bytes"] == expected_bytes


def test_lora_with_adamw_holds_state_for_exactly_the_adapters_and_head(lora_run):
    model, trainer, logged, summary = lora_run
    _check_run(model, trainer, logged, summary, ADAMW_BYTES)
    # The callback's what-if at train begin, over the PEFT model, says the same for adamw_torch.
    stated = {entry["name"]: entry["estimate"]["num_bytes"] for entry in summary["what_if"]["optimizers"]}
    assert stated["adamw_torch"] == ADAMW_BYTES
    assert summary["what_if"]["trainable_params"] == 6144


def test_qlora_4bit_base_with_paged_adamw_8bit_holds_state_for_exactly_the_adapters_and_head(qlora_run):
    model, trainer, logged, summary = qlora_run
    # The base really is 4-bit: packed uint8 weights in bitsandbytes' Linear4bit.
    import bitsandbytes

    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q_proj, bitsandbytes.nn.Linear4bit) and q_proj.weight.dtype == torch.uint8
    _check_run(model, trainer, logged, summary, PAGED_8BIT_BYTES)
    stated = {entry["name"]: entry["estimate"]["num_bytes"] for entry in summary["what_if"]["optimizers"]}
    assert stated["adamw_torch"] == ADAMW_BYTES


def _estimate(argv, capsys):
    capsys.readouterr()  # what a training run printed before
    assert main(argv + ["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    return document, {entry["name"]: entry["estimate"]["num_bytes"] for entry in document["optimizers"]}


def test_the_estimate_command_with_lora_options_gives_both_runs_figures(lora_run, qlora_run, tmp_path, capsys):
    config_dir = str(tmp_path / "tiny-llama")
    tiny_llama_config().save_pretrained(config_dir)
    document, figures = _estimate(["estimate", config_dir, *LORA_ARGV, "--optimizers", "adamw_torch,paged_adamw_8bit"],
                                  capsys)
    assert (document["trainable_params"], document["trainable_tensors"]) == (6144, 9)
    assert figures == {"adamw_torch": ADAMW_BYTES, "paged_adamw_8bit": PAGED_8BIT_BYTES}
    assert figures["adamw_torch"] == lora_run[2][-1]["optimizer_state_bytes"]
    assert figures["paged_adamw_8bit"] == qlora_run[2][-1]["optimizer_state_bytes"]
    # Over a bfloat16 base PEFT keeps the adapters in float32 but copies the head in bfloat16:
    # AdamW's moments follow each dtype, bitsandbytes' states do not.
    document, bf16 = _estimate(["estimate", config_dir, *LORA_ARGV, "--dtype", "bfloat16",
                                "--optimizers", "adamw_torch,paged_adamw_8bit"], capsys)
    assert document["trainable_dtypes"] == ["bfloat16", "float32"]
    adapters_fp32 = sum(8 * math.prod(shape) + 4 for shape in ADAPTER_SHAPES)
    head_bf16 = 4 * VOCAB * HIDDEN + 4
    assert bf16 == {"adamw_torch": adapters_fp32 + head_bf16, "paged_adamw_8bit": PAGED_8BIT_BYTES}
    assert adapters_fp32 + head_bf16 == 32_804
    # --trainable narrows PEFT's choice by name: only the lora_A matrices.
    document, only_a = _estimate(["estimate", config_dir, *LORA_ARGV, "--trainable", r"\.lora_A\.",
                                  "--optimizers", "adamw_torch"], capsys)
    assert (document["trainable_params"], only_a["adamw_torch"]) == (4 * RANK * HIDDEN, 8 * 4 * RANK * HIDDEN + 4 * 4)
    # It only narrows: the frozen base q_proj weights, whose names match too, stay frozen.
    document, q_only = _estimate(["estimate", config_dir, *LORA_ARGV, "--trainable", "q_proj",
                                  "--optimizers", "adamw_torch"], capsys)
    assert (document["trainable_params"], document["trainable_tensors"]) == (2 * 2 * RANK * HIDDEN, 4)


def test_the_estimate_command_with_trainable_gives_the_figure_of_a_run_that_freezes_the_rest(tmp_path, capsys):
    pattern = r"q_proj|v_proj|lm_head"
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    for name, param in model.named_parameters():
        param.requires_grad_(re.search(pattern, name) is not None)
    _, logged, _ = _run(model, str(tmp_path / "run"), "adamw_torch")
    # q_proj and v_proj weights (32, 32) in two layers and the head (128, 32): 8,192 values, 5 tensors.
    expected = 8 * (4 * HIDDEN * HIDDEN + VOCAB * HIDDEN) + 4 * 5
    assert expected == 65_556
    assert logged[-1]["optimizer_state_bytes"] == logged[-1]["optimizer_state_estimate_bytes"] == expected
    config_dir = str(tmp_path / "tiny-llama")
    tiny_llama_config().save_pretrained(config_dir)
    _, figures = _estimate(["estimate", config_dir, "--trainable", pattern, "--optimizers", "adamw_torch"], capsys)
    assert figures == {"adamw_torch": expected}


def test_lora_options_that_do_not_fit_give_a_message_and_exit_code(tmp_path, capsys):
    config_dir = str(tmp_path / "tiny-llama")
    tiny_llama_config().save_pretrained(config_dir)
    cases = [
        (["--lora-target-modules", "q_proj"], "--lora-target-modules and --lora-modules-to-save need --lora-r"),
        (["--lora-r", "0"], "argument --lora-r: '0' is not a positive integer"),
        (["--lora-r", "eight"], "argument --lora-r: 'eight' is not a positive integer"),
        (["--lora-r", "8", "--lora-target-modules", "nope_proj"],
         "PEFT cannot add LoRA adapters (r=8, target_modules='nope_proj', modules_to_save=None): Target modules"),
        (["--lora-r", "8", "--lora-target-modules", "q_proj("], "LoRA target_modules entry 'q_proj(' is not a regular"),
    ]
    for extra, phrase in cases:
        assert main(["estimate", config_dir, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert phrase in err and "Traceback" not in err, err


def test_the_readme_figures_for_llama_2_7b_with_rank_16_adapters(tmp_path, capsys):
    config_dir = str(tmp_path / "llama-2-7b")
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, architectures=["LlamaForCausalLM"]).save_pretrained(config_dir)
    document, figures = _estimate(["estimate", config_dir, "--dtype", "bfloat16", "--lora-r", "16",
                                   "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj",
                                   "--optimizers", "adamw_torch,paged_adamw_8bit,adafactor"], capsys)
    # 32 layers x 4 projections x (lora_A (16, 4096) + lora_B (4096, 16)), float32 whatever the base.
    values = 32 * 4 * 2 * 16 * 4096
    assert (document["trainable_params"], document["trainable_tensors"], document["trainable_dtypes"]) == (
        values, 256, ["float32"]) == (16_777_216, 256, ["float32"])
    assert figures["adamw_torch"] == 8 * values + 4 * 256 == 134_218_752
    # 65,536 values a tensor: 8-bit states, an fp32 absmax per 256 values each, two shared maps.
    assert figures["paged_adamw_8bit"] == 256 * (2 * 65_536 + 2 * 4 * 256) + 2 * 256 * 4 == 34_080_768
    # Adafactor: a row and a column factor per matrix and an fp32 RMS.
    assert figures["adafactor"] == 256 * (4 * (16 + 4096) + 4) == 4_211_712
