"""Ctrl-C in the `trainer-memcb` process: one line and exit 130, at any moment, never a traceback.

The command spends seconds importing torch and transformers, and imports more while it answers.
A `KeyboardInterrupt` raised inside a library's import can be swallowed by the library (the
command then carries on), or leave a module half made, which fails later in a way that has
nothing to do with Ctrl-C (a `RecursionError` in numpy's lazy attributes, seen here). So in the
command's own process the interrupt is not raised at all: a SIGINT handler, installed before the
first heavy import, writes the line to the stderr the process started with (the command may have
pointed file descriptor 2 elsewhere to hide other libraries' chatter) and ends the process with
`os._exit(130)` (128 + SIGINT, as shells report it). Nothing half-printed follows: stdout's buffer
is dropped. Python code that imports `trainer_memcb.cli` (and calls `main`) keeps Python's own
`KeyboardInterrupt`, which `main` answers with the same line.

Before this module runs, the interpreter's own start-up (tens of milliseconds) answers Ctrl-C
with Python's default traceback; nothing of the package has run yet.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

__all__ = ["this_process_is_the_command", "stop_on_ctrl_c"]

_PROGRAM = "trainer-memcb"
_EXIT_INTERRUPTED = 130  # 128 + SIGINT
_LINE = f"{_PROGRAM}: interrupted\n".encode()


def this_process_is_the_command() -> bool:
    """Whether the running program is `trainer-memcb` itself: its console script (named after it)
    or `python -m trainer_memcb`, rather than Python code that imports the package."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) == f"{__name__.split('.')[0]}.__main__":
        return True
    script = os.path.basename(getattr(main, "__file__", None) or "")
    return script.split(".")[0].removesuffix("-script") == _PROGRAM


def stop_on_ctrl_c() -> bool:
    """In the command's own process, make Ctrl-C print one line and exit 130 at once; elsewhere
    do nothing. Returns whether the handler was installed."""
    if not this_process_is_the_command():
        return False
    try:
        stderr = os.dup(2)  # the terminal (or file) stderr is now, kept while the command runs
    except OSError:
        stderr = None

    def stop(signum: int, frame: Any) -> None:
        if stderr is not None:
            try:
                os.write(stderr, _LINE)
            except OSError:
                pass
        os._exit(_EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, stop)
    return True
