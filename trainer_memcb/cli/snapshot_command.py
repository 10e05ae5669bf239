"""`trainer-memcb snapshot FILE`: a recorded memory snapshot, replayed and asked "what if".

    trainer-memcb snapshot FILE                       per device: events, streams, settings, the
                                                      real and the replayed reserved peak and
                                                      segments, where they part, the what-ifs
    trainer-memcb snapshot FILE --gpu a100-40gb       ... and the same allocations on that card
    trainer-memcb snapshot FILE --alloc-conf expandable_segments:True --device-memory 40GiB
    trainer-memcb snapshot FILE --plan PLAN           ... and beside the planned step (PLAN from
                                                      estimate ... --write-snapshot PLAN)

FILE is what `torch.cuda.memory._dump_snapshot()` wrote. It is read with an unpickler that refuses
every Python global (`trainer_memcb.plan.device.snapshot_file`): a file that is not a snapshot,
hostile ones included, is one line and exit 1, with nothing in it run. The figures are computed by
`replay_snapshot` and only printed here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Tuple

from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell

__all__ = ["add_snapshot_arguments", "snapshot_command", "snapshot_tables"]


def _conf_text(text: str) -> str:
    """--alloc-conf: checked as torch's parser reads it, kept as given."""
    from trainer_memcb.plan.device.alloc_conf import parse_alloc_conf

    try:
        parse_alloc_conf(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_snapshot_arguments(parser: argparse.ArgumentParser) -> None:
    """The `snapshot` command's arguments."""
    from trainer_memcb.cli.estimate_options import _GpuAction, _checked, _memory

    parser.add_argument("file", metavar="FILE", help="a torch.cuda.memory._dump_snapshot() pickle")
    parser.add_argument("--json", action="store_true",
                        help="print JSON with the exact figures instead of tables")
    parser.add_argument("--alloc-conf", type=_conf_text, metavar="TEXT",
                        help="a what-if under these PYTORCH_CUDA_ALLOC_CONF settings")
    parser.add_argument("--plan", metavar="PLAN",
                        help="the planned step as a snapshot (trainer-memcb estimate ... --write-snapshot "
                             "PLAN): each device beside it, and where the real trace first exceeds it")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--device-memory", type=_checked(_memory), metavar="SIZE",
                        help="a what-if on a device the allocator may take this much of (80GiB)")
    memory.add_argument("--gpu", action=_GpuAction, metavar="NAME",
                        help="a what-if on this card: its memory less its CUDA context "
                             "(--gpu list shows the presets)")


def _asked_what_if(args: argparse.Namespace) -> Optional[Tuple[Optional[str], Optional[int]]]:
    memory = args.device_memory
    if args.gpu is not None:
        from trainer_memcb.plan.device.gpus import gpu_preset

        preset = gpu_preset(args.gpu)
        memory = preset.total_bytes - preset.cuda_context_bytes
    if args.alloc_conf is None and memory is None:
        return None
    return args.alloc_conf, memory


def plan_tables(device: int, comparison: Any) -> List[TextTable]:
    """`--plan`: the planned step beside the real trace, and the plan's allocated peak by part."""
    over = comparison.first_over
    parted = ("never: the real trace stays within the plan's peaks" if over is None else
              f"event {over.event_index:,} ({over.action}): {over.figure} {bytes_cell(over.real_bytes)} "
              f"exceeds the plan's peak {bytes_cell(over.planned_bytes)}")
    rows = [[name, bytes_cell(figures.reserved_peak_bytes), bytes_cell(figures.allocated_peak_bytes),
             count_cell(figures.segments_created), count_cell(figures.segments_freed)]
            for name, figures in (("planned", comparison.planned), ("real", comparison.real))]
    tables = [TextTable(f"device {device}: planned against real",
                        ["", "reserved peak", "allocated peak", "segments created", "segments freed"], rows,
                        note=f"first over the plan: {parted}")]
    if comparison.planned_peak_parts:
        tables.append(TextTable(f"device {device}: the plan's allocated peak by part", ["part", "allocated"],
                                [[part.part, bytes_cell(part.bytes)] for part in comparison.planned_peak_parts],
                                note="the real trace's frames are Python's: they name no part"))
    return tables


