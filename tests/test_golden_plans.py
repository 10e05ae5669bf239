"""The golden plans (`tests/golden_plans.py`): every recorded `estimate --json` command gives the
same exit code and the same document, to the byte, on the releases they were recorded on."""

from __future__ import annotations

from typing import Any

import pytest

import golden_plans

GOLDEN = golden_plans.recorded()


def test_the_golden_plans_cover_every_kind_of_plan():
    flags = {flag for entry in GOLDEN["plans"].values() for flag in entry["argv"] if flag.startswith("--")}
    assert {"--zero", "--sharding", "--lora-r", "--load-in-4bit", "--eval-samples", "--fit", "--max-batch-size",
            "--alloc-conf", "--training-args", "--precision", "--device-type", "--gradient-accumulation-steps"} <= flags
    assert set(GOLDEN["plans"]) == set(golden_plans.COMMANDS)
    assert len(GOLDEN["plans"]) == 25


@pytest.mark.slow  # 25 plans, a 7B among them: a minute or two
@pytest.mark.parametrize("name", sorted(GOLDEN["plans"]))
def test_a_golden_plan_is_unchanged(name: str, capsys: Any):
    if golden_plans.versions() != GOLDEN["versions"]:
        pytest.skip(f"recorded on {GOLDEN['versions']}, these are {golden_plans.versions()}")
    entry = GOLDEN["plans"][name]
    assert entry["argv"] == golden_plans.COMMANDS[name]
    code, document = golden_plans.run(entry["argv"])
    assert code == entry["exit"]
    assert document == entry["json"]
