"""The TensorBoard view: custom-scalar charts and the text summary, read back through a real
TensorBoard server and looked at in a real headless Chromium.

The runs are real `Trainer` runs on the tiny DistilBERT (CPU, 4 steps, one evaluation) reporting
to TensorBoard, and a real Accelerate loop with its TensorBoard tracker. The browser test starts
`tensorboard` on a free loopback port, checks the layout, the tags and the exact values through
TensorBoard's HTTP data API, then saves a screenshot of the Custom Scalars tab from Chromium under
the test's temporary folder. It skips, saying why, only when Chromium is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import pytest
import torch
from accelerate import Accelerator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from transformers import Trainer

import trainer_memcb.training.tensorboard_view
from helpers import TinyDataset, accuracy_and_f1, independent_saved_bytes, tiny_classifier, training_args
from trainer_memcb import OptimizerMemoryCallback, OptimizerMemoryLogger
from trainer_memcb.training.activations_probe import ACTIVATIONS_SUPPORTED
from trainer_memcb.training.tensorboard_view import EVENT_FILE_SUFFIX, layout_charts, loop_tag, trainer_tag
from trainer_memcb.utils.units import format_bytes

ADAMW_BYTES = 29_808  # the tiny model's AdamW state: 2 x 3,714 fp32 values + 24 fp32 steps
MODEL_BYTES = 14_856  # the tiny model's fp32 parameters (3,714 values), and as many bytes of gradients
ADAFACTOR_BYTES = 2_512  # transformers' Adafactor, factored: see tests/state/test_estimate_rules.py
FROZEN_BYTES = 8_196  # word embeddings 64 x 16: two fp32 moments + a step, kept after freezing
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
SCREEN = (1400, 1100)
# Where the charts are in a screenshot of that size (the runs panel is left of it, the tabs above).
CHARTS_LEFT, HEADER_HEIGHT = 370, 80
# TensorBoard's colours for the first three runs it lists: orange, blue, red.
RUN_COLOURS = ((255, 112, 67), (0, 119, 187), (204, 51, 17))

# Each test makes its own Accelerator (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def train(output_dir: str, optim: str = "adamw_torch", freeze_embeddings_after_a_step: bool = False) -> Trainer:
    model = tiny_classifier()
    optimizers: Any = (None, None)
    if freeze_embeddings_after_a_step:  # one step of everything, then the embeddings stop training
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
        batch = TinyDataset(4)
        model(input_ids=batch.input_ids, labels=batch.labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.distilbert.embeddings.word_embeddings.weight.requires_grad_(False)
        optimizers = (optimizer, None)
    trainer = Trainer(
        model=model,
        args=training_args(output_dir, optim=optim, report_to=["tensorboard"], max_steps=4, logging_steps=1,
                           eval_strategy="steps", eval_steps=4),
        train_dataset=TinyDataset(16), eval_dataset=TinyDataset(8, seed=1), compute_metrics=accuracy_and_f1,
        optimizers=optimizers, callbacks=[OptimizerMemoryCallback()],
    )
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Three runs under one log dir, as the main job makes them: AdamW, Adafactor, and AdamW whose
    state still holds the moments of embeddings frozen after a first step."""
    root = tmp_path_factory.mktemp("tensorboard_runs")
    trainers = {
        "adamw": train(str(root / "adamw")),
        "adafactor": train(str(root / "adafactor"), optim="adafactor"),
    }
    with pytest.warns(RuntimeWarning, match="state for parameters that do not train"):
        trainers["adamw_frozen"] = train(str(root / "adamw_frozen"), freeze_embeddings_after_a_step=True)
    folders = {}
    for name in trainers:
        (folder,) = os.listdir(root / name / "runs")  # the reporter's <time>_<host> folder
        folders[name] = f"{name}/runs/{folder}"
    return SimpleNamespace(root=str(root), trainers=trainers, folders=folders)


