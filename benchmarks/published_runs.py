"""The step plan against published GPU runs: each run's settings planned, the planned allocated,
reserved and total bytes beside the published figure, and fits? beside what the run did.

The runs, their sources, settings and the planner's arguments are in
`tests/data/published/runs.json` (the model configs beside it); `tests/plan/test_published_runs.py`
holds the verdicts and the figures recorded there. Each plan is `trainer-memcb estimate ARGV --json`
run in this process, `PYTORCH_CUDA_ALLOC_CONF` unset (the runs used torch's defaults).

    python benchmarks/published_runs.py                 # every run: about 10 minutes on 2 cores
    python benchmarks/published_runs.py --only peft     # the runs whose name holds "peft"
    python benchmarks/published_runs.py --record        # also write the planned figures into runs.json
    python benchmarks/published_runs.py --markdown      # the table as the guide shows it
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "tests", "data", "published", "runs.json")
GiB = 1024 ** 3
# The figures a plan records per run (`StepMemoryPlan` fields).
RECORDED = ("peak_bytes", "allocator_allocated_peak_bytes", "reserved_peak_bytes", "device_total_bytes",
            "fragmentation_bytes", "fits", "margin_bytes")


def load_runs() -> List[Dict[str, Any]]:
    with open(RUNS, encoding="utf-8") as handle:
        return json.load(handle)


def plan_run(run: Dict[str, Any]) -> Dict[str, Any]:
    """The step plan's figures for one run (`RECORDED`), from the command line's JSON."""
    from trainer_memcb.cli import main

    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    cwd = os.getcwd()
    out = io.StringIO()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out):
            code = main(["estimate", *run["argv"], "--json"])
    finally:
        os.chdir(cwd)
    if code not in (0, 3):
        raise RuntimeError(f"{run['name']}: trainer-memcb estimate exited {code}")
    document = json.loads(out.getvalue())
    figures = {**document["step"], **document["device"], **document["answers"]}
    return {key: figures[key] for key in RECORDED}


def _gib(nbytes: Any) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.2f}"


def difference(run: Dict[str, Any], planned: Dict[str, Any]) -> str:
    """Planned against the published figure of the same kind, as a percentage of the published."""
    published = run.get("published")
    if not published:
        return "-"
    mine = planned["reserved_peak_bytes"] if published["kind"] == "reserved" else planned["device_total_bytes"]
    return f"{(mine - published['bytes']) / published['bytes'] * 100:+.1f}% ({published['kind']})"


def verdict(run: Dict[str, Any], planned: Dict[str, Any]) -> str:
    said = "fits" if planned["fits"] else "does not fit"
    right = planned["fits"] == (run["outcome"] == "ran")
    return f"{said} ({'right' if right else 'WRONG'})"


def table(runs: List[Dict[str, Any]], planned: Dict[str, Dict[str, Any]], markdown: bool) -> str:
    header = ["run", "GPU", "outcome", "plan says", "published (GiB)", "allocated", "reserved", "total",
              "difference", "cause"]
    rows = []
    for run in runs:
        if run["name"] not in planned:
            continue
        mine = planned[run["name"]]
        published = run.get("published")
        shown = "-" if not published else f"{_gib(published['bytes'])} {published['kind']}"
        if run.get("published_allocated_bytes"):
            shown += f"; {_gib(run['published_allocated_bytes'])} allocated"
        rows.append([run["name"], run["gpu"], run["outcome"], verdict(run, mine), shown,
                     _gib(mine["allocator_allocated_peak_bytes"]), _gib(mine["reserved_peak_bytes"]),
                     _gib(mine["device_total_bytes"]), difference(run, mine), run.get("cause", "")])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths))]
    lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="TEXT", help="plan only the runs whose name holds TEXT")
    parser.add_argument("--record", action="store_true", help="write the planned figures into runs.json")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    runs = load_runs()
    planned: Dict[str, Dict[str, Any]] = {}
    for run in runs:
        if args.only and args.only not in run["name"]:
            continue
        planned[run["name"]] = plan_run(run)
        print(f"planned {run['name']}", file=sys.stderr, flush=True)
    print(table(runs, planned, args.markdown))
    wrong = [name for name, mine in planned.items()
             if mine["fits"] != (next(r for r in runs if r["name"] == name)["outcome"] == "ran")]
    print(f"\n{len(planned)} runs planned; fits? wrong for {len(wrong)}{': ' + ', '.join(wrong) if wrong else ''}")
    if args.record:
        for run in runs:
            if run["name"] in planned:
                run["planned"] = planned[run["name"]]
        with open(RUNS, "w", encoding="utf-8") as handle:
            json.dump(runs, handle, indent=1)
            handle.write("\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
