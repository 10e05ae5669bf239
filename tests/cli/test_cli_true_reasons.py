"""`trainer-memcb estimate`: every refusal names the real cause and what is allowed (exit 2 for a
flag, 1 for a config file), and no setting given is dropped or misread."""

from __future__ import annotations

import json
from typing import Any, List

import pytest
from transformers import GPT2Config, LlamaConfig

from trainer_memcb.cli import main


def llama(**overrides: Any) -> LlamaConfig:
    values = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, architectures=["LlamaForCausalLM"])
    values.update(overrides)
    return LlamaConfig(**values)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: Any) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-reasons")
    llama().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory: Any) -> str:
    folder = tmp_path_factory.mktemp("tiny-gpt2-reasons")
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    return str(folder)


def run(argv: List[str], capsys: Any) -> Any:
    code = main(["estimate"] + argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def write_json(path: Any, value: Any) -> str:
    path.write_text(json.dumps(value))
    return str(path)


# -- 7: the evaluation plan ------------------------------------------------------------------------


def test_the_evaluation_plan_answers_fits_after_the_reserve(tiny_llama_dir: str, capsys: Any) -> None:
    argv = [tiny_llama_dir, "--eval-samples", "8", "--seq-len", "12", "--attn-implementation", "eager", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    peak = json.loads(out)["evaluation"]["device_peak_bytes"]
    # Memory for the peak and 1,000 bytes more: it fits with no reserve, not with a reserve of 1,001.
    code, out, _ = run(argv + ["--device-memory", f"{peak + 1000}B", "--reserve", "0B"], capsys)
    assert code == 0 and json.loads(out)["evaluation"]["fits_device"] is True
    code, out, _ = run(argv + ["--device-memory", f"{peak + 1000}B", "--reserve", "1001B"], capsys)
    evaluation = json.loads(out)["evaluation"]
    assert code == 3
    assert (evaluation["fits_device"], evaluation["reserve_bytes"], evaluation["device_memory_bytes"]) == \
        (False, 1001, peak + 1000)
    # The default reserve (1 GiB on a CUDA device) is taken too: a few MiB of memory is refused.
    code, _, err = run(argv + ["--device-memory", f"{peak + 1000}B"], capsys)
    assert code == 2 and "the default reserve of 1.00 GiB" in one_line(err)


def test_an_evaluation_that_cannot_be_traced_exits_5_not_fits(tmp_path: Any, capsys: Any) -> None:
    # Dynamic NTK rope scaling compares the largest position with the cached length: a value read.
    llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).save_pretrained(tmp_path)
    code, out, _ = run([str(tmp_path), "--eval-samples", "8", "--seq-len", "12", "--device-memory", "80GiB",
                        "--json"], capsys)
    evaluation = json.loads(out)["evaluation"]
    assert evaluation["problem"].startswith("the evaluation forward cannot run under fake tensors (")
    assert evaluation["fits_device"] is None
    assert code == 5