def read_events(folder: str) -> EventAccumulator:
    events = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def layout_of(events: EventAccumulator) -> Dict[str, Dict[str, List[str]]]:
    (point,) = events.Tensors("custom_scalars__config__")[-1:]
    layout = layout_pb2.Layout()
    layout.ParseFromString(point.tensor_proto.string_val[0])
    return {category.title: {chart.title: list(chart.multiline.tag) for chart in category.chart}
            for category in layout.category}


# -- the layout, from the keys logged ------------------------------------------------------------


def test_layout_charts_only_what_was_logged_measured_and_estimate_together():
    # Evaluation entries repeat the training measurement at their step: no chart of their own.
    one_process = {"": ["optimizer_state_bytes", "optimizer_state_estimate_bytes", "optimizer_state_unexpected_bytes"],
                   "eval": ["optimizer_state_bytes", "optimizer_state_estimate_bytes"]}
    assert layout_charts(one_process, trainer_tag) == {"Optimizer memory": {
        "optimizer state, measured and estimate (bytes)": [
            "Multiline", ["^train/optimizer_state_bytes$", "^train/optimizer_state_estimate_bytes$"]],
        "measured minus estimate (bytes)": ["Multiline", ["^train/optimizer_state_unexpected_bytes$"]],
    }}
    # Several processes (totals), ZeRO (master weights), a breakdown; tags as accelerate logs them.
    job = {"": ["optimizer_state_bytes", "optimizer_state_total_bytes", "optimizer_state_estimate_bytes",
                "optimizer_state_estimate_total_bytes", "optimizer_master_weights_bytes",
                "optimizer_state_bytes/by_key/exp_avg", "optimizer_state_bytes/by_key/step"]}
    assert layout_charts(job, loop_tag) == {"Optimizer memory": {
        "optimizer state, measured and estimate (bytes)": [
            "Multiline", ["^optimizer_state_bytes$", "^optimizer_state_estimate_bytes$"]],
        "job total over all processes, measured and estimate (bytes)": [
            "Multiline", ["^optimizer_state_total_bytes$", "^optimizer_state_estimate_total_bytes$"]],
        "DeepSpeed ZeRO master weights (bytes)": ["Multiline", ["^optimizer_master_weights_bytes$"]],
        "optimizer_state_bytes/by_key (bytes)": ["Multiline", ["^optimizer_state_bytes/by_key/"]],
    }}
    # A run that only evaluates gets its evaluation charts.
    assert layout_charts({"eval": ["optimizer_state_estimate_bytes"]}, loop_tag) == {"Optimizer memory": {
        "eval: optimizer state, measured and estimate (bytes)": ["Multiline", ["^eval_optimizer_state_estimate_bytes$"]]}}
    assert layout_charts({"test": ["optimizer_state_bytes"]}, trainer_tag) == {"Optimizer memory": {
        "test: optimizer state, measured and estimate (bytes)": ["Multiline", ["^test/optimizer_state_bytes$"]]}}
    assert layout_charts({}, trainer_tag) == {}


def test_layout_charts_the_steps_memory_by_part_measured_and_planned():
    logged = {"": ["optimizer_state_bytes", "optimizer_state_estimate_bytes", "model_params_bytes", "model_grads_bytes",
                   "model_states_bytes", "model_states_estimate_bytes", "activations_bytes", "activations_peak_bytes",
                   "device_peak_allocated_bytes"],
              "eval": ["optimizer_state_bytes", "model_params_bytes"]}
    assert layout_charts(logged, trainer_tag) == {"Optimizer memory": {
        "optimizer state, measured and estimate (bytes)": [
            "Multiline", ["^train/optimizer_state_bytes$", "^train/optimizer_state_estimate_bytes$"]],
        "the step's memory by part, measured (bytes)": ["Multiline", [
            "^train/model_params_bytes$", "^train/model_grads_bytes$", "^train/optimizer_state_bytes$",
            "^train/activations_bytes$"]],
        "model states and activations, measured and planned (bytes)": ["Multiline", [
            "^train/model_states_bytes$", "^train/model_states_estimate_bytes$", "^train/activations_bytes$",
            "^train/activations_peak_bytes$", "^train/device_peak_allocated_bytes$"]],
    }}
    # The optimizer state alone is no step's memory by part: that chart would repeat the first.
    assert list(layout_charts({"": ["optimizer_state_bytes"]}, loop_tag)["Optimizer memory"]) == [
        "optimizer state, measured and estimate (bytes)"]


