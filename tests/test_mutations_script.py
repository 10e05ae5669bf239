"""The mutation check (`benchmarks/mutations.py`) keeps working: its edit list applies to the code
as it is, and one edit it makes is caught by the tests it names, in a copy of the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "mutations.py")
# A fast one: a tiny plan, no training. `fits` must hold at a margin of exactly 0.
EDIT = "plan/answers/model_states.py#1"


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)


def test_list_names_every_edit_and_its_tests_and_finds_each_text_once():
    listed = run_script("--list")
    assert listed.returncode == 0, listed.stdout + listed.stderr  # 2 if an edit's text is not found exactly once
    names = re.findall(r"^(\S+\.py#\d+): ", listed.stdout, re.MULTILINE)
    assert len(names) >= 40 and len(set(names)) == len(names)
    assert f"{EDIT}: fits = margin >= 0 -> fits = margin > 0" in listed.stdout
    assert listed.stdout.count("    tests: ") == len(names)


@pytest.mark.slow
def test_one_edit_is_killed_in_a_copy_and_the_working_tree_is_untouched():
    path = os.path.join(REPO_ROOT, "trainer_memcb", "plan", "answers", "model_states.py")
    with open(path, encoding="utf-8") as handle:
        before = handle.read()
    ran = subprocess.run(
        [sys.executable, SCRIPT, "--edit", EDIT, "--no-baseline"], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert re.search(rf"^{re.escape(EDIT)}\s+fits = margin >= 0 -> fits = margin > 0\s+killed\s+\d+\.\d$",
                     ran.stdout, re.MULTILINE), ran.stdout
    assert "kill rate: 1/1 = 100.0%" in ran.stdout
    with open(path, encoding="utf-8") as handle:
        assert handle.read() == before


def test_bad_arguments_are_refused_with_exit_2():
    assert run_script("--edit", "plan/answers/model_states.py#999").returncode == 2
    assert run_script("--jobs", "0").returncode == 2
