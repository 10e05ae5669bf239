"""`use_liger_kernel=True` from a `--training-args` file or `--liger-kernel` (with `liger_kernel_config`
or `--liger-kernel-config`): recorded in the plan's settings with where it came from, planned with
liger-kernel's kernels stood in for (tests/plan/test_liger_kernels.py), and refused in one line where
liger-kernel's Triton kernels would not run (off CUDA) or its patching is not planned."""

from __future__ import annotations

import json

import pytest

from helpers import one_line, requires_transformers, run_estimate, tiny_llama_folder

pytest.importorskip("transformers")


def _plan(folder, capsys, *argv):
    code, out, err = run_estimate([folder, "--seq-len", "16", "--json", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


def test_the_training_args_file_and_the_flag_plan_the_same_step(tmp_path_factory, tmp_path, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "liger")
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"use_liger_kernel": True, "liger_kernel_config": {"rope": False},
                                "per_device_train_batch_size": 2}))
    from_file = _plan(folder, capsys, "--training-args", str(args))
    used = from_file["settings"]["used"]
    assert ["use_liger_kernel", True, "training args"] in used
    assert ["liger_kernel_config", {"rope": False}, "training args"] in used
    [note] = [note for note in from_file["step"]["notes"] if note.startswith("use_liger_kernel")]
    # 2 layers: 2 MLPs, 4 + 1 norms, one fused loss over 2 x 16 rows (inc_factor cdiv(256, 64) = 4,
    # chunk next_power_of_2(cdiv(32, 4)) = 8), no RoPE
    assert ("fused_linear_cross_entropy (1 calls), rms_norm (5 calls), swiglu (2 calls); the fused linear "
            "cross-entropy's 32 rows in 4 chunks of 8") in note
    flags = _plan(folder, capsys, "--batch-size", "2", "--liger-kernel", "--liger-kernel-config", '{"rope": false}')
    assert ["use_liger_kernel", True, "flag"] in flags["settings"]["used"]
    assert flags["step"]["peak_bytes"] == from_file["step"]["peak_bytes"]
    without = _plan(folder, capsys, "--batch-size", "2")
    # The tiny step's peaks are its model states'; what its forward saves differs.
    assert without["step"]["activations_bytes"] != from_file["step"]["activations_bytes"]
    # use_liger_kernel=false (a dumped TrainingArguments names it) changes nothing and is not listed; its
    # liger_kernel_config is not read, as the Trainer does not read it.
    args.write_text(json.dumps({"use_liger_kernel": False, "liger_kernel_config": {"rope": False},
                                "per_device_train_batch_size": 2}))
    off = _plan(folder, capsys, "--training-args", str(args))
    assert not [row for row in off["settings"]["used"] if row[0].startswith("liger") or row[0] == "use_liger_kernel"]
    assert off["step"]["peak_bytes"] == without["step"]["peak_bytes"]


def test_the_table_says_the_kernels_planned(tmp_path_factory, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "liger-table")
    code, out, err = run_estimate([folder, "--seq-len", "16", "--batch-size", "2", "--liger-kernel"], capsys)
    assert code == 0, err
    assert "use_liger_kernel: planned as liger-kernel 0.8.5's Triton kernels" in out


def test_off_cuda_it_is_refused_in_one_line(tmp_path_factory, capsys) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "liger-cpu")
    code, out, err = run_estimate([folder, "--seq-len", "16", "--batch-size", "2", "--liger-kernel",
                                   "--device-type", "cpu"], capsys)
    assert (code, out) == (2, "")
    assert one_line(err) == ("trainer-memcb: error: use_liger_kernel runs on CUDA only (liger-kernel's Triton "
                             "kernels), not on cpu: give --device-type cuda, or leave liger's kernels out")


def test_a_model_whose_patching_is_not_planned_is_refused(tmp_path_factory, capsys) -> None:
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("liger-gpt2")
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96, n_positions=64,
               architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    code, out, err = run_estimate([str(folder), "--seq-len", "16", "--batch-size", "2", "--liger-kernel"], capsys)
    assert (code, out) == (2, "")
    assert one_line(err) == ("trainer-memcb: error: use_liger_kernel with GPT2LMHeadModel (model type 'gpt2') is "
                             "not planned: liger-kernel's kernels are planned for the causal LMs of llama, mistral, "
                             "qwen2, qwen3")


