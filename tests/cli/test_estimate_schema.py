"""`docs/estimate.schema.json`: the JSON Schema of `trainer-memcb estimate --json`. The committed
file is what the package writes; every recorded golden plan and every kind of document the
command prints now is valid under it; a key it does not name, or one it requires left out, is not."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from typing import Any, Dict, List

import jsonschema
import pytest

import golden_plans
from trainer_memcb.cli.estimate_schema import ESTIMATE_SCHEMA, estimate_schema, schema_json

SCHEMA_FILE = os.path.join(golden_plans.REPO_ROOT, "docs", "estimate.schema.json")
GOLDEN = golden_plans.recorded()["plans"]


def committed() -> Dict[str, Any]:
    with open(SCHEMA_FILE, encoding="utf-8") as handle:
        return json.load(handle)


VALIDATOR = jsonschema.Draft202012Validator(committed())


def kind(document: Any) -> str:
    """The title of the one `oneOf` branch the document is valid under (it fails if none or several)."""
    VALIDATOR.validate(document)
    return next(branch["title"] for branch in committed()["oneOf"]
                if jsonschema.Draft202012Validator({**branch, "$defs": committed()["$defs"]}).is_valid(document))


def test_the_committed_schema_is_the_one_the_package_writes():
    with open(SCHEMA_FILE, encoding="utf-8") as handle:
        assert handle.read() == schema_json(), (
            "write it again: python -m trainer_memcb.cli.estimate_schema > docs/estimate.schema.json")


def test_it_is_a_draft_2020_12_schema_of_this_version():
    schema = estimate_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert ESTIMATE_SCHEMA == "trainer-memcb/estimate/3"
    assert [branch["properties"]["schema"] for branch in schema["oneOf"]] == [{"const": ESTIMATE_SCHEMA}] * 4


def objects(schema: Any) -> List[Dict[str, Any]]:
    """Every object schema (one with `properties`) anywhere in `schema`."""
    if isinstance(schema, list):
        return [found for item in schema for found in objects(item)]
    if not isinstance(schema, dict):
        return []
    own = [schema] if "properties" in schema else []
    return own + [found for value in schema.values() for found in objects(value)]


def test_every_object_names_each_key_it_requires_and_no_other():
    schema = estimate_schema()
    assert sorted(schema["$defs"]) == ["DeviceFigures", "EvalMemoryPlan", "EvalSettings", "FitCandidate", "FitSearch",
                                       "LargestBatch", "ModelStatesPlan", "OptimizerPlan", "OptimizerWhatIf",
                                       "PackedBatch", "PlannedGeneration", "PlannedPreference", "PlannedSettings", "RankGroup", "SearchedBatch", "Setup", "StateEstimate", "StepPeak",
                                       "WhatIf"]
    found = objects(schema)
    # The $defs, the four documents, the step's answers and the evaluation's, and a TRL step's phase.
    assert len(found) == 19 + 4 + 2 + 1
    for definition in found:
        assert definition["additionalProperties"] is False, definition
        assert set(definition["required"]) <= set(definition["properties"]), definition
    # Only the keys the command writes sometimes are not required.
    optional = {definition.get("title"): sorted(set(definition["properties"]) - set(definition["required"]))
                for definition in found if set(definition["properties"]) != set(definition["required"])}
    assert optional == {
        "ModelStatesPlan": ["cuda_context_bytes", "reserve_bytes"],
        "model-states plan": ["cuda_context_bytes", "reserve_bytes"],
        "PlannedSettings": ["packing", "preference"],  # packing: a packed batch only (--packing); preference: --trainer dpo|grpo
        # phases: --trainer dpo|kto|grpo|rloo: each phase's peak (generation, training); rank_groups: tensor
        # parallelism's uneven shards, each group of ranks with equal steps
        "StepPeak": ["phases", "rank_groups"],
        "step plan": ["device", "settings", "step"],
        "answers": ["evaluation", "evaluation_fit", "fit", "fits", "largest_batch", "margin_bytes"],
        "evaluation answers": ["evaluation_fit"],
    }


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_every_golden_plan_is_valid(name: str):
    document = GOLDEN[name]["json"]
    assert document["schema"] == ESTIMATE_SCHEMA
    expected = ("what-if" if name.startswith("what-if") else "model-states plan" if name.startswith("model states")
                else "evaluation plan" if name == "evaluation" else "step plan")
    assert kind(document) == expected


def estimate(argv: List[str]) -> Any:
    code, document = golden_plans.run(argv)
    assert code in (0, 3), document  # an answer: it fits, or it does not
    return document


LLAMA_EVAL = [golden_plans.LLAMA, "--seq-len", "12", "--attn-implementation", "eager", "--eval-samples", "2000",
              "--eval-batch-size", "16"]


@pytest.mark.parametrize("argv,expected,present,absent", [
    ([golden_plans.DISTILBERT, "--optimizers", "adamw,adafactor"], "what-if",
     {"trainable_tensors", "optimizers"}, set()),
    ([golden_plans.DISTILBERT, "--world-size", "2", "--zero", "2", "--offload-optimizer", "--device-memory", "1GiB"],
     "model-states plan", {"setup", "reserve_bytes", "cuda_context_bytes"}, set()),
    ([golden_plans.DISTILBERT, "--world-size", "2", "--zero", "2"], "model-states plan", {"setup"},
     {"reserve_bytes", "cuda_context_bytes"}),
    (LLAMA_EVAL + ["--device-memory", "440MiB", "--fit"], "evaluation plan", {"evaluation", "evaluation_fit"},
     {"model_states"}),
    (golden_plans.STEP + ["--device-memory", "446MiB", "--fit", "--max-proposals", "2"], "step plan",
     {"model_states", "settings", "step", "device", "fits", "margin_bytes", "fit"}, {"largest_batch", "evaluation"}),
    ([golden_plans.DISTILBERT, "--seq-len", "8", "--device-memory", "450MiB", "--max-batch-size"], "step plan",
     {"model_states", "largest_batch"}, {"fit", "evaluation", "step", "fits"}),
    # The tiny Llama: transformers 4.57's DistilBERT cannot run its eager evaluation under fake tensors.
    (golden_plans.LLAMA_STEP + ["--device-type", "cpu"] + LLAMA_EVAL[1:], "step plan",
     {"model_states", "step", "fits", "evaluation"}, {"fit", "largest_batch"}),
], ids=["what-if", "model states, memory", "model states", "evaluation, fit", "step, fit", "largest batch",
        "step and evaluation"])
def test_each_kind_of_document_the_command_prints_now_is_valid(argv: List[str], expected: str, present: set,
                                                                absent: set):
    document = estimate(argv)
    assert kind(document) == expected
    keys = set(document) | set(document["answers"]) if "answers" in document else set(document)
    assert present <= keys and not absent & keys


def golden(name: str) -> Dict[str, Any]:
    return copy.deepcopy(GOLDEN[name]["json"])


def invalid(document: Any) -> str:
    """The errors that validation gives, each said in a line, the reasons under `oneOf` included; it must fail."""
    errors = list(VALIDATOR.iter_errors(document))
    assert errors, "the document passed"
    lines, pending = [], errors
    while pending:
        error = pending.pop()
        lines.append(error.message)
        pending.extend(error.context)
    return "\n".join(lines)


def test_a_key_the_schema_does_not_name_fails_anywhere():
    document = golden("evaluation with the step, its fit")
    assert kind(document) == "step plan"
    for place in (document, document["settings"], document["step"], document["device"], document["answers"],
                  document["model_states"], document["model_states"]["setup"],
                  document["model_states"]["optimizers"][0], document["answers"]["evaluation"], document["answers"]["evaluation"]["settings"],
                  document["answers"]["fit"]["own"], document["answers"]["evaluation_fit"]["candidates"][0]):
        place["new_key_bytes"] = 1
        invalid(document)
        del place["new_key_bytes"]
    VALIDATOR.validate(document)


def test_a_key_left_out_a_wrong_type_or_another_version_fails():
    document = golden("step, CUDA, fp32 AdamW")
    del document["step"]["peak_bytes"]
    assert "'peak_bytes' is a required property" in invalid(document)
    document = golden("what-if, every default optimizer")
    del document["optimizers"][0]["estimate"]["bytes_by_key"]
    invalid(document)
    document = golden("step, CUDA, fp32 AdamW")
    document["step"]["peak_bytes"] = "1 GiB"
    invalid(document)
    document["step"]["peak_bytes"] = True  # a JSON boolean is no integer
    invalid(document)
    document = golden("largest batch")
    del document["answers"]["largest_batch"]["searched"]  # the search's answer holds each of its keys
    invalid(document)
    document = golden("step, CPU")
    del document["device"]  # a traced step writes its settings, step and device together
    invalid(document)
    document = golden("evaluation")
    document["schema"] = "trainer-memcb/estimate/0"
    invalid(document)
    del document["schema"]
    invalid(document)


def test_a_trl_steps_phase_is_generation_or_training_with_its_peak():
    document = golden("step, CPU")
    document["step"]["phases"] = [{"phase": "generation", "peak_bytes": 1}, {"phase": "training", "peak_bytes": 2}]
    VALIDATOR.validate(document)
    for bad in ({"phase": "evaluation", "peak_bytes": 1}, {"phase": "training"},
                {"phase": "training", "peak_bytes": 1, "peak_phase": "backward"}):
        document["step"]["phases"] = [bad]
        invalid(document)


def test_python_m_of_the_module_prints_the_file():
    printed = subprocess.run([sys.executable, "-m", "trainer_memcb.cli.estimate_schema"], capture_output=True,
                             text=True, check=True, cwd=golden_plans.REPO_ROOT).stdout
    with open(SCHEMA_FILE, encoding="utf-8") as handle:
        assert printed == handle.read()
