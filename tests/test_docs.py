"""Every example in README.md and the guide (docs/*.md) runs as written.

The convention the pages follow, and this file enforces:

- a ```python block runs; the blocks of one page run in order, in one namespace, so a later block
  uses what an earlier one made;
- a ```console block holds `$ command` lines, each run as a real subprocess from the repository
  root: `trainer-memcb` is the installed console script (found beside `sys.executable`), `python`
  is `sys.executable`; leading `NAME=value` words set the environment; a line ending in `\\`
  continues on the next. The lines after a command, up to the next `$ `, are its output, compared
  with what it prints (stdout and stderr, as a terminal shows them). A command must exit 0, or the
  status its line ends with (`$ trainer-memcb report output/none  # exit 1`);
- a ```text block is output: of the block right before it (what a python block prints, or the
  last command of a console block), compared the same way; a text block that is not the output of
  the block before it is marked `<!-- not run: illustrative: reason -->`;
- output is compared line by line, exactly, after one normalisation: trailing spaces and the
  blank lines at either end are dropped. A line `...` alone stands for any number of lines (the
  output shown in part), and `<seconds>` in a line stands for a decimal number (a duration or a
  time per step, which differ from run to run); nothing else varies;
- `<!-- not run: reason -->` on the line right before a block skips it, with its reason;
- a block in any other language, unmarked, fails the page, so that nothing slips through unrun.

Each page runs in a process of its own (`python tests/test_docs.py PAGE` runs one by hand, and
with `--show` prints what each command printed, to refresh a page's output), so what a page
registers or configures (an estimate rule, logging) stays there. Everything is
offline: the hub is switched off for the page's process and its commands.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
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
    return [(line, command) for line, command, _ in console_commands_and_outputs(block)]


def console_commands_and_outputs(block: Block) -> List[Tuple[int, str, str]]:
    """The `$ ` commands of a console block, with their lines and the output shown under each."""
    commands: List[Tuple[int, str, str]] = []
    lines = block.code.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("$ "):
            start, command = index, line[2:]
            while command.endswith("\\") and index + 1 < len(lines):
                index += 1
                command = command[:-1] + " " + lines[index].strip()
            output = []
            while index + 1 < len(lines) and not lines[index + 1].startswith("$ "):
                index += 1
                output.append(lines[index])
            commands.append((block.line + start, command, "\n".join(output)))
        index += 1
    return commands


SECONDS = "<seconds>"
ANY_LINES = "..."


def _normalised_lines(text: str) -> List[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_pattern(shown: str) -> "re.Pattern[str]":
    return re.compile("".join(r"\d+(?:\.\d+)?" if part == SECONDS else re.escape(part)
                              for part in re.split(f"({re.escape(SECONDS)})", shown)) + r"\Z")


def output_differs(shown: str, printed: str) -> Optional[str]:
    """None when `printed` is the output `shown` on a page (the normalisation of the header), else
    the first line that differs, said."""
    want, got = _normalised_lines(shown), _normalised_lines(printed)

    def match(i: int, j: int) -> Optional[str]:
        while i < len(want):
            if want[i] == ANY_LINES:
                if i + 1 == len(want):
                    return None
                for k in range(j, len(got) + 1):
                    if match(i + 1, k) is None:
                        return None
                return f"after `...`, nothing matches {want[i + 1]!r}"
            if j >= len(got):
                return f"the output ends where the page shows {want[i]!r}"
            if not _line_pattern(want[i]).match(got[j]):
                return f"the page shows {want[i]!r}\n      the command prints {got[j]!r}"
            i, j = i + 1, j + 1
        return None if j == len(got) else f"the command prints more: {got[j]!r}"

    return match(0, 0)


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
    ran = {"python": 0, "console": 0, "skipped": 0, "outputs compared": 0}
    # What the block before printed, for a text block that shows it; None after one that did not run.
    printed: Optional[str] = None
    for block in blocks:
        if block.not_run is not None:
            ran["skipped"] += 1
            printed = None
            continue
        if block.lang == "text":
            if printed is None:
                print(f"{name}:{block.line - 1}: a ```text block that is not the output of a block run right "
                      "before it: move it under its block, or mark it <!-- not run: illustrative: reason -->")
                return 1
            difference = output_differs(block.code, printed)
            if difference is not None:
                print(f"{name}:{block.line - 1}: the ```text block is not what the block before printed: "
                      f"{difference}\n--- printed\n{printed[-4000:]}")
                return 1
            ran["outputs compared"] += 1
            printed = None
        elif block.lang == "python":
            captured = io.StringIO()
            # Padded so that a traceback names the page's own line numbers.
            with contextlib.redirect_stdout(captured):
                exec(compile("\n" * (block.line - 1) + block.code, str(path), "exec"), namespace)
            printed = captured.getvalue()
            if show:
                print(f"{name}:{block.line}: python\n{printed}")
            ran["python"] += 1
        elif block.lang == "console":
            commands = console_commands_and_outputs(block)
            if not commands:
                print(f"{name}:{block.line - 1}: a console block without a `$ ` command: use ```text for output")
                return 1
            for line, command, shown in commands:
                argv, env, expected = command_argv(command)
                started = time.monotonic()
                # One stream, unbuffered: the order a terminal shows.
                result = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        timeout=COMMAND_TIMEOUT_S)
                printed = result.stdout
                if show:
                    print(f"{name}:{line}: $ {command}  [{time.monotonic() - started:.1f} s]\n{printed}")
                if result.returncode != expected:
                    print(f"{name}:{line}: `{command}` exited {result.returncode}, not {expected}\n"
                          f"--- output\n{printed[-8000:]}")
                    return 1
                if shown.strip():
                    difference = output_differs(shown, printed)
                    if difference is not None:
                        print(f"{name}:{line}: `{command}` does not print what the page shows: {difference}\n"
                              f"--- printed\n{printed[-4000:]}")
                        return 1
                    ran["outputs compared"] += 1
            ran["console"] += 1
    print(f"{name}: ran {ran['python']} python and {ran['console']} console blocks; skipped {ran['skipped']}; "
          f"compared {ran['outputs compared']} outputs")
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


@pytest.mark.slow  # the pages' commands take from seconds to minutes each (will-it-fit.md: the longest)
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


def test_the_guides_stylesheet_is_listed_and_widens_the_content_and_frees_the_first_entry() -> None:
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    listed = re.findall(r"^extra_css:\n((?:  - .+\n)+)", config, flags=re.MULTILINE)
    assert [line.strip()[2:] for line in listed[0].splitlines()] == ["stylesheets/extra.css"]
    stylesheet = (REPO / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    # The two rules the screenshots called for (the stylesheet says why): the grid's width, and the
    # navigation's repeated title hidden where the sidebar is shown.
    assert re.search(r"\.md-grid \{\s*max-width: 100rem;\s*\}", stylesheet)
    assert re.search(r"@media screen and \(min-width: 76\.25em\) \{\s*\.md-nav--primary > \.md-nav__title \{"
                     r"\s*display: none;", stylesheet)


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
    for extra, then in (("examples", "python examples/compare_optimizers.py"), ("test", 'python -m pytest -q -m "not slow" -n auto --dist loadfile')):
        command = (f'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && '
                   f'pip install -e ".[{extra}]" && {then}')
        assert f"```bash\n{command}\n```" in readme


@pytest.mark.parametrize("page,packages", [("docs/peft.md", {"peft", "bitsandbytes"}), ("docs/trl.md", {"trl"})])
def test_a_page_that_needs_an_optional_package_names_the_extra_that_installs_it(page: str, packages: set) -> None:
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg", encoding="utf-8")
    extras = {name: {re.split(r"[<>=!~\[;\s]", line.strip())[0] for line in value.splitlines()
                     if line.strip() and not line.strip().startswith("#")}
              for name, value in setup["options.extras_require"].items()}
    text = (REPO / page).read_text(encoding="utf-8")
    named = {extra for group in re.findall(r'pip install -e "\.\[([\w,-]+)\]"', text) for extra in group.split(",")}
    assert named <= set(extras), named - set(extras)
    assert packages <= set().union(*(extras[extra] for extra in named)), (page, named)


def test_no_page_promises_a_few_seconds() -> None:
    """A wait is given as measured (the demo's short runs took 30-40 s where "a few seconds" was
    promised), so that a reader knows whether it hangs."""
    promising = [page.name for page in PAGES if "a few seconds" in page.read_text(encoding="utf-8")]
    assert promising == []


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


def test_output_is_compared_exactly_but_for_trailing_spaces_seconds_and_elisions() -> None:
    printed = "Model: tiny\n  adamw  3,636,400   0.035  \n  adafactor  37,296   0.042\n\n"
    assert output_differs("Model: tiny\n  adamw  3,636,400   <seconds>\n  adafactor  37,296   <seconds>", printed) is None
    assert output_differs("\nModel: tiny\n...\n", printed) is None
    assert output_differs("...\n  adafactor  37,296   <seconds>", printed) is None
    assert output_differs("Model: tiny\n  adamw  3,636,400   <seconds>", printed) == (
        "the command prints more: '  adafactor  37,296   0.042'")
    assert output_differs("Model: tiny\n  adamw  3,636,401   <seconds>", printed) == (
        "the page shows '  adamw  3,636,401   <seconds>'\n      the command prints '  adamw  3,636,400   0.035'")
    assert output_differs("Model: tiny\n  adamw  3,636,400   0.036\n...", printed) is not None  # only <seconds> varies
    assert output_differs("Model: tiny\n...\nRows: x", printed) == "after `...`, nothing matches 'Rows: x'"
    assert output_differs("Model: tiny\nmore", "Model: tiny\n") == "the output ends where the page shows 'more'"


def test_console_outputs_are_the_lines_under_each_command() -> None:
    block = parse_blocks("```console\n$ python -c 'print(1)' \\\n    --flag\n1\n\n$ python -V  # exit 1\n```\n")[0]
    assert console_commands_and_outputs(block) == [(2, "python -c 'print(1)'  --flag", "1\n"),
                                                   (6, "python -V  # exit 1", "")]


def test_a_failing_example_fails_its_page(tmp_path: Path) -> None:
    """The runner itself, on pages made to fail: a wrong exit status, a raising block."""
    cases = {
        "status.md": ("```console\n$ python -c 'import sys; sys.exit(3)'\n```\n", "exited 3, not 0"),
        "raises.md": ("```python\nx = 1\n```\n\n```python\nassert x == 2\n```\n", "line 6"),
        "unmarked.md": ("```bash\nls\n```\n", "a ```bash block that does not run"),
        "console-output.md": ("```console\n$ python -c 'print(2)'\n1\n```\n",
                              "does not print what the page shows: the page shows '1'"),
        "text-output.md": ("```python\nprint(2)\n```\n\n```text\n1\n```\n",
                           "the ```text block is not what the block before printed"),
        "text-alone.md": ("Some prose.\n\n```text\n1\n```\n", "a ```text block that is not the output"),
    }
    for file_name, (text, message) in cases.items():
        (tmp_path / file_name).write_text(text, encoding="utf-8")
        result = subprocess.run([sys.executable, __file__, str(tmp_path / file_name)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and message in result.stdout + result.stderr, (file_name, result)
    (tmp_path / "passes.md").write_text(
        "```console\n$ python -c 'import sys; sys.exit(3)'  # exit 3\n```\n\n"
        "```console\n$ python -c 'import sys; print(1); print(2, file=sys.stderr); print(3)'\n1\n2\n3\n```\n\n"
        "```python\nprint('x  ')\n```\n\n```text\nx\n```\n\n"
        "<!-- not run: illustrative: a shape, not an output -->\n```text\nanything\n```\n",
        encoding="utf-8")
    result = subprocess.run([sys.executable, __file__, str(tmp_path / "passes.md")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ran 1 python and 2 console blocks; skipped 1; compared 2 outputs" in result.stdout


if __name__ == "__main__":
    sys.exit(run_page(Path(sys.argv[1]).resolve(), show="--show" in sys.argv[2:]))
