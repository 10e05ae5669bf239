"""Read what a finished (or running) Trainer run left on disk.

A run folder is a Trainer's `output_dir`. Its log history comes from, in this order:

1. `<run>/trainer_state.json` (written by `trainer.save_state()`, or when `run` is a checkpoint);
2. `<run>/checkpoint-<N>/trainer_state.json` of the latest checkpoint;
3. TensorBoard event files (`events.out.tfevents.*`) anywhere under `<run>`, when there is no state
   file: the newest folder of them. TensorBoard keeps scalars as float32, so byte counts above
   2**24 come back rounded.

Beside it, the callback's end-of-training summary `<run>/optimizer_memory.json`, when present.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from trainer_memcb.summary import SUMMARY_FILE_NAME

__all__ = [
    "TRAINER_STATE_FILE_NAME",
    "EVENT_FILE_PATTERN",
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
        log_history: the Trainer's `log_history` entries, oldest first (empty with only a summary).
        history_file: the `trainer_state.json` read, or None.
        event_files: the TensorBoard event files read when there was no state file.
        summary: the callback's `optimizer_memory.json`, or None.
        summary_file: its path, or None.
    """

    run_dir: str
    log_history: List[Dict[str, Any]] = field(default_factory=list)
    history_file: Optional[str] = None
    event_files: List[str] = field(default_factory=list)
    summary: Optional[Dict[str, Any]] = None
    summary_file: Optional[str] = None

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


def find_trainer_state(run_dir: str) -> Optional[str]:
    """`<run>/trainer_state.json`, else the latest checkpoint's, else None."""
    from transformers.trainer_utils import get_last_checkpoint

    direct = os.path.join(run_dir, TRAINER_STATE_FILE_NAME)
    if os.path.isfile(direct):
        return direct
    checkpoint = get_last_checkpoint(run_dir)
    if checkpoint is not None:
        in_checkpoint = os.path.join(checkpoint, TRAINER_STATE_FILE_NAME)
        if os.path.isfile(in_checkpoint):
            return in_checkpoint
    return None


def find_event_files(run_dir: str) -> List[str]:
    """The event files of the newest TensorBoard folder under `run_dir`.

    A Trainer run writes one folder per `train()` (`runs/<date>_<host>`); when a folder holds
    several, the newest one is the run that was reported last.
    """
    paths = glob.glob(os.path.join(run_dir, "**", EVENT_FILE_PATTERN), recursive=True)
    if not paths:
        return []
    newest = max(paths, key=os.path.getmtime)
    folder = os.path.dirname(newest)
    return sorted(path for path in paths if os.path.dirname(path) == folder)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise RunLogError(f"{path} is not valid JSON ({error})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise RunLogError(f"{path} could not be read ({error})") from None


def read_trainer_state(path: str) -> List[Dict[str, Any]]:
    """The `log_history` list of a `trainer_state.json`."""
    document = _read_json(path)
    history = document.get("log_history") if isinstance(document, dict) else None
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        raise RunLogError(f"{path} has no 'log_history' list of entries; is it a Trainer's {TRAINER_STATE_FILE_NAME}?")
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
        # The legacy loader parses events as written, without the read-time conversion of
        # `simple_value` scalars into tensors.
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    except ImportError:
        raise RunLogError(
            "reading TensorBoard event files needs tensorboard: pip install 'trainer_memcb[tensorboard]'"
        ) from None
    entries: Dict[tuple, Dict[str, Any]] = {}
    for path in paths:
        try:
            events = list(LegacyEventFileLoader(path).Load())
        except Exception as error:  # a truncated or foreign file: say which one
            raise RunLogError(f"{path} is not a readable TensorBoard event file ({error!r})") from None
        for event in events:
            for value in event.summary.value:
                key = _trainer_key(value.tag)
                number = _scalar(value)
                if key is None or number is None:
                    continue
                kind = key.split("_", 1)[0] if key.startswith(("eval_", "test_")) else ""
                entry = entries.setdefault((event.step, kind), {"step": event.step})
                entry[key] = number
    return [entries[slot] for slot in sorted(entries, key=lambda slot: (slot[0], slot[1] != ""))]


def _scalar(value: Any) -> Optional[float]:
    """The number in a summary value: `simple_value` (add_scalar), or a 0-dim tensor (new style)."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        number = float(value.simple_value)
    elif kind == "tensor" and not value.tensor.tensor_shape.dim:
        from tensorboard.util.tensor_util import make_ndarray

        array = make_ndarray(value.tensor)
        if array.dtype.kind not in "iuf":
            return None
        number = float(array)
    else:
        return None
    return int(number) if number.is_integer() else number


def read_summary(path: str) -> Dict[str, Any]:
    """The callback's end-of-training JSON summary."""
    document = _read_json(path)
    if not isinstance(document, dict) or "measured" not in document or "estimate" not in document:
        raise RunLogError(f"{path} is not a trainer_memcb summary (no 'measured' and 'estimate')")
    return document


def load_run(run_dir: str) -> RunLog:
    """Everything `trainer-memcb report` reads from one run folder.

    Raises:
        RunLogError: no such folder, nothing to read in it, or a file that cannot be parsed.

    Example:
        >>> load_run("no/such/run")
        Traceback (most recent call last):
        ...
        trainer_memcb.run_logs.RunLogError: no/such/run: no such folder
    """
    if not os.path.isdir(run_dir):
        raise RunLogError(f"{run_dir}: no such folder")
    run = RunLog(run_dir=run_dir)
    summary_file = os.path.join(run_dir, SUMMARY_FILE_NAME)
    if os.path.isfile(summary_file):
        run.summary, run.summary_file = read_summary(summary_file), summary_file
    run.history_file = find_trainer_state(run_dir)
    if run.history_file is not None:
        run.log_history = read_trainer_state(run.history_file)
    else:
        run.event_files = find_event_files(run_dir)
        if run.event_files:
            run.log_history = read_event_files(run.event_files)
    if not run.log_history and run.summary is None:
        raise RunLogError(
            f"{run_dir}: no logs found. Looked for {os.path.join(run_dir, TRAINER_STATE_FILE_NAME)}, "
            f"{os.path.join(run_dir, 'checkpoint-<N>', TRAINER_STATE_FILE_NAME)}, TensorBoard event files "
            f"({EVENT_FILE_PATTERN}) under {run_dir}, and {summary_file}"
        )
    return run
