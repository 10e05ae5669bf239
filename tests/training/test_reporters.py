"""Every logged key, breakdowns on, read back from each `report_to` reporter after a real run.

One tiny Trainer run per reporter (2 logged steps and an evaluation), with every breakdown on.
Each reporter must then hold every one of our keys, at every entry the Trainer logged it, with the
exact value: TensorBoard (its event files), W&B in offline mode (its `.wandb` file), MLflow with
its default store and with a file store (through `MlflowClient`), and DVCLive (its metric files).
A reporter whose package is missing is skipped; `pip install 'trainer_memcb[test]'` installs all.

Breakdown keys once nested under `optimizer_state_bytes` (`optimizer_state_bytes/by_key/exp_avg`):
DVCLive then raised inside `trainer.train()`, and MLflow's file store lost every breakdown metric.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
from transformers import Trainer

from helpers import TinyDataset, independent_saved_bytes, tiny_classifier, training_args
from test_callback_logging import adamw_figures
from trainer_memcb import OptimizerMemoryCallback
from trainer_memcb.training.activations_probe import ACTIVATIONS_SUPPORTED
from trainer_memcb.training.figures import (
    ACTIVATIONS_BYTES,
    ACTIVATIONS_PEAK_BYTES,
    BREAKDOWN_KEY_PREFIXES,
    ESTIMATE_BYTES,
    KEY_DESCRIPTIONS,
    MEASURED_BYTES,
    MEASURED_ELEMENTS,
    TRAINABLE_PARAMS,
    UNEXPECTED_BYTES,
    MODEL_GRADS_BYTES,
    MODEL_PARAMS_BYTES,
    MODEL_STATES_BYTES,
    MODEL_STATES_ESTIMATE_BYTES,
    breakdown_key,
)

Series = Dict[str, List[Tuple[int, float]]]


def _is_ours(key: str) -> bool:
    name = key[len("eval_"):] if key.startswith("eval_") else key
    return name in KEY_DESCRIPTIONS or name.startswith(tuple(BREAKDOWN_KEY_PREFIXES.values()))


def _planned_forward_peak(model: torch.nn.Module, batch_size: int) -> int:
    from trainer_memcb.plan.answers.eval_memory import EvalSettings, plan_eval_memory

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return type(model)(model.config)

    return plan_eval_memory(build, EvalSettings(batch_size=batch_size, samples=batch_size, seq_len=8)).forward_peak_bytes


def run_reporting_to(reporter: str, tmp_path: Any, monkeypatch: Any) -> Tuple[Trainer, Series]:
    """Train 2 logged steps and evaluate at step 2, reporting to `reporter` from inside `tmp_path`;
    the Trainer and our keys as it logged them: key -> [(step, value), ...]."""
    monkeypatch.chdir(tmp_path)  # reporters that write into the working directory write here
    trainer = Trainer(
        model=tiny_classifier(),
        args=training_args(str(tmp_path / "out"), max_steps=2, eval_strategy="steps", eval_steps=2,
                           report_to=[reporter]),
        train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1),
        callbacks=[OptimizerMemoryCallback(breakdown=("key", "dtype", "device"), summary_file=None, what_if=(),
                                           eval_keys="all")],
    )
    trainer.train()
    series: Series = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if _is_ours(key):
                series.setdefault(key, []).append((entry["step"], value))
    # What the run logged, exactly: AdamW on the tiny model, every key at steps 1 and 2, and the
    # evaluation's at step 2.
    figures = adamw_figures(trainer.model)
    total, num_params = figures[MEASURED_BYTES], figures[TRAINABLE_PARAMS]
    assert (total, num_params) == (29808, 3714)
    per_entry = {
        # One process: no `..._total_bytes`, which would only repeat its figure; measured and
        # estimate agree once every parameter has state.
        MEASURED_BYTES: total, MEASURED_ELEMENTS: figures[MEASURED_ELEMENTS],
        ESTIMATE_BYTES: total, TRAINABLE_PARAMS: num_params, UNEXPECTED_BYTES: 0,
        breakdown_key("key", "exp_avg"): 4 * num_params,
        breakdown_key("key", "exp_avg_sq"): 4 * num_params,
        breakdown_key("key", "step"): 4 * 24,
        breakdown_key("dtype", "float32"): total,
        breakdown_key("device", "cpu"): total,
        # The four model states: fp32 weights and as many bytes of gradients, plus the state.
        MODEL_PARAMS_BYTES: 4 * num_params, MODEL_GRADS_BYTES: 4 * num_params,
        MODEL_STATES_BYTES: 8 * num_params + total, MODEL_STATES_ESTIMATE_BYTES: 8 * num_params + total,
    }
    expected = {key: [(1, value), (2, value)] for key, value in per_entry.items()}
    expected.update({f"eval_{key}": [(2, value)] for key, value in per_entry.items()})
    # What the evaluation held: without compute_metrics only the losses, 8 samples of fp32; and its
    # forward's peak, as the evaluation plan traces it under fake tensors.
    expected.update({f"eval_{key}": [(2, 8 * 4)] for key in (
        "containers_device_bytes", "containers_host_bytes", "concat_peak_bytes", "host_concat_peak_bytes")})
    expected["eval_forward_peak_bytes"] = [(2, _planned_forward_peak(trainer.model, batch_size=8))]
    if ACTIVATIONS_SUPPORTED:  # torch 2.8 and newer (trainer_memcb.training.activations_probe)
        # The activations, in training entries only: what a forward on a batch of 4 saves for backward.
        batch = TinyDataset(4)
        trainer.model.train()
        activations = independent_saved_bytes(trainer.model, {"input_ids": batch.input_ids, "labels": batch.labels})
        expected.update({key: [(1, activations), (2, activations)]
                         for key in (ACTIVATIONS_BYTES, ACTIVATIONS_PEAK_BYTES)})
    assert series == expected
    return trainer, series


def as_reported(key: str) -> str:
    """transformers' `rewrite_logs`, as the TensorBoard and W&B callbacks apply it."""
    return key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"


