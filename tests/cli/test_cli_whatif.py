"""`trainer-memcb estimate`: the what-if on the meta device, and the callback's what-if at train
begin. Every figure is computed here from the shapes alone, independently of the rules."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, Trainer

from helpers import TinyDataset, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.cli import main
from trainer_memcb.plan.optimizers.whatif import build_meta_model, resolve_optimizer_names, select_trainable, what_if

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1024**3

# Llama-2-7B: hidden 4096, intermediate 11008, 32 layers of 32 heads, vocabulary 32000, untied head.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB = 4096, 11008, 32, 32, 32000


def llama_7b_shapes():
    """Every parameter of LlamaForCausalLM at the 7B size, by name, written out by hand."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{prefix}mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{prefix}mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{prefix}mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{prefix}input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def adamw_bytes(shapes, element_size=4):
    # torch AdamW: exp_avg and exp_avg_sq in the parameter's dtype, a 4-byte step per tensor.
    return sum(2 * math.prod(shape) * element_size + 4 for shape in shapes)


def adafactor_bytes(shapes):
    # transformers Adafactor (the Trainer's: beta1=None), fp32 whatever the parameter's dtype:
    # a row and a column factor for matrices, a full second moment for vectors, and RMS.
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            total += 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) + 4
        else:
            total += 4 * math.prod(shape) + 4
    return total


def bnb_8bit_trainer_bytes(named_shapes, embedding_names):
    # bitsandbytes AdamW with optim_bits=8 as the Trainer builds it: nn.Embedding weights and
    # tensors under 4096 values in fp32 (8 bytes a value), the rest uint8 states plus one fp32
    # absmax per 256 values for each of the two states, and two shared 256-value fp32 maps, which
    # an 8-bit optimizer makes at construction (Optimizer8bit.fill_qmap) even when no tensor is 8-bit.
    total = 0
    for name, shape in named_shapes.items():
        numel = math.prod(shape)
        if name in embedding_names or numel < 4096:
            total += 8 * numel
        else:
            total += 2 * numel + 2 * 4 * math.ceil(numel / 256)
    return total + 2 * 256 * 4


@pytest.fixture(scope="module")
def llama_7b_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-2-7b")
    LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, vocab_size=VOCAB, architectures=["LlamaForCausalLM"],
    ).save_pretrained(str(folder))
    return str(folder)


def test_the_hand_written_shapes_are_llama_2_7b():
    shapes = llama_7b_shapes()
    assert sum(math.prod(shape) for shape in shapes.values()) == 6_738_415_616
    assert len(shapes) == 291


@pytest.mark.slow  # a 7B plan in a subprocess: half a minute here
def test_estimate_command_on_a_7b_llama_config_takes_no_real_memory(llama_7b_dir, tmp_path):
    # The command as a user runs it, in a process of its own, waited for with os.wait4 to read
    # that one child's peak resident memory.
    with open(tmp_path / "stderr.txt", "w+b") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer_memcb", "estimate", llama_7b_dir,
             "--optimizers", "adamw,adafactor,adamw_8bit", "--json"],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        stdout = process.stdout.read()
        process.stdout.close()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        assert process.returncode == 0, stderr.read().decode()
    document = json.loads(stdout)

    shapes = llama_7b_shapes()
    assert document["total_params"] == document["trainable_params"] == 6_738_415_616
    assert document["trainable_tensors"] == 291
    assert document["trainable_dtypes"] == ["float32"]
    assert document["trainable_bytes"] == 4 * 6_738_415_616
    by_name = {entry["name"]: entry for entry in document["optimizers"]}
    assert list(by_name) == ["adamw_torch", "adafactor", "adamw_8bit"]
    assert by_name["adamw_torch"]["estimate"]["num_bytes"] == adamw_bytes(shapes.values()) == 53_907_326_092
    assert by_name["adamw_torch"]["estimate"]["num_bytes"] == 8 * 6_738_415_616 + 4 * 291
    assert by_name["adafactor"]["estimate"]["num_bytes"] == adafactor_bytes(shapes.values()) == 11_349_132
    assert by_name["adamw_8bit"]["estimate"]["num_bytes"] == bnb_8bit_trainer_bytes(
        shapes, {"model.embed_tokens.weight"}) == 14_469_744_768
    assert by_name["adamw_8bit"]["optimizer_class"] == "bitsandbytes.optim.adamw.AdamW"

    # fp32 weights alone would take 25 GiB; the whole process, Python and torch included, stays
    # under 2 GiB.
    peak_bytes = usage.ru_maxrss * 1024  # Linux reports KiB
    assert 4 * 6_738_415_616 > 12 * GiB > 2 * GiB > peak_bytes


