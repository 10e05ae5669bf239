"""The step plan against published GPU runs (tests/data/published/runs.json, the table on the
guide's page "Against published runs"): never "fits" for a run that ran out of memory, never "does
not fit" for one that ran, and the planned figures recorded there by `benchmarks/published_runs.py
--record`."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS_FILE = os.path.join(ROOT, "tests", "data", "published", "runs.json")


def _runs():
    with open(RUNS_FILE, encoding="utf-8") as handle:
        return json.load(handle)


def _benchmark():
    spec = importlib.util.spec_from_file_location("published_runs", os.path.join(ROOT, "benchmarks", "published_runs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_run_has_its_source_settings_config_and_a_right_recorded_verdict():
    runs = _runs()
    assert len(runs) == 21
    assert sum(run["outcome"] == "out of memory" for run in runs) == 3
    for run in runs:
        assert run["url"].startswith("https://") and run["quote"] and run["settings"]
        assert os.path.isfile(os.path.join(ROOT, run["argv"][0], "config.json")), run["name"]
        assert run["planned"]["fits"] is (run["outcome"] == "ran"), run["name"]


@pytest.fixture(scope="module")
def one_trace_per_step():
    """The runs' plans inside one `sharing_traces` block, as `--fit`'s proposals are planned: the
    guide's BERT-large rows that differ by their optimizer alone step it from one trace (the same
    timeline as a trace of their own, to the event: tests/plan/test_trace_sharing.py)."""
    from trainer_memcb.plan.step.trace import sharing_traces

    with sharing_traces():
        yield


@pytest.mark.slow  # 21 step plans, 7B and 70B among them: about 10 minutes on 2 cores
@pytest.mark.usefixtures("one_trace_per_step")
@pytest.mark.parametrize("run", _runs(), ids=lambda run: run["name"])
def test_the_plan_of_each_published_run(run):
    planned = _benchmark().plan_run(run)
    assert planned["fits"] is (run["outcome"] == "ran")
    assert planned == run["planned"]
