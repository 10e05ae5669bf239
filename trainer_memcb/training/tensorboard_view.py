"""A TensorBoard view of the optimizer figures: charts that put measured and estimate together,
and a text summary in MiB/GiB at the end of training.

The figures themselves reach TensorBoard through the Trainer's reporter (or the loop's
`accelerator.log`), one card per key. This module adds, in the same run folder, what those cards
cannot show:

- a custom-scalars layout (TensorBoard's "Custom Scalars" tab): one chart with the measured
  state and its estimate on the same axes, one with their difference
  (`optimizer_state_unexpected_bytes`), the job's totals when there are several processes, ZeRO's
  master weights when there are some, each breakdown on one chart, and the step's memory by part
  (parameters, gradients, optimizer state, master weights, activations) with a chart of the model
  states and activations beside the planned model states and the CUDA peak. Runs written into one log
  dir overlay on each chart. The layout lists only charts whose figures were logged, and is
  written again (a few times per run at most) when a new one appears;
- a text summary (the "Text" tab) at the end: measured against estimate in MiB/GiB, by state key
  and dtype, the judgement, the step's memory by part, and the what-if;
- a table of each evaluation's figures (the "Text" tab, `optimizer_memory_evaluation`), written as
  the evaluation's entry is logged: every figure of the entry under its TensorBoard tag, the
  Trainer's metrics beside the memory figures. A run with one evaluation has one point per
  evaluation card, which the line charts of TensorBoard's Time Series tab (its first) do not draw;
  the table shows its values.

It writes its own event file (`events.out.tfevents.*.trainer_memcb`) beside the reporter's, which
TensorBoard reads as one run. Writing never breaks training: the caller catches and warns.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from trainer_memcb.training.figures import (
    CONCAT_PEAK_BYTES,
    CONTAINERS_DEVICE_BYTES,
    CONTAINERS_HOST_BYTES,
    FORWARD_PEAK_BYTES,
    GENERATION_PHASE_PEAK_BYTES,
    HOST_CONCAT_PEAK_BYTES,
    ACTIVATIONS_BYTES,
    ACTIVATIONS_PEAK_BYTES,
    DEVICE_PEAK_ALLOCATED_BYTES,
    DEVICE_PEAK_RESERVED_BYTES,
    ESTIMATE_BYTES,
    ESTIMATE_TOTAL_BYTES,
    MASTER_WEIGHTS_BYTES,
    MEASURED_BYTES,
    MEASURED_ELEMENTS,
    MEASURED_TOTAL_BYTES,
    MODEL_GRADS_BYTES,
    MODEL_PARAMS_BYTES,
    MODEL_STATES_BYTES,
    MODEL_STATES_ESTIMATE_BYTES,
    STEP_PLAN_PEAK_BYTES,
    STEP_PLAN_RESERVED_BYTES,
    TRAINING_PHASE_PEAK_BYTES,
    TRAINABLE_PARAMS,
    UNEXPECTED_BYTES,
)
from trainer_memcb.training.figures import step_memory_rows
from trainer_memcb.training.summary import step_memory_figures
from trainer_memcb.utils.units import format_bytes

__all__ = [
    "EVENT_FILE_SUFFIX",
    "EVALUATION_TEXT_TAG",
    "TEXT_TAG",
    "TensorBoardView",
    "loop_tag",
    "trainer_tag",
    "layout_charts",
    "summary_markdown",
    "evaluation_markdown",
    "reporter_log_dir",
    "tracker_log_dir",
]

EVENT_FILE_SUFFIX = ".trainer_memcb"
# The text summary's tag (torch's writer files it as `<tag>/text_summary`).
TEXT_TAG = "optimizer_memory"
# Each evaluation's table (`<tag>/text_summary` too), one text per evaluation, at its step.
EVALUATION_TEXT_TAG = "optimizer_memory_evaluation"
CATEGORY_TITLE = "Optimizer memory"

# Charts, in the order shown: title (after the section), the figures drawn together.
_CHARTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("optimizer state, measured and estimate (bytes)", (MEASURED_BYTES, ESTIMATE_BYTES)),
    ("measured minus estimate (bytes)", (UNEXPECTED_BYTES,)),
    ("job total over all processes, measured and estimate (bytes)", (MEASURED_TOTAL_BYTES, ESTIMATE_TOTAL_BYTES)),
    ("DeepSpeed ZeRO master weights (bytes)", (MASTER_WEIGHTS_BYTES,)),
    ("values in the state and trainable parameters (count)", (MEASURED_ELEMENTS, TRAINABLE_PARAMS)),
    # The step's memory: each part measured, then the model states and the activations beside
    # what was planned (the model-states plan) and, on CUDA, the allocator's peak.
    ("the step's memory by part, measured (bytes)",
     (MODEL_PARAMS_BYTES, MODEL_GRADS_BYTES, MEASURED_BYTES, MASTER_WEIGHTS_BYTES, ACTIVATIONS_BYTES)),
    ("model states and activations, measured and planned (bytes)",
     (MODEL_STATES_BYTES, MODEL_STATES_ESTIMATE_BYTES, ACTIVATIONS_BYTES, ACTIVATIONS_PEAK_BYTES,
      DEVICE_PEAK_ALLOCATED_BYTES)),
    # The step's peak as planned for the run's own settings beside the allocator's peaks (on CUDA).
    ("the step's peak, planned and on the device (bytes)",
     (STEP_PLAN_PEAK_BYTES, DEVICE_PEAK_ALLOCATED_BYTES, STEP_PLAN_RESERVED_BYTES, DEVICE_PEAK_RESERVED_BYTES)),
    # A generating trainer's two phases (TRL's GRPO, RLOO), each above what was alive when it began.
    ("generation and training phases' peaks (bytes)", (GENERATION_PHASE_PEAK_BYTES, TRAINING_PHASE_PEAK_BYTES)),
    # Evaluation's own figures (evaluation entries only): what its containers gathered, and its forward.
    ("evaluation's containers and forward (bytes)",
     (CONTAINERS_DEVICE_BYTES, CONCAT_PEAK_BYTES, CONTAINERS_HOST_BYTES, HOST_CONCAT_PEAK_BYTES, FORWARD_PEAK_BYTES)),
)
# Evaluation beside the training step, on one chart: (prefix "" for training, key) pairs.
_BESIDE_TRAINING = (("", MODEL_STATES_BYTES), ("", ACTIVATIONS_PEAK_BYTES), (None, CONTAINERS_DEVICE_BYTES),
                    (None, CONCAT_PEAK_BYTES), (None, FORWARD_PEAK_BYTES))
_BESIDE_TITLE = "evaluation beside the training step (bytes)"
_CHARTED = {key for _, keys in _CHARTS for key in keys}


def trainer_tag(key: str) -> str:
    """The tag transformers' `TensorBoardCallback` gives a logged key (its `rewrite_logs`):
    `eval_x` -> `eval/x`, `test_x` -> `test/x`, anything else -> `train/x`."""
    for prefix in ("eval_", "test_"):
        if key.startswith(prefix):
            return f"{prefix[:-1]}/{key[len(prefix):]}"
    return f"train/{key}"


def loop_tag(key: str) -> str:
    """accelerate's TensorBoard tracker logs a key under its own name."""
    return key


