"""The version and the JSON Schema of `trainer-memcb estimate --json`'s documents.

Every document the command prints carries its version under `schema`. `estimate_schema()` is the
JSON Schema (draft 2020-12) of the four kinds, read from the plans' dataclasses (their fields and
type hints, `trainer_memcb.utils.json_schema`) and from the keys the command adds to them; it is
committed as `docs/estimate.schema.json`, and a test holds the file to it. To write it again:

    python -m trainer_memcb.cli.estimate_schema > docs/estimate.schema.json
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional

__all__ = ["ESTIMATE_SCHEMA", "estimate_schema", "schema_json", "with_schema"]

# Raised whenever the documents change shape (a key added, removed or renamed, a type changed): the
# schema file, whose `additionalProperties: false` refuses any key it does not name, changes with it.
ESTIMATE_SCHEMA = "trainer-memcb/estimate/1"


def with_schema(document: Dict[str, Any]) -> Dict[str, Any]:
    """The document with its `schema` key (a new dict: the plan's own is not changed)."""
    return {"schema": ESTIMATE_SCHEMA, **document}


def _ref(name: str) -> Dict[str, Any]:
    return {"$ref": f"#/$defs/{name}"}


def _document(title: str, description: str, properties: Dict[str, Any], required: List[str],
              **more: Any) -> Dict[str, Any]:
    """One kind of document: its own keys beside `schema`."""
    return {"title": title, "description": description, "type": "object",
            "properties": {"schema": {"const": ESTIMATE_SCHEMA}, **properties},
            "required": ["schema"] + required, "additionalProperties": False, **more}


def _with_version(definition: Dict[str, Any], title: str, description: str) -> Dict[str, Any]:
    """A plan printed on its own: its object's keys, and `schema`."""
    more = {"dependentRequired": definition["dependentRequired"]} if "dependentRequired" in definition else {}
    return _document(title, description, definition["properties"], definition["required"], **more)


def estimate_schema() -> Dict[str, Any]:
    """The JSON Schema of every document `trainer-memcb estimate --json` prints: the what-if, the
    model-states plan, the step plan (with the evaluation, `--fit` and `--max-batch-size` where
    asked) and the evaluation plan alone; one `oneOf` branch each.

    Examples:
        >>> schema = estimate_schema()
        >>> [branch["title"] for branch in schema["oneOf"]]
        ['what-if', 'model-states plan', 'step plan', 'evaluation plan']
        >>> schema["$defs"]["FitSearch"]["required"]
        ['fits_as_is', 'own', 'candidates', 'usable_bytes']
    """
    from trainer_memcb.plan.answers.eval_memory import EvalMemoryPlan
    from trainer_memcb.plan.answers.fit_candidates import FitCandidate, FitSearch
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan
    from trainer_memcb.plan.answers.step_memory import StepMemoryPlan
    from trainer_memcb.plan.optimizers.whatif import WhatIf
    from trainer_memcb.utils.json_schema import JSON_SCHEMA_DIALECT, object_schema

    defs: Dict[str, Any] = {}
    # The classes whose JSON form is not their fields alone come first; the others as their fields
    # reach them. `to_dict` says what each writes.
    defs["StepMemoryPlan"] = object_schema(StepMemoryPlan, defs, leave_out=["timeline"])
    defs["ModelStatesPlan"] = object_schema(
        ModelStatesPlan, defs, extra={"not_counted": str, "reserve_bytes": int, "cuda_context_bytes": int},
        optional=["reserve_bytes", "cuda_context_bytes"],
        description="The model-states plan: what each process holds of the parameters, gradients, optimizer state "
                    "and master weights, one entry per optimizer. With --device-memory, and no step plan that "
                    "answers fits?, the reserve and the CUDA context its fits? was answered against "
                    "(`reserve_bytes`, `cuda_context_bytes`).")
    defs["ModelStatesPlan"]["dependentRequired"] = {"reserve_bytes": ["cuda_context_bytes"],
                                                    "cuda_context_bytes": ["reserve_bytes"]}
    defs["EvalMemoryPlan"] = object_schema(
        EvalMemoryPlan, defs, properties=["usable_device_bytes", "device_figure_bytes", "device_margin_bytes"])
    defs["FitCandidate"] = object_schema(FitCandidate, defs, leave_out=["plan", "seconds"])
    defs["FitSearch"] = object_schema(FitSearch, defs)
    defs["WhatIf"] = object_schema(WhatIf, defs)
    searched = object_schema(
        StepMemoryPlan, defs, leave_out=[name for name in StepMemoryPlan.__dataclass_fields__
                                         if name not in ("batch_size", "peak_bytes", "reserved_peak_bytes",
                                                         "device_total_bytes", "fits")],
        description="One batch size the search for the largest planned, with the step plan's figures for it.")
    searched["title"] = "searched batch"
    step_plan = _step_plan_document(defs, searched)
    evaluation_plan = _document(
        "evaluation plan", "The evaluation alone (--eval-samples without a step): the evaluation loop's peaks on "
        "the device and the host; with --fit, the search for an evaluation setting that fits.",
        {"evaluation": _ref("EvalMemoryPlan"),
         "fit": {"type": "object", "properties": {"evaluation": _ref("FitSearch")}, "required": ["evaluation"],
                 "additionalProperties": False}},
        ["evaluation"])
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "trainer-memcb estimate --json",
        "description": f"Every document `trainer-memcb estimate ... --json` prints, version {ESTIMATE_SCHEMA} (its "
                       "`schema` key). Written by `python -m trainer_memcb.cli.estimate_schema`; do not edit.",
        "oneOf": [
            _with_version(defs["WhatIf"], "what-if", "Each optimizer's state for the model (no setup option given)."),
            _with_version(defs["ModelStatesPlan"], "model-states plan",
                          "The model-states plan alone (--world-size, --sharding, --zero, --precision, "
                          "--device-memory ... without a step)."),
            step_plan,
            evaluation_plan,
        ],
        "$defs": dict(sorted(defs.items())),
    }


