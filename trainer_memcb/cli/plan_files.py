"""`estimate --write-snapshot FILE` and `--write-html FILE`: the planned step written out.

`--write-snapshot` writes the CUDA step plan's allocator replay as a `torch.cuda.memory._dump_snapshot`
pickle (`trainer_memcb.plan.answers.plan_snapshot.plan_snapshot`), which `trainer-memcb snapshot`,
`python -m torch.cuda._memory_viz` and pytorch.org/memory_viz read; `--write-html` a page of the
planned step (`trainer_memcb.cli.plan_html`). The step written is the one at `--batch-size`, else
the largest batch `--max-batch-size` found. The options are checked before torch is imported
(`check_plan_files`: a step plan asked, a CUDA device for the snapshot, a destination that is not a
link and whose folder exists and takes files); each file is written all or nothing, never through a
symbolic link (`trainer_memcb.utils.safe_io.atomic_write`).
"""

from __future__ import annotations

import os
from typing import Any, List

from trainer_memcb.cli.estimate_request import EstimateRequest

__all__ = ["FILE_OPTIONS", "check_plan_files", "write_plan_files"]

# The options that write the planned step, by argparse name.
FILE_OPTIONS = (("write_snapshot", "--write-snapshot"), ("write_html", "--write-html"))


def check_plan_files(args: EstimateRequest) -> None:
    """Refuse `--write-snapshot` and `--write-html` where they cannot be written, before anything
    is planned.

    Raises:
        ValueError: one line naming the option and why.
    """
    from trainer_memcb.utils.safe_io import UnsafeFileError, check_writable, refuse_unsafe_destination

    for name, option in FILE_OPTIONS:
        path = getattr(args, name, None)
        if path is None:
            continue
        if not args.questions.step:
            raise ValueError(f"{option} writes the planned step: it needs the step plan (--batch-size or "
                             "--max-batch-size)")
        if name == "write_snapshot" and getattr(args, "device_type", None) == "cpu":
            raise ValueError("--write-snapshot writes the CUDA caching allocator's snapshot, and --device-type cpu "
                             "has no such allocator: plan --device-type cuda, or draw the CPU step with --write-html")
        try:
            refuse_unsafe_destination(path)
        except UnsafeFileError as error:
            raise ValueError(f"{option} {error}") from None
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{option} {path}: the folder {folder} does not exist")
        check_writable(path, folder, option)
    paths = [getattr(args, name, None) for name, _ in FILE_OPTIONS]
    if None not in paths and os.path.abspath(paths[0]) == os.path.abspath(paths[1]):
        raise ValueError(f"--write-snapshot and --write-html name the same file {paths[0]}")


def write_plan_files(step: Any, args: EstimateRequest) -> List[str]:
    """Write the files asked for of `step` (a `StepMemoryPlan`, or None when no step was planned:
    `--max-batch-size` found no batch that fits); the lines to say about them.

    Raises:
        ValueError: the step cannot be written (planned for the CPU by a settings file, not traced),
            or a destination refused since it was checked; one line.
        OSError: the file could not be written (nothing was).
    """
    import pickle

    from trainer_memcb.cli.output import bytes_cell
    from trainer_memcb.utils.safe_io import UnsafeFileError, atomic_write

    asked = [(name, option, getattr(args, name, None)) for name, option in FILE_OPTIONS
             if getattr(args, name, None) is not None]
    if not asked:
        return []
    if step is None:
        return [f"{path} not written: no batch fits, so there is no planned step to write" for _, _, path in asked]
    if step.timeline is None:
        return [f"{path} not written: the step could not be traced ({step.step.problem})" for _, _, path in asked]
    said: List[str] = []
    for name, option, path in asked:
        if name == "write_snapshot":
            from trainer_memcb.plan.answers.plan_snapshot import plan_snapshot

            try:
                snapshot = plan_snapshot(step)
            except ValueError as error:
                raise ValueError(f"{option}: {error}") from None
            data = pickle.dumps(snapshot, protocol=4)
            events = len(snapshot["device_traces"][0])
            what = (f"the planned step's allocator replay as a memory snapshot ({events:,} events, reserved peak "
                    f"{bytes_cell(step.device.reserved_peak_bytes)}; read it with trainer-memcb snapshot {path})")
        else:
            from trainer_memcb.cli.plan_html import plan_html
            from trainer_memcb.plan.answers.plan_snapshot import step_series

            data = plan_html(step, step_series(step)).encode("utf-8")
            what = "a page of the planned step (open it in a browser; it fetches nothing)"
        try:
            atomic_write(path, lambda handle: handle.write(data))
        except UnsafeFileError as error:
            raise ValueError(f"{option} {error}") from None
        said.append(f"wrote {path}: {what}")
    return said