def _logged(key: str, prefix: str) -> str:
    """The key as the entry logs it (`figures.with_prefix`)."""
    return f"{prefix}_{key}" if prefix else key


def _exact(tag: str) -> str:
    # Custom-scalar charts take regular expressions; a tag is matched whole.
    return f"^{re.escape(tag)}$"


def layout_charts(keys_by_prefix: Dict[str, Iterable[str]], tag: Callable[[str], str]) -> Dict[str, Dict[str, List]]:
    """The layout, as `torch.utils.tensorboard`'s `add_custom_scalars` takes it:
    `{category: {chart title: ["Multiline", [tag regexes]]}}`.

    Charts are drawn from the training entries. An evaluation entry carries the same measurement
    at its step (the Scalars tab shows it beside `eval/accuracy`), so a chart of it would only
    repeat the training chart, and with one evaluation per run TensorBoard's default "ignore
    outliers" would cut single points off it; evaluation charts appear only for figures the
    training entries lack (a run that only evaluates).

    Args:
        keys_by_prefix: the unprefixed figure keys logged, per entry prefix (`""` for training).
        tag: how a logged key becomes a TensorBoard tag (`trainer_tag` or `loop_tag`).

    Examples:
        >>> layout_charts({"": ["optimizer_state_bytes", "optimizer_state_estimate_bytes"],
        ...                "eval": ["optimizer_state_bytes"]}, trainer_tag)
        {'Optimizer memory': {'optimizer state, measured and estimate (bytes)': ['Multiline', ['^train/optimizer_state_bytes$', '^train/optimizer_state_estimate_bytes$']]}}
    """
    charts: Dict[str, List] = {}
    training = set(keys_by_prefix.get("", ()))
    for prefix in sorted(keys_by_prefix, key=lambda name: (name != "", name)):
        keys = set(keys_by_prefix[prefix]) - (training if prefix else set())
        section = f"{prefix}: " if prefix else ""
        drawn: set = set()
        for title, chart_keys in _CHARTS:
            shown = [key for key in chart_keys if key in keys]
            if shown and not drawn.issuperset(shown):  # a chart that only repeats earlier ones is left out
                drawn.update(shown)
                charts[f"{section}{title}"] = ["Multiline", [_exact(tag(_logged(key, prefix))) for key in shown]]
        # Breakdowns (`<figure>/by_key/<part>` or `<figure>_by_key/<part>`): one chart per family.
        families = sorted({key.rsplit("/", 1)[0] for key in keys if "/" in key and key not in _CHARTED})
        for family in families:
            family_tag = tag(_logged(family, prefix))
            charts[f"{section}{family} (bytes)"] = ["Multiline", [f"^{re.escape(family_tag)}/"]]
    _beside_training(keys_by_prefix, tag, charts)
    return {CATEGORY_TITLE: charts} if charts else {}


