"""Which values read back from a run folder can be used, checked one by one.

A `trainer_state.json`, an event file or an `optimizer_memory.json` may hold anything. Each value
the command reads is checked for its type; one of the wrong type is dropped and counted, so that
the reader can say so in one line per file, and the figures around it are kept:

- a log entry's `step` must be a whole number >= 0, else the entry is dropped;
- byte counts, value counts and parameter counts (`optimizer_state_bytes`, `..._by_key/<key>`,
  `eval_optimizer_state_bytes`, `optimizer_trainable_params`, ...) must be whole numbers >= 0
  below 2**63 (`optimizer_state_unexpected_bytes` may be negative);
- the evaluation metrics read (`eval_accuracy`; by default every `eval_*` and `test_*`) must be
  numbers (NaN and infinities are numbers);
- the summary keeps only the fields the command reads, each of its expected type.
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any, Collection, Dict, List, Optional, Tuple

__all__ = [
    "MAX_COUNT",
    "Problems",
    "whole_number",
    "real_number",
    "is_count_key",
    "clean_log_history",
    "clean_summary",
]

# No device holds 2**63 bytes; above it, a count cannot even be turned into a float for MiB.
MAX_COUNT = 2**63 - 1
# `optimizer_...bytes`, `model_...bytes`, `..._elements`, `..._params`, `activations_...bytes`,
# `device_peak_...bytes`, `step_plan_...bytes`, with any metric prefix
# (`eval_`, `eval_<dataset>_`) and breakdowns under either name (`..._bytes_by_key/<key>`, and
# `.../by_key/<key>` as first written).
_COUNT_KEY = re.compile(r"(?:^|_)(?:(?:optimizer|model)_\w*?(?:bytes|elements|params)(?:_by_\w+/.*|/by_\w+/.*)?"
                        r"|activations_\w*?bytes|device_peak_\w*?bytes|step_plan_\w*?bytes)$")
# Signed: measured minus estimate.
_SIGNED_KEY = re.compile(r"unexpected_bytes$")
_METRIC_PREFIXES = ("eval_", "test_")
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = 40
_SHOWN.maxother = 40


class Problems:
    """The values dropped from one file: how many, and the first, for one line of text."""

    def __init__(self) -> None:
        self.count = 0
        self.first: Optional[str] = None

    def add(self, where: str, value: Any, why: str) -> None:
        self.count += 1
        if self.first is None:
            self.first = f"{where} = {_SHOWN.repr(value)}: {why}"

    def sentence(self, what: str) -> Optional[str]:
        """`"skipped 2 values that a run does not log (log_history[3].step = 'x': ...)"`, or None."""
        if not self.count:
            return None
        return f"skipped {self.count} value{'s' if self.count != 1 else ''} that {what} ({self.first})"


def whole_number(value: Any, signed: bool = False) -> Optional[int]:
    """An int (a float with no fraction counts) within the count range, else None. Booleans are not numbers.

    Examples:
        >>> whole_number(88), whole_number(88.0), whole_number("88"), whole_number(-1), whole_number(True)
        (88, 88, None, None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            return None
        value = int(value)
    if not isinstance(value, int):
        return None
    if value > MAX_COUNT or value < (-MAX_COUNT if signed else 0):
        return None
    return value


def real_number(value: Any) -> Optional[float]:
    """An int or float that converts to a float (NaN and infinities included), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        float(value)
    except OverflowError:
        return None
    return value


def is_count_key(key: str) -> bool:
    """Whether a logged key holds a count of bytes, values or parameters.

    Examples:
        >>> [is_count_key(k) for k in ("optimizer_state_bytes", "eval_optimizer_state_bytes_by_key/exp_avg", "loss",
        ...                            "activations_peak_bytes", "device_peak_allocated_bytes")]
        [True, True, False, True, True]
    """
    return _COUNT_KEY.search(key) is not None


def _count_check(key: str) -> Tuple[bool, str]:
    signed = _SIGNED_KEY.search(key) is not None
    return signed, ("not a whole number" if signed else "not a whole number >= 0")


def clean_log_history(entries: List[Dict[str, Any]], label: str = "log_history",
                      metric_keys: Optional[Collection[str]] = None) -> Tuple[List[Dict[str, Any]], Problems]:
    """The entries with every value the command reads of its right type, and what was dropped.

    Args:
        entries: log entries (dicts); their order is kept.
        label: how to name the list in a problem (`"log_history"`).
        metric_keys: the metric keys to check (`{"eval_accuracy"}`); others are kept unchecked,
            since a run may log what it likes (a confusion matrix). None checks every `eval_*`
            and `test_*` key.

    Examples:
        >>> cleaned, problems = clean_log_history([{"step": "1", "loss": 1.0}, {"step": 2, "optimizer_state_bytes": "8"}])
        >>> cleaned, problems.sentence("a run does not log")
        ([{'step': 2}], "skipped 2 values that a run does not log (log_history[0].step = '1': not a whole number >= 0)")
    """
    problems = Problems()
    cleaned: List[Dict[str, Any]] = []
    for index, entry in enumerate(entries):
        step = whole_number(entry.get("step"))
        if step is None:
            problems.add(f"{label}[{index}].step", entry.get("step"), "not a whole number >= 0")
            continue
        kept: Dict[str, Any] = {"step": step}
        for key, value in entry.items():
            if key == "step":
                continue
            if is_count_key(key):
                signed, why = _count_check(key)
                number = whole_number(value, signed=signed)
                if number is None:
                    problems.add(f"{label}[{index}].{key}", value, why)
                    continue
                value = number
            elif (key in metric_keys if metric_keys is not None else key.startswith(_METRIC_PREFIXES)) \
                    and real_number(value) is None:
                problems.add(f"{label}[{index}].{key}", value, "not a number")
                continue
            kept[key] = value
        cleaned.append(kept)
    return cleaned, problems


class _SummaryReader:
    """Reads the fields of a summary the command shows, each checked; drops the others."""

    def __init__(self) -> None:
        self.problems = Problems()

    def count(self, where: str, value: Any) -> Optional[int]:
        if value is None:
            return None
        number = whole_number(value)
        if number is None:
            self.problems.add(where, value, "not a whole number >= 0")
        return number

    def text(self, where: str, value: Any) -> Optional[str]:
        if value is None or isinstance(value, str):
            return value
        self.problems.add(where, value, "not a string")
        return None

    def mapping(self, where: str, value: Any) -> Optional[Dict[str, Any]]:
        if value is None or isinstance(value, dict):
            return value
        self.problems.add(where, value, "not an object")
        return None

    def counts(self, where: str, value: Any) -> Dict[str, int]:
        found = self.mapping(where, value) or {}
        kept = {}
        for key, item in found.items():
            number = self.count(f"{where}.{key}", item)
            if number is not None:
                kept[key] = number
        return kept

    def figures(self, where: str, value: Any, counts: Tuple[str, ...], texts: Tuple[str, ...] = (),
                breakdowns: Tuple[str, ...] = ()) -> Optional[Dict[str, Any]]:
        section = self.mapping(where, value)
        if section is None:
            return None
        kept: Dict[str, Any] = {name: self.count(f"{where}.{name}", section.get(name)) for name in counts}
        kept.update({name: self.text(f"{where}.{name}", section.get(name)) for name in texts})
        kept.update({name: self.counts(f"{where}.{name}", section.get(name)) for name in breakdowns})
        return kept

    def signed(self, where: str, value: Any) -> Optional[int]:
        if value is None:
            return None
        number = whole_number(value, signed=True)
        if number is None:
            self.problems.add(where, value, "not a whole number")
        return number

    def texts(self, where: str, value: Any) -> List[str]:
        if value is None:
            return []
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        self.problems.add(where, value, "not a list of strings")
        return []

    def judgement(self, value: Any) -> Optional[Dict[str, Any]]:
        """Measured against estimate, judged (`trainer_memcb.state.judge`): the signed difference and
        each likely cause."""
        section = self.mapping("judgement", value)
        if section is None:
            return None
        kept: Dict[str, Any] = {"difference_bytes": self.signed("judgement.difference_bytes",
                                                                section.get("difference_bytes")), "causes": []}
        causes = section.get("causes")
        if causes is not None and not isinstance(causes, list):
            self.problems.add("judgement.causes", causes, "not a list")
            causes = None
        for index, cause in enumerate(causes or []):
            where = f"judgement.causes[{index}]"
            cause = self.mapping(where, cause)
            if cause is None:
                continue
            kept["causes"].append({
                "kind": self.text(f"{where}.kind", cause.get("kind")),
                "description": self.text(f"{where}.description", cause.get("description")),
                "num_bytes": self.signed(f"{where}.num_bytes", cause.get("num_bytes")),
                "state_keys": self.texts(f"{where}.state_keys", cause.get("state_keys")),
                "dtypes": self.texts(f"{where}.dtypes", cause.get("dtypes")),
            })
        return kept

    def what_if(self, value: Any) -> Optional[Dict[str, Any]]:
        section = self.mapping("what_if", value)
        if section is None:
            return None
        kept: Dict[str, Any] = {
            name: self.count(f"what_if.{name}", section.get(name))
            for name in ("total_params", "trainable_params", "trainable_tensors", "trainable_bytes")
        }
        kept["model"] = self.text("what_if.model", section.get("model"))
        dtypes = section.get("trainable_dtypes")
        if dtypes is not None and not (isinstance(dtypes, list) and all(isinstance(d, str) for d in dtypes)):
            self.problems.add("what_if.trainable_dtypes", dtypes, "not a list of strings")
            dtypes = None
        kept["trainable_dtypes"] = dtypes
        optimizers = section.get("optimizers")
        if optimizers is not None and not isinstance(optimizers, list):
            self.problems.add("what_if.optimizers", optimizers, "not a list")
            optimizers = None
        kept["optimizers"] = []
        for index, entry in enumerate(optimizers or []):
            where = f"what_if.optimizers[{index}]"
            entry = self.mapping(where, entry)
            if entry is None:
                continue
            kept["optimizers"].append({
                "name": self.text(f"{where}.name", entry.get("name")),
                "optimizer_class": self.text(f"{where}.optimizer_class", entry.get("optimizer_class")),
                "estimate": self.figures(f"{where}.estimate", entry.get("estimate"), ("num_bytes", "num_params"),
                                         ("optimizer_class",), ("bytes_by_key",)),
                "problem": self.text(f"{where}.problem", entry.get("problem")),
            })
        return kept


def clean_summary(document: Dict[str, Any]) -> Tuple[Dict[str, Any], Problems]:
    """The fields of an `optimizer_memory.json` the command shows, each of its type, and what was dropped.

    Examples:
        >>> cleaned, problems = clean_summary({"measured": {"num_bytes": "96"}, "estimate": None})
        >>> cleaned["measured"]["num_bytes"], problems.sentence("a summary does not hold")
        (None, "skipped 1 value that a summary does not hold (measured.num_bytes = '96': not a whole number >= 0)")
    """
    reader = _SummaryReader()
    cleaned = {
        "optimizer_class": reader.text("optimizer_class", document.get("optimizer_class")),
        "global_step": reader.count("global_step", document.get("global_step")),
        "peak_measured_bytes": reader.count("peak_measured_bytes", document.get("peak_measured_bytes")),
        "measured": reader.figures("measured", document.get("measured"), ("num_bytes", "num_elements"), (),
                                   ("bytes_by_key", "bytes_by_dtype")),
        "estimate": reader.figures("estimate", document.get("estimate"), ("num_bytes", "num_params"),
                                   ("optimizer_class",), ("bytes_by_key",)),
        "what_if": reader.what_if(document.get("what_if")),
        "judgement": reader.judgement(document.get("judgement")),
    }
    return cleaned, reader.problems
