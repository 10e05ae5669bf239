"""Every example in README.md and the guide (docs/*.md) runs as written.

The convention the pages follow, and this file enforces:

- a ```python block runs; the blocks of one page run in order, in one namespace, so a later block
  uses what an earlier one made;
- a ```console block holds `$ command` lines, each run as a real subprocess from the repository
  root: `trainer-memcb` is the installed console script (found beside `sys.executable`), `python`
  is `sys.executable`; leading `NAME=value` words set the environment; a line ending in `\\`
  continues on the next. The lines without `$ ` are output, not compared. A command must exit 0,
  or the status its line ends with (`$ trainer-memcb report output/none  # exit 1`);
- a ```text block is output and does not run;
- `<!-- not run: reason -->` on the line right before a block skips it, with its reason;
- a block in any other language, unmarked, fails the page, so that nothing slips through unrun.

Each page runs in a process of its own (`python tests/test_docs.py PAGE` runs one by hand, and
with `--show` prints what each command printed, to refresh a page's output), so what a page
registers or configures (an estimate rule, logging) stays there. Everything is
offline: the hub is switched off for the page's process and its commands.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
LANGUAGES = ("python", "console", "text")  # run, run, output; any other needs a not-run marker
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
COMMAND_TIMEOUT_S = 600  # one command; the slowest, an estimate over Llama-2-7B, takes seconds
PAGE_TIMEOUT_S = 1200

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
EXPECTED_EXIT = re.compile(r"\s+#\s*exit\s+(?P<status>\d+)\s*$")


@dataclass
class Block:
    lang: str
    code: str  # dedented to the fence
    line: int  # 1-based line of the first line of code
    not_run: Optional[str]  # the reason, when marked


def parse_blocks(text: str, name: str = "page") -> List[Block]:
    """The fenced blocks of a Markdown page, in order, with their not-run markers."""
    lines = text.splitlines()
    blocks: List[Block] = []
    index = 0
    while index < len(lines):
        marker = NOT_RUN.match(lines[index])
        opening = FENCE.match(lines[index])
        if marker and not (index + 1 < len(lines) and FENCE.match(lines[index + 1])):
            raise ValueError(f"{name}:{index + 1}: a not-run marker must be right before a block")
        if marker and not marker.group("reason"):
            raise ValueError(f"{name}:{index + 1}: a not-run marker must say why")
        if not opening:
            index += 1
            continue
        indent, lang = opening.group("indent"), opening.group("lang")
        end = index + 1
        while end < len(lines) and lines[end].rstrip() != indent + "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{name}:{index + 1}: a block that is never closed")
        previous = NOT_RUN.match(lines[index - 1]) if index > 0 else None
        code = textwrap.dedent("\n".join(lines[index + 1:end])) + "\n"
        blocks.append(Block(lang, code, index + 2, previous.group("reason") if previous else None))
        index = end + 1
    return blocks


def console_commands(block: Block) -> List[Tuple[int, str]]:
    """The `$ ` commands of a console block, with their lines; `\\` continues a command."""
    commands: List[Tuple[int, str]] = []
    lines = block.code.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("$ "):
            start, command = index, line[2:]
            while command.endswith("\\") and index + 1 < len(lines):
                index += 1
                command = command[:-1] + " " + lines[index].strip()
            commands.append((block.line + start, command))
        index += 1
    return commands


def command_argv(command: str) -> Tuple[List[str], Dict[str, str], int]:
    """argv, extra environment and expected exit status of one console command."""
    expected = 0
    match = EXPECTED_EXIT.search(command)
    if match:
        expected, command = int(match.group("status")), command[:match.start()]
    words = shlex.split(command, comments=True)
    env: Dict[str, str] = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words:
        raise ValueError(f"no command in {command!r}")
    bin_dir = Path(sys.executable).parent
    if words[0] == "trainer-memcb":
        script = bin_dir / "trainer-memcb"
        if not script.is_file():
            raise ValueError(f"the console script is not installed beside {sys.executable}: pip install -e .")
        words[0] = str(script)
    elif words[0] == "python":
        words[0] = sys.executable
    else:
        raise ValueError(f"{words[0]!r}: only trainer-memcb and python commands run; "
                         "mark the block <!-- not run: reason --> if it must not")
    return words, env, expected


def check_languages(blocks: List[Block], name: str) -> List[str]:
    return [f"{name}:{block.line - 1}: a ```{block.lang or '(no language)'} block that does not run: "
            f"use one of {', '.join(LANGUAGES)}, or mark it <!-- not run: reason -->"
            for block in blocks if block.not_run is None and block.lang not in LANGUAGES]


def run_page(path: Path, show: bool = False) -> int:
    """Runs one page's examples in this process, in order; prints what failed; 0 when none did."""
    name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    blocks = parse_blocks(path.read_text(encoding="utf-8"), name)
    problems = check_languages(blocks, name)
    if problems:
        print("\n".join(problems))
        return 1
    os.chdir(REPO)
    os.environ.update(OFFLINE)
    namespace: Dict[str, object] = {"__name__": "__docs__"}
    ran = {"python": 0, "console": 0, "skipped": 0}
    for block in blocks:
        if block.not_run is not None:
            ran["skipped"] += 1
            continue
        if block.lang == "python":
            # Padded so that a traceback names the page's own line numbers.
            exec(compile("\n" * (block.line - 1) + block.code, str(path), "exec"), namespace)
            ran["python"] += 1
        elif block.lang == "console":
            commands = console_commands(block)
            if not commands:
                print(f"{name}:{block.line - 1}: a console block without a `$ ` command: use ```text for output")
                return 1
            for line, command in commands:
                argv, env, expected = command_argv(command)
                result = subprocess.run(argv, cwd=REPO, env={**os.environ, **env}, capture_output=True,
                                        text=True, timeout=COMMAND_TIMEOUT_S)
                if show:
                    print(f"{name}:{line}: $ {command}\n{result.stdout}{result.stderr}")
                if result.returncode != expected:
                    print(f"{name}:{line}: `{command}` exited {result.returncode}, not {expected}\n"
                          f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
                    return 1
            ran["console"] += 1
    print(f"{name}: ran {ran['python']} python and {ran['console']} console blocks; skipped {ran['skipped']}")
    return 0


# -- the tests -------------------------------------------------------------------------------------

import pytest  # noqa: E402  (the page runner above needs nothing but the standard library)


# Pages whose examples meet a known bug, each with it; strict, so the page fails once it is fixed
# and the entry must go.
KNOWN_BUGS: Dict[str, str] = {}


def _page_param(page: Path) -> object:
    name = str(page.relative_to(REPO))
    marks = [pytest.mark.xfail(reason=KNOWN_BUGS[name], strict=True)] if name in KNOWN_BUGS else []
    return pytest.param(page, id=name, marks=marks)


@pytest.mark.parametrize("page", [_page_param(page) for page in PAGES])
def test_the_examples_of_the_page_run(page: Path) -> None:
    result = subprocess.run([sys.executable, __file__, str(page)], cwd=REPO, capture_output=True, text=True,
                            timeout=PAGE_TIMEOUT_S)
    if result.returncode != 0:
        pytest.fail(result.stdout[-8000:] + result.stderr[-8000:], pytrace=False)


def test_every_page_is_in_the_guide_nav_and_every_nav_entry_is_a_page() -> None:
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    in_nav = set(re.findall(r"^\s*- [^:\n]+: ([\w-]+\.md)\s*$", config, flags=re.MULTILINE))
    assert in_nav == {page.name for page in (REPO / "docs").glob("*.md")}


def test_the_api_page_documents_each_public_name() -> None:
    import trainer_memcb

    page = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    public = page.split("## The public names", 1)[1].split("\n## ", 1)[0]
    documented = {line.split(".")[-1] for line in public.splitlines() if line.startswith("::: ")}
    assert documented == set(trainer_memcb.__all__) - {"__version__"}
    for name in trainer_memcb.__all__:  # and each is in the list of what is public
        assert f"`{name}`" in page.split("## The public names", 1)[0]


def test_the_readme_is_a_first_read_with_its_two_set_up_commands() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    # Not run here (they make a venv); kept word for word, since people copy them.
    for extra, then in (("examples", "python examples/compare_optimizers.py"), ("test", 'python -m pytest -q -m "not slow"')):
        command = (f'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && '
                   f'pip install -e ".[{extra}]" && {then}')
        assert f"```bash\n{command}\n```" in readme


def test_a_block_in_another_language_fails_unless_marked() -> None:
    page = "Text.\n\n```bash\nls\n```\n\n<!-- not run: why -->\n```bash\nls\n```\n"
    blocks = parse_blocks(page)
    assert [(block.lang, block.line, block.not_run) for block in blocks] == [("bash", 4, None), ("bash", 9, "why")]
    assert check_languages(blocks, "page") == [
        "page:3: a ```bash block that does not run: use one of python, console, text, "
        "or mark it <!-- not run: reason -->"]


def test_markers_must_give_a_reason_and_stand_before_a_block() -> None:
    with pytest.raises(ValueError, match="must say why"):
        parse_blocks("<!-- not run: -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="right before a block"):
        parse_blocks("<!-- not run: because -->\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        parse_blocks("```python\npass\n")


def test_console_commands_are_parsed_as_a_shell_would() -> None:
    block = parse_blocks("```console\n$ HF_HUB_OFFLINE=1 python -c 'print(1)' \\\n    --flag\n1\n"
                         "$ trainer-memcb report output/none  # exit 1\n```\n")[0]
    commands = console_commands(block)
    assert commands == [(2, "HF_HUB_OFFLINE=1 python -c 'print(1)'  --flag"),
                        (5, "trainer-memcb report output/none  # exit 1")]
    argv, env, expected = command_argv(commands[0][1])
    assert (argv, env, expected) == ([sys.executable, "-c", "print(1)", "--flag"], {"HF_HUB_OFFLINE": "1"}, 0)
    argv, env, expected = command_argv(commands[1][1])
    assert (argv[1:], env, expected) == (["report", "output/none"], {}, 1)
    assert argv[0] == str(Path(sys.executable).parent / "trainer-memcb")
    with pytest.raises(ValueError, match="only trainer-memcb and python"):
        command_argv("pip install torch")


def test_a_failing_example_fails_its_page(tmp_path: Path) -> None:
    """The runner itself, on pages made to fail: a wrong exit status, a raising block."""
    cases = {
        "status.md": ("```console\n$ python -c 'import sys; sys.exit(3)'\n```\n", "exited 3, not 0"),
        "raises.md": ("```python\nx = 1\n```\n\n```python\nassert x == 2\n```\n", "line 6"),
        "unmarked.md": ("```bash\nls\n```\n", "a ```bash block that does not run"),
    }
    for file_name, (text, message) in cases.items():
        (tmp_path / file_name).write_text(text, encoding="utf-8")
        result = subprocess.run([sys.executable, __file__, str(tmp_path / file_name)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stdout + result.stderr, (file_name, result)
    (tmp_path / "passes.md").write_text("```console\n$ python -c 'import sys; sys.exit(3)'  # exit 3\n```\n",
                                        encoding="utf-8")
    result = subprocess.run([sys.executable, __file__, str(tmp_path / "passes.md")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ran 0 python and 1 console blocks; skipped 0" in result.stdout


if __name__ == "__main__":
    sys.exit(run_page(Path(sys.argv[1]).resolve(), show="--show" in sys.argv[2:]))
