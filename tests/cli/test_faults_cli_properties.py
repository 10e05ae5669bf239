"""Property tests of the readers behind `trainer-memcb report`: whatever bytes a run folder's
`trainer_state.json`, `optimizer_memory.json` or TensorBoard event file holds, the command answers
with figures of the right types (exit 0, at most one warning line per file) or with one line
naming the file (exit 1, after those warnings when the values left hold no figure); never a traceback, and within hypothesis' deadline for each example.

Every example writes real files into a fresh folder and runs the command in-process via `main`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import tempfile
from datetime import timedelta
from typing import Any, Dict, Optional

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer_memcb.cli import main  # noqa: E402

# Modest: the suite stays fast; a deadline per example rather than a timing assertion.
PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow],
)
MEASURED = "optimizer_state_bytes"
KEYS = (
    "step", "loss", "epoch", MEASURED, "optimizer_state_estimate_bytes", "optimizer_trainable_params",
    f"{MEASURED}_by_key/exp_avg", f"{MEASURED}/by_dtype/float32", "eval_accuracy", "eval_f1",
    f"eval_{MEASURED}", "optimizer_state_unexpected_bytes",
)
JSON_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
ANY_JSON = st.recursive(JSON_SCALARS, lambda children: st.lists(children, max_size=4)
                        | st.dictionaries(st.text(max_size=6), children, max_size=4), max_leaves=12)
# Mostly numbers where numbers belong, and now and then anything at all.
VALUES = st.one_of(st.integers(min_value=0, max_value=2**40), st.integers(min_value=-5, max_value=2**64),
                   st.floats(allow_nan=True, allow_infinity=True), ANY_JSON)
STEPS = st.one_of(st.integers(min_value=0, max_value=10**6), VALUES)
ENTRIES = st.fixed_dictionaries({"step": STEPS}, optional={key: VALUES for key in KEYS[1:]})


def _run(run_dir: str, *options: str) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", run_dir, "--json", *options])
    return code, out.getvalue(), err.getvalue()


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _is_count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63)


def _check(run_dir: str, files: int, *options: str) -> Optional[Dict[str, Any]]:
    """Figures of the right types, or one line; returns the document when there are figures."""
    code, out, err = _run(run_dir, "--no-plot" if not options else options[0], *options[1:])
    lines = err.splitlines()
    assert "Traceback" not in err
    assert all(line.startswith("trainer-memcb: ") for line in lines), err
    if code == 1:  # one line saying why, after at most one warning per file read (a run without figures)
        assert out == "" or _strict(out)["plot"] is None
        assert len(lines) <= files + 1 and not lines[-1].startswith("trainer-memcb: warning: "), err
        assert all(line.startswith("trainer-memcb: warning: ") for line in lines[:-1]), err
        return None
    assert code == 0, err
    assert len(lines) <= files, err  # at most one warning per file read
    assert all(line.startswith("trainer-memcb: warning: ") for line in lines), err
    document = _strict(out)
    for step in document["steps"]:
        assert isinstance(step["step"], int) and step["step"] >= 0
        assert _is_count(step["measured_bytes"]) and _is_count(step["estimate_bytes"])
    for evaluation in document["evals"]:
        assert isinstance(evaluation["step"], int) and _is_count(evaluation["measured_bytes"])
        assert all(value is None or isinstance(value, (int, float)) for value in evaluation["metrics"].values())
    for name in ("measured_bytes", "estimate_bytes", "peak_measured_bytes", "trainable_params"):
        assert _is_count(document[name]), name
    for breakdown in ("measured_by_key", "measured_by_dtype", "estimate_by_key"):
        assert all(isinstance(key, str) and _is_count(value) for key, value in document[breakdown].items())
    return document


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


# -- trainer_state.json ---------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=400))
def test_trainer_state_any_bytes(data):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, "trainer_state.json"), data)
        _check(run_dir, 1)


@PROPERTY_SETTINGS
@given(document=ANY_JSON)
def test_trainer_state_any_json(document):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, "trainer_state.json"), json.dumps({"log_history": document}).encode())
        _check(run_dir, 1)


@PROPERTY_SETTINGS
@given(history=st.lists(st.one_of(ENTRIES, st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6)), max_size=8),
       plot=st.booleans())
def test_trainer_state_entries_of_any_values_plotted_or_not(history, plot):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, "trainer_state.json"), json.dumps({"log_history": history}).encode())
        options = ("--plot", os.path.join(run_dir, "plot.png")) if plot else ()
        document = _check(run_dir, 1, *options)
        if document is not None and plot:
            assert document["plot"] == os.path.join(run_dir, "plot.png")
        assert not [name for name in os.listdir(run_dir) if name.endswith(".partial")]


# -- optimizer_memory.json ------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=400))
def test_summary_any_bytes(data):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, "optimizer_memory.json"), data)
        _check(run_dir, 1)


SECTIONS = st.fixed_dictionaries({
    "measured": st.one_of(ANY_JSON, st.fixed_dictionaries({}, optional={
        "num_bytes": VALUES, "bytes_by_key": st.dictionaries(st.text(max_size=5), VALUES, max_size=3),
        "bytes_by_dtype": ANY_JSON})),
    "estimate": st.one_of(ANY_JSON, st.fixed_dictionaries({}, optional={
        "num_bytes": VALUES, "num_params": VALUES, "optimizer_class": ANY_JSON, "bytes_by_key": ANY_JSON})),
}, optional={
    "optimizer_class": ANY_JSON, "peak_measured_bytes": VALUES,
    "what_if": st.one_of(ANY_JSON, st.fixed_dictionaries({}, optional={
        "trainable_params": VALUES,
        "optimizers": st.one_of(ANY_JSON, st.lists(st.one_of(ANY_JSON, st.fixed_dictionaries({}, optional={
            "name": ANY_JSON, "estimate": st.one_of(ANY_JSON, st.fixed_dictionaries({"num_bytes": VALUES})),
            "problem": ANY_JSON})), max_size=3))})),
})


@PROPERTY_SETTINGS
@given(document=SECTIONS, tables=st.booleans())
# A key holding a character str.splitlines() breaks at (NEL), once named raw in the warning.
@example(document={"measured": {"bytes_by_dtype": {"\x85": False}}, "estimate": {}}, tables=False)
def test_summary_sections_of_any_shape(document, tables):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, "optimizer_memory.json"), json.dumps(document).encode())
        assert _check(run_dir, 1) is not None
        if tables:  # the tables read the same fields
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                assert main(["report", run_dir, "--no-plot"]) == 0
            assert out.getvalue().startswith("Run ") and "Traceback" not in err.getvalue()


# -- TensorBoard event files -----------------------------------------------------------------------

event_pb2 = pytest.importorskip("tensorboard.compat.proto.event_pb2")
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # noqa: E402

EVENT_FILE = os.path.join("runs", "x", "events.out.tfevents.1.host")
TAGS = ("train/" + MEASURED, "train/optimizer_state_estimate_bytes", "eval/accuracy", "eval/f1",
        "eval/" + MEASURED, "train/loss", "other", "train/optimizer_state_bytes_by_key/exp_avg")


def _record(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", masked_crc32c(length)) + payload + struct.pack("<I", masked_crc32c(payload))


@st.composite
def _values(draw) -> Any:
    tag = draw(st.sampled_from(TAGS))
    if draw(st.integers(min_value=0, max_value=3)):
        return summary_pb2.Summary.Value(tag=tag, simple_value=draw(st.one_of(
            st.integers(min_value=0, max_value=2**24).map(float), st.floats(width=32))))
    dtype = draw(st.sampled_from([types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_INT64, types_pb2.DT_INT32,
                                  types_pb2.DT_STRING, types_pb2.DT_BOOL, types_pb2.DT_HALF]))
    dims = draw(st.lists(st.integers(min_value=-1, max_value=3), max_size=2))
    tensor = tensor_pb2.TensorProto(
        dtype=dtype, tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[
            tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in dims]),
        tensor_content=draw(st.binary(max_size=16)),
    )
    if draw(st.booleans()):
        tensor.double_val.extend(draw(st.lists(st.floats(), max_size=2)))
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor)


@st.composite
def _event_file(draw) -> bytes:
    records = []
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        step = draw(st.one_of(st.integers(min_value=0, max_value=1000), st.integers(min_value=-(2**63), max_value=2**63 - 1)))
        event = event_pb2.Event(step=step, wall_time=1.0)
        event.summary.value.extend(draw(st.lists(_values(), max_size=3)))
        records.append(_record(event.SerializeToString()))
    data = b"".join(records)
    cut = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=len(data))))
    return data if cut is None else data[:cut]


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=400))
def test_event_file_any_bytes(data):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, EVENT_FILE), data)
        _check(run_dir, 1)


@PROPERTY_SETTINGS
@given(payloads=st.lists(st.binary(max_size=60), max_size=4))
def test_event_file_of_good_records_holding_any_bytes(payloads):
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, EVENT_FILE), b"".join(_record(payload) for payload in payloads))
        _check(run_dir, 1)


@PROPERTY_SETTINGS
@given(data=_event_file(), flip=st.one_of(st.none(), st.tuples(st.integers(min_value=0), st.integers(1, 255))))
def test_event_file_of_events_holding_any_values_cut_or_damaged(data, flip):
    if flip is not None and data:
        position = flip[0] % len(data)
        data = data[:position] + bytes([data[position] ^ flip[1]]) + data[position + 1:]
    with tempfile.TemporaryDirectory() as run_dir:
        _write(os.path.join(run_dir, EVENT_FILE), data)
        _check(run_dir, 1)


def test_a_record_claiming_more_bytes_than_the_file_holds_ends_the_file(tmp_path, capsys):
    # The length is checked against the file before anything is read: no 2**62-byte allocation.
    event = event_pb2.Event(step=1)
    event.summary.value.add(tag="train/" + MEASURED, simple_value=88.0)
    length = struct.pack("<Q", 2**62)
    data = _record(event.SerializeToString()) + length + struct.pack("<I", masked_crc32c(length)) + b"\0" * 16
    _write(os.path.join(str(tmp_path), EVENT_FILE), data)
    assert main(["report", str(tmp_path), "--json", "--no-plot"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert [(s["step"], s["measured_bytes"]) for s in _strict(captured.out)["steps"]] == [(1, 88)]
