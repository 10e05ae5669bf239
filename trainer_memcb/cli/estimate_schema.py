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
from typing import Any, Dict, List

__all__ = ["ESTIMATE_SCHEMA", "estimate_schema", "schema_json", "with_schema"]

# Raised whenever the documents change shape (a key added, removed or renamed, a type changed): the
# schema file, whose `additionalProperties: false` refuses any key it does not name, changes with it.
ESTIMATE_SCHEMA = "trainer-memcb/estimate/3"


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


def _answers(verdict: Dict[str, Any]) -> Dict[str, Any]:
    """The step plan's `answers`: the verdict's keys (`verdict`: its schema) and the answers asked for."""
    return {
        "title": "answers", "type": "object",
        "description": "What the command answers: fits? and its margin (a traced step), --fit's search, the "
                       "largest batch (--max-batch-size), the evaluation plan and --fit's search for it; each only "
                       "where asked.",
        "properties": {**verdict["properties"], "fit": _ref("FitSearch"), "largest_batch": _ref("LargestBatch"),
                       "evaluation": _ref("EvalMemoryPlan"), "evaluation_fit": _ref("FitSearch")},
        "required": [], "additionalProperties": False,
        "dependentRequired": {"fits": ["margin_bytes"], "margin_bytes": ["fits"],
                              "evaluation_fit": ["evaluation"]}}


# The evaluation plan's `answers`, printed alone.
_EVALUATION_ANSWERS = {
    "title": "evaluation answers", "type": "object",
    "description": "The evaluation plan, and --fit's search for an evaluation setting that fits.",
    "properties": {"evaluation": _ref("EvalMemoryPlan"), "evaluation_fit": _ref("FitSearch")},
    "required": ["evaluation"], "additionalProperties": False}


# One phase of a TRL step (`StepPeak.phases`): generation or training, and its device peak.
_PHASE = {"type": "object", "description": "One phase of TRL's step (GRPO and RLOO: generation, then training; "
                                           "DPO and KTO: training alone) and its device peak.",
          "properties": {"phase": {"enum": ["generation", "training"]}, "peak_bytes": {"type": "integer"}},
          "required": ["phase", "peak_bytes"], "additionalProperties": False}


def _definitions() -> Dict[str, Any]:
    """The `$defs` of the schema: each plan's class, read from its fields."""
    from trainer_memcb.plan.answers.eval_memory import EvalMemoryPlan
    from trainer_memcb.plan.answers.fit_candidates import FitCandidate, FitSearch
    from trainer_memcb.plan.answers.max_batch import LargestBatch
    from trainer_memcb.plan.answers.model_states import ModelStatesPlan
    from trainer_memcb.plan.answers.step_plan import DeviceFigures, PlannedSettings, StepPeak
    from trainer_memcb.plan.optimizers.whatif import WhatIf
    from trainer_memcb.utils.json_schema import object_schema

    defs: Dict[str, Any] = {}
    # The classes whose JSON form is not their fields alone come first; the others as their fields
    # reach them. `to_dict` says what each writes.
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
    for cls in (FitSearch, LargestBatch, StepPeak, DeviceFigures, WhatIf):
        defs[cls.__name__] = object_schema(cls, defs, optional=["phases", "rank_groups"] if cls is StepPeak else ())
    defs["StepPeak"]["properties"]["phases"]["items"] = _PHASE
    defs["PlannedSettings"] = object_schema(PlannedSettings, defs, optional=["packing", "preference"])
    return defs


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
    from trainer_memcb.plan.answers.step_plan import Verdict
    from trainer_memcb.utils.json_schema import JSON_SCHEMA_DIALECT, object_schema

    defs = _definitions()
    step_plan = _document(
        "step plan", "A traced step (--batch-size, a TrainingArguments file, --max-batch-size): the settings "
        "planned, the model states beside the step, the step's peak and its parts, the device (the allocator "
        "replay, the CUDA context) and the answers.",
        {"settings": _ref("PlannedSettings"), "model_states": _ref("ModelStatesPlan"), "step": _ref("StepPeak"),
         "device": _ref("DeviceFigures"), "answers": _answers(object_schema(Verdict, defs))},
        ["model_states", "answers"],
        # A step traced at the asked batch writes its four parts together.
        dependentRequired={key: [other for other in ("settings", "step", "device") if other != key]
                           for key in ("settings", "step", "device")})
    evaluation_plan = _document(
        "evaluation plan", "The evaluation alone (--eval-samples without a step): the evaluation loop's peaks on "
        "the device and the host; with --fit, the search for an evaluation setting that fits.",
        {"answers": _EVALUATION_ANSWERS}, ["answers"])
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


def schema_json() -> str:
    """`estimate_schema()` as the committed file holds it."""
    return json.dumps(estimate_schema(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_json())
