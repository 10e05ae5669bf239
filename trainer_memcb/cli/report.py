"""`trainer-memcb report RUN_DIR`: one run's optimizer memory over the steps, its evaluations,
and the breakdown by state key and dtype.

`run_report` computes the figures from a `RunLog`; `report_tables` only formats them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from trainer_memcb.cli.choices import DEFAULT_METRICS
from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell, metric_cell
from trainer_memcb.training.figures import (
    ESTIMATE_BYTES,
    MEASURED_BYTES,
    MODEL_STATES_BYTES,
    STEP_MEMORY_PARTS,
    TRAINABLE_PARAMS,
    UNEXPECTED_BYTES,
    step_memory_rows,
)
from trainer_memcb.runs.run_logs import RunLog
from trainer_memcb.training.phase_judgement import judge_phases, largest_evaluation
from trainer_memcb.runs.run_values import is_count_key, real_number

__all__ = ["DEFAULT_METRICS", "StepFigures", "EvalFigures", "RunReport", "logged_metrics", "run_report",
           "report_tables"]

# The lesson's metrics, eval accuracy and F1 (`compute_metrics` returning "accuracy" and "f1"),
# shown first when a run logged them: `trainer_memcb.cli.choices.DEFAULT_METRICS`.
# What the Trainer adds to every evaluation entry that is no metric (transformers trainer_utils.py
# speed_metrics, and the epoch).
_NOT_METRICS = ("runtime", "samples_per_second", "steps_per_second", "epoch")
# `Trainer.evaluate(metric_key_prefix="eval")`, the prefix of every evaluation key.
EVAL_PREFIX = "eval"
# Breakdown keys: `optimizer_state_bytes_by_key/<key>`, and `optimizer_state_bytes/by_key/<key>` as
# runs logged them before the rename (a key may not be the path prefix of another).
_BY_KEY = (f"{MEASURED_BYTES}_by_key/", f"{MEASURED_BYTES}/by_key/")
_BY_DTYPE = (f"{MEASURED_BYTES}_by_dtype/", f"{MEASURED_BYTES}/by_dtype/")
# TensorBoard's add_scalar stores a float32: integers are exact up to 2**24.
_FLOAT32_NOTE = ("logs read from TensorBoard, which keeps float32: byte counts above 16,777,216 in the "
                 "logged series are rounded (the summary's are exact)")


@dataclass
class StepFigures:
    """The figures of one logged training step."""

    step: int
    measured_bytes: Optional[int]
    estimate_bytes: Optional[int]


@dataclass
class EvalFigures:
    """One evaluation: its metrics and the state measured then."""

    step: int
    metrics: Dict[str, float]
    measured_bytes: Optional[int]


@dataclass
class RunReport:
    """What `trainer-memcb report` shows for one run.

    Final figures come from the callback's summary when the run has one, else from the last
    logged step. Breakdowns come from the summary, else from the last logged breakdown keys.
    """

    name: str
    run_dir: str
    history_source: Optional[str]
    summary_file: Optional[str]
    optimizer_class: Optional[str]
    trainable_params: Optional[int]
    measured_bytes: Optional[int]
    estimate_bytes: Optional[int]
    peak_measured_bytes: Optional[int]
    steps: List[StepFigures] = field(default_factory=list)
    evals: List[EvalFigures] = field(default_factory=list)
    measured_by_key: Dict[str, int] = field(default_factory=dict)
    measured_by_dtype: Dict[str, int] = field(default_factory=dict)
    estimate_by_key: Dict[str, int] = field(default_factory=dict)
    what_if: Optional[Dict[str, Any]] = None
    history_is_float32: bool = False
    # Measured against estimate, judged (trainer_memcb.state.judge): the summary's, else the last
    # logged `optimizer_state_unexpected_bytes` alone.
    judgement: Optional[Dict[str, Any]] = None
    # The step's memory by part (parameters, gradients, optimizer state, master weights,
    # activations, ...), measured and planned, as the last logged training step that has any of
    # them logged it, and that step.
    step_memory: Dict[str, int] = field(default_factory=dict)
    step_memory_step: Optional[int] = None
    # Which phase held the most, training or evaluation (trainer_memcb.training.phase_judgement):
    # the summary's, else judged from the logged entries; and the largest evaluation's figures.
    phases: Optional[Dict[str, Any]] = None
    evaluation_memory: Dict[str, int] = field(default_factory=dict)

    @property
    def has_figures(self) -> bool:
        """Whether the run logged any optimizer memory figure (a run made without the callback or
        the logger has none)."""
        return (self.summary_file is not None or bool(self.steps) or self.measured_bytes is not None
                or self.estimate_bytes is not None or any(e.measured_bytes is not None for e in self.evals))

    @property
    def final_metrics(self) -> Dict[str, float]:
        """The metrics of the last evaluation (empty without one)."""
        return dict(self.evals[-1].metrics) if self.evals else {}

    def to_dict(self) -> Dict[str, Any]:
        document = asdict(self)
        document["final_metrics"] = self.final_metrics
        return document


def _last_with(entries: Sequence[Dict[str, Any]], key: str) -> Optional[Any]:
    for entry in reversed(entries):
        if key in entry:
            return entry[key]
    return None


def _parts(entry: Dict[str, Any], prefixes: Sequence[str]) -> Dict[str, int]:
    return {key[len(prefix):]: value for key, value in entry.items() for prefix in prefixes if key.startswith(prefix)}


def _last_parts(entries: Sequence[Dict[str, Any]], prefixes: Sequence[str]) -> Dict[str, int]:
    for entry in reversed(entries):
        parts = _parts(entry, prefixes)
        if parts:
            return parts
    return {}


def _known(*values: Any) -> Any:
    """The first value that is not None (0 is a value)."""
    return next((value for value in values if value is not None), None)


def _nested(document: Optional[Dict[str, Any]], *keys: str) -> Any:
    for key in keys:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def logged_metrics(runs: Sequence[RunLog]) -> List[str]:
    """The evaluation metrics to show when none are asked for: accuracy and F1 where the runs logged
    them, else every metric they logged (`eval_loss` included), in the order first logged. Left out:
    the Trainer's timings and the epoch, and every count (`..._bytes`, `..._params`, ...).

    Examples:
        >>> from trainer_memcb.runs.run_logs import RunLog
        >>> sft = RunLog(run_dir="sft", log_history=[{"step": 2, "eval_loss": 2.1, "eval_runtime": 0.5,
        ...                                          "eval_mean_token_accuracy": 0.4, "eval_optimizer_state_bytes": 88}])
        >>> logged_metrics([sft])
        ['loss', 'mean_token_accuracy']
        >>> logged_metrics([sft, RunLog(run_dir="lesson", log_history=[{"step": 2, "eval_accuracy": 0.9}])])
        ['accuracy']
    """
    found: Dict[str, None] = {}
    for run in runs:
        for entry in run.log_history:
            for key, value in entry.items():
                if not key.startswith(f"{EVAL_PREFIX}_") or real_number(value) is None:
                    continue
                metric = key[len(EVAL_PREFIX) + 1:]
                if metric in _NOT_METRICS or is_count_key(key) or metric.endswith(("_bytes", "_elements", "_params")):
                    continue
                found.setdefault(metric, None)
    preferred = [metric for metric in DEFAULT_METRICS if metric in found]
    return preferred or list(found)


def run_report(run: RunLog, metrics: Sequence[str] = DEFAULT_METRICS) -> RunReport:
    """The figures of one run, from its own logs.

    Args:
        run: from `trainer_memcb.runs.run_logs.load_run`, which checks each value's type (a `step` is an int).
        metrics: evaluation metrics to follow, without the `eval_` prefix.
    """
    eval_keys = {metric: f"{EVAL_PREFIX}_{metric}" for metric in metrics}
    eval_measured = f"{EVAL_PREFIX}_{MEASURED_BYTES}"
    training = [entry for entry in run.log_history if MEASURED_BYTES in entry or ESTIMATE_BYTES in entry]
    evaluations = [
        entry for entry in run.log_history if any(key in entry for key in eval_keys.values()) or eval_measured in entry
    ]
    steps = [
        StepFigures(entry["step"], entry.get(MEASURED_BYTES), entry.get(ESTIMATE_BYTES))
        for entry in training
    ]
    evals = [
        EvalFigures(
            entry["step"],
            {metric: entry[key] for metric, key in eval_keys.items() if key in entry},
            entry.get(eval_measured),
        )
        for entry in evaluations
    ]
    summary = run.summary
    logged_peak = max((s.measured_bytes for s in steps if s.measured_bytes is not None), default=None)
    report = RunReport(
        name=run.name,
        run_dir=run.run_dir,
        history_source=run.history_source,
        summary_file=run.summary_file,
        # The estimate names the class with its module (bitsandbytes' AdamW is not torch's).
        optimizer_class=_known(_nested(summary, "estimate", "optimizer_class"), _nested(summary, "optimizer_class")),
        trainable_params=_known(_nested(summary, "estimate", "num_params"), _last_with(training, TRAINABLE_PARAMS)),
        measured_bytes=_nested(summary, "measured", "num_bytes"),
        estimate_bytes=_nested(summary, "estimate", "num_bytes"),
        peak_measured_bytes=_known(_nested(summary, "peak_measured_bytes"), logged_peak),
        steps=steps,
        evals=evals,
        what_if=_nested(summary, "what_if"),
        history_is_float32=run.history_file is None and bool(run.event_files),
    )
    for entry in reversed(training):
        known = {key: entry[key] for part in STEP_MEMORY_PARTS for key in part[1:] if key is not None and key in entry}
        if any(key not in (MEASURED_BYTES, ESTIMATE_BYTES) for key in known):
            report.step_memory, report.step_memory_step = known, entry["step"]
            break
    _judge_phases(report, run.log_history, training, summary)
    judgement = _nested(summary, "judgement")
    if isinstance(judgement, dict):
        report.judgement = judgement
    else:
        unexpected = _last_with(training, UNEXPECTED_BYTES)
        if unexpected is not None:
            report.judgement = {"difference_bytes": unexpected, "causes": []}
    if summary is None:
        report.measured_bytes = _last_with(training, MEASURED_BYTES)
        report.estimate_bytes = _last_with(training, ESTIMATE_BYTES)
        report.measured_by_key = _last_parts(training, _BY_KEY)
        report.measured_by_dtype = _last_parts(training, _BY_DTYPE)
    else:
        report.measured_by_key = dict(_nested(summary, "measured", "bytes_by_key") or {})
        report.measured_by_dtype = dict(_nested(summary, "measured", "bytes_by_dtype") or {})
        report.estimate_by_key = dict(_nested(summary, "estimate", "bytes_by_key") or {})
    return report


def _judge_phases(report: RunReport, history: Sequence[Dict[str, Any]], training: Sequence[Dict[str, Any]],
                  summary: Optional[Dict[str, Any]]) -> None:
    phases, evaluation = _nested(summary, "phases"), _nested(summary, "evaluation")
    if isinstance(phases, dict) and isinstance(evaluation, dict):
        report.phases, report.evaluation_memory = phases, dict(evaluation)
        return
    evaluation = largest_evaluation(entry for entry in history if entry not in training)
    last = next((entry for entry in reversed(training) if MODEL_STATES_BYTES in entry), {})
    judged = judge_phases(last, evaluation)
    report.evaluation_memory = evaluation
    if judged is not None:
        report.phases = {**judged.to_dict(), "text": judged.text()}


# -- printing ------------------------------------------------------------------------------------


def _changes(steps: Sequence[StepFigures]) -> List[StepFigures]:
    """The steps where a figure changes, and the last one: the state is flat once every
    parameter has had a gradient, so a long run would otherwise print the same row again and again."""
    shown: List[StepFigures] = []
    for index, figures in enumerate(steps):
        previous = shown[-1] if shown else None
        changed = previous is None or (previous.measured_bytes, previous.estimate_bytes) != (
            figures.measured_bytes, figures.estimate_bytes)
        if changed or index == len(steps) - 1:
            shown.append(figures)
    return shown


def _difference(measured: Optional[int], estimate: Optional[int]) -> Optional[int]:
    return None if measured is None or estimate is None else measured - estimate


def report_tables(report: RunReport, metrics: Sequence[str] = DEFAULT_METRICS) -> List[TextTable]:
    """The report as tables for people."""
    overview = TextTable(f"Run {report.name}", ["", "value"], [
        ["optimizer", report.optimizer_class or "- (no optimizer_memory.json)"],
        ["trainable parameters", count_cell(report.trainable_params)],
        ["state measured (end)", bytes_cell(report.measured_bytes)],
        ["state estimate", bytes_cell(report.estimate_bytes)],
        ["measured - estimate", bytes_cell(_difference(report.measured_bytes, report.estimate_bytes))],
        ["peak measured", bytes_cell(report.peak_measured_bytes)],
        ["logs from", report.history_source or "-"],
        ["summary from", report.summary_file or "-"],
    ], text_columns=(0, 1), note=_FLOAT32_NOTE if report.history_is_float32 else "")
    tables = [overview]
    if report.steps:
        shown = _changes(report.steps)
        tables.append(TextTable(
            "Optimizer state over the steps", ["step", "measured", "estimate", "measured - estimate"],
            [[str(s.step), bytes_cell(s.measured_bytes), bytes_cell(s.estimate_bytes),
              bytes_cell(_difference(s.measured_bytes, s.estimate_bytes))] for s in shown],
            note=f"{len(report.steps)} logged steps; rows where a figure changes, and the last one",
            text_columns=(),
        ))
    if report.evals:
        tables.append(TextTable(
            "Evaluations", ["step", *metrics, "state measured"],
            [[str(e.step), *(metric_cell(e.metrics.get(m)) for m in metrics), bytes_cell(e.measured_bytes)]
             for e in report.evals],
            text_columns=(),
        ))
    if report.measured_by_key or report.estimate_by_key:
        keys = sorted(set(report.measured_by_key) | set(report.estimate_by_key))
        tables.append(TextTable("By state key", ["key", "measured", "estimate"], [
            [key, bytes_cell(report.measured_by_key.get(key)), bytes_cell(report.estimate_by_key.get(key))]
            for key in keys
        ]))
    if report.measured_by_dtype:
        tables.append(TextTable("By dtype", ["dtype", "measured"], [
            [dtype, bytes_cell(num_bytes)] for dtype, num_bytes in sorted(report.measured_by_dtype.items())
        ]))
    if report.judgement:
        tables.append(_judgement_table(report.judgement))
    if report.step_memory:
        tables.append(TextTable(
            f"The step's memory by part at step {report.step_memory_step} (per process)",
            ["part", "measured", "planned"],
            [[part, bytes_cell(measured), bytes_cell(planned)]
             for part, measured, planned in step_memory_rows(report.step_memory)],
            note="activations: what the step's last micro-batch forward saved for backward (parameters excluded)"
            if any(row[0].startswith("activations") for row in step_memory_rows(report.step_memory)) else "",
        ))
    if report.evaluation_memory:
        rows = [[key, bytes_cell(value)] for key, value in report.evaluation_memory.items()]
        tables.append(TextTable("Evaluation's memory, the largest evaluation (per process)", ["figure", "bytes"], rows,
                                note=str(report.phases.get("text", "")) if report.phases else ""))
    if report.what_if:
        tables.append(TextTable(
            f"What-if at train begin, for {count_cell(report.what_if.get('trainable_params'))} trainable parameters",
            ["optimizer", "state estimate"],
            [[entry.get("name") or "?", bytes_cell(_nested(entry, "estimate", "num_bytes"))
              if entry.get("estimate") else entry.get("problem") or "-"]
             for entry in report.what_if.get("optimizers", [])],
        ))
    return tables


def _judgement_table(judgement: Dict[str, Any]) -> TextTable:
    """Measured against estimate, judged: the difference, then each likely cause with its bytes."""
    difference = judgement.get("difference_bytes")
    rows = [["measured - estimate, once every trainable parameter had state", bytes_cell(difference), ""]]
    for cause in judgement.get("causes") or []:
        where = "; ".join(part for part in (
            ", ".join(cause.get("state_keys") or []),
            ", ".join(cause.get("dtypes") or []),
        ) if part)
        rows.append([f"likely cause: {cause.get('description', cause.get('kind', '?'))}",
                     bytes_cell(cause.get("num_bytes")), where or "-"])
    verdict = "they agree" if difference == 0 else "they differ"
    return TextTable(f"Measured against estimate: {verdict}", ["", "bytes", "state keys; held as"], rows,
                     text_columns=(0, 2))
