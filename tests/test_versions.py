"""The declared version bounds are the ones the compatibility pass tests, and the skip markers
other tests use read the installed versions right."""

from __future__ import annotations

import configparser
import os
import re
from typing import Dict

import torch
import transformers

from helpers import installed_version, requires_torch, requires_version

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins(path: str) -> Dict[str, str]:
    with open(path, encoding="utf-8") as handle:
        lines = [line.split("#")[0].strip() for line in handle]
    return dict(line.split("==") for line in lines if line)


def _lower_bounds() -> Dict[str, str]:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    bounds = {}
    for line in config["options"]["install_requires"].splitlines():
        if line.strip():
            name, bound = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", line.strip()).groups()
            bounds[name] = bound
    return bounds


def test_the_compatibility_pass_pins_exactly_the_declared_lower_bounds():
    pins = _pins(os.path.join(REPO_ROOT, ".ci", "oldest-constraints.txt"))
    bounds = _lower_bounds()
    assert bounds == {"torch": "2.6", "transformers": "4.57.1", "accelerate": "1.10", "rich": "13"}
    for name, bound in bounds.items():  # 2.6 is pinned as 2.6.0: the same release
        assert pins[name].split(".") == (bound.split(".") + ["0", "0"])[: len(pins[name].split("."))]
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    assert config["options"]["python_requires"] == ">=3.10"


def test_installed_versions_satisfy_the_declared_bounds():
    for name, bound in _lower_bounds().items():
        assert installed_version(name) >= tuple(int(part) for part in bound.split("."))


def test_installed_version_reads_the_release_numbers():
    # torch.__version__ carries a local build tag (2.13.0+cpu); the numbers are what compare.
    assert installed_version("torch") == tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:3])
    assert installed_version("transformers")[:2] == tuple(int(part) for part in transformers.__version__.split(".")[:2])
    assert installed_version("no-such-distribution-here") is None


def test_a_version_marker_skips_below_its_minimum_and_says_why():
    running = ".".join(map(str, installed_version("torch")))
    newer = requires_torch("999.0", "a release from the future")
    assert newer.args == (True,)
    assert newer.kwargs["reason"] == f"needs torch>=999.0 (a release from the future); installed: {running}"
    assert requires_torch(running, "this very release").args == (False,)
    missing = requires_version("no-such-distribution-here", "1.0", "anything")
    assert missing.args == (True,) and missing.kwargs["reason"].endswith("installed: none")



def test_the_extras_bitsandbytes_floor_is_the_release_the_compatibility_pass_installs():
    # 0.46.0 to 0.49.0 (each .0 release tried) cannot plan a 4-bit layer under fake tensors, nor step an 8-bit optimizer on the
    # CPU: the floor is the first release that does both, and the oldest pass installs exactly it.
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    floors = {extra: re.search(r"^bitsandbytes>=([0-9.]+)$", text.strip(), flags=re.MULTILINE)
              for extra, text in config["options.extras_require"].items() if "bitsandbytes" in text}
    assert sorted(floors) == ["examples", "optimizers", "test"]
    assert {match.group(1) for match in floors.values()} == {"0.50"}
    assert _pins(os.path.join(REPO_ROOT, ".ci", "oldest-constraints.txt"))["bitsandbytes"] == "0.50.0"