def test_what_if_in_bfloat16_with_only_q_and_v_training(llama_7b_dir):
    model = build_meta_model(llama_7b_dir, torch.bfloat16)
    assert select_trainable(model, r"q_proj|v_proj") == 64
    assert all(param.device.type == "meta" for param in model.parameters())
    result = what_if(model, "adamw,adafactor,adamw_8bit,adamw_torch_8bit")
    trained = {name: shape for name, shape in llama_7b_shapes().items() if re.search(r"q_proj|v_proj", name)}
    numel = 64 * HIDDEN * HIDDEN
    assert (result.total_params, result.trainable_params, result.trainable_tensors) == (6_738_415_616, numel, 64)
    assert result.trainable_dtypes == ("bfloat16",)
    assert result.trainable_bytes == 2 * numel
    estimates = {entry.name: entry.estimate.num_bytes for entry in result.optimizers}
    # bf16 AdamW keeps bf16 moments; Adafactor and bitsandbytes keep fp32 or uint8 whatever the dtype.
    assert estimates["adamw_torch"] == adamw_bytes(trained.values(), element_size=2) == 4 * numel + 4 * 64
    assert estimates["adafactor"] == adafactor_bytes(trained.values())
    assert estimates["adamw_8bit"] == bnb_8bit_trainer_bytes(trained, set())
    # torchao AdamW8bit: per buffer uint8 codes, an fp32 scale per 256 values and its own
    # 256-value fp32 map; a 0-dim fp32 step.
    assert estimates["adamw_torch_8bit"] == 64 * (4 + 2 * (HIDDEN * HIDDEN + 4 * HIDDEN * HIDDEN // 256 + 4 * 256))


def test_estimate_command_builds_the_architecture_asked_for(capsys):
    # The lesson's model: distilbert-base-cased's shipped config as a 2-label classifier. AdamW
    # holds 65,783,042 x 2 fp32 moments + 104 four-byte steps, as measured in a real run.
    config_dir = os.path.join(REPO_ROOT, "examples", "models", "distilbert-base-cased")
    assert main(["estimate", config_dir, "--architecture", "DistilBertForSequenceClassification",
                 "--optimizers", "adamw", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["trainable_params"], document["trainable_tensors"]) == (65_783_042, 104)
    assert document["optimizers"][0]["estimate"]["num_bytes"] == 65_783_042 * 8 + 104 * 4 == 526_264_752


def test_the_callback_states_the_what_if_once_in_its_logger_and_summary(tmp_path, caplog):
    model = tiny_classifier()
    named = {name: tuple(param.shape) for name, param in model.named_parameters()}
    embeddings = {name for name in named if name.endswith(("word_embeddings.weight", "position_embeddings.weight"))}
    callback = OptimizerMemoryCallback()
    trainer = Trainer(model=model, args=training_args(str(tmp_path), max_steps=2), train_dataset=TinyDataset(8),
                      callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="trainer_memcb.training.callback"):
        trainer.train()
    with open(os.path.join(str(tmp_path), "optimizer_memory.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    stated = summary["what_if"]
    assert stated["trainable_params"] == sum(math.prod(shape) for shape in named.values())
    by_name = {entry["name"]: entry["estimate"]["num_bytes"] for entry in stated["optimizers"]}
    assert by_name == {
        "adamw_torch": adamw_bytes(named.values()),
        "adafactor": adafactor_bytes(named.values()),
        "adamw_bnb_8bit": bnb_8bit_trainer_bytes(named, embeddings),
    }
    logged = [record.getMessage() for record in caplog.records if "what-if" in record.getMessage()]
    assert len(logged) == 1
    for name, num_bytes in by_name.items():
        assert re.search(rf"^  {name} +[0-9.]+ KiB  \({num_bytes:,} bytes\)$", logged[0], re.MULTILINE), logged[0]
    # The run's own optimizer is the Trainer's default AdamW: the what-if says what it then holds.
    assert summary["measured"]["num_bytes"] == by_name["adamw_torch"]
    # The model is left as it was: no state, no gradient, no new parameter.
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == named


def test_the_callback_refuses_an_unknown_what_if_optimizer_and_can_state_none(tmp_path):
    with pytest.raises(ValueError, match=r"what_if='adamw9' is not one of \[.*'adafactor'.*'adamw_torch'"):
        OptimizerMemoryCallback(what_if=("adamw9",))
    callback = OptimizerMemoryCallback(what_if=())
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path), max_steps=1),
                      train_dataset=TinyDataset(4), callbacks=[callback])
    trainer.train()
    with open(os.path.join(str(tmp_path), "optimizer_memory.json"), encoding="utf-8") as handle:
        assert "what_if" not in json.load(handle)


def test_optimizer_names_resolve_aliases_and_refuse_typos():
    assert resolve_optimizer_names("adamw, adafactor,adamw_8bit") == ("adamw_torch", "adafactor", "adamw_8bit")
    with pytest.raises(ValueError, match=r"optimizer 'adamv' is not one of: "):
        resolve_optimizer_names("adamw,adamv")
    with pytest.raises(ValueError, match=r"optimizers=7: expected optimizer names"):
        resolve_optimizer_names(7)


# -- bad input -----------------------------------------------------------------------------------


def _fails(argv, capsys, code, *phrases):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for phrase in phrases:
        assert phrase in err, err


def test_estimate_bad_input_gives_a_message_and_an_exit_code(tmp_path, capsys, llama_7b_dir):
    missing = str(tmp_path / "missing")
    _fails(["estimate", missing], capsys, 1, f"{missing}: no such folder")
    _fails(["estimate", str(tmp_path)], capsys, 1, f"no config.json in this folder (looked for {tmp_path / 'config.json'})")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    _fails(["estimate", str(corrupt)], capsys, 1, f"{corrupt}: could not read a model config")
    _fails(["estimate", llama_7b_dir, "--optimizers", "adamw,nope"], capsys, 2,
           "argument --optimizers: optimizer 'nope' is not one of: ")
    _fails(["estimate", llama_7b_dir, "--dtype", "int8"], capsys, 2, "argument --dtype: invalid choice: 'int8'")
    _fails(["estimate", llama_7b_dir, "--trainable", "q_proj("], capsys, 2, "is not a regular expression")
    _fails(["estimate", llama_7b_dir, "--architecture", "LlamaForEverything"], capsys, 2,
           "architecture 'LlamaForEverything' is not a transformers model class")
    _fails(["estimate", llama_7b_dir, "--trainable", "lora_A"], capsys, 1,
           "matches --trainable 'lora_A'; names look like: model.embed_tokens.weight")
