"""The user's tensor-parallel rules over the model's plan (`tp_plan`, `--tp-plan`), merged as
transformers 5's `DistributedConfig(tp_plan=dict)` merges them; the real run of the same rules is
tests/training/test_tensor_parallel_runs.py (engine `tp-attention-whole`)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import requires_torch, valid_estimate_document

from trainer_memcb.cli import main
from trainer_memcb.plan.model.tp_plan import model_tp_plan
from trainer_memcb.plan.settings import resolve_settings

sys.path.insert(0, os.path.dirname(__file__))
from test_engines import build  # noqa: E402

ATTENTION_WHOLE = {f"model.layers.*.self_attn.{name}": "replicate" for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_the_rules_replace_the_model_s_for_their_modules_and_keep_the_rest():
    meta = build()
    own = model_tp_plan(meta)
    merged = model_tp_plan(meta, ATTENTION_WHOLE)
    assert merged == {**own, **ATTENTION_WHOLE}
    assert merged["model.layers.*.mlp.down_proj"] == own["model.layers.*.mlp.down_proj"] == "rowwise"
    with pytest.raises(ValueError, match=r"'model.layers.\*.attn.q_proj' names no module of LlamaForCausalLM"):
        model_tp_plan(meta, {"model.layers.*.attn.q_proj": "colwise"})


@pytest.mark.parametrize("flags,message", [
    (dict(parallelism="tp=2", tp_plan={"model.norm": "sideways"}), "tp_plan 'model.norm': style 'sideways' is not planned"),
    (dict(parallelism="tp=2", tp_plan={}), "expected a JSON object of module names to style names, at least one"),
    (dict(tp_plan=ATTENTION_WHOLE), "tp_plan without tensor parallelism: give --parallelism tp=N"),
])
def test_bad_rules_are_refused_in_one_line(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(batch_size=2, **flags)


STEP = ["--optimizers", "adamw_torch", "--batch-size", "2", "--seq-len", "16", "--device-type", "cpu",
        "--parallelism", "tp=2", "--json"]


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@pytest.mark.parametrize("given", ["inline", "file"])
def test_the_command_plans_the_rules_inline_or_from_a_file(tiny_llama_dir, tmp_path, capsys, given):
    text = json.dumps(ATTENTION_WHOLE)
    if given == "file":
        (tmp_path / "rules.json").write_text(text)
        text = str(tmp_path / "rules.json")
    assert main(["estimate", tiny_llama_dir, *STEP, "--tp-plan", text]) == 0
    document = valid_estimate_document(json.loads(capsys.readouterr().out))
    used = {name: (value, source) for name, value, source in document["settings"]["used"]}
    assert used["tp_plan"] == (ATTENTION_WHOLE, "flag")
    # The real run's, per process (tests/training/test_tensor_parallel_runs.py): the model's plan but the
    # attention's projections whole.
    assert document["step"]["model_states_at_optimizer_step_bytes"]["parameters"] == 296_192


@pytest.mark.parametrize("argv,phrase", [
    (["--tp-plan", "{not json"], "is not JSON: give an object such as"),
    (["--tp-plan", "/nonexistent/rules.json"], "--tp-plan"),
    (["--tp-plan", '{"model.norm": "sideways"}'], "style 'sideways' is not planned"),
])
def test_a_bad_tp_plan_is_one_usage_line(tiny_llama_dir, capsys, argv, phrase):
    assert main(["estimate", tiny_llama_dir, *STEP, *argv]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2


def test_rules_without_tensor_parallelism_are_a_usage_line(tiny_llama_dir, capsys):
    argv = ["estimate", tiny_llama_dir, *[a for a in STEP if a not in ("--parallelism", "tp=2")], "--tp-plan",
            json.dumps(ATTENTION_WHOLE)]
    assert main(argv) == 2
    assert "tp_plan without tensor parallelism" in capsys.readouterr().err


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
def test_the_rules_from_a_file_through_the_console_script(tiny_llama_dir, tmp_path):
    """The installed `trainer-memcb`, whose start keeps some packages out: the same bytes as above."""
    from cli.test_console_script import run_script

    (tmp_path / "rules.json").write_text(json.dumps(ATTENTION_WHOLE))
    done = run_script("estimate", tiny_llama_dir, *STEP, "--tp-plan", str(tmp_path / "rules.json"))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    document = json.loads(done.stdout)
    assert document["step"]["model_states_at_optimizer_step_bytes"]["parameters"] == 296_192