def _step_plan_document(defs: Dict[str, Any], searched: Dict[str, Any]) -> Dict[str, Any]:
    """The step plan's document: the step, the model states beside it, and where asked the
    evaluation, --fit's search and the largest batch (`searched`: the schema of one batch planned)."""
    from trainer_memcb.utils.json_schema import type_schema

    fit_search = defs["FitSearch"]
    step_fit = {
        "description": "--fit: the search for a setting that fits; with an evaluation asked and --fit, "
                       "`evaluation` holds the search for the evaluation's.",
        "oneOf": [
            {**fit_search, "title": "the step's search (and the evaluation's)",
             "properties": {**fit_search["properties"], "evaluation": _ref("FitSearch")}},
            {"title": "the evaluation's search alone", "type": "object",
             "properties": {"evaluation": _ref("FitSearch")}, "required": ["evaluation"],
             "additionalProperties": False},
        ],
    }
    search_keys = ["max_batch_size", "max_batch_size_problem", "max_batch_size_is_search_limit", "searched"]
    step_plan = _document(
        "step plan", "A traced step (--batch-size, a TrainingArguments file, --max-batch-size): the step's peak "
        "and its parts, the model states beside it; the evaluation, --fit's search and the largest batch where asked.",
        {"model_states": _ref("ModelStatesPlan"),
         "step": _ref("StepMemoryPlan"),
         "evaluation": _ref("EvalMemoryPlan"),
         "fit": step_fit,
         "max_batch_size": {**type_schema(Optional[int], defs),
                            "description": "the largest per-device batch that fits; null when none does"},
         "max_batch_size_problem": {**type_schema(Optional[str], defs),
                                    "description": "why the search could not answer, or null"},
         "max_batch_size_is_search_limit": {
             "type": "boolean", "description": "max_batch_size is the search's limit, which fits; no larger was tried"},
         "searched": {"type": "array", "items": searched}},
        ["model_states"],
        # --max-batch-size writes its four keys together.
        dependentRequired={key: [other for other in search_keys if other != key] for key in search_keys})
    return step_plan


def schema_json() -> str:
    """`estimate_schema()` as the committed file holds it."""
    return json.dumps(estimate_schema(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_json())
