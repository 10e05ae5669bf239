"""What the command is doing while it works: one live line on the terminal, never in the output.

An estimate imports torch and transformers, builds the model, and traces steps: seconds to a
minute with nothing to read. While `showing_progress()` is active, `say_progress(text)` names the
phase (`tracing the step at batch 8`) on one line of stderr, with a spinner and the seconds spent,
erased when the command ends. Only when stderr is a terminal: piped, redirected, or under `--json`
into a file, not one byte is written, and stdout is never touched.

The line is written to a copy of file descriptor 2 taken on entry, so that it stays visible while
the command sends the libraries' import chatter on descriptor 2 to a sink (`quiet.py`). The cursor
is left visible: a Ctrl-C ends the process at once (`interrupt.py`), with no chance to show it again.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, List, Optional

__all__ = ["showing_progress", "say_progress"]

# The live display of the command running now, if any.
_active: List[Any] = []


def say_progress(text: str) -> None:
    """Name the phase the command is in (shown only inside `showing_progress`, on a terminal)."""
    if _active:
        progress, task = _active[-1]
        progress.update(task, description=text)
        progress.refresh()  # drawn now, so that no phase passes unseen between two refreshes


def _terminal_stderr() -> Optional[Any]:
    """A text stream on a copy of stderr's descriptor when that is a terminal, else None."""
    try:
        descriptor = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stream (a test's capture)
        return None
    if not os.isatty(descriptor):
        return None
    return os.fdopen(os.dup(descriptor), "w", encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                     errors="replace")


@contextlib.contextmanager
def showing_progress(text: str, enabled: bool = True) -> Iterator[None]:
    """While inside, a live line on a terminal's stderr naming the phase (`say_progress`).

    Args:
        text: the first phase's name.
        enabled: False shows nothing (as when stderr is not a terminal).

    Examples:
        >>> with showing_progress("building the model"):  # stderr is no terminal here: nothing shown
        ...     say_progress("tracing the step at batch 1")
    """
    stream = _terminal_stderr() if enabled else None
    if stream is None:
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    class _KeepCursor(Console):
        def show_cursor(self, show: bool = True) -> bool:  # a Ctrl-C could not show it again
            return False

    progress = Progress(SpinnerColumn(), TextColumn("[progress.description]{task.description}"), TimeElapsedColumn(),
                        console=_KeepCursor(file=stream), transient=True, redirect_stdout=False,
                        redirect_stderr=False, refresh_per_second=8)
    task = progress.add_task(text, total=None)
    _active.append((progress, task))
    progress.start()
    try:
        yield
    finally:
        _active.pop()
        progress.stop()
        stream.close()