@pytest.mark.parametrize("config,line", [
    ({"rms_nrom": False}, "'rms_nrom' is not a keyword of liger-kernel's apply functions"),
    ({"rope": "no"}, "rope='no': expected true or false"),
    ({"cross_entropy": True}, "cross_entropy and fused_linear_cross_entropy cannot both be true"),
])
def test_a_config_liger_kernel_would_misread_is_refused(tmp_path_factory, tmp_path, capsys, config, line) -> None:
    folder = tiny_llama_folder(tmp_path_factory, "liger-config")
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"use_liger_kernel": True, "liger_kernel_config": config,
                                "per_device_train_batch_size": 2}))
    code, out, err = run_estimate([folder, "--seq-len", "16", "--training-args", str(args)], capsys)
    assert (code, out) == (1, "")  # as every value of a settings file the run would refuse or misread
    message = one_line(err)
    assert message.startswith(f"trainer-memcb: training args {str(args)!r}: liger_kernel_config") and line in message, \
        message


# Llama-3.2-3B's config.json (as tests/plan/test_flash_attn.py plans it).
LLAMA_3B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 128, "tie_word_embeddings": True,
            "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}


@pytest.mark.slow
@requires_transformers("5.0", "transformers 4.x's Trainer leaves the KV cache on: other figures")
def test_llama_3b_on_l40s_with_liger(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3B))
    steps = {}
    for flag in ([], ["--liger-kernel"]):
        run = subprocess.run([sys.executable, "-m", "trainer_memcb", "estimate", str(tmp_path), "--dtype", "bfloat16",
                              "--batch-size", "4", "--seq-len", "768", "--gpu", "l40s", "--optimizers", "adamw_torch",
                              "--json", *flag], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        assert run.returncode in (0, 3), run.stderr
        steps[bool(flag)] = json.loads(run.stdout)["step"]
    # Llama-3.2-3B (tied embeddings, vocabulary 128,256) in bf16, 4 x 768: the bf16 logits and transformers'
    # fp32 upcast of them leave the peak, which moves to the optimizer step.
    assert (steps[False]["peak_bytes"], steps[False]["peak_phase"]) == (35_363_740_932, "backward")
    assert (steps[True]["peak_bytes"], steps[True]["peak_phase"]) == (32_127_223_036, "optimizer step")
    assert (steps[False]["activations_bytes"], steps[True]["activations_bytes"]) == (12_935_196_680, 8_586_203_140)
    # BT 3072, H 3072: inc_factor cdiv(128256, 3072) = 42, chunk next_power_of_2(cdiv(3072, 42) = 74) = 128
    assert any("3072 rows in 24 chunks of 128" in note for note in steps[True]["notes"])


def test_it_composes_with_flash_attention_checkpointing_and_packing(tmp_path_factory, capsys) -> None:
    # As liger-kernel's README says it works with Flash Attention: its RoPE rotates q and k in place before
    # flash-attn's kernels (tests/plan/test_flash_attn.py) take them, padded rows or a packed one.
    folder = tiny_llama_folder(tmp_path_factory, "liger-flash")
    # 2 layers: 2 RoPE calls a forward, 4 with checkpointing (each layer's forward again in the backward).
    for shape, rope in ((["--batch-size", "2", "--gradient-checkpointing"], 4),
                        (["--batch-size", "1", "--packing", "40"], 2)):
        plan = _plan(folder, capsys, *shape, "--dtype", "bfloat16", "--attn-implementation", "flash_attention_2",
                     "--liger-kernel")
        notes = plan["step"]["notes"]
        assert plan["step"]["problem"] is None
        assert any(note.startswith("attention planned as flash-attn") for note in notes)
        assert any(note.startswith("use_liger_kernel") and f"rope ({rope} calls)" in note for note in notes), notes
