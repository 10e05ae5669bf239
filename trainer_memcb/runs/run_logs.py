"""Read what a finished (or running) Trainer run left on disk, trusting none of it.

A run folder is a Trainer's `output_dir`. Its log history comes from, in this order:

1. `<run>/trainer_state.json` (written by `trainer.save_state()`, or when `run` is a checkpoint);
   when it cannot be read, a complete checkpoint's, with a warning (else the file is refused);
2. `<run>/checkpoint-<N>/trainer_state.json` of the newest complete checkpoint: one whose state
   file is missing or unreadable (a save cut short) is passed over, with a warning;
3. TensorBoard event files (`events.out.tfevents.*`) under `<run>`, when there is no state
   file: the newest folder of them. TensorBoard keeps scalars as float32, so byte counts above
   2**24 come back rounded.

Beside it, the callback's end-of-training summary `<run>/optimizer_memory.json`, when present.

Every file is read within bounds (`trainer_memcb.utils.safe_io`): regular files only, a size limit per
kind, JSON at most 64 levels deep, folders searched without following symbolic links. Every value
is checked for its type (`trainer_memcb.runs.run_values`): a wrong one is dropped and the file named in
`RunLog.warnings`; a file that cannot be read at all raises `RunLogError`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from trainer_memcb.runs.run_values import clean_log_history, clean_summary
from trainer_memcb.utils.safe_io import MAX_WALK_ENTRIES, UnsafeFileError, find_files, read_json
from trainer_memcb.training.tensorboard_view import EVENT_FILE_SUFFIX
from trainer_memcb.training.summary import SUMMARY_FILE_NAME
from trainer_memcb.utils.units import MiB

__all__ = [
    "TRAINER_STATE_FILE_NAME",
    "EVENT_FILE_PATTERN",
    "MAX_TRAINER_STATE_BYTES",
    "MAX_SUMMARY_BYTES",
    "MAX_LOG_ENTRIES",
    "MAX_EVENT_FILES",
    "RunLog",
    "RunLogError",
    "find_trainer_state",
    "find_event_files",
    "read_trainer_state",
    "read_event_files",
    "read_summary",
    "load_run",
]

# transformers/trainer_callback.py TrainerState.save_to_json, trainer.py TRAINER_STATE_NAME.
TRAINER_STATE_FILE_NAME = "trainer_state.json"
# torch/utils/tensorboard and tensorboardX name every event file so.
EVENT_FILE_PATTERN = "events.out.tfevents.*"
# transformers/trainer_utils.py PREFIX_CHECKPOINT_DIR and get_last_checkpoint's pattern.
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Far above a long run's state file (tens of MiB), small enough to parse in memory.
MAX_TRAINER_STATE_BYTES = 128 * MiB
MAX_LOG_ENTRIES = 1_000_000
# The callback's summary is a few KiB.
MAX_SUMMARY_BYTES = 16 * MiB
# Event files read from the newest folder.
MAX_EVENT_FILES = 1_000
# transformers/integrations/integration_utils.py rewrite_logs: `eval_x` -> `eval/x`,
# `test_x` -> `test/x`, every other key `x` -> `train/x`. Undone here to get the Trainer's keys back.
_TENSORBOARD_PREFIXES = {"eval/": "eval_", "test/": "test_", "train/": ""}


class RunLogError(Exception):
    """A run folder that holds nothing readable; the message says where it looked and why."""


@dataclass
class RunLog:
    """The logs of one run.

    Attributes:
        run_dir: the folder given.
        log_history: the Trainer's `log_history` entries, oldest first (empty with only a summary),
            each value the command reads checked for its type.
        history_file: the `trainer_state.json` read, or None.
        event_files: the TensorBoard event files read when there was no state file.
        summary: the fields of the callback's `optimizer_memory.json` the command reads, or None.
        summary_file: its path, or None.
        warnings: one line per file with something left out: values of the wrong type, checkpoints
            passed over.
    """

    run_dir: str
    log_history: List[Dict[str, Any]] = field(default_factory=list)
    history_file: Optional[str] = None
    event_files: List[str] = field(default_factory=list)
    summary: Optional[Dict[str, Any]] = None
    summary_file: Optional[str] = None
    warnings: List[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.abspath(self.run_dir))

    @property
    def history_source(self) -> Optional[str]:
        """Where the log history came from, for people."""
        if self.history_file is not None:
            return self.history_file
        if self.event_files:
            return os.path.dirname(self.event_files[0])
        return None


def _checkpoints(run_dir: str) -> List[str]:
    """The `checkpoint-<N>` folders of a run, newest (largest N) first; links are not followed."""
    found: List[Tuple[int, str]] = []
    try:
        with os.scandir(run_dir) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_WALK_ENTRIES:
                    break
                match = _CHECKPOINT.match(entry.name)
                if match and entry.is_dir(follow_symlinks=False):
                    found.append((int(match.group(1)), entry.path))
    except OSError:
        return []
    return [path for _, path in sorted(found, reverse=True)]


def find_trainer_state(run_dir: str) -> Optional[str]:
    """`<run>/trainer_state.json`, else the newest checkpoint's (present, not necessarily readable), else None."""
    direct = os.path.join(run_dir, TRAINER_STATE_FILE_NAME)
    if os.path.lexists(direct):
        return direct
    for checkpoint in _checkpoints(run_dir):
        in_checkpoint = os.path.join(checkpoint, TRAINER_STATE_FILE_NAME)
        if os.path.lexists(in_checkpoint):
            return in_checkpoint
    return None


