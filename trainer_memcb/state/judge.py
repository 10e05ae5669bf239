"""Measured against estimate, judged: by how many bytes the state differs, where, and why.

The estimate says what a rule expects each parameter's state to hold; the measurement says what
the state holds. Once every trainable parameter has state, the two should agree. When they do not,
`judge_state` says by how many bytes, in which state keys and dtypes, and, where the rule's
per-parameter numbers can tell, the likely cause:

| cause | what was seen |
|---|---|
| `32bit_where_8bit` | a state tensor of 4-byte values where the rule expected 1 byte per value (8-bit state) |
| `dtype_differs_from_param` | a parameter-sized state tensor in another dtype than the parameter's, where the rule expected the parameter's (fp32 moments for a bf16 parameter) |
| `frozen_param_state` | state for a parameter that does not train, from an optimizer whose rule makes none for it |
| `unknown_state_key` | a state key the rule does not know (a subclass that keeps more) |
| `state_for_other_tensors` | state keyed by a tensor that is in none of the param groups (a parameter taken out of the groups, its state left behind) |
| `missing_state_key` | a key the rule expects that the state does not hold |
| `unexplained` | what is left of the difference once the causes above are counted |

The rule's per-parameter numbers are taken when the estimate is (`expect_state`), so a setting
changed after the estimate (a bitsandbytes override registered later) shows as a difference.
Judging walks the state once per parameter and key, reading metadata only; it runs once, when the
two first differ, and at the end of a run, never at every logged step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from trainer_memcb.state.estimate import StateEstimate, find_estimate_rule, param_infos
from trainer_memcb.state.measure import StateMeasurement, measure_optimizer_state
from trainer_memcb.utils.units import format_bytes
from trainer_memcb.state.unwrap import inner_optimizers

__all__ = [
    "CAUSES",
    "Cause",
    "ParamExpectation",
    "StateExpectation",
    "StateJudge",
    "StateJudgement",
    "expect_state",
    "judge_state",
]

# Each cause, as a person reads it.
CAUSES: Dict[str, str] = {
    "32bit_where_8bit": "32-bit state where 8-bit state was expected",
    "dtype_differs_from_param": "state in another dtype than its parameter's, where the rule expected the parameter's",
    "frozen_param_state": "state for parameters that do not train (requires_grad=False)",
    "unknown_state_key": "state the rule does not know",
    "state_for_other_tensors": "state for tensors that are in none of the optimizer's param groups",
    "missing_state_key": "state the rule expects that the optimizer does not hold",
    "unexplained": "a difference no cause above accounts for",
}


@dataclass(frozen=True)
class ParamExpectation:
    """What the rule expects one parameter's state to hold.

    Attributes:
        dtype: the parameter's dtype.
        numel: its values (a DTensor's local shard).
        requires_grad: whether it trains.
        bytes_by_key: the rule's bytes per state key for it; empty for a parameter the rule makes
            no state for.
    """

    dtype: torch.dtype
    numel: int
    requires_grad: bool
    bytes_by_key: Dict[str, int]


@dataclass(frozen=True)
class StateExpectation:
    """The rule's numbers per parameter, taken when the estimate is.

    Attributes:
        params: by `id(param)` (the optimizer's state is keyed by the parameters themselves).
        shared_bytes_by_key: keys held once per optimizer (bitsandbytes' quantization maps).
        includes_frozen: the rule makes state for parameters that do not train too.
    """

    params: Dict[int, ParamExpectation]
    shared_bytes_by_key: Dict[str, int]
    includes_frozen: bool


def expect_state(optimizer: Any) -> Optional[StateExpectation]:
    """The rule's per-parameter numbers for `optimizer`, or None when no rule knows it.

    The same walk as `estimate_optimizer_state` (each tensor once, the same rules), kept per
    parameter.
    """
    params: Dict[int, ParamExpectation] = {}
    shared: Dict[str, int] = {}
    includes_frozen = False
    for inner in inner_optimizers(optimizer):
        rule = find_estimate_rule(type(inner))
        if rule is None:
            return None
        includes_frozen = includes_frozen or rule.includes_frozen
        infos = [info for info in param_infos(inner) if id(info.param) not in params]
        groups = inner.param_groups
        for info in infos:
            expected: Dict[str, int] = {}
            if info.requires_grad or rule.includes_frozen:
                expected = {key: int(num_bytes)
                            for key, num_bytes in rule.per_param(info, groups[info.group_index], inner).items()}
            # By identity only: holding the parameter would keep it alive after its optimizer.
            params[id(info.param)] = ParamExpectation(info.dtype, info.numel, info.requires_grad, expected)
        if rule.shared is not None:
            for key, num_bytes in rule.shared(inner, infos).items():
                shared[key] = shared.get(key, 0) + int(num_bytes)
    return StateExpectation(params, shared, includes_frozen)


@dataclass(frozen=True)
class Cause:
    """One likely cause of a difference.

    Attributes:
        kind: one of `CAUSES`.
        num_bytes: the part of measured minus estimate it accounts for (signed).
        state_keys: the state keys involved.
        dtypes: the dtypes the state holds there.
        param_dtypes: the dtypes of the parameters involved.
        num_params: parameter tensors involved.
    """

    kind: str
    num_bytes: int
    state_keys: Tuple[str, ...] = ()
    dtypes: Tuple[str, ...] = ()
    param_dtypes: Tuple[str, ...] = ()
    num_params: int = 0

    @property
    def description(self) -> str:
        return CAUSES[self.kind]

    def text(self) -> str:
        """One line: what, how many bytes, where."""
        where = []
        if self.state_keys:
            where.append("keys " + ", ".join(self.state_keys))
        if self.dtypes:
            where.append("held as " + ", ".join(self.dtypes))
        if self.param_dtypes:
            where.append("parameters " + ", ".join(self.param_dtypes))
        if self.num_params:
            where.append(f"{self.num_params:,} parameter tensor{'s' if self.num_params != 1 else ''}")
        return f"{self.description}: {_signed(self.num_bytes)}" + (f" ({'; '.join(where)})" if where else "")

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "description": self.description, "num_bytes": self.num_bytes,
                "state_keys": list(self.state_keys), "dtypes": list(self.dtypes),
                "param_dtypes": list(self.param_dtypes), "num_params": self.num_params}


@dataclass(frozen=True)
class StateJudgement:
    """Measured against estimate, once every trainable parameter has state.

    Attributes:
        measured_bytes: what the state holds.
        estimate_bytes: what the rule expects.
        difference_bytes: measured minus estimate (signed; 0 when they agree).
        bytes_by_key: per state key whose bytes differ: `(measured, estimate)`.
        dtypes_by_key: per such key, the measured bytes per dtype.
        causes: the likely causes, largest first; their bytes add up to `difference_bytes`.
    """

    measured_bytes: int
    estimate_bytes: int
    difference_bytes: int
    bytes_by_key: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    dtypes_by_key: Dict[str, Dict[str, int]] = field(default_factory=dict)
    causes: Tuple[Cause, ...] = ()

    @property
    def agrees(self) -> bool:
        return self.difference_bytes == 0

    def key_lines(self) -> List[str]:
        lines = []
        for key, (measured, estimated) in sorted(self.bytes_by_key.items()):
            dtypes = ", ".join(f"{name} {format_bytes(num)}" for name, num in sorted(self.dtypes_by_key.get(key, {}).items()))
            lines.append(f"{key}: measured {format_bytes(measured)}, estimate {format_bytes(estimated)}, "
                         f"{_signed(measured - estimated)}" + (f" ({dtypes})" if dtypes else ""))
        return lines

    def headline(self) -> str:
        """One sentence: agree, or by how much the state holds more or less."""
        if self.agrees:
            return f"measured and estimate agree: {self.measured_bytes:,} bytes ({format_bytes(self.measured_bytes)})"
        more = "more" if self.difference_bytes > 0 else "less"
        amount = abs(self.difference_bytes)
        return (f"the optimizer state holds {amount:,} bytes ({format_bytes(amount)}) {more} than estimated "
                f"(measured {self.measured_bytes:,}, estimate {self.estimate_bytes:,})")

    def text(self) -> str:
        """A few lines for people: the difference, by state key, and the likely causes."""
        lines = [f"Measured against estimate: {self.headline()}."]
        if self.bytes_by_key:
            lines += ["  by state key:"] + ["    " + line for line in self.key_lines()]
        if self.causes:
            lines += ["  likely causes:"] + ["    " + cause.text() for cause in self.causes]
        return "\n".join(lines)

    def message(self) -> str:
        """The warning: one paragraph."""
        parts = [self.headline()]
        if self.bytes_by_key:
            parts.append("by state key: " + "; ".join(self.key_lines()))
        if self.causes:
            parts.append("likely causes: " + "; ".join(cause.text() for cause in self.causes))
        return ". ".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "measured_bytes": self.measured_bytes,
            "estimate_bytes": self.estimate_bytes,
            "difference_bytes": self.difference_bytes,
            "bytes_by_key": {key: {"measured": measured, "estimate": estimated}
                             for key, (measured, estimated) in sorted(self.bytes_by_key.items())},
            "dtypes_by_key": {key: dict(sorted(dtypes.items())) for key, dtypes in sorted(self.dtypes_by_key.items())},
            "causes": [cause.to_dict() for cause in self.causes],
        }


def _signed(num_bytes: int) -> str:
    sign = "+" if num_bytes > 0 else "-" if num_bytes < 0 else ""
    return f"{sign}{abs(num_bytes):,} bytes ({sign}{format_bytes(abs(num_bytes))})"


class _OneEntry:
    """A stand-in optimizer whose state is one parameter's entry, for `measure_optimizer_state`."""

    param_groups: List[Any] = []

    def __init__(self, state: Dict[Any, Any]) -> None:
        self.state = state


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _states(optimizer: Any):
    """`(param, its state entry)` for every entry holding something, each parameter once."""
    seen = set()
    for inner in inner_optimizers(optimizer):
        state = getattr(inner, "state", None)
        if not isinstance(state, Mapping):
            continue
        for param, entry in list(state.items()):  # items() of a defaultdict never inserts
            if id(param) in seen or not isinstance(entry, Mapping) or not entry:
                continue
            seen.add(id(param))
            yield param, entry


def every_trainable_param_has_state(optimizer: Any, expectation: StateExpectation,
                                    measurement: StateMeasurement, estimate: StateEstimate) -> bool:
    """Whether the state is complete enough to judge: every trainable parameter has an entry.

    Where the state is keyed by other tensors than the param groups show (DeepSpeed ZeRO-3 outside
    its step), the count of entries stands in for the check.
    """
    with_state = {id(param) for param, _ in _states(optimizer)}
    trainable = [pid for pid, expected in expectation.params.items() if expected.requires_grad]
    if trainable and with_state & set(expectation.params):
        return all(pid in with_state for pid in trainable)
    return not measurement.is_empty and measurement.num_params_with_state >= estimate.num_param_tensors


class _Causes:
    """Causes found so far, merged by kind."""

    def __init__(self) -> None:
        self.by_kind: Dict[str, Dict[str, Any]] = {}

    def add(self, kind: str, num_bytes: int, key: Optional[str] = None, dtype: Optional[str] = None,
            param_dtype: Optional[str] = None, param_id: Optional[int] = None) -> None:
        found = self.by_kind.setdefault(kind, {"bytes": 0, "keys": [], "dtypes": [], "param_dtypes": [], "params": set()})
        found["bytes"] += num_bytes
        for name, value in (("keys", key), ("dtypes", dtype), ("param_dtypes", param_dtype)):
            if value is not None and value not in found[name]:
                found[name].append(value)
        if param_id is not None:
            found["params"].add(param_id)

    def causes(self) -> Tuple[Cause, ...]:
        made = [Cause(kind, found["bytes"], tuple(found["keys"]), tuple(found["dtypes"]),
                      tuple(found["param_dtypes"]), len(found["params"]))
                for kind, found in self.by_kind.items() if found["bytes"]]
        return tuple(sorted(made, key=lambda cause: -abs(cause.num_bytes)))


def judge_state(optimizer: Any, measurement: StateMeasurement, estimate: StateEstimate,
                expectation: Optional[StateExpectation] = None) -> StateJudgement:
    """Measured against estimate: by how much, in which keys and dtypes, and the likely causes.

    Args:
        optimizer: the optimizer measured (or a wrapper around it).
        measurement: from `measure_optimizer_state(optimizer)`.
        estimate: from `estimate_optimizer_state(optimizer)`.
        expectation: from `expect_state(optimizer)`, taken with the estimate; None takes it now.

    Examples:
        >>> import torch
        >>> from trainer_memcb import estimate_optimizer_state, measure_optimizer_state
        >>> from trainer_memcb.state.judge import judge_state
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> layer(torch.ones(1, 4)).sum().backward()
        >>> optimizer.step()
        >>> optimizer.state[layer.bias]["exp_avg"] = optimizer.state[layer.bias]["exp_avg"].double()
        >>> judged = judge_state(optimizer, measure_optimizer_state(optimizer), estimate_optimizer_state(optimizer))
        >>> judged.difference_bytes, [cause.kind for cause in judged.causes]
        (8, ['dtype_differs_from_param'])
    """
    if expectation is None:
        expectation = expect_state(optimizer) or StateExpectation({}, {}, False)
    difference = measurement.num_bytes - estimate.num_bytes
    changed = {key: (measurement.bytes_by_key.get(key, 0), estimate.bytes_by_key.get(key, 0))
               for key in set(measurement.bytes_by_key) | set(estimate.bytes_by_key)
               if measurement.bytes_by_key.get(key, 0) != estimate.bytes_by_key.get(key, 0)}
    if difference == 0 and not changed:
        return StateJudgement(measurement.num_bytes, estimate.num_bytes, 0)

    judging = _Judging(expectation, changed)
    for param, entry in _states(optimizer):
        judging.entry(param, entry)
    judging.shared_keys(measurement)
    causes = judging.causes
    accounted = sum(found["bytes"] for found in causes.by_kind.values())
    if accounted != difference:
        causes.add("unexplained", difference - accounted)
    return StateJudgement(measurement.num_bytes, estimate.num_bytes, difference, changed, judging.dtypes_by_key,
                          causes.causes())


class _Judging:
    """One judging's running state, shared by the walk over the parameters' entries and the keys
    held once per optimizer: the causes found, the dtypes of the keys that differ, and the
    parameters whose state is 32-bit where 8-bit was expected (their missing 8-bit scales, and a
    shared key's difference, are then put down to that same cause)."""

    def __init__(self, expectation: StateExpectation, changed: Mapping) -> None:
        self.expectation, self.changed = expectation, changed
        self.causes = _Causes()
        self.dtypes_by_key: Dict[str, Dict[str, int]] = {}
        self.eight_bit_params: set = set()

    def entry(self, param: Any, entry: Mapping) -> None:
        """One parameter's state entry, key by key, then the keys its rule expects that it lacks."""
        expectation = self.expectation
        expected = expectation.params.get(id(param))
        requires_grad = expected.requires_grad if expected is not None else bool(getattr(param, "requires_grad", True))
        frozen = not requires_grad and not expectation.includes_frozen
        param_dtype = _dtype_name(expected.dtype) if expected is not None else None
        wanted = dict(expected.bytes_by_key) if expected is not None and not frozen else {}
        for key, value in list(entry.items()):
            name = key if isinstance(key, str) else str(key)
            if name in expectation.shared_bytes_by_key:
                continue  # held once per optimizer: judged in `shared_keys`, over all parameters
            held = measure_optimizer_state(_OneEntry({param: {name: value}}))
            if held.num_bytes == 0 and name not in wanted:
                continue  # a plain Python value (bitsandbytes' int `step`): no tensor memory
            self._key(param, expected, frozen, param_dtype, name, held, wanted.pop(name, None))
        for name, want in wanted.items():
            if name in expectation.shared_bytes_by_key or not want:
                continue
            # 8-bit state's scales (`absmax1`) go with the 8-bit state that did not come.
            kind = "32bit_where_8bit" if id(param) in self.eight_bit_params else "missing_state_key"
            self.causes.add(kind, -want, name, None, param_dtype, id(param))

    def _key(self, param: Any, expected: Optional[ParamExpectation], frozen: bool, param_dtype: Optional[str],
             name: str, held: StateMeasurement, want: Optional[int]) -> None:
        """One key of a parameter's entry, holding `held`, against the bytes its rule wants (None: a
        key the rule does not know)."""
        for dtype, num_bytes in held.bytes_by_dtype.items():
            if name in self.changed:
                self.dtypes_by_key.setdefault(name, {})
                self.dtypes_by_key[name][dtype] = self.dtypes_by_key[name].get(dtype, 0) + num_bytes
        dtype = max(held.bytes_by_dtype, key=held.bytes_by_dtype.get) if held.bytes_by_dtype else None
        if expected is None and self.expectation.params:
            self.causes.add("state_for_other_tensors", held.num_bytes, name, dtype, None, id(param))
        elif frozen:
            self.causes.add("frozen_param_state", held.num_bytes, name, dtype, param_dtype, id(param))
        elif want is None:
            self.causes.add("unknown_state_key", held.num_bytes, name, dtype, param_dtype, id(param))
        elif held.num_bytes != want:
            kind = _mismatch_kind(expected, held, dtype, param_dtype, want)
            if kind == "32bit_where_8bit":
                self.eight_bit_params.add(id(param))
            self.causes.add(kind, held.num_bytes - want, name, dtype, param_dtype, id(param))

    def shared_keys(self, measurement: StateMeasurement) -> None:
        """The keys held once per optimizer, judged over all parameters at once."""
        for name, want in self.expectation.shared_bytes_by_key.items():
            held = measurement.bytes_by_key.get(name, 0)
            if held != want:
                kind = "32bit_where_8bit" if self.eight_bit_params else "missing_state_key" if not held else "unexplained"
                self.causes.add(kind, held - want, name)


def _mismatch_kind(expected: Optional[ParamExpectation], held: StateMeasurement, dtype: Optional[str],
                   param_dtype: Optional[str], want: int) -> str:
    """Why a known key holds other bytes than its rule wants, where the element counts can tell: 4-byte
    values where the rule counted one byte a value, or the parameter's size in another dtype."""
    numel = expected.numel if expected is not None else -1
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size() if dtype else 0
    if held.num_elements == numel and want == numel and itemsize == 4:
        return "32bit_where_8bit"
    if (expected is not None and held.num_elements == numel and dtype != param_dtype
            and want == numel * expected.dtype.itemsize):
        return "dtype_differs_from_param"
    return "unexplained"


class StateJudge:
    """The judging the monitor does for one optimizer: the rule's numbers taken with the estimate,
    then, once every trainable parameter has state, the logged difference and one judgement.
    Never raises out of `difference`: a failure leaves the figure out."""

    def __init__(self) -> None:
        self.expectation: Optional[StateExpectation] = None
        self._ready = False

    def expect(self, optimizer: Any) -> None:
        """Take the rule's per-parameter numbers now, as the estimate is taken."""
        self.expectation = expect_state(optimizer)

    def difference(self, optimizer: Any, measurement: Optional[StateMeasurement],
                   estimate: Optional[StateEstimate]) -> Optional[int]:
        """Measured minus estimate, once every trainable parameter has state; else None."""
        if measurement is None or estimate is None or measurement.is_empty or self.expectation is None:
            return None
        if not self._ready:
            self._ready = every_trainable_param_has_state(optimizer, self.expectation, measurement, estimate)
            if not self._ready:
                return None
        return measurement.num_bytes - estimate.num_bytes

    def judge(self, optimizer: Any, measurement: Optional[StateMeasurement],
              estimate: Optional[StateEstimate]) -> Optional[StateJudgement]:
        """The judgement, once every trainable parameter has state; else None."""
        if self.difference(optimizer, measurement, estimate) is None:
            return None
        return judge_state(optimizer, measurement, estimate, self.expectation)
