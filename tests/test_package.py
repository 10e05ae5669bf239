"""The package as users get it: the wheel and the sdist built with `python -m build` from a clean
copy of the source, and what they hold."""

from __future__ import annotations

import ast
import configparser
import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from typing import List

import pytest

import trainer_memcb

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not shipped in the sdist: the CI script and git's own file.
NOT_IN_SDIST = (".ci/", ".gitignore")
# Left out of the clean copy when the source is not a git checkout (an unpacked sdist, say).
BUILD_LEFTOVERS = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".pytest_cache", ".git")


def _source_files() -> List[str]:
    """The files a release is made of: what git tracks or would (not ignored), or every file of an
    unpacked sdist."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False)
    if listed.returncode == 0 and listed.stdout:
        return sorted(name for name in listed.stdout.decode().split("\0")
                      if name and os.path.isfile(os.path.join(REPO_ROOT, name)))
    # Not a git checkout: the tree as it is, less what builds and test runs leave behind.
    files = []
    for folder, subfolders, names in os.walk(REPO_ROOT):
        ignored = BUILD_LEFTOVERS(folder, subfolders + names)
        subfolders[:] = [name for name in subfolders if name not in ignored]
        files += [os.path.relpath(os.path.join(folder, name), REPO_ROOT) for name in names if name not in ignored]
    return sorted(files)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source files, sdist path, wheel path), built once for the module from a clean copy, so that
    nothing untracked or left by earlier runs gets in and nothing is written into the repo."""
    root = tmp_path_factory.mktemp("package")
    files = _source_files()
    source = root / "source"
    for name in files:
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO_ROOT, name), target)
    out = root / "dist"
    # --no-isolation: offline, with the setuptools the test extra installs (>= 70.1 builds wheels
    # without the `wheel` package).
    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(out), str(source)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stdout.decode()[-3000:]
    version = trainer_memcb.__version__
    sdist = out / f"trainer_memcb-{version}.tar.gz"
    wheel = out / f"trainer_memcb-{version}-py3-none-any.whl"
    assert sorted(os.listdir(out)) == sorted([sdist.name, wheel.name])
    return files, sdist, wheel


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    return config