def _beside_training(keys_by_prefix: Dict[str, Iterable[str]], tag: Callable[[str], str],
                     charts: Dict[str, List]) -> None:
    """One chart of the training step's model states and activations peak with each evaluation
    prefix's containers and forward peaks, when both were logged: which phase holds the most."""
    training = set(keys_by_prefix.get("", ()))
    for prefix in sorted(name for name in keys_by_prefix if name):
        evaluation = set(keys_by_prefix[prefix])
        tags = [_exact(tag(_logged(key, "" if where == "" else prefix))) for where, key in _BESIDE_TRAINING
                if key in (training if where == "" else evaluation)]
        if any(key in evaluation for _, key in _BESIDE_TRAINING) and any(
                key in training for where, key in _BESIDE_TRAINING if where == ""):
            charts[f"{prefix}: {_BESIDE_TITLE}"] = ["Multiline", tags]


def reporter_log_dir(callbacks: Optional[Iterable[Any]]) -> Optional[str]:
    """The folder of the Trainer's TensorBoard reporter among its `callbacks`, or None without
    one: the folder of the writer it was given (`TensorBoardCallback(tb_writer)`) or made
    (`report_to="tensorboard"`: `args.logging_dir` in transformers 4, `$TENSORBOARD_LOGGING_DIR`
    or `<output_dir>/runs/<time>_<host>` in transformers 5, named in its `on_train_begin`)."""
    try:
        from transformers.integrations import TensorBoardCallback
    except ImportError:  # transformers without its integrations: no reporter to find
        return None
    for callback in callbacks or ():
        if not isinstance(callback, TensorBoardCallback):
            continue
        writer = getattr(callback, "tb_writer", None)
        # torch's SummaryWriter names it log_dir, tensorboardX's logdir.
        folder = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None) or getattr(
            callback, "logging_dir", None)
        if folder:
            return str(folder)
    return None