def find_event_files(run_dir: str) -> List[str]:
    """The event files of the newest TensorBoard folder under `run_dir`.

    A Trainer run writes one folder per `train()` (`runs/<date>_<host>`); when a folder holds
    several, the newest one is the run that was reported last. Symbolic links are not followed
    and folders more than 8 levels down are not searched.
    """
    try:
        paths = find_files(run_dir, EVENT_FILE_PATTERN)
    except UnsafeFileError as error:
        raise RunLogError(str(error)) from None
    dated = []
    for path in paths:
        if path.endswith(EVENT_FILE_SUFFIX):
            continue  # the callback's own charts and text summary: no scalars to read
        try:
            dated.append((os.lstat(path).st_mtime, path))
        except OSError:
            continue
    if not dated:
        return []
    folder = os.path.dirname(max(dated)[1])
    return sorted(path for _, path in dated if os.path.dirname(path) == folder)[:MAX_EVENT_FILES]


def _read_json(path: str, max_bytes: int) -> Any:
    try:
        return read_json(path, max_bytes)
    except UnsafeFileError as error:
        raise RunLogError(str(error)) from None


def read_trainer_state(path: str) -> List[Dict[str, Any]]:
    """The `log_history` list of a `trainer_state.json`, as written (entries unchecked)."""
    document = _read_json(path, MAX_TRAINER_STATE_BYTES)
    history = document.get("log_history") if isinstance(document, dict) else None
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        raise RunLogError(f"{path} has no 'log_history' list of entries; is it a Trainer's {TRAINER_STATE_FILE_NAME}?")
    if len(history) > MAX_LOG_ENTRIES:
        raise RunLogError(f"{path} holds more than {MAX_LOG_ENTRIES:,} log entries; not read")
    return history


def _trainer_key(tag: str) -> Optional[str]:
    for prefix, replacement in _TENSORBOARD_PREFIXES.items():
        if tag.startswith(prefix):
            return replacement + tag[len(prefix):]
    return None


def read_event_files(paths: List[str]) -> List[Dict[str, Any]]:
    """Scalars of TensorBoard event files as `log_history`-like entries, one per (step, kind).

    A training entry holds the `train/...` scalars of a step under their Trainer names (`loss`,
    `optimizer_state_bytes`), an evaluation entry the `eval/...` ones (`eval_accuracy`). Whole
    floats come back as ints.
    """
    try:
        from trainer_memcb.runs.event_records import read_events
        import tensorboard  # noqa: F401  (the reader needs its protobufs)
    except ImportError:
        raise RunLogError(
            "reading TensorBoard event files needs tensorboard: pip install 'trainer_memcb[tensorboard]'"
        ) from None
    entries: Dict[tuple, Dict[str, Any]] = {}
    for path in paths:
        try:
            for event in read_events(path):
                for value in event.summary.value:
                    key = _trainer_key(value.tag)
                    number = _scalar(value)
                    if key is None or number is None:
                        continue
                    kind = key.split("_", 1)[0] if key.startswith(("eval_", "test_")) else ""
                    entry = entries.setdefault((event.step, kind), {"step": event.step})
                    entry[key] = number
        except UnsafeFileError as error:
            raise RunLogError(str(error)) from None
        if len(entries) > MAX_LOG_ENTRIES:
            raise RunLogError(f"{path}: more than {MAX_LOG_ENTRIES:,} logged steps; not read further")
    return [entries[slot] for slot in sorted(entries, key=lambda slot: (slot[0], slot[1] != ""))]