def test_tensorboard_holds_every_key_exactly(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, logged = run_reporting_to("tensorboard", tmp_path, monkeypatch)
    (log_dir,) = glob.glob(os.path.join(trainer.args.output_dir, "runs", "*"))
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    # float32 in the file: these integers are below 2**24, so they come back exact.
    read_back = {key: [(event.step, event.value) for event in events.Scalars(as_reported(key))] for key in logged}
    assert read_back == logged


def test_tensorboard_figures_read_back_by_the_cli_readers(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from trainer_memcb.cli.report import run_report
    from trainer_memcb.runs.run_logs import load_run

    trainer, logged = run_reporting_to("tensorboard", tmp_path, monkeypatch)
    report = run_report(load_run(trainer.args.output_dir))  # no trainer_state.json, no summary
    assert report.summary_file is None and report.history_is_float32
    assert report.measured_by_key == {"exp_avg": 14856, "exp_avg_sq": 14856, "step": 96}
    assert report.measured_by_dtype == {"float32": 29808}
    assert report.measured_bytes == 29808


def _wandb_records(path: str) -> List[bytes]:
    """The records of a `.wandb` file: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then
    LevelDB's log format: 32 KiB blocks of chunks, each with a 7-byte header (checksum, length,
    type: 1 whole record, 2 first, 3 middle, 4 last part of one). Checksums are not checked."""
    with open(path, "rb") as handle:
        data = handle.read()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    block, position, records, pending = 32 * 1024, 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    return records


def test_wandb_offline_holds_every_key_exactly(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed")
    from wandb.proto import wandb_internal_pb2

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_CONSOLE": "off", "WANDB_PROJECT": "trainer-memcb-test"}.items():
        monkeypatch.setenv(name, value)
    try:
        _, logged = run_reporting_to("wandb", tmp_path, monkeypatch)
    finally:
        wandb.finish()
        wandb.teardown()  # the service writes the rest of the run's file as it shuts down
    (path,) = glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "run-*.wandb"))
    read_back: Series = {}
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for key in logged:
            if as_reported(key) in row:
                read_back.setdefault(key, []).append((row["train/global_step"], row[as_reported(key)]))
    assert read_back == logged


@pytest.fixture
def mlflow_uri_reset():
    """MLflow keeps the tracking URI process-wide (and in MLFLOW_TRACKING_URI): start and end unset."""
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed")
    mlflow.set_tracking_uri(None)
    yield mlflow
    if mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


def _mlflow_read_back(mlflow: Any, logged: Series) -> Series:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow.get_tracking_uri())
    (run,) = client.search_runs(experiment_ids=[exp.experiment_id for exp in client.search_experiments()])
    assert run.info.status == "FINISHED"
    read_back: Series = {}
    for key in logged:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        read_back[key] = [(metric.step, metric.value) for metric in history]
    return read_back