def test_docstring_examples_run():
    import doctest

    results = doctest.testmod(trainer_memcb.training.tensorboard_view, optionflags=doctest.ELLIPSIS)
    assert (results.failed, results.attempted) == (0, 8)


# -- what the Trainer run folders hold -------------------------------------------------------------


def test_the_view_is_written_into_the_reporters_own_run_folder(runs):
    for name, folder in runs.folders.items():
        files = os.listdir(os.path.join(runs.root, folder))
        assert sorted(file.endswith(EVENT_FILE_SUFFIX) for file in files) == [False, True], name  # the reporter's, ours
        events = read_events(os.path.join(runs.root, folder))
        assert set(layout_of(events)) == {"Optimizer memory"}
        assert "optimizer_memory/text_summary" in events.Tags()["tensors"]


def test_one_evaluation_is_a_table_in_the_text_tab(runs):
    # One evaluation (step 4): each eval/ card of the Time Series tab holds one point, which its line
    # chart does not draw (seen in Chromium; the Custom Scalars charts mark single points).
    # The table, written as the entry is logged, gives every figure of it.
    for name, trainer in runs.trainers.items():
        [entry] = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
        events = read_events(os.path.join(runs.root, runs.folders[name]))
        [text] = events.Tensors("optimizer_memory_evaluation/text_summary")
        assert text.step == 4
        lines = text.tensor_proto.string_val[0].decode("utf-8").splitlines()
        assert lines[:4] == [
            "**Evaluation at step 4**: the figures of the `eval` entry (a Time Series card of one evaluation holds one "
            "point, which its line chart does not draw); MiB and GiB are 1024-based.", "",
            "| tag | value |", "|---|---|"]
        rows = [line.split(" | ") for line in lines[4:]]
        # The entry's order: the Trainer's metrics, then the memory figures.
        assert [row[0][2:] for row in rows] == [f"eval/{key[5:]}" for key in entry if key.startswith("eval_")]
        values = {row[0][2:]: row[1][:-2] for row in rows}
        measured = {"adamw": ADAMW_BYTES, "adafactor": ADAFACTOR_BYTES, "adamw_frozen": ADAMW_BYTES}[name]
        estimate = measured - (FROZEN_BYTES if name == "adamw_frozen" else 0)
        assert values["eval/optimizer_state_bytes"] == f"{format_bytes(measured)} ({measured:,} bytes)"
        assert values["eval/optimizer_state_estimate_bytes"] == f"{format_bytes(estimate)} ({estimate:,} bytes)"
        device = entry["eval_containers_device_bytes"]
        assert values["eval/containers_device_bytes"] == f"{format_bytes(device)} ({device:,} bytes)"
        assert (values["eval/loss"], values["eval/accuracy"]) == (repr(entry["eval_loss"]), repr(entry["eval_accuracy"]))
        # The Scalars tab has the same figures, one point each.
        for tag in ("eval/optimizer_state_bytes", "eval/containers_device_bytes", "eval/loss"):
            assert [event.step for event in events.Scalars(tag)] == [4], tag


def activations_of_a_batch_of_4(model: torch.nn.Module) -> int:
    """What the tiny model's forward on a batch of 4 saves for backward, counted independently."""
    batch = TinyDataset(4)
    model.train()
    return independent_saved_bytes(model, {"input_ids": batch.input_ids, "labels": batch.labels})