def snapshot_tables(replay: Any, plans: Optional[Dict[int, Any]] = None) -> List[TextTable]:
    """One table per device: real against replayed, then the what-ifs (and with `plans`, the plan's)."""
    tables = []
    for device in replay.devices:
        settings = device.alloc_conf or "torch's defaults"
        if not device.settings_recorded:
            settings += " (the dump recorded no settings)"
        capacity = {"given": "as given", "oom event": "taken from its out-of-memory event",
                    "retry bursts": "the least its release-and-retry bursts allow",
                    "unknown": "unknown: replayed with no limit"}[device.capacity_source]
        if device.capacity_bytes is not None:
            capacity = f"{bytes_cell(device.capacity_bytes)}, {capacity}"
        if device.capacity_range_bytes is not None:
            capacity += f" (they allow up to {bytes_cell(device.capacity_range_bytes[1])})"
        divergence = device.first_divergence
        parted = ("none: the replay creates and frees the real segments, in order"
                  if divergence is None else
                  f"event {divergence.event_index:,} ({divergence.action}): {divergence.reason}")
        rows = [[name, bytes_cell(figures.reserved_peak_bytes),
                 count_cell(figures.segments_created), count_cell(figures.segments_freed)]
                for name, figures in (("real", device.real), ("replayed", device.replayed))]
        tables.append(TextTable(
            f"device {device.device}: {device.events:,} events, streams "
            f"{', '.join(map(str, device.streams))}; settings: {settings}",
            ["", "reserved peak", "segments created", "segments freed"], rows,
            note=(f"reserved when recording began: {bytes_cell(device.start_reserved_bytes)}; "
                  f"device memory {capacity}; first divergence: {parted}")))
        rows = [[what.alloc_conf or "torch's defaults", bytes_cell(what.device_memory_bytes),
                 bytes_cell(what.reserved_peak_bytes), "yes" if what.oom else "no"]
                for what in device.what_if]
        tables.append(TextTable(f"device {device.device}: what if", [
            "PYTORCH_CUDA_ALLOC_CONF", "device memory", "reserved peak", "out of memory"], rows,
            text_columns=(0, 3), note="the same allocations, from the same start"))
        if plans and device.device in plans:
            tables += plan_tables(device.device, plans[device.device])
    return tables


def snapshot_command(args: argparse.Namespace) -> int:
    """Read, replay, print; a file that is not a snapshot is one line and exit 1."""
    from trainer_memcb.cli.failures import KnownFailure
    from trainer_memcb.cli.output import print_json, print_tables
    from trainer_memcb.plan.device.snapshot_file import SnapshotError, read_snapshot
    from trainer_memcb.plan.device.snapshot_replay import replay_snapshot

    try:
        snapshot = read_snapshot(args.file)
    except SnapshotError as error:
        raise KnownFailure(str(error)) from None
    plans = None
    if args.plan is not None:
        from trainer_memcb.plan.device.snapshot_plan import compare_with_plan

        try:
            plan = read_snapshot(args.plan)
        except SnapshotError as error:
            raise KnownFailure(str(error)) from None
        if not plan.device_traces or not plan.device_traces[0]:
            raise KnownFailure(f"{args.plan}: records no events on device 0 (write the plan with "
                               "trainer-memcb estimate ... --write-snapshot)")
        plans = compare_with_plan(snapshot, plan)
    asked = _asked_what_if(args)
    replay = replay_snapshot(snapshot, what_ifs=[asked] if asked else [])
    if not replay.devices:
        raise KnownFailure(f"{args.file}: records no events (record them with "
                           "torch.cuda.memory._record_memory_history() before the dump)")
    if args.json:
        from trainer_memcb.cli.snapshot_schema import snapshot_document, snapshot_json

        print_json(snapshot_json(snapshot_document(replay, plans)), sys.stdout)
    else:
        print_tables(snapshot_tables(replay, plans), sys.stdout)
    return 0