def _file_store_warning(uri: str) -> str:
    return (f"trainer_memcb: MLflow's file store ({uri}) can lose a breakdown key's values: the Trainer's MLflow "
            "reporter logs on several threads, and two entries that make a key's folder at once fail one of them "
            "(MLflow logs 'File exists' and drops that entry); set MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE=1 before "
            "training, or use a database store")


def _mlflow_warnings(run: Any) -> Tuple[Any, List[str]]:
    """What `run()` returns, and the callback's warnings about MLflow's file store while it ran."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught if str(w.message).startswith("trainer_memcb: MLflow's file store")]


def test_mlflow_default_store_holds_every_key_exactly(tmp_path, monkeypatch, mlflow_uri_reset):
    mlflow = mlflow_uri_reset
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", raising=False)
    (_, logged), said = _mlflow_warnings(lambda: run_reporting_to("mlflow", tmp_path, monkeypatch))
    uri = mlflow.get_tracking_uri()  # the default: a store in the working directory
    assert str(tmp_path) in uri, uri
    # MLflow 3's default is a database, which makes no folders; MLflow 2's was a file store.
    assert said == ([] if uri.startswith("sqlite:") else [_file_store_warning(uri)])
    assert _mlflow_read_back(mlflow, logged) == logged


def test_mlflow_file_store_holds_every_key_exactly(tmp_path, monkeypatch, mlflow_uri_reset):
    mlflow = mlflow_uri_reset
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())  # file:///...
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store otherwise
    # The Trainer's MLflow reporter logs asynchronously, on up to 10 threads by default. The file
    # store makes a nested key's folder with a check then a makedirs (make_containing_dirs), so two
    # batches that reach a new folder at once can fail one, and that batch's later keys are lost
    # (seen: step 1 of seven keys). One thread, as the guide advises for a file store.
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", "1")
    (_, logged), said = _mlflow_warnings(lambda: run_reporting_to("mlflow", tmp_path, monkeypatch))
    assert mlflow.get_tracking_uri() == store.as_uri()
    assert said == []
    assert _mlflow_read_back(mlflow, logged) == logged
    # The file store keeps a metric as a file: a nested key is a folder beside its parent's file.
    (run_dir,) = glob.glob(str(store / "*" / "*" / "metrics"))
    assert os.path.isfile(os.path.join(run_dir, "optimizer_state_bytes"))
    assert os.path.isfile(os.path.join(run_dir, "optimizer_state_bytes_by_key", "exp_avg"))


def test_mlflow_file_store_on_several_threads_is_warned_of_once(tmp_path, monkeypatch, mlflow_uri_reset):
    mlflow = mlflow_uri_reset
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", raising=False)
    # The run's values may be lost here (that is the warning's subject): only the warning is held.
    _, said = _mlflow_warnings(lambda: run_reporting_to("mlflow", tmp_path, monkeypatch))
    assert said == [_file_store_warning(store.as_uri())]
    assert mlflow.get_tracking_uri() == store.as_uri()


def test_dvclive_holds_every_key_exactly(tmp_path, monkeypatch):
    pytest.importorskip("dvclive", reason="dvclive is not installed")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("DVCLIVE_OPEN", "false")
    _, logged = run_reporting_to("dvclive", tmp_path, monkeypatch)
    metrics_dir = tmp_path / "dvclive" / "plots" / "metrics"
    read_back: Dict[str, List[float]] = {}
    for key in logged:
        # DVCLive's Hugging Face naming: eval_ -> eval/; training keys stay as they are. Its steps
        # are its own count of log calls, so only the values are compared, in order.
        name = key.replace("eval_", "eval/", 1)
        with open(metrics_dir / f"{name}.tsv", encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        read_back[key] = [float(row[name.rsplit("/", 1)[-1]]) for row in rows]
    assert read_back == {key: [float(value) for _, value in points] for key, points in logged.items()}
    # The latest values, nested by `/` in metrics.json: a breakdown beside the total, not under it.
    with open(tmp_path / "dvclive" / "metrics.json", encoding="utf-8") as handle:
        latest = json.load(handle)
    assert latest[MEASURED_BYTES] == 29808
    assert latest["optimizer_state_bytes_by_key"] == {"exp_avg": 14856, "exp_avg_sq": 14856, "step": 96}
    assert latest["eval"]["optimizer_state_bytes_by_device"] == {"cpu": 29808}