measures = pytest.mark.skipif(not ACTIVATIONS_SUPPORTED, reason="this torch does not measure the activations "
                              "(torch 2.8 and newer do: trainer_memcb.training.activations_probe)")


@measures
def test_the_steps_memory_is_charted_and_summarised_exactly(runs):
    activations = activations_of_a_batch_of_4(runs.trainers["adamw"].model)
    events = read_events(os.path.join(runs.root, runs.folders["adamw"]))
    charts = layout_of(events)["Optimizer memory"]
    assert charts["the step's memory by part, measured (bytes)"] == [
        "^train/model_params_bytes$", "^train/model_grads_bytes$", "^train/optimizer_state_bytes$",
        "^train/activations_bytes$"]
    assert charts["model states and activations, measured and planned (bytes)"] == [
        "^train/model_states_bytes$", "^train/model_states_estimate_bytes$", "^train/activations_bytes$",
        "^train/activations_peak_bytes$"]
    scalars = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for tag in ("train/activations_bytes", "train/activations_peak_bytes"):
        assert scalars[tag] == [(step, float(activations)) for step in (1, 2, 3, 4)]
    assert not [tag for tag in scalars if tag.startswith("eval/") and "activations" in tag]
    [text] = events.Tensors("optimizer_memory/text_summary")
    markdown = text.tensor_proto.string_val[0].decode("utf-8")
    table = markdown.split("**The step's memory by part** (per process; activations of step 4, its last micro-batch)")[1]
    cell = lambda num: f"{trainer_memcb.training.tensorboard_view.format_bytes(num)} ({num:,} bytes)"  # noqa: E731
    assert table.split("\n\n")[1].splitlines() == [
        "| part | measured | planned |", "|---|---|---|",
        f"| parameters | {cell(MODEL_BYTES)} | - |",
        f"| gradients | {cell(MODEL_BYTES)} | - |",
        f"| optimizer state | {cell(ADAMW_BYTES)} | {cell(ADAMW_BYTES)} |",
        f"| model states | {cell(2 * MODEL_BYTES + ADAMW_BYTES)} | {cell(2 * MODEL_BYTES + ADAMW_BYTES)} |",
        f"| activations | {cell(activations)} | - |",
        f"| activations, peak | {cell(activations)} | - |",
    ]


def test_one_process_logs_no_total_cards(runs):
    tags = read_events(os.path.join(runs.root, runs.folders["adamw"])).Tags()["scalars"]
    assert not [tag for tag in tags if "total" in tag and tag.startswith(("train/optimizer", "eval/optimizer"))]