def _lines(value: str) -> List[str]:
    return [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_sdist_holds_every_source_file_so_its_tests_run(built):
    files, sdist, _ = built
    prefix = f"trainer_memcb-{trainer_memcb.__version__}/"
    with tarfile.open(sdist) as archive:
        names = {member.name[len(prefix):] for member in archive.getmembers() if member.isfile()}
    expected = {name for name in files if not name.startswith(NOT_IN_SDIST)}
    assert sorted(expected - names) == []
    # The pieces the suite cannot run without, named so a MANIFEST.in change that drops them shows.
    for needed in ("LICENSE", "README.md", "setup.cfg", "setup.py", "tests/conftest.py", "tests/helpers.py",
                   "tests/dist_scripts/ddp_trainer.py", "examples/data/reviews/train.csv",
                   "examples/models/tiny-distilbert/config.json", "benchmarks/overhead.py",
                   "mkdocs.yml", "docs/index.md", "docs/tensorboard_custom_scalars.png"):
        assert needed in names
    # Only setuptools' own additions beyond the source: PKG-INFO and the egg-info (a source that is
    # itself an unpacked sdist has PKG-INFO already).
    extra = {name for name in names - expected if not name.startswith("trainer_memcb.egg-info/")}
    assert extra == {"PKG-INFO"} - expected
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_the_wheel_holds_the_package_alone_with_its_license_and_metadata(built):
    files, _, wheel = built
    version = trainer_memcb.__version__
    info = f"trainer_memcb-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = email.parser.Parser().parsestr(archive.read(info + "METADATA").decode())
        entry_points = archive.read(info + "entry_points.txt").decode()
        license_names = [name for name in names if name.startswith(info) and name.endswith("LICENSE")]
        assert len(license_names) == 1
        with open(os.path.join(REPO_ROOT, "LICENSE"), "rb") as handle:
            assert archive.read(license_names[0]) == handle.read()
    package = {name for name in files if name.startswith("trainer_memcb/")}
    assert package == {name for name in names if not name.startswith(info)}
    assert "trainer_memcb/py.typed" in package

    config = _setup_cfg()
    assert metadata["Name"] == "trainer_memcb" and metadata["Version"] == version
    assert metadata["Requires-Python"] == config["options"]["python_requires"] == ">=3.10"
    # Requires-Dist: exactly install_requires, then each extra's list under its marker.
    required = sorted(metadata.get_all("Requires-Dist"))
    expected = sorted(_lines(config["options"]["install_requires"]) + [
        f'{requirement}; extra == "{extra}"'
        for extra, value in config["options.extras_require"].items() for requirement in _lines(value)])
    assert required == expected
    assert metadata["Description-Content-Type"] == "text/markdown"
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as handle:
        assert metadata.get_payload().strip() == handle.read().strip()
    classifiers = metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.10" in classifiers and "Typing :: Typed" in classifiers
    assert "trainer-memcb = trainer_memcb.cli:console_main" in entry_points


def test_install_requires_is_what_the_package_imports():
    """Each distribution of install_requires is imported by trainer_memcb (accelerate, which
    transformers' TrainingArguments needs too, by the context-parallel plan, for its own hooks); the
    examples' and the tests' own needs (datasets, evaluate) stay in the extras."""
    config = _setup_cfg()
    names = {requirement.split(">")[0].split("=")[0].split("<")[0].strip()
             for requirement in _lines(config["options"]["install_requires"])}
    assert names == {"torch", "transformers", "accelerate", "rich"}
    for extra in ("examples", "test"):
        extra_names = {requirement.split(">")[0].strip()
                       for requirement in _lines(config["options.extras_require"][extra])}
        assert {"datasets", "evaluate"} <= extra_names
    imported = set()
    package_dir = os.path.join(REPO_ROOT, "trainer_memcb")
    for folder, _, names_here in os.walk(package_dir):
        for name in names_here:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as handle:
                    for line in handle:
                        words = line.split()
                        if len(words) >= 2 and words[0] in ("import", "from"):
                            imported.add(words[1].split(".")[0])
    assert {"torch", "transformers", "rich", "accelerate"} <= imported
    assert not {"datasets", "evaluate"} & imported


def test_the_examples_extra_brings_what_the_examples_import_and_every_named_extra_exists():
    """`pip install -e ".[examples]"` is enough for examples/ (beyond what torch and transformers
    bring), and each `trainer_memcb[extra]` the guide, the README or a message names is declared."""
    import re

    config = _setup_cfg()
    extras = {extra: {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()
                      for requirement in _lines(value)}
              for extra, value in config["options.extras_require"].items()}
    assert extras["peft"] == {"peft"}
    # Import name -> distribution, for the examples' third-party imports; numpy, tokenizers and
    # huggingface_hub come with transformers, accelerate is install_requires.
    distributions = {"datasets": "datasets", "evaluate": "evaluate", "sklearn": "scikit-learn",
                     "bitsandbytes": "bitsandbytes", "tensorboard": "tensorboard"}
    provided = {"torch", "transformers", "accelerate", "numpy", "tokenizers", "huggingface_hub", "trainer_memcb",
                "text_classification",
                "train_with_trainer", "make_reviews"}
    imported = set()
    for folder, _, names in os.walk(os.path.join(REPO_ROOT, "examples")):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as handle:
                    tree = ast.parse(handle.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        imported |= {alias.name.split(".")[0] for alias in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name not in provided}
    assert third_party <= set(distributions), third_party - set(distributions)
    # torch.utils.tensorboard's SummaryWriter, which the examples give the reporter, needs tensorboard.
    assert {distributions[name] for name in third_party} | {"tensorboard"} <= extras["examples"]
    named = set()
    for path in [os.path.join(REPO_ROOT, "README.md")] + [
            os.path.join(folder, name) for root in ("docs", "trainer_memcb")
            for folder, _, names in os.walk(os.path.join(REPO_ROOT, root)) for name in names
            if name.endswith((".md", ".py"))]:
        with open(path, encoding="utf-8") as handle:
            named |= set(re.findall(r"trainer_memcb\[(\w+)\]", handle.read()))
    assert named and named <= set(extras), named - set(extras)
