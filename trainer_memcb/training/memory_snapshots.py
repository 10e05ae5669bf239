"""The CUDA caching allocator's history recorded over chosen training steps, and dumped as a snapshot.

`OptimizerMemoryCallback(memory_snapshot_dir=..., snapshot_steps=(1, 2))` (off by default): at the
start of the first chosen optimizer step `torch.cuda.memory._record_memory_history(max_entries=
MAX_ENTRIES)`, at the end of the last one `torch.cuda.memory._dump_snapshot(...)` into
`<memory_snapshot_dir>/memory_snapshot_step<N>.pickle` (N the last chosen step), then
`_record_memory_history(enabled=None)`. The file is what `trainer-memcb snapshot FILE` reads (with
`--plan`, beside the planned step) and what pytorch.org/memory_viz draws.

- Steps count as `state.global_step` does: step 1 is the first optimizer step.
- An out-of-memory error (`torch.OutOfMemoryError`) leaving `Trainer.train` while recording dumps
  `memory_snapshot_oom.pickle` first; the error then goes on, the same object.
- Training that ends before the last chosen step dumps what was recorded, named by the last step
  done, and warns once; any other error leaving `train()` stops the recording, no file.
- Every process records its own allocator: with several processes each file name carries its rank
  (`memory_snapshot_step2-rank1.pickle`), as the out-of-memory report's does; one process alone
  writes the plain name.
- Recording is asked for when CUDA is available (the history is the process's allocator's); without
  CUDA, one warning says there is nothing to record, and nothing else happens.
- Files are written atomically: dumped to a temporary name in the same folder (made if missing),
  then renamed over the destination with `os.replace`; a destination that is a symbolic link is
  refused (`trainer_memcb.utils.safe_io`).

The run is never altered: nothing here changes a tensor, a setting or the allocator's statistics
(recording only adds its bookkeeping), a fault warns once and is skipped, and what was started is
stopped on every way out (the last step, `on_train_end`, an error leaving `train()`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Tuple

import torch

from trainer_memcb.utils.safe_io import atomic_write

__all__ = ["MAX_ENTRIES", "OOM_SNAPSHOT_FILE_NAME", "MemorySnapshots", "check_memory_snapshot_dir",
           "check_snapshot_steps", "snapshot_path"]

# The events the allocator keeps (a ring: the oldest go first). torch's default keeps all of them,
# without bound in a long run; torch's own guide ("Understanding CUDA Memory Usage") uses 100,000.
MAX_ENTRIES = 100_000
OOM_SNAPSHOT_FILE_NAME = "memory_snapshot_oom.pickle"


def check_memory_snapshot_dir(value: Any) -> Optional[str]:
    """`value` as a folder path (str), or None; else a `ValueError`."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bool):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            return path
    raise ValueError(f"memory_snapshot_dir={value!r}: expected a folder (a non-empty str or os.PathLike) for the "
                     "memory snapshots, or None for none")


def check_snapshot_steps(value: Any) -> Tuple[int, ...]:
    """The chosen optimizer steps, sorted, each once; else a `ValueError`.

    Like the callback's name lists: a list or tuple, or one comma-separated string.

    Examples:
        >>> check_snapshot_steps("3, 1")
        (1, 3)
        >>> check_snapshot_steps((0, 2))
        Traceback (most recent call last):
        ...
        ValueError: snapshot_steps=0 is not a step: expected positive ints (the first optimizer step is 1)
    """
    items: Any = value
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
        items = [int(item) if item.isdigit() else item for item in items]
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"snapshot_steps={value!r}: expected optimizer steps, positive ints (a list or tuple, "
                         "or one comma-separated string such as \"1,2\")")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise ValueError(f"snapshot_steps={item!r} is not a step: expected positive ints (the first "
                             "optimizer step is 1)")
    return tuple(sorted(set(items)))


def snapshot_path(folder: str, name: str, rank: int = 0, world_size: int = 1) -> str:
    """`<folder>/<name>`, or with several processes `<folder>/<stem>-rank<N><suffix>`."""
    if world_size > 1:
        stem, suffix = os.path.splitext(name)
        name = f"{stem}-rank{rank}{suffix}"
    return os.path.join(folder, name)


def _dump_atomically(path: str) -> None:
    """`_dump_snapshot` to a temporary file in `path`'s folder, then `os.replace`; never through a link."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, torch.cuda.memory._dump_snapshot, by_name=True)


class MemorySnapshots:
    """The recording for one callback (see the module docstring). Every method never raises.

    Args:
        folder: `memory_snapshot_dir` (None: off, every method returns at once).
        steps: the chosen steps (`check_snapshot_steps`).
        warn: warn once per kind of fault.
    """

    def __init__(self, folder: Optional[str], steps: Tuple[int, ...], warn: Callable[[str, str], None]) -> None:
        self.folder, self.steps, self._warn = folder, steps, warn
        self.recording = False
        # The file names' rank part, read from the run's arguments as recording starts.
        self._rank, self._world_size = 0, 1

    def step_begin(self, args: Any, state: Any) -> None:
        """Start recording as the first chosen step begins (`state.global_step` steps are done)."""
        if self.folder is None or self.recording or int(state.global_step) + 1 != self.steps[0]:
            return
        if not torch.cuda.is_available():
            self._warn("memory-snapshot", "memory_snapshot_dir is set but CUDA is not available: there is no "
                       "allocator history to record; no memory snapshot is written")
            return
        self._rank = int(getattr(args, "process_index", 0) or 0)
        self._world_size = int(getattr(args, "world_size", 1) or 1)
        try:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
            self.recording = True
        except Exception as error:  # never break training over a recording
            self._warn("memory-snapshot", f"recording the allocator's history failed ({error!r}); no memory "
                       "snapshot is written")

    def step_end(self, state: Any) -> None:
        """Dump and stop as the last chosen step ends."""
        if self.recording and int(state.global_step) >= self.steps[-1]:
            self._finish(f"memory_snapshot_step{self.steps[-1]}.pickle")

    def train_end(self, state: Any) -> None:
        """Training ended while recording (before the last chosen step): dump what was recorded."""
        if self.recording:
            done = int(state.global_step)
            self._warn("memory-snapshot-short", f"training ended after step {done}, before snapshot step "
                       f"{self.steps[-1]}; the memory snapshot holds the steps up to {done}")
            self._finish(f"memory_snapshot_step{done}.pickle")

    def train_left(self, out_of_memory: bool) -> None:
        """`train()` returned or raised: an out-of-memory error dumps the oom file; recording stops."""
        if self.recording:
            self._finish(OOM_SNAPSHOT_FILE_NAME if out_of_memory else None)

    def _finish(self, name: Optional[str]) -> None:
        try:
            if name is not None:
                _dump_atomically(snapshot_path(self.folder or ".", name, self._rank, self._world_size))
        except Exception as error:
            self._warn("memory-snapshot-dump", f"writing the memory snapshot {name} failed ({error!r})")
        finally:
            self.recording = False
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as error:
                self._warn("memory-snapshot-stop", f"stopping the allocator's history failed ({error!r})")