# -- TensorBoard itself, over HTTP, and Chromium -----------------------------------------------------


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(base: str, path: str, **query: str) -> Any:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def wait_for_runs(base: str, server: subprocess.Popen, expected: List[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    last: Optional[Exception] = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"tensorboard exited with {server.returncode}")
        try:
            listed = get_json(base, "/data/runs")
            if sorted(listed) == sorted(expected) and get_json(base, "/data/plugin/custom_scalars/layout"):
                return
        except OSError as error:  # not listening yet
            last = error
        time.sleep(0.5)
    raise AssertionError(f"tensorboard did not list {expected} within {timeout_s} s ({last!r})")


def scalar_values(base: str, run: str, tag: str) -> List[List[float]]:
    return [[step, value] for _, step, value in get_json(base, "/data/plugin/scalars/scalars", run=run, tag=tag)]


@pytest.mark.slow  # a TensorBoard server and a headless Chromium
def test_tensorboard_serves_the_view_and_chromium_shows_it(runs, tmp_path):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium), so the page cannot be loaded")
    port = free_loopback_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "tensorboard.log", "w", encoding="utf-8")
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", runs.root, "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "0"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        folders = runs.folders
        wait_for_runs(base, server, list(folders.values()))

        # The layout: one category per kind of entry, measured and estimate on one chart.
        layout = get_json(base, "/data/plugin/custom_scalars/layout")
        charts = {category["title"]: [(chart["title"], chart["multiline"]["tag"]) for chart in category["chart"]]
                  for category in layout["category"]}
        assert charts == {"Optimizer memory": [
            ("optimizer state, measured and estimate (bytes)",
             ["^train/optimizer_state_bytes$", "^train/optimizer_state_estimate_bytes$"]),
            ("measured minus estimate (bytes)", ["^train/optimizer_state_unexpected_bytes$"]),
            ("values in the state and trainable parameters (count)",
             ["^train/optimizer_state_elements$", "^train/optimizer_trainable_params$"]),
            ("the step's memory by part, measured (bytes)",
             ["^train/model_params_bytes$", "^train/model_grads_bytes$", "^train/optimizer_state_bytes$"]
             + ["^train/activations_bytes$"] * ACTIVATIONS_SUPPORTED),
            ("model states and activations, measured and planned (bytes)",
             ["^train/model_states_bytes$", "^train/model_states_estimate_bytes$"]
             + ["^train/activations_bytes$", "^train/activations_peak_bytes$"] * ACTIVATIONS_SUPPORTED),
            # What the evaluation's containers held (the default eval_keys: device and host), and
            # evaluation beside the training step.
            ("eval: evaluation's containers and forward (bytes)",
             ["^eval/containers_device_bytes$", "^eval/containers_host_bytes$"]),
            ("eval: evaluation beside the training step (bytes)",
             ["^train/model_states_bytes$"] + ["^train/activations_peak_bytes$"] * ACTIVATIONS_SUPPORTED
             + ["^eval/containers_device_bytes$"]),
        ]}

        # The tags: every figure once, no total that would repeat its per-process card; evaluation
        # entries carry the measured/estimate pair only (the callback's default eval_keys).
        tags = get_json(base, "/data/plugin/scalars/tags")
        for folder in folders.values():
            optimizer_tags = sorted(tag for tag in tags[folder] if "optimizer_" in tag)
            assert optimizer_tags == sorted(
                [f"train/optimizer_{name}" for name in ("state_bytes", "state_estimate_bytes", "state_elements",
                                                         "trainable_params", "state_unexpected_bytes")]
                + ["eval/optimizer_state_bytes", "eval/optimizer_state_estimate_bytes"]), folder

        # The exact values, as the chart draws them.
        expected = {  # run -> (measured, estimate, measured - estimate)
            "adamw": (ADAMW_BYTES, ADAMW_BYTES, 0),
            "adafactor": (ADAFACTOR_BYTES, ADAFACTOR_BYTES, 0),
            "adamw_frozen": (ADAMW_BYTES, ADAMW_BYTES - FROZEN_BYTES, FROZEN_BYTES),
        }
        for name, (measured, estimate, unexpected) in expected.items():
            run = folders[name]
            assert scalar_values(base, run, "train/optimizer_state_bytes") == [[step, measured] for step in (1, 2, 3, 4)]
            assert scalar_values(base, run, "train/optimizer_state_estimate_bytes") == [
                [step, estimate] for step in (1, 2, 3, 4)]
            assert scalar_values(base, run, "train/optimizer_state_unexpected_bytes") == [
                [step, unexpected] for step in (1, 2, 3, 4)]
            assert scalar_values(base, run, "eval/optimizer_state_bytes") == [[4, measured]]
            # The custom-scalars chart's own query, by its regex, gives the same points.
            chart = get_json(base, "/data/plugin/custom_scalars/scalars", run=run, tag="^train/optimizer_state_bytes$")
            assert [[step, value] for _, step, value in chart["tag_to_events"]["train/optimizer_state_bytes"]] == [
                [step, measured] for step in (1, 2, 3, 4)]

        # The text summary, rendered by TensorBoard from Markdown.
        text_tags = get_json(base, "/data/plugin/text/tags")
        assert all("optimizer_memory/text_summary" in text_tags[folder] for folder in folders.values())
        [adamw_text] = get_json(base, "/data/plugin/text/text", run=folders["adamw"], tag="optimizer_memory/text_summary")
        assert adamw_text["step"] == 4
        html = adamw_text["text"]
        assert "<td>state measured</td>\n<td>29.1 KiB (29,808 bytes)</td>" in html
        assert "<td><code>exp_avg</code></td>\n<td>14.5 KiB (14,856 bytes)</td>\n<td>14.5 KiB (14,856 bytes)</td>" in html
        assert "<td><code>adafactor</code></td>\n<td>2.5 KiB (2,512 bytes)</td>" in html  # the what-if
        assert "they agree" in html
        [frozen_text] = get_json(base, "/data/plugin/text/text", run=folders["adamw_frozen"],
                                 tag="optimizer_memory/text_summary")
        assert "state for parameters that do not train (requires_grad=False)</td>\n<td>8.0 KiB (8,196 bytes)</td>" in (
            frozen_text["text"])
        # The one evaluation's table, rendered: its values, where the eval/ cards hold one point each.
        assert all("optimizer_memory_evaluation/text_summary" in text_tags[folder] for folder in folders.values())
        [evaluation] = get_json(base, "/data/plugin/text/text", run=folders["adamw"],
                                tag="optimizer_memory_evaluation/text_summary")
        assert evaluation["step"] == 4
        assert "<td>eval/optimizer_state_bytes</td>\n<td>29.1 KiB (29,808 bytes)</td>" in evaluation["text"]

        # The page, in a real browser: the Custom Scalars tab, and the Text tab.
        shots = {}
        for tab in ("custom_scalars", "text"):
            shots[tab] = tmp_path / f"tensorboard_{tab}.png"
            browser = subprocess.run(
                [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={SCREEN[0]},{SCREEN[1]}", "--virtual-time-budget=20000",
                 f"--screenshot={shots[tab]}", f"{base}/#{tab}&tagFilter=optimizer_memory"],
                capture_output=True, text=True, timeout=180,
            )
            assert browser.returncode == 0, browser.stderr[-2000:]
        from PIL import Image

        for tab, shot in shots.items():
            with Image.open(shot) as image:
                assert image.size == SCREEN, tab
                # A page that drew something has many colours; a blank or error page has a handful.
                assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 200, tab
        with Image.open(shots["custom_scalars"]) as image:
            # Right of the runs panel, below the header: each run's line in TensorBoard's colour
            # for it (its palette, in the order the runs are listed).
            charts = image.convert("RGB").crop((CHARTS_LEFT, HEADER_HEIGHT, SCREEN[0], SCREEN[1]))
            counts = {colour: count for count, colour in charts.getcolors(maxcolors=1 << 20)}
        assert all(counts.get(colour, 0) >= 100 for colour in RUN_COLOURS), {c: counts.get(c, 0) for c in RUN_COLOURS}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()
    assert server.returncode is not None