def tracker_log_dir(accelerator: Any) -> Optional[str]:
    """The folder of the accelerator's TensorBoard tracker (`Accelerator(log_with="tensorboard")`
    after `init_trackers(run_name)`: `<project_dir>/<run_name>`), or None without one."""
    for tracker in getattr(accelerator, "trackers", None) or []:
        if getattr(tracker, "name", None) != "tensorboard":
            continue
        writer = getattr(tracker, "writer", None)
        folder = getattr(writer, "log_dir", None) or getattr(tracker, "logging_dir", None)
        if folder:
            return str(folder)
    return None


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(num_bytes: Optional[int]) -> str:
    return "-" if num_bytes is None else f"{format_bytes(num_bytes)} ({num_bytes:,} bytes)"


def summary_markdown(document: Dict[str, Any]) -> str:
    """The end-of-run summary (`optimizer_memory.json`'s document) as Markdown for the Text tab:
    totals, by state key against the estimate, by dtype, the judgement, and the what-if.

    Examples:
        >>> print(summary_markdown({"optimizer_class": "AdamW", "global_step": 2,
        ...     "measured": {"num_bytes": 88, "bytes_by_key": {"exp_avg": 40}, "bytes_by_dtype": {"float32": 88}},
        ...     "estimate": {"num_bytes": 88, "bytes_by_key": {"exp_avg": 40}}}).splitlines()[4])
        | state measured | 88 B (88 bytes) |
    """
    measured = document.get("measured") or {}
    estimate = document.get("estimate") or {}
    parts = [f"**{document.get('optimizer_class', '?')}** at step {document.get('global_step', '?')}; "
             "MiB and GiB are 1024-based."]
    rows = [
        ["state measured", _cell(measured.get("num_bytes"))],
        ["state estimate", _cell(estimate.get("num_bytes"))],
    ]
    if measured.get("num_bytes") is not None and estimate.get("num_bytes") is not None:
        rows.append(["measured - estimate", _cell(measured["num_bytes"] - estimate["num_bytes"])])
    if document.get("peak_measured_bytes") is not None:
        rows.append(["peak measured", _cell(document["peak_measured_bytes"])])
    if estimate.get("num_params") is not None:
        rows.append(["trainable parameters", f"{estimate['num_params']:,}"])
    parts.append(_markdown_table(["", "value"], rows))

    by_key_measured = measured.get("bytes_by_key") or {}
    by_key_estimate = estimate.get("bytes_by_key") or {}
    keys = sorted(set(by_key_measured) | set(by_key_estimate))
    if keys:
        rows = []
        for key in keys:
            got, want = by_key_measured.get(key), by_key_estimate.get(key)
            difference = None if got is None or want is None else got - want
            rows.append([f"`{key}`", _cell(got), _cell(want), _cell(difference)])
        parts.append("**By state key**\n\n" + _markdown_table(["state key", "measured", "estimate", "measured - estimate"], rows))
    by_dtype = measured.get("bytes_by_dtype") or {}
    if by_dtype:
        parts.append("**By dtype**\n\n" + _markdown_table(
            ["dtype", "measured"], [[f"`{name}`", _cell(num)] for name, num in sorted(by_dtype.items())]))

    judgement = document.get("judgement")
    if isinstance(judgement, dict):
        difference = judgement.get("difference_bytes")
        if difference == 0:
            parts.append("**Measured against estimate:** they agree, once every trainable parameter had state.")
        else:
            rows = [[cause.get("description", cause.get("kind", "?")), _cell(cause.get("num_bytes")),
                     ", ".join(f"`{key}`" for key in cause.get("state_keys") or []) or "-",
                     ", ".join(cause.get("dtypes") or []) or "-"]
                    for cause in judgement.get("causes") or []]
            parts.append(f"**Measured against estimate:** the state holds {_cell(difference)} "
                         f"{'more' if (difference or 0) > 0 else 'less'} than estimated.\n\n"
                         + _markdown_table(["likely cause", "bytes", "state keys", "held as"], rows))

    figures, activations_step = step_memory_figures(document)
    by_part = step_memory_rows(figures)
    if by_part:
        when = f"; activations of step {activations_step}, its last micro-batch" if activations_step is not None else ""
        parts.append(f"**The step's memory by part** (per process{when})\n\n" + _markdown_table(
            ["part", "measured", "planned"], [[part, _cell(got), _cell(want)] for part, got, want in by_part]))

    evaluation, phases = document.get("evaluation"), document.get("phases")
    if isinstance(evaluation, dict) and evaluation:
        parts.append("**Evaluation's memory**, the largest evaluation (per process)\n\n" + _markdown_table(
            ["figure", "bytes"], [[f"`{key}`", _cell(value)] for key, value in evaluation.items()])
            + (f"\n\n{phases['text']}." if isinstance(phases, dict) and phases.get("text") else ""))

    what_if = document.get("what_if")
    if isinstance(what_if, dict) and what_if.get("optimizers"):
        rows = []
        for entry in what_if["optimizers"]:
            num_bytes = (entry.get("estimate") or {}).get("num_bytes")
            rows.append([f"`{entry.get('name', '?')}`", _cell(num_bytes) if num_bytes is not None
                         else str(entry.get("problem") or "-")])
        trainable = what_if.get("trainable_params")
        title = "**What-if at train begin**" + (f", for {trainable:,} trainable parameters" if trainable else "")
        parts.append(title + "\n\n" + _markdown_table(["optimizer", "state estimate"], rows))
    return "\n\n".join(parts)