def _scalar(value: Any) -> Optional[float]:
    """The number in a summary value: `simple_value` (add_scalar), or a 0-dim tensor (new style)."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        number = float(value.simple_value)
    elif kind == "tensor" and not value.tensor.tensor_shape.dim:
        from tensorboard.util.tensor_util import make_ndarray

        try:
            array = make_ndarray(value.tensor)
            if array.dtype.kind not in "iuf" or array.size != 1:
                return None
            number = float(array.reshape(()))
        except Exception:  # a tensor proto whose content does not match its dtype: not a scalar
            return None
    else:
        return None
    return int(number) if number.is_integer() else number


def read_summary(path: str) -> Dict[str, Any]:
    """The callback's end-of-training JSON summary, as written (fields unchecked)."""
    document = _read_json(path, MAX_SUMMARY_BYTES)
    if not isinstance(document, dict) or "measured" not in document or "estimate" not in document:
        raise RunLogError(f"{path} is not a trainer_memcb summary (no 'measured' and 'estimate')")
    return document


def _listed(paths: List[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{', '.join(paths[:-1])} and {paths[-1]}"


def _read_history(run: RunLog) -> None:
    direct = os.path.join(run.run_dir, TRAINER_STATE_FILE_NAME)
    unreadable: Optional[RunLogError] = None
    if os.path.lexists(direct):
        try:
            run.history_file, run.log_history = direct, read_trainer_state(direct)
            return
        except RunLogError as error:  # save_state() cut short: a complete checkpoint may still tell the run
            unreadable = error
    incomplete: List[str] = []
    for checkpoint in _checkpoints(run.run_dir):
        state_file = os.path.join(checkpoint, TRAINER_STATE_FILE_NAME)
        try:
            run.log_history = read_trainer_state(state_file)
        except RunLogError:
            # Missing, cut short or not a state: a save that did not finish (Trainer._save_checkpoint
            # writes trainer_state.json after the model and the optimizer).
            incomplete.append(checkpoint)
            continue
        run.history_file = state_file
        break
    if incomplete:
        verb = "is" if len(incomplete) == 1 else "are"
        found = f"; read {os.path.dirname(run.history_file)}" if run.history_file else ""
        run.warnings.append(f"{_listed(incomplete)} {verb} incomplete (no readable {TRAINER_STATE_FILE_NAME}){found}")
    if unreadable is not None:
        if run.history_file is None:
            raise unreadable
        run.warnings.append(f"{unreadable}; read {run.history_file} instead")
    if run.history_file is None:
        run.event_files = find_event_files(run.run_dir)
        if run.event_files:
            run.log_history = read_event_files(run.event_files)


def load_run(run_dir: str, metrics: Optional[Sequence[str]] = None) -> RunLog:
    """Everything `trainer-memcb report` reads from one run folder.

    Args:
        run_dir: the Trainer's `output_dir`, or one of its checkpoints.
        metrics: the evaluation metrics whose values are checked (`["accuracy"]` checks
            `eval_accuracy`); None checks every `eval_*` and `test_*` value.

    Raises:
        RunLogError: no such folder, nothing to read in it, or a file that cannot be read.

    Examples:
        >>> load_run("no/such/run")
        Traceback (most recent call last):
        ...
        trainer_memcb.runs.run_logs.RunLogError: no/such/run: no such folder
    """
    if not os.path.isdir(run_dir):
        raise RunLogError(f"{run_dir}: no such folder")
    run = RunLog(run_dir=run_dir)
    summary_file = os.path.join(run_dir, SUMMARY_FILE_NAME)
    if os.path.lexists(summary_file):
        run.summary, problems = clean_summary(read_summary(summary_file))
        run.summary_file = summary_file
        if problems.count:
            run.warnings.append(f"{summary_file}: {problems.sentence('a summary does not hold')}")
    _read_history(run)
    metric_keys = None if metrics is None else {f"eval_{metric}" for metric in metrics}
    label = "log_history" if run.history_file else "scalars"
    run.log_history, problems = clean_log_history(run.log_history, label, metric_keys)
    if problems.count:
        run.warnings.append(f"{run.history_source}: {problems.sentence('a run does not log')}")
    if not run.log_history and run.summary is None:
        raise RunLogError(
            f"{run_dir}: no logs found. Looked for {os.path.join(run_dir, TRAINER_STATE_FILE_NAME)}, "
            f"{os.path.join(run_dir, 'checkpoint-<N>', TRAINER_STATE_FILE_NAME)}, TensorBoard event files "
            f"({EVENT_FILE_PATTERN}) under {run_dir}, and {summary_file}"
        )
    return run