# -- the custom-loop logger writes into the tracker's folder ---------------------------------------


def test_the_loop_logger_writes_the_view_into_the_trackers_folder(tmp_path):
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=5, max_steps=2)
    loader = torch.utils.data.DataLoader(TinyDataset(size=8), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        memory()
        optimizer.zero_grad()
    accelerator.log(memory.add_to({"eval_accuracy": 0.5}, prefix="eval"), step=2)
    accelerator.end_training()
    memory.save_summary(str(tmp_path))

    events = read_events(str(tmp_path / "run"))
    assert layout_of(events) == {"Optimizer memory": {
        "optimizer state, measured and estimate (bytes)": ["^optimizer_state_bytes$", "^optimizer_state_estimate_bytes$"],
        "measured minus estimate (bytes)": ["^optimizer_state_unexpected_bytes$"],
        "values in the state and trainable parameters (count)": [
            "^optimizer_state_elements$", "^optimizer_trainable_params$"],
    }}
    scalars = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["optimizer_state_bytes"] == scalars["eval_optimizer_state_bytes"] == [(2, float(ADAMW_BYTES))]
    [text] = events.Tensors("optimizer_memory/text_summary")
    markdown = text.tensor_proto.string_val[0].decode("utf-8")
    assert text.step == 2 and "| state measured | 29.1 KiB (29,808 bytes) |" in markdown
    # The evaluation's entry, as a table under the tracker's own tags (the keys as logged).
    [table] = events.Tensors("optimizer_memory_evaluation/text_summary")
    assert table.step == 2
    assert table.tensor_proto.string_val[0].decode("utf-8").splitlines()[2:] == [
        "| tag | value |", "|---|---|", "| eval_accuracy | 0.5 |",
        "| eval_optimizer_state_bytes | 29.1 KiB (29,808 bytes) |", "| eval_optimizer_state_elements | 7,452 |",
        "| eval_optimizer_state_estimate_bytes | 29.1 KiB (29,808 bytes) |",
        "| eval_optimizer_trainable_params | 3,714 |", "| eval_optimizer_state_unexpected_bytes | 0 B (0 bytes) |"]


@measures
def test_the_loop_logger_with_the_model_charts_and_summarises_the_activations(tmp_path):
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(TinyDataset(size=8), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    memory = OptimizerMemoryLogger(optimizer, accelerator, logging_steps=1, max_steps=2, model=model)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        memory()
        optimizer.zero_grad()
    accelerator.end_training()
    memory.save_summary(str(tmp_path))
    activations = activations_of_a_batch_of_4(model)

    events = read_events(str(tmp_path / "run"))
    charts = layout_of(events)["Optimizer memory"]
    assert charts["the step's memory by part, measured (bytes)"] == [
        "^model_params_bytes$", "^model_grads_bytes$", "^optimizer_state_bytes$", "^activations_bytes$"]
    scalars = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["activations_bytes"] == scalars["activations_peak_bytes"] == [
        (1, float(activations)), (2, float(activations))]
    [text] = events.Tensors("optimizer_memory/text_summary")
    markdown = text.tensor_proto.string_val[0].decode("utf-8")
    assert "(per process; activations of step 2, its last micro-batch)" in markdown
    assert f"| activations | {format_bytes(activations)} ({activations:,} bytes) | - |" in markdown
    assert [line.split() for line in memory.summary().splitlines() if line.strip().startswith("activations")] == [
        ["activations", *format_bytes(activations).split(), "-"],
        ["activations,", "peak", *format_bytes(activations).split(), "-"]]


def test_a_trainer_without_tensorboard_gets_no_view(tmp_path):
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path), max_steps=1),
                      train_dataset=TinyDataset(8), callbacks=[OptimizerMemoryCallback()])
    trainer.train()
    assert not os.path.exists(tmp_path / "runs")
    found = [name for _, _, names in os.walk(tmp_path) for name in names if name.startswith("events.out")]
    assert found == []


def test_a_tensorboard_folder_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    writer = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))
    (tmp_path / "not_a_folder").write_text("a file")
    writer.log_dir = str(tmp_path / "not_a_folder" / "run")  # the view's event file cannot go there
    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path), max_steps=2),
                      train_dataset=TinyDataset(8), callbacks=[TensorBoardCallback(writer), OptimizerMemoryCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in caught if str(w.message).startswith("trainer_memcb:")]
    assert len(messages) == 1 and messages[0].startswith("trainer_memcb: writing the TensorBoard charts failed")
    assert [entry["optimizer_state_bytes"] for entry in trainer.state.log_history if "loss" in entry] == [ADAMW_BYTES] * 2
    assert trainer.state.global_step == 2