def _value_cell(key: str, value: Any) -> str:
    """A logged value as the table shows it: bytes (the key's unit) in MiB/GiB with the exact
    count, other whole numbers with thousands separators, floats as Python prints them (exact)."""
    if isinstance(value, int):
        return _cell(value) if "_bytes" in key else f"{value:,}"
    return repr(value)


def evaluation_markdown(entry: Dict[str, Any], prefix: str, step: int, tag: Callable[[str], str]) -> Optional[str]:
    """One evaluation's entry as Markdown for the Text tab: each number the entry logs under
    `prefix` (the Trainer's metrics and the memory figures), by the tag TensorBoard files it
    under, in the entry's order; None when it has none.

    Args:
        entry: the evaluation's log entry (`eval_loss`, `eval_optimizer_state_bytes`, ...).
        prefix: the entry's prefix (`eval`, `test`, or the `metric_key_prefix` given).
        step: the global step the entry is logged at.
        tag: how a logged key becomes a TensorBoard tag (`trainer_tag` or `loop_tag`).

    Examples:
        >>> print(evaluation_markdown({"eval_accuracy": 0.5, "eval_optimizer_state_bytes": 29808, "epoch": 1.0},
        ...                           "eval", 4, trainer_tag))
        **Evaluation at step 4**: the figures of the `eval` entry (a Time Series card of one evaluation holds one point, which its line chart does not draw); MiB and GiB are 1024-based.
        <BLANKLINE>
        | tag | value |
        |---|---|
        | eval/accuracy | 0.5 |
        | eval/optimizer_state_bytes | 29.1 KiB (29,808 bytes) |
    """
    start = f"{prefix}_"
    rows = [[tag(key), _value_cell(key, value)] for key, value in entry.items()
            if key.startswith(start) and isinstance(value, (int, float)) and not isinstance(value, bool)]
    if not rows:
        return None
    return (f"**Evaluation at step {step}**: the figures of the `{prefix}` entry (a Time Series card of one "
            "evaluation holds one point, which its line chart does not draw); MiB and GiB are 1024-based.\n\n"
            + _markdown_table(["tag", "value"], rows))


