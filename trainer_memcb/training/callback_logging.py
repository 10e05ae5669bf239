"""The callback's logging: what goes into the Trainer's log entries, its charts and its summary.

The hook on `Trainer.log` (`trainer_log_hook.py`) hands each entry to `EntryLogging.contribute`
before the Trainer stores and reports it; `late` catches the entries of a Trainer whose `log`
bypasses the hook; `end` writes the end-of-training summary. What the figures are is measured
elsewhere (`callback_measuring.py`, and `callback_hooks.py` for the evaluation loops).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

from transformers.utils import logging

from trainer_memcb.training.activations_probe import without_activation_keys
from trainer_memcb.training.callback_hooks import EvaluationLoops
from trainer_memcb.training.callback_measuring import Run, Runs
from trainer_memcb.training.figures import keep_keys, with_prefix
from trainer_memcb.training.phase_judgement import judge_phases
from trainer_memcb.training.summary import SUMMARY_FILE_NAME, step_memory_figures, summary_text, write_summary
from trainer_memcb.training.tensorboard_view import TensorBoardView, reporter_log_dir, summary_markdown, trainer_tag

__all__ = ["EntryLogging", "check_summary_file", "log_entry_prefix"]

# The callback's own logger, as before its parts had modules of their own: the name users configure.
logger = logging.get_logger(f"{__package__}.callback")

_RUNTIME_SUFFIX = "_runtime"


def log_entry_prefix(logs: Dict[str, Any]) -> Optional[str]:
    """Which kind of Trainer log entry `logs` is, as the prefix its keys take.

    `""` for a training entry (it holds `loss`); `"eval"`, `"test"`, `"eval_<name>"` for an
    evaluation entry (`evaluate()` adds `<prefix>_runtime`); None for anything else, such as the
    closing `train_runtime` summary, which gets no figures.
    """
    if "loss" in logs:
        return ""
    for key in logs:
        if isinstance(key, str) and key.endswith(_RUNTIME_SUFFIX):
            prefix = key[: -len(_RUNTIME_SUFFIX)]
            if prefix and prefix != "train":
                return prefix
    return None


def check_summary_file(summary_file: Optional[str]) -> Optional[str]:
    """`summary_file` if it is a plain file name or None; else a `ValueError`."""
    if summary_file is not None and (
        not isinstance(summary_file, str) or summary_file in ("", ".", "..")
        or os.path.basename(summary_file) != summary_file
    ):
        raise ValueError(f"summary_file={summary_file!r}: expected a plain file name such as "
                         f"{SUMMARY_FILE_NAME!r}, or None for no file")
    return summary_file


class EntryLogging:
    """What the callback puts into the Trainer's log entries, its charts and its summary.

    Args: the callback's own `eval_keys`, `train_keys` (None: every key) and `summary_file`, and
    `warn` (warn once per kind of fault).
    """

    def __init__(self, eval_keys: Optional[Tuple[str, ...]], train_keys: Optional[Tuple[str, ...]],
                 summary_file: Optional[str], warn: Callable[[str, str], None]) -> None:
        self.eval_keys, self.train_keys, self.summary_file = eval_keys, train_keys, summary_file
        self._warn = warn
        # The entry the hook filled last, so that `late` can tell whether the hook ran for it.
        self._contributed_entry: Optional[Dict[str, Any]] = None

    def _evaluation_figures(self, trainer: Any, logs: Dict[str, Any], prefix: str,
                            evaluations: EvaluationLoops) -> Dict[str, int]:
        """The figures of the evaluation loop whose entry `logs` is, kept by `eval_keys`, unprefixed."""
        figures = keep_keys(evaluations.take(trainer, prefix), self.eval_keys)
        if figures and getattr(trainer.state, "is_world_process_zero", True):
            logs.update(with_prefix(figures, prefix))
        return figures

    def contribute(self, trainer: Any, logs: Dict[str, Any], runs: Runs, evaluations: EvaluationLoops) -> None:
        """Add the figures to `logs`, which `trainer` is about to store and report; never raises."""
        try:
            prefix = log_entry_prefix(logs)
            if prefix is None:
                return
            self._contributed_entry = logs
            # Evaluation's own figures, whether or not the Trainer has trained yet.
            evaluation = self._evaluation_figures(trainer, logs, prefix, evaluations) if prefix else {}
            # This Trainer's own optimizer: the callback may serve others, before or in between.
            optimizer = getattr(trainer, "optimizer", None)
            if optimizer is None:
                return  # not trained yet: no optimizer to measure, on any process
            state = trainer.state
            run = runs.run(optimizer)
            # The frozen reference model, if the trainer holds one (TRL): every process, before
            # the figures (a collective with several processes).
            run.monitor.reference_model(getattr(trainer, "ref_model", None), getattr(trainer, "model", None))
            figures = self._kept(run.monitor.figures(state.global_step, stepped=state.global_step > 0), prefix)
            if state.is_world_process_zero:
                if not prefix:  # the step plan, made at the first logged step, beside the device's peaks
                    figures.update(keep_keys(run.step_plan.figures(getattr(trainer, "model", None), trainer.args),
                                             self.train_keys))
                    # A generating trainer's phases, beside the reward and kl its `log` added to `logs`.
                    figures.update(keep_keys(run.phases.figures(state.global_step), self.train_keys))
                # A training entry (no prefix) takes the monitor's fresh dict as it is.
                logs.update(with_prefix(figures, prefix) if prefix else figures)
                self._observe(run, trainer, {**figures, **evaluation}, prefix, state.global_step, logs)
        except Exception as error:  # never break training over a figure
            self._warn("log", f"adding the optimizer figures to the log failed ({error!r})")

    def _kept(self, figures: Dict[str, int], prefix: str) -> Dict[str, int]:
        """The figures an entry of this kind carries (`train_keys`, `eval_keys`); an evaluation
        entry never the activations, which belong to training steps."""
        if prefix:
            return keep_keys(without_activation_keys(figures), self.eval_keys)
        return keep_keys(figures, self.train_keys)

    def _observe(self, run: Run, trainer: Any, figures: Dict[str, int], prefix: str, step: int,
                 entry: Dict[str, Any]) -> None:
        """The charts of the figures an entry logged; for an evaluation's entry, also its table."""
        if not figures:
            return
        try:
            if run.tensorboard is None:
                # The reporter names its folder in its own on_train_begin, before any entry. The
                # folder, not the Trainer, is kept: the run must not hold its optimizer alive.
                folder = reporter_log_dir(getattr(getattr(trainer, "callback_handler", None), "callbacks", None))
                if folder is None:
                    return
                run.tensorboard = TensorBoardView(folder, trainer_tag)
            run.tensorboard.observe(figures, prefix, step)
            if prefix:
                run.tensorboard.write_evaluation(entry, prefix, step)
        except Exception as error:  # never break training over a chart
            self._warn("tensorboard", f"writing the TensorBoard charts failed ({error!r})")

    def late(self, logs: Optional[Dict[str, Any]], state: Any, runs: Runs, optimizer: Any) -> None:
        """`on_log`: the figures of an entry the hook did not see, added to it and to `log_history`."""
        # A Trainer subclass whose `log` never calls `Trainer.log` bypasses the hook. Then the
        # figures still reach `log_history` (the entry appended just now) and the reporters after
        # this callback; the ones before it miss them, which the warning says.
        if logs is None or logs is self._contributed_entry:
            return
        prefix = log_entry_prefix(logs)
        run = runs.run(optimizer)
        if prefix is None or run is None:
            return
        figures = with_prefix(self._kept(run.monitor.figures(state.global_step, stepped=state.global_step > 0),
                                         prefix), prefix)
        if not prefix:
            figures.update(keep_keys(run.phases.figures(state.global_step), self.train_keys))
        if not figures or not state.is_world_process_zero:
            return
        self._warn(
            "hook-bypassed",
            "this Trainer's log() does not call transformers.Trainer.log; the optimizer figures are added "
            "to log_history late and miss the report_to reporters",
        )
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def end(self, run: Run, args: Any, state: Any, largest_evaluation: Dict[str, int]) -> None:
        """`on_train_end`: the summary (logger, JSON file, TensorBoard); every process takes part."""
        monitor = run.monitor
        stepped = state.global_step > 0  # an optimizer step has run: the state is a claim, even empty
        final_figures = monitor.figures(state.global_step, stepped=stepped)  # every process takes part
        if not state.is_world_process_zero:
            return
        try:
            measurement = monitor.claimed_measurement(state.global_step, stepped)
            estimate = monitor.estimate()
            if measurement is None and estimate is None:
                return
            document = monitor.summary_document(
                state.global_step,
                stepped=stepped,
                extra={"final_figures": {**final_figures, **keep_keys(run.step_plan.planned, self.train_keys),
                                         **keep_keys(run.phases.figures(state.global_step), self.train_keys)},
                       **({"what_if": run.what_if.to_dict()} if run.what_if is not None else {})},
            )
            phases = judge_phases(step_memory_figures(document)[0], largest_evaluation)
            if phases is not None:
                document["evaluation"] = dict(largest_evaluation)
                document["phases"] = {**phases.to_dict(), "text": phases.text()}
            logger.info(summary_text(measurement, estimate, monitor.judgement(state.global_step),
                                     *step_memory_figures(document))
                        + (f"\n{phases.text()}" if phases is not None else ""))
            if self.summary_file is not None:
                write_summary(document, os.path.join(args.output_dir, self.summary_file))
        except Exception as error:  # never break training over a summary
            self._warn("summary", f"writing the optimizer memory summary failed ({error!r})")
            document = None
        self._write_tensorboard_summary(run, document, state.global_step)

    def _write_tensorboard_summary(self, run: Run, document: Optional[Dict[str, Any]], step: int) -> None:
        view, run.tensorboard = run.tensorboard, None
        if view is None:
            return
        try:
            if document is not None:
                view.write_text(summary_markdown(document), step)
            view.close()
        except Exception as error:  # never break training over a summary
            self._warn("tensorboard", f"writing the TensorBoard summary failed ({error!r})")