class TensorBoardView:
    """The layout and the text summary, written into one run folder.

    Args:
        log_dir: the run folder (the reporter's, or the tracker's), or a function that finds it
            when first needed and returns None while there is none (asked again at the next
            entry, a few times at most).
        tag: how a logged key becomes a TensorBoard tag: `trainer_tag` or `loop_tag`.

    Examples:
        >>> import tempfile
        >>> view = TensorBoardView(tempfile.mkdtemp(), trainer_tag)
        >>> view.observe(["optimizer_state_bytes", "optimizer_state_estimate_bytes"], prefix="", step=1)
        True
        >>> view.observe(["optimizer_state_bytes"], prefix="", step=2)  # nothing new: nothing written
        False
        >>> view.close()
    """

    # How many entries may ask for a folder that is not there before the view gives up.
    _FIND_ATTEMPTS = 3

    def __init__(self, log_dir: Union[str, Callable[[], Optional[str]]], tag: Callable[[str], str]) -> None:
        self._find = log_dir if callable(log_dir) else (lambda: log_dir)
        self._attempts = 0
        self.log_dir: Optional[str] = None
        self.tag = tag
        self._keys: Dict[str, set] = {}
        self._writer: Any = None

    def _file_writer(self) -> Any:
        if self._writer is None:
            if self.log_dir is None:
                if self._attempts >= self._FIND_ATTEMPTS:
                    return None
                self._attempts += 1
                self.log_dir = self._find()
                if self.log_dir is None:
                    return None
            # Imported here: only a run that reports to TensorBoard needs it.
            from torch.utils.tensorboard.writer import FileWriter

            try:
                self._writer = FileWriter(self.log_dir, filename_suffix=EVENT_FILE_SUFFIX)
            except Exception:
                self._attempts, self.log_dir = self._FIND_ATTEMPTS, None  # not tried again
                raise
        return self._writer

    def observe(self, keys: Iterable[str], prefix: str, step: int) -> bool:
        """Note the figure keys an entry logged; writes the layout again if it gained a chart.
        Returns whether it wrote."""
        known = self._keys.setdefault(prefix, set())
        new = {key for key in keys if key not in known}
        if not new and self._writer is not None:
            return False
        before = layout_charts(self._keys, self.tag)
        known.update(new)
        layout = layout_charts(self._keys, self.tag)
        if not layout or (layout == before and self._writer is not None):
            return False
        writer = self._file_writer()
        if writer is None:
            return False
        from torch.utils.tensorboard.summary import custom_scalars

        writer.add_summary(custom_scalars(layout), step)
        writer.flush()
        return True

    def write_text(self, markdown: str, step: int) -> bool:
        """The end-of-run summary, in the Text tab under `optimizer_memory`; whether it wrote."""
        return self._write_markdown(TEXT_TAG, markdown, step)

    def write_evaluation(self, entry: Dict[str, Any], prefix: str, step: int) -> bool:
        """An evaluation's figures as a table in the Text tab (`optimizer_memory_evaluation`), at
        its step (`evaluation_markdown`); whether it wrote."""
        markdown = evaluation_markdown(entry, prefix, step, self.tag)
        return markdown is not None and self._write_markdown(EVALUATION_TEXT_TAG, markdown, step)

    def _write_markdown(self, tag: str, markdown: str, step: int) -> bool:
        writer = self._file_writer()
        if writer is None:
            return False
        from torch.utils.tensorboard.summary import text

        writer.add_summary(text(tag, markdown), step)
        writer.flush()
        return True

    def close(self) -> None:
        """Close the event file; a later entry opens a new one in the same folder."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
